"""Executes one request's walk on one rank, so the worker can batch node calls across requests (docs/architecture.md §4).

A :class:`WalkRun` is a state machine with no threads and no I/O. :meth:`WalkRun.ready` hands out the node calls that
became runnable (several at once inside a ``Parallel``); the worker runs them, batched with other requests' calls to
the same component, and hands each result to :meth:`WalkRun.complete`, which routes its outputs and may make more
calls ready. Values from outside the walk during it (a streamed chunk, an input from another rank) come in through
:meth:`WalkRun.deliver`.

Readiness: a ``Sequential`` starts member ``i + 1`` when member ``i`` has finished; a ``Parallel`` starts all its
members. A started node runs once its required inputs are present, each of its ``until_end`` inputs holds a value or
has ended (:meth:`WalkRun.end_input`: its stream is over), and every ``Parallel`` sibling member that feeds it has
finished; it runs once per iteration of its loops (once per walk outside loops).

Routing: an edge to a node queues the value as that node's input; the node consumes it when it runs. Each input
holds at most two values: one for the node's next run and one for the run after (a loop-back value, or a delivered
one that came while a value was still waiting); a third is a :class:`GraphError`, as is a value for a node that
already ran outside any loop: a value is never silently dropped or overwritten. Exceptions: an edge that leaves a
loop keeps only its latest value (the last iteration's), and when a loop's run ends, the values that nodes of the
walk queued for the loop's nodes are dropped (they were for iterations that will not happen; an inner loop restarts
fresh each outer iteration), while values from outside the walk are kept. An edge to :data:`EMIT_TO_CLIENT` calls
``on_emit``; an edge with no destination is a walk output (kept in the store when ``persist``). Declared outputs
a node does not return are skipped. Walk inputs go, at the start, to every external input of that name
(:func:`mstar_dist.graph.io.walk_io`), not to inputs an internal edge feeds.

Loops: a loop runs up to ``min(loop_limits[name], max_iters)`` iterations (reason ``"length"``: the one place a
request's "length" is decided, its token budget being a loop limit) and ends early, after the current iteration,
when a call of a node it holds innermost returns ``NodeResult.stop`` or when :meth:`WalkRun.stop_loop` names it
(reason ``"stop"``). Stopping a loop stops no other loop. The walk's
``finish_reason`` is that of its outermost loop (the last one to end, if several), ``None`` without loops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection

from mstar_dist.graph.io import Port
from mstar_dist.graph.nodes import GraphNode, Loop, Parallel, Section, Sequential, iter_nodes
from mstar_dist.graph.wiring import OUTPUT, PUSH, STREAM, wire


@dataclass(eq=False)
class NodeCall:
    """One node invocation for one request; ``ctx`` is the worker's per-request walk context. Compared by identity."""

    run: "WalkRun"
    node: str
    inputs: dict[str, Any]
    iteration: int
    """Iteration of the innermost loop holding the node (0 outside loops)."""

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
    """Dynamic stop check fired (e.g. EOS): end the innermost loop holding the node after this iteration."""


class GraphError(RuntimeError):
    """A walk could not proceed (a required input never arrived, a value would be lost, a call is unknown)."""


def _origin(source: str | None) -> str:
    """Where a value came from, for an error message (built only when one is raised: ``_push`` runs per token)."""
    return f"node {source!r}" if source else "outside the walk"


def _ignore(signal: str, value: Any) -> None:
    """A closed run's ``on_emit`` and ``on_stream``."""


class _Frame:
    """Run-time state of one section of one walk; ``start`` (re)starts it, ``parent.child_done`` reports its end."""

    def __init__(self, run: "WalkRun", parent: "_Frame | None"):
        self.run = run
        self.parent = parent
        self.done = False

    def start(self) -> None:
        raise NotImplementedError

    def child_done(self, child: "_Frame") -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        self.done = True
        if self.parent is None:
            self.run._done = True
        else:
            self.parent.child_done(self)


class _NodeFrame(_Frame):
    def __init__(self, run: "WalkRun", parent: _Frame | None, node: GraphNode, loops: tuple["_LoopFrame", ...]):
        super().__init__(run, parent)
        self.node = node
        self.loops = loops
        """Loops holding the node, outermost first."""
        self.state = "idle"  # idle -> waiting (started) -> running (call handed out) -> done
        self.waits_on: tuple[_Frame, ...] = ()

    def start(self) -> None:
        self.done = False
        self.state = "waiting"

    def ran(self) -> None:
        self.state = "done"
        self._finish()


class _SequentialFrame(_Frame):
    members: list[_Frame]

    def start(self) -> None:
        self.done = False
        self.index = 0
        self._start_current()

    def _start_current(self) -> None:
        if self.index == len(self.members):
            self._finish()
        else:
            self.members[self.index].start()

    def child_done(self, child: _Frame) -> None:
        self.index += 1
        self._start_current()


class _ParallelFrame(_Frame):
    members: list[_Frame]

    def start(self) -> None:
        self.done = False
        self.remaining = len(self.members)
        if not self.members:
            self._finish()
        for member in self.members:
            member.start()

    def child_done(self, child: _Frame) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self._finish()


class _LoopFrame(_Frame):
    body: _Frame

    def __init__(self, run: "WalkRun", parent: _Frame | None, loop: Loop, outer: "_LoopFrame | None"):
        super().__init__(run, parent)
        self.loop = loop
        self.outer = outer
        self.node_names = frozenset(node.name for node in iter_nodes(loop))
        self.running = False
        self.iteration = 0
        self.stopped: str | None = None
        self._advancing = False
        self._again = False

    def start(self) -> None:
        self.done = False
        self.running = True
        self.iteration = 0
        self.limit = self.run._loop_limit(self.loop)
        self.stopped = "stop" if self.run._take_stop_request(self.loop.name) else None
        self.latest: dict[str, Any] = {}
        self.current: dict[str, Any] = {}
        self.accumulated: dict[str, list] = {signal: [] for signal in self.loop.accumulated_outputs}
        self._next_iteration()

    def record(self, signal: str, value: Any) -> None:
        """A node inside the loop emitted ``signal``."""
        if signal in self.loop.outputs or signal in self.accumulated:
            self.current[signal] = self.latest[signal] = value

    def _next_iteration(self) -> None:
        # A body can end inside its own start() (its inner loops run 0 times): iterate here instead of recursing,
        # so a long loop of empty iterations cannot exhaust the stack.
        if self._advancing:
            self._again = True
            return
        self._advancing = True
        while self.stopped is None and self.iteration < self.limit:
            self._again = False
            self.body.start()
            if not self._again:
                self._advancing = False
                return
        self._advancing = False
        self.running = False
        self.run._loop_ended(self)
        self._finish()

    def child_done(self, child: _Frame) -> None:
        for signal, values in self.accumulated.items():
            if signal in self.current:
                values.append(self.current[signal])
        self.current = {}
        self.iteration += 1
        self._next_iteration()


def runs_no_node(section: Section, loop_limits: dict[str, int]) -> bool:
    """A walk of ``section`` with these loop limits ends as it starts, running no node: its root is a named loop given
    no iteration (a decode loop with no token left to make). The conductor completes such a walk without a rank."""
    return isinstance(section, Loop) and section.name is not None and \
        min(loop_limits.get(section.name, section.max_iters), section.max_iters) <= 0


@dataclass
class WalkRun:
    """One request's walk on one rank (see the module docstring). Not thread-safe; never blocks. Raises
    ``ValueError`` for an invalid graph (:func:`mstar_dist.graph.validate.validate`) and ``GraphError`` when the
    walk cannot proceed; after an error the run is unusable."""

    request_id: str
    walk: str
    section: Section
    inputs: dict[str, Any]
    ctx: Any = None
    loop_limits: dict[str, int] = field(default_factory=dict)
    on_emit: Callable[[str, Any], None] = lambda signal, value: None
    on_stream: Callable[[str, Any], None] = lambda signal, value: None
    """Called with each value a node sends on a streaming edge (to another partition)."""
    streamed_inputs: Collection[str] = frozenset()
    """Input signals that arrive through :meth:`deliver` during the walk: a node missing only these waits for them
    instead of failing the walk as stalled."""
    emitting_nodes: Collection[str] | None = None
    """Nodes whose edges to :data:`EMIT_TO_CLIENT` and streaming edges this run performs (``None``: every node).
    A copy of a walk that spans ranks emits only for its own nodes; the rank that ran a node emits its values."""

    def __post_init__(self):
        self.outputs: dict[str, Any] = {}
        self._wiring = wire(self.section)
        self.persist_signals = self._wiring.persist_signals
        self.stream_signals = self._wiring.stream_signals
        self.finish_reason: str | None = None
        self._done = False
        self._nodes: dict[str, _NodeFrame] = {}
        self._named_loops: dict[str, _LoopFrame] = {}
        self._positions: dict[tuple[int, ...], _Frame] = {}
        self._inbox: dict[tuple[str, str], list[tuple[str | None, Any]]] = {}
        self._outstanding: dict[NodeCall, _NodeFrame] = {}
        self._fresh: list[NodeCall] = []
        self._stop_requests: set[str] = set()
        self._ended: set[tuple[str, str]] = set()  # (node, until_end input) whose stream has ended
        root = self._build(self.section, None, (), ())
        for name, positions in self._wiring.waits_on.items():
            self._nodes[name].waits_on = tuple(self._positions[p] for p in sorted(positions))
        for port in self._wiring.io.external_inputs:
            if port.signal in self.inputs:
                self._push(port.node, port.signal, self.inputs[port.signal], source=None)
        root.start()
        self._pump()

    # ---- public API ----
    @property
    def done(self) -> bool:
        """The walk has finished: every section ran; ``outputs`` and ``finish_reason`` are final."""
        return self._done

    @property
    def outstanding(self) -> tuple[NodeCall, ...]:
        """Calls handed out (or ready to be) and not completed yet, in the order they became ready."""
        return tuple(self._outstanding)

    @property
    def external_inputs(self) -> tuple[Port, ...]:
        """Inputs this walk takes from outside (walk inputs or :meth:`deliver`); see :func:`walk_io`."""
        return self._wiring.io.external_inputs

    def ready(self) -> list[NodeCall]:
        """Calls that became runnable since the last ``ready()``; each call is handed out exactly once."""
        calls, self._fresh = self._fresh, []
        return calls

    def complete(self, call: NodeCall, result: NodeResult) -> None:
        """Route ``call``'s outputs, end its node's run, and make what that unblocks ready. Raises ``GraphError`` for
        a call that is not outstanding, a value that would be lost, or a walk that can no longer proceed."""
        frame = self._outstanding.pop(call, None)
        if frame is None:
            raise GraphError(f"walk {self.walk!r}: complete() for a call of node {call.node!r} that is not "
                             f"outstanding (completed already, or from another walk)")
        if self._fresh and call in self._fresh:
            self._fresh.remove(call)
        self_loop = self._wiring.self_loops.get(call.node)
        if self_loop is not None and self._iterate(frame, result, *self_loop):
            return
        self._route(frame, result)
        if result.stop and frame.loops and frame.loops[-1].stopped is None:
            frame.loops[-1].stopped = "stop"
        frame.ran()
        self._pump()

    def deliver(self, node: str, signal: str, value: Any) -> None:
        """An input from outside the walk, during it (a streamed chunk, a value from another rank). It is for the
        node's next run: if the node already ran in the current iteration, or a value is already waiting, it waits
        for the next iteration; a third value while one is queued raises ``GraphError``."""
        self.deliver_many(node, {signal: value})

    def deliver_many(self, node: str, values: dict[str, Any]) -> None:
        """Several inputs of one node that belong together (a streamed chunk with its ``_final``/``_context``
        flags): queued for the same run, all or none (``GraphError`` before anything is queued)."""
        if self._done:
            raise GraphError(f"walk {self.walk!r} is done: cannot deliver {sorted(values)} to node {node!r}")
        frame = self._nodes.get(node)
        if frame is None:
            raise GraphError(f"walk {self.walk!r}: cannot deliver {sorted(values)}: no node {node!r} "
                             f"(nodes: {sorted(self._nodes)})")
        for signal in values:
            if signal not in (*frame.node.inputs, *frame.node.optional_inputs, *frame.node.until_end):
                raise GraphError(f"walk {self.walk!r}: cannot deliver {signal!r}: node {node!r} has no such input "
                                 f"(inputs: {list(frame.node.inputs)}, optional: {list(frame.node.optional_inputs)}, "
                                 f"until_end: {list(frame.node.until_end)})")
            if len(self._inbox.get((node, signal), ())) >= 2:
                raise GraphError(f"walk {self.walk!r}: node {node!r} input {signal!r} already holds a value for its "
                                 f"next run and one for the run after; rejected a third from outside the walk")
        for signal, value in values.items():
            self._push(node, signal, value, source=None)
        self._pump()

    def end_input(self, node: str, signal: str) -> None:
        """The stream feeding ``node``'s ``until_end`` input ``signal`` has ended: once the values already queued
        for it are taken, the node runs without it. A no-op once the walk is done; ``GraphError`` for a node or
        input the walk does not have."""
        if self._done:
            return
        frame = self._nodes.get(node)
        if frame is None or signal not in frame.node.until_end:
            raise GraphError(f"walk {self.walk!r}: end_input({node!r}, {signal!r}): no such until_end input")
        self._ended.add((node, signal))
        self._pump()

    def stop_loop(self, name: str) -> None:
        """Stop the named loop after its current iteration; if it is not running, its next run does not iterate.
        A no-op for a name that is not a loop of this walk."""
        frame = self._named_loops.get(name)
        if frame is None:
            return
        if not frame.running:
            self._stop_requests.add(name)
        elif frame.stopped is None:
            frame.stopped = "stop"

    def close(self) -> None:
        """Let go of the run-time state once the run is over (finished, failed or removed); ``outputs`` and
        ``finish_reason`` stay readable, nothing else may be called. The frames point back at the run and at each
        other, and the handed-out calls at the run: left alone, every finished walk would be a reference cycle that
        only the cyclic collector frees, with its tensors (dozens of objects a request, whose collection pauses the
        rank in the middle of a decode wave)."""
        for frame in self._positions.values():
            frame.__dict__.clear()
        for held in (self._positions, self._nodes, self._named_loops, self._outstanding, self._inbox, self._fresh,
                     self._ended):
            held.clear()
        self.on_emit = self.on_stream = _ignore

    # ---- building ----
    def _build(
        self, sec: Section, parent: _Frame | None, pos: tuple[int, ...], loops: tuple[_LoopFrame, ...]
    ) -> _Frame:
        """Build the frame of ``sec`` at position ``pos`` (member indices from the root) and its children's."""
        frame: _Frame
        if isinstance(sec, GraphNode):
            frame = self._nodes[sec.name] = _NodeFrame(self, parent, sec, loops)
        elif isinstance(sec, (Sequential, Parallel)):
            frame = _SequentialFrame(self, parent) if isinstance(sec, Sequential) else _ParallelFrame(self, parent)
            frame.members = [self._build(m, frame, pos + (i,), loops) for i, m in enumerate(sec.members)]
        else:
            frame = _LoopFrame(self, parent, sec, outer=loops[-1] if loops else None)
            frame.body = self._build(sec.section, frame, pos + (0,), loops + (frame,))
            if sec.name is not None:
                self._named_loops[sec.name] = frame
        self._positions[pos] = frame
        return frame

    # ---- routing ----
    def _route(self, frame: _NodeFrame, result: NodeResult) -> None:
        name = frame.node.name
        outputs = result.outputs
        for hop in self._wiring.routes[name]:
            if hop.signal not in outputs:
                continue  # declared outputs are possible outputs
            value = outputs[hop.signal]
            for depth in hop.records:
                frame.loops[depth].record(hop.signal, value)
            if hop.kind == PUSH:
                self._push(hop.dst, hop.signal, value, source=name, latest_only=hop.latest_only)
            elif hop.kind == OUTPUT:
                self.outputs[hop.signal] = value
            elif self.emitting_nodes is None or name in self.emitting_nodes:
                (self.on_stream if hop.kind == STREAM else self.on_emit)(hop.signal, value)

    def _iterate(self, frame: _NodeFrame, result: NodeResult, fed: tuple[str, ...],
                 keys: tuple[tuple[str, str], ...]) -> bool:
        """``complete`` for a self-loop node (``wiring.Wiring.self_loops``) whose loop goes on after this iteration, with
        nothing queued for the node from outside: route the outputs, end the iteration and issue the next call, as
        ``_route``, ``ran`` and ``_pump`` would, in one pass (every row of every decode step comes here). False, with
        nothing changed, when the generic path must run (the loop ends or stops, an output is missing, a value waits
        in the node's inbox)."""
        loop = frame.loops[-1]
        if result.stop or loop.stopped is not None or loop.iteration + 1 >= loop.limit:
            return False
        outputs = result.outputs
        for signal in fed:
            if signal not in outputs:
                return False
        inbox = self._inbox
        for key in keys:
            if inbox.get(key):
                return False
        name = frame.node.name
        hops = self._wiring.routes[name]
        inputs = {}
        for hop in hops:
            if hop.signal not in outputs:
                continue
            value = outputs[hop.signal]
            for depth in hop.records:
                frame.loops[depth].record(hop.signal, value)
            if hop.kind == PUSH:
                inputs[hop.signal] = value
            elif hop.kind == OUTPUT:
                self.outputs[hop.signal] = value
            elif self.emitting_nodes is None or name in self.emitting_nodes:
                (self.on_stream if hop.kind == STREAM else self.on_emit)(hop.signal, value)
        loop.current = {}
        loop.iteration += 1
        call = NodeCall(run=self, node=name, inputs=inputs, iteration=loop.iteration)
        self._outstanding[call] = frame  # the frame stays "running": its next run is handed out at once
        self._fresh.append(call)
        return True

    def _push(self, node: str, signal: str, value: Any, *, source: str | None, latest_only: bool = False) -> None:
        frame = self._nodes[node]
        if not frame.loops and frame.state in ("running", "done"):
            raise GraphError(f"walk {self.walk!r}: node {node!r} already ran and is in no loop, so the value of its "
                             f"input {signal!r} from {_origin(source)} would be lost")
        queue = self._inbox.setdefault((node, signal), [])
        if latest_only and queue:
            queue[:] = [(src, v) for src, v in queue if src != source]
        if len(queue) >= 2:
            raise GraphError(f"walk {self.walk!r}: node {node!r} input {signal!r} already holds a value for its next "
                             f"run and one for the run after; rejected a third from {_origin(source)}")
        queue.append((source, value))

    def _loop_ended(self, frame: _LoopFrame) -> None:
        for signal in frame.loop.outputs:
            if signal in frame.latest:
                self.outputs[signal] = frame.latest[signal]
        self.outputs.update(frame.accumulated)
        if frame.outer is None:
            self.finish_reason = frame.stopped or "length"
        for (node, _), queue in self._inbox.items():
            if node in frame.node_names:
                queue[:] = [(src, v) for src, v in queue if src is None]

    def _loop_limit(self, loop: Loop) -> int:
        limit = loop.max_iters if loop.name is None else self.loop_limits.get(loop.name, loop.max_iters)
        return max(0, min(limit, loop.max_iters))

    def _take_stop_request(self, name: str | None) -> bool:
        if name in self._stop_requests:
            self._stop_requests.discard(name)
            return True
        return False

    # ---- readiness ----
    def _pump(self) -> None:
        for frame in self._nodes.values():
            if frame.state == "waiting" and self._is_ready(frame):
                self._issue(frame)
        if not self._done and not self._outstanding:
            self._check_stall()

    def _is_ready(self, frame: _NodeFrame) -> bool:
        name = frame.node.name
        inbox = self._inbox
        for signal in frame.node.inputs:
            if not inbox.get((name, signal)):
                return False
        for signal in frame.node.until_end:  # (an empty tuple for most nodes)
            if not inbox.get((name, signal)) and (name, signal) not in self._ended:
                return False
        for before in frame.waits_on:
            if not before.done:
                return False
        return True

    def _issue(self, frame: _NodeFrame) -> None:
        node = frame.node
        inputs = {signal: self._inbox[(node.name, signal)].pop(0)[1] for signal in node.inputs}
        for signals in (node.optional_inputs, node.until_end):
            for signal in signals:
                queue = self._inbox.get((node.name, signal))
                if queue:
                    inputs[signal] = queue.pop(0)[1]
        frame.state = "running"
        iteration = frame.loops[-1].iteration if frame.loops else 0
        call = NodeCall(run=self, node=node.name, inputs=inputs, iteration=iteration)
        self._outstanding[call] = frame
        self._fresh.append(call)

    def _check_stall(self) -> None:
        """Nothing is running and nothing can run: wait if a streamed input can still unblock a node, else raise."""
        blocked = []
        for frame in self._nodes.values():
            if frame.state != "waiting":
                continue
            name = frame.node.name
            missing = [s for s in frame.node.inputs if not self._inbox.get((name, s))]
            live = [s for s in frame.node.until_end if not self._inbox.get((name, s)) and (name, s) not in self._ended]
            if (missing or live) and set(missing) <= set(self.streamed_inputs):
                return
            if missing:
                blocked.append(self._describe_missing(frame, missing))
        assert blocked, f"walk {self.walk!r}: not done, nothing outstanding and no node waiting"
        raise GraphError(f"walk {self.walk!r} cannot proceed: " + "; ".join(blocked))

    def _describe_missing(self, frame: _NodeFrame, missing: list[str]) -> str:
        inputs = "inputs " if len(missing) > 1 else "input "
        text = (f"node {frame.node.name!r} needs {inputs}{', '.join(map(repr, missing))}, which neither the walk "
                f"inputs ({sorted(self.inputs)}) nor an earlier node provided")
        if frame.loops:
            loop = frame.loops[-1]
            text += f" (iteration {loop.iteration} of loop {loop.loop.name or 'unnamed'!r})"
        return text
