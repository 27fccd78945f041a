"""Graph primitives (docs/architecture.md §4): nodes, edges, composition, loops.

A walk is one :data:`Section`. A node runs when all its required inputs are present; an output edge names the
signal, where it goes (a node name, :data:`EMIT_TO_CLIENT`, or ``None`` for a walk output) and whether the value is
kept in the producer's tensor store after the walk (``persist``). Declared outputs are *possible* outputs: a node
emits the ones it returns.

Composition: a :class:`Sequential` runs its members one after another (member ``i + 1`` starts when member ``i`` has
finished, so side effects such as a KV cache written by one node and read by the next are ordered); a
:class:`Parallel` starts all its members at once and each node runs as soon as its data is there. A :class:`Loop`
repeats its section. A node may appear once per walk (:func:`mstar_dist.graph.validate.validate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Union

EMIT_TO_CLIENT = "@client"
"""Special destination: the value goes to the conductor, which postprocesses it for the client."""


@dataclass(frozen=True)
class Edge:
    signal: str
    """Name of the value on this edge (the consumer's input name)."""
    dst: str | None = None
    """Consumer node name, :data:`EMIT_TO_CLIENT`, or ``None``: a walk output."""
    persist: bool = False
    """Keep the value in the producer's store after the walk, for a later walk (possibly on another rank)."""
    stream: bool = False
    """A streaming edge: ``dst`` is a node in a walk of another partition; each value goes into that consumer's
    buffer (chunk policy from the model's ``streaming_edges()``), whichever rank it runs on."""


@dataclass(frozen=True)
class GraphNode:
    name: str
    """Component name; the same name in several walks is one component (one KV cache)."""
    inputs: tuple[str, ...] = ()
    """Required input signals: the node runs when all of them are present."""
    outputs: tuple[Edge, ...] = ()
    optional_inputs: tuple[str, ...] = ()
    """Inputs passed when present (e.g. a KV cache that arrives only on a loop's first iteration)."""
    until_end: tuple[str, ...] = ()
    """Inputs fed by a streaming edge, one value per run, required until their stream ends: while it lasts the node
    waits for the next value; once it has ended (``WalkRun.end_input``) and none is queued, the node runs without
    them (a talker that reads one text entry per step while the text is written, and goes on alone after it)."""


@dataclass(frozen=True)
class Sequential:
    members: tuple["Section", ...]

    def __init__(self, *members: "Section"):
        object.__setattr__(self, "members", tuple(members))


@dataclass(frozen=True)
class Parallel:
    """Members start together; a node runs once its inputs are there and every sibling member that feeds it through
    an edge has finished (so an edge between siblings is a same-iteration dependency, never a loop-back)."""

    members: tuple["Section", ...]

    def __init__(self, *members: "Section"):
        object.__setattr__(self, "members", tuple(members))


@dataclass(frozen=True)
class Loop:
    section: "Section"
    max_iters: int
    """Upper bound on iterations; a walk may lower it per request through ``RunWalk.loop_limits[name]`` (for every
    run of the loop: a nested loop runs afresh in each iteration of the loop around it)."""
    outputs: tuple[str, ...] = ()
    """Signals whose *last* iteration's value becomes a walk output."""
    name: str | None = None
    """A named loop can be stopped early (EOS from a stop check, stop strings from the conductor)."""
    accumulated_outputs: tuple[str, ...] = field(default=())
    """Signals whose values from *every* iteration are walk outputs (a list)."""

    def __post_init__(self):
        if self.max_iters < 0:
            raise ValueError(f"Loop {self.name!r}: max_iters must be >= 0, got {self.max_iters}")


Section = Union[GraphNode, Sequential, Parallel, Loop]


def iter_nodes(section: Section) -> Iterator[GraphNode]:
    """Every node of a section, depth first, in declaration order."""
    if isinstance(section, GraphNode):
        yield section
    elif isinstance(section, (Sequential, Parallel)):
        for member in section.members:
            yield from iter_nodes(member)
    elif isinstance(section, Loop):
        yield from iter_nodes(section.section)
    else:
        raise TypeError(f"not a graph section: {section!r}")


def node_names(section: Section) -> frozenset[str]:
    """Names of every node of a section (the components a walk uses)."""
    return frozenset(node.name for node in iter_nodes(section))


def iter_loops(section: Section) -> Iterator[Loop]:
    """Every loop of a section, outer before inner, in declaration order."""
    if isinstance(section, Loop):
        yield section
        yield from iter_loops(section.section)
    elif isinstance(section, (Sequential, Parallel)):
        for member in section.members:
            yield from iter_loops(member)
