"""Walks whose nodes run on several ranks, and values that move straight from worker to worker.

A walk may place its nodes on different ranks (a codec beside an LLM, the two guidance branches of a denoiser on
their own GPUs). Every rank that runs one of its nodes for a request gets the same ``RunWalk`` (with
``node_ranks``) and runs a *copy* of the whole :class:`~mstar_dist.graph.walk.WalkRun`: it executes its own
nodes and, for every other node, waits for that node's :class:`~mstar_dist.control.messages.NodeDone` from the
rank that ran it, then completes the same call in its copy. All copies therefore take the same steps in the same
order: a ``Sequential`` advances, a ``Loop`` iterates and stops in lockstep, and a dynamic stop raised on any rank
travels in the ``NodeDone`` of the node that raised it, so the loop ends after the same iteration everywhere
(docs/architecture.md, "Walks across ranks").

Values: an edge whose consumer is on another rank goes straight to that rank inside the ``NodeDone`` (inline up
to ``inline_max_bytes``, else a :class:`~mstar_dist.control.messages.WireTensor` descriptor of a data-plane
transfer: p2p on the pair, NCCL device to device on GPUs, or the shm / mooncake arena, see
``transport/router.py``). A value no node of a rank consumes is the :data:`REMOTE` placeholder in that rank's
copy and is never reported as a walk output there; a copy emits to the client and streams only for its own nodes
(``WalkRun.emitting_nodes``): the rank that ran a node does that. Nothing passes through the conductor.

A node's runs are numbered per walk (``seq``): a node has at most one outstanding call at a time, and its calls
become ready in the same order in every copy, so (node, seq) names the same run everywhere.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar_dist.control import messages as m
from mstar_dist.graph.nodes import EMIT_TO_CLIENT, GraphNode, Section, iter_nodes
from mstar_dist.graph.walk import NodeCall, NodeResult, WalkRun
from mstar_dist.transport.base import Done
from mstar_dist.transport.router import Router


class _Remote:
    """The placeholder for a value that another rank holds (see the module docstring)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "REMOTE"


REMOTE = _Remote()


def is_remote(value: Any) -> bool:
    """True for the placeholder, and for a list (accumulated loop output) of placeholders."""
    return value is REMOTE or (isinstance(value, list) and any(v is REMOTE for v in value))


@dataclass
class Arrived:
    """A peer's ``NodeDone`` whose wire tensors may still be in flight (receives posted in message order)."""

    msg: m.NodeDone
    values: dict[str, Any]
    """Signal -> tensor (inline values) or posted transfer (``.done()``, ``.tensor``)."""
    since: float = field(default_factory=time.monotonic)


@dataclass
class Span:
    """One request's copy of a walk that spans ranks, on this rank (``me``, a global rank)."""

    section: Section
    node_ranks: dict[str, int]
    """Node -> global rank running it for this request."""
    me: int
    nodes: dict[str, GraphNode] = field(init=False)
    peers: tuple[int, ...] = field(init=False)
    """The other global ranks of this walk, sorted: each gets every ``NodeDone`` of this rank."""
    arrived: dict[tuple[str, int], Arrived] = field(default_factory=dict)
    pending_stops: list[str] = field(default_factory=list)
    """Named loops the conductor asked to stop: attached to this rank's next result (so every copy stops them
    in the same iteration)."""
    _seq: dict[NodeCall, int] = field(default_factory=dict)
    _runs: collections.Counter = field(default_factory=collections.Counter)

    def __post_init__(self):
        self.nodes = {node.name: node for node in iter_nodes(self.section)}
        missing = sorted(set(self.nodes) - set(self.node_ranks))
        if missing:
            raise ValueError(f"RunWalk.node_ranks names no rank for nodes {missing}")
        self.peers = tuple(sorted(set(self.node_ranks.values()) - {self.me}))

    def is_local(self, node: str) -> bool:
        return self.node_ranks[node] == self.me

    def seq(self, call: NodeCall) -> int:
        """The run number of ``call``'s node (assigned when first seen: calls of a node come one at a time)."""
        if call not in self._seq:
            self._seq[call] = self._runs[call.node]
            self._runs[call.node] += 1
        return self._seq[call]

    def forget(self, call: NodeCall) -> None:
        self._seq.pop(call, None)

    def consumed_on(self, node: str, peer: int) -> list[str]:
        """Signals of ``node`` that some node on ``peer`` consumes (those travel to it with real values)."""
        out = []
        for edge in self.nodes[node].outputs:
            if edge.stream or edge.dst in (None, EMIT_TO_CLIENT):
                continue
            if self.node_ranks.get(edge.dst) == peer and edge.signal not in out:
                out.append(edge.signal)
        return out

    def arrivals(self, run: WalkRun) -> list[tuple[NodeCall, Arrived]]:
        """Outstanding calls of other ranks' nodes whose ``NodeDone`` is here (its tensors may still be in
        flight), in call order."""
        out = []
        for call in run.outstanding:
            if not self.is_local(call.node):
                arrived = self.arrived.get((call.node, self.seq(call)))
                if arrived is not None:
                    out.append((call, arrived))
        return out

    @staticmethod
    def result_of(arrived: Arrived) -> NodeResult:
        """The peer's result as this copy's result: received tensors, placeholders for the rest."""
        values = {s: v if isinstance(v, torch.Tensor) else v.tensor for s, v in arrived.values.items()}
        return NodeResult(outputs={s: values.get(s, REMOTE) for s in arrived.msg.signals}, stop=arrived.msg.stop)

    def take_stops(self) -> list[str]:
        stops, self.pending_stops = self.pending_stops, []
        return stops


def receive(value: m.Carried, *, src: int, plane: Router, walk: str, signal: str) -> Any:
    """A tensor (inline values and other transfers done at once) or the posted receive of a data-plane
    descriptor from global rank ``src``; ``walk``/``signal`` label the edge in the statistics."""
    transfer = plane.post_recv(value, src, walk=walk, signal=signal)
    return transfer.tensor if isinstance(transfer, Done) else transfer
