"""Starts a real deployment the way users do (torchrun -m mstar_dist.serve) and stops every process it started."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]
WEIGHTS = os.path.expanduser(os.environ.get("MSTAR_TEST_WEIGHTS", "~/.cache/mstar_dist/smollm2-135m-instruct"))


def per_rank(base_url: str, name: str) -> dict[str, int]:
    """A per-rank series of ``/metrics``: ``{rank: value}`` (e.g. ``mstar_dist_live_tensors``)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {m.group(1): int(float(m.group(2)))
            for m in re.finditer(rf'^{name}\{{rank="(\d+)"\}} (\S+)$', text, re.M)}


def metric(base_url: str, series: str) -> float:
    """One series of ``/metrics`` (a regex for its name and labels); 0 when absent."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    match = re.search(r"^" + series + r" (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    """Call ``predicate()`` until it returns a truthy value (returned), sleeping ``interval`` between tries.

    At the deadline: ``AssertionError(f"{what} did not happen within {timeout} s")``. A predicate may also assert
    (raise AssertionError): it is retried until the deadline, and the last one is then raised, message and all.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
            if value:
                return value
            failure = None
        except AssertionError as exc:
            failure = exc
        if time.monotonic() >= deadline:
            if failure is not None:
                raise failure
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(interval)


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def signal_all(pids: list[int], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to each of ``pids`` that still exists (processes this test started, by PID)."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _gpus_per_node(nodes: list[int]) -> list[str] | None:
    """With several simulated hosts on a machine with enough GPUs: the ``CUDA_VISIBLE_DEVICES`` of each (node k gets
    the next ``nodes[k]`` GPUs), so two hosts' local rank 0 do not share a GPU; None otherwise (CPU, or one host)."""
    if len(nodes) < 2:
        return None
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [i.strip() for i in visible.split(",") if i.strip()] if visible else \
        [str(i) for i in range(torch.cuda.device_count())]
    if len(ids) < sum(nodes):
        return None
    out, start = [], 0
    for n in nodes:
        out.append(",".join(ids[start:start + n]))
        start += n
    return out


_HEALTH = """
import httpx
try:
    print(httpx.get("{url}", timeout=2).status_code)
except httpx.HTTPError:
    print(0)
"""


class Server:
    """``torchrun --standalone --nproc-per-node N -m mstar_dist.serve CONFIG`` in its own process group."""

    def __init__(self, config: str | Path, nproc: int, *, overrides: dict | None = None, args: tuple = (),
                 startup_timeout: float = 240.0, nodes: list[int] | None = None, rdzv: str = "static",
                 netns=None):
        """``netns`` (a ``tests.e2e.netns.NetnsPair``): node k runs inside namespace k, the rendezvous is on
        namespace 0's address, and every HTTP call must be made from inside namespace 0 (``netns.run_in``)."""
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
        master_port = free_port()
        self.netns = netns
        master_addr = netns.addrs[0] if netns is not None else "127.0.0.1"
        nodes = list(nodes) if nodes else [nproc]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        self._log = open(self.log_path, "wb")
        self.procs: list[subprocess.Popen] = []
        self._starts: list[tuple[list[str], dict[str, str]]] = []  # each node's torchrun command and environment
        gpus = _gpus_per_node(nodes)
        for node_rank, n in enumerate(nodes):
            # one host: --standalone; several: static rendezvous on loopback (host k of the spec = node rank k)
            node_env = dict(env)
            if gpus is not None:  # each "host" sees only its own GPUs, as on separate machines
                node_env["CUDA_VISIBLE_DEVICES"] = gpus[node_rank]
            if len(nodes) == 1:
                flags = ["--standalone", f"--master-port={master_port}"]
            elif rdzv == "static":
                flags = [f"--nnodes={len(nodes)}", f"--node-rank={node_rank}", f"--master-addr={master_addr}",
                         f"--master-port={master_port}"]
            else:  # c10d: node ranks arrive in any order; hosts are named by MSTAR_NODE_RANK
                flags = [f"--nnodes={len(nodes)}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{master_port}",
                         "--rdzv-id=mstar-test", f"--local-addr=127.0.0.{node_rank + 1}",
                         f"--rdzv-conf=is_host={'true' if node_rank == 0 else 'false'}"]
                node_env["MSTAR_NODE_RANK"] = str(node_rank)
            cmd = [
                *(netns.exec_prefix(node_rank) if netns is not None else []), sys.executable, "-m", "torch.distributed.run", *flags, f"--nproc-per-node={n}",
                "-m", "mstar_dist.serve", str(self.config_path),
                "--port", str(self.port), "--startup-timeout", str(startup_timeout), *args,
            ]
            self._starts.append((cmd, node_env))
            self.procs.append(subprocess.Popen(cmd, cwd=REPO, env=node_env, stdout=self._log,
                                               stderr=subprocess.STDOUT, start_new_session=True))
        self.proc = self.procs[0]
        self.started_at = time.monotonic()
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a torchrun agent exited with {proc.returncode} before /health:\n{self.log()}")
            if self.netns is not None:
                if self.netns.run_in(0, _HEALTH.format(url=f"{self.base_url}/health")).strip() == "200":
                    self.ready_seconds = time.monotonic() - self.started_at
                    return
                time.sleep(1.0)
                continue
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    self.ready_seconds = time.monotonic() - self.started_at
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not healthy within {timeout:.0f} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-12000:]

    def rank_pid(self, rank: int) -> int:
        """The pid of the process serving ``rank`` on any host (under its supervisor: the supervised child)."""
        for pid in [d for proc in self.procs for d in descendants(proc.pid)]:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ and b"MSTAR_RANK_CHILD=1" in environ:
                return pid
        raise AssertionError(f"no process serving rank {rank}")

    def kill_node(self, node: int) -> None:
        """SIGKILL one torchrun agent and every rank it started: the host dies (its workers run in their own
        sessions, so killing the agent's process group alone would orphan them)."""
        victims = [self.procs[node].pid, *descendants(self.procs[node].pid)]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def restart_node(self, node: int) -> None:
        """Start host ``node``'s torchrun again, as its operator would after the host came back (``kill_node``
        first): the same command, flags and environment."""
        cmd, env = self._starts[node]
        self.procs[node] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM every torchrun agent, then SIGKILL whatever is left of it and its ranks; returns node 0's status."""
        family = {proc.pid: descendants(proc.pid) for proc in self.procs}
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
            for pid in [proc.pid, *family[proc.pid]]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def stop_clean(self, nranks: int) -> bool:
        """Stop with SIGTERM; True when every rank reported a clean exit (status 0).

        torchrun's agent itself exits non-zero when it is signalled, so the ranks' own lines are what count.
        """
        self.stop()
        text = self.log_path.read_text(errors="replace")
        return text.count("exits with status 0") == nranks
