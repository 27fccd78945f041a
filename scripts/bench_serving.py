"""Serving benchmark: our deployment vs HF transformers ``generate`` vs a bare batched loop, side by side in one run.

    python scripts/bench_serving.py [--config launch/configs/smollm2_pd.yaml] [--rounds 3] [--max-tokens 64]

Measures, alternating the contenders round by round so machine noise hits them alike (medians reported):
- cold start: torchrun launch to ``/health`` 200 (weights already prepared);
- ours: output tok/s and TTFT with 1 stream (sequential streaming requests) and 8 concurrent streams;
- HF ``generate`` (greedy, batch 1) on the same weights and prompts: tok/s;
- bare loop (our model + KV cache, no serving; ``models/llama/bare_loop.py``) at batch 1 and 8: tok/s.
Ratios and the issue's targets go into the JSON (``--out``, default ``bench/results/serving_<device>.json``).
Every request asks for ``--max-tokens`` greedy tokens; all prompts are long-answer prompts so EOS rarely ends
them early, and tok/s counts the tokens actually produced.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.server import WEIGHTS, Server  # noqa: E402

PROMPTS = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a steam engine works, step by step.",
    "Describe a journey across the Sahara desert on a camel, day by day.",
    "Write a detailed essay about the history of the printing press.",
    "Tell me everything you know about the planets of the solar system.",
    "Write a long letter from a sailor to his family back home.",
    "Explain how bread is made, from growing wheat to baking the loaf.",
    "Describe a busy market in a medieval town in great detail.",
]


def stream_one(base_url: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """One streaming /generate request: (ttft seconds, total seconds, completion tokens)."""
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True,
            "model_kwargs": {"max_tokens": max_tokens, "temperature": 0}}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    with httpx.stream("POST", f"{base_url}/generate", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.strip():
                continue
            item = json.loads(line)
            meta = item.get("metadata", {})
            if item["modality"] == "error":
                raise RuntimeError(meta)
            if ttft is None and meta.get("n_tokens"):
                ttft = time.perf_counter() - t0
            if "usage" in meta:
                tokens = meta["usage"]["completion_tokens"]
    return ttft or 0.0, time.perf_counter() - t0, tokens


def ours(base_url: str, streams: int, max_tokens: int, n_requests: int) -> dict:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n_requests)]
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda p: stream_one(base_url, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    tokens = sum(r[2] for r in results)
    return {"tok_s": tokens / wall, "ttft_median_s": statistics.median(r[0] for r in results),
            "tokens": tokens, "seconds": wall}


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_generate(hf_model, ids_list: list[list[int]], max_tokens: int, device: str) -> dict:
    tokens, t0 = 0, time.perf_counter()
    for ids in ids_list:
        out = hf_model.generate(torch.tensor([ids], device=device), max_new_tokens=max_tokens, do_sample=False,
                                pad_token_id=0)
        tokens += out.shape[1] - len(ids)
    _sync(device)
    wall = time.perf_counter() - t0
    return {"tok_s": tokens / wall, "tokens": tokens, "seconds": wall}


def bare(model, cfg, ids_list: list[list[int]], batch: int, max_tokens: int, device: str, dtype) -> dict:
    from models.llama.bare_loop import bare_generate
    from mstar_dist.engine.kv_cache import StaticKVCache

    cache = StaticKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, max_slots=batch, max_seq_len=512,
                          dtype=dtype, device=device)
    tokens, wall = 0, 0.0
    for i in range(0, len(ids_list), batch):
        group = ids_list[i : i + batch]
        out, seconds = bare_generate(model, cache, group, max_tokens)
        tokens += len(group) * max_tokens
        wall += seconds
    return {"tok_s": tokens / wall, "tokens": tokens, "seconds": wall}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=str(REPO / "launch/configs/smollm2_pd.yaml"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cpu", help="cpu | cuda (the server picks CUDA by itself when present)")
    p.add_argument("--model", default=None, help="registry key override for the served config (e.g. llama)")
    args = p.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))

    from transformers import AutoModelForCausalLM

    from models.llama.tokenizer import ChatTokenizer
    from models.llama.weights import load_llama

    tok = ChatTokenizer(WEIGHTS)
    ids8 = [chat_ids(tok, p) for p in PROMPTS]
    hf_model = AutoModelForCausalLM.from_pretrained(WEIGHTS, torch_dtype=dtype).to(args.device).eval()
    our_model, cfg = load_llama(WEIGHTS, device=args.device, dtype=dtype)

    server = Server(args.config, nproc=args.nproc, overrides={"model": args.model} if args.model else None)
    cold_start = server.ready_seconds
    rows: dict[str, list[dict]] = {k: [] for k in ("ours_1", "ours_8", "hf_1", "bare_1", "bare_8")}
    try:
        ours(server.base_url, 1, 8, 1)  # warm the path once
        for r in range(args.rounds):
            rows["ours_1"].append(ours(server.base_url, 1, args.max_tokens, 4))
            rows["ours_8"].append(ours(server.base_url, 8, args.max_tokens, 16))
            with torch.inference_mode():
                rows["hf_1"].append(hf_generate(hf_model, ids8[:4], args.max_tokens, args.device))
                rows["bare_1"].append(bare(our_model, cfg, ids8[:4], 1, args.max_tokens, args.device, dtype))
                rows["bare_8"].append(bare(our_model, cfg, ids8 + ids8, 8, args.max_tokens, args.device, dtype))
            print(f"round {r}: " + ", ".join(f"{k}={v[-1]['tok_s']:.1f}" for k, v in rows.items()), flush=True)
    finally:
        server.stop()

    med = {k: statistics.median(x["tok_s"] for x in v) for k, v in rows.items()}
    ratios = {
        "ours_8_over_hf_1": med["ours_8"] / med["hf_1"],
        "ours_8_over_bare_8": med["ours_8"] / med["bare_8"],
        "ours_1_over_hf_1": med["ours_1"] / med["hf_1"],
        "ours_1_over_bare_1": med["ours_1"] / med["bare_1"],
    }
    targets = {
        "ours_8_over_hf_1 >= 1.5": ratios["ours_8_over_hf_1"] >= 1.5,
        "ours_8_over_bare_8 >= 0.85": ratios["ours_8_over_bare_8"] >= 0.85,
        "ours_1_over_hf_1 >= 0.7": ratios["ours_1_over_hf_1"] >= 0.7,
        "cold_start_s <= 20": cold_start <= 20,
    }
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "config": args.config,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "loadavg_1m": os.getloadavg()[0], "device": args.device,
                    "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None},
        "weights": WEIGHTS,
        "max_tokens": args.max_tokens,
        "cold_start_to_health_s": cold_start,
        "median_tok_s": med,
        "ttft_median_s": {k: statistics.median(x["ttft_median_s"] for x in rows[k]) for k in ("ours_1", "ours_8")},
        "ratios": ratios,
        "targets_met": targets,
        "rounds": rows,
    }
    out = Path(args.out or REPO / f"bench/results/serving_{args.device.split(':')[0]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("cold_start_to_health_s", "median_tok_s", "ttft_median_s", "ratios",
                                             "targets_met")}, indent=2))


if __name__ == "__main__":
    main()
