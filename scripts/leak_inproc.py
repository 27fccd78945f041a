"""Per-request memory growth of the runtime itself, without processes, sockets or GPUs: a conductor and one worker
in one process (tests/inproc.py) serve random short requests for SECONDS; prints RSS every 1,000 requests and, with
``--tracemalloc``, the Python allocations that grew most (where they were made).

    python scripts/leak_inproc.py [--model qwen3_moe --weights ~/.cache/mstar_dist/qwen3-moe-tiny] [--seconds 300]

A leak keeps growing to the end; caches and bounded tables (e.g. the worker's memory of the last 100,000 removed
request ids) level off. Not a test: a soak companion (bench/results/README.md, "Fifth session").
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from mstar_dist.config.deployment import parse_config  # noqa: E402
from mstar_dist.server.backend import GenerationParams  # noqa: E402
from mstar_dist.telemetry import process_sample  # noqa: E402
from mstar_dist.runtime.deployment import Deployment  # noqa: E402
from tests.inproc import InProcDeployment  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()


def rss_mib() -> float:
    return process_sample()["rss_bytes"] / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3_moe")
    p.add_argument("--weights", default="~/.cache/mstar_dist/qwen3-moe-tiny")
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--tracemalloc", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = {"model": args.model, "model_kwargs": {"max_seq_len": 1024, "max_batch": 8},
           "weights": os.path.expanduser(args.weights),
           "node_groups": [{"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill", "decode"]}]}
    dep = Deployment.build(parse_config(cfg, "leak_inproc"), 1, 1)
    dep.model.load_frontend()
    served = InProcDeployment(dep.model, cfg, 1)
    rng, done = random.Random(0), 0

    def wave(k: int = 8) -> None:
        nonlocal done
        served.run([GenerationParams(request_id=f"r{done + i:031d}", messages=None, max_tokens=rng.randint(1, 8),
                                     prompt=" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))))
                    for i in range(k)], max_turns=100_000)
        done += k

    for _ in range(30):  # warm-up, untracked
        wave()
    gc.collect()
    if args.tracemalloc:
        tracemalloc.start(8)
        before = tracemalloc.take_snapshot()
    start, start_rss, mark, t0 = done, rss_mib(), done, time.monotonic()
    while time.monotonic() - t0 < args.seconds:
        wave()
        if done - mark >= 1000:
            mark = done
            print(f"{done} requests: RSS {rss_mib():.1f} MiB", flush=True)
    gc.collect()
    end_rss = rss_mib()
    print(f"requests {start} -> {done}: RSS {start_rss:.1f} -> {end_rss:.1f} MiB "
          f"({(end_rss - start_rss) * 1024 / max(1, done - start):.2f} KiB per request)")
    if args.tracemalloc:
        for stat in tracemalloc.take_snapshot().compare_to(before, "traceback")[:8]:
            print(f"{stat.size_diff:+d} B in {stat.count_diff:+d} blocks, made at:")
            for line in stat.traceback.format()[-6:]:
                print("   ", line)


if __name__ == "__main__":
    main()
