"""Log lines of every rank: each carries the rank and the host; ``--log-format json`` writes one JSON object a
line (``time``, ``level``, ``rank``, ``host``, ``logger``, ``message``, and ``exc`` with a traceback) for log
collectors. One stderr handler on the root logger; uvicorn's loggers propagate to it (``HttpServer``).
"""

from __future__ import annotations

import datetime
import json
import logging
import sys

FORMATS = ("text", "json")


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


def configure_logging(level: str | int, *, rank: int | str | None, host: str, fmt: str = "text") -> None:
    """One stderr handler whose lines carry ``rank`` (None: not known yet) and ``host``; calling it again (once
    the logical rank is known) relabels every line."""
    if fmt not in FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    root = logging.getLogger()
    root.setLevel(level)
    if not root.handlers:
        root.addHandler(logging.StreamHandler(sys.stderr))
    who = f"rank {rank if rank is not None else '?'} host {host}"
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
