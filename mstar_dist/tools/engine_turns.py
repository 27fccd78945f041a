"""Driving a component in process turn by turn, as the worker drives it (benchmarks that time an engine without HTTP,
conductor or wire: ``scripts/bench_moe30b.py``, ``scripts/profile_speech.py``)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from mstar_dist.engine.scheduler import Held
from mstar_dist.graph.walk import NodeCall


def call(request_id: str, ctx, inputs: dict, node: str = "LLM", iteration: int = 0) -> NodeCall:
    """A call of ``node`` for the walk context ``ctx``, as the worker hands it to ``run_batch`` (``iteration``: the
    turns of its loop before this one)."""
    return NodeCall(run=SimpleNamespace(request_id=request_id, ctx=ctx), node=node, inputs=inputs,
                    iteration=iteration)


def settle(component, calls: list[NodeCall], timeout_s: float = 300.0) -> list[int]:
    """Each call's token: turns of ``run_batch`` until every call has its result (a held call is handed over again,
    as the worker does). TimeoutError naming the unanswered calls after ``timeout_s``."""
    tokens: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    while len(tokens) < len(calls):
        todo = [i for i in range(len(calls)) if i not in tokens]
        for i, result in zip(todo, component.run_batch([calls[i] for i in todo])):
            if isinstance(result, BaseException):
                raise result
            if not isinstance(result, Held) and result is not None:
                tokens[i] = int(result.outputs["token"])
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine: {len(calls) - len(tokens)} of {len(calls)} calls unanswered after "
                               f"{timeout_s} s")
    return [tokens[i] for i in range(len(calls))]
