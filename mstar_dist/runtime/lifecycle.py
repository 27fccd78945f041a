"""The skeleton every process main shares (docs/architecture.md §2): a rank (``rank.py``), the front end
(``frontend.py``) and an intake (``intake.py``) each read top-down as parse, build, run, teardown.

A main makes a :class:`Lifecycle` (names the process in the trace, sets up its log lines), builds its parts, calls
:meth:`Lifecycle.catch_signals` when a stop should drain instead of kill, and hands :meth:`Lifecycle.run` three
steps of its own: ``serve`` (build what is left, :meth:`Lifecycle.ready` once serving, then run until
``stop``), ``failed`` (say what went wrong) and ``teardown`` (always runs; each part bounds its own wait and
says whether it finished). A teardown that did not finish leaves by ``os._exit``: a thread stuck in a backend could
block the interpreter's own shutdown too.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

from mstar_dist import trace
from mstar_dist.heap import freeze_startup_heap
from mstar_dist.logs import configure_logging

SHUTDOWN_FLUSH_S = 1.0
"""Bound on the wait for a process's last control messages (``Shutdown`` to every rank, a rank's ``Leaving``) to
leave before its control socket closes (``ControlChannel.close(flush_s=...)``): a peer that is gone keeps them
queued, and the process must still exit well within torchrun's grace between SIGTERM and SIGKILL."""

WATCH_EVERY_S = 0.2
"""How often a serving main checks that its parts still run (:meth:`Lifecycle.wait`)."""


class Lifecycle:
    """One process's life: its name, its ``stop`` event, its log lines, and the try/finally around its work."""

    def __init__(self, name: str, *, log_level: str | int, rank: int | None, host: str, log_format: str,
                 progress: str | None = None) -> None:
        """Name the process ``name`` in its trace file and label its log lines with ``rank`` and ``host``
        (``progress``: the progress bars' mode, None to keep the one set before)."""
        self.name = name
        self.stop = threading.Event()
        """Set by SIGTERM / SIGINT (after :meth:`catch_signals`) or by a part that found the process must end."""
        self.stopped_by: str | None = None
        """The signal that asked this process to stop (``"SIGINT"``: Ctrl-C; ``"SIGTERM"``), None when none did."""
        self.signal_fd: int | None = None
        """After :meth:`catch_signals`: a descriptor that becomes readable (one byte, the signal number) whenever a
        signal arrives, even while the main thread is inside a C call that Python's handlers cannot interrupt (a
        guard thread watches it: ``distributed/guard.py``)."""
        trace.set_process(name)
        configure_logging(log_level, rank=rank, host=host, fmt=log_format, progress=progress)

    def catch_signals(self, wakeup: bool = False) -> None:
        """From now on SIGTERM and SIGINT set ``stop`` (the main's loop ends and teardown runs) instead of ending
        the process where it stands; with ``wakeup``, they also write to ``signal_fd`` (a process that runs no
        asyncio loop on its main thread: such a loop claims the wake-up descriptor for itself)."""
        def stop(signum: int, _frame) -> None:
            self.stopped_by = self.stopped_by or signal.Signals(signum).name
            self.stop.set()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        if wakeup and self.signal_fd is None:
            read_fd, write_fd = os.pipe()
            os.set_blocking(read_fd, False)
            os.set_blocking(write_fd, False)
            signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
            self.signal_fd = read_fd

    def ready(self) -> None:
        """The process is built and about to serve: what is alive now leaves the collector's reach (``heap.py``)."""
        freeze_startup_heap()

    def wait(self, check: Callable[[], None], every_s: float = WATCH_EVERY_S) -> None:
        """Until ``stop``: call ``check`` every ``every_s`` (it raises when a part the process needs has died)."""
        while not self.stop.wait(every_s):
            check()

    def run(self, serve: Callable[[], int], failed: Callable[[Exception], None],
            teardown: Callable[[int], bool]) -> int:
        """``serve()``'s exit status (1 when it raised, after ``failed(exc)``); ``teardown(status)`` runs whatever
        happened and returns whether it finished in time (False: leave at once with the status)."""
        rc = 0
        finished = True
        try:
            rc = serve()
        except Exception as exc:
            rc = 1
            failed(exc)
        finally:
            finished = teardown(rc)
        if not finished:
            trace.flush()  # os._exit skips atexit, which writes the trace otherwise
            logging.shutdown()
            os._exit(rc)
        return rc
