"""CUDA-graph replay of one decode step (docs/architecture.md §8: an eager decode step is host-launch-bound on our GPUs).

One graph per (batch-size bucket, context bucket): batch 1, 2, 4, ... up to the engine's batch; context 512,
2048, ... (x4) up to the cache's ``max_seq_len``, the positions a row's attention reads. Captured at warm-up over
static input tensors: tokens (B, 1), positions (B,), slots (B,) -> last-token logits (B, 1, V). A step of n rows
whose longest row writes position p replays the smallest batch bucket >= n and the smallest context bucket > p,
after copying its inputs in; the rows past n are padding that decode into a scratch KV slot at position 0 and
are ignored. Attention over a context bucket instead of the whole cache keeps a step's cost near what its
requests' lengths need (a 2048-position cache read by 300-token requests otherwise costs ~4x the attention).
Sampling stays outside the graph (per-request generators). Built on ``StaticKVCache.bind_graph``, whose
attention reads slots and positions on the device (no host syncs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar_dist.engine.kv_cache import StaticKVCache

CTX_BASE = 512
CTX_FACTOR = 4


def context_buckets(max_seq_len: int) -> list[int]:
    """512, 2048, 8192, ... below ``max_seq_len``, then ``max_seq_len`` itself."""
    buckets, ctx = [], CTX_BASE
    while ctx < max_seq_len:
        buckets.append(ctx)
        ctx *= CTX_FACTOR
    return [*buckets, max_seq_len]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    logits: torch.Tensor


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, cache: StaticKVCache, scratch_slot: int, max_batch: int):
        self.model = model
        self.cache = cache
        self.scratch = scratch_slot
        self.buckets = [1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch]
        if self.buckets[-1] != max_batch:
            self.buckets.append(max_batch)
        self.contexts = context_buckets(cache.max_seq_len)
        self._captured: dict[tuple[int, int], _Captured] = {}

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory pool). Blocks for a few seconds."""
        device = self.cache.device
        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.buckets, reverse=True):
            for ctx in sorted(self.contexts, reverse=True):
                tokens = torch.zeros((bucket, 1), dtype=torch.long, device=device)
                positions = torch.zeros(bucket, dtype=torch.long, device=device)
                slots = torch.full((bucket,), self.scratch, dtype=torch.long, device=device)
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):  # warm the kernels (and cuBLAS workspaces) outside the capture
                    for _ in range(2):
                        self._forward(tokens, positions, slots, ctx)
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(tokens, positions, slots, ctx)
                self._captured[(bucket, ctx)] = _Captured(graph, tokens, positions, slots, logits)

    def close(self) -> None:
        """Destroy the graphs (after the device has finished the last replay). With TP they captured NCCL
        all-reduces, which hold the TP group's communicator until the graphs go (see ``Component.close``)."""
        if self._captured:
            torch.cuda.synchronize(self.cache.device)
        self._captured.clear()

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, ctx: int) -> torch.Tensor:
        self.cache.bind_graph(slots, positions, ctx)
        return self.model(tokens, positions[:, None], self.cache, last_only=True)

    def bucket_for(self, n: int, longest: int) -> tuple[int, int]:
        """(batch bucket, context bucket) of a step of ``n`` rows whose highest written position is ``longest``."""
        return (next(b for b in self.buckets if b >= n), next(c for c in self.contexts if c > longest))

    def logits(self, tokens: torch.Tensor, positions: list[int], slots: list[int]) -> torch.Tensor:
        """Last-token logits (n, 1, V) of one decode step for n <= max_rows rows, each writing the position given
        (below the cache's ``max_seq_len``); valid until the next call."""
        n = len(slots)
        bucket, ctx = self.bucket_for(n, max(positions))
        cap = self._captured[(bucket, ctx)]
        pad = bucket - n
        cap.tokens[:n, 0].copy_(tokens.reshape(-1))
        # through pinned memory: a copy from pageable memory may wait for the queue (a step launched ahead)
        cap.positions[:n].copy_(torch.tensor(positions, dtype=torch.long).pin_memory(), non_blocking=True)
        cap.slots[:n].copy_(torch.tensor(slots, dtype=torch.long).pin_memory(), non_blocking=True)
        if pad:
            cap.tokens[n:].zero_()
            cap.positions[n:].zero_()
            cap.slots[n:].fill_(self.scratch)
        cap.graph.replay()
        return cap.logits[:n]
