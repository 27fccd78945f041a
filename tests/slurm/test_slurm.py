"""A two-node CPU deployment submitted to a real SLURM on this machine (tests/slurm/setup_cluster.sh: slurmctld and
two ``slurmd -N`` node daemons) with ``sbatch launch/slurm/serve.sbatch``, queried over HTTP, then scancelled.

A failure means the SLURM script does not bring a multi-node deployment up (cluster spec from the allocation, one
task per node, torchrun inside, rendezvous on the first node), the deployment answers wrongly, or scancel leaves
processes running. Skips only when SLURM cannot be installed here (no apt-get), saying so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.server import REPO, WEIGHTS, descendants
from tests.helpers import free_port

SETUP = REPO / "tests/slurm/setup_cluster.sh"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm") / "cluster"
    up = subprocess.run(["bash", str(SETUP), "up", str(state)], capture_output=True, text=True, timeout=600)
    if up.returncode == 3:
        pytest.skip(f"SLURM cannot be set up here: {up.stderr.strip()}")
    assert up.returncode == 0, up.stderr + up.stdout
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}
    yield env
    subprocess.run(["bash", str(SETUP), "down", str(state)], capture_output=True, timeout=120)


def _procs_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                pids.append(int(entry))
    return pids


def test_sbatch_serves_a_two_node_deployment_and_scancel_leaves_nothing(slurm, tmp_path):
    data = yaml.safe_load((REPO / "launch/configs/smollm2_pd.yaml").read_text())
    data["weights"] = WEIGHTS
    config = tmp_path / "pd.yaml"
    config.write_text(yaml.safe_dump(data))
    port = free_port()
    env = {**slurm, "PYTHON": sys.executable, "MSTAR_JOB_DIR": str(tmp_path), "STARTUP_TIMEOUT": "240",
           "MASTER_PORT": str(free_port(span=2))}
    out = subprocess.run(["sbatch", "--parsable", "-N", "2", f"--output={tmp_path}/job-%j.log",
                          str(REPO / "launch/slurm/serve.sbatch"), str(config), "--port", str(port)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip().split(";")[0]
    log = tmp_path / f"job-{job}.log"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True,
                                   text=True).stdout.strip()
            assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job} is {state!r}:\n{_tail(log)}"
            assert time.monotonic() < deadline, f"not healthy within 240 s:\n{_tail(log)}"
            time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
            "model": "smollm2", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        text = _tail(log, 20000)
        assert f"job {job} on " in text and "all 2 hosts joined" in text
        assert re.search(r"\[rank 1 host \S+\] INFO", text) and "0 -> 1" in text  # both nodes' ranks log; the
        # cross-host pair is listed
        spec = tmp_path / f"job-{job}.yaml"
        running = _procs_mentioning(str(spec))
        assert running, "the deployment's processes run the job's spec"
    finally:
        subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True).stdout.strip()
        left = _procs_mentioning(f"job-{job}.yaml")
        if not queued and not left:
            break
        time.sleep(0.5)
    assert not queued, f"job {job} is still queued: {queued}"
    assert not left, f"processes of job {job} still running after scancel: {left}"


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no job log yet)"
