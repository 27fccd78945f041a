"""CUDA-graph replay of decode steps and of batched prefills (docs/architecture.md §8: an eager forward of a small
model is host-launch-bound on our GPUs; an eager SmolLM2 prefill of one 44-token prompt took 10 ms on an H200).

Decode (``DecodeGraphs``):
One graph per (batch-size bucket, context bucket): batch 1, 2, 4, ... up to the engine's batch; context 512,
2048, ... (x4) up to the cache's ``max_seq_len``, the positions a row's attention reads. Captured at warm-up over
static input tensors: tokens (B, 1), positions (B,), slots (B,) -> last-token logits (B, 1, V). A step of n rows
whose longest row writes position p replays the smallest batch bucket >= n and the smallest context bucket > p,
after copying its inputs in; the rows past n are padding that decode into a scratch KV slot at position 0 and
are ignored. Attention over a context bucket instead of the whole cache keeps a step's cost near what its
requests' lengths need (a 2048-position cache read by 300-token requests otherwise costs ~4x the attention).
Sampling stays outside the graph (per-request generators). Built on ``StaticKVCache.bind_graph``, whose
attention reads slots and positions on the device (no host syncs).

Prefill (``PrefillGraphs``): packed, one graph per token bucket (64, 128, ... up to the engine's prefill token budget,
``token_buckets``). The prompts of one forward lie back to back in one row of T tokens, each from position 0; each
token attends to the earlier tokens of its own prompt only (a block-diagonal causal mask,
``StaticKVCache.bind_packed``) and writes its K/V at (its prompt's slot, its position). The tokens past the prompts are
padding (token 0, position 0, the scratch slot, a sequence of their own). Static inputs: one long tensor holding ids,
positions, slots and sequence ids (T each), then each row's last token (R = the engine's batch) -> the logits of each
row's last token (R, 1, V). A batch costs the tokens it has, rounded up to a bucket, not rows x its longest prompt
rounded up twice: a 17-prompt wave of ~44-token prompts packs ~750 tokens into 768, where (rows, length) buckets
padded it to 32 x 64 = 2048. One copy to the device carries all the inputs. A batch no bucket holds runs eagerly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from mstar_dist.engine.kv_cache import StaticKVCache

PREFILL_MIN_TOKENS = 64

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
        self.buckets = _pow2_buckets(max_batch)
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


def _pow2_buckets(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit``, and ``limit`` itself."""
    buckets = [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]
    return buckets if buckets[-1] == limit else [*buckets, limit]


def token_buckets(max_tokens: int) -> list[int]:
    """Packed prefill sizes: 64, 128, ... 512 in steps of 64, then steps of a quarter of the previous power of two
    (640, 768, 896, 1024, 1280, ...), up to ``max_tokens`` (itself the last one when it falls between, or the only
    one below 64): a batch's
    padding stays under 25% of what it packs (under 64 tokens for small batches)."""
    sizes, n = [], PREFILL_MIN_TOKENS
    while n < max_tokens:
        sizes.append(n)
        step = PREFILL_MIN_TOKENS if n < 512 else (1 << (n.bit_length() - 1)) // 4
        n += step
    return [*sizes, max_tokens] if max_tokens > 0 else []


@dataclass
class _CapturedPrefill:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor
    """(4 T + 2 R + 1,) long: ids, positions, slots and sequence ids of the T packed tokens, each row's last token, the
    sequences' boundaries."""
    logits: torch.Tensor
    staging: list[torch.Tensor]
    """Two pinned host buffers of ``inputs``' size, used in turn: a batch's inputs are written there and cross in
    one copy. Allocated at capture: a first pinned allocation of a size on the serving path costs milliseconds."""
    copied: list[object]
    """Per staging buffer, a CUDA event after the last copy out of it (None: never used)."""
    turn: int = 0


class PrefillGraphs:
    """Packed prefill forwards replayed from CUDA graphs, one per token bucket (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, cache: StaticKVCache, scratch_slot: int, max_rows: int,
                 max_tokens: int, attention: list | None = None):
        """``max_rows``: the most prompts one forward packs; ``max_tokens``: the largest bucket (the engine's prefill
        token budget); ``attention``: the SDPA backends the captured attention may use
        (``torch.nn.attention.sdpa_kernel``), as for an eager prefill."""
        self.model = model
        self.cache = cache
        self.scratch = scratch_slot
        self.attention = attention
        self.max_rows = max_rows
        self.buckets = token_buckets(min(max_tokens, cache.max_seq_len * max_rows))
        self._captured: dict[int, _CapturedPrefill] = {}

    def bucket_for(self, lengths: list[int]) -> int | None:
        """The smallest token bucket that packs prompts of these lengths, or None (too many prompts or tokens)."""
        total = sum(lengths)
        if len(lengths) > self.max_rows or not self.buckets or total > self.buckets[-1]:
            return None
        return next(b for b in self.buckets if b >= total)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool (they never run at once)."""
        from torch.nn.attention import sdpa_kernel

        device = self.cache.device
        pool = torch.cuda.graph_pool_handle()
        for tokens in sorted(self.buckets, reverse=True):
            inputs = self._host_inputs([], [], tokens).to(device)  # padding only: the shapes are what is captured
            with sdpa_kernel(self.attention) if self.attention else contextlib.nullcontext():
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):  # warm the kernels outside the capture
                    self.forward(inputs, tokens)
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.forward(inputs, tokens)
            staging = [torch.empty_like(inputs, device="cpu").pin_memory() for _ in range(2)]
            self._captured[tokens] = _CapturedPrefill(graph, inputs, logits, staging, [None, None])

    def close(self) -> None:
        if self._captured:
            torch.cuda.synchronize(self.cache.device)
        self._captured.clear()

    def forward(self, inputs: torch.Tensor, tokens: int) -> torch.Tensor:
        """The packed forward of ``inputs`` (from ``_host_inputs``, on the cache's device) -> logits (R, 1, V) of each
        row's last token; what a bucket's graph replays (eager on a CPU, for tests)."""
        ids, positions, slots, seqs = inputs[: 4 * tokens].view(4, tokens)
        rows = self.max_rows
        last = inputs[4 * tokens: 4 * tokens + rows]
        cu_seqlens = inputs[4 * tokens + rows:]
        self.cache.bind_packed(slots, positions, seqs, cu_seqlens, max_len=tokens)
        logits = self.model(ids[None], positions[None], self.cache, last_only=True, last_index=last[None])  # (1, R, V)
        return logits.view(-1, 1, logits.shape[-1])

    def _host_inputs(self, prompts: list, slots: list[int], tokens: int, out: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """The packed inputs of one forward on the host: ids, positions, slots and sequence ids of
        ``tokens`` tokens (the prompts back to back, then padding: id 0, position 0, the scratch slot, sequence -1),
        each row's last token (rows past the prompts read token 0), and the sequences' boundaries (R + 1: the last
        prompt's sequence takes in the padding, the rest are empty); written into ``out`` when given."""
        rows = self.max_rows
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        used, n = int(lengths.sum()), len(prompts)
        if out is None:
            out = torch.empty(4 * tokens + 2 * rows + 1, dtype=torch.long)
        ids, positions, slot_of, seq_of = out[: 4 * tokens].view(4, tokens)
        if prompts and isinstance(prompts[0], torch.Tensor):
            torch.cat([p.reshape(-1) for p in prompts], out=ids[:used])
        elif prompts:
            ids[:used] = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
        ends = torch.cumsum(lengths, 0)
        starts = ends - lengths
        positions[:used] = torch.arange(used) - starts.repeat_interleave(lengths)
        slot_of[:used] = torch.tensor(slots, dtype=torch.long).repeat_interleave(lengths)
        seq_of[:used] = torch.arange(n).repeat_interleave(lengths)
        ids[used:], positions[used:], slot_of[used:], seq_of[used:] = 0, 0, self.scratch, -1
        last, cu_seqlens = out[4 * tokens: 4 * tokens + rows], out[4 * tokens + rows:]
        last[:n] = ends - 1
        last[n:] = 0
        cu_seqlens[0] = 0
        cu_seqlens[1:n] = ends[:-1]
        cu_seqlens[max(n, 1):] = tokens
        return out

    def logits(self, prompts: list[torch.Tensor], slots: list[int], bucket: int) -> torch.Tensor:
        """The last-token logits (n, 1, V) of ``prompts`` (each (T,)) prefilled into ``slots``, replayed from
        ``bucket`` (from ``bucket_for``); valid until the next call (the buckets share one memory pool, so another
        bucket's replay may write where this output lies: use it on this stream before then). Host prompts cross to
        the device in one copy with the rest of the inputs, through pinned memory (no wait for work queued ahead, such
        as a decode step launched ahead); prompts already on the device are packed there, on the current stream."""
        cap = self._captured[bucket]
        k = cap.turn = 1 - cap.turn
        if cap.copied[k] is not None:  # the copy out of this buffer two launches ago has run (it almost always has)
            cap.copied[k].synchronize()
        on_host = all(p.device.type == "cpu" for p in prompts)
        self._host_inputs(prompts if on_host else [range(p.numel()) for p in prompts], slots, bucket, cap.staging[k])
        cap.inputs.copy_(cap.staging[k], non_blocking=True)
        cap.copied[k] = torch.cuda.Event()
        cap.copied[k].record()
        if not on_host:
            torch.cat([p.reshape(-1).to(cap.inputs.device) for p in prompts],
                      out=cap.inputs[: sum(p.numel() for p in prompts)])
        cap.graph.replay()
        return cap.logits[: len(prompts)]
