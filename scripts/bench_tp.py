"""Tensor parallelism on GPUs: TP2 against TP1 for a Qwen3-MoE-shaped model, in one run.

    python scripts/bench_tp.py --weights DIR [--make medium] [--streams 1 32] [--max-tokens 128] --out JSON

1. Correctness over NCCL: ``torchrun --nproc-per-node 2 scripts/bench_tp.py check --weights DIR`` (started by this
   script) builds each rank's TP2 shard on its GPU and, on rank 0, the unsharded model; one prefill and a few decode
   steps in fp32: the largest logit difference, and whether every MoE layer's selected experts are identical on
   both TP ranks and equal to TP1's.
2. Decode speed: the server with TP1 (one GPU) and with TP2 (two GPUs), N concurrent streaming /generate requests
   of ``--max-tokens`` greedy tokens: output tok/s per N.
``--make medium`` first writes a random checkpoint of the HF Qwen3-MoE layout: hidden 1024, 16 layers, 16 heads /
4 KV heads, 32 experts (top 4, moe_intermediate 512): ~0.9B parameters.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MEDIUM = dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, n_layers=16, n_heads=16,
              n_kv_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4)


def check(weights: str) -> None:
    """One rank of the NCCL correctness check (run under torchrun with 2 processes)."""
    import torch.distributed as dist

    from mstar_dist.distributed.tp import TPGroup
    from models.moe.weights import load_moe
    from mstar_dist.engine.kv_cache import StaticKVCache

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device(f"cuda:{rank}"))
    tp = TPGroup.from_process_group(dist.new_group([0, 1]))
    runs = {"tp2": tp}
    if rank == 0:
        runs["tp1"] = TPGroup.single()
    out = {}
    vocab = json.loads(Path(weights, "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(0)).cuda()
    for name, group in runs.items():
        model, cfg = load_moe(weights, device="cuda", dtype=torch.float32, tp=group)
        calls = [[] for _ in model.layers]
        for i, layer in enumerate(model.layers):
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                router.register_forward_hook(lambda m, a, o, rec=calls[i]: rec.append(o[1].clone()))
        cache = StaticKVCache(n_layers=cfg.n_layers, n_kv_heads=model.local_kv_heads, head_dim=cfg.head_dim,
                              max_slots=1, max_seq_len=64, dtype=torch.float32, device="cuda")
        slot = cache.alloc()
        logits = []
        with torch.inference_mode():
            cache.bind([slot], [0], ids.shape[1])
            logits.append(model(ids, torch.arange(ids.shape[1], device="cuda")[None], cache, last_only=True))
            token = logits[-1][:, -1].argmax(-1, keepdim=True)
            for step in range(4):
                pos = ids.shape[1] + step
                cache.bind([slot], [pos], 1)
                logits.append(model(token, torch.tensor([[pos]], device="cuda"), cache, last_only=True))
                token = logits[-1][:, -1].argmax(-1, keepdim=True)
        out[name] = (torch.cat(logits).cpu(), [[c.cpu() for c in layer] for layer in calls if layer])
        del model, cache
        torch.cuda.empty_cache()
    gathered = [None, None]
    dist.all_gather_object(gathered, out["tp2"][1])
    if rank == 0:
        diff = (out["tp2"][0] - out["tp1"][0]).abs().max().item()
        same_ranks = all(torch.equal(a, b) for la, lb in zip(*gathered) for a, b in zip(la, lb))
        same_tp1 = all(torch.equal(a, b) for la, lb in zip(out["tp2"][1], out["tp1"][1]) for a, b in zip(la, lb))
        print(json.dumps({"max_abs_logit_diff": diff, "routing_same_on_tp_ranks": same_ranks,
                          "routing_same_as_tp1": same_tp1, "moe_layers": len(out["tp1"][1])}))
    dist.destroy_process_group()


def stream_one(base_url: str, i: int, max_tokens: int) -> int:
    import httpx

    body = {"prompt": f"Write a long story number {i}.", "stream": True,
            "model_kwargs": {"max_tokens": max_tokens, "temperature": 0}}
    tokens = 0
    with httpx.stream("POST", f"{base_url}/generate", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.strip():
                meta = json.loads(line).get("metadata", {})
                tokens = meta.get("usage", {}).get("completion_tokens", tokens)
    return tokens


def serving(weights: str, streams: list[int], max_tokens: int, cuda_graphs: bool = True) -> dict:
    from tests.e2e.server import Server

    out = {"cuda_graphs": cuda_graphs}
    for name, groups, nproc in (
        ("tp1_1gpu", [{"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill", "decode"]}], 1),
        ("tp2_2gpu", [{"node_names": ["LLM"], "ranks": [0, 1], "tp_size": 2, "graph_walks": ["prefill", "decode"]}], 2),
    ):
        server = Server(REPO / "launch/configs/moe_tp2.yaml", nproc, startup_timeout=600, overrides={
            "weights": weights, "node_groups": groups,
            "engine": {"max_seq_len": 1024, "max_batch": max(streams), "cuda_graphs": cuda_graphs}})
        try:
            stream_one(server.base_url, 0, 8)
            rows = {}
            for n in streams:
                t0 = time.perf_counter()
                with cf.ThreadPoolExecutor(n) as pool:
                    tokens = sum(pool.map(lambda i: stream_one(server.base_url, i, max_tokens), range(n)))
                rows[f"streams_{n}_tok_s"] = tokens / (time.perf_counter() - t0)
            out[name] = rows
            print(name, rows, flush=True)
        except Exception:
            print(server.log()[-6000:], flush=True)
            raise
        finally:
            server.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", nargs="?", default="all", choices=["all", "check"])
    p.add_argument("--weights", required=True)
    p.add_argument("--make", choices=["medium"])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out")
    args = p.parse_args()
    if args.what == "check":
        return check(args.weights)
    if args.make and not Path(args.weights, "config.json").exists():
        from models.moe.checkpoint import make_moe_checkpoint

        t0 = time.perf_counter()
        make_moe_checkpoint(args.weights, seed=0, writer="plain", **MEDIUM)
        print(f"medium MoE checkpoint written in {time.perf_counter() - t0:.0f} s", flush=True)
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           __file__, "check", "--weights", args.weights], capture_output=True, text=True, env=env,
                          timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        print(done.stdout[-3000:], done.stderr[-3000:])
        raise SystemExit("the NCCL check failed")
    result = {"nccl_check": json.loads(lines[-1])}
    print(result, flush=True)
    try:
        result["serving"] = serving(args.weights, args.streams, args.max_tokens)
    except Exception as exc:  # e.g. a decode graph that cannot capture the TP all-reduce: measure eager instead
        result["cuda_graphs_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        result["serving"] = serving(args.weights, args.streams, args.max_tokens, cuda_graphs=False)
    tp1, tp2 = result["serving"]["tp1_1gpu"], result["serving"]["tp2_2gpu"]
    result["tp2_over_tp1"] = {k: tp2[k] / tp1[k] for k in tp1 if k.startswith("streams")}
    result.update(command=" ".join(sys.argv), device=torch.cuda.get_device_name(0), torch=torch.__version__)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
