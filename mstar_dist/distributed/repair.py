"""Groups formed without the world group: the pairs and TP groups of a rank that rejoins a running deployment
(docs/architecture.md §10, "Restart and rejoin").

torch.distributed forms a subgroup (``new_group``) collectively over the default group, and a process joins the
default group once, together with every other rank (``init_process_group``). A rank restarted in place can do
neither: the others passed that rendezvous long ago, and their default group's connections to the dead process are
gone for good. What it can do is what ``new_group`` does underneath: a process group of two (or of a TP replica's
size) built straight on a store under a prefix of its own. Both members build it from the same prefix at about the
same time (the conductor's ``Repair`` tells each what to build), and gloo (or NCCL) connects them through the store.
The launch's store (``distributed/store.py``) is reachable by every process of the launch, restarted or not.

So the world group serves startup only; every edge runs on pair groups, which a rejoin replaces one pair at a time
(the p2p transport takes a new group for a peer it had aborted: ``DataPlane.revive_peer``). A group made here is
not registered with torch.distributed's world (``dist.get_rank(group)`` does not know it); this runtime only calls
the group's own methods (``send``, ``recv``, ``allreduce``), which need no registration.

Backends: gloo alone on CPU (``ProcessGroupGloo``); on CUDA a ``ProcessGroup`` with NCCL for CUDA tensors and gloo
for host tensors, assembled the way ``new_group`` assembles it (torch's ``_register_backend``: the one private call
of this module).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from mstar_dist.distributed.groups import PairGroup
from mstar_dist.distributed.tp import TPGroup

__all__ = ["form_pairs", "form_tp_group", "tp_generation_key"]


def _group(store: Any, prefix: str, rank_in_group: int, size: int, backend: str, timeout_s: float) -> Any:
    """A process group of ``size`` members under ``prefix`` of ``store``; blocks until every member joined (at most
    ``timeout_s``: then RuntimeError)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    scoped = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(dist.PrefixStore("gloo", scoped), rank_in_group, size, timeout)
    if backend != "cuda:nccl,cpu:gloo":
        raise ValueError(f"cannot form a group with backend {backend!r}")
    pg = dist.ProcessGroup(scoped, rank_in_group, size)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", scoped), rank_in_group, size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", scoped), rank_in_group, size, options)
    pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
    return pg


def form_pairs(store: Any, prefix: str, pairs: Iterable[tuple[int, int]], me: int, backend: str,
               timeout_s: float) -> dict[tuple[int, int], PairGroup]:
    """The fresh group of each directed pair of ``pairs`` that global rank ``me`` belongs to, in sorted order (its
    peer forms the same ones in the same order), each under ``prefix/<src>_<dst>``. Blocks until each peer has
    joined its group; RuntimeError naming the pair when one does not within ``timeout_s``."""
    out: dict[tuple[int, int], PairGroup] = {}
    for src, dst in sorted({(int(s), int(d)) for s, d in pairs}):
        if me not in (src, dst) or src == dst:
            continue
        peer = dst if me == src else src
        mine = int(me > peer)  # members sorted ascending, as create_pair_groups does
        try:
            group = _group(store, f"{prefix}/{src}_{dst}", mine, 2, backend, timeout_s)
        except Exception as exc:
            raise RuntimeError(f"forming pair {src}->{dst} again failed: {type(exc).__name__}: {exc}") from None
        out[(src, dst)] = PairGroup(src, dst, group, peer_rank_in_group=1 - mine)
    return out


def tp_generation_key(ranks: tuple[int, ...]) -> str:
    """The store counter that numbers the re-formations of TP replica ``ranks``."""
    return f"tp/{'_'.join(map(str, ranks))}/joins"


def form_tp_group(store: Any, ranks: tuple[int, ...], me: int, backend: str, timeout_s: float) -> TPGroup:
    """The TP group of replica ``ranks`` formed anew by its members, each restarted in place (the first incarnation
    formed it with ``new_group``). Every member counts itself in under ``tp_generation_key``: the k-th ``len(ranks)``
    arrivals form generation k, so a replica whose members all restart once per failure meets in one generation.
    Blocks until every member has joined (RuntimeError after ``timeout_s``)."""
    ranks = tuple(sorted(ranks))
    arrival = store.add(tp_generation_key(ranks), 1)
    generation = (arrival - 1) // len(ranks)
    prefix = f"tp/{'_'.join(map(str, ranks))}/g{generation}"
    try:
        group = _group(store, prefix, ranks.index(me), len(ranks), backend, timeout_s)
    except Exception as exc:
        raise RuntimeError(f"forming TP group {list(ranks)} again (generation {generation}) failed: "
                           f"{type(exc).__name__}: {exc}; every member of the replica must restart") from None
    return TPGroup(group=group, rank=ranks.index(me), size=len(ranks), ranks=ranks)
