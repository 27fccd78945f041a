"""The dry run (``python -m mstar_dist.serve CFG --dry-run``, no torchrun, no weights) against golden outputs.

It is what an operator reads before starting a cluster: the rank map, placement per walk and replicas, TP groups,
the pair groups every rank will create, every cross-host rank pair with its transport, the cut edges (kept outputs
such as the P/D KV cache among them) and every graph edge that crosses hosts with its transport. A
failure means that report changed: if the change is intended, regenerate with ``MSTAR_UPDATE_GOLDEN=1`` and
review the diff; if not, placement, pair selection or transport choice moved.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from mstar_dist.runtime.cli import main

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"

MIXED = {  # two hosts, a prefill replica on each, decode on the second: shm inside a host, mooncake between
    "model": "smollm2",
    "weights": "~/.cache/mstar_dist/smollm2-135m-instruct",
    "node_groups": [{"node_names": ["LLM"], "ranks": [0, 2], "graph_walks": ["prefill"]},
                    {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"]}],
    "cluster": {"hosts": [
        {"name": "node-a", "addr": "10.0.0.1", "devices": [0], "env": {"GLOO_SOCKET_IFNAME": "eth1"}},
        {"name": "node-b", "addr": "10.0.0.2", "devices": [0, 1], "transfer_device": "mlx5_0"}]},
    "transport": {"intra_host": "shm", "inter_host": "mooncake"},
}

CASES = {
    "smollm2_pd": ("launch/configs/smollm2_pd.yaml", []),
    "smollm2_pd_2host_mooncake": ("launch/configs/smollm2_pd_2host.yaml", ["--inter-host-tensor-protocol", "mooncake"]),
    "smollm2_dp": ("launch/configs/smollm2_dp.yaml", []),
    "speech_split": ("launch/configs/speech_split.yaml", []),
    "image_cfg_parallel": ("launch/configs/image_cfg_parallel.yaml", []),
    "image_split": ("launch/configs/image_split.yaml", []),
    "image_cfg_parallel_2host": ("launch/configs/image_cfg_parallel_2host.yaml", []),
    "qwen3omni": ("launch/configs/qwen3omni.yaml", []),
    "mixed_two_hosts": ("mixed.yaml", []),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_dry_run_matches_golden(name, capsys, monkeypatch, tmp_path):
    config, flags = CASES[name]
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if config == "mixed.yaml":
        (tmp_path / config).write_text(yaml.safe_dump(MIXED))
        monkeypatch.chdir(tmp_path)
    assert main([config, "--dry-run", *flags]) == 0
    out = capsys.readouterr().out
    golden = GOLDEN / f"dry_run_{name}.txt"
    if os.environ.get("MSTAR_UPDATE_GOLDEN"):
        golden.write_text(out)
    assert out == golden.read_text(), f"dry run of {config} changed; see the module docstring"


def test_a_hosts_env_and_transfer_device_are_set_before_its_ranks_initialise(monkeypatch):
    """rank.apply_host_env runs right after identify, before init_process_group: the spec's env wins over what
    the process had, and transfer_device becomes NCCL's NIC unless the env names one."""
    import os

    from mstar_dist.config.cluster import HostSpec
    from mstar_dist.runtime.rank import apply_host_env

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.delenv("NCCL_IB_HCA", raising=False)
    apply_host_env(HostSpec("node-b", "10.0.0.2", (0,), "mlx5_1", {"GLOO_SOCKET_IFNAME": "eth1"}))
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth1" and os.environ["NCCL_IB_HCA"] == "mlx5_1"
    apply_host_env(HostSpec("node-c", "10.0.0.3", (0,), "mlx5_2", {"NCCL_IB_HCA": "mlx5_7"}))
    assert os.environ["NCCL_IB_HCA"] == "mlx5_7"
