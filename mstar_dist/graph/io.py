"""Graph I/O derivation (docs/architecture.md §4): which inputs a walk takes from outside, which edges stay inside an iteration,
which feed the next one, and which signals are walk outputs. Pure; the structure alone decides.

Edge classification, by the innermost section holding both ends: inside a :class:`Sequential` an edge to a later
member is *internal* (same iteration) and an edge to an earlier member, or a node's edge to itself, is a
*loop-back* (it feeds the next iteration of an enclosing loop); inside a :class:`Parallel` an edge between members is
internal. An input is *external* unless an internal edge feeds it: a walk input or a value given to
``WalkRun.deliver``. Inputs fed only by loop-back edges stay external (their first iteration's value comes from
outside, as the first token of a decode loop does).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

from mstar_dist.graph.nodes import Edge, GraphNode, Loop, Parallel, Section, Sequential, iter_loops, iter_nodes

Trail = tuple[tuple[Section, int], ...]
"""A node's ancestors from the walk's root down, each with the index of the member that leads to the node."""

EdgeKind = Literal["internal", "loopback"]


@dataclass(frozen=True)
class Port:
    node: str
    signal: str
    required: bool
    """``False`` for an optional input (passed when present) or one read until its stream ends (``until_end``)."""


@dataclass(frozen=True)
class WalkIO:
    external_inputs: tuple[Port, ...]
    """Inputs no internal edge feeds, in declaration order: they come from the walk inputs or ``deliver``."""
    internal_edges: tuple[tuple[str, Edge], ...]
    """``(source node, edge)`` for edges consumed in the same iteration."""
    loopback_edges: tuple[tuple[str, Edge], ...]
    """``(source node, edge)`` for edges that feed the next iteration of an enclosing loop."""
    outputs: tuple[str, ...]
    """Walk output signals: edges with no destination, then loop ``outputs`` and ``accumulated_outputs``."""


def node_trails(section: Section) -> dict[str, Trail]:
    """Node name -> its trail. Assumes unique node names (a later duplicate overwrites an earlier one)."""
    trails: dict[str, Trail] = {}

    def visit(sec: Section, trail: Trail) -> None:
        if isinstance(sec, GraphNode):
            trails[sec.name] = trail
        elif isinstance(sec, (Sequential, Parallel)):
            for i, member in enumerate(sec.members):
                visit(member, trail + ((sec, i),))
        elif isinstance(sec, Loop):
            visit(sec.section, trail + ((sec, 0),))
        else:
            raise TypeError(f"not a graph section: {sec!r}")

    visit(section, ())
    return trails


def divergence(a: Trail, b: Trail) -> int:
    """Depth of the innermost section holding both nodes (``a[k][0] is b[k][0]``, ``a[k][1] != b[k][1]``);
    ``len(a)`` when the trails are the same (one node)."""
    for k, (step_a, step_b) in enumerate(zip(a, b)):
        if step_a[1] != step_b[1]:
            return k
    assert len(a) == len(b), "a node cannot be an ancestor of another"
    return len(a)


def edge_kind(src: Trail, dst: Trail) -> EdgeKind:
    """Classify an edge from the node at ``src`` to the node at ``dst`` (see the module docstring)."""
    k = divergence(src, dst)
    if k == len(src):
        return "loopback"  # a node's edge to itself
    holder, src_index = src[k]
    if isinstance(holder, Parallel):
        return "internal"
    return "internal" if dst[k][1] > src_index else "loopback"


def common_loops(src: Trail, dst: Trail) -> tuple[Loop, ...]:
    """Loops that hold both ends of an edge, outermost first (where a loop-back edge loops)."""
    return tuple(sec for sec, _ in src[: divergence(src, dst)] if isinstance(sec, Loop))


def routed_edges(section: Section) -> list[tuple[str, Edge]]:
    """``(source node, edge)`` for every edge to a node of the walk, in declaration order."""
    names = {node.name for node in iter_nodes(section)}
    return [(node.name, e) for node in iter_nodes(section) for e in node.outputs if e.dst in names]


@functools.lru_cache(maxsize=256)
def walk_io(section: Section) -> WalkIO:
    """Derive a walk's I/O from its structure (edges to unknown nodes are ignored here; ``validate`` reports them)."""
    trails = node_trails(section)
    internal: list[tuple[str, Edge]] = []
    loopback: list[tuple[str, Edge]] = []
    for src, e in routed_edges(section):
        kind = edge_kind(trails[src], trails[e.dst])
        (internal if kind == "internal" else loopback).append((src, e))
    fed = {(e.dst, e.signal) for _, e in internal}
    external = [
        Port(node.name, signal, required)
        for node in iter_nodes(section)
        for signal, required in [(s, True) for s in node.inputs] + [(s, False) for s in node.optional_inputs]
        + [(s, False) for s in node.until_end]
        if (node.name, signal) not in fed
    ]
    outputs = [e.signal for node in iter_nodes(section) for e in node.outputs if e.dst is None]
    for loop in iter_loops(section):
        outputs += [*loop.outputs, *loop.accumulated_outputs]
    return WalkIO(
        external_inputs=tuple(external),
        internal_edges=tuple(internal),
        loopback_edges=tuple(loopback),
        outputs=tuple(dict.fromkeys(outputs)),
    )

