"""The conductor: request lifecycle, walk transitions, rank liveness and stop strings (docs/architecture.md §2, §6).

It runs in the front-end process on rank 0's host, on one thread of its own (:meth:`Conductor.start`), and owns its
control channel ``"conductor"`` (connected to every rank and to every HTTP intake process); all request state lives
on that thread. Requests come in as commands (:mod:`mstar_dist.conductor.commands`): from the in-process HTTP backend
(``conductor/backend.py``) through :meth:`Conductor.command` (a thread-safe queue plus a wake-up of the channel), or
from an intake's ``Submit`` (``conductor/intake_hub.py``). Admission is ``conductor/admission.py``; where each walk
runs and what its dispatch sends where is ``conductor/routes.py``. Events go back to each request's sink. Nothing here
touches device tensors.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import msgspec
import torch

from mstar_dist import trace
from mstar_dist.conductor.admission import Admission
from mstar_dist.conductor.commands import Command, RankDied, Sink, Submit
from mstar_dist.conductor.intake_hub import IntakeHub
from mstar_dist.conductor.liveness import Liveness
from mstar_dist.conductor.membership import Membership
from mstar_dist.conductor.metrics import Metrics
from mstar_dist.conductor.fanout import Fanout
from mstar_dist.conductor.request import Request, check_knobs, request_seed, request_state, walk_seed
from mstar_dist.conductor.routes import Routes
from mstar_dist.control import messages as m
from mstar_dist.control.envelope import CONDUCTOR, Reject, is_rank, open_envelope, parse_rank, rank_name
from mstar_dist.control.port import ControlPort
from mstar_dist.events import BackendError, Finished, GenerationParams, MediaDelta, TextDelta, as_deltas
from mstar_dist.graph.model import CompositeModel, WalkStep
from mstar_dist.graph.partitions import PartitionTracker, check_partitions
from mstar_dist.graph.walk import WalkRun, runs_no_node
from mstar_dist.topology.placement import Placement
from mstar_dist.transport.inline import decode_ids, decode_tensor, encode_tensor

__all__ = ["Conductor"]

log = logging.getLogger(__name__)


class Conductor(Liveness):
    """Every request of the deployment, on one thread (see the module docstring); rank failures, restarts and
    rejoins are its :class:`~mstar_dist.conductor.liveness.Liveness` part."""

    def __init__(
        self,
        *,
        model: CompositeModel,
        placement: Placement,
        channel: ControlPort,
        token: str,
        world_size: int,
        max_concurrent: int,
        request_timeout_s: float,
        rank_hosts: dict[int, str],
        max_queued: int = 256,
        rank_timeout_s: float = 30.0,
        log_stats_s: float | None = None,
        intakes: tuple[str, ...] = (),
        p2p_pairs: tuple[tuple[int, int], ...] = (),
        restarts: bool = False,
        rejoin_timeout_s: float = 300.0,
        retry_in_flight: bool = False,
    ):
        """``intakes``: names of the HTTP intake processes whose control sockets ``channel`` is connected to (none:
        the in-process ``ConductorBackend`` is the only way in). ``p2p_pairs``: the data plane's pair groups (a
        rejoining rank forms its own again); ``restarts``: dead ranks may come back (``restart.max_restarts`` > 0),
        each within ``rejoin_timeout_s``; ``retry_in_flight``: ``restart.retry_in_flight``."""
        self.model, self.placement, self.channel, self.token = model, placement, channel, token
        self.world_size, self.rank_hosts = world_size, rank_hosts
        self.request_timeout_s = request_timeout_s
        self.rank_timeout_s = rank_timeout_s
        self.log_stats_s = log_stats_s
        self.last_seen: dict[int, float] = {}
        self.left_at: float | None = None
        """When a rank last left on a signal (see ``Liveness._check_servable``)."""
        self.last_rank_check: float | None = None
        """When ``check_ranks`` last ran (a long gap since: the conductor itself was stopped)."""
        self.retry_in_flight = retry_in_flight
        self.membership = Membership(world_size=world_size, rank_hosts=rank_hosts, p2p_pairs=p2p_pairs,
                                     restarts=restarts, rejoin_timeout_s=rejoin_timeout_s,
                                     repair_timeout_s=60.0, send=self._send,
                                     reconnect=lambda name, ep: self.channel.reconnect(name, ep))
        self.dead_ranks = self.membership.dead
        self._read_model(model)
        self.routes = Routes(graphs=self.graphs, partitions=self.partitions, streams=self.streams,
                             placement=placement, world_size=world_size, rank_hosts=rank_hosts)
        self.metrics = Metrics(world_size)
        self.metrics.dead_ranks = self.dead_ranks
        self.metrics.load = lambda: (len(self._active), len(self.admission.queue))
        self.admission = Admission(max_concurrent=max_concurrent, max_queued=max_queued, metrics=self.metrics)
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.ready_ranks: dict[int, float] = {}
        self.failed: str | None = None
        self.serving = False
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        """The thread running :meth:`run` (see :meth:`start`)."""
        self._active: dict[str, Request] = {}  # by the client's request id (a choice's: conductor/fanout.py)
        self._fanouts: dict[str, Fanout] = {}  # requests with n > 1, by the client's request id
        self._by_wire: dict[str, Request] = {}
        self._incarnation = 0
        self._health: tuple[bool, str] = (True, "ok")
        """What ``health`` answers once serving, published by the thread that owns the requests when a rank dies."""
        self.intakes = IntakeHub(intakes, send=self._send_to, health=self.health, execute=self.execute,
                                 metrics_text=self.metrics.render)

    def _read_model(self, model: CompositeModel) -> None:
        """The model's walks, partitions and streaming edges, checked against each other, and its stop ids."""
        self.graphs = model.graphs()
        self.stop_ids = model.stop_token_ids()
        self._id_signals = model.id_signals
        self.partitions = list(check_partitions(model.partitions(), self.graphs).values())
        self.streams = model.streaming_edges()
        for edge in self.streams:
            edge.check({p.name: p for p in self.partitions}, self.graphs)
        self._partition_index = {p.name: i for i, p in enumerate(self.partitions)}

    # ---- thread side ----
    def wait_ready(self, timeout_s: float) -> None:
        """Block until every rank reported READY; raise RuntimeError naming the ranks on LOAD_FAILED or timeout."""
        deadline = time.monotonic() + timeout_s
        while len(self.ready_ranks) < self.world_size:
            if self.failed:
                raise RuntimeError(self.failed)
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.world_size)) - set(self.ready_ranks))
                raise TimeoutError(f"ranks {missing} did not report READY within {timeout_s:g} s "
                                   f"(--startup-timeout); see those ranks' logs")
            for sender, payload in self.channel.recv(int(min(left, 0.2) * 1000)):
                self.handle(sender, payload)
        self.serving = True

    def start(self) -> None:
        """Run :meth:`run` on a daemon thread named ``conductor``; call after :meth:`wait_ready`."""
        if self.thread is not None:
            raise RuntimeError("the conductor was started already")
        self.thread = threading.Thread(target=self.run, name="conductor", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        """True while the conductor thread runs."""
        return self.thread is not None and self.thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop the conductor thread: in-flight requests end with a 503 on the way out (see :meth:`run`). Blocks up
        to ``timeout_s`` for the thread; True when it ended. Only after this returns may another thread use the
        channel (ZMQ sockets are single-threaded)."""
        self.stopped.set()
        self.channel.wake()
        if self.thread is None:
            return True
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            log.warning("the conductor thread did not stop within %g s", timeout_s)
            return False
        return True

    def run(self) -> None:
        """Serve until :meth:`stop`. Runs on the conductor thread."""
        last_check = last_beat = time.monotonic()
        while not self.stopped.is_set():
            for sender, payload in self.channel.recv(100):
                self._guarded(self.handle, sender, payload)
            self._drain_commands()
            now = time.monotonic()
            if now - last_check > 0.2:
                last_check = now
                self.check_timeouts(now)
                self.check_ranks(now)
                self.intakes.push_health()
            if self.log_stats_s and now - self.metrics.stats_mark[0] >= self.log_stats_s:
                self.log_stats(now)
            if now - last_beat > 1.0:
                last_beat = now
                for rank in range(self.world_size):
                    if rank not in self.dead_ranks or rank in self.membership.rejoining:
                        self._send(rank, m.Heartbeat(sent_at=now))
            self.intakes.flush()
        self._fail_all(503, "the server is shutting down")
        self.intakes.push_health()
        self.intakes.flush()

    def broadcast(self, body: m.Message) -> None:
        for rank in range(self.world_size):
            self._send(rank, body)

    def _send(self, rank: int, body: m.Message) -> None:
        self.channel.send(rank_name(rank), m.encode(self.token, CONDUCTOR, body))

    def _send_to(self, name: str, body: m.Message) -> None:
        self.channel.send(name, m.encode(self.token, CONDUCTOR, body))

    # ---- commands ----
    def command(self, cmd: Command) -> None:
        """Hand the conductor thread a command from another thread; its wait for rank messages ends at once
        (``ControlPort.wake``)."""
        self.commands.put(cmd)
        self.channel.wake()

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return
            self.execute(cmd)

    def execute(self, cmd: Command) -> None:
        """Carry out ``cmd`` on the conductor thread; whatever goes wrong is an error event or a log line, never an
        exception out of here."""
        if isinstance(cmd, Submit):
            self.submit(cmd.params, cmd.sink, cmd.pinned_id)
        elif isinstance(cmd, RankDied):
            self._guarded(self._on_rank_died, cmd)
        else:
            self.abort(cmd.request_id, cmd.sink)

    def submit(self, params: GenerationParams, sink: Sink, pinned_id: bool) -> None:
        """Take one request on the conductor thread (from the in-process backend or an intake): start it, queue it
        or refuse it (``conductor/admission.py``); whatever goes wrong is an error event on ``sink``."""
        if trace.ON:
            trace.event("cond_received", params.request_id, queued=self.queue_depth, active=len(self._active))
        try:
            if self.admission.take(Submit(params, sink, pinned_id), self._active, self._fanouts):
                self._start(params, sink, pinned_id, time.monotonic())
        except Exception as exc:  # never let one request take the conductor thread down
            log.exception("conductor: submit of %s failed", params.request_id)
            req = self._active.get(params.request_id)
            if req is not None and req.sink is sink:
                self._finish_error(req, 500, f"{type(exc).__name__}: {exc}")
            else:
                sink(BackendError(500, f"{type(exc).__name__}: {exc}"))

    def abort(self, request_id: str, sink: Sink | None = None) -> None:
        """Abort a queued or running request on the conductor thread; with ``sink``, only the submission that owns
        that sink (a late abort must not hit a newer request that reuses the same pinned id). A failure is logged,
        never raised."""
        self._guarded(self._abort, request_id, sink)

    def _abort(self, request_id: str, sink: Sink | None) -> None:
        if self.admission.abort(request_id, sink):
            return
        fan = self._fanouts.get(request_id)
        if fan is not None and sink in (None, fan.sink):
            fan.abort()
            return
        req = self._active.get(request_id)
        if req is not None and sink in (None, req.sink):
            self.metrics.observe_done("abort", time.monotonic() - req.arrived, req.state.completion_tokens)
            self._release(req)

    def health(self) -> tuple[bool, str]:
        """(serving?, reason): what ``/health`` answers. Safe from any thread and writes nothing: it reads the
        conductor's flags and the snapshot its thread publishes when a rank dies."""
        if self.failed:
            return False, self.failed
        if self.thread is not None and not self.thread.is_alive() and not self.stopped.is_set():
            return False, "the conductor thread died; see rank 0's log"
        if not self.serving:
            return False, f"starting: {len(self.ready_ranks)}/{self.world_size} ranks ready"
        if self.stopped.is_set():
            return False, "shutting down"
        return self._health

    def running(self, request_id: str) -> Request | None:
        """The running request of client id ``request_id``, if any (conductor thread)."""
        return self._active.get(request_id)

    # ---- messages ----
    def _guarded(self, fn, *args) -> None:
        """Run one message handler; an exception fails the request it concerns, never the conductor thread."""
        try:
            fn(*args)
        except Exception as exc:
            log.exception("conductor: handling %s failed", fn.__name__)
            payload = args[1] if fn == self.handle and len(args) > 1 else None
            wire_id = getattr(args[0], "request_id", None) if args else None  # a message handled on its own
            if isinstance(payload, bytes):
                try:
                    wire_id = getattr(m.decode(payload).body, "request_id", None)
                except Exception:
                    pass
            req = self._by_wire.get(wire_id) if wire_id else None
            if req is not None:
                try:
                    self._finish_error(req, 500, f"conductor: {type(exc).__name__}: {exc}")
                except Exception:
                    log.exception("conductor: failing request %s failed too", req.state.request_id)

    def handle(self, sender: str, payload: bytes) -> None:
        """Apply one control message from socket peer ``sender`` (a rank or an intake of this launch; anything else
        is dropped and counted)."""
        env = open_envelope(payload, sender, self.token, lambda name: name in self.intakes or is_rank(name))
        if isinstance(env, Reject):
            self.metrics.rejected_messages += 1
            log.warning("conductor: %s", env)
            return
        if sender in self.intakes:
            self.intakes.handle(sender, env.body)
            return
        rank = parse_rank(sender)
        self.last_seen[rank] = time.monotonic()
        if rank not in self.dead_ranks:
            self._on_rank_message(rank, env.body)
        else:  # its requests were failed: only its new process may come back, by rejoining
            self._on_dead_rank_message(rank, env.body)

    def _on_rank_message(self, rank: int, body: m.Message) -> None:
        if isinstance(body, m.Emits):
            for emit in body.items:
                self._guarded(self._on_emit, emit)
            if body.done:
                self.intakes.flush()  # the step's first tokens leave before its walks' next ones are dispatched
                for done in body.done:
                    self._guarded(self._on_walk_done, done)
        elif isinstance(body, m.Emit):
            self._on_emit(body)
        elif isinstance(body, m.WalkDone):
            # what the Emits before it produced leaves first: a prefill's WalkDone follows its first tokens, and
            # dispatching the next walks of a whole batch of requests takes a while
            self.intakes.flush()
            self._on_walk_done(body)
        elif isinstance(body, m.Stats):
            self.metrics.rank_stats[body.rank] = body
            self.membership.incarnation[rank] = body.incarnation
        elif isinstance(body, m.Repaired):
            self._on_repaired(body)
        elif isinstance(body, m.Rejoin):  # a new process of a rank not found dead yet (its host was started again)
            self._on_early_rejoin(body)
        elif isinstance(body, m.Ready):
            self.ready_ranks[body.rank] = body.load_seconds
            log.info("rank %d on %s is ready (loaded in %.1f s)", body.rank, body.host, body.load_seconds)
        elif isinstance(body, m.Leaving):
            log.warning("rank %d on %s is leaving: %s", body.rank, body.host, body.reason)
            self.left_at = time.monotonic()
            self._declare_dead(rank, body.reason, "stopped")
        elif isinstance(body, m.LoadFailed):
            self.failed = f"rank {body.rank} on host {body.host} failed to load: {body.error}"
        else:
            log.warning("conductor: unexpected %s from rank %d", type(body).__name__, rank)

    # ---- a request's walks ----
    def _start(self, params: GenerationParams, sink: Sink, pinned_id: bool, arrived: float) -> None:
        """Preprocess an admitted request, choose its replicas and dispatch its first walks (each choice's, for n > 1)."""
        if params.n > 1:  # n choices, each a request of its own (conductor/fanout.py)
            rid = params.request_id
            fan = self._fanouts[rid] = Fanout(params, sink, request_seed(params, pinned_id), abort=lambda choice: (
                self._abort(choice, None)), ended=lambda: self._fanouts.pop(rid, None))
            fan.start(lambda choice, choice_sink: self._start(choice, choice_sink, pinned_id, arrived))
            return
        state = request_state(params, pinned_id, self.stop_ids)
        try:
            check_knobs(params)
            self.model.preprocess(state, params.prompt, params.messages)
            if trace.ON:
                trace.event("cond_preprocessed", params.request_id, prompt_tokens=state.prompt_tokens)
        except ValueError as exc:
            sink(BackendError(400, str(exc)))
            return
        except Exception as exc:
            log.exception("preprocess failed for %s", params.request_id)
            sink(BackendError(500, f"preprocess failed: {type(exc).__name__}: {exc}"))
            return
        choice = self.routes.choose(self.dead_ranks)
        if choice is None:
            dead = ", ".join(f"rank {r} ({why})" for r, why in sorted(self.dead_ranks.items()))
            sink(BackendError(503, f"no live replica can serve this request; dead: {dead}"))
            return
        self._incarnation += 1
        req = Request(state=state, params=params, sink=sink, choice=choice, arrived=arrived,
                      wire_id=f"{params.request_id}#{self._incarnation}", pinned_id=pinned_id)
        self._active[params.request_id] = req
        self._by_wire[req.wire_id] = req
        if trace.ON:  # joins the front end's events (client id) with the ranks' (wire id)
            trace.event("cond_admitted", req.wire_id, client=params.request_id, active=len(self._active))
        try:
            start_done = self.model.start_done(state)
            req.partitions = PartitionTracker(self.partitions, start_done)
            for partition in start_done:
                self._end_streams(req, partition)
            steps = self.model.start(state)
            for step in steps if isinstance(steps, list) else [steps]:
                req.partitions.start(req.partitions.partition_of(step.walk))
                self._dispatch(req, step)
        except Exception as exc:
            self._finish_error(req, 500, f"start failed: {type(exc).__name__}: {exc}")
            return
        if req.partitions.request_done:
            self._finish(req, state.finish_reason or "stop")

    def _start_queued(self) -> None:
        while (q := self.admission.next(len(self._active))) is not None:
            self._start(q.params, q.sink, q.pinned_id, q.arrived)

    def _dispatch(self, req: Request, step: WalkStep) -> None:
        """Send ``step`` to every rank running a node of its walk for this request (``conductor/routes.py``): each
        gets the inputs its own nodes consume (placeholders for the rest), kept tensors are pushed straight from
        their producer to the ranks that consume them. A walk that runs no node ends here, as it would on a rank."""
        section = self.graphs[step.walk]
        if runs_no_node(section, step.loop_limits):  # its finish reason is the walk's own (graph/walk.py)
            run = WalkRun(req.wire_id, step.walk, section, {}, loop_limits=dict(step.loop_limits))
            outputs = {s: encode_tensor(torch.empty(0)) for s, v in run.outputs.items() if isinstance(v, list)}
            self._on_walk_done(m.WalkDone(request_id=req.wire_id, walk=step.walk, rank=-1, outputs=outputs,
                                          finish_reason=run.finish_reason))
            return
        route = self.routes.route(req.choice, step.walk)
        ranks = route.ranks
        partition = req.partitions.partition_of(step.walk)
        walk_index = req.partitions.walks_done(partition)
        inputs: dict[int, dict[str, m.Value]] = {rank: {} for rank in ranks}
        release: dict[int, list[str]] = {rank: [] for rank in ranks}
        for name, value in step.inputs.items():
            wanted = route.consumers.get(name) or ranks[:1]
            if isinstance(value, m.TensorRef):
                self.routes.push_kept(self._send, req.wire_id, req.choice, name, value, wanted,
                                      keep=name in step.keep, release=release, walk=step.walk)
            elif not isinstance(value, m.InlineTensor):  # a family may hand it encoded already (inline.encode_ids)
                value = encode_tensor(value)
            for rank in ranks:
                inputs[rank][name] = value if rank in wanted else m.Remote()
        if len(ranks) > 1:
            req.pieces[step.walk] = (set(ranks), {})
        seed = walk_seed(req.state.seed, self._partition_index[partition], walk_index)
        sampling = req.walk_sampling()
        req.touched.update(route.touched)  # before any send: a send that fails still leaves them to be told to release
        for rank in ranks:
            msg = m.RunWalk(
                request_id=req.wire_id, walk=step.walk, walk_index=walk_index, seed=seed, inputs=inputs[rank],
                sampling=sampling, export=route.export, loop_limits=step.loop_limits, stop_token_ids=req.stop_ids,
                stream_routes=route.stream_routes, release=release[rank], node_ranks=route.node_ranks,
            )
            if trace.ON:  # as it is handed to the socket
                trace.event("cond_dispatch", req.wire_id, walk=step.walk, rank=rank)
            self._send(rank, msg)
        for signal in route.stream_routes:
            req.stream_src[signal] = req.rank_of(*self.routes.producer[signal])

    def _on_walk_done(self, done: m.WalkDone) -> None:
        req = self._by_wire.get(done.request_id)
        if req is None:
            return  # finished or aborted meanwhile; the ranks got RemoveRequest
        if done.error is not None:
            host = self.rank_hosts.get(done.rank, "?")
            self._finish_error(req, done.status, f"rank {done.rank} ({host}) failed walk {done.walk!r}: {done.error}")
            return
        outputs = {
            k: (v if isinstance(v, m.TensorRef) else decode_tensor(v, torch.device("cpu")))
            for k, v in done.outputs.items()
        }
        if done.walk in req.pieces:  # a walk across ranks ends when every rank's copy has ended
            due, gathered = req.pieces[done.walk]
            due.discard(done.rank)
            gathered.update(outputs)
            if due:
                return
            del req.pieces[done.walk]
            outputs = gathered
        partition = req.partitions.partition_of(done.walk)
        req.partitions.walk_done(partition)
        if done.finish_reason and (req.finish_reason is None or self._partition_index[partition] == 0):
            req.finish_reason = done.finish_reason  # the first partition's walks (the text, the codes) say why
        try:
            step = self.model.after_walk(req.state, done.walk, outputs)
        except Exception as exc:
            self._finish_error(req, 500, f"after_walk({done.walk!r}) failed: {type(exc).__name__}: {exc}")
            return
        if step is not None:
            self._dispatch(req, step)
            return
        req.partitions.partition_done(partition)
        self._end_streams(req, partition)
        if req.partitions.request_done:
            self._finish(req, req.state.finish_reason or req.finish_reason or "stop")

    def _end_streams(self, req: Request, partition: str) -> None:
        """The producing partition is done: its consumers' buffers get their final chunk (see ``StreamEnd``)."""
        for rank, end in self.routes.stream_ends(req.choice, req.wire_id, partition, req.partitions.is_done,
                                                 req.stream_src):
            self._send(rank, end)

    # ---- output ----
    def _on_emit(self, emit: m.Emit) -> None:
        req = self._by_wire.get(emit.request_id)
        if req is None:
            return
        before = req.state.completion_tokens
        try:
            values = decode_ids(emit.values) if emit.signal in self._id_signals else \
                [decode_tensor(v) for v in emit.values]
            out = self.model.postprocess(req.state, emit.signal, values)
            deltas = as_deltas(out, req.state.completion_tokens - before)
        except Exception as exc:
            self._finish_error(req, 500, f"postprocess failed: {type(exc).__name__}: {exc}")
            return
        n = req.state.completion_tokens - before
        now = time.monotonic()
        if req.first_token_at is None:
            req.first_token_at = now
            if trace.ON:
                trace.event_at(now, "cond_first_emit", req.wire_id)
            self.metrics.ttft.observe(now - req.arrived)
        self.metrics.observe_tokens(n, None if req.last_token_at is None else now - req.last_token_at)
        if n:
            req.last_token_at = now
        for delta in deltas:
            if isinstance(delta, MediaDelta):
                req.sink(delta)
            elif self._emit_text(req, delta):
                return  # a stop string ended the request

    def _emit_text(self, req: Request, delta: TextDelta) -> bool:
        """Send ``delta`` cut at the request's stop strings (looked for once it made its ``min_tokens``); True when a
        stop string ended the request."""
        text = req.stops.feed(delta.text, req.state.completion_tokens >= req.params.min_tokens)
        if text or delta.n_tokens:
            if trace.ON:
                trace.first("cond_first_delta", [req.wire_id], text=bool(text))
            req.sink(delta if text == delta.text else msgspec.structs.replace(delta, text=text))
        if req.stops.stopped:
            self._finish(req, "stop")
        return req.stops.stopped

    # ---- ends ----
    def _release(self, req: Request) -> None:
        self._active.pop(req.state.request_id, None)
        self._by_wire.pop(req.wire_id, None)
        for rank in sorted(req.touched | req.choice.ranks()):
            self._send(rank, m.RemoveRequest(request_id=req.wire_id))
        self._start_queued()

    def _finish(self, req: Request, reason: str) -> None:
        if req.wire_id not in self._by_wire:
            return  # ended already (a choice aborted while its batch mates' events were handled)
        stops = req.stops
        if not stops.stopped:
            tail = stops.feed(self.model.finish_text(req.state)) + stops.flush()
            if tail:
                req.sink(TextDelta(text=tail, n_tokens=0))
            if stops.stopped:
                reason = "stop"
        latency = time.monotonic() - req.arrived
        self.admission.observe_latency(latency)
        self.metrics.observe_done(reason, latency, req.state.completion_tokens, req.state.prompt_tokens)
        req.sink(Finished(finish_reason=reason, prompt_tokens=req.state.prompt_tokens,
                          completion_tokens=req.state.completion_tokens))
        self._release(req)

    def _finish_error(self, req: Request, status: int, message: str) -> None:
        if req.wire_id not in self._by_wire:
            return  # ended already
        log.error("request %s failed: %s", req.state.request_id, message)
        self.metrics.observe_done("error", time.monotonic() - req.arrived, req.state.completion_tokens)
        req.sink(BackendError(status, message))
        self._release(req)

    def _fail_all(self, status: int, message: str) -> None:
        for req in list(self._active.values()):
            self._finish_error(req, status, message)
        self.admission.fail_all(status, message)

    # ---- time and liveness ----
    def check_timeouts(self, now: float) -> None:
        """Fail (504) every running or queued request older than ``request_timeout_s``; a running one is removed
        from every rank it touched (its tensors and KV are freed). Conductor thread, a few times a second."""
        limit = self.request_timeout_s
        self.admission.expire(now, limit)
        for req in list(self._active.values()):
            if now - req.arrived > limit:
                self._finish_error(req, 504, f"request timed out after {limit:g} s (limits.request_timeout_s)")

    def log_stats(self, now: float) -> None:
        """Log the throughput since the last call, the load, the leak canary and the edges (``Metrics.log_stats``)."""
        self.metrics.log_stats(now)

    @property
    def queue_depth(self) -> int:
        return len(self.admission.queue)

    @property
    def active_count(self) -> int:
        return len(self._active)

