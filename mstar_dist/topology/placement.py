"""Placement (docs/architecture.md §5): which rank runs which component for which walk, replicas, TP groups, edge pairs.

Pure: built from the deployment config and the model's walks (walk -> node names), checked at once with every
number in the message, identical on every rank, testable with no process group. Ranks here are logical global
ranks (`mstar_dist.config.cluster`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mstar_dist.config.cluster import ClusterSpec
from mstar_dist.config.deployment import DeploymentConfig, NodeGroup, TransportConfig
from mstar_dist.config.schema import ConfigError, fail, join, read_int

CONDUCTOR_RANK = 0
"""Global rank that runs the conductor and the HTTP front end."""


@dataclass(frozen=True)
class Replica:
    """One data-parallel copy of a (walk, node): tp_size ranks."""

    index: int
    """Replica number within its (walk, node), 0..replica_count-1, in the node group's rank order."""
    ranks: tuple[int, ...]
    """Global ranks of this copy; ranks[rank_in_group] holds TP shard rank_in_group."""


@dataclass(frozen=True, order=True)
class Flow:
    """A value may move from ``src_node`` in ``src_walk`` to ``dst_node`` in ``dst_walk`` (an edge inside a walk,
    a kept walk output consumed by a later walk, or a streaming edge). Built from the model by
    ``topology.cuts.flows``; the placement turns flows into the rank pairs the data plane must connect."""

    src_walk: str
    src_node: str
    dst_walk: str
    dst_node: str


@dataclass(frozen=True)
class CutEdge:
    """A directed rank pair whose ranks are on different hosts, and the transport it uses."""

    src_rank: int
    """Producing global rank."""
    dst_rank: int
    """Consuming global rank."""
    src_host: str
    """Host name of src_rank."""
    dst_host: str
    """Host name of dst_rank."""
    transport: str
    """Transport for tensors on this pair (``transport.inter_host``: the consumer is on another host)."""
    src_components: tuple[str, ...]
    """``walk/node`` components on src_rank, sorted."""
    dst_components: tuple[str, ...]
    """``walk/node`` components on dst_rank, sorted."""


@dataclass(frozen=True)
class Placement:
    """Node groups checked against the model's walks and the world size, with the lookups the runtime needs."""

    world_size: int
    """Number of ranks (torchrun's WORLD_SIZE); placed ranks are 0..world_size-1."""
    node_groups: tuple[NodeGroup, ...]
    """The config's node groups, in file order (error messages index them)."""
    walks: Mapping[str, frozenset[str]] = field(hash=False)
    """Walk name -> node names of that walk's graph."""
    source: str = field(default="<config>", compare=False)
    """Config file named in error messages."""
    flows: tuple[Flow, ...] | None = None
    """Where values may move (``topology.cuts.flows``); None: anywhere between hosting ranks."""
    _group_of: dict[tuple[str, str], int] = field(init=False, repr=False, compare=False, hash=False)
    _replicas: dict[tuple[str, str], tuple[Replica, ...]] = field(init=False, repr=False, compare=False, hash=False)
    _components: dict[int, dict[str, frozenset[str]]] = field(init=False, repr=False, compare=False, hash=False)

    @classmethod
    def build(cls, config: DeploymentConfig, walks: Mapping[str, frozenset[str]], world_size: int,
              flows: tuple[Flow, ...] | None = None) -> Placement:
        """Check `config.node_groups` against `walks` and `world_size`; ValueError with every number. `flows`
        (the model's, from ``topology.cuts.flows``) narrows `edge_pairs` to the pairs some value can use."""
        if config.cluster is not None and config.cluster.world_size != world_size:
            raise ConfigError(
                "cluster", f"the hosts list {config.cluster.world_size} devices but WORLD_SIZE={world_size}",
                source=config.source,
            )
        placement = cls(world_size=world_size, node_groups=config.node_groups, walks=walks, source=config.source,
                        flows=None if flows is None else tuple(sorted(set(flows))))
        if config.cluster is None:
            _check_no_idle_rank(config)
        return placement

    def __post_init__(self) -> None:
        try:
            self._check()
        except ConfigError as e:
            raise e.under("", self.source) from None

    def _check(self) -> None:
        read_int(self.world_size, "world_size", minimum=1)
        walks = {w: frozenset(nodes) for w, nodes in self.walks.items()}
        object.__setattr__(self, "walks", walks)
        object.__setattr__(self, "node_groups", tuple(self.node_groups))
        group_of: dict[tuple[str, str], int] = {}
        for i, g in enumerate(self.node_groups):
            self._check_group(i, g, walks)
            for w in g.graph_walks:
                for n in g.node_names:
                    if (w, n) in group_of:
                        raise fail(
                            join("node_groups", i), {"node_names": list(g.node_names), "graph_walks": list(g.graph_walks)},
                            f"places node {n!r} for walk {w!r}, which node_groups[{group_of[w, n]}] already places: "
                            f"place each (walk, node) once",
                        )
                    group_of[w, n] = i
        needed = [(w, n) for w in sorted(walks) for n in sorted(walks[w])]
        missing = [f"{w}/{n}" for w, n in needed if (w, n) not in group_of]
        if missing:
            raise ConfigError(
                "node_groups",
                f"{len(missing)} of the model's {len(needed)} (walk, node) pairs are placed by no node group: "
                f"{', '.join(missing)}",
            )
        replicas = {key: _replicas(self.node_groups[i]) for key, i in group_of.items()}
        object.__setattr__(self, "_group_of", group_of)
        object.__setattr__(self, "_replicas", replicas)
        object.__setattr__(self, "_components", self._components_by_rank(group_of))

    def _check_group(self, i: int, g: NodeGroup, walks: Mapping[str, frozenset[str]]) -> None:
        key = join("node_groups", i)
        for w in g.graph_walks:
            if w not in walks:
                raise fail(
                    join(key, "graph_walks"), list(g.graph_walks),
                    f"walk {w!r} is not a walk of the model (its {len(walks)} walks: {', '.join(sorted(walks))})",
                )
            for n in g.node_names:
                if n not in walks[w]:
                    raise fail(
                        join(key, "node_names"), list(g.node_names),
                        f"node {n!r} is not in walk {w!r} (its {len(walks[w])} nodes: {', '.join(sorted(walks[w]))})",
                    )
        for r in g.ranks:
            if r >= self.world_size:
                raise fail(
                    join(key, "ranks"), list(g.ranks),
                    f"rank {r} is outside the world: WORLD_SIZE={self.world_size} gives global ranks "
                    f"0..{self.world_size - 1}",
                )
        if len(g.ranks) % g.tp_size:
            raise fail(join(key, "tp_size"), g.tp_size, f"does not divide len(ranks)={len(g.ranks)}")

    def _components_by_rank(self, group_of: Mapping[tuple[str, str], int]) -> dict[int, dict[str, frozenset[str]]]:
        """rank -> node -> walks; one node on one rank is one component, so its layout must agree across walks."""
        walks_of: dict[int, dict[str, set[str]]] = {}
        layout: dict[tuple[int, str], tuple[int, tuple[int, ...]]] = {}  # (rank, node) -> (group, replica ranks)
        for (w, n), i in sorted(group_of.items()):
            for rep in _replicas(self.node_groups[i]):
                for r in rep.ranks:
                    seen = layout.setdefault((r, n), (i, rep.ranks))
                    if seen[1] != rep.ranks:
                        raise fail(
                            join(join("node_groups", i), "ranks"), list(self.node_groups[i].ranks),
                            f"rank {r} holds node {n!r} in replica ranks {list(rep.ranks)} (tp_size="
                            f"{self.node_groups[i].tp_size}) but node_groups[{seen[0]}] puts it in replica ranks "
                            f"{list(seen[1])} (tp_size={self.node_groups[seen[0]].tp_size}): the same node on one "
                            f"rank is one component, so every walk must shard it the same way",
                        )
                    walks_of.setdefault(r, {}).setdefault(n, set()).add(w)
        return {r: {n: frozenset(ws) for n, ws in nodes.items()} for r, nodes in walks_of.items()}

    # -- lookups ------------------------------------------------------------------------------------------

    def replicas(self, walk: str, node: str) -> tuple[Replica, ...]:
        """The DP replicas serving `node` in `walk` (len(ranks) / tp_size of them)."""
        return self._replicas[self._key(walk, node)]

    def node_group_of(self, walk: str, node: str) -> int:
        """Index in `node_groups` of the group placing `node` for `walk`."""
        return self._group_of[self._key(walk, node)]

    def ranks_hosting(self, walk: str) -> frozenset[int]:
        """Global ranks that run some node of `walk`."""
        if walk not in self.walks:
            raise KeyError(f"walk {walk!r} is not a walk of the model (walks: {', '.join(sorted(self.walks))})")
        return frozenset(r for (w, _), reps in self._replicas.items() if w == walk for rep in reps for r in rep.ranks)

    def components_on(self, rank: int) -> dict[str, frozenset[str]]:
        """What `rank` must load: node name -> the walks it serves there (one component per node name)."""
        return dict(self._components.get(rank, {}))

    @property
    def hosting_ranks(self) -> tuple[int, ...]:
        """Sorted global ranks that host at least one component."""
        return tuple(sorted(self._components))

    @property
    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Distinct replica rank tuples with tp_size > 1, sorted: create their subgroups in this order."""
        return tuple(sorted({rep.ranks for reps in self._replicas.values() for rep in reps if len(rep.ranks) > 1}))

    @property
    def edge_pairs(self) -> tuple[tuple[int, int], ...]:
        """The directed (src, dst) pairs of distinct ranks that some value can use, sorted: for every flow, every
        rank of a producer replica to every rank of a consumer replica (a request may pair any two). Without
        flows, every pair of hosting ranks."""
        if self.flows is None:
            ranks = self.hosting_ranks
            return tuple((s, d) for s in ranks for d in ranks if s != d)
        pairs = set()
        for f in self.flows:
            src = {r for rep in self.replicas(f.src_walk, f.src_node) for r in rep.ranks}
            dst = {r for rep in self.replicas(f.dst_walk, f.dst_node) for r in rep.ranks}
            pairs.update((s, d) for s in src for d in dst if s != d)
        return tuple(sorted(pairs))

    def peers_of(self, global_rank: int) -> tuple[int, ...]:
        """Global ranks that `global_rank` sends to or receives from (over `edge_pairs`), sorted."""
        return tuple(sorted({d if s == global_rank else s for s, d in self.edge_pairs if global_rank in (s, d)}))

    def is_conductor(self, global_rank: int) -> bool:
        """Whether `global_rank` runs the conductor and HTTP front end (rank 0)."""
        return global_rank == CONDUCTOR_RANK

    def _key(self, walk: str, node: str) -> tuple[str, str]:
        if (walk, node) not in self._group_of:
            raise KeyError(
                f"({walk!r}, {node!r}) is not placed: walks are {', '.join(sorted(self.walks))}"
                + (f"; walk {walk!r} has nodes {', '.join(sorted(self.walks[walk]))}" if walk in self.walks else "")
            )
        return walk, node

    # -- reports ------------------------------------------------------------------------------------------

    def cut_report(self, cluster: ClusterSpec, transport: TransportConfig) -> list[CutEdge]:
        """Edge pairs whose ranks are on different hosts, with the transport they use (inter_host)."""
        if cluster.world_size != self.world_size:
            raise ValueError(
                f"the cluster lists {cluster.world_size} devices over {len(cluster.hosts)} hosts but the placement "
                f"is for world_size={self.world_size}"
            )
        host = cluster.rank_hosts()
        return [
            CutEdge(s, d, host[s], host[d], transport.inter_host, self._labels(s), self._labels(d))
            for s, d in self.edge_pairs
            if host[s] != host[d]
        ]

    def describe_ranks(self, cluster: ClusterSpec) -> str:
        """The hosts (devices, transfer device, environment) and the rank map: every global rank's host, node
        rank, local rank, device, address and components."""
        rows = [("rank", "host", "node_rank", "local_rank", "device", "addr", "components")]
        for rank in range(self.world_size):
            i = cluster.rank_info(rank)
            rows.append((str(rank), i.host_name, str(i.node_rank), str(i.local_rank), str(i.device_index), i.addr,
                         " ".join(self._labels(rank)) or "-"))
        hosts = [f"  {h.name} ({h.addr}): devices {list(h.devices)}"
                 + (f", transfer_device {h.transfer_device}" if h.transfer_device else "")
                 + (", env " + " ".join(f"{k}={v}" for k, v in sorted(h.env.items())) if h.env else "")
                 for h in cluster.hosts]
        return "hosts:\n" + "\n".join(hosts) + "\nrank map:\n" + _table(rows)

    def describe_groups(self, p2p_pairs: tuple[tuple[int, int], ...], transport: TransportConfig) -> str:
        """TP groups, the data plane's choice, and the pair groups every rank creates (in creation order)."""
        tp = ", ".join("[" + ",".join(map(str, g)) + "]" for g in self.tp_groups) or "none"
        lines = [f"TP groups: {len(self.tp_groups)}: {tp}",
                 f"data plane: inline up to {transport.inline_max_bytes} B; intra_host={transport.intra_host}, "
                 f"inter_host={transport.inter_host}; {len(self.edge_pairs)} rank pair(s) carry values",
                 f"pair groups (p2p): {len(p2p_pairs)}" + (": " if p2p_pairs else "")
                 + ", ".join(f"{s}->{d}" for s, d in p2p_pairs)]
        return "\n".join(lines)

    def _labels(self, rank: int) -> tuple[str, ...]:
        return tuple(sorted(f"{w}/{n}" for n, ws in self.components_on(rank).items() for w in ws))

    def describe(self, cluster: ClusterSpec, transport: TransportConfig | None = None) -> str:
        """Human-readable placement table (walk, node, replica -> ranks -> host:device) and cross-host edges."""
        transport = transport or TransportConfig()
        cut = self.cut_report(cluster, transport)
        rows = [("walk", "node", "replica", "tp", "ranks", "host:device")]
        for (w, n), reps in sorted(self._replicas.items()):
            for rep in reps:
                infos = [cluster.rank_info(r) for r in rep.ranks]
                rows.append((
                    w, n, str(rep.index), str(len(rep.ranks)), ",".join(map(str, rep.ranks)),
                    " ".join(f"{i.host_name}:{i.device_index}" for i in infos),
                ))
        lines = [
            f"placement: world_size={self.world_size} on {len(cluster.hosts)} host(s), "
            f"{len(self.hosting_ranks)} hosting rank(s), {len(self.edge_pairs)} edge pair(s), "
            f"{len(self.tp_groups)} TP group(s)",
            _table(rows),
        ]
        lines.append(f"cross-host edges: {len(cut)} (intra_host={transport.intra_host}, inter_host={transport.inter_host})")
        by_hosts: dict[tuple[str, str], list[CutEdge]] = {}
        for e in cut:
            by_hosts.setdefault((e.src_host, e.dst_host), []).append(e)
        for (a, b), edges in sorted(by_hosts.items()):
            lines.append(f"  {a} -> {b}: {len(edges)} rank pair(s) via {edges[0].transport}")
            for e in edges[:16]:
                lines.append(
                    f"    {e.src_rank} -> {e.dst_rank}  [{' '.join(e.src_components)}] -> [{' '.join(e.dst_components)}]"
                )
            if len(edges) > 16:
                lines.append(f"    ... {len(edges) - 16} more")
        return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _replicas(group: NodeGroup) -> tuple[Replica, ...]:
    t = group.tp_size
    return tuple(Replica(k, group.ranks[k * t:(k + 1) * t]) for k in range(len(group.ranks) // t))


def choose_replica(
    replicas: Sequence[Replica],
    live_ranks: set[int],
    hosts_used: set[str],
    ranks_used: set[int],
    rank_host: Mapping[int, str],
    rng: random.Random,
) -> Replica | None:
    """The replica a request should use for one (walk, node) (docs/architecture.md §5), or None when none is live.

    Only replicas whose every rank is in `live_ranks` count. Among them prefer the most ranks on hosts the
    request already uses (`hosts_used`), then the most ranks it already uses (`ranks_used`); ties are broken
    uniformly with `rng` (ranks are global ranks; `rank_host` maps each to its host name).
    """
    live = [rep for rep in replicas if all(r in live_ranks for r in rep.ranks)]
    if not live:
        return None

    def score(rep: Replica) -> tuple[int, int]:
        return (sum(rank_host[r] in hosts_used for r in rep.ranks), sum(r in ranks_used for r in rep.ranks))

    best = max(score(rep) for rep in live)
    ties = sorted((rep for rep in live if score(rep) == best), key=lambda rep: rep.index)
    return ties[0] if len(ties) == 1 else rng.choice(ties)


def _check_no_idle_rank(config: DeploymentConfig) -> None:
    """Without a ``cluster:`` section the launch scripts start the highest placed rank + 1 processes, and every rank
    below it must serve some node: a gap (``ranks: [2]`` where ``[1]`` was meant) would start a process that loads
    nothing and only idles. (A cluster spec lists its devices itself; one it leaves unplaced is its author's choice.)"""
    placed = {r for g in config.node_groups for r in g.ranks}
    idle = sorted(set(range(1 + max(placed, default=-1))) - placed)
    if idle:
        raise ConfigError("node_groups", f"rank {idle[0]} is in no node group (the ranks placed are {sorted(placed)}, "
                          f"so ranks 0..{max(placed)} must each serve a node; a rank with none would only idle)",
                          source=config.source)
