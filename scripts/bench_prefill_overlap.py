"""How long a batched prefill's first tokens take to reach the host when a decode step is already queued on the GPU
(the engine's decode lookahead, docs/architecture.md §8), with the prefill queued behind that step on the same stream
against replayed on a second, higher-priority stream. CUDA only; not a timed test.

    python scripts/bench_prefill_overlap.py --weights /tmp/smol-rand --out bench/results/prefill_overlap_h200.json

Per case (prefill rows R of one length bucket, decode batch D): the wall time from launching the prefill (replay,
sampling, copy to the host) to its tokens on the host, medians over ``--samples`` alternated samples: ``alone`` (idle
GPU), ``behind`` (a D-row decode step replayed on the same stream just before), ``side`` (the same decode step, the
prefill on a high-priority side stream); and how much the decode step itself slowed down beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mstar_dist.engine.cuda_graphs import DecodeGraphs, PrefillGraphs  # noqa: E402
from mstar_dist.engine.kv_cache import StaticKVCache  # noqa: E402
from mstar_dist.engine.kv_engine import _PREFILL_ATTENTION  # noqa: E402
from models.llama.weights import load_llama  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--weights", required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    p.add_argument("--decode", type=int, nargs="+", default=[32, 64])
    p.add_argument("--prompt", type=int, default=44)
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    model, cfg = load_llama(args.weights, device=device, dtype=torch.bfloat16)
    max_batch = max(max(args.decode), max(args.rows))
    n_slots = max(args.decode) + max(args.rows) + 1
    cache = StaticKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, max_slots=n_slots, max_seq_len=2048,
                          dtype=torch.bfloat16, device=device)
    decode = DecodeGraphs(model, cache, scratch_slot=cache.alloc(), max_batch=max_batch)
    prefill = PrefillGraphs(model, cache, scratch_slot=decode.scratch, max_rows=max_batch, max_tokens=4096,
                            attention=_PREFILL_ATTENTION)
    decode.capture()
    prefill.capture()
    dec_slots = [cache.alloc() for _ in range(max(args.decode))]
    pre_slots = [cache.alloc() for _ in range(max(args.rows))]
    side = torch.cuda.Stream(device, priority=-1)
    gen = torch.Generator().manual_seed(0)

    def run_prefill(rows: int) -> torch.Tensor:
        prompts = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=gen).pin_memory()
                   .to(device, non_blocking=True) for _ in range(rows)]
        bucket = prefill.bucket_for(rows, args.prompt)
        logits = prefill.logits(prompts, pre_slots[:rows], bucket)
        return logits[:, -1].argmax(-1).cpu()

    def run_decode(d: int) -> torch.cuda.Event:
        tokens = torch.zeros(d, dtype=torch.long, device=device)
        decode.logits(tokens, [300] * d, dec_slots[:d])
        done = torch.cuda.Event(enable_timing=True)
        done.record()
        return done

    results = []
    with torch.inference_mode():
        for d in args.decode:
            # one decode step alone, for its own time
            for _ in range(3):
                run_decode(d)
            torch.cuda.synchronize()
            for rows in args.rows:
                run_prefill(rows)
                torch.cuda.synchronize()
                samples: dict[str, list[float]] = {"alone": [], "behind": [], "side": [], "decode_alone": [],
                                                   "decode_beside": []}
                for _ in range(args.samples):
                    for case in ("alone", "behind", "side"):
                        torch.cuda.synchronize()
                        start_ev = torch.cuda.Event(enable_timing=True)
                        if case != "alone":
                            start_ev.record()
                            done = run_decode(d)
                        t0 = time.perf_counter()
                        if case == "side":
                            with torch.cuda.stream(side):
                                run_prefill(rows)
                        else:
                            run_prefill(rows)
                        samples[case].append((time.perf_counter() - t0) * 1e3)
                        if case != "alone":
                            done.synchronize()
                            key = "decode_alone" if case == "behind" else "decode_beside"
                            samples[key].append(start_ev.elapsed_time(done))
                row = {"decode_rows": d, "prefill_rows": rows, "prompt": args.prompt,
                       **{f"{k}_ms": round(statistics.median(v), 3) for k, v in samples.items()}}
                results.append(row)
                print(json.dumps(row), flush=True)
    out = {"command": " ".join([sys.executable, *sys.argv]), "date": datetime.date.today().isoformat(),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "platform": platform.platform(),
           "samples": args.samples, "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
