"""Cluster spec and rank identity (mstar_dist.config.cluster): a failure here means a process would run as the
wrong rank or on the wrong device, or a torchrun launch that does not match the cluster spec would start
instead of failing with a message naming the host, node rank and both numbers."""

from __future__ import annotations

import pytest

from mstar_dist.config.cluster import (
    ClusterSpec,
    HostSpec,
    RankInfo,
    default_cluster,
    device_for,
    identify,
    parse_cluster,
)

# Two hosts, [3 devices, 2 devices]: node-a holds global ranks 0,1,2 and node-b holds 3,4.
SPEC = ClusterSpec((
    HostSpec("node-a", "10.0.0.1", (0, 1, 2)),
    HostSpec("node-b", "10.0.0.2", (4, 6), transfer_device="mlx5_0", env={"NCCL_SOCKET_IFNAME": "eth1"}),
))


def torchrun_env(rank: int, local_rank: int, group_rank: int, local_world_size: int, world_size: int = 5, **extra):
    env = {
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size), "GROUP_RANK": str(group_rank), "GROUP_WORLD_SIZE": "2",
    }
    env.update({k: str(v) for k, v in extra.items()})
    return env


def test_static_layout_over_hosts_of_different_sizes():
    assert SPEC.world_size == 5
    assert SPEC.ranks_on_host(0) == (0, 1, 2) and SPEC.ranks_on_host(1) == (3, 4)
    assert SPEC.rank_info(4) == RankInfo(4, 1, "node-b", "10.0.0.2", 1, 6)
    assert SPEC.rank_info(2) == RankInfo(2, 0, "node-a", "10.0.0.1", 2, 2)
    assert SPEC.rank_hosts() == {0: "node-a", 1: "node-a", 2: "node-a", 3: "node-b", 4: "node-b"}
    with pytest.raises(ValueError, match=r"global rank 5 is outside the cluster: 2 hosts list 5 devices, global ranks 0..4"):
        SPEC.rank_info(5)
    with pytest.raises(ValueError, match=r"node rank 2 is past the cluster's hosts: it lists 2 hosts"):
        SPEC.ranks_on_host(2)


def test_identify_static_rendezvous_maps_every_process():
    seen = []
    for node_rank, host in enumerate(SPEC.hosts):
        for local_rank in range(len(host.devices)):
            rank = SPEC.first_rank(node_rank) + local_rank
            info = identify(SPEC, torchrun_env(rank, local_rank, node_rank, len(host.devices)))
            assert (info.global_rank, info.node_rank, info.host_name, info.local_rank) == (
                rank, node_rank, host.name, local_rank)
            assert info.device_index == host.devices[local_rank]
            seen.append(info)
    assert [i.global_rank for i in seen] == [0, 1, 2, 3, 4]
    assert [i.device_index for i in seen] == [0, 1, 2, 4, 6]


def test_wrong_world_size_names_both_numbers():
    with pytest.raises(ValueError, match=r"WORLD_SIZE=4 processes but the cluster spec lists 5 devices over 2 hosts"):
        identify(SPEC, torchrun_env(0, 0, 0, 3, world_size=4))


def test_wrong_local_world_size_names_host_node_rank_and_both_numbers():
    with pytest.raises(ValueError) as info:
        identify(SPEC, torchrun_env(3, 0, 1, 4))
    msg = str(info.value)
    assert "cluster host 'node-b' (node rank 1" in msg
    assert "lists 2 devices [4, 6] but torchrun started LOCAL_WORLD_SIZE=4 processes there" in msg


def test_node_rank_past_the_hosts():
    with pytest.raises(ValueError, match=r"node rank 2 \(from GROUP_RANK=2\) is past the cluster's hosts: the spec lists 2"):
        identify(SPEC, torchrun_env(4, 0, 2, 1))
    with pytest.raises(ValueError, match=r"node rank 7 \(from MSTAR_NODE_RANK=7\)"):
        identify(SPEC, torchrun_env(0, 0, 0, 3, MSTAR_NODE_RANK=7))


def test_group_world_size_must_match_host_count():
    env = torchrun_env(0, 0, 0, 3)
    env["GROUP_WORLD_SIZE"] = "3"
    with pytest.raises(ValueError, match=r"GROUP_WORLD_SIZE=3 nodes but the cluster spec lists 2 hosts"):
        identify(SPEC, env)


def test_static_rank_mismatch_is_reported():
    # Hosts are [3, 2]; a torchrun that gave node-b's first process RANK=2 ran node-a with 2 processes.
    with pytest.raises(ValueError) as info:
        identify(SPEC, torchrun_env(2, 0, 1, 2))
    msg = str(info.value)
    assert "cluster host 'node-b' (node rank 1" in msg and "holds global ranks 3..4" in msg
    assert "LOCAL_RANK=0 is global rank 3, but torchrun gave RANK=2" in msg


def test_bad_or_missing_env():
    env = torchrun_env(0, 0, 0, 3)
    del env["LOCAL_WORLD_SIZE"]
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE is not set: start mstar_dist with torchrun"):
        identify(SPEC, env)
    with pytest.raises(ValueError, match=r"RANK='x' is not an integer"):
        identify(SPEC, {**torchrun_env(0, 0, 0, 3), "RANK": "x"})
    with pytest.raises(ValueError, match=r"LOCAL_RANK=3 is outside 0..2"):
        identify(SPEC, torchrun_env(3, 3, 0, 3))


def test_c10d_node_rank_from_override_gives_the_logical_rank():
    # c10d gave node-b GROUP_RANK 0 (so torch RANK 0, 1 there); MSTAR_NODE_RANK says it is spec host 1.
    env = torchrun_env(1, 1, 0, 2, MSTAR_NODE_RANK=1)
    info = identify(SPEC, env)
    assert (info.global_rank, info.host_name, info.device_index) == (4, "node-b", 6)
    # SLURM_NODEID works the same way; MSTAR_NODE_RANK wins over it.
    assert identify(SPEC, torchrun_env(1, 1, 0, 2, SLURM_NODEID=1)).global_rank == 4
    assert identify(SPEC, torchrun_env(1, 1, 0, 2, SLURM_NODEID=0, MSTAR_NODE_RANK=1)).global_rank == 4
    # Every process of a c10d launch finds its logical rank, whatever RANK torchrun gave it.
    infos = [
        identify(SPEC, torchrun_env(r, lr, 0, 2, MSTAR_NODE_RANK=1)) for r, lr in ((0, 0), (1, 1))
    ] + [identify(SPEC, torchrun_env(r, r - 2, 1, 3, MSTAR_NODE_RANK=0)) for r in (2, 3, 4)]
    assert [info.global_rank for info in infos] == [3, 4, 0, 1, 2]


def test_c10d_node_rank_from_hostname_or_address():
    env = torchrun_env(0, 0, 0, 2)  # c10d: node-b came first
    info = identify(SPEC, env, hostnames={"machine-b.example.com", "10.0.0.2", "127.0.0.1"})
    assert (info.host_name, info.global_rank) == ("node-b", 3)
    # Name match (FQDN short form) works too.
    assert identify(SPEC, env, hostnames={"node-b.cluster.local"}).host_name == "node-b"
    # GROUP_RANK's host among the matches: GROUP_RANK stands and RANK is checked.
    assert identify(SPEC, torchrun_env(3, 0, 1, 2), hostnames={"10.0.0.2"}).global_rank == 3
    # No match at all: GROUP_RANK stands.
    assert identify(SPEC, torchrun_env(3, 0, 1, 2), hostnames={"elsewhere"}).global_rank == 3


def test_loopback_names_never_identify_a_host():
    # Both nodes of a one-machine rig see 127.0.0.1 and localhost; that must not move node 1 onto host 0.
    spec = ClusterSpec((HostSpec("node-a", "127.0.0.1", (0,)), HostSpec("node-b", "127.0.0.2", (0,))))
    env = torchrun_env(1, 0, 1, 1, world_size=2)
    info = identify(spec, env, hostnames={"127.0.0.1", "localhost", "::1", "rig"})
    assert (info.host_name, info.global_rank) == ("node-b", 1)


def test_ambiguous_hostname_match_asks_for_override():
    spec = ClusterSpec((
        HostSpec("a", "10.0.0.1", (0,)), HostSpec("b", "10.0.0.1", (1,)), HostSpec("c", "10.0.0.3", (0,)),
    ))
    env = torchrun_env(2, 0, 2, 1, world_size=3)
    env["GROUP_WORLD_SIZE"] = "3"
    with pytest.raises(ValueError, match=r"several cluster hosts, 'a' \(node rank 0\), 'b' \(node rank 1\).*MSTAR_NODE_RANK"):
        identify(spec, env, hostnames={"10.0.0.1"})


def test_no_way_to_tell_the_host():
    env = torchrun_env(0, 0, 0, 3)
    del env["GROUP_RANK"]
    with pytest.raises(ValueError, match="GROUP_RANK, MSTAR_NODE_RANK and SLURM_NODEID are unset"):
        identify(SPEC, env, hostnames={"x"})


def test_default_cluster_and_device_for():
    spec = default_cluster(3)
    assert spec.hosts == (HostSpec("localhost", "127.0.0.1", (0, 1, 2)),)
    assert default_cluster(3, 3) == spec
    with pytest.raises(ValueError, match="WORLD_SIZE=4 processes with LOCAL_WORLD_SIZE=2"):
        default_cluster(4, 2)
    info = spec.rank_info(2)
    assert device_for(info, cuda_available=False) == "cpu"
    assert device_for(SPEC.rank_info(4), cuda_available=True) == "cuda:6"
    assert identify(spec, torchrun_env(1, 1, 0, 3, world_size=3) | {"GROUP_WORLD_SIZE": "1"}).global_rank == 1


def test_spec_errors():
    with pytest.raises(ValueError, match=r"hosts = \[\]: must not be empty"):
        ClusterSpec(())
    with pytest.raises(ValueError, match=r"devices = \[0, 1, 0\]: 0 is listed twice"):
        HostSpec("a", "10.0.0.1", (0, 1, 0))
    with pytest.raises(ValueError, match=r"hosts\[1\]\.name = 'a': duplicates hosts\[0\]\.name"):
        ClusterSpec((HostSpec("a", "10.0.0.1", (0,)), HostSpec("a", "10.0.0.2", (0,))))
    with pytest.raises(ValueError, match=r"hosts\[1\]\.devices = \[1, 2\]: .*same device\(s\) \[1\]"):
        ClusterSpec((HostSpec("a", "10.0.0.1", (0, 1)), HostSpec("b", "10.0.0.1", (1, 2))))
    with pytest.raises(ValueError, match=r"f.yaml: cluster.hosts\[0\]\.devices = -1: must be >= 1"):
        parse_cluster({"hosts": [{"name": "a", "addr": "x", "devices": -1}]}, "f.yaml")


def test_parse_cluster_round_trips():
    assert parse_cluster(SPEC.to_dict()) == SPEC
    spec = parse_cluster({"hosts": [{"name": "a", "addr": "h", "devices": 2}]}, "f.yaml")
    assert spec.hosts[0].devices == (0, 1)


def test_a_host_behind_nat_or_a_firewall_gets_an_advertised_address_and_a_control_port_range():
    """``advertise_addr`` beside the bind address and ``control_ports`` for the control plane: what other hosts
    connect to, and the only ports a firewall has to open. A failure means a cluster behind NAT publishes an address
    nobody can reach, or a range too small for the host's processes passes until a rank cannot bind."""
    spec = parse_cluster({"hosts": [{"name": "a", "addr": "0.0.0.0", "advertise_addr": "203.0.113.7", "devices": 2,
                                     "control_ports": [41000, 41009]}]}, "f.yaml")
    host = spec.hosts[0]
    assert (host.reached_at, host.control_ports) == ("203.0.113.7", (41000, 41009))
    assert parse_cluster(spec.to_dict()) == spec
    for ports, words in (([41009, 41000], "the first port must not be above the second"),
                         ([41000, 41001], "holds 2 port(s); this host runs 2 rank(s) and maybe the front end: give "
                                          "at least 3"),
                         ("41000-41009", "must be [lo, hi]"), ([0, 10], "control_ports[0] = 0: must be >= 1")):
        with pytest.raises(ValueError) as info:
            parse_cluster({"hosts": [{"name": "a", "addr": "h", "devices": 2, "control_ports": ports}]}, "f.yaml")
        assert "cluster.hosts[0].control_ports" in str(info.value) and words in str(info.value), str(info.value)


def test_a_control_socket_binds_in_its_port_range_and_publishes_the_advertised_address():
    from mstar_dist.control.channel import ControlChannel
    from tests.helpers import free_port

    lo = free_port()
    with pytest.raises(ValueError, match="is a wildcard"):
        ControlChannel("rank1", "0.0.0.0", local=False)
    first = ControlChannel("rank1", "0.0.0.0", local=False, advertise_addr="127.0.0.1", port_range=(lo, lo))
    try:
        assert first.endpoint == f"tcp://127.0.0.1:{lo}"
        with pytest.raises(OSError, match=rf"rank2: no free port for the control plane in {lo}-{lo} .*control_ports"):
            ControlChannel("rank2", "127.0.0.1", local=False, port_range=(lo, lo))
    finally:
        first.close()
