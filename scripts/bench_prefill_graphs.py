"""A batched prefill replayed from the engine's prefill graphs (docs/architecture.md §8), alone on an idle GPU: how
long R prompts take from launch to their first tokens on the host, and the GPU time of the replay. CUDA only; not
a timed test. Run it once per tree to compare two implementations side by side in one command:

    python scripts/bench_prefill_graphs.py --weights /tmp/smol-rand --out new.json
    (cd .ab_base && python ../scripts/bench_prefill_graphs.py --weights /tmp/smol-rand --out ../old.json)

The script imports ``mstar_dist`` from the working directory, so the second line measures the tree in ``.ab_base``.
It speaks two bucket interfaces: main's (rows, length) buckets (``bucket_for(rows, longest)``, prompts on the device)
and the packed token buckets of an experiment that did not stay (``bucket_for(lengths)``, host prompts; commit
1f4218b, bench/results/README.md "Eleventh session").
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.getcwd())

from mstar_dist.engine.cuda_graphs import DecodeGraphs, PrefillGraphs  # noqa: E402
from mstar_dist.engine.kv_cache import StaticKVCache  # noqa: E402
from mstar_dist.engine.kv_engine import _PREFILL_ATTENTION  # noqa: E402
from models.llama.weights import load_llama  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--weights", required=True)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 15, 17, 32, 48, 64])
    p.add_argument("--prompt", type=int, default=44, help="mean prompt length; rows alternate +-8 around it")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    model, cfg = load_llama(args.weights, device=device, dtype=torch.bfloat16)
    cache = StaticKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, max_slots=args.max_batch + 1, max_seq_len=2048,
                          dtype=torch.bfloat16, device=device)
    decode = DecodeGraphs(model, cache, scratch_slot=cache.alloc(), max_batch=args.max_batch)
    prefill = PrefillGraphs(model, cache, scratch_slot=decode.scratch, max_rows=args.max_batch, max_tokens=4096,
                            attention=_PREFILL_ATTENTION)
    t0 = time.perf_counter()
    prefill.capture()
    capture_s = time.perf_counter() - t0
    packed = len(inspect.signature(prefill.bucket_for).parameters) == 1
    slots = [cache.alloc() for _ in range(args.max_batch)]
    gen = torch.Generator().manual_seed(0)

    def prompts(rows: int) -> list[torch.Tensor]:
        lengths = [args.prompt + (8 if r % 2 else -8) for r in range(rows)]
        host = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lengths]
        return host if packed else [t.pin_memory().to(device, non_blocking=True) for t in host]

    def once(batch: list[torch.Tensor]) -> tuple[float, float, object]:
        lengths = [t.numel() for t in batch]
        bucket = prefill.bucket_for(lengths) if packed else prefill.bucket_for(len(batch), max(lengths))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        start.record()
        logits = prefill.logits(batch, slots[: len(batch)], bucket)
        end.record()
        logits[:, -1].argmax(-1).cpu()
        host_ms = (time.perf_counter() - t) * 1e3
        return host_ms, start.elapsed_time(end), bucket

    results = []
    with torch.inference_mode():
        for rows in args.rows:
            batch = prompts(rows)
            once(batch)
            torch.cuda.synchronize()
            host, gpu = [], []
            for _ in range(args.samples):
                h, g, bucket = once(batch)
                host.append(h)
                gpu.append(g)
            row = {"rows": rows, "tokens": sum(t.numel() for t in batch), "bucket": bucket,
                   "launch_to_tokens_ms": round(statistics.median(host), 3), "gpu_ms": round(statistics.median(gpu), 3)}
            results.append(row)
            print(json.dumps(row), flush=True)
    out = {"command": " ".join([sys.executable, *sys.argv]), "cwd": os.getcwd(), "packed": packed,
           "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "platform": platform.platform(), "buckets": len(prefill.buckets), "capture_s": round(capture_s, 2),
           "samples": args.samples, "results": results}
    print(json.dumps({k: out[k] for k in ("packed", "buckets", "capture_s")}))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
