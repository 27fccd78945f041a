"""Host cost of admitting a burst of requests, without the GPU: the conductor's ``submit`` and a rank taking the
``RunWalk``s, per request.

    python scripts/bench_admission.py --weights DIR [--burst 32] [--rounds 60] [--out FILE]

A burst of requests (the 32 of a benchmark wave) passes one process at a time through the conductor, which admits
each, picks its ranks and sends its prefill ``RunWalk``, and then through the rank that starts its walk. Both run one
request after another, so what one request costs them adds to how far apart the burst reaches the GPU
(docs/architecture.md §2). Measured here on the real code: the Llama chat family's front end (``DIR`` needs its
tokenizer files; the prompt comes already encoded, as an HTTP intake sends it), a ``Conductor`` over the single-rank
deployment with a channel that only encodes, and a ``Worker`` with the chat walks (scripts/bench_hostpath.py's).
Reports the median CPU time per request over ``--rounds`` bursts.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

REPO = Path.cwd()
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_hostpath import TOKEN, make_worker  # noqa: E402
from models.llama.chat import LlamaChat  # noqa: E402
from mstar_dist.conductor.conductor import Conductor  # noqa: E402
from mstar_dist.config.deployment import parse_config  # noqa: E402
from mstar_dist.control import messages as m  # noqa: E402
from mstar_dist.graph.nodes import node_names  # noqa: E402
from mstar_dist.server.backend import GenerationParams  # noqa: E402
from mstar_dist.topology.placement import Placement  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a haiku about the sea, please, and explain it briefly."}]


class EncodingChannel:
    """Encodes what the conductor sends, as the real channel does, and keeps the payloads."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, peer: str, payload: bytes) -> None:
        self.sent.append(payload)

    def recv(self, timeout_ms: int = 0) -> list:
        return []


def make_conductor(weights: str) -> tuple[Conductor, EncodingChannel, list[int]]:
    raw = yaml.safe_load((REPO / "launch/configs/smollm2_single.yaml").read_text())
    raw["weights"] = weights
    model = LlamaChat(weights)
    model.load_frontend()
    placement = Placement.build(parse_config(raw, "bench"),
                                {w: frozenset(node_names(s)) for w, s in model.graphs().items()}, 1)
    channel = EncodingChannel()
    conductor = Conductor(model=model, placement=placement, channel=channel, token=TOKEN, world_size=1,
                          max_concurrent=1 << 20, request_timeout_s=600.0, rank_hosts={0: "h"})
    return conductor, channel, model.tokenizer.encode_prompt(None, MESSAGES)


def one_burst(conductor: Conductor, channel: EncodingChannel, ids: list[int], burst: int, start: int
              ) -> tuple[float, float]:
    """(conductor CPU s per request, rank CPU s per request) for one burst of ``burst`` requests."""
    conductor._active.clear()  # the burst before is done: no admission limit, no growing state
    conductor._by_wire.clear()
    channel.sent.clear()
    params = [GenerationParams(request_id=f"r{start + i}", prompt=None, messages=MESSAGES, max_tokens=256, stop=[],
                               seed=None, prompt_ids=list(ids)) for i in range(burst)]
    t0 = time.thread_time()
    for p in params:
        conductor.submit(p, lambda event: None, True)
    t1 = time.thread_time()
    worker, _, _ = make_worker(burst)
    payloads = list(channel.sent)
    t2 = time.thread_time()
    for payload in payloads:
        worker._handle("conductor", payload)
    t3 = time.thread_time()
    assert len(worker._runs) == burst, "every RunWalk started a walk"
    return (t1 - t0) / burst, (t3 - t2) / burst


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--weights", required=True, help="a weights directory with tokenizer.json and tokenizer_config.json")
    p.add_argument("--burst", type=int, default=32)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    conductor, channel, ids = make_conductor(args.weights)
    for k in range(5):
        one_burst(conductor, channel, ids, args.burst, -args.burst * (k + 1))
    runs = [one_burst(conductor, channel, ids, args.burst, k * args.burst) for k in range(args.rounds)]
    result = {"command": " ".join([sys.executable, *sys.argv]), "tree": str(REPO), "burst": args.burst,
              "prompt_tokens": len(ids), "rounds": args.rounds,
              "conductor_submit_cpu_us_median": round(statistics.median(c for c, _ in runs) * 1e6, 1),
              "rank_runwalk_cpu_us_median": round(statistics.median(r for _, r in runs) * 1e6, 1),
              "machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "torch": torch.__version__}}
    print(f"conductor submit: {result['conductor_submit_cpu_us_median']:.1f} us CPU per request; rank RunWalk: "
          f"{result['rank_runwalk_cpu_us_median']:.1f} us ({args.burst}-request bursts, {len(ids)}-token prompts)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
