"""Qwen3-MoE at its real 30B-A3B shape on one device (TP1): the serving engine's decode steps against a CUDA-graph
decode loop of the same model, with random weights made on the device (no checkpoint: ~61 GB of bf16 would take
longer to write and read than the whole measurement).

    python scripts/bench_moe30b.py [--shape 30b-a3b|tiny] [--device cuda|cpu] [--streams 1 32 64] [--tokens 128]
        [--eager-tokens 16] [--max-seq-len 1024] --out JSON

Per concurrency N (N prompts of ``--prompt-len`` random ids, prefilled together, then ``--tokens`` greedy decode
steps of all N rows; only the decode steps are timed, tok/s = N x steps / seconds):

- ``engine``: the ``KVCacheEngine`` the ``qwen3_moe`` family builds for a rank (``MoEChat.build_component``, the
  deployment's engine defaults: decode CUDA graphs, the decode-attention kernel and fused pointwise kernels where
  they run), driven in process turn by turn as the worker drives it (``run_batch`` of the N decode calls, a held call
  handed over again), the family's model loader replaced by the random one. No HTTP, conductor or wire: this is the
  engine's decode step, not end-to-end serving (a served checkpoint of this size does not fit the device's disk).
- ``bare_graphs``: ``mstar_dist.tools.bare_loop.bare_generate`` over ``DecodeGraphs`` captured on the same model and
  a cache of the same context: the CUDA-graph decode loop, the yardstick.
- ``bare_eager``: the same loop without graphs (``--eager-tokens`` steps): the model's eager forward, where an MoE
  block of more than E assignments takes the per-expert (grouped) path instead of the gathered one.
- ``experts_ms``: one MoE block's expert compute at N rows, gathered path (what a captured step runs) against the
  grouped per-expert loop, and the block's share of an engine step (x layers): where a step's time goes.

``--shape tiny`` (a few MB, any device) checks the script on a CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from models.moe.config import MoEConfig  # noqa: E402
from mstar_dist.tools.engine_turns import call, settle  # noqa: E402

SHAPES = {
    # Qwen/Qwen3-30B-A3B's config.json (every layer sparse, no shared expert, untied head)
    "30b-a3b": MoEConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                         n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                         norm_topk_prob=True, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         max_position_embeddings=40960, bos_token_id=151643, eos_token_ids=(151645, 151643)),
    "tiny": MoEConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_layers=2,
                      n_heads=4, n_kv_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      max_position_embeddings=2048),
}


def random_moe(config: MoEConfig, device: str, dtype: torch.dtype, seed: int = 0):
    """``Qwen3Moe`` built on meta and filled on ``device``: norms 1, every other weight N(0, 0.02) (HF's init)."""
    from models.moe.model import Qwen3Moe

    with torch.device("meta"):
        model = Qwen3Moe(config).to(dtype)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(1.0) if param.dim() == 1 else param.normal_(0.0, 0.02, generator=gen)
    model.tie_weights()
    model.init_rope_tables()
    return model.eval().requires_grad_(False)


def build_engine(model, config: MoEConfig, device: str, max_batch: int, max_seq_len: int):
    """The engine the qwen3_moe family builds for a TP1 rank, around ``model``."""
    from models.moe.chat import MoEChat
    from mstar_dist.config.engine import EngineConfig

    class RandomMoE(MoEChat):
        def _load_model(self, device, dtype, tp):
            return model, config

    family = RandomMoE("/nonexistent-random-weights")
    engine = EngineConfig(max_batch=max_batch, max_seq_len=max_seq_len)
    eng = family.build_component("LLM", device=device, walks={"prefill", "decode"}, engine=engine)
    eng.warmup()
    return eng


def engine_decode(eng, prompts: list[list[int]], steps: int, device: str) -> dict:
    """Prefill every prompt in one turn, then ``steps`` decode turns of all rows; the decode turns timed."""
    from mstar_dist.engine.component import WalkContext
    from mstar_dist.engine.sampling import SamplingParams

    ids = [f"r{i}" for i in range(len(prompts))]
    ctxs = [WalkContext(request_id=rid, walk="prefill", walk_index=0, seed=0,
                        sampling=SamplingParams(temperature=0.0, seed=0)) for rid in ids]
    try:
        tokens = settle(eng, [call(rid, ctx, {"input_ids": torch.tensor(p)}) for rid, ctx, p in
                              zip(ids, ctxs, prompts)])
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            tokens = settle(eng, [call(rid, ctx, {"token": torch.tensor([t])}) for rid, ctx, t in
                                  zip(ids, ctxs, tokens)])
        seconds = time.perf_counter() - start
    finally:
        for rid in ids:
            eng.release(rid)
    return {"tok_s": len(prompts) * steps / seconds, "step_ms": 1000 * seconds / steps, "steps": steps}


def bare_decode(model, cache, graphs, prompts: list[list[int]], steps: int) -> dict:
    """The bare loop's decode steps alone (its prefills excluded, as the serving benchmark's yardstick)."""
    from mstar_dist.tools.bare_loop import bare_generate

    bare_generate(model, cache, prompts, 3, graphs=graphs)  # warm this batch size
    phases: dict = {}
    bare_generate(model, cache, prompts, steps + 1, graphs=graphs, phases=phases)
    return {"tok_s": len(prompts) * steps / phases["decode_s"], "step_ms": 1000 * phases["decode_s"] / steps,
            "steps": steps}


def make_cache(config: MoEConfig, slots: int, max_seq_len: int, dtype, device: str, decode_kernel: bool):
    from mstar_dist.engine.kv_cache import StaticKVCache

    return StaticKVCache(config.n_layers, config.n_kv_heads, config.head_dim, max_slots=slots,
                         max_seq_len=max_seq_len, dtype=dtype, device=device, decode_kernel=decode_kernel)


def experts_ms(model, config: MoEConfig, rows: int, device: str, repeats: int = 10) -> dict:
    """One MoE block's expert compute at ``rows`` tokens: the gathered path and the grouped per-expert loop (ms)."""
    block = model.layers[0].mlp
    x = torch.randn(rows, config.hidden_size, device=device, dtype=model.embed.weight.dtype)
    with torch.inference_mode():
        weights, selected, _ = block.router(x)
        out = {}
        for name, path in (("gathered", block.experts._gathered), ("grouped", block.experts._grouped)):
            path(x, selected, weights)
            _sync(device)
            start = time.perf_counter()
            for _ in range(repeats):
                path(x, selected, weights)
            _sync(device)
            out[name] = 1000 * (time.perf_counter() - start) / repeats
    return out


def run(args, save) -> dict:
    """Every measurement of the module docstring; ``save(out)`` after each phase (a run cut short keeps them)."""
    config, dtype = SHAPES[args.shape], torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    start = time.perf_counter()
    model = random_moe(config, args.device, dtype)
    _sync(args.device)
    params = sum(p.numel() for p in model.parameters())
    out: dict = {"shape": args.shape, "config": config.to_hf(), "params_b": params / 1e9, "dtype": str(dtype),
                 "init_s": time.perf_counter() - start, "max_seq_len": args.max_seq_len, "prompt_len": args.prompt_len}
    gen = torch.Generator().manual_seed(1)
    prompts = {n: torch.randint(config.vocab_size, (n, args.prompt_len), generator=gen).tolist() for n in args.streams}
    top = max(args.streams)
    start = time.perf_counter()
    eng = build_engine(model, config, args.device, top, args.max_seq_len)
    out["engine_warmup_s"] = time.perf_counter() - start
    out["engine_config"] = {k: getattr(eng.config, k) for k in ("cuda_graphs", "lookahead", "prefill_graphs",
                                                                  "decode_attention", "fused_pointwise")}
    kernel = eng.cache.decode_kernel
    out["engine"] = {f"streams_{n}": engine_decode(eng, prompts[n], args.tokens, args.device) for n in args.streams}
    print("engine", out["engine"], flush=True)
    save(out)
    eng.close()
    del eng
    _free(args.device)
    out["bare_graphs"] = bare_loop(model, config, args, prompts, dtype, graphs=True, kernel=kernel)
    out["bare_graphs_captured"] = args.device.startswith("cuda")  # on a CPU the "graphs" loop runs eagerly
    out["engine_over_bare_graphs"] = {k: out["engine"][k]["tok_s"] / out["bare_graphs"][k]["tok_s"]
                                      for k in out["engine"]}
    print("bare_graphs", out["bare_graphs"], out["engine_over_bare_graphs"], flush=True)
    save(out)
    out["bare_eager"] = bare_loop(model, config, args, prompts, dtype, graphs=False, kernel=False)
    print("bare_eager", out["bare_eager"], flush=True)
    save(out)
    out["experts_ms"] = {f"streams_{n}": experts_ms(model, config, n, args.device) for n in args.streams}
    for n in args.streams:
        row = out["experts_ms"][f"streams_{n}"]
        row["gathered_share_of_engine_step"] = row["gathered"] * config.n_layers / out["engine"][f"streams_{n}"][
            "step_ms"]
    return out


def bare_loop(model, config: MoEConfig, args, prompts: dict, dtype, *, graphs: bool, kernel: bool) -> dict:
    """The bare loop at every concurrency, with CUDA graphs (on CUDA) or eagerly, on a cache of its own."""
    from mstar_dist.engine.cuda_graphs import DecodeGraphs

    graphs = graphs and args.device.startswith("cuda")
    top = max(args.streams)
    cache = make_cache(config, top + (1 if graphs else 0), args.max_seq_len, dtype, args.device, kernel and graphs)
    captured = None
    if graphs:
        captured = DecodeGraphs(model, cache, scratch_slot=cache.alloc(), max_batch=top)
        captured.capture()
    steps = args.tokens if graphs else args.eager_tokens
    try:
        return {f"streams_{n}": bare_decode(model, cache, captured, prompts[n], steps) for n in args.streams}
    finally:
        if captured is not None:
            captured.close()
        del cache, captured
        _free(args.device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(SHAPES), default="30b-a3b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 32, 64])
    p.add_argument("--tokens", type=int, default=128, help="decode steps timed per concurrency (engine, graphs)")
    p.add_argument("--eager-tokens", type=int, default=16, help="decode steps timed per concurrency, eager loop")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if min(args.streams) < 1 or args.tokens < 1 or args.eager_tokens < 1:
        p.error("--streams, --tokens and --eager-tokens take positive numbers")
    if args.prompt_len + max(args.tokens, args.eager_tokens) + 8 > args.max_seq_len:
        p.error(f"--prompt-len {args.prompt_len} + the steps must fit --max-seq-len {args.max_seq_len}")
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    meta = dict(command=" ".join(sys.argv), torch=torch.__version__,
                device=torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def save(out: dict) -> None:
        Path(args.out).write_text(json.dumps({**out, **meta}, indent=2) + "\n")

    result = {**run(args, save), **meta}
    save(result)
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=2))


if __name__ == "__main__":
    main()
