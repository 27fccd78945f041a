"""The tensor-parallel group a model's layers reduce on (docs/architecture.md §4b).

One class for both sides of the seam: ``create_tp_groups`` (``distributed/groups.py``) makes one per TP replica this
rank belongs to, and a model family's TP layers (``models/common/tp.py``) take it through
``build_component(..., tp=...)``, so the runtime hands a family a group without importing the zoo.

Index spaces: ``rank`` is the rank *inside the group* (rank_in_group, 0..size-1), never a global rank; ``ranks``
are the members' global ranks. Every collective here runs on ``group`` and its peers are exactly the members. With
``TPGroup.single()`` (no TP) nothing communicates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["TPGroup"]


@dataclass(frozen=True)
class TPGroup:
    """One tensor-parallel group as seen by one of its members."""

    group: dist.ProcessGroup | None
    """The group's process group (gloo or NCCL); None only for a group of one (no TP)."""
    rank: int
    """rank_in_group: this rank's index inside `group` (0..size-1), not a global rank."""
    size: int
    """Members of the group (the TP degree). 1 means disabled."""
    ranks: tuple[int, ...] = ()
    """The members' global ranks, ascending (empty when the group was not made by ``create_tp_groups``)."""

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TPGroup: rank_in_group ({self.rank}) must be in [0, size={self.size})")
        if self.size > 1 and self.group is None:
            raise ValueError(f"TPGroup: size {self.size} needs a process group")

    @classmethod
    def single(cls) -> TPGroup:
        """No tensor parallelism: one rank, no process group, no collectives."""
        return cls(group=None, rank=0, size=1)

    @classmethod
    def from_process_group(cls, group: dist.ProcessGroup) -> TPGroup:
        """The TP group formed by `group`'s members."""
        return cls(group=group, rank=dist.get_rank(group), size=dist.get_world_size(group))

    @property
    def rank_in_group(self) -> int:
        return self.rank

    def split(self, n: int, what: str) -> int:
        """n // size; ValueError naming `what`, n and the TP size when n does not divide evenly."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by tp_size ({self.size})")
        return n // self.size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the group in place and return it (a no-op for a group of one).

        Collective on `group`: every member must call it with a tensor of the same shape, in the same order.
        Blocks until the sum is done (gloo); on NCCL it is enqueued on the current stream. `t` must be
        contiguous. Every member ends with the same values (the reduced tensor is the group's, not a rank's).
        """
        if self.size > 1:
            # the group's own call: a group re-formed by a rejoining replica (distributed/repair.py) is not
            # registered with torch.distributed's world, which dist.all_reduce would look it up in
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.SUM
            self.group.allreduce([t], options).wait()
        return t
