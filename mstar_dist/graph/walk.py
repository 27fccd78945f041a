"""Executes one request's walk on one rank, one node call at a time, so the worker can batch calls across requests.

A :class:`WalkRun` is a small state machine: ``pending`` is the node call it waits on (or ``None`` when done);
the worker runs that call (batched with other requests' calls to the same component) and hands the result to
:meth:`WalkRun.complete`, which routes the outputs along the node's edges and advances to the next call.

Routing rules: an edge to a node delivers the value as that node's input (consumed when the node runs, so a
loop-back edge feeds the next iteration); an edge to :data:`EMIT_TO_CLIENT` calls ``on_emit``; an edge with no
destination is a walk output (kept in the store when ``persist``). Walk inputs are delivered at the start to
every node that declares them. A loop stops at its ``max_iters`` (finish reason ``"length"``), when a node's stop
check asks (``NodeResult.stop``, reason ``"stop"``), or when :meth:`stop_loop` names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Generator

from mstar_dist.graph.nodes import EMIT_TO_CLIENT, GraphNode, Loop, Section, Sequential, iter_nodes


@dataclass
class NodeCall:
    """One node invocation for one request; ``ctx`` is the worker's per-request walk context."""

    run: "WalkRun"
    node: str
    inputs: dict[str, Any]
    iteration: int

    @property
    def request_id(self) -> str:
        return self.run.request_id

    @property
    def ctx(self) -> Any:
        return self.run.ctx


@dataclass
class NodeResult:
    outputs: dict[str, Any]
    stop: bool = False
    """Dynamic stop check fired (e.g. EOS): end the innermost enclosing loop after this call."""


class GraphError(RuntimeError):
    """A walk could not proceed (a required input never arrived, a component misbehaved)."""


@dataclass
class _LoopState:
    loop: Loop
    limit: int
    stopped: str | None = None
    iteration: int = 0


@dataclass
class WalkRun:
    request_id: str
    walk: str
    section: Section
    inputs: dict[str, Any]
    ctx: Any = None
    loop_limits: dict[str, int] = field(default_factory=dict)
    on_emit: Callable[[str, Any], None] = lambda signal, value: None

    def __post_init__(self):
        self.outputs: dict[str, Any] = {}
        self.persist_signals: set[str] = {
            edge.signal for node in iter_nodes(self.section) for edge in node.outputs if edge.persist
        }
        self.finish_reason: str | None = None
        self.pending: NodeCall | None = None
        self._stop_requests: set[str] = set()
        self._loops: list[_LoopState] = []
        self._deliveries: dict[tuple[str, str], Any] = {}
        self._last: dict[str, Any] = {}
        for node in iter_nodes(self.section):
            for name in node.inputs + node.optional_inputs:
                if name in self.inputs:
                    self._deliveries[(node.name, name)] = self.inputs[name]
        self._gen = self._run(self.section)
        self._advance(None)

    @property
    def done(self) -> bool:
        return self.pending is None

    def complete(self, result: NodeResult) -> None:
        """Route ``result`` (for :attr:`pending`) and advance to the next node call or the end."""
        assert self.pending is not None, "complete() on a finished walk"
        self._advance(result)

    def stop_loop(self, name: str) -> None:
        """Stop the named loop after its current iteration (a no-op for a loop that is not running)."""
        self._stop_requests.add(name)
        for state in self._loops:
            if state.loop.name == name and state.stopped is None:
                state.stopped = "stop"

    def _advance(self, result: NodeResult | None) -> None:
        try:
            self.pending = self._gen.send(result) if result is not None else next(self._gen)
        except StopIteration:
            self.pending = None

    def _run(self, section: Section) -> Generator[NodeCall, NodeResult, None]:
        if isinstance(section, GraphNode):
            yield from self._run_node(section)
        elif isinstance(section, Sequential):
            for member in section.members:
                yield from self._run(member)
        elif isinstance(section, Loop):
            yield from self._run_loop(section)
        else:
            raise GraphError(f"walk {self.walk!r}: not a graph section: {section!r}")

    def _run_node(self, node: GraphNode) -> Generator[NodeCall, NodeResult, None]:
        inputs: dict[str, Any] = {}
        for name in node.inputs:
            if (node.name, name) not in self._deliveries:
                raise GraphError(
                    f"walk {self.walk!r}: node {node.name!r} needs input {name!r}, which neither the walk inputs "
                    f"({sorted(self.inputs)}) nor an earlier node provided"
                )
            inputs[name] = self._deliveries.pop((node.name, name))
        for name in node.optional_inputs:
            if (node.name, name) in self._deliveries:
                inputs[name] = self._deliveries.pop((node.name, name))
        iteration = self._loops[-1].iteration if self._loops else 0
        result = yield NodeCall(run=self, node=node.name, inputs=inputs, iteration=iteration)
        self._route(node, result)

    def _route(self, node: GraphNode, result: NodeResult) -> None:
        for edge in node.outputs:
            if edge.signal not in result.outputs:
                continue  # declared outputs are possible outputs
            value = result.outputs[edge.signal]
            self._last[edge.signal] = value
            if edge.dst == EMIT_TO_CLIENT:
                self.on_emit(edge.signal, value)
            elif edge.dst is None:
                self.outputs[edge.signal] = value
            else:
                self._deliveries[(edge.dst, edge.signal)] = value
        if result.stop and self._loops and self._loops[-1].stopped is None:
            self._loops[-1].stopped = "stop"

    def _run_loop(self, loop: Loop) -> Generator[NodeCall, NodeResult, None]:
        limit = self.loop_limits.get(loop.name, loop.max_iters) if loop.name else loop.max_iters
        state = _LoopState(loop=loop, limit=min(limit, loop.max_iters))
        if loop.name in self._stop_requests:
            state.stopped = "stop"
        accumulated: dict[str, list] = {name: [] for name in loop.accumulated_outputs}
        self._loops.append(state)
        try:
            while state.stopped is None and state.iteration < state.limit:
                yield from self._run(loop.section)
                for name in loop.accumulated_outputs:
                    if name in self._last:
                        accumulated[name].append(self._last[name])
                state.iteration += 1
        finally:
            self._loops.pop()
        self.finish_reason = state.stopped or "length"
        for name in loop.outputs:
            if name in self._last:
                self.outputs[name] = self._last[name]
        self.outputs.update(accumulated)
