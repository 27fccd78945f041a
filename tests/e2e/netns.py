"""Two "hosts" on one machine: two network namespaces joined by a veth pair, each with its own address
(docs/architecture.md §11). Needs root (``ip netns``); ``NetnsPair.unavailable()`` says why not, for a skip.

Addresses inside a namespace are reachable only from inside a namespace (from the root namespace they would be
routed out of the machine), so every contact goes through ``ip netns exec``: the servers run in them, and
`run_in` runs a Python snippet in one (HTTP clients included). Shared memory (/dev/shm) is not a network
resource: both namespaces share it, like two containers of one machine, unless ``own_shm_mb`` gives each host a
/dev/shm of its own of that size (a tmpfs mounted in the host's mount namespace, as a container runtime does).
"""

from __future__ import annotations

import ctypes
import os
import random
import subprocess
import sys
import uuid

from tests.e2e.server import REPO


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")


class NetnsPair:
    """Namespaces ``names[0]`` (address ``addrs[0]``) and ``names[1]`` (``addrs[1]``), interfaces ``ifnames``."""

    def __init__(self, own_shm_mb: int | None = None) -> None:
        self.own_shm_mb = own_shm_mb
        tag = uuid.uuid4().hex[:6]
        self.names = (f"mstar-a-{tag}", f"mstar-b-{tag}")
        self.ifnames = (f"mva{tag}", f"mvb{tag}")  # at most 15 characters
        net = f"10.{random.randint(64, 250)}.{random.randint(0, 250)}"
        self.addrs = (f"{net}.1", f"{net}.2")
        self._made: list[str] = []

    @staticmethod
    def unavailable() -> str | None:
        """None when namespaces can be made here, else the reason."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        probe = f"mstar-probe-{uuid.uuid4().hex[:6]}"
        out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if out.returncode != 0:
            return f"ip netns add failed: {out.stderr.strip() or out.returncode}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return None

    def __enter__(self) -> NetnsPair:
        try:
            for name in self.names:
                _ip("netns", "add", name)
                self._made.append(name)
                _ip("link", "set", "lo", "up", ns=name)
            _ip("link", "add", self.ifnames[0], "type", "veth", "peer", "name", self.ifnames[1])
            for name, ifname, addr in zip(self.names, self.ifnames, self.addrs):
                _ip("link", "set", ifname, "netns", name)
                _ip("addr", "add", f"{addr}/24", "dev", ifname, ns=name)
                _ip("link", "set", ifname, "up", ns=name)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for name in self._made:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()

    def exec_prefix(self, i: int) -> list[str]:
        """Run a command inside namespace ``i`` (``ip netns exec`` gives it a mount namespace of its own too: with
        ``own_shm_mb``, a fresh tmpfs of that size is mounted on its /dev/shm first)."""
        prefix = ["ip", "netns", "exec", self.names[i]]
        if self.own_shm_mb is None:
            return prefix
        mount = f'mount -t tmpfs -o size={self.own_shm_mb}m tmpfs /dev/shm && exec "$@"'
        return [*prefix, "sh", "-c", mount, "sh"]

    def enter(self, i: int) -> None:
        """Move the calling thread (and every thread and process it starts afterwards) into namespace ``i``: call it
        on the main thread before starting any, so that plain HTTP clients reach the servers there."""
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{self.names[i]}", os.O_RDONLY)
        try:
            if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                raise OSError(ctypes.get_errno(), f"setns into {self.names[i]} failed")
        finally:
            os.close(fd)

    def set_link(self, up: bool) -> None:
        """Take the veth link between the two namespaces down (or up again): each side sees its carrier go."""
        _ip("link", "set", self.ifnames[0], "up" if up else "down", ns=self.names[0])

    def run_in(self, i: int, code: str, timeout: float = 300) -> str:
        """Run Python ``code`` inside namespace ``i`` (with the repository importable); returns its stdout."""
        out = subprocess.run([*self.exec_prefix(i), sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=timeout, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        if out.returncode != 0:
            raise RuntimeError(f"in {self.names[i]}: {out.stderr[-3000:]}")
        return out.stdout
