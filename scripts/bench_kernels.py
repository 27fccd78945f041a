"""Where a captured forward's GPU time goes, and what kernel fusion would buy: for decode steps of B rows and prefills
of R rows x L tokens of the same model on one GPU, side by side in one run:

- ``graph_ms``: one forward as the engine runs it (the eager forward captured in a CUDA graph), GPU time per replay,
  median of ``--repeats`` runs of ``--replays`` back-to-back replays (CUDA events);
- ``kernels``: the kernels of one eager forward under torch.profiler: how many, their summed GPU time, the largest;
- ``kernel_graph_ms`` (decode, where Triton runs): the same step with the cache's ``decode_kernel`` (the in-place
  attention of ``engine/decode_attention.py`` instead of SDPA over copies of the rows' keys and values), its kernels,
  and the largest difference of its logits from the SDPA step's;
- ``fused_graph_ms`` (where Triton runs): the forward as the engine runs it by default, with the fused pointwise
  kernels of ``models/common/fused.py`` (and, for decode, the in-place attention), its kernels, the largest difference
  of its logits from the unfused forward's with the same attention, and ``unfused_over_fused``; for prefills
  ``store_graph_ms`` first, the unfused forward with the cache's one-launch K/V store
  (``decode_attention.store_prompt``);
- ``compiled_graph_ms``: the same forward compiled by ``torch.compile`` (inductor fuses the pointwise work between
  GEMMs, attention and norms) and captured in a CUDA graph, timed alike; ``compile_s`` and the largest difference of
  its logits from the eager ones.

Exploratory (what fusion is worth before building it into the engine), CUDA only, never a test:

    python scripts/bench_kernels.py --weights /tmp/smol-rand --out bench/raw/kernels_h200.json

The JSON is rewritten after every case, so a run cut short keeps what it measured.
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
from torch.nn.attention import sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.common import fused  # noqa: E402
from mstar_dist.engine import decode_attention  # noqa: E402
from mstar_dist.engine.cuda_graphs import context_buckets  # noqa: E402
from mstar_dist.engine.kv_cache import StaticKVCache  # noqa: E402
from mstar_dist.engine.kv_engine import PREFILL_ATTENTION  # noqa: E402
from models.llama.weights import load_llama  # noqa: E402

MAX_SEQ_LEN = 2048
"""The served engine's cache (LlamaChat's default max_seq_len); an SDPA decode step reads its rows' context bucket
(``cuda_graphs.context_buckets``), the in-place kernel each row's own length."""


def graph_ms(fn, replays: int, repeats: int) -> float:
    """GPU ms per replay of a CUDA graph of ``fn`` (warmed on a side stream first), median over ``repeats``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    del graph
    return statistics.median(times)


def kernel_profile(fn, top: int = 12) -> dict:
    """The GPU kernels of one call of ``fn`` (warmed): count, summed time and the ``top`` largest by time."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    return {"count": len(kernels), "gpu_us": round(sum(e.device_time for e in kernels), 1),
            "top": [{"name": name[:120], "calls": len(ts), "us": round(sum(ts), 1)} for name, ts in ranked[:top]]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--weights", required=True)
    p.add_argument("--decode", type=int, nargs="+", default=[1, 32, 64], help="decode batch sizes")
    p.add_argument("--prefill", nargs="*", default=["1x48", "32x48"], help="prefill shapes, ROWSxTOKENS")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--position", type=int, default=300, help="the position decode rows write (their context - 1)")
    p.add_argument("--out", default="bench/raw/kernels.json")
    args = p.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    model, cfg = load_llama(args.weights, device=device, dtype=torch.bfloat16)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.prefill]
    slots = max([*args.decode, *(r for r, _ in shapes)])
    cache = StaticKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, max_slots=slots, max_seq_len=MAX_SEQ_LEN,
                          dtype=torch.bfloat16, device=device)
    for _ in range(slots):
        cache.alloc()
    compiled_model = None if args.no_compile else torch.compile(model, dynamic=False)
    out = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "date": datetime.datetime.now().isoformat(),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "host": platform.node(),
           "weights": args.weights, "cases": []}

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))

    ctx = next(c for c in context_buckets(MAX_SEQ_LEN) if c > args.position)
    out["decode_position"], out["decode_context_bucket"] = args.position, ctx
    cases = [("decode", b, 1) for b in args.decode] + [("prefill", r, n) for r, n in shapes]
    with torch.inference_mode():
        for kind, rows, tokens in cases:
            if kind == "decode":
                ids = torch.randint(0, cfg.vocab_size, (rows, 1), device=device)
                positions = torch.full((rows,), args.position, dtype=torch.long, device=device)
                slot_idx = torch.arange(rows, device=device)

                def forward(m, ids=ids, positions=positions, slot_idx=slot_idx):
                    cache.bind_graph(slot_idx, positions, ctx)
                    return m(ids, positions[:, None], cache, last_only=True)
            else:
                ids = torch.randint(0, cfg.vocab_size, (rows, tokens), device=device)
                slot_idx = torch.arange(rows, device=device)
                pos = torch.arange(tokens, device=device).expand(rows, tokens)
                last = torch.full((rows,), tokens - 1, dtype=torch.long, device=device)

                def forward(m, ids=ids, slot_idx=slot_idx, pos=pos, last=last, tokens=tokens):
                    cache.bind_prefill_graph(slot_idx, tokens)
                    with sdpa_kernel(PREFILL_ATTENTION):
                        return m(ids, pos, cache, last_only=True, last_index=last)
            case = {"kind": kind, "rows": rows, "tokens": tokens}
            case["graph_ms"] = round(graph_ms(lambda: forward(model), args.replays, args.repeats), 4)
            case["kernels"] = kernel_profile(lambda: forward(model))
            if kind == "decode" and decode_attention.available(device):
                want = forward(model).float()
                cache.decode_kernel = True  # bind_graph and attend read it on every call
                try:
                    got = forward(model).float()
                    case["kernel_max_abs_diff"] = float((got - want).abs().max())
                    case["kernel_argmax_agree"] = float((got.argmax(-1) == want.argmax(-1)).float().mean())
                    case["kernel_graph_ms"] = round(graph_ms(lambda: forward(model), args.replays, args.repeats), 4)
                    case["kernel_kernels"] = kernel_profile(lambda: forward(model), top=6)
                    case["sdpa_over_kernel"] = round(case["graph_ms"] / case["kernel_graph_ms"], 3)
                finally:
                    cache.decode_kernel = False
            if fused.available(device):
                # the engine's default cache beside the fused kernels: decode attention in place, a prompt's keys and
                # values stored in one launch (decode_attention.store_prompt)
                cache.decode_kernel = kernel = decode_attention.available(device)
                try:
                    want = forward(model).float()
                    if kind == "prefill" and kernel:
                        case["store_graph_ms"] = round(graph_ms(lambda: forward(model), args.replays, args.repeats), 4)
                    unfused_ms = case.get("kernel_graph_ms") or case.get("store_graph_ms") or case["graph_ms"]
                    model.fuse_pointwise()
                    got = forward(model).float()
                    case["fused_max_abs_diff"] = float((got - want).abs().max())
                    case["fused_argmax_agree"] = float((got.argmax(-1) == want.argmax(-1)).float().mean())
                    case["fused_graph_ms"] = round(graph_ms(lambda: forward(model), args.replays, args.repeats), 4)
                    case["fused_kernels"] = kernel_profile(lambda: forward(model), top=6)
                    case["unfused_over_fused"] = round(unfused_ms / case["fused_graph_ms"], 3)
                finally:
                    model.fuse_pointwise(False)
                    cache.decode_kernel = False
            out["cases"].append(case)
            save()
            if compiled_model is not None:
                try:
                    t0 = time.perf_counter()
                    got = forward(compiled_model)  # compiles this shape
                    torch.cuda.synchronize()
                    case["compile_s"] = round(time.perf_counter() - t0, 1)
                    case["compiled_max_abs_diff"] = float((got.float() - forward(model).float()).abs().max())
                    case["compiled_graph_ms"] = round(graph_ms(lambda: forward(compiled_model), args.replays,
                                                               args.repeats), 4)
                    case["compiled_kernels"] = kernel_profile(lambda: forward(compiled_model), top=6)
                    case["graph_over_compiled"] = round(case["graph_ms"] / case["compiled_graph_ms"], 3)
                except Exception as exc:  # an exploratory number: record why it is missing and go on
                    case["compile_error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                save()
            print(json.dumps({k: v for k, v in case.items() if "kernels" not in k}), flush=True)
    save()


if __name__ == "__main__":
    main()
