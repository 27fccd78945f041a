"""Placement (mstar_dist.topology.placement): a failure here means a rank would load the wrong components,
a walk node would be left unplaced or placed twice without a clear error, subgroups would be created in a
rank-dependent order (an NCCL hang), the cross-host report would be wrong, or requests would be routed to
dead or needlessly distant replicas."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from mstar_dist.config.cluster import ClusterSpec, HostSpec
from mstar_dist.config.deployment import TransportConfig, load_config, parse_config
from mstar_dist.topology.placement import CutEdge, Placement, Replica, choose_replica

CONFIGS = Path(__file__).resolve().parents[2] / "launch" / "configs"
LLM_WALKS = {"prefill": frozenset({"LLM"}), "decode": frozenset({"LLM"})}
# An omni-style model: encoder + LLM in prefill, LLM in decode, LLM + codec in speech.
OMNI_WALKS = {
    "prefill": frozenset({"ENC", "LLM"}),
    "decode": frozenset({"LLM"}),
    "speech": frozenset({"LLM", "CODEC"}),
}


def config(groups, cluster=None):
    data = {"model": "m", "node_groups": groups}
    if cluster is not None:
        data["cluster"] = cluster
    return parse_config(data, "p.yaml")


def group(nodes, ranks, walks, tp=1):
    return {"node_names": nodes, "ranks": ranks, "graph_walks": walks, "tp_size": tp}


OMNI = [
    group(["ENC"], [0], ["prefill"]),
    group(["LLM"], [0], ["prefill"]),
    group(["LLM"], [1, 2, 3, 4], ["decode", "speech"], tp=2),
    group(["CODEC"], [5, 6], ["speech"]),
]


def build(groups, walks=OMNI_WALKS, world_size=8, cluster=None) -> Placement:
    return Placement.build(config(groups, cluster), walks, world_size)


def error(groups, walks=OMNI_WALKS, world_size=8) -> str:
    with pytest.raises(ValueError) as info:
        build(groups, walks, world_size)
    return str(info.value)


@pytest.mark.parametrize("name", ["smollm2_pd.yaml", "smollm2_single.yaml", "smollm2_dp.yaml", "smollm2_pd_2host.yaml"])
def test_example_configs_place(name):
    cfg = load_config(CONFIGS / name)
    world_size = {"smollm2_single.yaml": 1, "smollm2_dp.yaml": 3}.get(name, 2)
    p = Placement.build(cfg, LLM_WALKS, world_size)
    cluster = cfg.resolve_cluster(world_size)
    assert p.components_on(0) == {"LLM": frozenset({"prefill"} if world_size > 1 else {"prefill", "decode"})}
    assert "prefill" in p.describe(cluster) and "decode" in p.describe(cluster)
    if name == "smollm2_dp.yaml":
        assert p.replicas("decode", "LLM") == (Replica(0, (1,)), Replica(1, (2,)))
    if name == "smollm2_pd_2host.yaml":
        assert [(e.src_host, e.dst_host) for e in p.cut_report(cluster, cfg.transport)] == [
            ("node-a", "node-b"), ("node-b", "node-a")]


def test_replicas_groups_and_components():
    p = build(OMNI)
    assert p.replicas("decode", "LLM") == (Replica(0, (1, 2)), Replica(1, (3, 4)))
    assert p.replicas("speech", "LLM") == p.replicas("decode", "LLM")
    assert p.replicas("speech", "CODEC") == (Replica(0, (5,)), Replica(1, (6,)))
    assert p.node_group_of("prefill", "ENC") == 0 and p.node_group_of("speech", "LLM") == 2
    assert p.ranks_hosting("prefill") == {0}
    assert p.ranks_hosting("speech") == {1, 2, 3, 4, 5, 6}
    assert p.components_on(0) == {"ENC": {"prefill"}, "LLM": {"prefill"}}
    assert p.components_on(3) == {"LLM": {"decode", "speech"}}  # one component for both walks
    assert p.components_on(7) == {}  # a spare rank loads nothing
    assert p.tp_groups == ((1, 2), (3, 4))
    assert p.hosting_ranks == (0, 1, 2, 3, 4, 5, 6)
    pairs = p.edge_pairs
    assert len(pairs) == 7 * 6 and pairs == tuple(sorted(pairs))
    assert all(s != d and 7 not in (s, d) for s, d in pairs)
    assert p.is_conductor(0) and not p.is_conductor(1)
    with pytest.raises(KeyError, match="'decode', 'ENC'"):
        p.replicas("decode", "ENC")


def test_placement_is_the_same_whatever_the_dict_order():
    a = build(OMNI)
    b = build(OMNI, walks=dict(reversed(list(OMNI_WALKS.items()))))
    assert a.tp_groups == b.tp_groups and a.edge_pairs == b.edge_pairs and a == b


def test_same_node_on_one_rank_through_two_groups_is_one_component():
    p = build([group(["LLM"], [0], ["prefill"]), group(["LLM"], [0], ["decode"])], LLM_WALKS, 1)
    assert p.components_on(0) == {"LLM": {"prefill", "decode"}}
    assert p.edge_pairs == ()


@pytest.mark.parametrize(
    "groups, expected",
    [
        (OMNI[:3], ["p.yaml: node_groups: 1 of the model's 5 (walk, node) pairs are placed by no node group",
                    "speech/CODEC"]),
        (OMNI[1:3], ["2 of the model's 5", "prefill/ENC, speech/CODEC"]),
        (OMNI + [group(["LLM"], [7], ["decode"])],
         ["node_groups[4]", "places node 'LLM' for walk 'decode', which node_groups[2] already places"]),
        (OMNI[:3] + [group(["CODEC"], [5], ["speech", "tts"])],
         ["node_groups[3].graph_walks = ['speech', 'tts']", "walk 'tts' is not a walk of the model",
          "3 walks: decode, prefill, speech"]),
        (OMNI[:3] + [group(["CODEC"], [5], ["speech", "decode"])],
         ["node_groups[3].node_names = ['CODEC']", "node 'CODEC' is not in walk 'decode' (its 1 nodes: LLM)"]),
        (OMNI[:3] + [group(["CODEC"], [5, 8], ["speech"])],
         ["node_groups[3].ranks = [5, 8]", "rank 8 is outside the world: WORLD_SIZE=8", "0..7"]),
        (OMNI[:2] + [group(["LLM"], [1, 2], ["decode"], tp=2), group(["LLM"], [1], ["speech"]), OMNI[3]],
         ["node_groups[3].ranks = [1]", "rank 1 holds node 'LLM' in replica ranks [1] (tp_size=1)",
          "node_groups[2] puts it in replica ranks [1, 2] (tp_size=2)"]),
    ],
)
def test_impossible_placements_name_key_and_numbers(groups, expected):
    msg = error(groups)
    for part in expected:
        assert part in msg, (part, msg)


def test_tp_size_must_divide_ranks():
    msg = error(OMNI[:2] + [group(["LLM"], [1, 2, 3], ["decode", "speech"], tp=2), OMNI[3]])
    assert "node_groups[2].tp_size = 2" in msg and "len(ranks)=3" in msg


def test_cluster_world_size_must_match():
    cluster = {"hosts": [{"name": "a", "addr": "10.0.0.1", "devices": 2}]}
    with pytest.raises(ValueError, match=r"p.yaml: cluster: the hosts list 2 devices but WORLD_SIZE=3"):
        Placement.build(config([group(["LLM"], [0], ["prefill", "decode"])], cluster), LLM_WALKS, 3)


TWO_HOSTS = ClusterSpec((HostSpec("node-a", "10.0.0.1", (0, 1, 2, 3)), HostSpec("node-b", "10.0.0.2", (0, 1, 2, 3))))


def test_cut_report_lists_cross_host_pairs_with_inter_host_transport():
    p = build(OMNI)
    cut = p.cut_report(TWO_HOSTS, TransportConfig(intra_host="p2p", inter_host="mooncake"))
    assert {(e.src_rank, e.dst_rank) for e in cut} == {
        (s, d) for s, d in p.edge_pairs if (s < 4) != (d < 4)}
    assert all(e.transport == "mooncake" for e in cut)
    assert cut[0] == CutEdge(0, 4, "node-a", "node-b", "mooncake", ("prefill/ENC", "prefill/LLM"),
                             ("decode/LLM", "speech/LLM"))
    one_host = ClusterSpec((HostSpec("h", "10.0.0.1", tuple(range(8))),))
    assert p.cut_report(one_host, TransportConfig()) == []
    with pytest.raises(ValueError, match="lists 2 devices over 1 hosts but the placement is for world_size=8"):
        p.cut_report(ClusterSpec((HostSpec("h", "x", (0, 1)),)), TransportConfig())


def test_describe_shows_replicas_hosts_devices_and_cut():
    text = build(OMNI).describe(TWO_HOSTS, TransportConfig(inter_host="mooncake"))
    assert "speech   LLM    1        2   3,4    node-a:3 node-b:0" in text
    assert "node-a -> node-b: 12 rank pair(s) via mooncake" in text
    assert "0 -> 4  [prefill/ENC prefill/LLM] -> [decode/LLM speech/LLM]" in text


# -- replica choice (docs/architecture.md §5) ------------------------------------------------------------------------------

HOST = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"}
SINGLE = tuple(Replica(i, (r,)) for i, r in enumerate([1, 2, 3, 4]))


def choose(replicas=SINGLE, live=set(HOST), hosts=(), ranks=(), seed=0):
    return choose_replica(replicas, set(live), set(hosts), set(ranks), HOST, random.Random(seed))


def test_dead_ranks_are_never_chosen():
    for seed in range(50):
        assert choose(live={0, 2, 4}, seed=seed).ranks in {(2,), (4,)}
    assert choose(live={0, 5}) is None
    tp = (Replica(0, (1, 2)), Replica(1, (3, 4)))
    for seed in range(20):  # one dead rank kills its whole TP replica
        assert choose(tp, live={0, 1, 2, 3}, seed=seed) == tp[0]


def test_host_preference_comes_before_rank_preference():
    # Only host b is used: its ranks 2 and 3 beat ranks 1 (host a) and 4 (host c).
    assert {choose(hosts={"b"}, seed=s).ranks for s in range(20)} == {(2,), (3,)}
    # Among host b's ranks, the rank already used wins.
    assert choose(hosts={"b"}, ranks={3}).ranks == (3,)
    # Used host beats used rank: rank 1 was used but its host is not; rank 4 is on used host c.
    assert choose(hosts={"c"}, ranks={1}).ranks == (4,)
    tp = (Replica(0, (1, 2)), Replica(1, (3, 4)), Replica(2, (2, 3)))
    assert choose(tp, hosts={"b"}) == tp[2]  # both ranks on a used host beats one


def test_uniform_among_ties():
    counts = Counter(choose(seed=s).ranks[0] for s in range(4000))
    assert set(counts) == {1, 2, 3, 4}
    assert all(800 < c < 1200 for c in counts.values()), counts
    counts = Counter(choose(hosts={"b"}, seed=s).ranks[0] for s in range(2000))
    assert set(counts) == {2, 3} and all(850 < c < 1150 for c in counts.values()), counts
    assert choose(seed=7) == choose(seed=7)  # seeded draws repeat


# -- pair groups only where values can flow (docs/architecture.md §7) ----------------------------------------------

def test_pairs_follow_the_flows_not_every_pair_of_hosting_ranks():
    from mstar_dist.graph.nodes import Edge, GraphNode
    from mstar_dist.graph.partitions import Partition, StreamingEdge
    from mstar_dist.graph.streaming import Fixed
    from mstar_dist.topology.cuts import flows

    llm = GraphNode("LLM", inputs=("x",), outputs=(Edge("codes", "CODEC", stream=True), Edge("kv", persist=True)))
    graphs = {"prefill": llm, "decode": llm, "speech": GraphNode("CODEC", inputs=("codes",))}
    parts = [Partition("text", ("prefill", "decode")), Partition("audio", ("speech",))]
    streams = [StreamingEdge("codes", "text", "audio", "CODEC", Fixed(4))]
    walks = {"prefill": frozenset({"LLM"}), "decode": frozenset({"LLM"}), "speech": frozenset({"CODEC"})}
    groups = [group(["LLM"], [0, 2], ["prefill"]), group(["LLM"], [1, 3], ["decode"]),
              group(["CODEC"], [4], ["speech"])]
    p = Placement.build(config(groups), walks, 5, flows(graphs, parts, streams))
    kv = {(s, d) for s in (0, 2) for d in (1, 3)}
    codes = {(s, 4) for s in (0, 1, 2, 3)}
    assert set(p.edge_pairs) == kv | {(d, s) for s, d in kv} | codes  # never 0<->2, 1<->3 or 4 -> anyone
    assert p.peers_of(4) == (0, 1, 2, 3) and p.peers_of(0) == (1, 3, 4)
    assert len(Placement.build(config(groups), walks, 5).edge_pairs) == 20  # without flows: all 5 x 4


def test_a_rank_in_no_node_group_is_an_error_naming_it():
    """``ranks: [2]`` where ``[1]`` was meant would start a world whose rank 1 loads nothing and only idles."""
    groups = [group(["LLM"], [0], ["prefill"]), group(["LLM"], [2], ["decode"])]
    msg = error(groups, LLM_WALKS, 3)
    assert msg.startswith("p.yaml: node_groups: rank 1 is in no node group (the ranks placed are [0, 2]"), msg
    cluster = {"hosts": [{"name": "a", "addr": "10.0.0.1", "devices": 3}]}
    build(groups, LLM_WALKS, 3, cluster)  # a cluster spec lists its devices itself
