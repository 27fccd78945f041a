"""Host cost of one decode step per row, without the GPU: the rank's worker loop and the KV engine around a model
whose forward costs (almost) nothing.

    python scripts/bench_hostpath.py [--rows 1 8 32 64] [--steps 200] [--profile 32] [--out FILE]
    python scripts/bench_hostpath.py --prefill [--rows 1 16 25] [--steps 200] [--out FILE]

On a GPU the forward of a small model is one CUDA-graph replay of a few milliseconds; everything else a decode
step does (the walk state machine per request, the engine's bookkeeping, sampling, the emitted tokens'
message) is Python on the thread that feeds the GPU. This measures exactly that part: a real ``Worker`` with the
Llama chat walks (prefill, decode loop) and a real ``KVCacheEngine`` whose model returns constant logits over a
64-token vocabulary, ``rows`` requests decoding together, every control message encoded as it would be sent.
``--lookahead`` runs the decode steps one ahead, as the engine does on CUDA (and claims each row from the step
before). ``--profile N`` adds a cProfile of N rows (the functions where the step's time goes) to the JSON.

``--prefill`` measures instead what the rank spends on a batch of ``rows`` new prompts (44 tokens each) from their
``RunWalk``s to the ``Emits`` with their first tokens and the prefill walks' ends, beside 32 requests that decode:
the host's share of a burst's first tokens, which leave the rank in one message once every row of the batch is
through (``--steps`` batches, a new worker for each).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from models.llama.chat import LlamaChat  # noqa: E402
from mstar_dist.control import messages as m  # noqa: E402
from mstar_dist.engine.kv_cache import StaticKVCache  # noqa: E402
from mstar_dist.engine.kv_engine import KVCacheEngine  # noqa: E402
from mstar_dist.transport.inline import decode_tensor, encode_tensor  # noqa: E402
from mstar_dist.transport.router import Router  # noqa: E402
from mstar_dist.transport.store import TensorStore  # noqa: E402
from mstar_dist.worker.worker import Worker  # noqa: E402

TOKEN = "bench"
VOCAB = 64


class NullModel(torch.nn.Module):
    """Constant logits (token 1 wins) for every row: the forward's cost is gone, its interface is not."""

    pads_are_inert = True

    def forward(self, ids, positions, cache, last_only=False, last_index=None):
        logits = torch.zeros(ids.shape[0], 1, VOCAB)
        logits[:, :, 1] = 1.0
        return logits


class CountingChannel:
    """Encodes like the real channel; keeps the conductor-bound messages' bodies for the harness."""

    def __init__(self):
        self.inbox: list[tuple[str, bytes]] = []
        self.bytes_sent = 0
        self.messages = 0
        self.done: list[m.WalkDone] = []

    def recv(self, timeout_ms=0):
        out, self.inbox = self.inbox, []
        return out

    def send(self, peer, payload):
        self.bytes_sent += len(payload)
        self.messages += 1
        body = m.decode(payload).body if b"WalkDone" in payload else None
        if isinstance(body, m.WalkDone):
            self.done.append(body)
        elif isinstance(body, m.Emits):  # the walks that ended in a step ride in its Emits
            self.done.extend(body.done)


def make_worker(rows: int, lookahead: bool = False) -> tuple[Worker, CountingChannel, KVCacheEngine]:
    cache = StaticKVCache(n_layers=1, n_kv_heads=1, head_dim=8, max_slots=rows, max_seq_len=4096)
    engine = KVCacheEngine("LLM", NullModel(), cache, torch.device("cpu"), lookahead=lookahead)
    channel = CountingChannel()
    router = Router(global_rank=0, rank_hosts={0: "h"}, transports={}, intra_host="p2p", inter_host="p2p",
                    inline_max_bytes=65536, device=torch.device("cpu"))
    graphs = LlamaChat("/unused").graphs()
    worker = Worker(global_rank=0, graphs=graphs, components={"LLM": engine}, channel=channel, transport=router,
                    store=TensorStore(), token=TOKEN, device=torch.device("cpu"), inline_max_bytes=65536)
    return worker, channel, engine


def deliver(worker: Worker, body: m.Message) -> None:
    worker.handle("conductor", m.encode(TOKEN, "conductor", body))


def start_decoding(worker: Worker, channel: CountingChannel, rows: int, limit: int, prefix: str = "r") -> None:
    """``rows`` requests through their prefill walk and into their decode walk (``limit`` steps at most)."""
    for i in range(rows):
        deliver(worker, m.RunWalk(request_id=f"{prefix}{i}", walk="prefill", walk_index=0, seed=i,
                                  inputs={"input_ids": encode_tensor(torch.arange(2, 12))}, sampling=m.Sampling(
                                      temperature=0.0)))
    for _ in range(1000):
        if len(channel.done) >= rows:
            break
        worker._step()
    else:
        raise RuntimeError(f"{rows - len(channel.done)} of {rows} prefill walks did not report their end in 1000 steps")
    for done in channel.done:
        token = decode_tensor(done.outputs["token"])
        deliver(worker, m.RunWalk(request_id=done.request_id, walk="decode", walk_index=1, seed=0,
                                  inputs={"token": encode_tensor(token)}, sampling=m.Sampling(temperature=0.0),
                                  loop_limits={"decode": limit}))
    channel.done.clear()


def run(rows: int, steps: int, profile: bool = False, lookahead: bool = False) -> dict:
    worker, channel, engine = make_worker(rows, lookahead)
    start_decoding(worker, channel, rows, steps + 10)
    for _ in range(5):  # warm
        worker._step()
    prof = cProfile.Profile() if profile else None
    before_steps, before_msgs, before_bytes = engine.steps, channel.messages, channel.bytes_sent
    times = []
    if prof:
        prof.enable()
    for _ in range(steps):
        t0 = time.perf_counter()
        worker._step()
        times.append(time.perf_counter() - t0)
    if prof:
        prof.disable()
    assert engine.steps - before_steps == steps and engine.decode_rows >= steps * rows, "every step decoded every row"
    per_step = statistics.median(times)
    out = {"rows": rows, "step_us_median": per_step * 1e6, "per_row_us": per_step * 1e6 / rows,
           "messages_per_step": (channel.messages - before_msgs) / steps,
           "bytes_per_step": (channel.bytes_sent - before_bytes) / steps}
    if prof:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        out["profile_tottime_top25"] = text.getvalue().splitlines()
    return out


def run_prefill(rows: int, batches: int, decoding: int = 32) -> dict:
    times = []
    for _ in range(batches):
        worker, channel, engine = make_worker(rows + decoding)
        start_decoding(worker, channel, decoding, 10 ** 6, prefix="d")  # the runs a real rank holds beside a burst
        for _ in range(3):  # not on the clock: the decode rows' first steps
            worker._step()
        t0 = time.perf_counter()
        for i in range(rows):
            deliver(worker, m.RunWalk(request_id=f"r{i}", walk="prefill", walk_index=0, seed=i,
                                      inputs={"input_ids": encode_tensor(torch.arange(2, 46))},
                                      sampling=m.Sampling(temperature=0.0)))
        for _ in range(10):
            worker._step()
            if len(channel.done) >= rows:
                break
        else:
            raise RuntimeError(f"{rows - len(channel.done)} of {rows} prefill walks did not end in 10 turns")
        times.append(time.perf_counter() - t0)
        assert engine.decode_rows > 0 and len(worker.runs.by_key) == decoding, "the decode rows ran beside the prompts"
    per = statistics.median(times)
    return {"rows": rows, "decoding": decoding, "batch_us_median": per * 1e6, "per_row_us": per * 1e6 / rows}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--profile", type=int, default=None, help="also profile a run with this many rows")
    p.add_argument("--prefill", action="store_true", help="a batch of new prompts' turn instead of decode steps")
    p.add_argument("--lookahead", action="store_true",
                   help="decode steps run one ahead, as on CUDA (the engine's claim of each row; off on a CPU)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.prefill:
        results = [run_prefill(n, args.steps) for n in args.rows]
        for r in results:
            print(f"{r['rows']:3d} prompts beside {r['decoding']} decoding: {r['batch_us_median']:8.0f} us to their "
                  f"Emits, {r['per_row_us']:6.1f} us/prompt", flush=True)
    else:
        results = [run(n, args.steps, lookahead=args.lookahead) for n in args.rows]
        for r in results:
            print(f"{r['rows']:3d} rows: {r['step_us_median']:8.0f} us/step, {r['per_row_us']:6.1f} us/row, "
                  f"{r['messages_per_step']:.1f} msg/step", flush=True)
    result = {"command": " ".join([sys.executable, *sys.argv]), "machine": {
        "platform": platform.platform(), "torch": torch.__version__, "python": platform.python_version()},
        "results": results}
    if args.profile and not args.prefill:
        prof = run(args.profile, args.steps, profile=True, lookahead=args.lookahead)
        result["profile"] = prof
        print("\n".join(prof["profile_tottime_top25"][:45]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
