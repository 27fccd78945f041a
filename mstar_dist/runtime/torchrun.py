"""``python -m mstar_dist.runtime.torchrun [torchrun's flags] -m mstar_dist.serve CFG [serve flags]``: torchrun, with
one line instead of a traceback when it ends (docs/architecture.md §2; what ``launch/serve.sh``, ``serve_node.sh`` and
the SLURM script run).

torchrun itself answers Ctrl-C or SIGTERM by stopping its workers with that signal and then raising
``SignalException`` out of its main (a traceback of some 30 lines), and a failed worker with ``ChildFailedError``'s
error summary (another 30); its agent logs a warning per worker it signals. Here the same agent runs (its flags,
rendezvous and restarts are torchrun's own, unchanged), its own log lines are left out (``LOGLEVEL=CRITICAL``: what
they would say, the line below says), and its end is one line on stderr: ``stopped by SIGINT`` (exit 0: a requested stop), or which worker
failed how (exit 1; the worker's own log lines say why), or what kept torchrun from starting them; nothing more for a
mistake that local rank 0 already named in its one line (exit 2: config, flags, a port in use).
"""

from __future__ import annotations

import logging
import os
import signal
import sys


def summary(exc: BaseException) -> tuple[int, str]:
    """The exit status and the one line for how torchrun ended (``exc``: what its ``run`` raised)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(exc, SignalException):
        return 0, f"mstar-dist: stopped by {signal.Signals(exc.sigval).name}"
    if isinstance(exc, ChildFailedError):
        rank, failure = exc.get_first_failure()
        if failure.exitcode == 2 and failure.local_rank == 0:
            return 2, ""  # a mistake (config, flags, port in use) its worker already said in one line
        how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
               else f"exited with status {failure.exitcode}")
        others = len(exc.failures) - 1
        also = f" ({others} other worker(s) of this host failed too)" if others > 0 else ""
        return 1, (f"mstar-dist: worker {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how}{also}; "
                   f"its log lines above say why")
    return 1, f"mstar-dist: torchrun failed: {type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("LOGLEVEL", "CRITICAL")  # read by torch.distributed.elastic's loggers when first made
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(os.environ["LOGLEVEL"])  # its other loggers

    args = parse_args(argv)
    try:
        run(args)
    except Exception as exc:  # noqa: BLE001 - every way torchrun ends is one line here
        rc, line = summary(exc)
        if line:
            print(line, file=sys.stderr, flush=True)
        return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
