"""Deployment config parsing (mstar_dist.config.deployment): a failure here means a user's YAML mistake is
accepted, or reported without the key path, value or file name they need to fix it, or a valid file no longer
loads (the example configs in launch/configs/ included)."""

from __future__ import annotations

import copy
import os
import pickle
from pathlib import Path

import pytest
import yaml

from mstar_dist.config.cluster import ClusterSpec, HostSpec
from mstar_dist.config.deployment import (
    DeploymentConfig,
    Limits,
    NodeGroup,
    ServerConfig,
    TransportConfig,
    load_config,
    parse_config,
)
from mstar_dist.config.schema import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "launch" / "configs"

BASE = {
    "model": "smollm2",
    "weights": "~/w",
    "node_groups": [
        {"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill"]},
        {"node_names": ["LLM"], "ranks": [1, 2, 3, 4], "tp_size": 2, "graph_walks": ["decode"]},
    ],
}


def with_(path: str, value, base=BASE) -> dict:
    """A deep copy of `base` with the value at dotted/indexed `path` set (``node_groups.1.tp_size``)."""
    data = copy.deepcopy(base)
    *parents, last = path.split(".")
    node = data
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


def error(data, source="deploy.yaml") -> str:
    with pytest.raises(ValueError) as info:
        parse_config(data, source)
    return str(info.value)


def test_minimal_config_gets_defaults_and_expands_weights():
    cfg = parse_config(BASE, "deploy.yaml")
    assert cfg.model == "smollm2"
    assert cfg.weights == os.path.expanduser("~/w") and not cfg.weights.startswith("~")
    assert cfg.node_groups[1] == NodeGroup(("LLM",), (1, 2, 3, 4), ("decode",), 2)
    assert cfg.node_groups[1].replica_count == 2
    assert cfg.cluster is None
    assert cfg.transport == TransportConfig("p2p", "p2p", 65536)
    assert cfg.limits == Limits(64, 600.0, 2048)
    assert cfg.server == ServerConfig("127.0.0.1", 8000)
    assert cfg.source == "deploy.yaml"


def test_full_config_round_trips():
    data = dict(
        BASE,
        model_kwargs={"dtype": "bfloat16", "n_layers": 2},
        cluster={"hosts": [
            {"name": "node-a", "addr": "10.0.0.1", "devices": 3},
            {"name": "node-b", "addr": "10.0.0.2", "devices": [0, 1], "transfer_device": "mlx5_0",
             "env": {"NCCL_SOCKET_IFNAME": "eth1"}},
        ]},
        transport={"intra_host": "p2p", "inter_host": "mooncake", "inline_max_bytes": 0, "spin_us": 50},
        limits={"max_concurrent_requests": 8, "request_timeout_s": 30, "max_tokens": 100},
        server={"host": "0.0.0.0", "port": 9000},
    )
    cfg = parse_config(data, "a.yaml")
    assert cfg.cluster.hosts[0].devices == (0, 1, 2)
    assert cfg.transport.spin_s("cuda") == cfg.transport.spin_s("cpu") == 50e-6
    assert parse_config(BASE, "c.yaml").transport.spin_s("cuda") == 200e-6  # unset: GPU ranks spin, CPU ranks not
    assert parse_config(BASE, "c.yaml").transport.spin_s("cpu") == 0
    assert cfg.limits.request_timeout_s == 30.0 and isinstance(cfg.limits.request_timeout_s, float)
    again = parse_config(yaml.safe_load(yaml.safe_dump(cfg.to_dict())), "b.yaml")
    assert again == cfg
    assert again.to_dict() == cfg.to_dict()
    hash(cfg)  # frozen and hashable despite its dict fields


def test_load_config_reads_file_and_names_it(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(with_("node_groups.1.tp_size", 3)))
    with pytest.raises(ValueError) as info:
        load_config(path)
    msg = str(info.value)
    assert str(path) in msg and "node_groups[1].tp_size = 3" in msg and "len(ranks)=4" in msg
    path.write_text("")
    with pytest.raises(ValueError, match="mine.yaml: the file is empty"):
        load_config(path)
    path.write_text("model: [unclosed")
    with pytest.raises(ValueError, match="mine.yaml: not valid YAML"):
        load_config(path)


@pytest.mark.parametrize(
    "data, expected",
    [
        ({**BASE, "modle": "x"}, ["deploy.yaml", "modle: unknown key", "allowed here"]),
        ({k: v for k, v in BASE.items() if k != "model"}, ["deploy.yaml", "model: missing required key"]),
        ({k: v for k, v in BASE.items() if k != "node_groups"}, ["node_groups: missing required key"]),
        (with_("node_groups.1.tp_szie", 2), ["node_groups[1].tp_szie: unknown key"]),
        (with_("node_groups.0", {"node_names": ["LLM"], "ranks": [0]}), ["node_groups[0].graph_walks: missing"]),
        (with_("node_groups.1.tp_size", 0), ["node_groups[1].tp_size = 0", "must be >= 1"]),
        (with_("node_groups.1.tp_size", -2), ["node_groups[1].tp_size = -2"]),
        (with_("node_groups.1.tp_size", 3), ["node_groups[1].tp_size = 3", "len(ranks)=4", "tp_size=3"]),
        (with_("node_groups.1.tp_size", "2"), ["node_groups[1].tp_size = '2'", "must be an integer, got str"]),
        (with_("node_groups.1.tp_size", True), ["node_groups[1].tp_size = True", "integer, got bool"]),
        (with_("node_groups.0.cpu_threads", 0), ["node_groups[0].cpu_threads = 0", ">= 1"]),
        (with_("node_groups.1.ranks", [1, 2, 1, 4]), ["node_groups[1].ranks = [1, 2, 1, 4]", "1 is listed twice"]),
        (with_("node_groups.1.ranks", [1, -2]), ["node_groups[1].ranks[1] = -2", "must be >= 0"]),
        (with_("node_groups.1.ranks", []), ["node_groups[1].ranks = []", "must not be empty"]),
        (with_("node_groups.0.node_names", []), ["node_groups[0].node_names = []", "must not be empty"]),
        (with_("node_groups.0.node_names", "LLM"), ["node_groups[0].node_names = 'LLM'", "must be a list"]),
        (with_("node_groups.0.graph_walks", ["prefill", ""]), ["node_groups[0].graph_walks[1] = ''", "empty"]),
        (with_("node_groups", []), ["node_groups = []", "must not be empty"]),
        (with_("node_groups", {"a": 1}), ["node_groups = {'a': 1}", "must be a list"]),
        (with_("model", 3), ["model = 3", "must be a string"]),
        (with_("model_kwargs", [1]), ["model_kwargs = [1]", "must be a mapping"]),
        (with_("weights", 5), ["weights = 5", "must be a string"]),
        (with_("transport.intra_host", "nccl"), ["transport.intra_host = 'nccl'", "p2p | mooncake"]),
        (with_("transport.inter_host", "tcp"), ["transport.inter_host = 'tcp'", "p2p | mooncake"]),
        (with_("transport.inline_max_bytes", -1), ["transport.inline_max_bytes = -1", ">= 0"]),
        (with_("transport.mode", "x"), ["transport.mode: unknown key"]),
        (with_("transport.spin_us", -5), ["transport.spin_us = -5", ">= 0"]),
        (with_("limits.max_concurrent_requests", 0), ["limits.max_concurrent_requests = 0", ">= 1"]),
        (with_("limits.request_timeout_s", 0), ["limits.request_timeout_s = 0", "> 0"]),
        (with_("limits.request_timeout_s", -1.5), ["limits.request_timeout_s = -1.5"]),
        (with_("limits.max_tokens", 0), ["limits.max_tokens = 0"]),
        (with_("server.port", 0), ["server.port = 0", ">= 1"]),
        (with_("server.port", 70000), ["server.port = 70000", "<= 65535"]),
        (with_("server.host", ""), ["server.host = ''", "empty"]),
        (with_("server", [1]), ["server = [1]", "must be a mapping"]),
    ],
)
def test_mistakes_name_file_key_path_and_value(data, expected):
    msg = error(data)
    assert msg.startswith("deploy.yaml: "), msg
    for part in expected:
        assert part in msg, (part, msg)


def test_cluster_mistakes_name_key_path():
    hosts = [{"name": "a", "addr": "10.0.0.1", "devices": 3}, {"name": "b", "addr": "10.0.0.2", "devices": [0, 1]}]
    ok = dict(BASE, cluster={"hosts": hosts})
    assert parse_config(ok, "d.yaml").cluster.world_size == 5
    cases = [
        (with_("cluster.hosts.1.devices", [0, 0], ok), ["cluster.hosts[1].devices = [0, 0]", "0 is listed twice"]),
        (with_("cluster.hosts.1.devices", 0, ok), ["cluster.hosts[1].devices = 0", ">= 1"]),
        (with_("cluster.hosts.1.devices", [], ok), ["cluster.hosts[1].devices = []", "must not be empty"]),
        (with_("cluster.hosts.1.name", "a", ok), ["cluster.hosts[1].name = 'a'", "duplicates hosts[0].name"]),
        (with_("cluster.hosts.1.addr", "10.0.0.1", ok), ["cluster.hosts[1].devices = [0, 1]", "same device(s) [0, 1]"]),
        (with_("cluster.hosts.1.gpus", 2, ok), ["cluster.hosts[1].gpus: unknown key"]),
        (with_("cluster.hosts.1.env", {"NCCL_IB_DISABLE": 1}, ok), ["cluster.hosts[1].env.NCCL_IB_DISABLE = 1"]),
        (with_("cluster.hosts", [], ok), ["cluster.hosts = []", "must not be empty"]),
        (with_("cluster.nodes", [], ok), ["cluster.nodes: unknown key"]),
        (with_("node_groups.1.ranks", [1, 2, 3, 4, 5, 6], ok),
         ["node_groups[1].ranks = [1, 2, 3, 4, 5, 6]", "rank 5 is outside the cluster", "5 devices", "0..4"]),
    ]
    for data, expected in cases:
        msg = error(data, "d.yaml")
        assert msg.startswith("d.yaml: "), msg
        for part in expected:
            assert part in msg, (part, msg)


def test_same_addr_with_disjoint_devices_is_allowed():
    hosts = [{"name": "a", "addr": "10.0.0.1", "devices": [0, 1]}, {"name": "b", "addr": "10.0.0.1", "devices": [2]}]
    cfg = parse_config(dict(BASE, cluster={"hosts": hosts}, node_groups=BASE["node_groups"][:1]), "d.yaml")
    assert cfg.cluster.world_size == 3


def test_with_overrides_replaces_only_given_values_and_checks_them():
    cfg = parse_config(BASE, "deploy.yaml")
    assert cfg.with_overrides() == cfg
    new = cfg.with_overrides(port=9001, request_timeout_s=5)
    assert new.server == ServerConfig("127.0.0.1", 9001)
    assert new.limits == Limits(64, 5.0, 2048)
    assert cfg.server.port == 8000  # the original is untouched
    new = cfg.with_overrides(host="0.0.0.0", max_concurrent_requests=3)
    assert (new.server.host, new.limits.max_concurrent_requests) == ("0.0.0.0", 3)
    with pytest.raises(ValueError, match=r"server\.port = 0"):
        cfg.with_overrides(port=0)
    with pytest.raises(ValueError, match=r"limits\.max_concurrent_requests = -1"):
        cfg.with_overrides(max_concurrent_requests=-1)


def test_dataclasses_check_their_fields_when_built_in_code():
    with pytest.raises(ValueError, match=r"tp_size = 2: len\(ranks\)=3"):
        NodeGroup(("LLM",), (0, 1, 2), ("decode",), 2)
    with pytest.raises(ValueError, match="intra_host = 'rdma'"):
        TransportConfig(intra_host="rdma")
    with pytest.raises(ValueError, match=r"<config>: node_groups = \[\]: must not be empty"):
        DeploymentConfig(model="m", node_groups=())
    cfg = DeploymentConfig(model="m", node_groups=(NodeGroup(["A"], [0], ["w"]),))
    assert cfg.node_groups[0].node_names == ("A",) and cfg.node_groups[0].ranks == (0,)
    cluster = ClusterSpec((HostSpec("a", "10.0.0.1", (0,)),))
    with pytest.raises(ValueError, match=r"node_groups\[0\]\.ranks = \[1\]: rank 1 is outside the cluster"):
        DeploymentConfig(model="m", node_groups=(NodeGroup(["A"], [1], ["w"]),), cluster=cluster)


def test_resolve_cluster_defaults_to_one_local_host():
    cfg = parse_config(BASE, "deploy.yaml")
    spec = cfg.resolve_cluster(5)
    assert [(h.name, h.addr, h.devices) for h in spec.hosts] == [("localhost", "127.0.0.1", (0, 1, 2, 3, 4))]
    with pytest.raises(ValueError, match="WORLD_SIZE=4 .* LOCAL_WORLD_SIZE=2"):
        cfg.resolve_cluster(4, 2)


def test_config_error_is_a_picklable_value_error():
    with pytest.raises(ConfigError) as info:
        parse_config(with_("server.port", -1), "deploy.yaml")
    err = pickle.loads(pickle.dumps(info.value))
    assert isinstance(err, ValueError) and str(err) == str(info.value) and err.key == "server.port"


@pytest.mark.parametrize("name", ["smollm2_pd.yaml", "smollm2_single.yaml", "smollm2_dp.yaml", "smollm2_pd_2host.yaml"])
def test_example_configs_load(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.model == "smollm2"
    assert cfg.weights == os.path.expanduser("~/.cache/mstar_dist/smollm2-135m-instruct")


def test_every_key_of_the_annotated_example_is_commented():
    lines = (CONFIGS / "smollm2_pd.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if ":" in line and not line.lstrip().startswith("#") and "#" not in line:
            assert lines[i - 1].lstrip().startswith("#"), f"uncommented key in smollm2_pd.yaml: {line!r}"


def test_cpu_threads_default_to_an_even_share_and_groups_can_ask_for_more():
    from mstar_dist.runtime.rank import cpu_threads_for

    cfg = parse_config(BASE, "deploy.yaml")
    assert cpu_threads_for(cfg, 1, ranks_on_host=5, cores=16) == 3
    assert cpu_threads_for(cfg, 1, ranks_on_host=5, cores=2) == 1  # never 0
    asked = parse_config(with_("node_groups.1.cpu_threads", 4), "deploy.yaml")
    assert cpu_threads_for(asked, 2, ranks_on_host=5, cores=2) == 4
    assert cpu_threads_for(asked, 0, ranks_on_host=5, cores=10) == 2
    assert parse_config(asked.to_dict(), "deploy.yaml") == asked


# ------------------------------------------------------------------------------------------------- media


def test_media_limits_have_defaults_and_round_trip():
    from mstar_dist.config.deployment import MediaConfig

    cfg = parse_config(BASE, "deploy.yaml")
    assert cfg.media == MediaConfig(max_item_bytes=10 << 20, max_items=16, max_image_pixels=4096 * 4096,
                                    max_audio_seconds=300.0, allowed_domains=(), fetch_timeout_s=10.0)
    data = with_("media", {"max_items": 3, "max_audio_seconds": 30, "allowed_domains": ["img.example.com", "cdn.x.io"],
                           "fetch_timeout_s": 2.5})
    cfg = parse_config(data, "deploy.yaml")
    assert (cfg.media.max_items, cfg.media.max_audio_seconds, cfg.media.allowed_domains) == (
        3, 30.0, ("img.example.com", "cdn.x.io"))
    assert parse_config(cfg.to_dict(), "deploy.yaml") == cfg
    assert yaml.safe_load(yaml.safe_dump(cfg.to_dict())) == cfg.to_dict()


@pytest.mark.parametrize("key,value,expected", [
    ("max_item_bytes", 0, "media.max_item_bytes = 0: must be >= 1"),
    ("max_items", 5000, "media.max_items = 5000: must be <= 1024"),
    ("max_items", "8", "media.max_items = '8': must be an integer"),
    ("max_image_pixels", 1.5, "media.max_image_pixels = 1.5: must be an integer"),
    ("max_audio_seconds", -1, "media.max_audio_seconds = -1: must be a finite number > 0"),
    ("fetch_timeout_s", 0, "media.fetch_timeout_s = 0: must be a finite number > 0"),
    ("allowed_domains", "img.example.com", "media.allowed_domains = 'img.example.com': must be a list of host names"),
    ("allowed_domains", ["https://img.example.com"], "media.allowed_domains[0] = 'https://img.example.com': must be"),
    ("allowed_domains", ["*.example.com"], "media.allowed_domains[0] = '*.example.com'"),
    ("allowed_domains", ["Img.Example.com"], "lower-case host name"),
    ("allowed_domains", ["a.io", "a.io"], "'a.io' is listed twice"),
    ("max_pixels", 10, "media.max_pixels: unknown key 'max_pixels' (did you mean 'max_image_pixels'?"),
])
def test_media_mistakes_name_the_key_and_value(key, value, expected):
    assert expected in error(with_(f"media.{key}", value))


def test_the_allowed_media_domains_flag_overrides_the_config_and_is_checked():
    from mstar_dist.runtime.cli import parse_args

    args = parse_args(["x.yaml", "--allowed-media-domains", "A.example.com, b.example.com",
                       "--allowed-media-domains", "c.example.org"])
    assert args.allowed_media_domains == ["a.example.com", "b.example.com", "c.example.org"]
    assert parse_args(["x.yaml"]).allowed_media_domains is None
    cfg = parse_config(with_("media.allowed_domains", ["old.example.com"]), "deploy.yaml")
    assert cfg.with_overrides().media.allowed_domains == ("old.example.com",)
    assert cfg.with_overrides(allowed_media_domains=args.allowed_media_domains).media.allowed_domains == (
        "a.example.com", "b.example.com", "c.example.org")
    with pytest.raises(ValueError, match=r"command line \(--allowed-media-domains\).*media.allowed_domains\[0\]"):
        cfg.with_overrides(allowed_media_domains=["http://x"])
