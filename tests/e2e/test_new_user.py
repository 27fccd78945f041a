"""What a new user meets first, through the real scripts: ``launch/serve.sh`` with a config path relative to
their own folder, its install step skipped when nothing changed, one clear line (no traceback, not once per
rank) for a missing file, a flag without a config, a misspelled key, a missing weights directory or a port in
use; and a rank stopped with SIGTERM failing its requests at once instead of after ``limits.rank_timeout_s``, then the
deployment exiting non-zero (no other replica serves that rank's walk, and a stopped rank is not restarted).

The module's one server is the toy model (2 ranks) started by ``serve.sh`` with ``MSTAR_NO_INSTALL`` on this
test's venv; ``install.sh``'s stamp logic runs against a stub venv whose python records pip calls, so nothing is
ever installed here.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.server import REPO, descendants, metric, signal_all, wait_for
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
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:  # it ended already (the last test stops it)
            pass
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


TORCHLESS_PYTHON = """#!/bin/sh
# stands in for a venv's python without torch: pip calls are recorded and succeed
case "$*" in *pip*) echo "$*" >> "$(dirname "$0")/../pip-calls"; exit 0 ;; *torch*) exit 1 ;; esac
exit 0
"""


@pytest.mark.parametrize("index", ["https://mirror.example/whl/cpu", None])
def test_install_says_each_step_and_takes_torch_from_the_index_the_user_names(tmp_path, index):
    """The one-minute install prints what it does (not pip's warnings), and on a machine without NVIDIA GPUs the
    user can name torch's CPU index (``MSTAR_TORCH_INDEX``) instead of pulling the multi-GB CUDA build."""
    fake = tmp_path / "venv"
    (fake / "bin").mkdir(parents=True)
    (fake / "bin/python").write_text(TORCHLESS_PYTHON)
    (fake / "bin/python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("MSTAR_NO_INSTALL", "MSTAR_TORCH_INDEX")}
    env |= {"MSTAR_VENV": str(fake), "PATH": "/usr/bin:/bin"} | ({"MSTAR_TORCH_INDEX": index} if index else {})
    out = subprocess.run(["bash", str(REPO / "launch/install.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == str(fake), out.stderr
    steps = out.stderr.strip().splitlines()
    assert all(line.startswith("install.sh: ") for line in steps), steps
    assert any("installing mstar_dist" in line for line in steps) and "done in" in steps[-1], steps
    calls = (fake / "pip-calls").read_text()
    if index:
        assert f"installing torch 2.13.0 from {index}" in out.stderr
        assert f"torch==2.13.0 --index-url {index}" in calls, calls
    else:
        assert "torch==2.13.0" in calls and "--index-url" not in calls, calls
        if shutil.which("nvidia-smi", path=env["PATH"]) is None:  # told how to avoid the CUDA build
            assert "MSTAR_TORCH_INDEX=https://download.pytorch.org/whl/cpu" in out.stderr


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
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in text, text  # checked before torchrun
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_stop_every_rank_at_once_with_one_line_and_status_0(venv, tmp_path, signum):
    """Ctrl-C (SIGINT to the terminal's process group) or SIGTERM: every rank ends within seconds, the command
    ends with one line naming the signal the user sent, exit 0, no traceback and no process left behind."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["bash", str(SERVE), str(REPO / "tests/toy_deploy.yaml"), "--port", str(port)],
                                cwd=tmp_path, env=env_for(venv, MASTER_PORT=str(free_port())), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    family = []
    try:
        def up() -> bool:
            assert proc.poll() is None, log_path.read_text()
            return _healthy(f"http://127.0.0.1:{port}")

        wait_for(up, 120, "serve.sh answering /health", interval=0.25)
        family = descendants(proc.pid)
        t0 = time.monotonic()
        os.killpg(proc.pid, signum)
        status = proc.wait(30)
        took = time.monotonic() - t0
    finally:
        signal_all([proc.pid, *family])
    text = log_path.read_text()
    name = signal.Signals(signum).name
    assert status == 0 and text.rstrip().endswith(f"mstar-dist: stopped by {name}"), text[-3000:]
    assert "Traceback" not in text and "SignalException" not in text, text[-5000:]
    assert text.count(f"exits with status 0 ({name})") == 2, text[-3000:]
    assert took < 10, f"the stop took {took:.1f} s"
    left = [pid for pid in family if Path(f"/proc/{pid}").exists()]
    assert not left, f"processes left behind: {left}"


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
    # the rank was asked to stop (no restart follows), and no other replica serves COUNT: the whole deployment
    # exits non-zero, naming why, instead of answering 503 forever
    try:
        status = proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"serve.sh still runs: {log_path.read_text()[-4000:]}") from None
    text = log_path.read_text()
    assert status != 0 and "no live replica can serve walks ['count'] and no restart is left" in text, text[-3000:]
