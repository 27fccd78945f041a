"""Log lines of every rank: each carries the rank and the host; ``--log-format json`` writes one JSON object a
line (``time``, ``level``, ``rank``, ``host``, ``logger``, ``message``, and ``exc`` with a traceback) for log
collectors. One stderr handler on the root logger; uvicorn's loggers propagate to it (``HttpServer``).

Progress bars (``progress_bar``: weight preparation and loading) go to the same stderr, never stdout, labelled with
the rank and host. ``--progress`` (default ``$MSTAR_PROGRESS``, else ``auto``): ``auto`` draws them only when stderr
is a terminal (a log file or a collector would get a carriage-return-separated line per refresh), ``on`` also into
a file (refreshed at most every 5 s), ``off`` never. With ``--log-format json`` they are off: every line must parse.
"""

from __future__ import annotations

import datetime
import io
import json
import logging
import os
import socket
import sys
from collections.abc import Iterable

FORMATS = ("text", "json")
PROGRESS_MODES = ("auto", "on", "off")

_progress = {"who": f"host {socket.gethostname()}", "mode": "auto", "fmt": "text"}
"""What ``progress_bar`` labels its bars with, the ``--progress`` mode and the log format (``configure_logging``)."""


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in messages are escaped)."""

    def __init__(self, rank: int | str | None, host: str) -> None:
        super().__init__()
        self.rank, self.host = rank, host

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname,
            "rank": self.rank,
            "host": self.host,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(level: str | int, *, rank: int | str | None, host: str, fmt: str = "text",
                      progress: str | None = None) -> None:
    """One stderr handler whose lines carry ``rank`` (None: not known yet) and ``host``; calling it again (once
    the logical rank is known) relabels every line and every later progress bar. ``progress``: see the module
    docstring; None keeps the mode set before (``auto`` at first)."""
    if fmt not in FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if progress is not None and progress not in PROGRESS_MODES:
        raise ValueError(f"--progress must be one of {', '.join(PROGRESS_MODES)}, got {progress!r}")
    root = logging.getLogger()
    root.setLevel(level)
    if not root.handlers:
        root.addHandler(logging.StreamHandler(sys.stderr))
    who = f"rank {rank if rank is not None else '?'} host {host}"
    _progress.update(who=who, mode=progress or _progress["mode"], fmt=fmt)
    formatter = (JsonFormatter(rank, host) if fmt == "json"
                 else logging.Formatter(f"%(asctime)s [{who}] %(levelname)s %(name)s: %(message)s"))
    for handler in root.handlers:
        handler.setFormatter(formatter)


def announce(text: str) -> None:
    """A line for the operator (the placement table, the serving URL): printed as is with text logs, a log
    record with JSON logs (so every line stays one JSON object)."""
    if any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers):
        logging.getLogger("mstar_dist").info(text)
    else:
        print(text, flush=True)


def progress_bar(iterable: Iterable, *, desc: str, total: int | None = None, unit: str = "it") -> Iterable:
    """``iterable`` wrapped in a tqdm bar on stderr described as ``[rank R host H] desc`` when the ``--progress``
    mode asks for one (module docstring), else ``iterable`` itself. Draws from the calling thread only."""
    tty = sys.stderr.isatty()
    mode = _progress["mode"]
    if _progress["fmt"] == "json" or mode == "off" or (mode == "auto" and not tty):
        return iterable
    from tqdm import tqdm

    sized = tty and _columns(sys.stderr) > 0  # a pty without a size (some CI runners) reads as 0x0: tqdm hides
    return tqdm(iterable, desc=f"[{_progress['who']}] {desc}", total=total, unit=unit, file=sys.stderr,
                mininterval=0.1 if tty else 5.0, ascii=not tty, dynamic_ncols=sized, ncols=None if sized else 100,
                nrows=None if sized else 24, leave=True)


def _columns(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return 0
