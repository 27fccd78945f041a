"""The control port: what the worker and the conductor need of a control channel (docs/architecture.md §6).

:class:`mstar_dist.control.channel.ControlChannel` is the implementation; tests pass in-memory fakes. Bytes only:
serialisation is the caller's (``control/messages.py``). Not thread-safe, ``wake`` excepted.
"""

from __future__ import annotations

from typing import Protocol


class ControlPort(Protocol):
    """One participant's sockets: send to a named peer, receive from any, wake a blocked receive."""

    name: str
    """This participant's name on the control plane (``"rank3"``, ``"conductor"``, ``"intake0"``)."""

    def send(self, peer_name: str, payload: bytes) -> None:
        """Queue ``payload`` for ``peer_name``; never blocks (raises ``ChannelFullError`` at the peer's bound)."""

    def recv(self, timeout_ms: int = 0, max_messages: int = 10_000,
             spin_s: float = 0.0) -> list[tuple[str, bytes]]:
        """Messages that arrived, as (sender, payload) in each sender's order; blocks up to ``timeout_ms``."""

    def reconnect(self, peer_name: str, endpoint: str) -> None:
        """``peer_name`` restarted with a new ``endpoint``: send to the new process from now on."""

    def wake(self) -> None:
        """End a ``recv`` blocked on another thread at once (the one call that is thread-safe)."""

    def close(self) -> None:
        """Release the sockets; messages not yet sent may be dropped."""
