"""Who may speak on the control plane, checked in one place (docs/architecture.md §6).

Every participant names itself on its sockets: ``"rank<N>"`` for the worker of global rank N, ``"conductor"`` for
the conductor, ``"intake<N>"`` for an HTTP intake process. A receiver keeps a message only when its bytes decode to
an :class:`~mstar_dist.control.messages.Envelope` carrying this launch's deployment secret, the sender it claims is
the socket peer it came from, and that peer is one the receiver expects; anything else is a :class:`Reject`, which
the receiver logs and counts. The worker, the conductor and the intake all open envelopes with :func:`open_envelope`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from mstar_dist.control import messages as m

CONDUCTOR = "conductor"
"""The conductor's name on the control plane."""

_RANK = re.compile(r"rank(\d+)")


def rank_name(global_rank: int) -> str:
    """The control-plane name of the worker of ``global_rank``."""
    return f"rank{global_rank}"


def parse_rank(name: str) -> int | None:
    """The global rank a worker's name stands for (``"rank3"`` -> 3); None for any other name."""
    match = _RANK.fullmatch(name)
    return None if match is None else int(match.group(1))


def is_rank(name: str) -> bool:
    return _RANK.fullmatch(name) is not None


@dataclass(frozen=True)
class Reject:
    """Why a control message was dropped (the receiver logs it with its own name and counts it)."""

    sender: str
    """The socket peer it came from."""
    reason: str

    def __str__(self) -> str:
        return f"dropped a message from {self.sender!r}: {self.reason}"


def open_envelope(payload: bytes, sender: str, token: str, expected: Callable[[str], bool]) -> m.Envelope | Reject:
    """The envelope of ``payload``, received from socket peer ``sender``, when it is this launch's (``token``), claims
    to come from ``sender`` itself, and ``expected(sender)`` holds; else the :class:`Reject` saying why. Never
    raises."""
    try:
        env = m.decode(payload)
    except Exception as exc:
        return Reject(sender, f"undecodable: {exc}")
    if env.token != token:
        return Reject(sender, "without this launch's deployment secret")
    if env.sender != sender or not expected(sender):
        return Reject(sender, f"unknown sender (claims to be {env.sender!r})")
    return env
