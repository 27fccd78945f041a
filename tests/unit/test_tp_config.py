"""Which placements may use tensor parallelism (mstar_dist/runtime/: ``deployment.check_tp``, ``rank.tp_roles_for``).

A failure means a family that cannot shard a node is started with tp_size > 1 (it would run unsharded and
disagree with its replica), a node is sharded differently in two walks (a P/D KV shard would not fit its
counterpart), or a rank does not know whether it leads or follows its TP replica.
"""

from __future__ import annotations

import pytest

from mstar_dist.config.deployment import parse_config
from mstar_dist.topology.placement import Placement
from mstar_dist.runtime.deployment import check_tp
from mstar_dist.runtime.rank import tp_roles_for
from models.moe.chat import MoEChat
from tests.toy_model import ToyModel


def config(groups: list[dict]):
    return parse_config({"model": "x", "node_groups": groups}, "test.yaml")


def test_tp_needs_a_family_that_shards_the_node():
    cfg = config([{"node_names": ["ADD"], "ranks": [0, 1], "tp_size": 2, "graph_walks": ["start"]},
                  {"node_names": ["COUNT"], "ranks": [2], "graph_walks": ["count"]}])
    with pytest.raises(ValueError, match=r"node_groups\[0\].tp_size = 2: node 'ADD' of model 'toy' does not support"):
        check_tp(cfg, ToyModel(None), {"start": frozenset({"ADD"}), "count": frozenset({"COUNT"})})


def test_a_node_is_sharded_alike_in_every_walk():
    cfg = config([{"node_names": ["LLM"], "ranks": [0, 1], "tp_size": 2, "graph_walks": ["prefill"]},
                  {"node_names": ["LLM"], "ranks": [2], "graph_walks": ["decode"]}])
    with pytest.raises(ValueError, match=r"node_groups\[1\].tp_size = 1: node 'LLM' has tp_size 2 in node_groups\[0\]"):
        check_tp(cfg, MoEChat.__new__(MoEChat), {"prefill": frozenset({"LLM"}), "decode": frozenset({"LLM"})})


def test_roles_follow_the_replica_order():
    cfg = config([{"node_names": ["LLM"], "ranks": [0, 1], "tp_size": 2, "graph_walks": ["prefill"]},
                  {"node_names": ["LLM"], "ranks": [2, 3], "tp_size": 2, "graph_walks": ["decode"]}])
    placement = Placement.build(cfg, {"prefill": frozenset({"LLM"}), "decode": frozenset({"LLM"})}, 4)
    roles = {rank: tp_roles_for(placement, rank)["LLM"] for rank in range(4)}
    assert [roles[r].leads for r in range(4)] == [True, False, True, False]
    assert roles[3].ranks == (2, 3) and roles[3].rank_in_group == 1 and roles[2].followers == (3,)
