"""What a CUDA graph's first replay and pinned host memory's first use cost the host, against the next ones.

    python scripts/bench_first_use.py [--kernels 400] [--out FILE]

In serving, the first prefill of each CUDA-graph bucket took 1.3-1.9 ms of host time to launch and its next ones
0.2-0.3 ms (docs/notes.md, thirteenth session). A launch does two things for the first time there: it replays a graph
that was captured but never replayed, and it stages its inputs in a pinned host buffer of a size not used before.
This times each alone, on a graph of ``--kernels`` small kernels (about a SmolLM2-135M forward's count) and on
pinned buffers of the sizes a prefill bucket stages (rows x 64 tokens + 2 x rows longs). Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def graph_of(kernels: int, device: torch.device) -> torch.cuda.CUDAGraph:
    x = torch.zeros(64, 576, device=device)
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        for _ in range(kernels):
            x.mul_(1.0001).add_(1.0)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels // 2):
            x.mul_(1.0001).add_(1.0)
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, device: torch.device) -> float:
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    graph.replay()
    t1 = time.perf_counter()
    torch.cuda.synchronize(device)
    return (t1 - t0) * 1e6


def pin_us(numel: int) -> float:
    t0 = time.perf_counter()
    t = torch.zeros(numel, dtype=torch.long, pin_memory=True)
    t1 = time.perf_counter()
    del t
    return (t1 - t0) * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", type=int, default=400)
    p.add_argument("--graphs", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    device = torch.device("cuda")
    graphs = [graph_of(args.kernels, device) for _ in range(args.graphs)]
    first = [replay_us(g, device) for g in graphs]
    second = [replay_us(g, device) for g in graphs]
    third = [replay_us(g, device) for g in graphs]
    sizes = [rows * 64 + 2 * rows for rows in (1, 2, 4, 8, 16, 32, 64)]
    pin_first = {n * 8: pin_us(n) for n in sizes}
    pin_again = {n * 8: pin_us(n) for n in sizes}
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "kernels_per_graph": args.kernels,
        "graph_replay_host_us": {"first_median": statistics.median(first), "second_median": statistics.median(second),
                                 "third_median": statistics.median(third), "first": first, "second": second},
        "pinned_alloc_host_us": {"first": pin_first, "again": pin_again},
    }
    print(json.dumps({k: v for k, v in result.items() if k != "command"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
