"""Where a request's walks run and what dispatching one sends where (docs/architecture.md §5, §7).

At admission the conductor chooses one replica per (walk, node) for the request (:meth:`Routes.choose`: prefer
hosts, then ranks the request already uses; a TP replica's first rank leads). A walk's :class:`Route` follows from
that choice: the ranks that run its nodes, which of them take each input, which persisted outputs must be
materialised for another rank, where its streamed signals go. Kept tensors move straight from their producer to
each consuming rank (:meth:`Routes.push_kept`: the producer gets a ``Push``). Every method runs on the conductor
thread; nothing here sends except through the ``send`` it is given.
"""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass, field
from typing import Callable

from mstar_dist.control import messages as m
from mstar_dist.graph.io import walk_io
from mstar_dist.graph.nodes import Section, iter_nodes, node_names
from mstar_dist.graph.partitions import Partition, StreamingEdge
from mstar_dist.topology.placement import Placement, choose_replica


@dataclass(frozen=True)
class Route:
    """What dispatching one walk of a request sends where, given the request's ranks: the same for every request
    that got the same replicas, so computed once per walk for them (a burst of requests reaches the conductor at once
    and it dispatches one request after another)."""

    ranks: list[int]
    """The ranks running some node of the walk, sorted."""
    consumers: dict[str, list[int]]
    """Walk input -> the ranks whose nodes take it."""
    export: list[str]
    """The walk's persisted outputs to materialise for another rank, sorted."""
    node_ranks: dict[str, int]
    """Node -> rank, for a walk across ranks (empty otherwise)."""
    stream_routes: dict[str, int]
    """Streaming signal produced in the walk's partition -> the rank consuming it."""
    touched: frozenset[int]
    """Every rank of the replicas the walk uses (TP followers included)."""


@dataclass
class Choice:
    """The replicas chosen for a request, with the routes of its walks as they are computed. Requests only read a
    choice: with one replica per node every request shares one."""

    replicas: dict[tuple[str, str], tuple[int, ...]]
    """(walk, node) -> every rank of the chosen replica (its TP group; the first one leads)."""
    nodes: dict[tuple[str, str], int]
    """(walk, node) -> the global rank that runs that node of that walk (the replica's leader)."""
    routes: dict[str, Route] = field(default_factory=dict)
    """Walk -> its route (:meth:`Routes.route`)."""

    def walk_ranks(self, walk: str) -> list[int]:
        """Global ranks running some node of ``walk``, sorted."""
        return sorted({rank for (w, _), rank in self.nodes.items() if w == walk})

    def rank_of(self, walk: str, node: str) -> int:
        return self.nodes[(walk, node)]

    def ranks(self) -> set[int]:
        """Every rank of every chosen replica."""
        return {r for ranks in self.replicas.values() for r in ranks}


class Routes:
    """The model's walks as the placement serves them: replica choices and routes (see the module docstring)."""

    def __init__(self, *, graphs: dict[str, Section], partitions: list[Partition], streams: list[StreamingEdge],
                 placement: Placement, world_size: int, rank_hosts: dict[int, str]) -> None:
        self.graphs, self.partitions, self.streams = graphs, partitions, streams
        self.placement, self.world_size, self.rank_hosts = placement, world_size, rank_hosts
        self.partition_of = {walk: p.name for p in partitions for walk in p.walks}
        self.persist_signals = {walk: {e.signal for n in iter_nodes(section) for e in n.outputs if e.persist}
                                for walk, section in graphs.items()}
        self.walk_nodes = [(walk, node) for walk, section in graphs.items()
                           for node in dict.fromkeys(n.name for n in iter_nodes(section))]
        self._ports = {walk: walk_io(section).external_inputs for walk, section in graphs.items()}
        self.producer = {  # streaming signal -> (walk, node) producing it
            e.signal: next((w, n.name) for w, sec in graphs.items() for n in iter_nodes(sec)
                           for out in n.outputs if out.stream and out.signal == e.signal)
            for e in streams
        }
        self.consumer_walk = {  # streaming signal -> the walk holding its consumer node
            e.signal: next(w for p in partitions if p.name == e.dst_partition for w in p.walks
                           if e.dst_node in node_names(graphs[w]))
            for e in streams
        }
        self._rng = random.Random(0)
        self._fixed: tuple[frozenset[int], Choice | None] | None = None
        """(the dead ranks, the choice) when every node has one replica: shared by every request (with its routes)
        until a rank dies or comes back."""

    def choose(self, dead_ranks: dict[int, str]) -> Choice | None:
        """One live replica per (walk, node) for a new request (see the module docstring); None when some node has
        none."""
        fixed = self._fixed
        dead = frozenset(dead_ranks)
        if fixed is not None and fixed[0] == dead:  # a rank re-admitted after a restart leaves dead_ranks again
            return fixed[1]
        chosen: dict[tuple[str, str], tuple[int, ...]] | None = {}
        for walk, node in self.walk_nodes:
            replica = choose_replica(
                self.placement.replicas(walk, node),
                live_ranks=set(range(self.world_size)) - set(dead_ranks),
                hosts_used={self.rank_hosts[r] for ranks in chosen.values() for r in ranks},
                ranks_used={r for ranks in chosen.values() for r in ranks},
                rank_host=self.rank_hosts,
                rng=self._rng,
            )
            if replica is None:
                chosen = None
                break
            chosen[(walk, node)] = replica.ranks
        choice = None if chosen is None else Choice(replicas=chosen, nodes={k: r[0] for k, r in chosen.items()})
        if all(len(self.placement.replicas(walk, node)) == 1 for walk, node in self.walk_nodes):
            # one replica per node: every request gets the same answer until a rank dies (and no random tie-break
            # is drawn), and so the same routes
            self._fixed = (dead, choice)
        return choice

    def unservable_walks(self, dead_ranks: dict[int, str]) -> list[str]:
        """Walks with no live replica left (the service is down for them)."""
        live = set(range(self.world_size)) - set(dead_ranks)
        return sorted({walk for walk, node in self.walk_nodes
                       if not any(set(r.ranks) <= live for r in self.placement.replicas(walk, node))})

    def route(self, choice: Choice, walk: str) -> Route:
        """Where dispatching ``walk`` sends what for ``choice``'s ranks, kept in ``choice.routes``."""
        found = choice.routes.get(walk)
        if found is not None:
            return found
        ranks = choice.walk_ranks(walk)
        partition = self.partition_of[walk]
        route = choice.routes[walk] = Route(
            ranks=ranks,
            consumers=self._input_consumers(choice, walk),
            export=sorted(self.persist_signals[walk]) if self._exports(choice, walk) else [],
            node_ranks={node: rank for (w, node), rank in choice.nodes.items() if w == walk} if len(ranks) > 1 else {},
            stream_routes={e.signal: self.consumer_rank(choice, e) for e in self.streams
                           if partition == e.src_partition},
            touched=frozenset(ranks) | {r for (w, _), rs in choice.replicas.items() if w == walk for r in rs},
        )
        return route

    def consumer_rank(self, choice: Choice, edge: StreamingEdge) -> int:
        """The rank of the node consuming streaming ``edge``."""
        return choice.rank_of(self.consumer_walk[edge.signal], edge.dst_node)

    def stream_ends(self, choice: Choice, wire_id: str, partition: str, is_done: Callable[[str], bool],
                    stream_src: dict[str, int]) -> list[tuple[int, m.StreamEnd]]:
        """(rank, message) of the ``StreamEnd`` of every streaming edge ``partition`` produces into a partition not
        done yet (``is_done``), now that it is done: sent to the rank that produced the stream last (``stream_src``:
        signal -> rank), which forwards it after its items, or to the consumer when nothing was produced."""
        ends = []
        for edge in self.streams:
            if edge.src_partition != partition or is_done(edge.dst_partition):
                continue
            dst = self.consumer_rank(choice, edge)
            src = stream_src.get(edge.signal)
            ends.append((dst if src is None else src, m.StreamEnd(request_id=wire_id, signal=edge.signal,
                                                                  forward_to=-1 if src is None else dst)))
        return ends

    def _exports(self, choice: Choice, walk: str) -> bool:
        """Whether a walk's persisted outputs must be materialised for another rank: some other walk of its
        partition runs on a rank this walk does not (e.g. decode on another rank than prefill)."""
        mine = set(choice.walk_ranks(walk))
        partition = self.partition_of[walk]
        return any(set(choice.walk_ranks(w)) - mine for p in self.partitions if p.name == partition
                   for w in p.walks if w != walk)

    def _input_consumers(self, choice: Choice, walk: str) -> dict[str, list[int]]:
        """Walk input name -> the ranks whose nodes take it (sorted)."""
        out: dict[str, set[int]] = collections.defaultdict(set)
        for port in self._ports[walk]:
            out[port.signal].add(choice.rank_of(walk, port.node))
        return {name: sorted(r) for name, r in out.items()}

    @staticmethod
    def push_kept(send: Callable[[int, m.Message], None], wire_id: str, choice: Choice, name: str,
                  ref: m.TensorRef, ranks: list[int], *, keep: bool, release: dict[int, list[str]],
                  walk: str) -> None:
        """Push a kept tensor from its producer to each consuming rank of ``ranks``; one persist count is consumed
        per dispatch (by exactly one of them: a push with ``release``, or the producer's own ``RunWalk.release`` when
        it consumes the tensor itself) unless the model keeps the tensor for a later walk."""
        releaser = None if keep else (ref.rank if ref.rank in ranks else ranks[-1])
        for rank in ranks:
            if rank != ref.rank:
                tp_dst = next((list(r) for r in choice.replicas.values() if r[0] == rank and len(r) > 1), [])
                send(ref.rank, m.Push(request_id=wire_id, uuid=ref.uuid, dst=rank, release=rank == releaser,
                                      tp_dst=tp_dst, walk=walk, signal=name))
            elif rank == releaser:
                release[rank].append(name)
