"""Restart in place: the supervisor of a rank (docs/architecture.md §10, "Restart and rejoin").

torchrun restarts workers only all together (``--max-restarts``: every worker of a host, after any one of them
failed), so a rank that dies while the others serve needs a restarter of its own. The process torchrun starts for a
rank other than 0 is that supervisor: it runs the rank as a child (``python -m mstar_dist.serve`` again, with
``CHILD_ENV`` set) and, when the child dies without being asked to and without the deployment being over, starts it
again, within ``restart.max_restarts`` per ``restart.window_s``, after ``restart.backoff_s`` doubling. A restarted
child does not join the world group again: it rejoins the running deployment (``rank.py``, ``distributed/repair.py``).
Rank 0 is not supervised: the front end lives beside it, and its loss ends the deployment.

Each start of the child is an incarnation (``INCARNATION_ENV``): the launch's count of this rank's starts
(``starts/<rank>`` in its store), so 0 for the launch's first and 1, 2, ... after, whichever supervisor starts it. A
whole host started again into the running deployment (``serve_node.sh`` after the host came back: torchrun's agent
rejoins the launch's store and starts its workers with their old ranks) therefore starts incarnations > 0, which
rejoin like a restart in place instead of waiting for a world group that formed long ago.

The supervisor stays small (no model, no device); it imports torch only for its client of the launch's store, where
it writes each death (``death/<n>``, counted in ``deaths``: rank, host, incarnation, cause, whether it restarts),
which the front end's watcher hands the conductor: the rank's requests fail at once with a 503 naming the cause,
and the conductor knows whether to wait for the rank to come back.

The child tells its supervisor on an inherited pipe (``PIPE_ENV``), one JSON line each: ``{"serving": true}`` once it
serves, ``{"over": reason}`` when the deployment is over for it (a ``Shutdown`` that is not a restart, rank 0's host
gone, a startup failure on the board), ``{"leaving": reason}`` when it leaves on its own (said in the death record).

Signals: torchrun stops its workers with a signal to each worker's process group, which holds the child too; the
supervisor forwards the signal anyway (a signal to it alone) and waits for the child (``STOP_WAIT_S``), then leaves
with the child's status: a requested stop restarts nothing. A supervisor killed outright takes its child with it
(``PR_SET_PDEATHSIG``): no orphan.
"""

from __future__ import annotations

import collections
import ctypes
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from mstar_dist.config.deployment import RestartConfig

__all__ = ["CHILD_ENV", "INCARNATION_ENV", "PIPE_ENV", "Supervisor", "SupervisorPipe", "describe_exit"]

log = logging.getLogger("mstar_dist.supervisor")

CHILD_ENV = "MSTAR_RANK_CHILD"
"""Set (to "1") in a supervised rank: it serves instead of supervising."""
INCARNATION_ENV = "MSTAR_RANK_INCARNATION"
"""How many times the rank was restarted in place (0: its first start, which joins the world group)."""
PIPE_ENV = "MSTAR_SUPERVISOR_FD"
"""The descriptor a supervised rank writes its JSON lines to."""
STOP_WAIT_S = 6.0
"""How long a supervisor asked to stop waits for its child before killing it (the child bounds its own stop)."""
REPORT_WAIT_S = 1.0
"""Bound on writing a death record."""
STORE_WAIT_S = 30.0
"""Bound on reaching the launch's store before the child's first start (its count of starts lives there)."""
BACKOFF_CAP_S = 60.0
"""The longest wait before a restart, however many came before it."""
_PR_SET_PDEATHSIG = 1


def describe_exit(returncode: int) -> str:
    """A child's exit status in words."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    if returncode == 0:
        return "exited with status 0 (nobody asked it to stop)"
    return f"exited with status {returncode}"


class SupervisorPipe:
    """A rank's line to its supervisor (does nothing when the rank is not supervised)."""

    def __init__(self, fd: int | None) -> None:
        self._out = os.fdopen(fd, "wb", buffering=0) if fd is not None else None
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SupervisorPipe:
        raw = (os.environ if env is None else env).get(PIPE_ENV)
        return cls(int(raw) if raw else None)

    @property
    def supervised(self) -> bool:
        return self._out is not None

    def serving(self) -> None:
        self._say({"serving": True})

    def over(self, reason: str) -> None:
        """The deployment is over for this rank: its supervisor must not restart it."""
        self._say({"over": reason})

    def leaving(self, reason: str) -> None:
        """This rank leaves on its own (its supervisor names ``reason`` as the cause and may restart it)."""
        self._say({"leaving": reason})

    def _say(self, obj: dict[str, Any]) -> None:
        if self._out is None:
            return
        with self._lock:  # the guard thread may say something while the main thread does
            try:
                self._out.write(json.dumps(obj).encode() + b"\n")
            except OSError:
                pass


class Supervisor:
    """Runs one rank as a child and restarts it in place (see the module docstring)."""

    def __init__(self, argv: list[str], *, rank: int, host: str, policy: RestartConfig,
                 env: Mapping[str, str] | None = None) -> None:
        self.argv, self.rank, self.host, self.policy = list(argv), rank, host, policy
        self.env = dict(os.environ if env is None else env)
        self.stop_signal: int | None = None
        """The signal that asked this rank to stop (then nothing is restarted)."""
        self.child: subprocess.Popen | None = None
        self.incarnation = 0
        self.served = False
        """The rank served once: only then is a death restarted (a first start that fails would fail again)."""
        self.deaths: collections.deque[float] = collections.deque()
        self._store: Any | None = None
        self._store_ready = threading.Event()
        self._starts = 0
        """Starts of the child counted here (only without the launch's store)."""

    def run(self) -> int:
        """Supervise until the rank stops for good; the exit status torchrun sees."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        logging.getLogger("torch").setLevel(logging.WARNING)  # its exit-time statistics are not this rank's news
        threading.Thread(target=self._open_store, name="store", daemon=True).start()
        while True:
            self.incarnation = self._count_start()
            returncode, said = self._run_child()
            if self.stop_signal is not None:  # asked to stop: said so, for a conductor that still serves
                self._report(f"was stopped ({signal.Signals(self.stop_signal).name})", restarting=False)
                return max(returncode, 0)
            if "over" in said:
                return returncode if returncode > 0 else (0 if returncode == 0 else 1)
            if not self.served:
                return returncode if returncode > 0 else 1
            cause = said.get("leaving") or describe_exit(returncode)
            delay = self._next_delay(time.monotonic())
            self._report(cause, restarting=delay is not None)
            if delay is None:
                log.error("rank %d on host %s %s; no restart left (restart.max_restarts=%d within %g s): it stays "
                          "down", self.rank, self.host, cause, self.policy.max_restarts, self.policy.window_s)
                return self._wait_for_the_end()
            log.warning("rank %d on host %s %s; restarting it in %.1f s (restart %d of %d within %g s)", self.rank,
                        self.host, cause, delay, len(self.deaths), self.policy.max_restarts, self.policy.window_s)
            if self._sleep(delay):
                return 0

    def _count_start(self) -> int:
        """This start's incarnation: the launch's count of this rank's starts so far (see the module docstring), or,
        without the launch's store, this supervisor's own count."""
        self._store_ready.wait(STORE_WAIT_S)
        if self._store is not None:
            from mstar_dist.distributed.store import key

            try:
                return int(self._store.add(key("starts", rank=self.rank), 1)) - 1
            except Exception as exc:  # noqa: BLE001 - the store's host is gone: the child's own startup says so
                log.warning("rank %d: could not count its start in the launch's store (%s)", self.rank, exc)
        self._starts += 1
        return self._starts - 1

    def _next_delay(self, now: float) -> float | None:
        """Count this death; the wait before the restart, or None when no restart is left."""
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] > self.policy.window_s:
            self.deaths.popleft()
        if len(self.deaths) > self.policy.max_restarts:
            return None
        return min(self.policy.backoff_s * 2 ** (len(self.deaths) - 1), BACKOFF_CAP_S)

    def _run_child(self) -> tuple[int, dict[str, str]]:
        """Start the child and wait for it; (its return code, what it said on the pipe)."""
        read_fd, write_fd = os.pipe()
        env = {**self.env, CHILD_ENV: "1", INCARNATION_ENV: str(self.incarnation), PIPE_ENV: str(write_fd)}
        try:
            self.child = subprocess.Popen([sys.executable, "-m", "mstar_dist.serve", *self.argv], env=env,
                                          pass_fds=(write_fd,), preexec_fn=_die_with_parent)
        finally:
            os.close(write_fd)
        said: dict[str, str] = {}
        buffer = b""
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:  # only the child holds the other end: EOF is its exit
            while True:
                if not select.select([pipe], [], [], 0.5)[0]:
                    continue
                chunk = pipe.read(65536)
                if not chunk:
                    break
                *lines, buffer = (buffer + chunk).split(b"\n")
                for line in lines:
                    self._heard(json.loads(line), said)
        return self.child.wait(), said

    def _heard(self, obj: dict[str, Any], said: dict[str, str]) -> None:
        if obj.get("serving"):
            self.served = True
        for k in ("over", "leaving"):
            if k in obj:
                said[k] = str(obj[k])

    def _on_signal(self, signum: int, _frame) -> None:
        self.stop_signal = self.stop_signal or signum
        child = self.child
        if child is not None and child.poll() is None:
            try:
                child.send_signal(signum)
            except ProcessLookupError:
                pass
            threading.Thread(target=self._bound_stop, args=(child,), daemon=True).start()

    def _bound_stop(self, child: subprocess.Popen) -> None:
        try:
            child.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            log.error("rank %d on host %s did not stop within %g s; killing it", self.rank, self.host, STOP_WAIT_S)
            child.kill()

    def _sleep(self, seconds: float) -> bool:
        """Wait before a restart; True when a stop was asked meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.stop_signal is not None:
                return True
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return self.stop_signal is not None

    # ---- the launch's store ----
    def _open_store(self) -> None:
        try:
            from mstar_dist.distributed.store import launch_store

            self._store = launch_store(self.env, timeout_s=30.0)
        except Exception as exc:  # noqa: BLE001 - deaths then go unreported; the conductor sees the silence
            log.warning("rank %d: no client of the launch's store (%s): its deaths are found by silence only",
                        self.rank, exc)
        finally:
            self._store_ready.set()

    def _report(self, cause: str, *, restarting: bool, wait_s: float = REPORT_WAIT_S) -> None:
        """Write the death record where the front end's watcher reads it; at most ``wait_s`` (a store whose host
        is gone must not hold up a stop or a restart)."""
        def write() -> None:
            self._store_ready.wait(wait_s)
            if self._store is None:
                return
            from mstar_dist.distributed.store import key, write_json

            record = {"rank": self.rank, "host": self.host, "incarnation": self.incarnation, "cause": cause,
                      "restarting": restarting}
            try:
                n = self._store.add(key("deaths"), 1)
                write_json(self._store, record, "death", n=n)
            except Exception as exc:  # noqa: BLE001 - the store's host is gone: so is the deployment
                log.warning("rank %d: could not report its death (%s)", self.rank, exc)

        reporter = threading.Thread(target=write, name="report", daemon=True)
        reporter.start()
        reporter.join(wait_s)

    def _wait_for_the_end(self) -> int:
        """No restart left: stay (torchrun would stop this host's other ranks if this process exited non-zero)
        until the deployment is over (the front end writes ``over``), its store is gone, or a stop is asked; then
        exit 1."""
        from mstar_dist.distributed.store import key

        while self.stop_signal is None:
            try:
                if self._store is None or self._store.check([key("over")]):
                    break
            except Exception:  # noqa: BLE001 - the store's host is gone
                break
            time.sleep(1.0)
        return 1


def _die_with_parent() -> None:
    """In the child, before it runs: SIGKILL it when the supervisor dies (Linux; elsewhere nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
