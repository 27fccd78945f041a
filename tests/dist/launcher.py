"""Run a function on N real processes that form a torch.distributed world over loopback (test tier b).

    results = run_ranks(fn, 3, args=(x,))   # fn(global_rank, x) runs in 3 processes; results[r] is rank r's return

Each process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a MASTER_PORT the OS
picked, as torchrun would set them; `fn` itself calls `init_distributed` (so that path is what gets tested).
`fn` and `args` must be picklable (a module-level function of an importable module) and so must the return.

Processes come from a forkserver that has already imported torch, so a launch costs a fork, not a ~1 s torch
import per rank (on 2 cores, 3 spawned ranks took ~4.5 s to start; forked ones ~0.05 s after the first).
Each rank runs in its own session so its whole process tree can be killed; every process started here is
killed when `run_ranks` returns or raises, including on timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

from tests.helpers import free_port

__all__ = ["run_ranks", "RankFailed"]


class RankFailed(RuntimeError):
    """A rank raised, died, or the world did not finish in time. The message carries the rank's traceback."""


_CTX: mp.context.BaseContext | None = None


def _context() -> mp.context.BaseContext:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "numpy", "zmq", "msgspec"])
    return _CTX


def _rank_main(fn: Callable, rank: int, env: dict[str, str], args: tuple, results) -> None:
    os.setsid()  # own process group: the parent kills the whole tree with one killpg
    os.environ.clear()
    os.environ.update(env)  # the forkserver's environment is from when it started; use the caller's, now
    try:
        value = fn(rank, *args)
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit/KeyboardInterrupt
        _report_and_exit(results, (rank, False, traceback.format_exc()), 1)
    try:
        payload = (rank, True, value)
        pickle.dumps(payload)
    except Exception:  # noqa: BLE001 - an unpicklable return value
        payload = (rank, False, traceback.format_exc())
    _report_and_exit(results, payload, 0)


def _report_and_exit(results, payload: tuple, code: int) -> None:
    results.put(payload)
    results.close()
    results.join_thread()  # flush the queue's feeder thread before exiting
    os._exit(code)  # skip atexit handlers and destructors that could hang on a dead peer


def run_ranks(fn: Callable[..., Any], world_size: int, *, timeout_s: float = 60, args: tuple = ()) -> list[Any]:
    """Run `fn(global_rank, *args)` on `world_size` processes; return the return values indexed by rank.

    Blocks until every rank returned, one failed, or `timeout_s` passed. Raises RankFailed with the first
    failing rank's traceback (or which ranks were still running at the timeout). Always kills every process
    it started before returning or raising.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = []
    try:
        for rank in range(world_size):
            env = dict(os.environ)
            env.update(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            )
            p = ctx.Process(target=_rank_main, args=(fn, rank, env, args, results), name=f"rank{rank}")
            p.start()
            procs.append(p)
        return _collect(procs, results, world_size, timeout_s)
    finally:
        _kill_all(procs)
        results.close()
        results.cancel_join_thread()


def _collect(procs, results, world_size: int, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    while len(values) < world_size:
        try:
            rank, ok, value = results.get(timeout=0.05)
        except queue.Empty:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(values))
                raise RankFailed(f"timed out after {timeout_s:g} s; ranks still running: {missing}") from None
            for rank, p in enumerate(procs):
                if rank not in values and p.exitcode not in (None, 0):
                    # give its report a moment to arrive before blaming a silent death
                    try:
                        r2, ok2, v2 = results.get(timeout=0.5)
                    except queue.Empty:
                        raise RankFailed(f"rank {rank} died with exit code {p.exitcode} and no report") from None
                    if not ok2:
                        raise RankFailed(f"rank {r2} failed:\n{v2}")
                    values[r2] = v2
            continue
        if not ok:
            raise RankFailed(f"rank {rank} failed:\n{value}")
        values[rank] = value
    return [values[r] for r in range(world_size)]


def _kill_all(procs) -> None:
    for p in procs:
        if p.pid is None:
            continue
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the rank and anything it started
        except (ProcessLookupError, PermissionError):
            pass
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)
