"""Child processes of a rank's family (docs/architecture.md §2): rank 0 spawns the front end, the front end spawns
its HTTP intakes. Each child is ``python -m <module>`` that talks JSON lines with its parent: it writes them on an
inherited pipe (``OUT_FD_ENV``) and reads them on its stdin; it stops on SIGTERM or when its stdin closes (its
parent is gone, even SIGKILLed). Nothing is pickled.

The parent holds a :class:`ChildProcess` (:class:`FrontendProcess`, ``runtime.intake.IntakeProcess``); the child
holds a :class:`ParentPipe` and runs :func:`watch_parent`.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

HTTP_FD_ENV = "MSTAR_FRONTEND_HTTP_FD"
"""The front end's inherited descriptor of rank 0's reserved HTTP socket."""
OUT_FD_ENV = "MSTAR_FRONTEND_OUT_FD"
"""A child's inherited descriptor of the pipe it writes its JSON lines on."""
WHERE_ENV = "MSTAR_FRONTEND_WHERE"
"""``"host_name addr"``: the host a child runs on (its log lines) and the address it binds its control socket on."""
FRONTEND_MODULE = "mstar_dist.runtime.frontend"
"""What rank 0 runs as its front end (``python -m``)."""

SWITCH_INTERVAL_S = 0.0005
"""How long a thread of a child may keep the GIL while another waits for it (Python's default: 5 ms). The HTTP
thread and the conductor thread (or an intake's link thread and its HTTP loop) hand each request over to each other,
and with the default a burst of arrivals queues behind whichever thread holds the GIL. Set on hosts of 8 cores or
more only: on a small host the extra hand-offs cost the other processes (the ranks) more than they save here."""


def quick_hand_offs() -> None:
    """Let a child's threads hand work to each other sooner (``SWITCH_INTERVAL_S``) when the host has cores to
    spare."""
    if (os.cpu_count() or 1) >= 8:
        sys.setswitchinterval(SWITCH_INTERVAL_S)


def where_from_env() -> tuple[str, str]:
    """(host name, address) the parent handed this child (``WHERE_ENV``)."""
    host_name, addr = os.environ[WHERE_ENV].split(" ", 1)
    return host_name, addr


class ChildProcess:
    """A parent's handle on one child process (``python -m module argv``, JSON lines both ways)."""

    what = "child process"

    def __init__(self, module: str, argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()):
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", module, *argv], stdin=subprocess.PIPE,
                                         env={**os.environ, **env, OUT_FD_ENV: str(write_fd)},
                                         pass_fds=(*pass_fds, write_fd))
        finally:
            os.close(write_fd)
        self._out = os.fdopen(read_fd, "rb")
        self.pid = self.proc.pid
        self._checked_at, self._alive = 0.0, True

    def read(self, timeout_s: float, what: str) -> dict[str, Any]:
        """The next JSON line it writes; RuntimeError naming ``what`` it owed when none comes within ``timeout_s``."""
        line = read_line(self._out.fileno(), timeout_s, self.proc)
        if not line:
            raise RuntimeError(f"{self.what} (pid {self.pid}) did not report {what} within {timeout_s:g} s "
                               f"(exit status {self.proc.poll()}); see its log lines")
        return json.loads(line)

    def write(self, obj: dict[str, Any]) -> None:
        """One JSON line on its stdin (nothing when it is gone already: ``alive()`` says so)."""
        try:
            self.proc.stdin.write(json.dumps(obj).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def alive(self) -> bool:
        """Whether it runs (checked at most every 0.2 s: callers ask every turn of their loop)."""
        now = time.monotonic()
        if now - self._checked_at >= 0.2:
            self._checked_at, self._alive = now, self.proc.poll() is None
        return self._alive

    def describe_exit(self) -> str:
        return f"{self.what} (pid {self.pid}) exited with status {self.proc.poll()}"

    def terminate(self) -> None:
        """SIGTERM it now (no wait: :meth:`stop` waits)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, wait up to ``timeout_s`` (it finishes what it must on the way out), then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.error("%s (pid %d) did not stop within %g s; killing it", self.what, self.pid, timeout_s)
                self.proc.kill()
                self.proc.wait(5)
        for f in (self.proc.stdin, self._out):
            try:
                f.close()
            except OSError:
                pass
        return self.proc.returncode


def stop_all(children: list[ChildProcess], timeout_s: float = 8.0) -> None:
    """SIGTERM each at once, then wait for each (their drains overlap; an intake drains for at most 5 s, so the
    front end stays within the 15 s rank 0 gives it)."""
    for child in children:
        child.terminate()
    for child in children:
        child.stop(timeout_s)


class FrontendProcess(ChildProcess):
    """Rank 0's handle on its front-end process (``runtime/frontend.py``)."""

    what = "the front end (conductor and HTTP)"

    def __init__(self, argv: list[str], *, host_name: str, addr: str, http_sock: socket.socket):
        """Spawn it now; ``argv`` are this rank's serve flags (the front end parses the same ones)."""
        env = {HTTP_FD_ENV: str(http_sock.fileno()), WHERE_ENV: f"{host_name} {addr}", "CUDA_VISIBLE_DEVICES": "",
               "OMP_NUM_THREADS": "1"}
        super().__init__(FRONTEND_MODULE, argv, env, pass_fds=(http_sock.fileno(),))
        http_sock.close()  # the front end holds the port now; it is freed when the front end exits

    def endpoint(self, timeout_s: float) -> str:
        """The front end's control endpoint (blocks until it has bound its socket)."""
        return self.read(timeout_s, "its control endpoint")["endpoint"]

    def configure(self, token: str, endpoints: dict[str, str], failed: str | None = None) -> None:
        """Hand over the launch's secret and every rank's endpoint (or that rank 0 failed to load)."""
        self.write({"token": token, "endpoints": endpoints, "failed": failed})


class ParentGone(EOFError):
    """The parent process is gone (its pipe closed): the child has nobody to serve."""


class ParentPipe:
    """A child's side of its :class:`ChildProcess`: JSON lines out on the inherited pipe, in on stdin."""

    def __init__(self) -> None:
        self._out = os.fdopen(int(os.environ[OUT_FD_ENV]), "wb")

    def report(self, obj: dict[str, Any]) -> None:
        """One JSON line to the parent (its :meth:`ChildProcess.read`); ParentGone when the parent is gone."""
        try:
            self._out.write(json.dumps(obj).encode() + b"\n")
            self._out.flush()
        except BrokenPipeError:
            raise ParentGone("the parent process is gone") from None

    def read(self, timeout_s: float) -> dict[str, Any] | None:
        """The parent's next JSON line on stdin, or None when none comes within ``timeout_s``; ParentGone when stdin
        closed (the parent is gone)."""
        line = read_line(sys.stdin.fileno(), timeout_s)
        if line == b"":
            raise ParentGone("the parent process is gone")
        return None if line is None else json.loads(line)


def read_line(fd: int, timeout_s: float, proc: subprocess.Popen | None = None) -> bytes | None:
    """One line from ``fd`` within ``timeout_s`` (None on timeout or ``proc`` exiting; ``b""`` at end of file)."""
    deadline = time.monotonic() + timeout_s
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or (proc is not None and proc.poll() is not None and not select.select([fd], [], [], 0)[0]):
            return None
        ready, _, _ = select.select([fd], [], [], min(left, 0.2))
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                return b""
            data += chunk
    return data


def watch_parent(stop: threading.Event, parent: str, gone: threading.Event | None = None) -> None:
    """Our ``parent`` holds our stdin: end of file means it is gone (even SIGKILLed): set ``gone`` (if given), then
    ``stop``. Runs on its own thread."""
    fd = sys.stdin.fileno()
    try:
        while not stop.is_set():
            if select.select([fd], [], [], 0.5)[0] and not os.read(fd, 65536):
                break
    except (OSError, ValueError):
        pass
    if not stop.is_set():
        log.error("%s is gone (its pipe to this process closed): stopping", parent)
        if gone is not None:
            gone.set()
        stop.set()


def start_watching_parent(stop: threading.Event, parent: str, gone: threading.Event | None = None) -> None:
    """:func:`watch_parent` on a daemon thread named ``parent-watch``."""
    threading.Thread(target=watch_parent, args=(stop, parent, gone), name="parent-watch", daemon=True).start()
