"""Starts a real deployment the way users do (torchrun -m mstar_dist.serve) and stops every process it started."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]
WEIGHTS = os.path.expanduser(os.environ.get("MSTAR_TEST_WEIGHTS", "~/.cache/mstar_dist/smollm2-135m-instruct"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``torchrun --standalone --nproc-per-node N -m mstar_dist.serve CONFIG`` in its own process group."""

    def __init__(self, config: str | Path, nproc: int, *, overrides: dict | None = None, args: tuple = (),
                 startup_timeout: float = 240.0):
        data = yaml.safe_load(Path(config).read_text())
        data["weights"] = WEIGHTS
        for key, value in (overrides or {}).items():
            data[key] = value
        self._tmp = tempfile.TemporaryDirectory()
        self.config_path = Path(self._tmp.name) / "deployment.yaml"
        self.config_path.write_text(yaml.safe_dump(data))
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(self._tmp.name) / "server.log"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}", "-m", "mstar_dist.serve", str(self.config_path),
            "--port", str(self.port), "--startup-timeout", str(startup_timeout), *args,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.started_at = time.monotonic()
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before /health:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    self.ready_seconds = time.monotonic() - self.started_at
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not healthy within {timeout:.0f} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the torchrun agent's process group, then SIGKILL what is left; returns the exit status."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the agent's workers share its process group
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def stop_clean(self, nranks: int) -> bool:
        """Stop with SIGTERM; True when every rank reported a clean exit (status 0).

        torchrun's agent itself exits non-zero when it is signalled, so the ranks' own lines are what count.
        """
        self.stop()
        text = self.log_path.read_text(errors="replace")
        return text.count("exits with status 0") == nranks
