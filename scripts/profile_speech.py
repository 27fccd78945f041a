"""Where a speech step's time goes (Orpheus shape, one device, in process): the LLM engine's decode step with Orpheus's
sampling against the same step greedy, the SNAC codec's batched windows, and which of them change the output's bits
when the batch or the free memory changes.

    python scripts/profile_speech.py --weights DIR [--make 3b] [--streams 8 32 64 128 256] [--steps 40] --out JSON

Per concurrency N (N prompts prefilled, then ``--steps`` decode turns of all N rows, as the worker drives the engine;
mstar_dist/tools/engine_turns.py):

- ``llm_ms``: one decode step of the ``LLM`` engine the family builds (CUDA graphs, lookahead, the Triton kernels),
  per sampling: ``orpheus`` (temperature 0.6, top-p 0.95, repetition penalty 1.1: the family's defaults),
  ``top_p`` (the same without the penalty) and ``greedy`` (no draw at all: the model's step).
- ``codec_ms``: one ``SpeechCodec`` batch of 4-frame windows (one new frame each, what a stream's regular chunk
  decodes) as served (CUDA graphs on the codec's stream, PCM to the host) at N / 7 windows (the chunks a step of N
  streams completes on average: a chunk every 7 codes) and at N, and eagerly at N / 7.
- ``budget``: a stream stays real time while a step of all streams takes at most one code's audio
  (2048 / 7 samples at 24 kHz = 12.19 ms); ``step_ms`` = the orpheus step + the codec's share of a step, and
  ``rtf_bound`` = step_ms / 12.19 (what the serving benchmark's RTF would be with nothing else on the rank).

``bits``: whether a stream's output is the same bits when (a) its codec window decodes alone or in a batch of 8, (b)
its codec window decodes with almost no free device memory (the cuDNN workspace), (c) its LLM logits come from a
step of 1 row or of 8 rows (a different graph bucket, so a different GEMM shape). The JSON keeps every figure;
the table of bench/results/README.md quotes them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mstar_dist.tools.engine_turns import call, settle  # noqa: E402

CODE_AUDIO_MS = 2048 / 7 / 24000 * 1000
"""One code's audio: a 2048-sample frame is 7 codes, at 24 kHz."""
SAMPLINGS = {"orpheus": dict(temperature=0.6, top_p=0.95, repetition_penalty=1.1),
             "top_p": dict(temperature=0.6, top_p=0.95), "greedy": dict(temperature=0.0)}


def build(weights: str, device: str, max_batch: int):
    """(family, LLM engine, codec) as a rank builds them for ``speech_single.yaml``."""
    from models.speech.orpheus import CODEC, OrpheusSpeech
    from mstar_dist.config.engine import EngineConfig

    family = OrpheusSpeech(weights)
    engine = family.build_component("LLM", device=device, walks={"prefill", "decode"},
                                    engine=EngineConfig(max_batch=max_batch, max_seq_len=1024))
    engine.warmup()
    codec = family.build_component(CODEC, device=device, walks={"codec"})
    codec.warmup()
    return family, engine, codec


def llm_step_ms(engine, family, n: int, sampling: dict, steps: int, device: str) -> float:
    """One decode turn of n rows, milliseconds (median of ``steps`` turns after 4 warm ones)."""
    from mstar_dist.engine.component import WalkContext
    from mstar_dist.engine.sampling import SamplingParams

    tokens = family._speech_tokens()
    prompt = tokens.prompt_ids("tara", "The lighthouse keeper climbed the spiral stairs every evening at dusk.")
    ids = [f"r{i}" for i in range(n)]
    ctxs = [WalkContext(request_id=rid, walk="decode", walk_index=1, seed=1000 + i,
                        sampling=SamplingParams(seed=1000 + i, **sampling),
                        stop_token_ids=frozenset({tokens.end_of_speech}))
            for i, rid in enumerate(ids)]
    times = []
    try:
        last = settle(engine, [call(rid, ctx, {"input_ids": torch.tensor(prompt)}) for rid, ctx in zip(ids, ctxs)])
        for k in range(steps + 4):
            _sync(device)
            t0 = time.perf_counter()
            last = settle(engine, [call(rid, ctx, {"token": torch.tensor([t])}, iteration=k)
                                   for rid, ctx, t in zip(ids, ctxs, last)])
            _sync(device)
            times.append(time.perf_counter() - t0)
    finally:
        for rid in ids:
            engine.release(rid)
    times = sorted(times[4:])
    return 1000 * times[len(times) // 2]


def codec_ms(codec, batch: int, device: str, eager: bool = False, repeats: int = 5) -> float:
    """One batch of ``batch`` 4-frame windows (1 new frame each) through the codec as it serves them (CUDA graphs on
    its own stream, PCM to the host), or eagerly on the current stream; milliseconds (median)."""
    from models.snac.frames import decode_windows, to_pcm16
    from mstar_dist.engine.sampling import seeded

    gen = torch.Generator().manual_seed(0)
    windows = torch.randint(0, codec.codebook_size, (batch, 4, 7), generator=gen)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        gens = [seeded(i, device) for i in range(batch)]
        if eager:
            to_pcm16(decode_windows(codec.decoder, windows.to(device), 1, gens)).cpu()
        else:
            codec._decode(windows, 1, gens)
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return 1000 * times[len(times) // 2]


def codec_digest(codec, windows: torch.Tensor, row: int, device: str) -> str:
    """The PCM bytes of ``windows[row]`` decoded in a batch of ``windows``, hashed."""
    from models.snac.frames import decode_windows, to_pcm16
    from mstar_dist.engine.sampling import seeded

    pcm = to_pcm16(decode_windows(codec.decoder, windows.to(device), 1,
                                  [seeded(7 + i, device) for i in range(windows.shape[0])]))
    return hashlib.sha256(pcm[row].cpu().numpy().tobytes()).hexdigest()[:16]


def bits(engine, family, codec, device: str) -> dict:
    """Which batch and memory conditions change a stream's output bits (see the module docstring)."""
    gen = torch.Generator().manual_seed(1)
    windows = torch.randint(0, codec.codebook_size, (8, 4, 7), generator=gen)
    # row 0 of the batch of 8 is window 0 decoded alone with the same generator seed (7)
    alone, batched = codec_digest(codec, windows[:1], 0, device), codec_digest(codec, windows, 0, device)
    out = {"codec_alone_vs_batch8": alone == batched}
    if codec.graphs is not None:  # the served path (a graph of the bucket of 8) against the eager batch of 8
        from mstar_dist.engine.sampling import seeded

        pcm = codec._decode(windows, 1, [seeded(7 + i, device) for i in range(8)])
        out["codec_graph_vs_eager_batch8"] = hashlib.sha256(pcm[0].numpy().tobytes()).hexdigest()[:16] == batched
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
        blocker = torch.empty(max(0, free - (128 << 20)), dtype=torch.uint8, device=device)
        try:
            out["codec_low_memory_vs_free"] = codec_digest(codec, windows[:1], 0, device) == alone
        except torch.OutOfMemoryError:
            out["codec_low_memory_vs_free"] = "out of memory"
        finally:
            del blocker
            torch.cuda.empty_cache()
    out["llm_logits_1_row_vs_8_rows"] = _llm_rows_equal(engine, family, device)
    out["tf32_cudnn"] = bool(torch.backends.cudnn.allow_tf32)
    out["tf32_matmul"] = bool(torch.backends.cuda.matmul.allow_tf32)
    return out


def _llm_rows_equal(engine, family, device: str) -> bool:
    """Row 0's logits from a captured step of 1 row against the same row among 8 rows (same slot, position)."""
    from mstar_dist.engine.component import WalkContext
    from mstar_dist.engine.sampling import SamplingParams

    if engine.graphs is None:
        return True
    tokens = family._speech_tokens()
    prompt = tokens.prompt_ids("tara", "Children ran along the sea wall.")
    ids = [f"b{i}" for i in range(8)]
    ctxs = [WalkContext(request_id=rid, walk="prefill", walk_index=0, seed=i,
                        sampling=SamplingParams(temperature=0.0)) for i, rid in enumerate(ids)]
    try:
        first = settle(engine, [call(rid, ctx, {"input_ids": torch.tensor(prompt)}) for rid, ctx in zip(ids, ctxs)])
        seqs = [engine._seqs[rid] for rid in ids]
        positions, slots = [s.length for s in seqs], [s.slot for s in seqs]
        step = torch.tensor(first, device=device)
        with torch.inference_mode():
            one = engine.graphs.logits(step[:1], positions[:1], slots[:1], None)[0, -1].float().clone()
            eight = engine.graphs.logits(step, positions, slots, None)[0, -1].float().clone()
        return bool(torch.equal(one, eight))
    finally:
        for rid in ids:
            engine.release(rid)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", required=True)
    p.add_argument("--make", default=None, help="write a random speech checkpoint of this size to --weights first")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--streams", type=int, nargs="+", default=[8, 32, 64, 128, 256])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if min(args.streams) < 1 or args.steps < 1:
        p.error("--streams and --steps take positive numbers")
    if args.make and not Path(args.weights, "config.json").exists():
        from bench_composite import make_checkpoint  # scripts/ is on the path as this script's folder

        make_checkpoint(argparse.Namespace(what="speech", make=args.make, weights=args.weights))
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    meta = dict(command=" ".join(sys.argv), torch=torch.__version__, device=device)
    out: dict = {"code_audio_ms": CODE_AUDIO_MS}

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**out, **meta}, indent=2) + "\n")

    family, engine, codec = build(args.weights, args.device, max(args.streams))
    try:
        out["bits"] = bits(engine, family, codec, args.device)
    except Exception as exc:  # the timings below do not depend on it
        out["bits"] = {"error": f"{type(exc).__name__}: {exc}"}
    print("bits", out["bits"], flush=True)
    save()
    for n in args.streams:
        row = {"llm_ms": {name: llm_step_ms(engine, family, n, s, args.steps, args.device)
                          for name, s in SAMPLINGS.items()}}
        per_step = max(1, round(n / 7))
        row["codec_ms"] = {f"windows_{per_step}": codec_ms(codec, per_step, args.device),
                           f"windows_{per_step}_eager": codec_ms(codec, per_step, args.device, eager=True),
                           f"windows_{n}": codec_ms(codec, n, args.device)}
        step = row["llm_ms"]["orpheus"] + row["codec_ms"][f"windows_{per_step}"]
        row["budget"] = {"step_ms": step, "rtf_bound": step / CODE_AUDIO_MS,
                         "sampling_share": 1 - row["llm_ms"]["greedy"] / row["llm_ms"]["orpheus"],
                         "codec_share": row["codec_ms"][f"windows_{per_step}"] / step}
        out[f"streams_{n}"] = row
        print(n, json.dumps(row), flush=True)
        save()


if __name__ == "__main__":
    main()
