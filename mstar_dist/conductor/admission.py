"""Admission (docs/architecture.md §6): which submitted requests run now, wait in the queue, or are refused.

At most ``limits.max_concurrent_requests`` run; up to ``limits.max_queued_requests`` more wait, first in first out;
beyond that a request is refused at once with a 429 whose ``Retry-After`` estimates how long the queue ahead takes to
drain. A request that waits longer than ``limits.request_timeout_s`` fails with a 504. Runs on the conductor thread.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Container, Mapping

from mstar_dist.conductor.commands import Sink, Submit
from mstar_dist.conductor.metrics import Metrics
from mstar_dist.events import BackendError, GenerationParams


@dataclass
class Queued:
    """A request waiting for admission."""

    params: GenerationParams
    sink: Sink
    pinned_id: bool
    arrived: float = field(default_factory=time.monotonic)


class Admission:
    """The admission rule and its queue (see the module docstring)."""

    def __init__(self, *, max_concurrent: int, max_queued: int, metrics: Metrics) -> None:
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.metrics = metrics
        self.queue: collections.deque[Queued] = collections.deque()
        self.latency_ewma_s = 1.0
        """Recent request latency, for the Retry-After hint of a refused request."""

    def take(self, cmd: Submit, running: Mapping[str, object], fanned: Container[str] = ()) -> bool:
        """True when ``cmd``'s request may start now (``running``: the requests running, by client id; ``fanned``:
        the ids of running requests with several choices, which run under their choices' ids). Else it was queued,
        or refused on its sink: a 409 for an id already in flight, a 429 when the queue is full."""
        rid = cmd.params.request_id
        if rid in running or rid in fanned or any(q.params.request_id == rid for q in self.queue):
            cmd.sink(BackendError(409, f"request_id {rid!r} is already in flight; use a new id"))
            return False
        self.metrics.requests_received += 1
        if len(running) < self.max_concurrent:
            return True
        if len(self.queue) < self.max_queued:
            self.queue.append(Queued(cmd.params, cmd.sink, cmd.pinned_id))
            return False
        self.metrics.observe_rejected("queue_full")
        cmd.sink(BackendError(429, f"the server is at capacity: {len(running)} requests running and "
                                   f"{len(self.queue)} queued (limits.max_queued_requests); retry later",
                              retry_after_s=self.retry_after_s()))
        return False

    def next(self, running: int) -> Queued | None:
        """The oldest queued request, when ``running`` leaves room for it."""
        if self.queue and running < self.max_concurrent:
            return self.queue.popleft()
        return None

    def abort(self, request_id: str, sink: Sink | None) -> bool:
        """Drop a queued request (only the submission owning ``sink``, when given); True when it was queued."""
        for i, q in enumerate(self.queue):
            if q.params.request_id == request_id and sink in (None, q.sink):
                del self.queue[i]
                self.metrics.observe_done("abort", 0.0, 0)
                return True
        return False

    def expire(self, now: float, limit_s: float) -> None:
        """Fail (504) every queued request older than ``limit_s``."""
        while self.queue and now - self.queue[0].arrived > limit_s:  # FIFO: the oldest is first
            q = self.queue.popleft()
            self.metrics.observe_done("error", now - q.arrived, 0)
            q.sink(BackendError(504, f"request timed out after {limit_s:g} s waiting for admission "
                                     f"(limits.request_timeout_s); the server is overloaded"))

    def fail_all(self, status: int, message: str) -> None:
        while self.queue:
            self.queue.popleft().sink(BackendError(status, message))

    def observe_latency(self, latency_s: float) -> None:
        """A request ended after ``latency_s``: the Retry-After hint follows recent latency."""
        self.latency_ewma_s += 0.2 * (latency_s - self.latency_ewma_s)

    def retry_after_s(self) -> int:
        """About how long the queue ahead takes to drain (recent latency x queue waves), 1 to 60 s."""
        waves = (len(self.queue) + 1) / self.max_concurrent
        return int(min(60, max(1, math.ceil(waves * self.latency_ewma_s))))
