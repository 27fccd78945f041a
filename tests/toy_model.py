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

    def build_component(self, node: str, *, device: str, walks: set[str], engine=None) -> Component:
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


class Codec(Component):
    """Consumes streamed chunks of x: emits the sum of each chunk's new items; its stop check is the final chunk."""

    name = "CODEC"

    def run_batch(self, calls):
        out = []
        for call in calls:
            chunk = call.inputs["x"].reshape(-1)
            new = chunk[int(call.inputs.get("x_context", torch.tensor([0]))):]
            final = bool(call.inputs.get("x_final", torch.tensor([False])))
            out.append(NodeResult({"audio": new.sum().reshape(1)}, stop=final))
        return out


class ToyAudioModel(ToyModel):
    """ToyModel plus a Parallel walk and a streaming partition, like an LLM feeding an audio codec.

    Partition ``text``: walk ``start`` = Parallel(ADD: x -> x + 1, emitted; TWICE: x -> 2x, a walk output), then
    ``count`` (COUNT loop, which also streams every x to CODEC). Partition ``audio``: walk ``codec`` = a loop of
    CODEC over chunks of 3 (policy Fixed(3)), emitting each chunk's sum; it stops on the final chunk. The audio
    text is appended after the counted numbers: ``"| audio: s1 s2 ..."``. A prompt with ``no-audio`` starts the
    audio partition already done.
    """

    name = "toy_audio"

    def graphs(self):
        from mstar_dist.graph.nodes import Parallel

        return {
            "start": Parallel(
                GraphNode("ADD", inputs=("x",), outputs=(Edge("x"), Edge("x", EMIT_TO_CLIENT))),
                GraphNode("TWICE", inputs=("x",), outputs=(Edge("twice"),)),
            ),
            "count": Loop(GraphNode("COUNT", inputs=("x",), outputs=(
                Edge("x", "COUNT"), Edge("x", EMIT_TO_CLIENT), Edge("x", "CODEC", stream=True))),
                max_iters=10_000, outputs=("x",), name="count"),
            "codec": Loop(GraphNode("CODEC", inputs=("x",), optional_inputs=("x_final", "x_context"),
                                    outputs=(Edge("audio", EMIT_TO_CLIENT),)),
                          max_iters=10_000, name="codec"),
        }

    def partitions(self):
        from mstar_dist.graph.partitions import Partition

        return [Partition("text", ("start", "count")), Partition("audio", ("codec",))]

    def streaming_edges(self):
        from mstar_dist.graph.partitions import StreamingEdge
        from mstar_dist.graph.streaming import Fixed

        return [StreamingEdge("x", "text", "audio", "CODEC", Fixed(3))]

    def build_component(self, node: str, *, device: str, walks: set[str], engine=None) -> Component:
        if node == "CODEC":
            return Codec()
        if node == "TWICE":
            return Doubler()
        return super().build_component(node, device=device, walks=walks, engine=engine)

    def start_done(self, state: RequestState) -> set[str]:
        return {"audio"} if state.data.get("no_audio") else set()

    def preprocess(self, state, prompt, messages):
        super().preprocess(state, prompt, messages)
        state.data.update(no_audio="no-audio" in (prompt or ""), audio=[])

    def start(self, state: RequestState):
        steps = [WalkStep("start", {"x": torch.tensor([state.data["x"]])})]
        if not state.data["no_audio"]:
            steps.append(WalkStep("codec", {}))
        return steps

    def after_walk(self, state, walk, outputs):
        if walk == "start":
            state.data["twice"] = int(outputs["twice"])
        if walk == "codec":
            return None
        return super().after_walk(state, walk, outputs)

    def postprocess(self, state, signal, values):
        if signal == "audio":
            state.data["audio"].extend(int(v) for v in values)
            return ""
        return super().postprocess(state, signal, values)

    def finish_text(self, state):
        if state.data.get("no_audio"):
            return f"| twice: {state.data['twice']}"
        return f"| twice: {state.data['twice']} | audio: {' '.join(map(str, state.data['audio']))}"


class Doubler(Component):
    name = "TWICE"

    def run_batch(self, calls):
        return [NodeResult({"twice": call.inputs["x"] * 2}) for call in calls]


class Blob(Component):
    """MAKE: x -> a kept 80 KB tensor full of x (too big to inline); USE: blob -> its sum; PEEK: blob -> its max."""

    def __init__(self, name: str):
        self.name = name

    def run_batch(self, calls):
        out = []
        for call in calls:
            if self.name == "MAKE":
                out.append(NodeResult({"blob": torch.full((20_000,), float(call.inputs["x"]))}))
            elif self.name == "USE":
                out.append(NodeResult({"s": call.inputs["blob"].sum().reshape(1)}))
            else:
                out.append(NodeResult({"s": call.inputs["blob"].max().reshape(1)}))
        return out


class ToyFanoutModel(ToyModel):
    """One kept tensor consumed by two later walks: ``make`` persists ``blob``; ``use`` (keeps it) and ``peek``
    (consumes it for the last time) read it, wherever they run. Text: ``"<sum> <max> "``."""

    name = "toy_fanout"

    def graphs(self):
        return {
            "make": GraphNode("MAKE", inputs=("x",), outputs=(Edge("blob", persist=True),)),
            "use": GraphNode("USE", inputs=("blob",), outputs=(Edge("s", EMIT_TO_CLIENT),)),
            "peek": GraphNode("PEEK", inputs=("blob",), outputs=(Edge("s", EMIT_TO_CLIENT),)),
        }

    def build_component(self, node: str, *, device: str, walks: set[str], engine=None) -> Component:
        return Blob(node)

    def start(self, state):
        return WalkStep("make", {"x": torch.tensor([state.data["x"]])})

    def after_walk(self, state, walk, outputs):
        if walk == "make":
            state.data["blob"] = outputs["blob"]
            return WalkStep("use", {"blob": state.data["blob"]}, keep=frozenset({"blob"}))
        if walk == "use":
            return WalkStep("peek", {"blob": state.data["blob"]})
        return None

    def postprocess(self, state, signal, values):
        state.completion_tokens += len(values)
        return "".join(f"{float(v):g} " for v in values)


def audio_text(start: int, max_tokens: int, audio: bool = True) -> str:
    """The text ToyAudioModel answers for prompt ``start=<start>`` and ``max_tokens``."""
    xs = [start + i for i in range(1, max_tokens + 1)]
    streamed = xs[1:]  # the count walk streams; the first value comes from the start walk
    head = "".join(f"{x} " for x in xs) + f"| twice: {2 * start}"
    if not audio:
        return head
    full = [sum(streamed[i : i + 3]) for i in range(0, len(streamed) - len(streamed) % 3, 3)]
    final = sum(streamed[len(streamed) - len(streamed) % 3 :])  # the final chunk: the remainder (maybe empty)
    return head + " | audio: " + " ".join(map(str, [*full, final]))


class Stepper(Component):
    """STEP: x -> y, ``width`` copies of x + 1 (``width`` large makes y travel on the pair, not inline), and k, x + 1
    as a one-element tensor (a small walk output); its stop
    check fires when x + 1 is a multiple of 100. CHECK: y -> x = y[0], emitted; its stop check fires when x ends
    in 37. ``run_batch`` of each runs wherever the placement puts it."""

    def __init__(self, name: str, width: int):
        self.name, self.width = name, width

    def run_batch(self, calls):
        out = []
        for call in calls:
            if self.name == "STEP":
                x = int(call.inputs["x"].reshape(-1)[0])
                out.append(NodeResult({"y": torch.full((self.width,), float(x + 1)), "k": torch.tensor([x + 1])},
                                      stop=(x + 1) % 100 == 0))
            else:
                x = int(call.inputs["y"][0])
                out.append(NodeResult({"x": torch.tensor([x])}, stop=x % 100 == 37))
        return out


class ToySpanModel(ToyModel):
    """One walk whose loop body has two nodes that a deployment may put on different ranks.

    Walk ``span`` = Loop(STEP -> CHECK, back to STEP), named ``span``, ``outputs=("x",)``,
    ``accumulated_outputs=("k",)`` (from STEP): each iteration adds 1 and CHECK emits it. The loop stops after
    ``max_tokens`` iterations, or after the iteration in which STEP (x + 1 a multiple of 100) or CHECK (x ending
    in 37) raises its stop. The text ends with ``| last: <x> | rows: <iterations> | sum: <sum of k>``, made
    from the walk's outputs. ``model_kwargs.width`` sets how many floats y carries (default 4).
    """

    name = "toy_span"

    def graphs(self):
        from mstar_dist.graph.nodes import Sequential

        body = Sequential(GraphNode("STEP", inputs=("x",), outputs=(Edge("y", "CHECK"), Edge("k"))),
                          GraphNode("CHECK", inputs=("y",), outputs=(Edge("x", "STEP"), Edge("x", EMIT_TO_CLIENT))))
        return {"span": Loop(body, max_iters=10_000, outputs=("x",), accumulated_outputs=("k",), name="span")}

    def build_component(self, node: str, *, device: str, walks: set[str], engine=None) -> Component:
        return Stepper(node, int(self.model_kwargs.get("width", 4)))

    def start(self, state):
        return WalkStep("span", {"x": torch.tensor([state.data["x"]])}, loop_limits={"span": state.max_tokens})

    def after_walk(self, state, walk, outputs):
        ks = outputs["k"]
        state.data["tail"] = f"| last: {int(outputs['x'])} | rows: {ks.shape[0]} | sum: {int(ks.sum())}"
        return None

    def finish_text(self, state):
        return state.data.get("tail", "")


def span_text(start: int, max_tokens: int) -> str:
    """The text ToySpanModel answers for prompt ``start=<start>`` and ``max_tokens``."""
    xs = []
    x = start
    while len(xs) < max_tokens:
        x += 1
        xs.append(x)
        if x % 100 == 0 or x % 100 == 37:
            break
    return "".join(f"{v} " for v in xs) + f"| last: {xs[-1]} | rows: {len(xs)} | sum: {sum(xs)}"
