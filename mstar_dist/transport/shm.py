"""Shared-memory transport: host-memory tensors between ranks of one host through a per-rank arena in /dev/shm
(docs/architecture.md §7, "shm").

Each rank owns one segment, ``/dev/shm/mstar_dist.<launch>.r<rank>.p<pid>``, created at start (space reserved
with ``posix_fallocate``, so a full /dev/shm is an error at start, not a SIGBUS mid-transfer) and mapped for
the rank's lifetime. A send copies the tensor into a first-fit slot of the sender's own segment (the one copy;
the source can be freed at once) and the descriptor names segment, offset and slot. The consumer maps the
producer's segment once and wraps the slot as a tensor without copying; when that tensor (and every view of
it) is let go the slot goes back and the producer frees it. So arena occupancy is what consumers still hold, and
0 when the deployment is idle. CUDA tensors are staged through host memory on both sides (counted in
``host_staging_copies``); shm is a host-memory transport.

Handing slots back: behind its arena each segment has ``RINGS`` release rings of ``RING_ENTRIES`` 8-byte entries,
one per consumer (the first ``RINGS`` consumers it sends to; the descriptor names the ring). The consumer writes
``slot + 1`` into the next entry if that entry is 0, the producer reads entries in order, frees their slots and
writes 0 back: each entry has one writer at a time (0: the consumer's, else the producer's) and every access is
one aligned 8-byte load or store, so no lock is needed and no control message is sent. The producer reads its
rings in ``poll`` (every turn of the worker's loop) and before it reports a full arena. When a ring is full, or
the producer has no ring for this consumer, the consumer sends ``TransferAck`` on the control plane instead.

Backpressure: a send that finds no room raises ``ArenaFull``; the worker lets acknowledgements in and retries
for ``transport.backpressure_timeout_s`` before failing the request with a message naming the arena. A tensor
bigger than the whole arena is a ValueError at once (raise ``transport.arena_bytes``).

Cleanup: ``close`` (called on every exit path, SIGTERM included) unlinks the segment. The owner holds a shared
``flock`` on its segment for its whole life, so a segment nobody holds a lock on belongs to a dead process:
``sweep_orphans`` (run at start) unlinks those, whichever launch or pid namespace they came from. Segments are
created under a temporary name and renamed once locked, and a temporary one is swept only once it is older than
``TMP_GRACE_S``, so a sweep never catches one half-made.

Ranks are global ranks; the transport is used from the rank's worker thread (wrapped tensors may be released on
any thread: that only queues an acknowledgement).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from mstar_dist.control import messages as m
from mstar_dist.transport.arena import ArenaTransport, ReleaseQueue, wrap_bytes
from mstar_dist.transport.base import Done, TransferFailed
from mstar_dist.transport.inline import str_to_dtype
from mstar_dist.transport.plane import TransportSetup

__all__ = ["SEGMENT_PREFIX", "ShmTransport", "build", "sweep_orphans"]

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
RINGS = 64
"""Release rings per segment: consumers beyond the first 64 a rank sends to acknowledge by message."""
RING_ENTRIES = 1024
"""Slots one consumer can hand back before its producer reads them; more go by message."""
SEGMENT_PREFIX = "mstar_dist."
_SEGMENT_NAME = re.compile(r"mstar_dist\.[0-9A-Za-z_-]+\.r\d+\.p\d+")
_SWEEPABLE = re.compile(r"mstar_dist\.[0-9A-Za-z_-]+\.r\d+\.p\d+|\.mstar_dist\.tmp\.[0-9a-f]+")
"""Segments, and segments that a process died creating (before it renamed them)."""
TMP_GRACE_S = 60.0
"""A half-made segment younger than this is never swept: its creator opens it before it can lock it, and a sweep of
another rank starting on the host in that moment would unlink it (and the creator's rename then fail)."""


def sweep_orphans(directory: Path = SHM_DIR) -> list[str]:
    """Unlink the segments of dead processes under ``directory`` (no one holds their lock); returns their names.

    Safe while other servers run: a live owner holds its lock, and this only takes it without blocking."""
    removed = []
    try:
        names = sorted(p.name for p in directory.iterdir() if _SWEEPABLE.fullmatch(p.name))
    except OSError:
        return removed
    for name in names:
        path = directory / name
        try:
            if name.startswith(".") and time.time() - path.stat().st_mtime < TMP_GRACE_S:
                continue  # maybe still being made: not yet locked by its creator
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its owner is alive
        except OSError:
            continue
        else:
            try:
                path.unlink()
                removed.append(name)
            except OSError:
                pass
        finally:
            os.close(fd)
    if removed:
        log.warning("removed %d shared-memory segment(s) left by dead servers: %s", len(removed), ", ".join(removed))
    return removed


def build(setup: TransportSetup) -> ShmTransport:
    """This rank's shm transport (the registry's factory): first the segments dead servers left behind go, then
    this rank's own is made (``transport.arena_bytes``, named by the launch)."""
    sweep_orphans()
    return ShmTransport(setup.global_rank, launch_id=setup.launch_id, arena_bytes=setup.config.arena_bytes,
                        device=setup.device)


class _Segment:
    """A mapped segment (ours, or a peer's) with a numpy view over all of it."""

    def __init__(self, path: Path, fd: int, size: int) -> None:
        self.path = path
        self.fd = fd
        self.size = size
        self.map = mmap.mmap(fd, size)
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.address = self.array.ctypes.data
        """Address of the segment's first byte in this process (valid while the mapping lives: our lifetime)."""
        # the release rings: a memoryview of 8-byte words reads and writes plain ints, each one aligned 8-byte
        # load or store, cheaper than numpy's scalars (the producer reads a ring every turn of its loop)
        self.words = memoryview(self.map)[:size - size % 8].cast("Q")


class ShmTransport(ArenaTransport):
    """This rank's arena plus the peers' segments it reads from. Implements ``transport.base.DataPlane``."""

    name = "shm"
    location_type = m.ShmLocation

    def __init__(self, global_rank: int, *, launch_id: str, arena_bytes: int, device: str | torch.device = "cpu",
                 directory: Path = SHM_DIR) -> None:
        """Create and map this rank's segment of ``arena_bytes`` under ``directory``; ``launch_id`` (letters,
        digits, ``-``/``_``) makes the name unique per server instance. OSError naming the path and the free
        space when /dev/shm cannot hold it."""
        if not re.fullmatch(r"[0-9A-Za-z_-]+", launch_id):
            raise ValueError(f"launch id {launch_id!r} must be letters, digits, '-' or '_'")
        self._dir = Path(directory)
        arena_bytes -= arena_bytes % 64
        self._own = _create(self._dir, f"{SEGMENT_PREFIX}{launch_id}.r{global_rank}.p{os.getpid()}", arena_bytes,
                            global_rank)
        self._segment = self._own.path.name
        self.arena_label = f"shared-memory arena {self._segment}"
        super().__init__(global_rank, device, self._own.array, arena_bytes, slots_back_by_ring=0,
                         slots_back_by_message=0)
        self._released = ReleaseQueue()
        self._peers: dict[str, _Segment] = {}
        self._rings: dict[int, list[int]] = {}  # consumer -> [byte offset of its ring here, next entry to read]
        self._peer_rings: dict[int, list] = {}  # producer -> [its segment, word index of our ring there, next entry]
        self._epochs: dict[int, int] = {}  # producer -> how often it was revived: a release of its old arena is void
        log.info("rank %d: shared-memory arena %s (%d bytes)", global_rank, self._own.path, self._own.size)

    @property
    def segment(self) -> str:
        """This rank's segment name (under /dev/shm)."""
        return self._segment

    def poll(self) -> list[tuple[int, m.TransferAck]]:
        """Free the slots our consumers handed back through their rings; hand back the ones we let go (through
        the producer's ring, else as acknowledgements to send: returned here, none to dead peers)."""
        if self._rings:
            self._read_rings()
        if not self._released:  # nothing let go since the last turn: the common case
            return []
        spill: dict[int, list[int]] = {}
        for peer, slot in self._released.take():
            self._leases -= 1
            if peer < 0:  # a slot of a producer's previous process (it restarted): nobody to hand it back to
                continue
            if peer not in self._dead and not self._write_ring(peer, slot):
                spill.setdefault(peer, []).append(slot)
        self._stats["slots_back_by_message"] += sum(len(slots) for slots in spill.values())
        return self._ack_messages(spill)

    # -- ArenaTransport -------------------------------------------------------------------------------------
    def _location(self, dst: int, offset: int, nbytes: int, slot: int) -> m.ShmLocation:
        if slot < 0:
            return m.ShmLocation(self._segment, 0, 0, -1)
        ring = self._rings.get(dst)
        return m.ShmLocation(self._segment, offset, nbytes, slot, self._ring_for(dst) if ring is None else ring[0])

    def _receive(self, wire: m.WireTensor, loc: m.ShmLocation, src: int, target: torch.device) -> Done:
        """Wrap the bytes global rank ``src`` lent us (no copy; a CUDA consumer gets a device copy, and the slot
        goes back at once). The slot is handed back when the tensor is let go."""
        seg = self._peers.get(loc.segment) or self._peer_segment(loc.segment, src)
        nbytes = loc.nbytes
        if loc.offset < 0 or loc.offset + nbytes > seg.size:
            raise TransferFailed(f"shm descriptor from rank {src} points past segment {loc.segment} "
                                 f"({loc.offset}+{nbytes} > {seg.size})")
        if loc.ring >= 0 and src not in self._peer_rings:
            if loc.ring % 8 or not seg.size - RINGS * RING_ENTRIES * 8 <= loc.ring <= seg.size - RING_ENTRIES * 8:
                raise TransferFailed(f"shm descriptor from rank {src} names a release ring at {loc.ring}, "
                                     f"outside segment {loc.segment}'s rings")
            self._peer_rings[src] = [seg, loc.ring // 8, 0]
        released, slot, epochs = self._released, loc.slot, self._epochs
        epoch = epochs.get(src, 0)
        self._leases += 1  # until the release comes back through ``poll`` (also when the wrap fails: it releases)
        out = wrap_bytes(seg.array, loc.offset, nbytes, str_to_dtype(wire.dtype), wire.shape,
                         lambda: released.put(src if epochs.get(src, 0) == epoch else -1, slot))
        return Done(self._to_target(out, target))

    def _make_room(self) -> int:
        return self._read_rings()

    def _on_peer_revived(self, peer: int) -> None:
        """``peer``'s new process starts its release ring here from the first entry, and has a new segment: what it
        wrote as the old process is void, and so are our releases of the old segment's slots (``_epochs``)."""
        ring = self._rings.get(peer)
        if ring is not None:
            words, base = self._own.words, ring[0] // 8
            for i in range(base, base + RING_ENTRIES):
                words[i] = 0
            ring[1] = 0
        self._peer_rings.pop(peer, None)
        self._epochs[peer] = self._epochs.get(peer, 0) + 1

    def _close(self) -> None:
        """Unlink this rank's segment and drop the peers' mappings; never raises."""
        for seg in [self._own, *self._peers.values()]:
            try:
                os.close(seg.fd)
            except OSError:
                pass
        try:
            self._own.path.unlink()
        except OSError:
            pass
        # The mappings stay until the last wrapped tensor is gone (closing a map with live views would fail).
        self._peers.clear()

    # -- release rings (see the module's docstring) -----------------------------------------------------------
    def _ring_for(self, consumer: int) -> int:
        """Byte offset of ``consumer``'s release ring in our segment (made on the first send), or -1."""
        ring = self._rings.get(consumer)
        if ring is None:
            if len(self._rings) >= RINGS:
                return -1
            ring = self._rings[consumer] = [self._alloc.size + len(self._rings) * RING_ENTRIES * 8, 0]
        return ring[0]

    def _read_rings(self) -> int:
        """Free every slot our consumers wrote into their rings; returns how many."""
        words, lent, n = self._own.words, self._lent, 0
        for consumer, ring in self._rings.items():
            base = ring[0] // 8
            while True:
                i = base + ring[1] % RING_ENTRIES
                value = words[i]
                if value == 0:
                    break
                words[i] = 0
                ring[1] += 1
                n += lent.give_back_one(consumer, value - 1)
        return n

    def _write_ring(self, producer: int, slot: int) -> bool:
        """Hand ``slot`` back through ``producer``'s ring; False when it does not fit now (or there is no ring)."""
        ring = self._peer_rings.get(producer)
        if ring is None:
            return False
        words, i = ring[0].words, ring[1] + ring[2] % RING_ENTRIES
        if words[i] != 0:  # the producer has not read this far yet
            return False
        words[i] = slot + 1
        ring[2] += 1
        self._stats["slots_back_by_ring"] += 1
        return True

    # -- internals ------------------------------------------------------------------------------------------
    def _peer_segment(self, name: str, src: int) -> _Segment:
        seg = self._peers.get(name)
        if seg is not None:
            return seg
        if not _SEGMENT_NAME.fullmatch(name):
            raise TransferFailed(f"rank {src} named a shared-memory segment {name!r} that is not ours")
        path = self._dir / name
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise TransferFailed(
                f"rank {self.global_rank} cannot open rank {src}'s shared-memory segment {path} "
                f"({os.strerror(exc.errno or errno.ENOENT)}): transport 'shm' needs ranks that share /dev/shm "
                f"(one machine); use p2p or mooncake between hosts") from None
        seg = _Segment(path, fd, os.fstat(fd).st_size)
        self._peers[name] = seg
        return seg


def _create(directory: Path, name: str, arena_bytes: int, global_rank: int) -> _Segment:
    """Create, lock (shared, for life) and map segment ``name``: the arena plus the release rings behind it."""
    size = arena_bytes + RINGS * RING_ENTRIES * 8
    path = directory / name
    tmp = directory / f".{SEGMENT_PREFIX}tmp.{uuid.uuid4().hex}"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # held for life: the sweeper's sign that we are alive
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot reserve {size} bytes for rank {global_rank}'s shared-memory arena "
                          f"{path} (transport.arena_bytes {arena_bytes} and {size - arena_bytes} of release rings; "
                          f"{os.strerror(exc.errno)}; {_free_bytes(directory)} bytes free there): lower "
                          f"transport.arena_bytes or enlarge {directory}") from None
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return _Segment(path, fd, size)


def _free_bytes(directory: Path) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize
