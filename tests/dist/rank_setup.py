"""Shared per-rank setup for the multi-process data-plane tests (runs inside a rank started by run_ranks)."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import msgspec

from mstar_dist.control.channel import ControlChannel, default_store, lookup_endpoint, publish_endpoint
from mstar_dist.distributed.groups import PairGroup, create_pair_groups, warm_pairs
from mstar_dist.distributed.init import init_distributed, shutdown_distributed
from mstar_dist.transport.p2p import P2PTransport


class Desc(msgspec.Struct, array_like=True):
    """Test-only descriptor: what a producer announces before `send` (the runtime's lives in the wire types)."""

    seq: int
    shape: list[int]
    dtype: str


@dataclass
class Rank:
    rank: int
    world: int
    groups: dict[tuple[int, int], PairGroup]
    transport: P2PTransport
    channel: ControlChannel


def setup_rank(rank: int, *, timeout_s: float = 20.0, warm: bool = True) -> Rank:
    """init gloo, every directed pair, warm-up, transport, and a control channel connected to every peer."""
    world = int(os.environ["WORLD_SIZE"])
    init_distributed(global_rank=rank, world_size=world, device="cpu", timeout_s=timeout_s)
    pairs = [p for p in itertools.permutations(range(world), 2)]
    groups = create_pair_groups(pairs, global_rank=rank, backend="gloo", timeout_s=timeout_s)
    if warm:
        warm_pairs(groups, rank, "cpu", timeout_s=timeout_s)
    channel = ControlChannel(f"rank{rank}", "127.0.0.1")
    store = default_store()
    publish_endpoint(store, f"rank{rank}", channel.endpoint)
    for peer in range(world):
        if peer != rank:
            channel.connect(f"rank{peer}", lookup_endpoint(store, f"rank{peer}", timeout_s))
    return Rank(rank, world, groups, P2PTransport(rank, groups, "cpu"), channel)


def teardown_rank(r: Rank) -> None:
    r.transport.close()
    r.channel.close()
    shutdown_distributed()
