"""The rank's data plane as the worker sees it: one transport per tensor, chosen when it is sent
(docs/architecture.md §7, "choice per tensor").

- at most ``transport.inline_max_bytes``: inline, inside the control message (no transport at all);
- else, consumer on this rank's host: ``transport.intra_host``; on another host: ``transport.inter_host``.
The worker sends each tensor to one consumer rank, so "all consumers on this host" is "the destination rank is on
this host". The descriptor (``WireTensor.via`` / ``.at``) says which transport carried it and where, and the
receive goes to that transport. Each peer is reached through exactly one transport (its host decides), so
aborting a peer and asking whether it is dead need no transport name.

Metering (``--log-stats``, /metrics; ``metering.py``): every received value is counted under (walk, producer ->
consumer, signal, transport) with its bytes and its transfer time (descriptor arrival to data ready, seen when
the worker polls), and every transfer a transport carries fills that transport's size and time histograms.
The router meters every transport alike, so a transport never measures itself.

Ranks are global ranks; used from the rank's worker thread only.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Mapping

import torch

from mstar_dist.control import messages as m
from mstar_dist.transport.base import DataPlane, Done, PeerDeadError, Transfer
from mstar_dist.transport.inline import decode_tensor, dtype_to_str, encode_tensor, str_to_dtype
from mstar_dist.transport.metering import EdgeStats, Metered, MeteredSend, TimedRecv, TransferMeter

__all__ = ["Router"]


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
        self._meters = {name: TransferMeter(name) for name in self._transports}
        self._last_gc = 0.0

    @property
    def transports(self) -> Mapping[str, DataPlane]:
        """The transports this rank runs, by name."""
        return dict(self._transports)

    def via(self, peer: int) -> str:
        """The transport for tensors between this rank and global rank ``peer``."""
        return self._intra if self._host.get(peer) == self._host.get(self.global_rank) else self._inter

    def _name_for(self, peer: int) -> str:
        """``via(peer)``, which this rank must run (PeerDeadError naming it otherwise)."""
        name = self.via(peer)
        if name not in self._transports:
            raise PeerDeadError(f"rank {self.global_rank} has no {name} transport to rank {peer} "
                                f"(transports here: {sorted(self._transports)})")
        return name

    # -- sending --------------------------------------------------------------------------------------------
    def post_send(self, tensor: torch.Tensor, dst: int) -> tuple[Transfer, m.Carried]:
        """Start sending ``tensor`` to global rank ``dst``; returns the transfer and the value to put in the
        message (inline bytes, or the descriptor). Raises like the transport's ``post_send`` (ArenaFull,
        PeerDeadError, ...); nothing is lent or posted when it raises."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes <= self.inline_max_bytes or dst == self.global_rank:
            return Done(tensor), encode_tensor(tensor)  # to this rank itself (a stream between two partitions
            # placed on one rank): inline at any size, no transport serves a rank to itself
        name = self._name_for(dst)
        plane = self._transports[name]
        dtype = dtype_to_str(tensor.dtype)  # before the post: a dtype the wire cannot name must not lend a slot
        transfer, at = plane.post_send(tensor, dst)
        meter = self._meters[name]
        meter.bytes["send"].observe(nbytes)
        return MeteredSend(transfer, meter.seconds["send"]), m.WireTensor(
            shape=list(tensor.shape), dtype=dtype, host=tensor.is_cpu, via=plane.name, at=at)

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
            if not plane.withdraw(transfer.inner if isinstance(transfer, Metered) else transfer):
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
        meter = self._meters[value.via]
        meter.bytes["recv"].observe(nbytes)
        return TimedRecv(transfer, self.edges, (walk, src, self.global_rank, signal, plane.name), nbytes,
                         meter.seconds["recv"])

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

    def revive_peer(self, peer: int, pair_groups: Mapping) -> None:
        """``peer`` restarted and rejoined: every transport serves it again (p2p on ``pair_groups``, its fresh pair
        groups with this rank)."""
        for plane in self._transports.values():
            plane.revive_peer(peer, pair_groups)

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
        histograms = [h for name in sorted(self._meters) for h in self._meters[name].snapshot()]
        return {**total, "transports": per, "histograms": histograms}

    def close(self) -> None:
        for plane in self._transports.values():
            plane.close()


def _nbytes(wire: m.WireTensor) -> int:
    return math.prod(wire.shape) * str_to_dtype(wire.dtype).itemsize
