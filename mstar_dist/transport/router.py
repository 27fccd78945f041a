"""The rank's data plane as the worker sees it: one transport per tensor, chosen when it is sent
(docs/architecture.md §7, "choice per tensor").

- at most ``transport.inline_max_bytes``: inline, inside the control message (no transport at all);
- else, consumer on this rank's host: ``transport.intra_host``; on another host: ``transport.inter_host``.
The worker sends each tensor to one consumer rank, so "all consumers on this host" is "the destination rank is on
this host". The descriptor (``WireTensor.via`` / ``.at``) says which transport carried it and where, and the
receive goes to that transport. Each peer is reached through exactly one transport (its host decides), so
aborting a peer and asking whether it is dead need no transport name.

Per-edge statistics (``--log-stats``, /metrics): every received value is counted under (walk, producer ->
consumer, signal, transport) with its bytes and its transfer time (descriptor arrival to data ready, seen when
the worker polls), see :class:`EdgeStats`.

Ranks are global ranks; used from the rank's worker thread only.
"""

from __future__ import annotations

import collections
import gc
import math
import time
from collections.abc import Mapping

import torch

from mstar_dist.control import messages as m
from mstar_dist.transport.base import DataPlane, Done, PeerDeadError, Transfer
from mstar_dist.transport.inline import decode_tensor, dtype_to_str, encode_tensor, str_to_dtype

__all__ = ["EdgeStats", "Router"]


class EdgeStats:
    """Count, bytes and recent transfer times per (walk, src, dst, signal, transport)."""

    WINDOW = 1024
    """Quantiles are over the last this-many transfers of each edge."""

    def __init__(self) -> None:
        self._edges: dict[tuple[str, int, int, str, str], list] = {}

    def record(self, walk: str, src: int, dst: int, signal: str, via: str, nbytes: int, seconds: float) -> None:
        entry = self._edges.get((walk, src, dst, signal, via))
        if entry is None:
            entry = self._edges[(walk, src, dst, signal, via)] = [0, 0, collections.deque(maxlen=self.WINDOW)]
        entry[0] += 1
        entry[1] += nbytes
        entry[2].append(seconds)

    def snapshot(self) -> list[m.EdgeStat]:
        out = []
        for (walk, src, dst, signal, via), (count, nbytes, times) in sorted(self._edges.items()):
            ordered = sorted(times)
            out.append(m.EdgeStat(walk=walk, src=src, dst=dst, signal=signal, via=via, count=count, nbytes=nbytes,
                                  p50_s=_quantile(ordered, 0.5), p99_s=_quantile(ordered, 0.99)))
        return out


def _quantile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Timed:
    """A receive that records its edge statistics the first time it is seen complete."""

    __slots__ = ("_inner", "_stats", "_key", "_nbytes", "_t0", "_recorded")

    def __init__(self, inner: Transfer, stats: EdgeStats, key: tuple, nbytes: int) -> None:
        self._inner, self._stats, self._key, self._nbytes = inner, stats, key, nbytes
        self._t0 = time.perf_counter()
        self._recorded = False

    @property
    def tensor(self) -> torch.Tensor:
        return self._inner.tensor

    def done(self) -> bool:
        finished = self._inner.done()
        if finished and not self._recorded:
            self._recorded = True
            self._stats.record(*self._key, self._nbytes, time.perf_counter() - self._t0)
        return finished


class Router:
    """Picks the transport of every tensor this rank sends, dispatches receives by descriptor. Implements the
    ``DataPlane`` operations the worker uses, on `Carried` values (inline or descriptor)."""

    def __init__(self, *, global_rank: int, rank_hosts: Mapping[int, str], transports: Mapping[str, DataPlane],
                 intra_host: str, inter_host: str, inline_max_bytes: int, device: torch.device) -> None:
        """``rank_hosts``: host name of every global rank; ``transports``: name -> transport, holding at least
        the ones ``intra_host``/``inter_host`` name that some peer needs."""
        self.global_rank = global_rank
        self.device = torch.device(device)
        self.inline_max_bytes = inline_max_bytes
        self._host = dict(rank_hosts)
        self._transports = dict(transports)
        self._intra, self._inter = intra_host, inter_host
        self.edges = EdgeStats()
        self._last_gc = 0.0

    @property
    def transports(self) -> Mapping[str, DataPlane]:
        """The transports this rank runs, by name."""
        return dict(self._transports)

    def via(self, peer: int) -> str:
        """The transport for tensors between this rank and global rank ``peer``."""
        return self._intra if self._host.get(peer) == self._host.get(self.global_rank) else self._inter

    def transport_for(self, peer: int) -> DataPlane:
        name = self.via(peer)
        try:
            return self._transports[name]
        except KeyError:
            raise PeerDeadError(f"rank {self.global_rank} has no {name} transport to rank {peer} "
                                f"(transports here: {sorted(self._transports)})") from None

    # -- sending --------------------------------------------------------------------------------------------
    def post_send(self, tensor: torch.Tensor, dst: int) -> tuple[Transfer, m.Carried]:
        """Start sending ``tensor`` to global rank ``dst``; returns the transfer and the value to put in the
        message (inline bytes, or the descriptor). Raises like the transport's ``post_send`` (ArenaFull,
        PeerDeadError, ...); nothing is lent or posted when it raises."""
        if tensor.numel() * tensor.element_size() <= self.inline_max_bytes or dst == self.global_rank:
            return Done(tensor), encode_tensor(tensor)  # to this rank itself (a stream between two partitions
            # placed on one rank): inline at any size, no transport serves a rank to itself
        plane = self.transport_for(dst)
        dtype = dtype_to_str(tensor.dtype)  # before the post: a dtype the wire cannot name must not lend a slot
        transfer, at = plane.post_send(tensor, dst)
        return transfer, m.WireTensor(shape=list(tensor.shape), dtype=dtype, host=tensor.is_cpu, via=plane.name,
                                      at=at)

    def flush(self) -> None:
        """Issue the sends deferred until their descriptors went out (p2p; the worker calls this right after
        every control message it sends)."""
        for plane in self._transports.values():
            plane.flush()

    def device_inflight(self) -> bool:
        """Whether some transport has a transfer in flight that only polling sees end (NCCL)."""
        return any(plane.device_inflight() for plane in self._transports.values())

    def cancel(self, dst: int, transfer: Transfer, value: m.Carried, reason: str) -> None:
        """Undo a posted send whose descriptor will never go out: an arena slot is taken back; a p2p send still
        deferred is withdrawn; one already issued that nobody will receive leaves the pair out of step, so the
        peer is aborted."""
        if not isinstance(value, m.WireTensor):
            return
        plane = self._transports[value.via]
        slot = -1 if value.at is None else value.at.slot
        if value.at is None:
            if not plane.withdraw(transfer):
                plane.abort_peer(dst, reason)
        elif slot >= 0:
            plane.on_ack(dst, m.TransferAck(via=value.via, slots=[slot]))

    # -- receiving ------------------------------------------------------------------------------------------
    def post_recv(self, value: m.Carried, src: int, *, walk: str = "", signal: str = "") -> Transfer:
        """The receive of ``value`` from global rank ``src``: done at once for inline values, else posted on the
        transport the descriptor names (call in message order per sender). ``walk``/``signal`` label the edge."""
        if isinstance(value, m.InlineTensor):
            tensor = decode_tensor(value, self.device)
            self.edges.record(walk, src, self.global_rank, signal, "inline", len(value.data), 0.0)
            return Done(tensor)
        try:
            plane = self._transports[value.via]
        except KeyError:
            raise PeerDeadError(f"rank {src} sent a tensor over {value.via!r}, which rank {self.global_rank} does "
                                f"not run (transports here: {sorted(self._transports)})") from None
        nbytes = _nbytes(value)
        transfer = plane.post_recv(value, src, None)
        return _Timed(transfer, self.edges, (walk, src, self.global_rank, signal, plane.name), nbytes)

    # -- the rest of DataPlane ------------------------------------------------------------------------------
    def poll(self) -> list[tuple[int, m.TransferAck]]:
        return [ack for plane in self._transports.values() for ack in plane.poll()]

    def on_ack(self, src: int, ack: m.TransferAck) -> None:
        plane = self._transports.get(ack.via)
        if plane is not None:
            plane.on_ack(src, ack)

    def abort_peer(self, peer: int, reason: str) -> None:
        """Abort ``peer`` on every transport this rank runs (a dead peer is dead on all of them)."""
        for plane in self._transports.values():
            plane.abort_peer(peer, reason)

    def is_dead(self, peer: int) -> bool:
        if peer == self.global_rank:
            return False  # values to this rank itself never use a transport
        plane = self._transports.get(self.via(peer))
        return plane is None or plane.is_dead(peer)

    def collect_garbage_if_held(self, every_s: float = 1.0) -> bool:
        """Run Python's cycle collector when received arena tensors are still alive, at most every ``every_s``.

        A wrapped tensor goes back to its producer when the last reference to it dies; one caught in a reference
        cycle (a finished walk's bookkeeping) dies only when the cycle collector runs, which an idle process
        may never do. The worker calls this when it is idle, so arena occupancy returns to 0 at idle."""
        now = time.monotonic()
        if now - self._last_gc < every_s:
            return False
        self._last_gc = now
        if not any(plane.stats().get("leases", 0) for plane in self._transports.values()):
            return False
        gc.collect()
        return True

    def arena_bytes_used(self) -> dict[str, int]:
        return {name: int(st["bytes_used"]) for name, plane in self._transports.items()
                if "bytes_used" in (st := plane.stats())}

    def stats(self) -> dict:
        """Totals over the transports, and each transport's own counters under its name."""
        per = {name: plane.stats() for name, plane in sorted(self._transports.items())}
        total = {key: sum(int(st.get(key, 0)) for st in per.values())
                 for key in ("sends", "recvs", "bytes_sent", "bytes_received", "host_staging_copies", "inflight")}
        histograms = [h for st in per.values() for h in st.get("histograms", ())]  # metered transports' (telemetry)
        return {**total, "transports": per, "histograms": histograms}

    def close(self) -> None:
        for plane in self._transports.values():
            plane.close()


def _nbytes(wire: m.WireTensor) -> int:
    return math.prod(wire.shape) * str_to_dtype(wire.dtype).itemsize
