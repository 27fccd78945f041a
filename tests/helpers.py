"""Small helpers shared by tests: a free port, a walk driven to its end, and a control port that records.

A failure in a test that uses these points to the code under test, not here: they hold no logic of the runtime.
"""

from __future__ import annotations

import socket
from typing import Callable

from mstar_dist.control import messages as m
from mstar_dist.graph.walk import NodeCall, NodeResult, WalkRun


def free_port(span: int = 1) -> int:
    """A loopback port that is free, with the ``span - 1`` ports after it (a launch that also uses its port + 1,
    as ``launch/serve_node.sh``'s join check does, must not find a listener of another test there). It may be taken
    again before use."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + span <= 65536 and all(_bindable(port + k) for k in range(1, span)):
            return port
    raise RuntimeError(f"found no {span} free consecutive loopback ports in 100 tries")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def drive_batches(run: WalkRun, fn: Callable[[NodeCall], NodeResult],
                  on_call: Callable[[WalkRun, NodeCall], None] = lambda run, call: None,
                  limit: int = 100_000) -> list[list[NodeCall]]:
    """Complete every ready call with ``fn(call)`` (after ``on_call(run, call)``) until the walk is done or ``limit``
    calls were made; returns the calls of each ready batch, in hand-out order."""
    batches: list[list[NodeCall]] = []
    made = 0
    while not run.done and made < limit:
        batch = run.ready()
        assert batch, "walk is neither done nor has a ready call"
        batches.append(batch)
        for call in batch:
            made += 1
            on_call(run, call)
            run.complete(call, fn(call))
    return batches


def drive(run: WalkRun, fn: Callable[[NodeCall], NodeResult],
          on_call: Callable[[WalkRun, NodeCall], None] = lambda run, call: None,
          limit: int = 100_000) -> list[NodeCall]:
    """:func:`drive_batches`, the calls one after another."""
    return [call for batch in drive_batches(run, fn, on_call, limit) for call in batch]


class FakeChannel:
    """A control port (``control/port.py``) in memory: what is sent is kept decoded in ``sent`` as (peer, body);
    ``recv`` hands out what a test put in ``inbox`` as (sender, payload)."""

    endpoint = "inproc://fake"

    def __init__(self, name: str = "fake") -> None:
        self.name = name
        self.inbox: list[tuple[str, bytes]] = []
        self.sent: list[tuple[str, m.Message]] = []

    def send(self, peer_name: str, payload: bytes) -> None:
        self.sent.append((peer_name, m.decode(payload).body))

    def recv(self, timeout_ms: int = 0, max_messages: int = 10_000, spin_s: float = 0.0) -> list[tuple[str, bytes]]:
        out, self.inbox = self.inbox, []
        return out

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass
