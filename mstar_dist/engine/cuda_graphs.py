"""CUDA-graph replay of decode steps and of batched prefills (docs/architecture.md §8: an eager forward of a small
model is host-launch-bound, a kernel launch per op; a replay is one launch).

Decode (``DecodeGraphs``):
One graph per (batch-size bucket, context bucket): batch 1, 2, 4, ... up to the engine's batch; context 256,
512, 1024, ... (x2) up to the cache's ``max_seq_len``, the positions a row's attention reads (with the cache's
``decode_kernel``, which reads each row's own length, two: up to 512 positions, and above them, where a small batch
splits each row's positions over several programs, ``decode_attention.kernel_contexts``). Captured at warm-up over
static input tensors: tokens (B, 1), positions (B,), slots (B,) -> last-token logits (B, 1, V). A step of n rows
whose longest row writes position p replays the smallest batch bucket >= n and the smallest context bucket > p,
after copying its inputs in; the rows past n are padding that decode into a scratch KV slot at position 0 and
are ignored. Attention over a context bucket instead of the whole cache keeps a step's cost near what its
requests' lengths need (a whole long cache read by short requests would cost several times the attention).
Sampling stays outside the graph (per-request generators). Built on ``StaticKVCache.bind_graph``, whose
attention reads slots and positions on the device (no host syncs). For a model with position offsets
(``offsets``) the rotary positions are a third static input beside the written positions (a multimodal request's
differ: kv_engine's ``position_offset``); a text model's graphs have two.

Prefill (``PrefillGraphs``): one graph per (rows bucket, length bucket): rows 1, 2, 4, 6, 8, 12, 16, 24, ... up to the
engine's batch, lengths 16, 24, 32, 48, 64, 96, ... up to the cache's ``max_seq_len`` (half steps between powers of two:
a batch pads by at most a third), every pair whose padded size rows x length is within the engine's prefill token
budget. Static inputs: ids (R, L), slots (R,), each row's last index (R,) -> the logits of each
row's last token (R, 1, V). Prompts are right-padded to the bucket's length (pad positions are written into the
row's slot past its prompt, where decode overwrites them before reading), padding rows prefill token 0 into the
scratch slot. The three inputs are views of one device buffer, so prompts that are on the host reach it in one copy
from one pinned buffer (a copy per prompt would cost host time per prompt at every launch).
Built on ``StaticKVCache.bind_prefill_graph`` (attention over the new tokens, causal, from position 0).
A batch no bucket holds runs eagerly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from mstar_dist.engine.decode_attention import kernel_contexts
from mstar_dist.engine.kv_cache import StaticKVCache
from mstar_dist.engine.prefill import PREFILL_ATTENTION
from mstar_dist.engine.sampling import to_device

PREFILL_MIN_LENGTH = 16

CTX_BASE = 256
CTX_FACTOR = 2
"""Decode context buckets 256, 512, 1024, ...: a step reads each row's keys and values over its bucket, and with
SDPA that copy out of the cache is a large share of the step's device time; buckets that double copy at most twice
what the longest row needs, for a graph per bucket."""


def context_buckets(max_seq_len: int) -> list[int]:
    """256, 512, 1024, ... below ``max_seq_len``, then ``max_seq_len`` itself."""
    buckets, ctx = [], CTX_BASE
    while ctx < max_seq_len:
        buckets.append(ctx)
        ctx *= CTX_FACTOR
    return [*buckets, max_seq_len]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor
    rows: torch.Tensor
    """(2 * B,) long: positions, then slots (then rotary positions, with offsets), so that a step's host inputs
    reach the device in one copy."""
    positions: torch.Tensor
    slots: torch.Tensor
    logits: torch.Tensor


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, cache: StaticKVCache, scratch_slot: int, max_batch: int,
                 offsets: bool = False):
        """``offsets``: the model's rotary positions may differ from the positions written (``logits``' ``rope``)."""
        self.model = model
        self.cache = cache
        self.scratch = scratch_slot
        self.offsets = offsets
        self.buckets = _pow2_buckets(max_batch)
        limit = cache.max_seq_len
        self.contexts = kernel_contexts(limit) if cache.decode_kernel else context_buckets(limit)
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
                rows = torch.zeros((3 if self.offsets else 2) * bucket, dtype=torch.long, device=device)
                positions, slots = rows[:bucket], rows[bucket:2 * bucket]
                rope = rows[2 * bucket:] if self.offsets else positions
                slots.fill_(self.scratch)
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):  # warm the kernels (and cuBLAS workspaces) outside the capture
                    for _ in range(2):
                        self._forward(tokens, positions, slots, ctx, rope)
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(tokens, positions, slots, ctx, rope)
                self._captured[(bucket, ctx)] = _Captured(graph, tokens, rows, positions, slots, logits)
        for bucket in self.buckets:  # the host buffers a step of each batch bucket pins (pinned memory's first use)
            self.logits(torch.zeros(bucket, dtype=torch.long, device=device), [0] * bucket, [self.scratch] * bucket)
        _replay_once(self._captured.values(), device)

    def close(self) -> None:
        """Destroy the graphs (after the device has finished the last replay). With TP they captured NCCL
        all-reduces, which hold the TP group's communicator until the graphs go (see ``Component.close``)."""
        if self._captured:
            torch.cuda.synchronize(self.cache.device)
        self._captured.clear()

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, ctx: int,
                 rope: torch.Tensor) -> torch.Tensor:
        self.cache.bind_graph(slots, positions, ctx)
        return self.model(tokens, rope[:, None], self.cache, last_only=True)

    def bucket_for(self, n: int, longest: int) -> tuple[int, int]:
        """(batch bucket, context bucket) of a step of ``n`` rows whose highest written position is ``longest``."""
        return (next(b for b in self.buckets if b >= n), next(c for c in self.contexts if c > longest))

    def logits(self, tokens: torch.Tensor, positions: list[int], slots: list[int],
               rope: list[int] | None = None) -> torch.Tensor:
        """Last-token logits (n, 1, V) of one decode step for n <= max_rows rows, each writing the position given
        (below the cache's ``max_seq_len``), rotated by ``rope`` (default: the same positions; other values only
        with ``offsets``); valid until the next call."""
        n = len(slots)
        bucket, ctx = self.bucket_for(n, max(positions))
        cap = self._captured[(bucket, ctx)]
        pad = bucket - n
        cap.tokens[:n, 0].copy_(tokens.reshape(-1))
        # padding rows write position 0 of the scratch slot; one copy through pinned memory (a copy from pageable
        # memory may wait for the queue: a step launched ahead)
        host = [*positions, *[0] * pad, *slots, *[self.scratch] * pad]
        if self.offsets:
            host += [*(positions if rope is None else rope), *[0] * pad]
        elif rope is not None:
            raise ValueError("DecodeGraphs: rotary positions given to graphs captured without offsets")
        cap.rows.copy_(torch.tensor(host, dtype=torch.long).pin_memory(), non_blocking=True)
        if pad:
            cap.tokens[n:].zero_()
        cap.graph.replay()
        return cap.logits[:n]


def _replay_once(captured, device: torch.device) -> None:
    """Replay every graph once after capture (their inputs still hold the scratch slot's padding, so only that slot is
    written): a graph's first replay costs the host more than its next ones, which would otherwise land on the first
    requests to use each bucket."""
    for cap in captured:
        cap.graph.replay()
    torch.cuda.synchronize(device)


def _pow2_buckets(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit``, and ``limit`` itself."""
    buckets = [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]
    return buckets if buckets[-1] == limit else [*buckets, limit]


def _half_steps(start: int, limit: int) -> list[int]:
    """``start``, 1.5 x ``start``, 2 x ``start``, 3 x ``start``, 4 x ``start``, ... up to ``limit``: the prefill
    buckets, so that a batch pads by at most a third (15 prompts of 46 tokens fill 16 x 48, not 16 x 64; 17 fill 24
    rows, not 32), and a replay's cost grows with its padded size."""
    out, n = [], start
    while n <= limit:
        out.append(n)
        if n * 3 // 2 <= limit:
            out.append(n * 3 // 2)
        n *= 2
    return out


@dataclass
class _CapturedPrefill:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor
    """(R * L + 2 * R,) long: ids, then slots, then each row's last index (``_input_views``)."""
    ids: torch.Tensor
    slots: torch.Tensor
    last: torch.Tensor
    logits: torch.Tensor


def _input_views(flat: torch.Tensor, rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (R, L), slots (R,) and last (R,) as views of one flat (R * L + 2 * R,) buffer."""
    n = rows * length
    return flat[:n].view(rows, length), flat[n : n + rows], flat[n + rows :]


class PrefillGraphs:
    """Prefill forwards replayed from CUDA graphs, one per (rows, length) bucket (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, cache: StaticKVCache, scratch_slot: int, max_rows: int,
                 max_tokens: int, attention: list | None = None):
        """``max_tokens``: the largest padded size (rows x length) captured; ``attention``: the SDPA backends the
        captured attention may use (``torch.nn.attention.sdpa_kernel``), as for an eager prefill."""
        self.model = model
        self.cache = cache
        self.scratch = scratch_slot
        self.attention = attention
        lengths = [n for n in _half_steps(PREFILL_MIN_LENGTH, min(cache.max_seq_len, max_tokens))
                   if n < cache.max_seq_len]
        if cache.max_seq_len <= max_tokens:
            lengths.append(cache.max_seq_len)  # a prompt is shorter than the cache: the last bucket holds it
        rows = [r for r in (1, 2, *_half_steps(4, max_rows)) if r <= max_rows]
        if rows[-1] != max_rows:
            rows.append(max_rows)
        self.buckets = [(r, length) for r in rows for length in lengths if r * length <= max_tokens]
        self._captured: dict[tuple[int, int], _CapturedPrefill] = {}

    def bucket_for(self, n: int, longest: int) -> tuple[int, int] | None:
        """The smallest (rows, length) bucket that holds ``n`` prompts of at most ``longest`` tokens (fewest padded
        tokens, then fewest rows), or None."""
        fits = [b for b in self.buckets if b[0] >= n and b[1] >= longest]
        return min(fits, key=lambda b: (b[0] * b[1], b[0])) if fits else None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool (they never run at once)."""
        from torch.nn.attention import sdpa_kernel

        device = self.cache.device
        pool = torch.cuda.graph_pool_handle()
        for rows, length in sorted(self.buckets, key=lambda b: b[0] * b[1], reverse=True):
            inputs = torch.zeros(rows * length + 2 * rows, dtype=torch.long, device=device)
            ids, slots, last = _input_views(inputs, rows, length)
            slots.fill_(self.scratch)
            with sdpa_kernel(self.attention) if self.attention else contextlib.nullcontext():
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):  # warm the kernels outside the capture
                    self._forward(ids, slots, last)
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(ids, slots, last)
            self._captured[(rows, length)] = _CapturedPrefill(graph, inputs, ids, slots, last, logits)
        pad = torch.zeros(1, dtype=torch.long)
        for bucket in self.buckets:  # each bucket's pinned staging buffer and first replay (why: ``_replay_once``)
            self.logits([pad], [self.scratch], bucket)
        torch.cuda.synchronize(device)

    def close(self) -> None:
        if self._captured:
            torch.cuda.synchronize(self.cache.device)
        self._captured.clear()

    def _forward(self, ids: torch.Tensor, slots: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        rows, length = ids.shape
        self.cache.bind_prefill_graph(slots, length)
        positions = torch.arange(length, device=ids.device).expand(rows, length)
        return self.model(ids, positions, self.cache, last_only=True, last_index=last)

    def logits(self, prompts: list[torch.Tensor], slots: list[int], bucket: tuple[int, int]) -> torch.Tensor:
        """The last-token logits (n, 1, V) of ``prompts`` (each (T,), on the host or the device) prefilled into
        ``slots``, replayed from ``bucket`` (from ``bucket_for``) on the current stream; valid until the next call (the
        buckets share one memory pool, so another bucket's replay may write where this output lies: use it on this
        stream before then)."""
        cap = self._captured[bucket]
        n = len(prompts)
        if all(p.device.type == "cpu" for p in prompts):
            # laid out on the host and sent in one asynchronous copy (pinned: no wait for the work queued before it)
            staged = torch.zeros(cap.inputs.shape, dtype=torch.long, pin_memory=True)
            ids, staged_slots, last = _input_views(staged, *bucket)
            for row, prompt in enumerate(prompts):
                ids[row, : prompt.numel()] = prompt
            staged_slots[:n] = torch.tensor(slots, dtype=torch.long)
            staged_slots[n:] = self.scratch
            last[:n] = torch.tensor([p.numel() - 1 for p in prompts], dtype=torch.long)
            cap.inputs.copy_(staged, non_blocking=True)
            cap.graph.replay()
            return cap.logits[:n]
        prompts = [to_device(p, cap.ids.device) for p in prompts]  # a host one among them: no wait for the queue
        cap.ids.zero_()
        for row, prompt in enumerate(prompts):
            cap.ids[row, : prompt.numel()].copy_(prompt)
        # through pinned memory: a copy from pageable memory would wait for the queue (a decode step launched ahead)
        cap.slots[:n].copy_(torch.tensor(slots, dtype=torch.long).pin_memory(), non_blocking=True)
        cap.last[:n].copy_(torch.tensor([p.numel() - 1 for p in prompts], dtype=torch.long).pin_memory(),
                           non_blocking=True)
        if n < bucket[0]:
            cap.slots[n:].fill_(self.scratch)
            cap.last[n:].zero_()
        cap.graph.replay()
        return cap.logits[:n]



def build_graphs(model: torch.nn.Module, cache: StaticKVCache, *, prefill: bool, token_budget: int, offsets: bool
                 ) -> tuple[DecodeGraphs, PrefillGraphs | None]:
    """A KV engine's decode graphs (the cache's first free slot becomes their scratch slot), and with ``prefill``
    its prefill graphs within ``token_budget`` (None when no bucket fits it: batches are then cut as without graphs).
    ``offsets``: decode steps take position offsets (``DecodeGraphs``). ValueError on a device that is not CUDA."""
    if cache.device.type != "cuda":
        raise ValueError(f"cuda_graphs needs a CUDA device, got {cache.device}")
    graphs = DecodeGraphs(model, cache, scratch_slot=cache.alloc(), max_batch=cache.num_free, offsets=offsets)
    if not prefill:
        return graphs, None
    prefills = PrefillGraphs(model, cache, scratch_slot=graphs.scratch, max_rows=graphs.max_rows,
                             max_tokens=token_budget, attention=PREFILL_ATTENTION)
    return graphs, prefills if prefills.buckets else None
