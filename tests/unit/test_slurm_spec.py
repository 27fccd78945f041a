"""launch/slurm/make_cluster_spec.py: the SLURM allocation as the cluster spec (no SLURM needed).

A failure means a job's hosts come out in another order than SLURM_NODEID (ranks on the wrong node), a compressed
node list is expanded wrongly, two node daemons of one machine claim the same device, or a bad allocation
produces a file instead of an error naming what is wrong.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from mstar_dist.config.deployment import load_config

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("make_cluster_spec", REPO / "launch/slurm/make_cluster_spec.py")
mcs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mcs)


@pytest.mark.parametrize("nodelist, names", [
    ("node1", ["node1"]),
    ("gpu[01-03,7],login-a", ["gpu01", "gpu02", "gpu03", "gpu7", "login-a"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("a[9-10]", ["a9", "a10"]),
])
def test_node_lists_expand_in_allocation_order(nodelist, names):
    assert mcs.expand_nodelist(nodelist) == names


@pytest.mark.parametrize("bad", ["a[1-", "a]", "a[x-2]", ""])
def test_malformed_node_lists_are_errors(bad):
    with pytest.raises(ValueError):
        mcs.expand_nodelist(bad)


def test_the_spec_is_a_checked_deployment_with_one_host_per_node(tmp_path):
    out = tmp_path / "job.yaml"
    # names must resolve: this machine's two that do (localhost, and the loopback address literal)
    rc = mcs.main([str(REPO / "launch/configs/smollm2_pd.yaml"), "--nodelist", "localhost,127.0.0.1",
                   "--gpus-per-node", "1", "--out", str(out), "--host-env", "GLOO_SOCKET_IFNAME=lo"])
    assert rc == 0
    cfg = load_config(out)
    hosts = [(h.name, h.addr, h.devices, dict(h.env)) for h in cfg.cluster.hosts]
    # both resolve to 127.0.0.1: one machine, so the second node takes the next device
    assert hosts == [("localhost", "127.0.0.1", (0,), {"GLOO_SOCKET_IFNAME": "lo"}),
                     ("127.0.0.1", "127.0.0.1", (1,), {"GLOO_SOCKET_IFNAME": "lo"})]
    assert mcs.main([str(out), "--head-addr"]) == 0


def test_an_allocation_too_small_for_the_placement_is_an_error(tmp_path, capsys):
    rc = mcs.main([str(REPO / "launch/configs/smollm2_pd.yaml"), "--nodelist", "localhost", "--gpus-per-node", "1",
                   "--out", str(tmp_path / "job.yaml")])
    assert rc == 2 and not (tmp_path / "job.yaml").exists()
    assert "rank 1 is outside the cluster" in capsys.readouterr().err
    rc = mcs.main([str(REPO / "launch/configs/smollm2_pd.yaml"), "--nodelist", "no-such-node.invalid",
                   "--gpus-per-node", "2", "--out", str(tmp_path / "job.yaml")])
    assert rc == 2 and "'no-such-node.invalid' of the allocation does not resolve" in capsys.readouterr().err
