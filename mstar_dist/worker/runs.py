"""The walks a rank runs, and what turns a ``RunWalk``'s inputs into a walk's values (docs/architecture.md §2).

Runs are keyed by (request, walk): two partitions of one request may run on the same rank. A removed request's id is
remembered (the most recent ones), so that a message that arrives after its ``RemoveRequest`` is ignored.
"""

from __future__ import annotations

import collections

import torch

from mstar_dist.control import messages as m
from mstar_dist.engine.component import Component
from mstar_dist.graph.nodes import Section, iter_nodes
from mstar_dist.graph.walk import WalkRun
from mstar_dist.transport.inline import decode_tensor
from mstar_dist.transport.store import TensorStore
from mstar_dist.worker.spans import REMOTE

REMEMBERED_REMOVALS = 100_000
"""Removed request ids kept to ignore their late messages (the oldest are forgotten first)."""


class Runs:
    """The rank's walk runs, by (request, walk) and by request, and the requests removed lately."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[str, str], WalkRun] = {}
        """(request, walk) -> run: the loop's index (every turn reads it)."""
        self._of: dict[str, dict[str, WalkRun]] = {}
        """Request -> walk -> run: ``by_key`` by request (a scan of every run, twice for each walk that ends, would
        make a large prefill batch's end quadratic in the runs on the rank)."""
        self.removed: collections.OrderedDict[str, None] = collections.OrderedDict()
        """Requests removed lately (``RemoveRequest``), oldest first: their late messages are ignored."""

    def of(self, request_id: str) -> list[WalkRun]:
        """The request's walks on this rank."""
        walks = self._of.get(request_id)
        return list(walks.values()) if walks else []

    def add(self, run: WalkRun) -> None:
        self.by_key[(run.request_id, run.walk)] = run
        self._of.setdefault(run.request_id, {})[run.walk] = run

    def drop(self, run: WalkRun) -> WalkRun:
        """Forget ``run`` (if it is still the one this rank runs for its request and walk)."""
        key = (run.request_id, run.walk)
        if self.by_key.get(key) is run:
            del self.by_key[key]
            walks = self._of[run.request_id]
            del walks[run.walk]
            if not walks:
                del self._of[run.request_id]
        return run

    def remove(self, request_id: str) -> list[WalkRun]:
        """Remember the request as removed and forget its runs; returns them (still to be closed)."""
        self.removed[request_id] = None
        while len(self.removed) > REMEMBERED_REMOVALS:
            self.removed.popitem(last=False)
        return [self.drop(run) for run in self.of(request_id)]


def host_inputs(section: Section, components: dict[str, Component]) -> frozenset[str]:
    """The walk's inputs that stay on the host when they arrive inline: those that every node of the walk taking
    them runs here, in a component that moves them to its device itself (``Component.host_inputs``)."""
    takers: dict[str, list] = collections.defaultdict(list)
    for node in iter_nodes(section):
        for name in (*node.inputs, *node.optional_inputs):
            takers[name].append(components.get(node.name))
    return frozenset(name for name, comps in takers.items()
                     if all(c is not None and name in c.host_inputs for c in comps))


def resolve(value: m.Value, received: torch.Tensor | None, *, store: TensorStore, device: torch.device) -> object:
    """A walk input's value on this rank: a tensor kept here (or ``received`` from its producer), the placeholder of
    a value only other ranks take, or an inline tensor on ``device``."""
    if isinstance(value, m.TensorRef):
        return received if received is not None else store.get(value.uuid)
    if isinstance(value, m.Remote):
        return REMOTE
    return decode_tensor(value, device)
