"""Streaming edges, consumer side (docs/architecture.md §4): a buffer that turns a producer's items into the consumer's chunks.

The producer partition emits values on a streaming edge; each value lands in the consumer's :class:`StreamBuffer`
as one or more *items* (rows along dim 0 of a tensor). A chunk policy decides when a chunk is ready; a chunk is
a contiguous range of items concatenated along dim 0.

Rules every policy shares:

* The regular chunks are a pure function of the item sequence and the policy: how pushes are split and when
  :meth:`StreamBuffer.pop_ready` is called never changes them (the same request gives the same chunks on any
  placement).
* After :meth:`StreamBuffer.producer_done` the buffer emits exactly one chunk with ``is_final=True``, holding what
  is left (empty when nothing is: a consumer always gets its final iteration), and nothing after it. The final
  chunk is always a chunk of its own, after the regular ones; a regular chunk is never re-marked final.
  Exception: ``Fixed(continue_after_done=True)`` never emits a final chunk (see :class:`Fixed`).
* ``Chunk.n_context`` is the number of leading items of ``data`` that an earlier chunk already delivered;
  ``data[n_context:]`` are new items. Over the whole stream the new items are every pushed item exactly once, in
  order (:class:`SlidingWindow` with ``stride < window`` and an early producer done included).

Items are tensors; all pushes of one buffer must agree on trailing shape, dtype and device. The buffer keeps the
pushed tensors as segments and concatenates once per chunk, so a stream costs O(items) plus O(chunk size) per
chunk, not O(items) per push.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Union

import torch


def _check_int(policy: str, field_name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{policy}: {field_name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class SlidingWindow:
    """Each chunk is the last ``window`` items, one every ``stride`` new items.

    Regular chunk k holds items ``[k*stride, k*stride + window)`` and is ready once that many items are in; so the
    first chunk waits for ``window`` items and consecutive chunks overlap by ``window - stride``
    (``n_context``). At producer done the final chunk is the last ``min(window, total)`` items if any item was
    never delivered, else empty.
    """

    window: int
    """Items per chunk."""
    stride: int
    """New items between consecutive chunks; ``<= window`` so that no item is skipped."""

    def __post_init__(self):
        _check_int("SlidingWindow", "window", self.window, minimum=1)
        _check_int("SlidingWindow", "stride", self.stride, minimum=1)
        if self.stride > self.window:
            raise ValueError(f"SlidingWindow: stride ({self.stride}) must be <= window ({self.window}), "
                             f"otherwise items between windows never reach the consumer")

    def bounds(self, k: int) -> tuple[int, int]:
        start = k * self.stride
        return start, start + self.window

    def final_start(self, total: int, delivered: int) -> int:
        return max(0, total - self.window)

    @property
    def lookback(self) -> int:
        return self.window - 1

    emits_final = True


@dataclass(frozen=True)
class LeftContext:
    """Chunks of ``chunk`` new items, each prefixed by up to ``left_context`` items before them.

    Regular chunk k holds new items ``[k*chunk, (k+1)*chunk)`` preceded by context
    ``[max(0, k*chunk - left_context), k*chunk)``; the first chunk has no context. The final chunk holds the
    undelivered remainder with the same context rule, or is empty (no context either) when nothing is left.
    """

    chunk: int
    """New items per chunk."""
    left_context: int
    """Most items of context before each chunk's new items; 0 makes this :class:`Fixed`."""

    def __post_init__(self):
        _check_int("LeftContext", "chunk", self.chunk, minimum=1)
        _check_int("LeftContext", "left_context", self.left_context, minimum=0)

    def bounds(self, k: int) -> tuple[int, int]:
        return max(0, k * self.chunk - self.left_context), (k + 1) * self.chunk

    def final_start(self, total: int, delivered: int) -> int:
        return max(0, delivered - self.left_context)

    @property
    def lookback(self) -> int:
        return self.left_context

    emits_final = True


@dataclass(frozen=True)
class Fixed:
    """Non-overlapping chunks of exactly ``chunk`` items; at producer done the remainder is the final chunk.

    With ``continue_after_done`` the consumer goes on running on its own after the producer is done (e.g. a
    talker that keeps decoding once the text is complete), so the buffer never emits a final chunk: at producer
    done a non-empty remainder (fewer than ``chunk`` items) is emitted as one last *short* chunk with
    ``is_final=False`` and nothing is emitted when there is no remainder. Items are never dropped. Either way
    :attr:`StreamBuffer.done` turns true once the remainder (if any) is popped; the consumer learns that its
    input has ended from ``done`` (or ``producer_is_done``), not from a chunk.
    """

    chunk: int
    """Items per chunk."""
    continue_after_done: bool = False
    """No final chunk: the consumer keeps running after the producer is done (see class docstring)."""

    def __post_init__(self):
        _check_int("Fixed", "chunk", self.chunk, minimum=1)
        if not isinstance(self.continue_after_done, bool):
            raise ValueError(f"Fixed: continue_after_done must be a bool, got {self.continue_after_done!r}")

    def bounds(self, k: int) -> tuple[int, int]:
        return k * self.chunk, (k + 1) * self.chunk

    def final_start(self, total: int, delivered: int) -> int:
        return delivered

    @property
    def lookback(self) -> int:
        return 0

    @property
    def emits_final(self) -> bool:
        return not self.continue_after_done


ChunkPolicy = Union[SlidingWindow, LeftContext, Fixed]
"""What :class:`StreamBuffer` asks of a policy (all in item indices of the stream, 0 = first item pushed):
``bounds(k) -> (start, end)`` of regular chunk k (ready once ``end`` items are in); ``final_start(total,
delivered)``, where the final chunk ``[start, total)`` begins when ``delivered < total`` items were delivered as
new; ``lookback``, the most items before ``delivered`` any later chunk may start at (what the buffer keeps);
``emits_final``."""


@dataclass(frozen=True)
class Chunk:
    """One consumer iteration's input on a streaming edge."""

    data: torch.Tensor
    """Items ``(n, ...)`` concatenated along dim 0; a fresh tensor, never a view of a pushed one. An empty chunk
    is ``(0, *item_shape)`` of the stream's dtype and device, or ``torch.empty(0)`` if nothing was ever pushed."""
    n_context: int
    """Leading items of ``data`` already delivered by an earlier chunk; ``data[n_context:]`` are new."""
    is_final: bool
    """The last chunk of the stream (producer done); may be empty."""
    index: int
    """Position in the stream: 0, 1, 2, ... over regular and final chunks alike."""

    @property
    def new(self) -> torch.Tensor:
        return self.data[self.n_context:]


class StreamBuffer:
    """Consumer-side buffer of one streaming edge for one request. Not thread-safe; nothing here blocks."""

    def __init__(self, policy: ChunkPolicy):
        if not isinstance(policy, (SlidingWindow, LeftContext, Fixed)):
            raise TypeError(f"not a chunk policy: {policy!r}")
        self.policy = policy
        self._segments: deque[tuple[int, torch.Tensor]] = deque()  # (index of first item, items (n, ...))
        self._total = 0  # items pushed
        self._delivered = 0  # items delivered as new (end of the last emitted chunk)
        self._next_k = 0  # next regular chunk
        self._n_emitted = 0
        self._empty: torch.Tensor | None = None  # (0, *item_shape) template: dtype, trailing shape, device
        self._producer_done = False
        self._finished = False

    # ---- producer side ----
    def push(self, items: torch.Tensor) -> None:
        """Append ``items.shape[0]`` items (shape ``(n, ...)``; ``n == 0`` only fixes shape, dtype and device).

        The buffer keeps a reference, not a copy: the producer must not modify ``items`` afterwards (clone first
        when pushing from a reused buffer, e.g. a CUDA graph's static output). Raises ``RuntimeError`` after
        :meth:`producer_done`, ``ValueError`` when shape, dtype or device differ from earlier pushes.
        """
        if self._producer_done:
            raise RuntimeError("StreamBuffer.push after producer_done()")
        if not isinstance(items, torch.Tensor) or items.dim() == 0:
            raise ValueError(f"push takes a tensor of shape (n, ...); use push_one for a single item, "
                             f"got {type(items).__name__} {getattr(items, 'shape', '')}")
        self._check_like(items)
        if items.shape[0]:
            self._segments.append((self._total, items))
            self._total += items.shape[0]

    def push_one(self, item: torch.Tensor) -> None:
        """Append one item (any shape, 0-d included): the same as ``push(item.unsqueeze(0))``."""
        if not isinstance(item, torch.Tensor):
            raise ValueError(f"push_one takes a tensor, got {type(item).__name__}")
        self.push(item.unsqueeze(0))

    def producer_done(self) -> None:
        """The producer will push nothing more; the next :meth:`pop_ready` ends the stream."""
        if self._producer_done:
            raise RuntimeError("StreamBuffer.producer_done called twice")
        self._producer_done = True

    # ---- consumer side ----
    def pop_ready(self) -> list[Chunk]:
        """Chunks ready now, in stream order (possibly none); each is returned once."""
        chunks = []
        while not self._finished:
            start, end = self.policy.bounds(self._next_k)
            if end <= self._total:
                chunks.append(self._emit(start, end, is_final=False))
                self._next_k += 1
            elif self._producer_done:
                chunks.extend(self._emit_end())
                self._finished = True
            else:
                break
        return chunks

    @property
    def has_ready(self) -> bool:
        """Whether :meth:`pop_ready` would return at least one chunk now."""
        if self._finished:
            return False
        if self.policy.bounds(self._next_k)[1] <= self._total:
            return True
        return self._producer_done and (self.policy.emits_final or self._total > self._delivered)

    @property
    def producer_is_done(self) -> bool:
        return self._producer_done

    @property
    def done(self) -> bool:
        """Producer done and every chunk (the final one included) returned by :meth:`pop_ready`."""
        return self._finished or (self._producer_done and not self.has_ready)

    @property
    def n_pushed(self) -> int:
        return self._total

    # ---- internals ----
    def _emit_end(self) -> list[Chunk]:
        """What producer done adds after the regular chunks: the final chunk, or the remainder (see Fixed)."""
        final = self.policy.emits_final
        if self._total == self._delivered:
            return [self._emit(self._total, self._total, is_final=True)] if final else []
        start = self.policy.final_start(self._total, self._delivered)
        return [self._emit(start, self._total, is_final=final)]

    def _emit(self, start: int, end: int, *, is_final: bool) -> Chunk:
        assert start <= self._delivered <= end, (start, self._delivered, end)
        chunk = Chunk(data=self._gather(start, end), n_context=self._delivered - start, is_final=is_final,
                      index=self._n_emitted)
        self._n_emitted += 1
        self._delivered = max(self._delivered, end)
        # Drop segments that no later chunk can reach: a chunk starts at most `lookback` items before `delivered`.
        keep_from = self._delivered - self.policy.lookback
        while self._segments and self._segments[0][0] + self._segments[0][1].shape[0] <= keep_from:
            self._segments.popleft()
        return chunk

    def _gather(self, start: int, end: int) -> torch.Tensor:
        """Items ``[start, end)`` as one new tensor; reads only the segments that overlap the range."""
        if start == end:
            return self._empty.clone() if self._empty is not None else torch.empty(0)
        parts = []
        for seg_start, seg in self._segments:
            seg_end = seg_start + seg.shape[0]
            if seg_end <= start:
                continue
            if seg_start >= end:
                break
            parts.append(seg[max(start, seg_start) - seg_start:min(end, seg_end) - seg_start])
        assert sum(p.shape[0] for p in parts) == end - start, (start, end)
        return torch.cat(parts)

    def _check_like(self, items: torch.Tensor) -> None:
        if self._empty is None:
            self._empty = items.new_empty((0, *items.shape[1:]))
            return
        e = self._empty
        if items.shape[1:] != e.shape[1:] or items.dtype != e.dtype or items.device != e.device:
            raise ValueError(f"pushed items of shape {tuple(items.shape[1:])}, dtype {items.dtype}, device "
                             f"{items.device}; this stream holds shape {tuple(e.shape[1:])}, dtype {e.dtype}, "
                             f"device {e.device}")
