"""Pair and TP subgroups (docs/architecture.md §2 step 3, §7).

Every graph edge between two ranks travels on a 2-rank subgroup of its own *directed* pair (src -> dst): the
producer only ever sends on it and the consumer only ever receives, so two ops on one pair can never wait on
each other and each pair is FIFO. The reverse direction (dst -> src) is a different group.

Why one global creation order: `new_group` is collective over the *whole world*, members or not (gloo agrees
on the group's store prefix through a world-wide counter; NCCL with a bound device splits the new communicator
from the world communicator, which every rank must join). Every rank must therefore create the same groups in
the same order, or the world deadlocks or pairs up the wrong peers. We sort the pairs (and TP groups) here, so
callers may pass them in any order, but every rank must pass the same set; `create_*` checks that with one
world all-reduce of a digest and raises ValueError instead of hanging. Caller's order across kinds
(docs/architecture.md §2): TP groups first, then pairs.

Backend: the groups take the deployment's backend string. On CUDA that is `cuda:nccl,cpu:gloo`, so each pair
group holds both an NCCL communicator (CUDA tensors, device to device) and a gloo context (host tensors); torch
routes each op by the tensor's device. One group per pair therefore carries both kinds of tensor, each kind in
its own FIFO, which is all the p2p transport needs because the consumer posts receives in descriptor order.

Index spaces: `src`, `dst`, `ranks` are global ranks; `*_rank_in_group` are ranks inside the subgroup (its
members sorted ascending, so the smaller global rank is 0).
"""

from __future__ import annotations

import datetime
import hashlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mstar_dist.distributed.tp import TPGroup

__all__ = ["PairGroup", "create_pair_groups", "create_tp_groups", "warm_pairs"]


@dataclass(frozen=True)
class PairGroup:
    """The subgroup of one directed pair, as seen by one of its two members."""

    src: int
    """Global rank of the producer (the only rank that sends on this group)."""
    dst: int
    """Global rank of the consumer (the only rank that receives on this group)."""
    group: dist.ProcessGroup
    """The 2-rank process group."""
    peer_rank_in_group: int
    """Rank inside `group` of the *other* member, as seen from this rank (use as group_dst / group_src)."""

    @property
    def pair(self) -> tuple[int, int]:
        return (self.src, self.dst)


def create_pair_groups(
    pairs: Iterable[tuple[int, int]], *, global_rank: int, backend: str, timeout_s: float
) -> dict[tuple[int, int], PairGroup]:
    """Create one 2-rank subgroup per directed pair (src, dst), in sorted order, on every rank.

    Collective over the whole world: every rank must call it with the same set of pairs (any order); blocks
    until all have. Returns only the pairs this rank belongs to. `timeout_s` becomes the groups' op timeout.
    ValueError for a self-pair, a negative or out-of-world rank, or pair sets that differ between ranks.
    """
    world_size = dist.get_world_size()
    ordered = sorted({(int(src), int(dst)) for src, dst in pairs})
    for src, dst in ordered:
        if src == dst or not (0 <= src < world_size and 0 <= dst < world_size):
            raise ValueError(f"invalid pair ({src}, {dst}) for world_size {world_size}: need src != dst in range")
    _check_same_everywhere("pair groups", ordered, global_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    out: dict[tuple[int, int], PairGroup] = {}
    for src, dst in ordered:
        group = dist.new_group([src, dst], timeout=timeout, backend=backend, group_desc=f"pair_{src}_to_{dst}")
        if global_rank in (src, dst):
            peer = dst if global_rank == src else src
            out[(src, dst)] = PairGroup(src, dst, group, peer_rank_in_group=int(peer > global_rank))
    return out


def create_tp_groups(
    groups: Iterable[Sequence[int]], *, global_rank: int, backend: str, timeout_s: float
) -> dict[tuple[int, ...], TPGroup]:
    """Create one subgroup per TP group (global ranks), in sorted order, on every rank.

    Same contract as `create_pair_groups` (collective over the world, same set on every rank, returns only
    the groups this rank is in). ValueError for a group with fewer than 2 ranks or repeated ranks.
    """
    world_size = dist.get_world_size()
    ordered = sorted({tuple(sorted(g)) for g in groups})
    for ranks in ordered:
        if len(ranks) < 2 or len(set(ranks)) != len(ranks) or not all(0 <= r < world_size for r in ranks):
            raise ValueError(f"invalid TP group {list(ranks)} for world_size {world_size}")
    _check_same_everywhere("TP groups", ordered, global_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    out: dict[tuple[int, ...], TPGroup] = {}
    for ranks in ordered:
        desc = "tp_" + "_".join(map(str, ranks))
        group = dist.new_group(list(ranks), timeout=timeout, backend=backend, group_desc=desc)
        if global_rank in ranks:
            out[ranks] = TPGroup(group=group, rank=ranks.index(global_rank), size=len(ranks), ranks=ranks)
    return out


def warm_pairs(
    pair_groups: dict[tuple[int, int], PairGroup], global_rank: int, device: str, *, timeout_s: float = 120.0
) -> float:
    """Do one small transfer on every pair this rank belongs to, so the first real transfer is not slow.

    Peers: the other member of each pair (global ranks). Blocks until every warm-up transfer is done or
    `timeout_s` passes (RuntimeError naming the pair). Call on every rank right after `create_pair_groups`.
    On a CUDA device both halves of each group are warmed: NCCL with a device tensor, gloo with a host one.
    Returns the seconds it took.

    Deadlock freedom: ops are posted as isend/irecv (gloo's `send` would block until the peer posts its
    recv) in the global sorted pair order and only then waited on. If posting itself blocks (lazy NCCL
    communicator creation), every rank still meets its peers in the same global order, so the first pair
    nobody has finished always has both members at it.
    """
    t0 = time.perf_counter()
    devices = [torch.device(device)]
    if devices[0].type != "cpu":
        devices.append(torch.device("cpu"))
    posted: list[tuple[PairGroup, torch.Tensor, dist.Work]] = []
    for key in sorted(pair_groups):
        pg = pair_groups[key]
        for dev in devices:
            if global_rank == pg.src:
                buf = torch.full((4,), float(pg.src * 1000 + pg.dst), device=dev)
                work = dist.isend(buf, group=pg.group, group_dst=pg.peer_rank_in_group)
            else:
                buf = torch.zeros(4, device=dev)
                work = dist.irecv(buf, group=pg.group, group_src=pg.peer_rank_in_group)
            posted.append((pg, buf, work))
    deadline = time.monotonic() + timeout_s
    for pg, buf, work in posted:
        _wait_work(work, buf.device, deadline, f"warm-up of pair {pg.src}->{pg.dst} on {buf.device.type}")
        if global_rank == pg.dst and buf[0].item() != pg.src * 1000 + pg.dst:
            raise RuntimeError(f"warm-up of pair {pg.src}->{pg.dst} received {buf.tolist()}: groups are mis-wired")
    return time.perf_counter() - t0


def _wait_work(work: dist.Work, device: torch.device, deadline: float, what: str) -> None:
    remaining = max(deadline - time.monotonic(), 1e-3)
    if device.type == "cpu":
        try:
            work.wait(datetime.timedelta(seconds=remaining))
        except RuntimeError as exc:
            raise RuntimeError(f"{what} failed or timed out: {exc}") from exc
        return
    while not work.is_completed():  # NCCL: poll the op's end event, host-side deadline
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} timed out")
        time.sleep(1e-4)
    work.wait()


def _check_same_everywhere(what: str, items: list, global_rank: int) -> None:
    """Raise ValueError on every rank if `items` differs between ranks (one world all-reduce, host tensor)."""
    digest = hashlib.sha256(repr(items).encode()).digest()
    value = int.from_bytes(digest[:7], "little")  # fits int64 with room to negate
    t = torch.tensor([value, -value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if t[0].item() != value or -t[1].item() != value:
        raise ValueError(
            f"rank {global_rank}: {what} differ between ranks (every rank must create the same set); "
            f"this rank has {items}"
        )
