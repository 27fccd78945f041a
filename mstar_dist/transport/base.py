"""The data-plane seam (docs/architecture.md §7): what the worker asks of a transport, and what it may raise.

A transport moves one tensor from a producer rank to a consumer rank. The producer posts the send and gets back
where the bytes are (``Location``) for the descriptor it then puts on the control plane; the consumer posts the
receive when that descriptor arrives. Implementations, one file each, listed by name in ``registry.py`` (which
says how to add one):

- ``p2p.py``: the directed pair groups (NCCL / gloo); FIFO per pair, no location;
- ``shm.py``: a shared-memory arena per rank for ranks of one host; the consumer wraps the bytes in place and
  acknowledges when it lets them go;
- ``mooncake.py``: the Mooncake transfer engine; the consumer reads one-sided, then acknowledges.
``shm`` and ``mooncake`` share ``arena.py``'s ``ArenaTransport``. ``router.py`` picks one per tensor (inline when
small, else by the consumer's host), meters every transfer, and is what the worker holds.

Arena transports lend producer memory until the consumer's ``TransferAck``: ``poll`` returns the
acknowledgements this rank owes (the worker sends them), ``on_ack`` takes the ones it is owed. A post that finds
the arena full raises :class:`ArenaFull`; the caller lets acknowledgements in and retries, for a bounded time.

Ranks are global ranks. Nothing here blocks unless its docstring says so; every object is used from the rank's
worker thread only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from mstar_dist.control import messages as m

if TYPE_CHECKING:
    from mstar_dist.distributed.groups import PairGroup

__all__ = ["ArenaFull", "DataPlane", "Done", "PeerDeadError", "Transfer", "TransferFailed"]


class PeerDeadError(RuntimeError):
    """The data plane to a peer was aborted (a failure, a timeout, or the peer was declared dead)."""


class TransferFailed(RuntimeError):
    """One transfer failed (the backend's error code or exception is in the message); its peer is suspect."""


class ArenaFull(RuntimeError):
    """No room in an arena right now; retry once acknowledgements have come in (the backpressure signal)."""


@runtime_checkable
class Transfer(Protocol):
    """One posted send or receive."""

    @property
    def tensor(self) -> torch.Tensor:
        """send: the source tensor. recv: the received tensor, valid once ``done()`` is true."""

    def done(self) -> bool:
        """True once complete (send: the source may be reused; recv: the data is there). Never blocks. Raises
        (PeerDeadError, TransferFailed, ...) if the transfer failed."""


class Done:
    """A transfer that completed when it was posted (inline values, empty tensors, arena copies)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def done(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Done({list(self.tensor.shape)} {self.tensor.dtype})"


@runtime_checkable
class DataPlane(Protocol):
    """A transport between this rank and its peers."""

    name: str
    """The transport's name in descriptors and config: its key in ``registry.TRANSPORTS``."""

    def post_send(self, tensor: torch.Tensor, dst: int) -> tuple[Transfer, m.Location | None]:
        """Start moving ``tensor`` to global rank ``dst``; returns the transfer and where the consumer finds the
        bytes (None for p2p). The descriptor goes on the control plane after this returns, then ``flush``. Never blocks;
        ArenaFull when there is no room now, PeerDeadError when the peer is aborted."""

    def flush(self) -> None:
        """Issue the sends ``post_send`` deferred (p2p defers every send until its descriptor is out, so the
        descriptor travels ahead of the bytes); a no-op for transports whose posts complete at once."""

    def device_inflight(self) -> bool:
        """Whether a transfer the device completes (NCCL) is in flight: nothing wakes the worker when one ends, so
        it polls instead of sleeping in the control channel's wait meanwhile."""

    def withdraw(self, transfer: Transfer) -> bool:
        """Drop a posted send whose descriptor will never go out, if nothing of it reached the peer yet; True
        if it was dropped (p2p: a deferred send). False: the caller must undo it some other way."""

    def post_recv(self, wire: m.WireTensor, src: int, device: torch.device | None = None) -> Transfer:
        """Start receiving the tensor ``wire`` describes from global rank ``src`` (call in descriptor order per
        sender). ``device``: where the tensor should end up (None: this rank's device; host tensors stay on the
        host). Never blocks."""

    def poll(self) -> list[tuple[int, m.TransferAck]]:
        """Advance internal work; return the acknowledgements to send now, as (producer's global rank, ack)."""

    def on_ack(self, src: int, ack: m.TransferAck) -> None:
        """Global rank ``src`` is done with the slots in ``ack``: reclaim them."""

    def abort_peer(self, peer: int, reason: str) -> None:
        """Declare the data plane to global rank ``peer`` dead for good: pending transfers with it fail, memory
        lent to it is reclaimed, later posts raise PeerDeadError naming ``reason``. Idempotent."""

    def is_dead(self, peer: int) -> bool:
        """Whether ``abort_peer`` was called for ``peer``."""

    def revive_peer(self, peer: int, pair_groups: Mapping[tuple[int, int], "PairGroup"]) -> None:
        """``peer`` was restarted and rejoined (docs/architecture.md §10): serve it again, as a new process.
        ``pair_groups``: the fresh groups of its pairs with this rank (p2p's; other transports ignore them). Nothing
        of the dead process is carried over: what it had been lent was reclaimed at ``abort_peer``."""

    def stats(self) -> dict:
        """Counters: at least ``sends``, ``recvs``, ``bytes_sent``, ``bytes_received``, ``host_staging_copies``,
        ``inflight``; arena transports add ``bytes_used``."""

    def close(self) -> None:
        """Release everything the transport holds (segments, registrations, helper threads). Idempotent."""
