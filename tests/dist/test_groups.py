"""Pair and TP subgroups over gloo with real processes (docs/architecture.md §2 step 3, §7 hazards). A failure means ranks
disagree on which group is which pair (mis-wired or hung boot), warm-up hangs, a mismatched placement hangs
instead of failing, or one timed-out pair takes other pairs down with it."""

from __future__ import annotations

import datetime
import itertools
import os
import random

import pytest
import torch
import torch.distributed as dist

from mstar_dist.distributed.groups import create_pair_groups, create_tp_groups, warm_pairs
from mstar_dist.distributed.init import init_distributed, shutdown_distributed
from tests.dist.launcher import run_ranks


def _init(rank: int, timeout_s: float = 20.0) -> int:
    world = int(os.environ["WORLD_SIZE"])
    init_distributed(global_rank=rank, world_size=world, device="cpu", timeout_s=timeout_s)
    return world


def _order_rank(rank: int) -> dict:
    world = _init(rank)
    tp = create_tp_groups([[2, 1]], global_rank=rank, backend="gloo", timeout_s=20)
    pairs = list(itertools.permutations(range(world), 2))
    random.Random(rank).shuffle(pairs)  # every rank passes its own order; creation order must not depend on it
    groups = create_pair_groups(pairs, global_rank=rank, backend="gloo", timeout_s=20)
    warm_s = warm_pairs(groups, rank, "cpu", timeout_s=20)
    if tp:
        (g,) = tp.values()
        t = torch.tensor([g.rank_in_group + 1])
        dist.all_reduce(t, group=g.group)
        assert t.item() == 3 and g.ranks == (1, 2)
    names = {f"{s}->{d}": pg.group.group_name for (s, d), pg in groups.items()}
    members = {f"{s}->{d}": dist.get_process_group_ranks(pg.group) for (s, d), pg in groups.items()}
    shutdown_distributed()
    return {"names": names, "members": members, "warm_s": warm_s, "tp": [list(k) for k in tp]}


def test_groups_are_created_in_one_order_on_every_rank_and_warm():
    out = run_ranks(_order_rank, 3, timeout_s=50)
    for rank, res in enumerate(out):
        assert sorted(res["names"]) == sorted(f"{s}->{d}" for s, d in itertools.permutations(range(3), 2)
                                              if rank in (s, d))
        for pair, ranks in res["members"].items():
            assert ranks == sorted(map(int, pair.split("->")))
        assert res["warm_s"] < 10
    for s, d in itertools.permutations(range(3), 2):  # both members see the same group for the pair
        assert out[s]["names"][f"{s}->{d}"] == out[d]["names"][f"{s}->{d}"]
    assert [r["tp"] for r in out] == [[], [[1, 2]], [[1, 2]]]


def _mismatch_rank(rank: int) -> str:
    _init(rank)
    pairs = [(0, 1), (1, 0)] + ([(1, 2)] if rank == 2 else [])
    try:
        create_pair_groups(pairs, global_rank=rank, backend="gloo", timeout_s=20)
    except ValueError as exc:
        return str(exc)
    finally:
        shutdown_distributed()
    return "no error"


def test_ranks_passing_different_pairs_fail_fast_not_hang():
    msgs = run_ranks(_mismatch_rank, 3, timeout_s=30)
    assert all("differ between ranks" in m for m in msgs), msgs


def _bad_pair_rank(rank: int) -> None:
    _init(rank)
    with pytest.raises(ValueError, match=r"\(1, 1\)"):
        create_pair_groups([(1, 1)], global_rank=rank, backend="gloo", timeout_s=5)
    with pytest.raises(ValueError, match=r"\(0, 5\)"):
        create_pair_groups([(0, 5)], global_rank=rank, backend="gloo", timeout_s=5)
    shutdown_distributed()


def test_invalid_pairs_are_value_errors():
    run_ranks(_bad_pair_rank, 2, timeout_s=30)


def _timeout_rank(rank: int) -> str:
    world = _init(rank)
    groups = create_pair_groups(itertools.permutations(range(world), 2), global_rank=rank, backend="gloo",
                                timeout_s=20)
    warm_pairs(groups, rank, "cpu")
    err = ""
    if rank == 1:  # rank 0 never sends on 0->1: this receive times out and breaks that pair's group
        work = dist.irecv(torch.empty(4), group=groups[(0, 1)].group, group_src=0)
        with pytest.raises(RuntimeError, match="[Tt]imed out") as exc:
            work.wait(datetime.timedelta(seconds=0.3))
        err = str(exc.value)
    dist.barrier()  # the world group is unaffected
    # every other pair still carries data, in both directions, including the same two ranks reversed
    works, bufs = [], {}
    for (s, d), pg in sorted(groups.items()):
        if (s, d) == (0, 1):
            continue
        if rank == s:
            payload = torch.full((8,), float(10 * s + d))
            works.append(dist.isend(payload, group=pg.group, group_dst=pg.peer_rank_in_group))
        else:
            bufs[(s, d)] = torch.zeros(8)
            works.append(dist.irecv(bufs[(s, d)], group=pg.group, group_src=pg.peer_rank_in_group))
    for w in works:
        w.wait(datetime.timedelta(seconds=10))
    for (s, d), b in bufs.items():
        assert torch.equal(b, torch.full((8,), float(10 * s + d))), (s, d, b)
    shutdown_distributed()
    return err


def test_a_timed_out_pair_does_not_break_other_pairs():
    out = run_ranks(_timeout_rank, 3, timeout_s=50)
    assert "300ms" in out[1]
