"""What a new user meets first, through the real scripts: ``launch/serve.sh`` with a config path relative to
their own folder, its install step skipped when nothing changed, one clear line (no traceback, not once per
rank) for a missing file, a flag without a config, a misspelled key, a missing weights directory or a port in
use; and a rank stopped with SIGTERM failing its requests at once instead of after ``limits.rank_timeout_s``.

The module's one server is the toy model (2 ranks) started by ``serve.sh`` with ``MSTAR_NO_INSTALL`` on this
test's venv; ``install.sh``'s stamp logic runs against a stub venv whose python records pip calls, so nothing is
ever installed here.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.server import REPO, descendants, metric, wait_for
from tests.helpers import free_port

SERVE = REPO / "launch/serve.sh"


@pytest.fixture(scope="module")
def venv() -> Path:
    """The venv running these tests; serve.sh uses it as it is (MSTAR_NO_INSTALL: nothing is installed)."""
    return Path(sys.prefix)


def env_for(venv: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "MSTAR_VENV": str(venv), "MSTAR_NO_INSTALL": "1", "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", **extra}


def run(args: list[str], venv: Path, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SERVE), *args], cwd=cwd, env=env_for(venv), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def toy(venv, tmp_path_factory):
    """The toy deployment started by serve.sh from another folder, with the config path relative to it."""
    cwd = REPO / "tests"
    port = free_port()
    log_path = tmp_path_factory.mktemp("log") / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["bash", str(SERVE), "toy_deploy.yaml", "--port", str(port)], cwd=cwd,
                                env=env_for(venv, MASTER_PORT=str(free_port())), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, log_path.read_text()
            return _healthy(url)

        wait_for(up, 120, "serve.sh answering /health", interval=0.25)
        yield proc, url, log_path
    finally:
        family = [proc.pid, *descendants(proc.pid)]
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        for pid in family:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def rank_pid(root: int, rank: int) -> int:
    for pid in descendants(root):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"mstar_dist.serve" in cmdline:
            return pid
    raise AssertionError(f"no process of rank {rank} under {root}")


STUB_PYTHON = """#!/bin/sh
# stands in for a venv's python: imports succeed, any pip call is recorded (and fails)
case "$*" in *pip*) echo "$*" >> "$(dirname "$0")/../pip-calls"; exit 1 ;; esac
exit 0
"""


@pytest.mark.parametrize("stamp_matches", [True, False])
def test_install_skips_pip_exactly_when_nothing_changed(tmp_path, stamp_matches):
    fake = tmp_path / "venv"
    (fake / "bin").mkdir(parents=True)
    (fake / "bin/python").write_text(STUB_PYTHON)
    (fake / "bin/python").chmod(0o755)
    digest = hashlib.sha256((REPO / "pyproject.toml").read_bytes() + (REPO / "launch/install.sh").read_bytes()
                            + b"\n").hexdigest()
    (fake / ".mstar-install.sha256").write_text((digest if stamp_matches else "0" * 64) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "MSTAR_NO_INSTALL"} | {"MSTAR_VENV": str(fake)}
    out = subprocess.run(["bash", str(REPO / "launch/install.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    if stamp_matches:
        assert out.returncode == 0 and out.stdout.strip() == str(fake), out.stderr
        assert not (fake / "pip-calls").exists()
    else:
        assert "pip install" in (fake / "pip-calls").read_text()  # changed: it installs (the stub refuses)


@pytest.mark.parametrize("args,needle", [
    (["no/such.yaml"], "no/such.yaml: no such file"),
    (["--port", "8001"], "the first argument must be a deployment YAML, got the flag '--port'"),
])
def test_a_missing_config_or_flags_without_one_are_one_clear_line(venv, tmp_path, args, needle):
    out = run(args, venv, tmp_path)
    assert out.returncode == 2 and needle in out.stderr and "usage:" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_misspelled_key_is_named_once_before_any_rank_starts(venv, tmp_path):
    data = yaml.safe_load((REPO / "tests/toy_deploy.yaml").read_text())
    data["node_group"] = data.pop("node_groups")
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(data))
    out = run(["typo.yaml"], venv, tmp_path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "node_group: unknown key 'node_group' (did you mean 'node_groups'?" in lines[0], lines
    assert "Traceback" not in out.stderr and "KeyError" not in out.stderr and "rank ?" not in out.stderr


def test_a_weights_path_that_does_not_exist_is_an_error_naming_the_key(venv, tmp_path):
    data = yaml.safe_load((REPO / "launch/configs/smollm2_single.yaml").read_text())
    data["weights"] = str(tmp_path / "typo-weights")
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(data))
    out = run(["w.yaml"], venv, tmp_path)
    assert out.returncode == 2 and "weights = " in out.stderr and "typo-weights': no such directory" in out.stderr
    assert "only the default ~/.cache/mstar_dist/smollm2-135m-instruct is prepared" in out.stderr
    assert not (tmp_path / "typo-weights").exists()


def test_a_port_in_use_is_reported_before_any_rank_loads(venv, tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        out = subprocess.run(["bash", str(SERVE), str(REPO / "tests/toy_deploy.yaml"), "--port", str(port)],
                             cwd=tmp_path, env=env_for(venv, MASTER_PORT=str(free_port())), capture_output=True,
                             text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and f"cannot bind HTTP server to 127.0.0.1:{port} (port already in use)" in text
    assert "loaded ADD" not in text and "loaded COUNT" not in text, text[-3000:]
    assert time.monotonic() - t0 < 60


def test_serve_sh_serves_a_config_relative_to_the_callers_folder(toy):
    _, url, _ = toy
    r = httpx.post(f"{url}/generate", timeout=30, json={"prompt": "start=1", "model_kwargs": {"max_tokens": 3}})
    assert r.status_code == 200 and r.json()["text"] == "2 3 4 "


def test_a_rank_stopped_with_sigterm_fails_its_requests_at_once(toy):
    proc, url, log_path = toy
    import concurrent.futures as cf

    body = {"prompt": "start=0", "model_kwargs": {"max_tokens": 95}}  # ~95 steps of 10 ms on rank 1
    with cf.ThreadPoolExecutor(1) as pool:
        future = pool.submit(httpx.post, f"{url}/generate", json=body, timeout=60)
        # SIGTERM while it runs (it lasts ~0.95 s)
        wait_for(lambda: metric(url, "mstar_dist_requests_running") == 1, 10, "the request running")
        os.kill(rank_pid(proc.pid, 1), signal.SIGTERM)
        t0 = time.monotonic()
        r = future.result()
    assert r.status_code == 503, r.text
    assert "rank 1 on host localhost stopped (stopped by a signal (SIGTERM))" in r.json()["error"]
    assert time.monotonic() - t0 < 5, "must not wait for limits.rank_timeout_s (30 s)"
    wait_for(lambda: not _healthy(url), 10, "/health reporting the service down")  # COUNT has no other replica
    assert "rank 1 on localhost is leaving" in log_path.read_text()
