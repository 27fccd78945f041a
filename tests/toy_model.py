"""A small deterministic model family for runtime tests (not part of the zoo): counts integers.

Walks: ``start`` runs node ADD once (x -> x + 1, emitted); ``count`` loops node COUNT (x -> x + 1, emitted each
iteration, fed back) up to ``max_tokens - 1`` times. The prompt ``"start=N"`` picks N; failure injection for
isolation tests, by prompt word: ``fail-pre`` (preprocess raises), ``fail-post`` (postprocess raises on the
third value), ``fail-forward`` (COUNT raises for this request at its third step), ``fail-stop`` (the stop check
raises for this request at its third step). Values 1000..2999 carry the forward/stop modes to the component.
Each batch sleeps ``batch_sleep_s`` so concurrent requests share batches.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mstar_dist.engine.component import Component
from mstar_dist.graph.model import CompositeModel, RequestState, WalkStep
from mstar_dist.graph.nodes import EMIT_TO_CLIENT, Edge, GraphNode, Loop
from mstar_dist.graph.walk import NodeResult

FORWARD_BASE, STOP_BASE = 1000, 2000


class Counter(Component):
    def __init__(self, name: str, sleep_s: float):
        self.name = name
        self.sleep_s = sleep_s

    def run_batch(self, calls):
        time.sleep(self.sleep_s)
        out = []
        for call in calls:
            x = int(call.inputs["x"])
            if FORWARD_BASE + 3 == x + 1 and self.name == "COUNT":
                out.append(RuntimeError(f"injected forward failure at x={x}"))
                continue
            try:
                stop = self._stop_check(x + 1)
            except Exception as exc:
                out.append(exc)
                continue
            out.append(NodeResult({"x": torch.tensor([x + 1])}, stop=stop))
        return out

    @staticmethod
    def _stop_check(x: int) -> bool:
        if x == STOP_BASE + 3:
            raise RuntimeError(f"injected stop-check failure at x={x}")
        return x % 100 == 99  # "EOS"


class ToyModel(CompositeModel):
    name = "toy"

    def graphs(self):
        return {
            "start": GraphNode("ADD", inputs=("x",), outputs=(Edge("x"), Edge("x", EMIT_TO_CLIENT))),
            "count": Loop(GraphNode("COUNT", inputs=("x",), outputs=(Edge("x", "COUNT"), Edge("x", EMIT_TO_CLIENT))),
                          max_iters=10_000, outputs=("x",), name="count"),
        }

    def build_component(self, node: str, *, device: str, walks: set[str]) -> Component:
        if self.model_kwargs.get("fail_load") == node:
            raise RuntimeError(f"injected load failure of {node}")
        return Counter(node, float(self.model_kwargs.get("batch_sleep_s", 0.01)))

    def preprocess(self, state: RequestState, prompt: str | None, messages: list[dict] | None) -> None:
        text = prompt if prompt is not None else " ".join(m["content"] for m in messages or [])
        if "fail-pre" in text:
            raise RuntimeError("injected preprocess failure")
        words = dict(w.split("=", 1) for w in text.split() if "=" in w)
        try:
            start = int(words.get("start", 0))
        except ValueError:
            raise ValueError(f"start must be an integer, got {words.get('start')!r}") from None
        if "fail-forward" in text:
            start = FORWARD_BASE
        elif "fail-stop" in text:
            start = STOP_BASE
        state.data.update(x=start, fail_post="fail-post" in text, seen=0)
        state.prompt_tokens = len(text.split())

    def start(self, state: RequestState) -> WalkStep:
        return WalkStep("start", {"x": torch.tensor([state.data["x"]])})

    def after_walk(self, state: RequestState, walk: str, outputs: dict[str, Any]) -> WalkStep | None:
        if walk == "start" and state.max_tokens > 1:
            return WalkStep("count", {"x": outputs["x"]}, loop_limits={"count": state.max_tokens - 1})
        return None

    def postprocess(self, state: RequestState, signal: str, values: list[Any]) -> str:
        texts = []
        for v in values:
            state.data["seen"] += 1
            state.completion_tokens += 1
            if state.data["fail_post"] and state.data["seen"] == 3:
                raise RuntimeError("injected postprocess failure")
            texts.append(f"{int(v)} ")
        return "".join(texts)
