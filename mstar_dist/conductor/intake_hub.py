"""The conductor's side of the HTTP intake processes (docs/architecture.md §2, "Intake processes").

Runs on the conductor thread, like everything of the conductor. An intake's ``Submit`` becomes a request whose
sink appends the request's events to that intake's outbox; the conductor's loop calls :meth:`IntakeHub.flush`
once per turn, so an intake gets one ``Outputs`` message per turn, whatever the number of tokens in it. The hub
also answers ``MetricsAsk`` (the runtime's metrics plus the sum of every intake's HTTP counts) and tells each
intake whether the deployment serves (``Health``, sent when it changes).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mstar_dist.conductor.metrics import render_counts
from mstar_dist.control import messages as m
from mstar_dist.control.channel import ChannelFullError
from mstar_dist.events import BackendError, Finished, MediaDelta, TextDelta

if TYPE_CHECKING:
    from mstar_dist.conductor.conductor import Conductor

log = logging.getLogger(__name__)


class IntakeHub:
    def __init__(self, conductor: Conductor, names: tuple[str, ...]) -> None:
        self._conductor = conductor
        self._out: dict[str, list] = {name: [] for name in names}
        self._sinks: dict[tuple[str, str], object] = {}  # (intake, request id) -> the sink of a running request
        self._counts: dict[str, m.HttpCounts] = {}
        self._health_sent: dict[str, tuple[bool, str]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._out

    def handle(self, intake: str, body: m.Message) -> None:
        c = self._conductor
        if isinstance(body, m.Submit):
            rid = body.params.request_id
            if (intake, rid) in self._sinks:  # the running one keeps its sink (a Cancel must still find it)
                self._out[intake].append(m.OutError(request_id=rid, status=409,
                                                    message=f"request_id {rid!r} is already in flight; use a new id"))
                return
            serving, reason = c.health()
            sink = self._sink(intake, rid)
            if not serving:
                sink(BackendError(503, f"not serving: {reason}"))
                return
            c.submit(body.params, sink, body.pinned_id)
        elif isinstance(body, m.Cancel):
            sink = self._sinks.get((intake, body.request_id))
            if sink is not None:  # else it has ended already
                c.abort(body.request_id, sink)
                self._sinks.pop((intake, body.request_id), None)
        elif isinstance(body, m.HttpCounts):
            self._counts[intake] = body
        elif isinstance(body, m.MetricsAsk):
            self._counts[intake] = body.counts
            text = c.metrics.render()
            if text and not text.endswith("\n"):
                text += "\n"
            text += render_counts([(cnt.requests, cnt.in_flight, cnt.disconnects) for cnt in self._counts.values()])
            self._send(intake, m.MetricsText(ask=body.ask, text=text))
        else:
            log.warning("conductor: unexpected %s from %s", type(body).__name__, intake)

    def _sink(self, intake: str, request_id: str):
        out = self._out[intake]

        def sink(event) -> None:
            if isinstance(event, TextDelta):
                out.append(m.OutText(request_id=request_id, text=event.text, n_tokens=event.n_tokens))
                return
            if isinstance(event, MediaDelta):
                out.append(m.OutMedia(request_id=request_id, modality=event.modality, data=event.data,
                                      metadata=dict(event.metadata), n_tokens=event.n_tokens))
                return
            if isinstance(event, Finished):
                out.append(m.OutFinished(request_id=request_id, finish_reason=event.finish_reason,
                                         prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens))
            elif isinstance(event, BackendError):
                out.append(m.OutError(request_id=request_id, status=event.status, message=event.message,
                                      retry_after_s=event.retry_after_s))
            else:
                out.append(m.OutError(request_id=request_id, status=500, message=f"{type(event).__name__}: {event}"))
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
        health = self._conductor.health()
        for intake in self._out:
            if self._health_sent.get(intake) != health:
                self._health_sent[intake] = health
                self._send(intake, m.Health(serving=health[0], reason=health[1]))

    def _send(self, intake: str, body: m.Message) -> None:
        c = self._conductor
        try:
            c.channel.send(intake, m.encode(c.token, "conductor", body))
        except ChannelFullError:
            # the intake reads nothing: what it runs is lost to its clients, so free it here
            log.error("conductor: %s does not read its control socket; aborting its requests", intake)
            for (name, request_id), sink in list(self._sinks.items()):
                if name == intake:
                    c.abort(request_id, sink)
                    del self._sinks[(name, request_id)]
