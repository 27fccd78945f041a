"""Mooncake transport: tensors read one-sided through the Mooncake transfer engine (docs/architecture.md §7).

Setup per rank: one ``TransferEngine`` started with ``P2PHANDSHAKE`` (no metadata server: peers learn each other's
segments by a handshake on first contact), on this host's address, with the configured protocol (``tcp``, or
``rdma`` with ``transfer_device`` naming the NIC), and one registered buffer pool of ``arena_bytes``. With
``tcp`` the engine would still pick RDMA NICs if present, so ``MC_FORCE_TCP=1`` is set first. A failed start
raises naming the host address, protocol and device.

A send makes the bytes readable by the consumer and puts their address in the descriptor:
- a tensor that lives in our pool already (one we received, or a view of it: a rank forwarding what it got)
  is exposed where it is; the transfer holds it until the consumer's ack;
- a contiguous host tensor of at least ``REGISTER_MIN_BYTES`` over tcp is registered where it is (no copy); the
  transfer holds the tensor until the consumer's ack, and the registration is dropped then;
- anything else is copied into a first-fit slot of the pool (CUDA tensors are staged through it: counted in
  ``host_staging_copies``); the source may be freed at once.
The session (``host:rpc_port``) rides in the descriptor too, so the consumer needs nothing else. The consumer
allocates a slot of its own pool, posts an asynchronous read, polls it with ``transfer_check_status`` (never
blocks: 0 pending, 1 done, <0 failed), acknowledges the producer's slot as soon as the read is done and wraps its
own slot as the received tensor (no copy; the slot is freed when the tensor is let go).

Errors are return codes, never exceptions: a negative code (−1 at once when the peer process is gone) fails the
transfer fast with ``TransferFailed`` naming the peer, session and code. A consumer whose own pool is full keeps
the read pending (``ArenaFull`` is not raised on receive) until room frees up; the worker's transfer timeout
bounds that wait.

Used from the rank's worker thread; wrapped tensors may be released on any thread (that only queues).
"""

from __future__ import annotations

import json
import logging
import os

import torch

from mstar_dist.control import messages as m
from mstar_dist.transport.arena import ArenaTransport, ReleaseQueue, wrap_bytes
from mstar_dist.transport.base import Transfer, TransferFailed
from mstar_dist.transport.inline import str_to_dtype
from mstar_dist.transport.plane import TransportSetup

__all__ = ["MooncakeTransport", "PROTOCOLS", "REGISTER_MIN_BYTES", "build"]

log = logging.getLogger(__name__)

PROTOCOLS = ("tcp", "rdma")
REGISTER_MIN_BYTES = 1 << 20
"""Host tensors at least this big are registered in place over tcp instead of copied into the pool."""


def build(setup: TransportSetup) -> MooncakeTransport:
    """This rank's Mooncake transport (the registry's factory): the engine on this host's address, over
    ``transport.mooncake_protocol`` (rdma on the host's ``transfer_device``), with a pool of
    ``transport.arena_bytes``."""
    cfg = setup.config
    return MooncakeTransport(setup.global_rank, host_addr=setup.host_addr, protocol=cfg.mooncake_protocol,
                             device_name=setup.transfer_device, arena_bytes=cfg.arena_bytes, device=setup.device)


def _engine_class():
    os.environ.setdefault("GLOG_minloglevel", "1")  # the engine's INFO lines are per connection: warnings and up
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise RuntimeError(
            "transport 'mooncake' needs the Mooncake transfer engine: pip install 'mstar_dist[mooncake]' "
            "(mooncake-transfer-engine; mooncake-transfer-engine-non-cuda on machines without CUDA; it needs "
            f"libibverbs1 from the system packages): {exc}") from exc
    return TransferEngine


class _SendTransfer:
    """A send whose source memory is registered in place: done when the consumer acknowledges."""

    def __init__(self, transport: "MooncakeTransport", tensor: torch.Tensor, dst: int) -> None:
        self._transport, self.tensor, self.dst = transport, tensor, dst
        self.acked = False

    def done(self) -> bool:
        if self.acked:
            return True
        self._transport._check_peer(self.dst)
        return False


class _RecvTransfer:
    """A one-sided read into a slot of our pool (waits for a free slot first)."""

    def __init__(self, transport: "MooncakeTransport", wire: m.WireTensor, loc: m.MooncakeLocation, src: int,
                 device: torch.device) -> None:
        self._t, self.wire, self.loc, self.src, self.device = transport, wire, loc, src, device
        self._offset: int | None = None
        self._batch: int | None = None
        self._result: torch.Tensor | None = None

    @property
    def tensor(self) -> torch.Tensor:
        if self._result is None:
            raise RuntimeError(f"read of {self.loc.nbytes} bytes from rank {self.src} is not done yet")
        return self._result

    def done(self) -> bool:
        if self._result is not None:
            return True
        t = self._t
        t._check_peer(self.src)
        if self._batch is None and not self._start():
            return False
        status = t._engine.transfer_check_status(self._batch)
        if status == 0:
            return False
        if status < 0:
            self._batch = None  # ended (failed): the slot can go back at once
            self._drop()
            raise TransferFailed(f"mooncake read of {self.loc.nbytes} bytes from rank {self.src} "
                                 f"({self.loc.session}) failed with status {status}")
        self._finish()
        return True

    def _start(self) -> bool:
        t = self._t
        self._offset = t._alloc.alloc(self.loc.nbytes)
        if self._offset is None:
            return False  # our pool is full: wait for wrapped tensors to be let go
        batch = t._engine.batch_transfer_async_read(
            self.loc.session, [t._pool_addr + self._offset], [self.loc.addr], [self.loc.nbytes])
        if not batch or batch < 0:  # 0: not even submitted (e.g. the handshake with a dead peer failed)
            self._drop()
            raise TransferFailed(f"mooncake could not post a read of {self.loc.nbytes} bytes from rank {self.src} "
                                 f"({self.loc.session}): code {batch}")
        self._batch = batch
        return True

    def _finish(self) -> None:
        t, offset = self._t, self._offset
        t._acks.put(self.src, self.loc.slot)  # the producer's slot is free now
        t._leases += 1
        out = wrap_bytes(t._arena, offset, self.loc.nbytes, str_to_dtype(self.wire.dtype), self.wire.shape,
                         lambda: t._local_free.put(-1, offset))
        self._result = t._to_target(out, self.device)
        t._pending.discard(self)

    def _drop(self) -> None:
        """Give our slot back (a read still in flight keeps it until the engine reports its end)."""
        self._t._pending.discard(self)
        if self._offset is None:
            return
        if self._batch is not None and self._result is None:
            self._t._zombies.append((self._batch, self._offset))
        else:
            self._t._alloc.free(self._offset)
        self._offset = None


class MooncakeTransport(ArenaTransport):
    """This rank's transfer engine and registered pool. Implements ``transport.base.DataPlane``."""

    name = "mooncake"
    location_type = m.MooncakeLocation
    arena_label = "Mooncake pool"

    def __init__(self, global_rank: int, *, host_addr: str, protocol: str = "tcp", device_name: str | None = None,
                 arena_bytes: int, device: str | torch.device = "cpu") -> None:
        """Start the engine on ``host_addr`` (this host's address in the cluster spec) and register the pool.

        RuntimeError naming the address, protocol and device when the engine cannot start or register."""
        if protocol not in PROTOCOLS:
            raise ValueError(f"mooncake protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
        self.protocol = protocol
        if protocol == "tcp":
            os.environ["MC_FORCE_TCP"] = "1"  # protocol "tcp" alone still uses RDMA NICs when it finds them
        else:
            os.environ.pop("MC_FORCE_TCP", None)
        where = f"rank {global_rank}: Mooncake on {host_addr} (protocol {protocol}, device {device_name or 'auto'})"
        self._engine = _engine_class()()
        rc = self._engine.initialize(host_addr, "P2PHANDSHAKE", protocol, device_name or "")
        if rc != 0:
            raise RuntimeError(f"{where}: transfer engine initialize failed with code {rc}")
        self.session = f"{host_addr}:{self._engine.get_rpc_port()}"
        self._check_started(where, device_name)
        self._pool = torch.empty(arena_bytes, dtype=torch.uint8)
        self._pool_addr = self._pool.data_ptr()
        rc = self._engine.register_memory(self._pool_addr, arena_bytes)
        if rc != 0:
            raise RuntimeError(f"{where}: registering the {arena_bytes}-byte pool failed with code {rc}")
        super().__init__(global_rank, device, self._pool.numpy(), arena_bytes, registered_sends=0)
        self._acks = ReleaseQueue()  # (producer, slot) to acknowledge
        self._local_free = ReleaseQueue()  # (-1, offset) of our pool let go by wrapped tensors
        self._registered: dict[int, list] = {}  # data_ptr -> [nbytes, number of sends lent from it]
        self._pending: set[_RecvTransfer] = set()
        self._zombies: list[tuple[int, int]] = []  # (batch, offset) of reads abandoned mid-flight
        log.info("rank %d: Mooncake session %s (%s), pool %d bytes", global_rank, self.session, protocol, arena_bytes)

    def poll(self) -> list[tuple[int, m.TransferAck]]:
        """Free our pool's blocks that received tensors let go; acknowledge the reads that completed."""
        if not (self._local_free or self._zombies or self._acks):  # nothing to do: most turns of the loop
            return []
        self._reclaim_local()
        return self._ack_messages(self._acks.drain())

    # -- ArenaTransport -------------------------------------------------------------------------------------
    def _location(self, dst: int, offset: int, nbytes: int, slot: int) -> m.MooncakeLocation:
        return m.MooncakeLocation(self.session, self._pool_addr + offset if slot >= 0 else 0, nbytes, slot)

    def _send_in_place(self, tensor: torch.Tensor, dst: int, nbytes: int):
        """A tensor in our pool (one we received, or a view of it) is readable where it is; a large contiguous
        host tensor over tcp is registered where it is. Else None: copy it into the pool."""
        if self._in_pool(tensor, nbytes):
            transfer = _SendTransfer(self, tensor, dst)
            slot = self._lent.lend(dst, nbytes, lambda: setattr(transfer, "acked", True))
            return transfer, m.MooncakeLocation(self.session, tensor.data_ptr(), nbytes, slot)
        if (self.protocol == "tcp" and nbytes >= REGISTER_MIN_BYTES and tensor.device.type == "cpu"
                and tensor.is_contiguous()):
            return self._register(tensor, dst, nbytes)
        return None

    def _receive(self, wire: m.WireTensor, loc: m.MooncakeLocation, src: int, target: torch.device) -> Transfer:
        """Read what global rank ``src`` exposed into our pool (asynchronous; poll ``done()``)."""
        tr = _RecvTransfer(self, wire, loc, src, target)
        self._pending.add(tr)
        self._reclaim_local()
        tr.done()  # start it now if the pool has room
        return tr

    def _make_room(self) -> int:
        return self._reclaim_local()

    def _close(self) -> None:
        """Drop every registration we made; the engine and pool go with the process."""
        self._lent.reclaim_all()
        for ptr in list(self._registered):
            self._engine.unregister_memory(ptr)
        self._registered.clear()

    def _on_peer_dead(self, peer: int) -> None:
        for tr in [t for t in self._pending if t.src == peer]:
            tr._drop()  # our slot comes back; a read still running lands in memory nobody will look at

    def _inflight(self) -> int:
        return len(self._pending)

    # -- internals ------------------------------------------------------------------------------------------
    def _check_started(self, where: str, device_name: str | None) -> None:
        """The engine starts "fine" on an address that is not this host's, and silently falls back to tcp when
        rdma finds no NIC: catch both here rather than at the first transfer."""
        rc = self._engine.send_probe(self.session)
        if rc != 0:
            raise RuntimeError(f"{where}: the engine does not answer on its own session {self.session} (code {rc}): "
                               f"is the host address an address of this machine?")
        if self.protocol == "rdma":
            topology = json.loads(self._engine.get_local_topology() or "{}")
            hcas = sorted({h for groups in topology.values() for group in groups for h in group})
            if not hcas or (device_name and device_name not in hcas):
                raise RuntimeError(f"{where}: no RDMA device {device_name or ''} found (the engine sees "
                                   f"{', '.join(hcas) or 'none'}); use mooncake_protocol: tcp or fix transfer_device")

    def _register(self, tensor: torch.Tensor, dst: int, nbytes: int):
        ptr = tensor.data_ptr()
        entry = self._registered.get(ptr)
        if entry is not None and entry[0] != nbytes:
            return None  # the same address registered with another length: use the pool
        if entry is None:
            if self._engine.register_memory(ptr, nbytes) != 0:
                return None  # e.g. it overlaps another registration: the pool copy still works
            entry = self._registered[ptr] = [nbytes, 0]
        entry[1] += 1
        transfer = _SendTransfer(self, tensor, dst)

        def reclaim() -> None:
            transfer.acked = True
            entry[1] -= 1
            if entry[1] == 0:
                del self._registered[ptr]
                self._engine.unregister_memory(ptr)

        slot = self._lent.lend(dst, nbytes, reclaim)
        self._stats["registered_sends"] += 1
        return transfer, m.MooncakeLocation(self.session, ptr, nbytes, slot)

    def _in_pool(self, tensor: torch.Tensor, nbytes: int) -> bool:
        ptr = tensor.data_ptr()
        return (tensor.device.type == "cpu" and tensor.is_contiguous() and self._pool_addr <= ptr
                and ptr + nbytes <= self._pool_addr + self._pool.numel())

    def _reclaim_local(self) -> int:
        """Free our pool's blocks that wrapped tensors let go, and those of abandoned reads the engine has
        finished with; returns how many."""
        n = 0
        for offsets in self._local_free.drain().values():
            self._leases -= len(offsets)
            n += len(offsets)
            for offset in offsets:
                self._alloc.free(offset)
        if self._zombies:
            still = []
            for batch, offset in self._zombies:
                if self._engine.transfer_check_status(batch) == 0:
                    still.append((batch, offset))
                else:
                    self._alloc.free(offset)
                    n += 1
            self._zombies = still
        return n
