"""The conductor's side of the HTTP intake processes (docs/architecture.md §2, "Intake processes").

Runs on the conductor thread, like everything of the conductor. An intake's ``Submit`` becomes a request whose
sink appends the request's events to that intake's outbox; the conductor's loop calls :meth:`IntakeHub.flush`
once per turn, so an intake gets one ``Outputs`` message per turn, whatever the number of tokens in it. The events
are ``mstar_dist/events.py``'s own, as the in-process sinks get them (``events.to_wire``). The hub also answers
``MetricsAsk`` (the runtime's metrics plus the sum of every intake's HTTP counts) and tells each intake whether the
deployment serves (``Health``, sent when it changes). It knows the conductor only through the callables it is given.
"""

from __future__ import annotations

import logging
from typing import Callable

from mstar_dist.conductor.metrics import render_counts
from mstar_dist.conductor.commands import Abort, Command, Sink, Submit
from mstar_dist.control import messages as m
from mstar_dist.control.channel import ChannelFullError
from mstar_dist.events import BackendError, Failed, MediaDelta, OutputEvent, TextDelta, WireEvent, to_wire

log = logging.getLogger(__name__)


class IntakeHub:
    def __init__(self, names: tuple[str, ...], *, send: Callable[[str, m.Message], None],
                 health: Callable[[], tuple[bool, str]], execute: Callable[[Command], None],
                 metrics_text: Callable[[], str]) -> None:
        """``names``: the intakes of this launch. ``send(intake, body)`` sends a message (raises ``ChannelFullError``
        when the intake does not read); ``health()`` is the conductor's; ``execute(command)`` carries out a command
        on the conductor thread; ``metrics_text()`` is the runtime's Prometheus text."""
        self._send_raw, self._health, self._execute, self._metrics_text = send, health, execute, metrics_text
        self._out: dict[str, list[tuple[str, WireEvent]]] = {name: [] for name in names}
        self._sinks: dict[tuple[str, str], Sink] = {}  # (intake, request id) -> the sink of a running request
        self._counts: dict[str, m.HttpCounts] = {}
        self._health_sent: dict[str, tuple[bool, str]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._out

    def handle(self, intake: str, body: m.Message) -> None:
        if isinstance(body, m.Submit):
            rid = body.params.request_id
            if (intake, rid) in self._sinks:  # the running one keeps its sink (a Cancel must still find it)
                self._out[intake].append((rid, Failed(409, f"request_id {rid!r} is already in flight; use a new id")))
                return
            serving, reason = self._health()
            sink = self.sink(intake, rid)
            if not serving:
                sink(BackendError(503, f"not serving: {reason}"))
                return
            self._execute(Submit(body.params, sink, body.pinned_id))
        elif isinstance(body, m.Cancel):
            sink = self._sinks.get((intake, body.request_id))
            if sink is not None:  # else it has ended already
                self._execute(Abort(body.request_id, sink))
                self._sinks.pop((intake, body.request_id), None)
        elif isinstance(body, m.HttpCounts):
            self._counts[intake] = body
        elif isinstance(body, m.MetricsAsk):
            self._counts[intake] = body.counts
            text = self._metrics_text()
            if text and not text.endswith("\n"):
                text += "\n"
            text += render_counts([(cnt.requests, cnt.in_flight, cnt.disconnects) for cnt in self._counts.values()])
            self._send(intake, m.MetricsText(ask=body.ask, text=text))
        else:
            log.warning("conductor: unexpected %s from %s", type(body).__name__, intake)

    def sink(self, intake: str, request_id: str) -> Sink:
        """The sink of request ``request_id`` of ``intake``: its events go to the intake's outbox."""
        out = self._out[intake]

        def sink(event: OutputEvent) -> None:
            if type(event) is TextDelta:  # every token
                out.append((request_id, event))
                return
            out.append((request_id, to_wire(event)))
            if isinstance(event, MediaDelta):
                return
            if self._sinks.get((intake, request_id)) is sink:  # the request is over
                del self._sinks[(intake, request_id)]

        self._sinks[(intake, request_id)] = sink
        return sink

    def flush(self) -> None:
        """Send each intake what its requests produced since the last flush, in one message."""
        for intake, out in self._out.items():
            if out:
                items = out[:]
                out.clear()
                self._send(intake, m.Outputs(items=items))

    def push_health(self) -> None:
        """Tell every intake whose last news is stale whether the deployment serves."""
        health = self._health()
        for intake in self._out:
            if self._health_sent.get(intake) != health:
                self._health_sent[intake] = health
                self._send(intake, m.Health(serving=health[0], reason=health[1]))

    def _send(self, intake: str, body: m.Message) -> None:
        try:
            self._send_raw(intake, body)
        except ChannelFullError:
            # the intake reads nothing: what it runs is lost to its clients, so free it here
            log.error("conductor: %s does not read its control socket; aborting its requests", intake)
            for (name, request_id), sink in list(self._sinks.items()):
                if name == intake:
                    self._execute(Abort(request_id, sink))
                    del self._sinks[(name, request_id)]
