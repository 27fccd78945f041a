"""What the arena transports (shm, mooncake) share: the ``ArenaTransport`` base (the whole ``DataPlane`` of a
transport that lends its own memory until the consumer acknowledges), a first-fit allocator over one buffer,
the table of slots lent to peers, host copies into the arena, and tensors that wrap arena bytes and report when
they are let go.

Lifetime of a slot (docs/architecture.md §7): the producer allocates it and copies the tensor in (or registers
the tensor's own memory), the descriptor names it, the consumer wraps (shm) or reads (mooncake) it and sends a
``TransferAck`` naming it, and only then does the producer free it. A peer declared dead gives back every slot
lent to it. Pure Python, no locks: used from the rank's worker thread; the one exception is the release
callback of a wrapped tensor, which may run on any thread and only drops its entry from a dict and appends to a
deque (single operations, atomic under the GIL).
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import ctypes
import logging
import os
import weakref
from typing import Callable

import numpy as np
import torch

from mstar_dist.control import messages as m
from mstar_dist.transport.base import ArenaFull, Done, PeerDeadError, Transfer, TransferFailed
from mstar_dist.transport.inline import str_to_dtype

__all__ = ["ArenaTransport", "FirstFit", "LentSlots", "ReleaseQueue", "copy_into", "copy_into_at", "wrap_bytes"]

ALIGN = 64
"""Allocation granularity in bytes: every slot starts on a cache line, so every dtype view is aligned."""


class FirstFit:
    """First-fit allocator over ``[0, size)``; blocks are ``ALIGN``-aligned. Free blocks coalesce."""

    def __init__(self, size: int) -> None:
        if size < ALIGN:
            raise ValueError(f"arena of {size} bytes is smaller than one {ALIGN}-byte block")
        self.size = size - size % ALIGN
        self._free_starts = [0]  # sorted starts of free blocks
        self._free_len = {0: self.size}
        self._used: dict[int, int] = {}  # start -> rounded length
        self.used_bytes = 0

    def alloc(self, nbytes: int) -> int | None:
        """Start offset of a new block of at least ``nbytes`` (> 0), or None when no free block is big enough."""
        need = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for i, start in enumerate(self._free_starts):
            length = self._free_len[start]
            if length < need:
                continue
            del self._free_len[start]
            if length == need:
                del self._free_starts[i]
            else:
                self._free_starts[i] = start + need
                self._free_len[start + need] = length - need
            self._used[start] = need
            self.used_bytes += need
            return start
        return None

    def free(self, start: int) -> None:
        """Return the block that starts at ``start``. KeyError for a start that is not allocated."""
        length = self._used.pop(start)
        self.used_bytes -= length
        i = bisect.bisect_left(self._free_starts, start)
        if i < len(self._free_starts) and start + length == self._free_starts[i]:  # merge with the next
            nxt = self._free_starts.pop(i)
            length += self._free_len.pop(nxt)
        if i > 0:
            prev = self._free_starts[i - 1]
            if prev + self._free_len[prev] == start:  # merge into the previous
                self._free_len[prev] += length
                return
        self._free_starts.insert(i, start)
        self._free_len[start] = length

    @property
    def largest_free(self) -> int:
        return max(self._free_len.values(), default=0)

    @property
    def blocks_used(self) -> int:
        return len(self._used)


class LentSlots:
    """Slot id -> what it lent to which peer. Ids are never reused, so a late or duplicate ack is harmless."""

    def __init__(self) -> None:
        self._slots: dict[int, tuple[int, int, Callable[[], None]]] = {}  # slot -> (peer, nbytes, reclaim)
        self._next = 0

    def lend(self, peer: int, nbytes: int, reclaim: Callable[[], None]) -> int:
        """A new slot lent to ``peer``; ``reclaim`` frees its memory (allocator block, or a registration) and is
        called once, when the slot comes back."""
        slot = self._next
        self._next = slot + 1
        self._slots[slot] = (peer, nbytes, reclaim)  # a tuple, not an object: one per transfer
        return slot

    def give_back(self, peer: int, slots: list[int]) -> int:
        """Reclaim ``slots`` that were lent to ``peer`` (others are ignored: not ours to free); returns how many."""
        n = 0
        for slot in slots:
            n += self.give_back_one(peer, slot)
        return n

    def give_back_one(self, peer: int, slot: int) -> int:
        """``give_back`` of one slot (the release rings hand them back one at a time); returns 1 or 0."""
        lent = self._slots.get(slot)
        if lent is None or lent[0] != peer:
            return 0
        del self._slots[slot]
        lent[2]()
        return 1

    def reclaim_peer(self, peer: int) -> int:
        """Reclaim every slot lent to ``peer`` (it is dead); returns how many."""
        return self.give_back(peer, [s for s, lent in self._slots.items() if lent[0] == peer])

    def reclaim_all(self) -> None:
        for slot in list(self._slots):
            self._slots.pop(slot)[2]()

    def __len__(self) -> int:
        return len(self._slots)


class ReleaseQueue:
    """Collects (peer, slot) pairs of wrapped tensors that were let go; drained by the worker thread."""

    def __init__(self) -> None:
        self._items: collections.deque[tuple[int, int]] = collections.deque()

    def put(self, peer: int, slot: int) -> None:  # may run on any thread (a lease ending): deque.append is atomic
        self._items.append((peer, slot))

    def __bool__(self) -> bool:
        return bool(self._items)

    def take(self) -> list[tuple[int, int]]:
        """The (peer, slot) pairs released since the last ``take``/``drain``, in order."""
        items, out = self._items, []
        while items:  # only the worker thread takes: never empty between the test and the pop
            out.append(items.popleft())
        return out

    def drain(self) -> dict[int, list[int]]:
        """peer -> slots released since the last drain."""
        if not self._items:  # the common case, every turn of the worker's loop
            return {}
        out: dict[int, list[int]] = {}
        while self._items:
            peer, slot = self._items.popleft()
            out.setdefault(peer, []).append(slot)
        return out


SPLIT_COPY_BYTES = 8 << 20
"""Host copies at least this large are split over ``copy_threads()`` threads (below it the hand-off costs more
than it saves)."""

_copy_pool: concurrent.futures.ThreadPoolExecutor | None = None


def copy_threads() -> int:
    """Threads a large host copy is split over: the CPUs this process may run on, at most 4 (one memcpy stream
    per core: one core's memcpy is what limits a large copy)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


def copy_into(dst: torch.Tensor | np.ndarray, tensor: torch.Tensor) -> None:
    """Copy ``tensor`` (any device, dtype, strides) into ``dst``, a flat uint8 CPU tensor (or numpy array) of
    exactly its bytes.

    A contiguous host tensor goes through numpy's ``copyto`` (libc ``memcpy``: non-temporal stores for large
    blocks), faster than ``Tensor.copy_``'s element loop into a shared mapping; from
    ``SPLIT_COPY_BYTES`` on, in equal parts on ``copy_threads()`` threads at once (numpy lets the GIL go while it
    copies), since one core's memcpy is what limits an arena transfer (docs/architecture.md §7). A lazily
    conjugated or negated view (``x.conj()``, ``x.conj().imag``) is resolved first: its raw bytes are not its
    values."""
    tensor = tensor.resolve_conj().resolve_neg()
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        out = dst if isinstance(dst, np.ndarray) else dst.numpy()
        src = tensor.reshape(-1).view(torch.uint8).numpy()
        parts = copy_threads() if src.nbytes >= SPLIT_COPY_BYTES else 1
        if parts == 1:
            np.copyto(out, src)
            return
        global _copy_pool
        if _copy_pool is None:
            _copy_pool = concurrent.futures.ThreadPoolExecutor(3, thread_name_prefix="arena-copy")
        step = -(-src.nbytes // parts // ALIGN) * ALIGN
        rest = [_copy_pool.submit(np.copyto, out[i:i + step], src[i:i + step]) for i in range(step, src.nbytes, step)]
        np.copyto(out[:step], src[:step])  # this thread copies the first part
        for part in rest:
            part.result()
        return
    if isinstance(dst, np.ndarray):
        dst = torch.from_numpy(dst)
    view = dst if tensor.dtype == torch.uint8 else dst.view(tensor.dtype)
    view.view(tensor.shape).copy_(tensor)


_memmove = ctypes.memmove


def copy_into_at(base: np.ndarray, address: int, offset: int, tensor: torch.Tensor, nbytes: int) -> None:
    """``copy_into(base[offset:offset + nbytes], tensor)``, where ``address`` is the address of ``base``'s first
    byte and ``nbytes`` the tensor's size.

    A contiguous host tensor below ``SPLIT_COPY_BYTES`` is one ``memmove`` from its data pointer: the views numpy's
    copy builds first would be most of a small arena send's cost (docs/architecture.md §7). Lazily conjugated or negated views take ``copy_into``, which resolves them."""
    if (nbytes < SPLIT_COPY_BYTES and tensor.is_cpu and tensor.is_contiguous() and not tensor.is_neg()
            and not tensor.is_conj()):
        _memmove(address + offset, tensor.data_ptr(), nbytes)
    else:
        copy_into(base[offset:offset + nbytes], tensor)


class _Lease(weakref.ref):
    """A weak reference to the array under a wrapped tensor, with what to call once that array is gone."""

    __slots__ = ("on_release",)


_leases: dict[int, _Lease] = {}
"""id -> lease of every wrapped tensor alive in this process: a weak reference calls back only while it is itself
alive. Written by the worker thread (adds) and by whichever thread lets a tensor go (removes); single dict
operations, atomic under the GIL."""


def _lease_ended(lease: _Lease) -> None:
    del _leases[id(lease)]
    lease.on_release()


_NUMPY_DTYPES = {getattr(torch, name): np.dtype(name) for name in (
    "float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")}
"""torch dtypes numpy reads the same way: their wrapped tensors are shaped by numpy, cheaper per call than torch."""


def wrap_bytes(
    base: np.ndarray, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int],
    on_release: Callable[[], None],
) -> torch.Tensor:
    """A tensor of ``dtype``/``shape`` over ``base[offset:offset + nbytes]`` (no copy) that calls ``on_release``
    once nothing refers to that memory any more (on the thread that lets the last reference go).

    The tensor's storage holds a numpy view of those bytes; every tensor view derived from it shares that
    storage, so the numpy view dies (and a weak reference to it calls ``on_release``) only after the last of
    them does. A plain weak reference kept in a table, not ``weakref.finalize`` (far dearer to set up), since
    that cost counts on every small arena receive (docs/architecture.md §7).
    """
    view = base[offset:offset + nbytes]
    np_dtype = _NUMPY_DTYPES.get(dtype)
    try:
        if np_dtype is not None:
            view = view.view(np_dtype).reshape(shape)  # the lease must watch the array the storage holds
            out = torch.from_numpy(view)
        else:
            out = torch.from_numpy(view).view(dtype).view(shape)
    except (ValueError, RuntimeError):  # shape and bytes disagree: nothing wraps the slot, it goes back now
        on_release()
        raise
    lease = _Lease(view, _lease_ended)
    lease.on_release = on_release
    _leases[id(lease)] = lease
    return out


_CPU = torch.device("cpu")


class ArenaTransport:
    """A transport that lends this rank's memory to its consumers until they acknowledge (docs/architecture.md
    §7): the arena, its allocator, the slots lent, dead peers, counters, and the whole ``DataPlane`` but for what
    differs between the memories. Implements ``transport.base.DataPlane``.

    A subclass sets ``name``, ``location_type`` (its ``m.Location`` struct) and ``arena_label`` (the arena named in
    errors), calls ``__init__`` once its memory exists, and implements:

    - ``_location(dst, offset, nbytes, slot)``: the descriptor's location of a slot (``slot`` -1: an empty tensor);
    - ``_receive(wire, loc, src, target)``: the receive of a non-empty tensor the descriptor names;
    - ``poll``: hand back what this rank let go, return the acknowledgements to send (``_ack_messages`` helps);
    - ``_make_room``: take back the slots consumers handed back, before a send reports the arena full;
    - ``_close``: release what it holds beyond the arena.

    ``_send_in_place`` (expose a tensor without a copy), ``_on_peer_dead`` and ``_inflight`` have defaults.
    Used from the rank's worker thread only.
    """

    name = "arena"
    location_type: type = type(None)
    """The ``m.Location`` struct of this transport's descriptors."""
    arena_label = "arena"
    """How errors name this rank's arena ("shared-memory arena <segment>", "Mooncake pool")."""

    def __init__(self, global_rank: int, device: str | torch.device, arena: np.ndarray, arena_bytes: int,
                 **extra_stats: int) -> None:
        """``arena``: a flat uint8 array whose first ``arena_bytes`` bytes (rounded down to ``ALIGN``) are the
        arena; it stays mapped (and at one address) for the transport's life. ``extra_stats``: the subclass's own
        counters, with their initial values."""
        self.global_rank = global_rank
        self.device = torch.device(device)
        self._arena = arena
        self._arena_addr = arena.ctypes.data
        self._alloc = FirstFit(arena_bytes)
        self._lent = LentSlots()
        self._dead: dict[int, str] = {}
        self._stats = dict(sends=0, recvs=0, bytes_sent=0, bytes_received=0, host_staging_copies=0, **extra_stats)
        self._leases = 0  # received tensors wrapping arena bytes that are still alive here
        self._closed = False

    @property
    def bytes_used(self) -> int:
        """Bytes of this rank's arena in use (lent to consumers and not yet acknowledged, or holding received
        tensors)."""
        return self._alloc.used_bytes

    # -- DataPlane ------------------------------------------------------------------------------------------
    def post_send(self, tensor: torch.Tensor, dst: int) -> tuple[Transfer, m.Location]:
        """Lend ``tensor`` to global rank ``dst``: in place where the subclass can expose it, else copied into a
        slot of this rank's arena (then done at once: the source may be reused). ArenaFull when no block is
        free even after ``_make_room``; ValueError when the tensor is bigger than the whole arena."""
        # Runs once per tensor a rank sends, small ones included, so it stays lean: a small send is one
        # allocation, one memmove and one location (docs/architecture.md §7).
        if dst in self._dead:
            self._check_peer(dst)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            self._count_send(0)
            return Done(tensor), self._location(dst, 0, 0, -1)
        placed = self._send_in_place(tensor, dst, nbytes)
        if placed is not None:
            self._count_send(nbytes)
            return placed
        alloc = self._alloc
        offset = alloc.alloc(nbytes) if nbytes <= alloc.size else None
        if offset is None:
            offset = self._reserve(tensor, nbytes)
        if not tensor.is_cpu:
            self._stats["host_staging_copies"] += 1
        try:
            copy_into_at(self._arena, self._arena_addr, offset, tensor, nbytes)
        except BaseException:  # nothing was lent: the block is ours again
            alloc.free(offset)
            raise
        slot = self._lent.lend(dst, nbytes, lambda: alloc.free(offset))
        self._count_send(nbytes)
        return Done(tensor), self._location(dst, offset, nbytes, slot)

    def post_recv(self, wire: m.WireTensor, src: int, device: torch.device | None = None) -> Transfer:
        """The receive of what global rank ``src`` lent us; ``device`` as in ``DataPlane.post_recv`` (a CUDA
        target gets a copy of the host bytes, counted in ``host_staging_copies``). TransferFailed for a
        descriptor that is not this transport's."""
        if src in self._dead:
            self._check_peer(src)
        loc = wire.at
        if type(loc) is not self.location_type:
            raise TransferFailed(f"{self.name} descriptor from rank {src} has no {self.location_type.__name__}: "
                                 f"{loc!r}")
        stats = self._stats
        stats["recvs"] += 1
        stats["bytes_received"] += loc.nbytes
        target = _CPU if wire.host else (device or self.device)
        if loc.nbytes == 0 or loc.slot < 0:
            return Done(torch.empty(wire.shape, dtype=str_to_dtype(wire.dtype), device=target))
        return self._receive(wire, loc, src, target)

    def flush(self) -> None:
        """Nothing is deferred: a post has copied or exposed the bytes when it returns."""

    def device_inflight(self) -> bool:
        return False

    def withdraw(self, transfer: Transfer) -> bool:
        """A lent slot is taken back through ``on_ack`` (the router does it), not here."""
        return False

    def on_ack(self, src: int, ack: m.TransferAck) -> None:
        self._lent.give_back(src, ack.slots)

    def is_dead(self, peer: int) -> bool:
        return peer in self._dead

    def abort_peer(self, peer: int, reason: str) -> None:
        if peer in self._dead:
            return
        self._dead[peer] = reason
        n = self._lent.reclaim_peer(peer)
        self._on_peer_dead(peer)
        logging.getLogger(type(self).__module__).warning(
            "rank %d: %s to rank %d is dead (%s); reclaimed %d slot(s)", self.global_rank, self.name, peer, reason, n)

    def revive_peer(self, peer: int, pair_groups=None) -> None:
        """``peer`` restarted and rejoined: lend to it and read from it again (its new process has a new arena)."""
        if self._dead.pop(peer, None) is not None:
            self._on_peer_revived(peer)

    def stats(self) -> dict:
        return {**self._stats, "inflight": self._inflight(), "bytes_used": self.bytes_used,
                "slots_lent": len(self._lent), "leases": self._leases, "arena_bytes": self._alloc.size,
                "dead_peers": sorted(self._dead)}

    def close(self) -> None:
        """Release everything this transport holds. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._close()

    # -- for subclasses -------------------------------------------------------------------------------------
    def _location(self, dst: int, offset: int, nbytes: int, slot: int) -> m.Location:
        raise NotImplementedError

    def _receive(self, wire: m.WireTensor, loc: m.Location, src: int, target: torch.device) -> Transfer:
        raise NotImplementedError

    def _make_room(self) -> int:
        """Take back what consumers handed back without a message; returns how many slots came back."""
        return 0

    def _close(self) -> None:
        """Release what the subclass holds (segments, registrations)."""

    def _send_in_place(self, tensor: torch.Tensor, dst: int, nbytes: int) -> tuple[Transfer, m.Location] | None:
        """Expose ``tensor`` to ``dst`` where it is, if this transport can (then lend the slot here); None: copy
        it into the arena."""
        return None

    def _on_peer_dead(self, peer: int) -> None:
        """Drop this transport's own pending work with ``peer`` (after its lent slots came back)."""

    def _on_peer_revived(self, peer: int) -> None:
        """Forget what this transport kept of ``peer``'s previous process (its arena, its release ring here)."""

    def _inflight(self) -> int:
        return 0

    def _reserve(self, tensor: torch.Tensor, nbytes: int) -> int:
        """Offset of a free block of ``nbytes`` once the first try found none: after ``_make_room``, else
        ArenaFull naming the arena (ValueError when the tensor is bigger than the whole arena)."""
        self._check_fits(tensor, nbytes)
        alloc = self._alloc
        offset = alloc.alloc(nbytes) if self._make_room() else None
        if offset is None:
            raise ArenaFull(f"rank {self.global_rank}'s {self.arena_label} has {self.bytes_used} of {alloc.size} "
                            f"bytes in use (lent to consumers, or holding received tensors) and no free block of "
                            f"{nbytes} bytes (largest {alloc.largest_free})")
        return offset

    def _to_target(self, out: torch.Tensor, target: torch.device) -> torch.Tensor:
        """A received host tensor where its consumer wants it (a device copy, counted as host staging)."""
        if target.type == "cpu":
            return out
        self._stats["host_staging_copies"] += 1
        return out.to(target)

    def _ack_messages(self, slots_by_peer: dict[int, list[int]]) -> list[tuple[int, m.TransferAck]]:
        """The ``TransferAck`` to send to each producer for ``slots``, none to dead peers, in rank order."""
        return [(peer, m.TransferAck(via=self.name, slots=slots))
                for peer, slots in sorted(slots_by_peer.items()) if peer not in self._dead]

    def _check_peer(self, peer: int) -> None:
        reason = self._dead.get(peer)
        if reason is not None:
            raise PeerDeadError(f"{self.name} between rank {self.global_rank} and rank {peer} is dead: {reason}")

    def _check_fits(self, tensor: torch.Tensor, nbytes: int) -> None:
        if nbytes > self._alloc.size:
            raise ValueError(f"a tensor of {nbytes} bytes ({list(tensor.shape)} {tensor.dtype}) does not fit rank "
                             f"{self.global_rank}'s {self.name} arena of {self._alloc.size} bytes; raise "
                             f"transport.arena_bytes")

    def _count_send(self, nbytes: int) -> None:
        self._stats["sends"] += 1
        self._stats["bytes_sent"] += nbytes
