"""Opt-in per-request phase trace (docs/architecture.md §2, "Phase trace"): where a request's time goes across the
front end's threads and the ranks.

Off unless ``MSTAR_DIST_TRACE_DIR`` is set when the process starts; then every process (the front end, each rank)
keeps events ``(t, phase, request_id, extra)`` in memory, ``t = time.monotonic()`` (CLOCK_MONOTONIC: one clock
for every process of a host, so events of the front end and of the ranks line up), and writes them at exit as
JSON lines to ``<dir>/trace.<process>.<pid>.jsonl``, one object per line: ``{"t", "phase", "rid", "proc",
"extra"}``; the last line is ``phase = "trace_end"`` with the number of events dropped past the bound.

Call sites guard every call with the module flag, so a process with the trace off pays one attribute read::

    from mstar_dist import trace
    if trace.ON:
        trace.event("cond_admitted", wire_id, client=request_id)

The garbage collector's pauses are events too (``gc``: generation, milliseconds, objects collected; stamped at the
pause's start), since a collection stops every thread of the process it runs in. The list is bounded
(``MAX_EVENTS``); past it events are counted, not kept. Appends are safe from any thread
(``list.append`` under the GIL). The file is written by ``atexit`` and by :func:`flush` (call it on a way out
that skips ``atexit``, such as ``os._exit``); writing again replaces the file with everything recorded so far.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import time

ENV = "MSTAR_DIST_TRACE_DIR"
MAX_EVENTS = 2_000_000

DIR: str | None = os.environ.get(ENV) or None
ON: bool = DIR is not None
"""Whether this process records (read once, at import)."""

_events: list[tuple[float, str, str, dict]] = []
_firsts: set[tuple[str, str]] = set()
_dropped = 0
_process = "proc"
_registered = False


def set_process(name: str) -> None:
    """Name this process in its trace file (``frontend``, ``rank0``, ...)."""
    global _process
    _process = name


def event(phase: str, request_id: str = "", **extra) -> None:
    """Record ``phase`` now, for ``request_id`` ("" for events of no one request; put what they concern in
    ``extra``, which must be JSON-serialisable)."""
    global _dropped
    if len(_events) < MAX_EVENTS:
        _events.append((time.monotonic(), phase, request_id, extra))
    else:
        _dropped += 1


def event_at(t: float, phase: str, request_id: str = "", **extra) -> None:
    """Record ``phase`` at an earlier ``t`` (``time.monotonic()``), e.g. an arrival whose request id is known
    only later."""
    global _dropped
    if len(_events) < MAX_EVENTS:
        _events.append((t, phase, request_id, extra))
    else:
        _dropped += 1


def first(phase: str, request_ids, **extra) -> None:
    """Record ``phase`` for each of ``request_ids`` not recorded under ``phase`` before in this process (a
    request's first token, not every one)."""
    global _dropped
    now = time.monotonic()
    for rid in request_ids:
        key = (phase, rid)
        if key in _firsts:
            continue
        if len(_events) >= MAX_EVENTS:
            _dropped += 1
            continue
        _firsts.add(key)
        _events.append((now, phase, rid, extra))


def events() -> list[tuple[float, str, str, dict]]:
    """A copy of what this process recorded so far."""
    return list(_events)


def path() -> str | None:
    """This process's trace file (None when the trace is off)."""
    if DIR is None:
        return None
    return os.path.join(DIR, f"trace.{_process}.{os.getpid()}.jsonl")


def flush() -> str | None:
    """Write everything recorded so far to :func:`path` (atomically: a temporary file renamed); returns the path,
    None when the trace is off. Never raises: a trace must not fail the process it watches."""
    target = path()
    if target is None:
        return None
    snapshot = list(_events)
    try:
        os.makedirs(DIR, exist_ok=True)
        tmp = f"{target}.tmp"
        with open(tmp, "w") as f:
            for t, phase, rid, extra in snapshot:
                f.write(json.dumps({"t": t, "phase": phase, "rid": rid, "proc": _process, "extra": extra},
                                   default=str))
                f.write("\n")
            f.write(json.dumps({"t": time.monotonic(), "phase": "trace_end", "rid": "", "proc": _process,
                                "extra": {"events": len(snapshot), "dropped": _dropped}}) + "\n")
        os.replace(tmp, target)
    except Exception:  # noqa: BLE001 -- best effort, at exit
        return None
    return target


def reset() -> None:
    """Forget what was recorded (tests)."""
    global _dropped
    _events.clear()
    _firsts.clear()
    _dropped = 0


_gc_started = 0.0


def _on_gc(phase: str, info: dict) -> None:
    """``gc.callbacks`` hook: one ``gc`` event per collection while the trace is on."""
    global _gc_started
    if phase == "start":
        _gc_started = time.monotonic()
    elif ON:
        event_at(_gc_started, "gc", generation=info.get("generation"), collected=info.get("collected"),
                 ms=round((time.monotonic() - _gc_started) * 1e3, 3))


def enable(directory: str | None) -> None:
    """Turn the trace on (into ``directory``) or off (None) in this process; the environment does it at import.
    For tests and tools that run the runtime in one process."""
    global DIR, ON, _registered
    DIR = directory or None
    ON = DIR is not None
    if ON and not _registered:
        _register()


def _register() -> None:
    global _registered
    atexit.register(flush)
    gc.callbacks.append(_on_gc)
    _registered = True


if ON:
    _register()
