"""Partitions and streaming edges (docs/architecture.md §4): which walks of a request run concurrently, and what flows between them.

A request is a sequence of walks; its walks are grouped in partitions that run concurrently (producer and
consumer, e.g. an LLM decode walk that produces audio codes and a codec walk that consumes them). Inside a
partition the model drives the walk order (``after_walk``); this module only says which partitions exist, which
walk belongs where and, per request, which partitions are running or done (:class:`PartitionTracker`). A
:class:`StreamingEdge` carries a signal from a producer partition into a consumer node's
:class:`~mstar_dist.graph.streaming.StreamBuffer`. Pure logic: no processes, nothing blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from mstar_dist.graph.nodes import Section, iter_nodes
from mstar_dist.graph.streaming import ChunkPolicy, Fixed, LeftContext, SlidingWindow


@dataclass(frozen=True)
class Partition:
    name: str
    """Unique within a model."""
    walks: tuple[str, ...]
    """The walks that run in this partition, in declaration order (the model still picks the order)."""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Partition: name must be a non-empty str, got {self.name!r}")
        if isinstance(self.walks, str) or not self.walks:
            raise ValueError(f"Partition {self.name!r}: walks must be a non-empty tuple of walk names, "
                             f"got {self.walks!r}")
        object.__setattr__(self, "walks", tuple(self.walks))
        if len(set(self.walks)) != len(self.walks):
            raise ValueError(f"Partition {self.name!r}: walks listed twice in {self.walks}")


def check_partitions(partitions: Iterable[Partition], graphs: Mapping[str, Section]) -> dict[str, Partition]:
    """Every walk of ``graphs`` in exactly one partition and partition names unique; returns ``{name: partition}``.

    Raises ``ValueError`` naming the offending partition or walk.
    """
    by_name: dict[str, Partition] = {}
    owner: dict[str, str] = {}
    for p in partitions:
        if p.name in by_name:
            raise ValueError(f"partition {p.name!r} declared twice")
        by_name[p.name] = p
        for walk in p.walks:
            if walk not in graphs:
                raise ValueError(f"partition {p.name!r}: unknown walk {walk!r}; walks are {sorted(graphs)}")
            if walk in owner:
                raise ValueError(f"walk {walk!r} is in partitions {owner[walk]!r} and {p.name!r}")
            owner[walk] = p.name
    missing = sorted(set(graphs) - set(owner))
    if missing:
        raise ValueError(f"walks {missing} are in no partition")
    return by_name


@dataclass(frozen=True)
class StreamingEdge:
    """``signal`` produced in ``src_partition`` streams into ``dst_node`` (in ``dst_partition``) through a buffer."""

    signal: str
    """The value's name: an output edge of a producer node and an input of ``dst_node``."""
    src_partition: str
    dst_partition: str
    dst_node: str
    """The consumer node; each of its iterations takes one chunk as its ``signal`` input."""
    policy: ChunkPolicy
    """When a chunk is ready (:mod:`mstar_dist.graph.streaming`)."""

    def __post_init__(self):
        if self.src_partition == self.dst_partition:
            raise ValueError(f"StreamingEdge {self.signal!r}: src_partition and dst_partition are both "
                             f"{self.src_partition!r}; a streaming edge crosses partitions")
        if not isinstance(self.policy, (SlidingWindow, LeftContext, Fixed)):
            raise ValueError(f"StreamingEdge {self.signal!r}: policy must be a chunk policy, got {self.policy!r}")

    def check(self, partitions: Mapping[str, Partition], graphs: Mapping[str, Section]) -> None:
        """Both partitions exist, a node of the source partition outputs ``signal`` and ``dst_node`` is a node of
        the destination partition that takes it. Raises ``ValueError``."""
        for role, name in (("src_partition", self.src_partition), ("dst_partition", self.dst_partition)):
            if name not in partitions:
                raise ValueError(f"StreamingEdge {self.signal!r}: unknown {role} {name!r}; "
                                 f"partitions are {sorted(partitions)}")
        src_nodes = [n for w in partitions[self.src_partition].walks for n in iter_nodes(graphs[w])]
        if not any(e.signal == self.signal for n in src_nodes for e in n.outputs):
            raise ValueError(f"StreamingEdge {self.signal!r}: no node of partition {self.src_partition!r} "
                             f"outputs {self.signal!r}")
        dst = [n for w in partitions[self.dst_partition].walks for n in iter_nodes(graphs[w])
               if n.name == self.dst_node]
        if not dst:
            raise ValueError(f"StreamingEdge {self.signal!r}: dst_node {self.dst_node!r} is in no walk of "
                             f"partition {self.dst_partition!r}")
        if not any(self.signal in (*n.inputs, *n.optional_inputs, *n.until_end) for n in dst):
            raise ValueError(f"StreamingEdge {self.signal!r}: dst_node {self.dst_node!r} does not take "
                             f"{self.signal!r} as an input")


PENDING, RUNNING, DONE = "pending", "running", "done"


class PartitionTracker:
    """One request's partition states: pending -> running -> done (or done from the start).

    The conductor calls :meth:`start` when it launches a partition's first walk, :meth:`walk_done` when one of
    its walks completes and :meth:`partition_done` when the model says the partition has nothing more to run.
    A partition in ``start_done`` (e.g. the audio partition when no audio was requested) is done from the start
    and may not be started. Unknown partition names raise ``ValueError``; a call in the wrong state raises
    ``RuntimeError`` (a conductor bug).
    """

    def __init__(self, partitions: Iterable[Partition], start_done: Iterable[str] = ()):
        self.partitions: dict[str, Partition] = {}
        for p in partitions:
            if p.name in self.partitions:
                raise ValueError(f"partition {p.name!r} declared twice")
            self.partitions[p.name] = p
        if not self.partitions:
            raise ValueError("PartitionTracker needs at least one partition")
        self._owner = {walk: p.name for p in self.partitions.values() for walk in p.walks}
        if len(self._owner) != sum(len(p.walks) for p in self.partitions.values()):
            raise ValueError("a walk is listed in more than one partition")
        self._state = {name: PENDING for name in self.partitions}
        self._walks_done = {name: 0 for name in self.partitions}
        for name in start_done:
            self._check_name(name)
            self._state[name] = DONE

    def start(self, partition: str) -> None:
        self._expect(partition, PENDING, "start")
        self._state[partition] = RUNNING

    def walk_done(self, partition: str) -> int:
        """One walk of a running partition completed; returns how many of its walks have completed so far."""
        self._expect(partition, RUNNING, "walk_done")
        self._walks_done[partition] += 1
        return self._walks_done[partition]

    def partition_done(self, partition: str) -> None:
        """The partition runs nothing more; allowed when pending (never started) or running, not twice."""
        if self.state(partition) == DONE:
            raise RuntimeError(f"partition_done({partition!r}): partition is already done")
        self._state[partition] = DONE

    def partition_of(self, walk: str) -> str:
        if walk not in self._owner:
            raise ValueError(f"walk {walk!r} is in no partition; walks are {sorted(self._owner)}")
        return self._owner[walk]

    def state(self, partition: str) -> str:
        """``"pending"``, ``"running"`` or ``"done"``."""
        self._check_name(partition)
        return self._state[partition]

    def is_done(self, partition: str) -> bool:
        return self.state(partition) == DONE

    def walks_done(self, partition: str) -> int:
        self._check_name(partition)
        return self._walks_done[partition]

    @property
    def request_done(self) -> bool:
        """Every partition is done."""
        return all(s == DONE for s in self._state.values())

    def _check_name(self, partition: str) -> None:
        if partition not in self.partitions:
            raise ValueError(f"unknown partition {partition!r}; partitions are {sorted(self.partitions)}")

    def _expect(self, partition: str, state: str, call: str) -> None:
        if self.state(partition) != state:
            raise RuntimeError(f"{call}({partition!r}): partition is {self._state[partition]}, expected {state}")
