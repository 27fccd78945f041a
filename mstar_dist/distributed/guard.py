"""A rank's guard: the thread that makes a rank fail fast and name the cause (docs/architecture.md §2, §10).

A rank spends its startup inside blocking C++ calls (``init_process_group``, store waits, group creation, loading),
where neither a Python signal handler nor an exception of another rank can reach it. The guard thread watches, every
``POLL_S``, what the main thread cannot:

- **the failure board** (startup only): a rank that cannot validate or load writes its cause under ``failed/<rank>``
  of the launch's store (:func:`publish_failure`) and counts it in ``failures``; every other rank's guard reads it
  and the rank exits 1 with one line naming that rank, its host and the cause, on every host, within a second;
- **the startup deadline**: past ``--startup-timeout`` (plus ``DEADLINE_GRACE_S``, so the main thread's own timeout,
  translated by :func:`startup_timeout_message`, usually speaks first) it names the ranks that never reached the
  rendezvous (no ``rendezvous/<rank>`` key) or never finished loading (no ``ready/<rank>``), with their hosts;
- **signals**: SIGTERM / SIGINT while starting end the rank at once with one line (exit 0: a requested stop); while
  serving the main thread stops on its own, and the guard only bounds it (``STOP_BOUND_S``);
- **the launch's store** (serving, ranks other than rank 0): torchrun's agent on rank 0's host holds it; when it stops
  answering, rank 0's host is gone and the rank exits 1 saying so, instead of waiting ``limits.rank_timeout_s``.

A fatal finding runs the rank's registered cleanups (each bounded: a shared-memory segment to unlink, the supervisor
to tell), then leaves by ``os._exit``: the main thread may be stuck in C++ for as long as the startup timeout.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from mstar_dist.distributed.store import key, launch_store, read_json

__all__ = ["Guard", "describe_ranks", "publish_failure", "startup_timeout_message"]

log = logging.getLogger("mstar_dist.boot")

POLL_S = 0.2
"""How often the guard looks at the board, the store and the signals."""
DEADLINE_GRACE_S = 3.0
"""How long past the startup timeout the guard lets the main thread report its own timeout first."""
STOP_BOUND_S = 4.5
"""A serving rank asked to stop that is still running this long after the signal leaves at once (within the 5 s an
operator expects; the stop is requested, so with status 0)."""
STORE_MISSES = 3
"""Consecutive failed polls of the launch's store before a serving rank concludes rank 0's host is gone (one miss may
be a slow answer; a connection the store's host closed counts at once)."""


def describe_ranks(ranks: list[int], rank_hosts: Mapping[int, str]) -> str:
    """``rank 2 on host b`` / ``ranks 2, 3 on host b and rank 5 on host c``."""
    by_host: dict[str, list[int]] = {}
    for r in sorted(ranks):
        by_host.setdefault(rank_hosts.get(r, "?"), []).append(r)
    parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} on host {host}" for host, rs in by_host.items()]
    return " and ".join(parts)


def startup_timeout_message(store: Any, world_size: int, rank_hosts: Mapping[int, str], timeout_s: float) -> str:
    """Who held the startup up, from the board: the ranks that never reached the rendezvous, else those that never
    finished loading (both with their hosts)."""
    try:
        absent = [r for r in range(world_size) if not store.check([key("rendezvous", rank=r)])]
        if absent:
            return (f"{describe_ranks(absent, rank_hosts)} never reached the rendezvous within {timeout_s:g} s "
                    f"(--startup-timeout): see that host's log, or whether its torchrun started at all")
        slow = [r for r in range(world_size) if not store.check([key("ready", rank=r)])]
        if slow:
            return f"{describe_ranks(slow, rank_hosts)} did not finish loading within {timeout_s:g} s (--startup-timeout)"
    except Exception as exc:  # the store itself is gone
        return f"the startup did not finish within {timeout_s:g} s and the launch's store does not answer ({exc})"
    return f"the startup did not finish within {timeout_s:g} s (--startup-timeout)"


def publish_failure(store: Any | None, rank: int, host: str, reason: str) -> None:
    """Put this rank's startup failure on the board (``failed/<rank>``, counted in ``failures``), where every other
    rank's guard finds it. ``store`` None: a short-lived client of the launch's store (nothing when there is none).
    Never raises: the failure itself is what the caller reports."""
    try:
        store = store if store is not None else launch_store(timeout_s=5.0)
        if store is None:
            return
        store.set(key("failed", rank=rank), json.dumps({"rank": rank, "host": host, "reason": reason}))
        store.add(key("failures"), 1)
    except Exception:  # noqa: BLE001 - the board is a courtesy to the other ranks
        log.debug("could not publish the failure of rank %d", rank, exc_info=True)


class Guard:
    """One rank's guard thread (see the module docstring)."""

    def __init__(self, *, rank: int, host: str, world_size: int, rank_hosts: Mapping[int, str], timeout_s: float,
                 signal_fd: int | None = None, watch_store: bool = True,
                 exit_fn: Callable[[int], None] = os._exit) -> None:
        """``signal_fd``: the read end of the pipe the process's signal wake-up writes to (``Lifecycle``);
        ``watch_store``: whether a serving rank watches the store (not rank 0, whose host holds it)."""
        self.rank, self.host, self.world_size, self.rank_hosts = rank, host, world_size, dict(rank_hosts)
        self.timeout_s = timeout_s
        self.signal_fd, self.watch_store = signal_fd, watch_store
        self.exit_fn = exit_fn
        self.serving = False
        """Set once the rank serves: the board and the deadline no longer apply; the store watch does."""
        self.started = time.monotonic()
        self.stop_signal: tuple[str, float] | None = None
        """(signal name, when) of the stop a serving rank was asked for."""
        self.cleanups: list[Callable[[], None]] = []
        """Run (each guarded) before a fatal exit."""
        self.on_fatal: Callable[[str, bool], None] | None = None
        """Called with (message, deployment over) before a fatal exit (the supervisor pipe)."""
        self._store: Any | None = None
        self._misses = 0
        self._failures_seen = 0
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def start(self, store: Any | None) -> None:
        """Run the guard on a daemon thread; ``store``: its own client of the launch's store (None: no board, no
        store watch; signals and the deadline only)."""
        self._store = store
        self._thread = threading.Thread(target=self._run, name="guard", daemon=True)
        self._thread.start()

    def close(self, wait_s: float = 1.0) -> None:
        """The rank is leaving on its own: the guard stops watching, and is waited for (a thread left inside a store
        call while the interpreter exits aborts the process)."""
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(wait_s)

    def _run(self) -> None:
        while not self._closed.wait(POLL_S):
            try:
                self.check_once(time.monotonic())
            except Exception:  # noqa: BLE001 - the guard must outlive a bad poll
                log.debug("guard poll failed", exc_info=True)

    def check_once(self, now: float) -> None:
        """One look at the signals, the board, the deadline and the store (the thread calls it every ``POLL_S``)."""
        sig = self._take_signal()
        if sig is not None and not self.serving:
            self.fatal(f"rank {self.rank} on host {self.host}: stopped by {sig} while starting", 0, over=True)
        if sig is not None:
            self.stop_signal = self.stop_signal or (sig, now)
        if self.stop_signal is not None and now - self.stop_signal[1] > STOP_BOUND_S:
            self.fatal(f"rank {self.rank} on host {self.host} exits with status 0 ({self.stop_signal[0]}; its stop "
                       f"was cut short {STOP_BOUND_S:g} s after the signal)", 0, over=True)
        if self._store is None:
            if not self.serving and now - self.started > self.timeout_s + DEADLINE_GRACE_S:
                self.fatal(f"rank {self.rank} on host {self.host}: the startup did not finish within "
                           f"{self.timeout_s:g} s (--startup-timeout)", 1, over=True)
            return
        if not self.serving:
            self._check_board()
            if now - self.started > self.timeout_s + DEADLINE_GRACE_S:
                self.fatal(startup_timeout_message(self._store, self.world_size, self.rank_hosts, self.timeout_s),
                           1, over=True)
        elif self.watch_store:
            self._check_store()

    def _take_signal(self) -> str | None:
        if self.signal_fd is None or not select.select([self.signal_fd], [], [], 0)[0]:
            return None
        try:
            data = os.read(self.signal_fd, 64)
        except (BlockingIOError, OSError):
            return None
        for byte in data:
            if byte in (signal.SIGTERM, signal.SIGINT):
                return signal.Signals(byte).name
        return None

    def _check_board(self) -> None:
        count = self._store.add(key("failures"), 0)
        if count <= self._failures_seen:
            return
        self._failures_seen = count
        for r in range(self.world_size):
            if r == self.rank:
                continue
            record = read_json(self._store, "failed", rank=r)
            if record is not None:
                self.fatal(f"stopping: rank {record['rank']} on host {record['host']}: {record['reason']}",
                           1, over=True)

    def _check_store(self) -> None:
        try:
            self._store.add(key("failures"), 0)
            self._misses = 0
        except Exception as exc:  # noqa: BLE001 - what it raises depends on how the host went
            self._misses += 1
            gone = any(word in str(exc) for word in ("Broken pipe", "Connection reset", "Connection refused"))
            if gone or self._misses >= STORE_MISSES:  # the peer closed the connection: no need to ask again
                self.fatal(f"rank {self.rank} on host {self.host}: rank 0's host ({self.rank_hosts.get(0, '?')}) is "
                           f"gone: the launch's store there stopped answering ({type(exc).__name__}: {exc})",
                           1, over=True)

    def fatal(self, message: str, rc: int, *, over: bool) -> None:
        """Say ``message`` (one line), run the cleanups, tell ``on_fatal``, leave with ``rc``."""
        (log.info if rc == 0 else log.error)("%s", message)
        for cleanup in [*self.cleanups, *([lambda: self.on_fatal(message, over)] if self.on_fatal else [])]:
            _bounded(cleanup, 2.0)
        logging.shutdown()
        self.exit_fn(rc)


def _bounded(fn: Callable[[], None], timeout_s: float) -> None:
    """Run ``fn`` on a helper thread, waiting at most ``timeout_s`` (a cleanup stuck in a backend must not keep a
    failed rank alive)."""
    def run() -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001
            log.debug("cleanup failed", exc_info=True)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
