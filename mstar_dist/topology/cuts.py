"""Where the model's edges cross ranks for a placement: the cut edges the dry run and the startup report list.

Pure: from the model's walks (sections), its streaming edges and a :class:`~mstar_dist.topology.placement.Placement`.
An edge is cut when its consumer may run on another rank than its producer for some choice of replicas: such a
value goes straight from the producing rank to the consuming one (docs/architecture.md, "Walks across ranks").
"""

from __future__ import annotations

from dataclasses import dataclass

from mstar_dist.graph.nodes import EMIT_TO_CLIENT, Loop, Parallel, Section, Sequential, iter_nodes
from mstar_dist.graph.partitions import Partition, StreamingEdge
from mstar_dist.topology.placement import Flow, Placement


@dataclass(frozen=True)
class CutSignal:
    """One edge of one walk whose producer and consumer nodes are placed on different ranks."""

    walk: str
    signal: str
    src_node: str
    dst_node: str
    src_ranks: tuple[int, ...]
    """Global ranks that may produce it (every replica of the producer)."""
    dst_ranks: tuple[int, ...]
    """Global ranks that may consume it."""
    streaming: bool = False
    """A streaming edge into another partition's walk (``walk`` is the producing walk)."""
    loop: str | None = None
    """The loop both ends run in, when they do: the value crosses ranks on every iteration (a per-step edge)."""
    dst_walk: str = ""
    """The consumer's walk when it is not ``walk``: a streaming edge's, or a later walk consuming a kept output."""

    @property
    def kept(self) -> bool:
        """A kept walk output (``persist``, like the P/D KV cache) that a later walk of the partition consumes."""
        return bool(self.dst_walk) and not self.streaming


def cut_signals(graphs: dict[str, Section], streams: list[StreamingEdge], placement: Placement,
                partitions: list[Partition] = ()) -> list[CutSignal]:
    """Every edge whose two ends are not always on the same rank, sorted by walk, signal and nodes: edges inside a
    walk, streaming edges, and (given ``partitions``) kept outputs consumed by a later walk of their partition."""
    cuts = set()
    consumer_walk = {e.signal: _walk_of(graphs, e.dst_node) for e in streams}
    for walk, section in graphs.items():
        loops = _loops_of(section)
        for node in iter_nodes(section):
            for edge in node.outputs:
                if edge.dst in (None, EMIT_TO_CLIENT):
                    continue
                dst_walk = consumer_walk.get(edge.signal, walk) if edge.stream else walk
                if placement.replicas(walk, node.name) == placement.replicas(dst_walk, edge.dst):
                    continue  # the same replicas: a request keeps both ends on one rank (replica choice prefers it)
                loop = loops.get(node.name) if not edge.stream and loops.get(node.name) == loops.get(edge.dst) else None
                cuts.add(CutSignal(walk, edge.signal, node.name, edge.dst, _ranks(placement, walk, node.name),
                                   _ranks(placement, dst_walk, edge.dst), edge.stream, loop,
                                   dst_walk if dst_walk != walk else ""))
    cuts.update(_kept_cuts(graphs, partitions, placement))
    return sorted(cuts, key=lambda c: (c.walk, c.signal, c.src_node, c.dst_walk, c.dst_node))


def _kept_cuts(graphs: dict[str, Section], partitions: list[Partition], placement: Placement) -> set[CutSignal]:
    """Kept outputs (``persist``) of one walk that a node of another walk of the same partition takes as an input,
    where the two nodes are not on the same replicas."""
    out = set()
    for partition in partitions:
        walks = [w for w in partition.walks if w in graphs]
        for walk in walks:
            for node in iter_nodes(graphs[walk]):
                for edge in node.outputs:
                    if not edge.persist:
                        continue
                    for dst_walk in walks:
                        for consumer in iter_nodes(graphs[dst_walk]):
                            if dst_walk == walk or edge.signal not in (*consumer.inputs, *consumer.optional_inputs):
                                continue
                            if placement.replicas(walk, node.name) == placement.replicas(dst_walk, consumer.name):
                                continue
                            out.add(CutSignal(walk, edge.signal, node.name, consumer.name,
                                              _ranks(placement, walk, node.name),
                                              _ranks(placement, dst_walk, consumer.name), dst_walk=dst_walk))
    return out


def flows(graphs: dict[str, Section], partitions: list[Partition], streams: list[StreamingEdge]) -> tuple[Flow, ...]:
    """Where values can move between nodes (docs/architecture.md §7), which decides the pair groups:
    - inside a walk, between any two of its nodes (a node's outputs go to the ranks of the nodes that consume
      them, and results of a walk across ranks travel between its nodes' ranks);
    - between the walks of one partition, from any node to any node (a kept output, like the P/D KV cache, is
      pushed from the walk that made it to the walk that consumes it);
    - along each streaming edge, from its producing node to its consumer node.
    Sorted, without duplicates."""
    nodes = {walk: sorted(n.name for n in iter_nodes(section)) for walk, section in graphs.items()}
    out = set()
    for walk, names in nodes.items():
        out.update(Flow(walk, a, walk, b) for a in names for b in names if a != b)
    for partition in partitions:
        walks = [w for w in partition.walks if w in nodes]
        out.update(Flow(w1, a, w2, b) for w1 in walks for w2 in walks if w1 != w2 for a in nodes[w1] for b in nodes[w2])
    for edge in streams:
        dst_walk = _walk_of(graphs, edge.dst_node)
        for walk, section in graphs.items():
            for node in iter_nodes(section):
                if any(e.stream and e.signal == edge.signal for e in node.outputs):
                    out.add(Flow(walk, node.name, dst_walk, edge.dst_node))
    return tuple(sorted(out))


def describe_cuts(cuts: list[CutSignal]) -> str:
    lines = [f"cut edges: {len(cuts)} (values that go straight from the producing rank to the consuming rank)"]
    for c in cuts:
        every = f"  every step of loop {c.loop}" if c.loop else ""
        lines.append(f"  {c.walk}: {c.signal}{_kind(c)}  {c.src_node}@{_ranks_text(c.src_ranks)} -> "
                     f"{_consumer(c)}@{_ranks_text(c.dst_ranks)}{every}")
    return "\n".join(lines)


def describe_cross_host(cuts: list[CutSignal], host_of: dict[int, str], inter_host: str) -> str:
    """Every graph edge whose producer and consumer may run on different hosts, per pair of hosts, with the
    transport it takes there (``transport.inter_host``): what a firewall or a NIC choice between hosts must let
    through."""
    lines = []
    for c in cuts:
        pairs = sorted({(host_of[s], host_of[d]) for s in c.src_ranks for d in c.dst_ranks if host_of[s] != host_of[d]})
        for a, b in pairs:
            src = [r for r in c.src_ranks if host_of[r] == a]
            dst = [r for r in c.dst_ranks if host_of[r] == b]
            lines.append(f"  {c.walk}: {c.signal}{_kind(c)}  {c.src_node}@{a} ({_ranks_text(tuple(src))}) -> "
                         f"{_consumer(c)}@{b} ({_ranks_text(tuple(dst))}) via {inter_host}")
    return "\n".join([f"cross-host graph edges: {len(lines)} (walk: signal, producer -> consumer, transport)",
                      *lines])


def _kind(c: CutSignal) -> str:
    return " (stream)" if c.streaming else " (kept)" if c.kept else ""


def _consumer(c: CutSignal) -> str:
    return f"{c.dst_walk}/{c.dst_node}" if c.dst_walk else c.dst_node


def _ranks(placement: Placement, walk: str, node: str) -> tuple[int, ...]:
    return tuple(sorted(r for rep in placement.replicas(walk, node) for r in rep.ranks))


def _loops_of(section: Section, loop: str | None = None) -> dict[str, str | None]:
    """Node name -> the name of the innermost loop it runs in (None outside loops; unnamed loops as "?")."""
    if isinstance(section, Loop):
        return _loops_of(section.section, section.name or "?")
    if isinstance(section, (Sequential, Parallel)):
        return {k: v for member in section.members for k, v in _loops_of(member, loop).items()}
    return {section.name: loop}


def _walk_of(graphs: dict[str, Section], node: str) -> str:
    return next(w for w, sec in graphs.items() if any(n.name == node for n in iter_nodes(sec)))


def _ranks_text(ranks: tuple[int, ...]) -> str:
    return "rank " + str(ranks[0]) if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))
