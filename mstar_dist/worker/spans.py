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
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Container

import torch

from mstar_dist.control import messages as m
from mstar_dist.control.envelope import rank_name
from mstar_dist.graph.nodes import EMIT_TO_CLIENT, GraphNode, Section, iter_nodes
from mstar_dist.graph.walk import NodeCall, NodeResult, WalkRun
from mstar_dist.transport.base import Done
from mstar_dist.transport.router import Router
from mstar_dist.worker.transfers import PostFailed, Transfers, transfer_state

log = logging.getLogger(__name__)


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


def receive(value: m.Carried, *, src: int, plane: Router, walk: str, signal: str) -> Any:
    """A tensor (inline values and other transfers done at once) or the posted receive of a data-plane
    descriptor from global rank ``src``; ``walk``/``signal`` label the edge in the statistics."""
    transfer = plane.post_recv(value, src, walk=walk, signal=signal)
    return transfer.tensor if isinstance(transfer, Done) else transfer


class Spans:
    """This rank's copies of the walks that span ranks (by (request, walk)), and the ``NodeDone``s that arrived for
    them. Runs on the worker's loop, like the rest of the rank."""

    def __init__(self, *, global_rank: int, transport: Router, transfers: Transfers,
                 send: Callable[[str, m.Message], None], removed: Container[str],
                 fail_run: Callable[[WalkRun, BaseException], None], transfer_timeout_s: float) -> None:
        self.global_rank = global_rank
        self.transport = transport
        self.transfers = transfers
        self._send = send
        self._removed = removed
        self._fail_run = fail_run
        self.transfer_timeout_s = transfer_timeout_s
        self.by_key: dict[tuple[str, str], Span] = {}
        """(request, walk) -> this rank's copy of a walk that spans ranks."""
        self.arrivals: dict[tuple[str, str], dict[tuple[str, int], Arrived]] = collections.defaultdict(dict)
        """(request, walk) -> the peers' ``NodeDone``s by (node, seq); they may arrive before the walk starts."""

    def open(self, key: tuple[str, str], section: Section, node_ranks: dict[str, int]) -> Span:
        """This rank's copy of the walk ``key`` (not yet kept: see :meth:`keep`)."""
        return Span(section, dict(node_ranks), self.global_rank, arrived=self.arrivals[key])

    def keep(self, key: tuple[str, str], span: Span) -> None:
        self.by_key[key] = span

    def close(self, key: tuple[str, str]) -> None:
        """The walk ended on this rank."""
        self.by_key.pop(key, None)
        self.arrivals.pop(key, None)

    def busy(self) -> bool:
        """A peer's result is here whose tensors may still be in flight (the loop must poll for them)."""
        return any(self.arrivals.values())

    def announce(self, span: Span, run: WalkRun, call: NodeCall, result: Any) -> None:
        """Tell every other rank of the walk that ``call`` (a node of ours) finished: its outputs, with real values
        for the signals their nodes consume."""
        produced = list(dict.fromkeys(e.signal for e in span.nodes[call.node].outputs if e.signal in result.outputs))
        seq = span.seq(call)
        span.forget(call)
        for peer in span.peers:
            signals = [s for s in span.consumed_on(call.node, peer) if s in result.outputs]
            carried, transfers = self.transfers.post_values([(s, result.outputs[s]) for s in signals], peer,
                                                            f"node {call.node!r} output")
            self._send(rank_name(peer), m.NodeDone(
                request_id=run.request_id, walk=run.walk, node=call.node, seq=seq, signals=produced,
                values=dict(zip(signals, carried)), stop=bool(result.stop),
            ))
            self.transfers.outgoing.extend(transfers)

    def on_node_done(self, msg: m.NodeDone, src: int) -> None:
        values: dict[str, Any] = {}
        for signal, value in msg.values.items():  # receives in message order: the sender sends in this order
            try:
                values[signal] = receive(value, src=src, plane=self.transport, walk=msg.walk, signal=signal)
            except Exception as exc:
                values[signal] = PostFailed(f"{type(exc).__name__}: {exc}")
                self.transfers.abort_pair(src, self.global_rank, f"posting a receive failed: {exc}")
        if msg.request_id in self._removed:
            self.transfers.drain(v for v in values.values() if not isinstance(v, torch.Tensor))
            return
        self.arrivals[(msg.request_id, msg.walk)][(msg.node, msg.seq)] = Arrived(msg, values)

    def advance(self, runs: dict[tuple[str, str], WalkRun]) -> list[WalkRun]:
        """Complete other ranks' node calls in this rank's copies whose results arrived; the runs that ended."""
        finished = []
        for key, span in list(self.by_key.items()):
            run = runs.get(key)
            for call, arrived in span.arrivals(run) if run is not None else ():
                states = [transfer_state(v) for v in arrived.values.values() if not isinstance(v, torch.Tensor)]
                broken = [st for st in states if st not in ("done", "pending")]
                if broken or ("pending" in states and time.monotonic() - arrived.since > self.transfer_timeout_s):
                    why = broken[0] if broken else f"not complete within {self.transfer_timeout_s:.0f} s"
                    self.transfers.abort_pair(span.node_ranks[call.node], self.global_rank, f"a receive: {why}")
                    self._fail_run(run, RuntimeError(f"output of node {call.node!r} from rank "
                                                     f"{span.node_ranks[call.node]}: {why}"))
                    break
                if "pending" in states:
                    break  # results apply in call order
                del span.arrived[(call.node, span.seq(call))]
                span.forget(call)
                try:
                    run.complete(call, span.result_of(arrived))
                except Exception as exc:
                    self._fail_run(run, exc)
                    break
                if run.done:
                    finished.append(run)
                    break
        return finished

    def drop(self, request_id: str) -> None:
        """Forget a removed request's copies; receives still in flight are drained."""
        for key in [k for k in self.arrivals if k[0] == request_id]:
            for arrived in self.arrivals.pop(key).values():
                self.transfers.drain(v for v in arrived.values.values() if not isinstance(v, torch.Tensor))
        for key in [k for k in self.by_key if k[0] == request_id]:
            del self.by_key[key]
