"""Requests with ``n`` > 1 (docs/architecture.md §5, "Several choices"): the conductor runs n requests of the same
prompt, choice i with seed ``seed + i``; their events reach the client's sink tagged with their index, and one
``Finished`` ends them all: each choice's end in ``choices``, the prompt counted once, the completions summed.

Each choice is a request of its own on the ranks (its own prefill, KV slot and walks): they are dispatched together,
so an engine prefills them in one batched forward. Sharing one prefill and forking its KV would save the prompt's
compute, not memory (a ``StaticKVCache`` slot holds a whole copy of the context), at the price of an engine call
that answers one prompt with n rows; the batched prefill costs about one forward at the prompt lengths chat clients
use. A choice that fails fails the request: its error goes to the client once and the other choices are aborted.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import msgspec

from mstar_dist.conductor.commands import Sink
from mstar_dist.events import BackendError, ChoiceEnd, Finished, GenerationParams, MediaDelta, OutputEvent, TextDelta


def choice_id(request_id: str, index: int) -> str:
    """The conductor's id of choice ``index`` of request ``request_id``."""
    return f"{request_id}#choice{index}"


class Fanout:
    """The n choices of one request, between their sinks and the client's (see the module docstring)."""

    def __init__(self, params: GenerationParams, sink: Sink, seed: int, *, abort: Callable[[str], None],
                 ended: Callable[[], None]) -> None:
        """``seed``: the request's (choice i draws with ``seed + i``); ``abort(choice id)`` aborts a running choice;
        ``ended()`` is called once, when the request is over."""
        self.sink = sink
        self.n = params.n
        self.choices = [dataclasses.replace(params, request_id=choice_id(params.request_id, i), n=1,
                                            seed=(seed + i) % 2**63) for i in range(params.n)]
        """Each choice's request."""
        self._abort, self._ended = abort, ended
        self._ends: dict[int, Finished] = {}
        self._over = False

    def start(self, start: Callable[[GenerationParams, Sink], None]) -> None:
        """``start(choice, its sink)`` for each choice in order, until one fails to start (its error ends the
        request)."""
        for i, choice in enumerate(self.choices):
            if self._over:
                return
            start(choice, lambda event, i=i: self._event(i, event))

    def abort(self) -> None:
        """The client went away: abort every choice; the client's sink gets nothing more."""
        if not self._over:
            self._end()
            for i in range(self.n):
                if i not in self._ends:
                    self._abort(self.choices[i].request_id)

    def _event(self, index: int, event: OutputEvent) -> None:
        if self._over:
            return
        if isinstance(event, (TextDelta, MediaDelta)):
            self.sink(msgspec.structs.replace(event, index=index) if index else event)
        elif isinstance(event, Finished):
            self._ends[index] = event
            if len(self._ends) == self.n:
                self._end()
                self.sink(self._finished())
        else:  # an error: the request fails once, and its other choices stop
            self._end()
            self.sink(event if isinstance(event, BackendError) else BackendError(500, str(event)))
            for i in range(self.n):
                if i != index and i not in self._ends:
                    self._abort(self.choices[i].request_id)

    def _end(self) -> None:
        self._over = True
        self._ended()

    def _finished(self) -> Finished:
        ends = [self._ends[i] for i in range(self.n)]
        return Finished(finish_reason=ends[0].finish_reason, prompt_tokens=ends[0].prompt_tokens,
                        completion_tokens=sum(e.completion_tokens for e in ends),
                        choices=[ChoiceEnd(i, e.finish_reason, e.completion_tokens) for i, e in enumerate(ends)])
