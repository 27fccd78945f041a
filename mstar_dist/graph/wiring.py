"""What a walk's structure says about running it (docs/architecture.md §4), derived once per section: which
``Parallel`` siblings a node waits for, where each output edge takes a value, and which nodes are self-loops (an AR
decode step, whose completions take ``WalkRun._iterate``'s fast path). Pure; ``WalkRun`` (graph/walk.py) reads it
for every call.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass

from mstar_dist.graph.io import WalkIO, common_loops, divergence, edge_kind, node_trails, walk_io
from mstar_dist.graph.nodes import EMIT_TO_CLIENT, Loop, Parallel, Section, iter_nodes
from mstar_dist.graph.validate import validate


@dataclass(frozen=True)
class Wiring:
    """What ``WalkRun`` needs from a section's structure, derived once per section."""

    io: WalkIO
    waits_on: dict[str, frozenset[tuple[int, ...]]]
    """Node -> positions of the ``Parallel`` sibling members that feed it (it runs after they have finished)."""
    persist_signals: frozenset[str]
    stream_signals: frozenset[str]
    routes: dict[str, tuple["Hop", ...]]
    """Node -> where each of its output edges takes a value (``WalkRun._route``, once per call: every decode token)."""
    self_loops: dict[str, tuple[tuple[str, ...], tuple[tuple[str, str], ...]]]
    """Nodes that are the whole body of their innermost loop and feed every input they need from their own outputs
    (an AR decode step: ``Loop(LLM(token) -> token)``), each with the signals it feeds itself and its inbox keys.
    While such a loop goes on, a call's completion touches nothing but the node itself: ``WalkRun._iterate``. A
    node with ``until_end`` inputs is none: it waits for its stream between iterations."""


STREAM, EMIT, OUTPUT, PUSH = range(4)


@dataclass(frozen=True)
class Hop:
    """One output edge of a node, resolved once per section: what ``_route`` does with the edge's value."""

    signal: str
    kind: int
    """``STREAM`` (a streaming edge), ``EMIT`` (to the client), ``OUTPUT`` (a walk output) or ``PUSH`` (to
    ``dst``)."""
    dst: str | None
    latest_only: bool
    """The edge leaves a loop that does not hold ``dst``: only its latest value waits there."""
    records: tuple[int, ...]
    """Depths of the loops holding the node (outermost 0) that keep the value as a loop output."""


@functools.lru_cache(maxsize=256)
def wire(section: Section) -> Wiring:
    validate(section)
    trails = node_trails(section)
    leaves: set[tuple[str, int]] = set()
    waits: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for node in iter_nodes(section):
        for index, e in enumerate(node.outputs):
            if e.dst not in trails:
                continue  # EMIT_TO_CLIENT or a walk output
            src, dst = trails[node.name], trails[e.dst]
            if sum(isinstance(sec, Loop) for sec, _ in src) > len(common_loops(src, dst)):
                leaves.add((node.name, index))
            k = divergence(src, dst)
            if edge_kind(src, dst) == "internal" and isinstance(src[k][0], Parallel):
                waits[e.dst].add(tuple(i for _, i in src[: k + 1]))
    outputs = [edge for node in iter_nodes(section) for edge in node.outputs]
    routes, self_loops = {}, {}
    for node in iter_nodes(section):
        loops = [sec for sec, _ in trails[node.name] if isinstance(sec, Loop)]  # outermost first, as frame.loops
        recorded: set[str] = set()  # two edges of one signal carry one value: the loops record it once
        hops = []
        for index, e in enumerate(node.outputs):
            records = () if e.signal in recorded else tuple(
                depth for depth, loop in enumerate(loops)
                if e.signal in loop.outputs or e.signal in loop.accumulated_outputs)
            recorded.add(e.signal)
            hops.append(Hop(e.signal, STREAM if e.stream else EMIT if e.dst == EMIT_TO_CLIENT
                             else OUTPUT if e.dst is None else PUSH, e.dst, (node.name, index) in leaves, records))
        routes[node.name] = tuple(hops)
        fed = [h.signal for h in hops if h.kind == PUSH]
        if (loops and loops[-1].section is node and not loops[-1].accumulated_outputs and node.name not in waits
                and not node.until_end
                and all(h.dst == node.name for h in hops if h.kind == PUSH) and len(set(fed)) == len(fed)
                and set(node.inputs) <= set(fed) <= set(node.inputs) | set(node.optional_inputs)):
            self_loops[node.name] = (tuple(fed), tuple((node.name, signal)
                                                       for signal in (*node.inputs, *node.optional_inputs)))
    return Wiring(walk_io(section), {name: frozenset(p) for name, p in waits.items()},
                   persist_signals=frozenset(e.signal for e in outputs if e.persist),
                   stream_signals=frozenset(e.signal for e in outputs if e.stream), routes=routes,
                   self_loops=self_loops)
