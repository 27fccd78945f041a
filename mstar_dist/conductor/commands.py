"""What another thread asks of the conductor (docs/architecture.md §6): commands, and the sinks its events go to.

The in-process HTTP backend (``conductor/backend.py``) hands commands to :meth:`Conductor.command` (a thread-safe
queue plus a wake-up of the conductor's control channel); an intake's ``Submit`` / ``Cancel`` messages become the same
commands on the conductor thread (``conductor/intake_hub.py``). A request's events go to its ``Sink``, called on the
conductor thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from mstar_dist.events import GenerationParams, OutputEvent

Sink = Callable[[OutputEvent], None]
"""Where a request's events go, in order, on the conductor thread: deltas, then ``Finished`` or a ``BackendError``."""


@dataclass(frozen=True)
class Submit:
    """Run ``params``; its events go to ``sink``."""

    params: GenerationParams
    sink: Sink
    pinned_id: bool
    """The client chose the request id (it then seeds sampling: docs/architecture.md §4)."""


@dataclass(frozen=True)
class Abort:
    """Abort request ``request_id``, queued or running; with ``sink``, only the submission that owns that sink (a
    late abort must not hit a newer request that reuses a pinned id)."""

    request_id: str
    sink: Sink | None = None


@dataclass(frozen=True)
class RankDied:
    """A rank's supervisor saw it die (its record in the launch's store, handed over by the front end's watcher:
    docs/architecture.md §10)."""

    rank: int
    host: str
    incarnation: int
    """Which process of the rank died (0: its first)."""
    cause: str
    """In words: ``killed by SIGKILL``, ``exited with status 1``, ..."""
    restarting: bool
    """Whether its supervisor starts it again (else no restart is left)."""


Command = Union[Submit, Abort, RankDied]
