"""Launching the way clusters do: two torchrun invocations (two hosts on loopback, static rendezvous), and
startup failures. A failure here means multi-host deployments do not come up, or a broken rank leaves the
others hanging or exiting 0 instead of failing everywhere with a message naming the rank, host and cause.
"""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest
import yaml

from tests.e2e.server import REPO, Server


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_two_hosts_on_loopback_serve_the_pd_split(rdzv):
    server = Server(REPO / "launch/configs/smollm2_pd_2host.yaml", 0, nodes=[1, 1], rdzv=rdzv)
    try:
        r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={
            "model": "smollm2", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
        log = server.log()
        assert "node-a -> node-b: 1 rank pair(s) via p2p" in log  # the cross-host edge report
    finally:
        assert server.stop_clean(2), server.log()


def test_a_rank_that_fails_to_load_stops_every_rank_with_its_name(tmp_path):
    with pytest.raises(RuntimeError) as info:
        Server(REPO / "tests/toy_deploy.yaml", 2, overrides={"model_kwargs": {"fail_load": "COUNT"}},
               startup_timeout=60)
    log = str(info.value)
    assert "rank 1 on host localhost failed to load: RuntimeError: injected load failure of COUNT" in log
    assert "exits with status 1" in log and "exits with status 0" not in log


def test_config_mistake_is_a_clear_error_without_traceback(tmp_path):
    data = yaml.safe_load((REPO / "launch/configs/smollm2_pd.yaml").read_text())
    data["node_groups"][1]["tp_size"] = 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    out = subprocess.run([sys.executable, "-m", "mstar_dist.serve", str(bad), "--dry-run"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, env={"WORLD_SIZE": "2", "PATH": "/usr/bin"})
    assert out.returncode == 2
    assert "node_groups[1].tp_size = 0" in out.stderr and "Traceback" not in out.stderr


def test_dry_run_names_the_transport_of_every_cross_host_pair(tmp_path):
    data = yaml.safe_load((REPO / "launch/configs/smollm2_pd_2host.yaml").read_text())
    data["transport"]["inter_host"] = "mooncake"
    cfg = tmp_path / "mooncake.yaml"
    cfg.write_text(yaml.safe_dump(data))
    out = subprocess.run([sys.executable, "-m", "mstar_dist.serve", str(cfg), "--dry-run"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin"})
    assert out.returncode == 0, out.stderr
    assert "node-a -> node-b: 1 rank pair(s) via mooncake" in out.stdout
    flag = subprocess.run([sys.executable, "-m", "mstar_dist.serve", str(cfg), "--dry-run",
                           "--inter-host-tensor-protocol", "shm"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin"})
    assert "node-a -> node-b: 1 rank pair(s) via shm" in flag.stdout, flag.stderr


@pytest.mark.parametrize("node_rank, words", [
    (0, "host 'node-b' (node rank 1 of 2, addr 127.0.0.2, global ranks 1..1) never joined within 4 s"),
    (1, "cannot reach host 'node-a' (node rank 0) at 127.0.0.1"),
])
def test_a_host_that_never_joins_is_named_within_the_startup_timeout(node_rank, words):
    import os
    import time

    from tests.helpers import free_port

    t0 = time.monotonic()
    out = subprocess.run(["bash", str(REPO / "launch/serve_node.sh"), str(REPO / "launch/configs/smollm2_pd_2host.yaml")],
                         cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "NODE_RANK": str(node_rank), "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": str(free_port(span=2)), "STARTUP_TIMEOUT": "4", "PYTHON": sys.executable})
    elapsed = time.monotonic() - t0
    assert out.returncode != 0 and words in out.stderr, out.stderr
    assert elapsed < 4 + 5 + 8, f"took {elapsed:.1f} s: the startup timeout plus a few seconds"


def test_a_join_whose_port_another_service_holds_ends_within_its_bound():
    """A node's join check connects to node 0's port + 1; when some other service holds that port, the store client
    waits for an answer that never comes (until the service closes the connection). The check must end on its own,
    exit 1 and say which port to change, within its bound (the grace shortened here to keep the test short)."""
    import socket
    import time

    from tests.helpers import free_port

    port = free_port()
    with socket.socket() as other:  # accepts connections (the kernel's backlog) and never answers
        other.bind(("127.0.0.1", port))
        other.listen(8)
        code = "import sys; import mstar_dist.distributed.join as j; j.GRACE_S = 0.5; sys.exit(j.main(sys.argv[1:]))"
        t0 = time.monotonic()
        argv = [str(REPO / "launch/configs/smollm2_pd_2host.yaml"), "--node-rank", "1", "--master-addr", "127.0.0.1",
                "--port", str(port), "--timeout", "0.5"]
        out = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True, text=True, timeout=60)
        elapsed = time.monotonic() - t0
    assert out.returncode == 1, out.stderr
    assert f"127.0.0.1:{port} did not finish within 2.5 s" in out.stderr and "MASTER_PORT" in out.stderr, out.stderr
    assert elapsed < 2.5 + 15, f"took {elapsed:.1f} s"  # the bound, plus starting Python and importing torch


def _torchrun_two_hosts(configs: list, port: int, *, timeout: float = 180) -> list[tuple[int, str, float]]:
    """Plain ``torchrun --nnodes 2`` twice (static rendezvous on loopback), host k with ``configs[k]``; each
    (exit status, output, when it exited: monotonic)."""
    import os
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(k),
                               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "-m", "mstar_dist.serve", str(cfg), "--port", str(port + 1),
                               "--startup-timeout", "120"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for k, cfg in enumerate(configs)]
    out: list = [None, None]
    deadline = time.monotonic() + timeout
    try:
        while any(o is None for o in out) and time.monotonic() < deadline:
            for k, proc in enumerate(procs):
                if out[k] is None and proc.poll() is not None:
                    out[k] = (proc.returncode, proc.stdout.read(), time.monotonic())
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                import signal as sig

                os.killpg(proc.pid, sig.SIGKILL)
                proc.wait(10)
    assert all(o is not None for o in out), f"a host did not exit within {timeout} s"
    return out


def test_a_load_failure_on_another_host_is_named_on_every_host_within_seconds(tmp_path):
    """Host b's copy of the config names a weights directory that does not exist: host b's rank fails validating
    it, and host a's rank, waiting in the rendezvous, must stop within seconds naming the rank, its host and the
    cause, not after --startup-timeout with a raw DistStoreError."""
    from tests.e2e.server import WEIGHTS
    from tests.helpers import free_port

    data = yaml.safe_load((REPO / "launch/configs/smollm2_pd_2host.yaml").read_text())
    data["weights"] = WEIGHTS
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(data))
    data["weights"] = str(tmp_path / "no-such-weights")
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(data))
    (rc_a, out_a, t_a), (rc_b, out_b, t_b) = _torchrun_two_hosts([tmp_path / "a.yaml", tmp_path / "b.yaml"],
                                                                 free_port(span=2))
    assert rc_b != 0 and "no-such-weights': no such directory" in out_b, out_b[-3000:]
    assert rc_a != 0, out_a[-3000:]
    assert "rank 1 on host node-b" in out_a and "no-such-weights': no such directory" in out_a, out_a[-3000:]
    assert t_a - t_b < 10, f"host a exited {t_a - t_b:.1f} s after host b"
    for out in (out_a, out_b):  # plain torchrun prints its own ChildFailedError summary; nothing of ours is raw
        assert "DistStoreError" not in out and not re.search(r'File ".*/mstar_dist/', out), out[-5000:]
