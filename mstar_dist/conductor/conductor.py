"""The conductor (rank 0): request lifecycle, walk transitions, admission, replica choice, stop strings (docs/architecture.md §4–§6).

Threading: the conductor owns one thread (``Conductor.run``) and its control channel ``"conductor"``; all request
state lives on that thread. The HTTP loop talks to it through :class:`ConductorBackend`: commands go into a
thread-safe queue plus a one-byte wake-up on the control socket; events come back through
``loop.call_soon_threadsafe``. Nothing here touches device tensors.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
import queue
import random
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mstar_dist import trace
from mstar_dist.conductor.metrics import Metrics
from mstar_dist.control import messages as m
from mstar_dist.control.port import ControlPort
from mstar_dist.graph.model import CompositeModel, RequestState, WalkStep
from mstar_dist.graph.io import walk_io
from mstar_dist.graph.nodes import iter_nodes, node_names
from mstar_dist.graph.partitions import PartitionTracker, check_partitions
from mstar_dist.conductor.intake_hub import IntakeHub
from mstar_dist.conductor.stop_strings import StopTrimmer
from mstar_dist.topology.placement import Placement
from mstar_dist.events import BackendError, Finished, GenerationParams, MediaDelta, TextDelta
from mstar_dist.transport.inline import decode_ids, decode_tensor, encode_tensor

log = logging.getLogger(__name__)

Sink = Callable[[Any], None]


def walk_seed(request_seed: int, partition_index: int, walk_index: int) -> int:
    """The seed of a walk: the request's seed advanced by one per completed walk of its partition (docs/architecture.md §4).

    Counting per partition keeps the seeds independent of how concurrent partitions interleave; partitions after
    the first are offset so that their walks never share a seed with the first partition's.
    """
    return (request_seed + partition_index * 1_000_003 + walk_index) & 0x7FFF_FFFF_FFFF_FFFF


def request_seed(params: GenerationParams, pinned_id: bool) -> int:
    """The pinned ``seed``, else a hash of a pinned request id, else random (docs/architecture.md §4)."""
    if params.seed is not None:
        return int(params.seed)
    if pinned_id:
        return int.from_bytes(hashlib.sha256(params.request_id.encode()).digest()[:7], "little")
    return random.getrandbits(56)


@dataclass
class _Request:
    state: RequestState
    params: GenerationParams
    sink: Sink
    nodes: dict[tuple[str, str], int]
    """(walk, node) -> the global rank that runs that node of that walk for this request (replicas chosen at
    admission)."""
    arrived: float
    wire_id: str
    """The id on the wire: the client's id plus an incarnation number, so a pinned id can be reused at once
    without a rank mistaking the new request for the removed one."""
    stops: StopTrimmer | None = None
    """Cuts the text at the request's stop strings (the one place they are applied)."""
    first_token_at: float | None = None
    last_token_at: float | None = None
    touched: set[int] = field(default_factory=set)
    partitions: PartitionTracker | None = None
    stream_src: dict[str, int] = field(default_factory=dict)
    """Streaming signal -> the rank of the last walk dispatched to produce it."""
    finish_reason: str | None = None
    replicas: dict[tuple[str, str], tuple[int, ...]] = field(default_factory=dict)
    """(walk, node) -> every rank of the chosen replica (its TP group; the first one leads and is in ``nodes``)."""
    pieces: dict[str, tuple[set[int], dict[str, Any]]] = field(default_factory=dict)
    """Walk -> (ranks whose ``WalkDone`` is still due, outputs gathered so far) for a walk that spans ranks."""
    routes: dict[str, "_Route"] = field(default_factory=dict)
    """Walk -> what its dispatch sends where (``Conductor._route``); shared by every request of one ``_Choice``."""

    def walk_ranks(self, walk: str) -> list[int]:
        """Global ranks running some node of ``walk`` for this request, sorted."""
        return sorted({rank for (w, _), rank in self.nodes.items() if w == walk})

    def rank_of(self, walk: str, node: str) -> int:
        return self.nodes[(walk, node)]


@dataclass(frozen=True)
class _Route:
    """What dispatching one walk of a request sends where, given the request's ranks (``Conductor._route``): the same
    for every request that got the same replicas, so computed once per walk for them (a 32-request burst reaches the
    conductor at once and it dispatches one request after another)."""

    ranks: list[int]
    """The ranks running some node of the walk, sorted."""
    consumers: dict[str, list[int]]
    """Walk input -> the ranks whose nodes take it."""
    export: list[str]
    """The walk's persisted outputs to materialise for another rank (``_exports``), sorted."""
    node_ranks: dict[str, int]
    """Node -> rank, for a walk across ranks (empty otherwise)."""
    stream_routes: dict[str, int]
    """Streaming signal produced in the walk's partition -> the rank consuming it."""
    touched: frozenset[int]
    """Every rank of the replicas the walk uses (TP followers included)."""


@dataclass
class _Choice:
    """The replicas chosen for a request (``_choose_ranks``), with the routes of its walks as they are computed."""

    replicas: dict[tuple[str, str], tuple[int, ...]]
    nodes: dict[tuple[str, str], int]
    routes: dict[str, _Route] = field(default_factory=dict)


@dataclass
class _Queued:
    """A request waiting for admission (``limits.max_queued_requests`` of them at most)."""

    params: GenerationParams
    sink: Sink
    pinned_id: bool
    arrived: float = field(default_factory=time.monotonic)


class Conductor:
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
    ):
        """``intakes``: names of the HTTP intake processes whose control sockets ``channel`` is connected to (none:
        the in-process ``ConductorBackend`` is the only way in)."""
        self.model = model
        self.placement = placement
        self.channel = channel
        self.token = token
        self.world_size = world_size
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self._latency_ewma_s = 1.0  # recent request latency, for the Retry-After hint of a refused request
        self.request_timeout_s = request_timeout_s
        self.rank_timeout_s = rank_timeout_s
        self.log_stats_s = log_stats_s
        self._stats_mark = (time.monotonic(), 0)  # (when, tokens generated then)
        self.last_seen: dict[int, float] = {}
        self.dead_ranks: dict[int, str] = {}
        self.rank_hosts = rank_hosts
        self.graphs = model.graphs()
        self.persist_signals = {
            walk: {e.signal for n in iter_nodes(section) for e in n.outputs if e.persist}
            for walk, section in self.graphs.items()
        }
        self.stop_ids = model.stop_token_ids()
        self._id_signals = model.id_signals
        self.partitions = list(check_partitions(model.partitions(), self.graphs).values())
        self.streams = model.streaming_edges()
        for edge in self.streams:
            edge.check({p.name: p for p in self.partitions}, self.graphs)
        self._partition_index = {p.name: i for i, p in enumerate(self.partitions)}
        self._walk_nodes = [(walk, node) for walk, section in self.graphs.items()
                            for node in dict.fromkeys(n.name for n in iter_nodes(section))]
        self._ports = {walk: walk_io(section).external_inputs for walk, section in self.graphs.items()}
        self._stream_producer = {  # streaming signal -> (walk, node) producing it
            e.signal: next((w, n.name) for w, sec in self.graphs.items() for n in iter_nodes(sec)
                           for out in n.outputs if out.stream and out.signal == e.signal)
            for e in self.streams
        }
        self._consumer_walk = {  # streaming signal -> the walk holding its consumer node
            e.signal: next(w for p in self.partitions if p.name == e.dst_partition for w in p.walks
                           if e.dst_node in node_names(self.graphs[w]))
            for e in self.streams
        }
        self.metrics = Metrics(world_size)
        self.metrics.dead_ranks = self.dead_ranks
        self.metrics.load = lambda: (len(self._active), len(self._queue))
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.ready_ranks: dict[int, float] = {}
        self.failed: str | None = None
        self.serving = False
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        """The thread running :meth:`run` (see :meth:`start`)."""
        self._active: dict[str, _Request] = {}  # by the client's request id
        self._by_wire: dict[str, _Request] = {}
        self._incarnation = 0
        self._queue: collections.deque[_Queued] = collections.deque()
        self._rng = random.Random(0)
        self._fixed_choice: tuple[int, _Choice | None] | None = None
        """(dead ranks counted, the choice) of ``_choose_ranks`` when every node has one replica: shared by every
        request (with its routes) until a rank dies."""
        self._unservable: tuple[int, list[str]] = (-1, [])
        """(dead ranks counted, ``unservable_walks()`` then): ``health`` is asked for every request an intake sends."""
        self.intakes = IntakeHub(self, intakes)

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
                raise TimeoutError(
                    f"ranks {missing} did not report READY within {timeout_s:g} s (--startup-timeout); "
                    f"see those ranks' logs"
                )
            for sender, payload in self.channel.recv(int(min(left, 0.2) * 1000)):
                self._handle(sender, payload)
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
                self._guarded(self._handle, sender, payload)
            self._drain_commands()
            now = time.monotonic()
            if now - last_check > 0.2:
                last_check = now
                self._check_timeouts(now)
                self._check_ranks(now)
                self.intakes.push_health()
            if self.log_stats_s and now - self._stats_mark[0] >= self.log_stats_s:
                self.log_stats(now)
            if now - last_beat > 1.0:
                last_beat = now
                for rank in range(self.world_size):
                    if rank not in self.dead_ranks:
                        self._send(rank, m.Heartbeat(sent_at=now))
            self.intakes.flush()
        self._fail_all(503, "the server is shutting down")
        self.intakes.push_health()
        self.intakes.flush()

    def broadcast(self, body: m.Message) -> None:
        for rank in range(self.world_size):
            self._send(rank, body)

    def _send(self, rank: int, body: m.Message) -> None:
        self.channel.send(f"rank{rank}", m.encode(self.token, "conductor", body))

    def command(self, cmd: tuple) -> None:
        """Hand the conductor thread a command (``("submit", params, sink, ...)`` or ``("abort", request_id,
        sink)``) from another thread; its wait for rank messages ends at once (``ControlChannel.wake``)."""
        self.commands.put(cmd)
        self.channel.wake()

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return
            kind = cmd[0]
            if kind == "submit":
                self.submit(*cmd[1:])
            elif kind == "abort":
                self._guarded(self._abort, cmd[1], cmd[2] if len(cmd) > 2 else None)

    def submit(self, params: GenerationParams, sink: Sink, pinned_id: bool) -> None:
        """Take one request on the conductor thread (from the in-process backend or an intake); whatever goes
        wrong is an error event on ``sink``, never an exception out of here."""
        if trace.ON:
            trace.event("cond_received", params.request_id, queued=len(self._queue), active=len(self._active))
        try:
            self._submit(params, sink, pinned_id)
        except Exception as exc:  # never let one request take the conductor thread down
            log.exception("conductor: submit of %s failed", params.request_id)
            req = self._active.get(params.request_id)
            if req is not None and req.sink is sink:
                self._finish_error(req, 500, f"{type(exc).__name__}: {exc}")
            else:
                sink(BackendError(500, f"{type(exc).__name__}: {exc}"))

    def abort(self, request_id: str, sink: Sink | None) -> None:
        """Abort on the conductor thread (see ``_abort``); a failure is logged, never raised."""
        self._guarded(self._abort, request_id, sink)

    def health(self) -> tuple[bool, str]:
        """(serving?, reason): what ``/health`` answers. Safe from any thread (reads only)."""
        if self.failed:
            return False, self.failed
        if self.thread is not None and not self.thread.is_alive() and not self.stopped.is_set():
            return False, "the conductor thread died; see rank 0's log"
        if not self.serving:
            return False, f"starting: {len(self.ready_ranks)}/{self.world_size} ranks ready"
        if self.stopped.is_set():
            return False, "shutting down"
        known = self._unservable
        if known[0] != len(self.dead_ranks):  # ranks are only ever added to dead_ranks
            known = self._unservable = (len(self.dead_ranks), self.unservable_walks())
        down = known[1]
        if down:
            dead = ", ".join(f"rank {r} ({why})" for r, why in sorted(self.dead_ranks.items()))
            return False, f"no live replica for walks {down}; dead: {dead}"
        return True, "ok"

    def _guarded(self, fn, *args) -> None:
        """Run one message handler; an exception fails the request it concerns, never the conductor thread."""
        try:
            fn(*args)
        except Exception as exc:
            log.exception("conductor: handling %s failed", fn.__name__)
            payload = args[1] if fn == self._handle and len(args) > 1 else None
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

    def _handle(self, sender: str, payload: bytes) -> None:
        try:
            env = m.decode(payload)
        except Exception as exc:
            self.metrics.rejected_messages += 1
            log.warning("conductor: dropped an undecodable message from %r: %s", sender, exc)
            return
        if env.token != self.token:
            self.metrics.rejected_messages += 1
            log.warning("conductor: rejected a message from %r without this launch's deployment secret", sender)
            return
        if sender in self.intakes and env.sender == sender:
            self.intakes.handle(sender, env.body)
            return
        if env.sender != sender or not re.fullmatch(r"rank\d+", sender):
            self.metrics.rejected_messages += 1
            log.warning("conductor: rejected a message from unknown sender %r (claims %r)", sender, env.sender)
            return
        body = env.body
        rank = int(sender[4:])
        self.last_seen[rank] = time.monotonic()
        if rank in self.dead_ranks:
            return  # declared dead: its requests were failed; it must not come back half-way
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
            # dispatching the next walks of a whole batch of requests takes ~70 us each (about 1 ms for 15)
            self.intakes.flush()
            self._on_walk_done(body)
        elif isinstance(body, m.Stats):
            self.metrics.rank_stats[body.rank] = body
        elif isinstance(body, m.Ready):
            self.ready_ranks[body.rank] = body.load_seconds
            log.info("rank %d on %s is ready (loaded in %.1f s)", body.rank, body.host, body.load_seconds)
        elif isinstance(body, m.Leaving):
            log.warning("rank %d on %s is leaving: %s", body.rank, body.host, body.reason)
            self._declare_dead(rank, body.reason, "stopped")
        elif isinstance(body, m.LoadFailed):
            self.failed = f"rank {body.rank} on host {body.host} failed to load: {body.error}"
        else:
            log.warning("conductor: unexpected %s from %r", type(body).__name__, sender)

    # ---- admission ----
    def _submit(self, params: GenerationParams, sink: Sink, pinned_id: bool) -> None:
        """Admit a request, queue it, or refuse it at once with a 429 when the queue is full."""
        rid = params.request_id
        if rid in self._active or any(q.params.request_id == rid for q in self._queue):
            sink(BackendError(409, f"request_id {rid!r} is already in flight; use a new id"))
            return
        self.metrics.requests_received += 1
        if len(self._active) < self.max_concurrent:
            self._admit(params, sink, pinned_id)
        elif len(self._queue) < self.max_queued:
            self._queue.append(_Queued(params, sink, pinned_id))
        else:
            self.metrics.observe_rejected("queue_full")
            sink(BackendError(429, f"the server is at capacity: {len(self._active)} requests running and "
                                   f"{len(self._queue)} queued (limits.max_queued_requests); retry later",
                              retry_after_s=self._retry_after_s()))

    def _retry_after_s(self) -> int:
        """About how long the queue ahead takes to drain (recent latency x queue waves), 1 to 60 s."""
        waves = (len(self._queue) + 1) / self.max_concurrent
        return int(min(60, max(1, math.ceil(waves * self._latency_ewma_s))))

    def _admit_queued(self) -> None:
        while self._queue and len(self._active) < self.max_concurrent:
            q = self._queue.popleft()
            self._admit(q.params, q.sink, q.pinned_id, arrived=q.arrived)

    def _admit(self, params: GenerationParams, sink: Sink, pinned_id: bool, arrived: float | None = None) -> None:
        state = RequestState(
            request_id=params.request_id, seed=request_seed(params, pinned_id), max_tokens=params.max_tokens,
            max_tokens_given=params.max_tokens_given, knobs=dict(params.model_kwargs),
        )
        if params.prompt_ids is not None:
            state.data["prompt_ids"] = params.prompt_ids
        try:
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
        choice = self._choose_ranks()
        if choice is None:
            dead = ", ".join(f"rank {r} ({why})" for r, why in sorted(self.dead_ranks.items()))
            sink(BackendError(503, f"no live replica can serve this request; dead: {dead}"))
            return
        self._incarnation += 1
        req = _Request(state=state, params=params, sink=sink, nodes=choice.nodes, replicas=choice.replicas,
                       arrived=time.monotonic() if arrived is None else arrived,
                       wire_id=f"{params.request_id}#{self._incarnation}", routes=choice.routes)
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

    def _choose_ranks(self) -> _Choice | None:
        """One replica per (walk, node); prefer hosts, then ranks the request already uses (docs/architecture.md,
        "Placement"), as the replica's ranks (TP group; the first leads). None when some node has no live replica.
        Requests only read the choice (it may be shared)."""
        from mstar_dist.topology.placement import choose_replica

        fixed = self._fixed_choice
        if fixed is not None and fixed[0] == len(self.dead_ranks):  # ranks are only ever added to dead_ranks
            return fixed[1]
        chosen: dict[tuple[str, str], tuple[int, ...]] | None = {}
        for walk, node in self._walk_nodes:
            replica = choose_replica(
                self.placement.replicas(walk, node),
                live_ranks=set(range(self.world_size)) - set(self.dead_ranks),
                hosts_used={self.rank_hosts[r] for ranks in chosen.values() for r in ranks},
                ranks_used={r for ranks in chosen.values() for r in ranks},
                rank_host=self.rank_hosts,
                rng=self._rng,
            )
            if replica is None:
                chosen = None
                break
            chosen[(walk, node)] = replica.ranks
        choice = None if chosen is None else _Choice(replicas=chosen, nodes={k: r[0] for k, r in chosen.items()})
        if all(len(self.placement.replicas(walk, node)) == 1 for walk, node in self._walk_nodes):
            # one replica per node: every request gets the same answer until a rank dies (and no random tie-break
            # is drawn), and so the same routes
            self._fixed_choice = (len(self.dead_ranks), choice)
        return choice

    # ---- walks ----
    def _dispatch(self, req: _Request, step: WalkStep) -> None:
        """Send ``step`` to every rank running a node of its walk for this request (docs/architecture.md,
        "Walks across ranks"): each gets the inputs its own nodes consume (placeholders for the rest), kept
        tensors are pushed straight from their producer to the ranks that consume them."""
        route = req.routes.get(step.walk) or self._route(req, step.walk)
        ranks = route.ranks
        partition = req.partitions.partition_of(step.walk)
        walk_index = req.partitions.walks_done(partition)
        inputs: dict[int, dict[str, m.Value]] = {rank: {} for rank in ranks}
        release: dict[int, list[str]] = {rank: [] for rank in ranks}
        for name, value in step.inputs.items():
            wanted = route.consumers.get(name) or ranks[:1]
            if isinstance(value, m.TensorRef):
                self._route_kept(req, name, value, wanted, keep=name in step.keep, release=release, walk=step.walk)
            elif not isinstance(value, m.InlineTensor):  # a family may hand it encoded already (inline.encode_ids)
                value = encode_tensor(value)
            for rank in ranks:
                inputs[rank][name] = value if rank in wanted else m.Remote()
        if len(ranks) > 1:
            req.pieces[step.walk] = (set(ranks), {})
        seed = walk_seed(req.state.seed, self._partition_index[partition], walk_index)
        sampling = m.Sampling(temperature=req.params.temperature, top_p=req.params.top_p, top_k=req.params.top_k)
        req.touched.update(route.touched)  # before any send: a send that fails still leaves them to be told to release
        for rank in ranks:
            msg = m.RunWalk(
                request_id=req.wire_id, walk=step.walk, walk_index=walk_index, seed=seed, inputs=inputs[rank],
                sampling=sampling, export=route.export, loop_limits=step.loop_limits, stop_token_ids=self.stop_ids,
                stream_routes=route.stream_routes, release=release[rank], node_ranks=route.node_ranks,
            )
            if trace.ON:  # as it is handed to the socket
                trace.event("cond_dispatch", req.wire_id, walk=step.walk, rank=rank)
            self._send(rank, msg)
        for signal in route.stream_routes:
            req.stream_src[signal] = req.rank_of(*self._stream_producer[signal])

    def _route(self, req: _Request, walk: str) -> _Route:
        """Where dispatching ``walk`` sends what for ``req``'s ranks, kept in ``req.routes`` (shared with every
        request of the same choice)."""
        ranks = req.walk_ranks(walk)
        partition = req.partitions.partition_of(walk)
        route = _Route(
            ranks=ranks,
            consumers=self._input_consumers(req, walk),
            export=sorted(self.persist_signals[walk]) if self._exports(req, walk) else [],
            node_ranks={node: rank for (w, node), rank in req.nodes.items() if w == walk} if len(ranks) > 1 else {},
            stream_routes={e.signal: req.rank_of(self._consumer_walk[e.signal], e.dst_node) for e in self.streams
                           if partition == e.src_partition},
            touched=frozenset(ranks) | {r for (w, _), rs in req.replicas.items() if w == walk for r in rs},
        )
        req.routes[walk] = route
        return route

    def _exports(self, req: _Request, walk: str) -> bool:
        """Whether a walk's persisted outputs must be materialised for another rank: some other walk of its
        partition runs on a rank this walk does not (e.g. decode on another rank than prefill)."""
        mine = set(req.walk_ranks(walk))
        partition = req.partitions.partition_of(walk)
        return any(set(req.walk_ranks(w)) - mine for p in self.partitions if p.name == partition
                   for w in p.walks if w != walk)

    def _input_consumers(self, req: _Request, walk: str) -> dict[str, list[int]]:
        """Walk input name -> the ranks whose nodes take it (sorted)."""
        out: dict[str, set[int]] = collections.defaultdict(set)
        for port in self._ports[walk]:
            out[port.signal].add(req.rank_of(walk, port.node))
        return {name: sorted(r) for name, r in out.items()}

    def _route_kept(self, req: _Request, name: str, ref: m.TensorRef, ranks: list[int], *, keep: bool,
                    release: dict[int, list[str]], walk: str) -> None:
        """Push a kept tensor from its producer to each consuming rank; one persist count is consumed per dispatch
        (by exactly one of them) unless the model keeps the tensor for a later walk."""
        releaser = None if keep else (ref.rank if ref.rank in ranks else ranks[-1])
        for rank in ranks:
            if rank != ref.rank:
                tp_dst = next((list(r) for r in req.replicas.values() if r[0] == rank and len(r) > 1), [])
                self._send(ref.rank, m.Push(request_id=req.wire_id, uuid=ref.uuid, dst=rank,
                                            release=rank == releaser, tp_dst=tp_dst, walk=walk, signal=name))
            elif rank == releaser:
                release[rank].append(name)

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

    def _end_streams(self, req: _Request, partition: str) -> None:
        """The producing partition is done: its consumers' buffers get their final chunk (see ``StreamEnd``)."""
        for edge in self.streams:
            if edge.src_partition != partition or req.partitions.is_done(edge.dst_partition):
                continue
            dst = req.rank_of(self._consumer_walk[edge.signal], edge.dst_node)
            src = req.stream_src.get(edge.signal)
            end = m.StreamEnd(request_id=req.wire_id, signal=edge.signal, forward_to=-1 if src is None else dst)
            self._send(dst if src is None else src, end)

    def _on_emit(self, emit: m.Emit) -> None:
        req = self._by_wire.get(emit.request_id)
        if req is None:
            return
        before = req.state.completion_tokens
        try:
            values = decode_ids(emit.values) if emit.signal in self._id_signals else \
                [decode_tensor(v) for v in emit.values]
            out = self.model.postprocess(req.state, emit.signal, values)
            deltas = _deltas(out, req.state.completion_tokens - before)
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

    def _emit_text(self, req: _Request, delta: TextDelta) -> bool:
        """Send ``delta`` cut at the request's stop strings; True when a stop string ended the request."""
        if req.stops is None:
            req.stops = StopTrimmer(req.params.stop)
        text = req.stops.feed(delta.text)
        if text or delta.n_tokens:
            if trace.ON:
                trace.first("cond_first_delta", [req.wire_id], text=bool(text))
            req.sink(TextDelta(text=text, n_tokens=delta.n_tokens))
        if req.stops.stopped:
            self._finish(req, "stop")
        return req.stops.stopped

    # ---- ends ----
    def _release(self, req: _Request) -> None:
        self._active.pop(req.state.request_id, None)
        self._by_wire.pop(req.wire_id, None)
        for rank in sorted(req.touched | {r for ranks in req.replicas.values() for r in ranks}):
            self._send(rank, m.RemoveRequest(request_id=req.wire_id))
        self._admit_queued()

    def _finish(self, req: _Request, reason: str) -> None:
        stops = req.stops or StopTrimmer(req.params.stop)
        if not stops.stopped:
            tail = stops.feed(self.model.finish_text(req.state)) + stops.flush()
            if tail:
                req.sink(TextDelta(text=tail, n_tokens=0))
            if stops.stopped:
                reason = "stop"
        latency = time.monotonic() - req.arrived
        self._latency_ewma_s += 0.2 * (latency - self._latency_ewma_s)
        self.metrics.observe_done(reason, latency, req.state.completion_tokens, req.state.prompt_tokens)
        req.sink(Finished(finish_reason=reason, prompt_tokens=req.state.prompt_tokens,
                          completion_tokens=req.state.completion_tokens))
        self._release(req)

    def _finish_error(self, req: _Request, status: int, message: str) -> None:
        log.error("request %s failed: %s", req.state.request_id, message)
        self.metrics.observe_done("error", time.monotonic() - req.arrived, req.state.completion_tokens)
        req.sink(BackendError(status, message))
        self._release(req)

    def _abort(self, request_id: str, sink: Sink | None = None) -> None:
        """Abort a queued or running request; with ``sink``, only the submission that owns that sink (a late abort
        must not hit a newer request that reuses the same pinned id)."""
        for i, q in enumerate(self._queue):
            if q.params.request_id == request_id and sink in (None, q.sink):
                del self._queue[i]
                self.metrics.observe_done("abort", 0.0, 0)
                return
        req = self._active.get(request_id)
        if req is not None and sink in (None, req.sink):
            self.metrics.observe_done("abort", time.monotonic() - req.arrived, req.state.completion_tokens)
            self._release(req)

    def _check_timeouts(self, now: float) -> None:
        """Fail (504) every running or queued request older than ``request_timeout_s``; a running one is removed
        from every rank it touched (its tensors and KV are freed)."""
        limit = self.request_timeout_s
        while self._queue and now - self._queue[0].arrived > limit:  # FIFO: the oldest is first
            q = self._queue.popleft()
            self.metrics.observe_done("error", now - q.arrived, 0)
            q.sink(BackendError(504, f"request timed out after {limit:g} s waiting for admission "
                                     f"(limits.request_timeout_s); the server is overloaded"))
        for req in list(self._active.values()):
            if now - req.arrived > limit:
                self._finish_error(req, 504, f"request timed out after {limit:g} s (limits.request_timeout_s)")

    def _check_ranks(self, now: float) -> None:
        """Declare ranks that went silent dead (docs/architecture.md §10) and fail every request that touches them."""
        if not self.serving:
            return
        for rank in range(self.world_size):
            seen = self.last_seen.get(rank, now)
            if self.placement.is_conductor(rank):
                continue  # our own process: if it were dead, so would we be; silence is only a long step
            if rank in self.dead_ranks or now - seen <= self.rank_timeout_s:
                continue
            why = f"silent for {now - seen:.0f} s on host {self.rank_hosts.get(rank, '?')}"
            log.error("rank %d declared dead: %s (limits.rank_timeout_s=%g)", rank, why, self.rank_timeout_s)
            self._declare_dead(rank, why, "died")

    def _declare_dead(self, rank: int, why: str, verb: str) -> None:
        """``rank`` serves no more: new requests avoid it, and every request touching it fails with a 503."""
        host = self.rank_hosts.get(rank, "?")
        self.dead_ranks[rank] = why
        for peer in range(self.world_size):  # their data planes give up on it: pending transfers end
            if peer not in self.dead_ranks:
                self._send(peer, m.RankDown(rank=rank, reason=why))
        for req in list(self._active.values()):
            if rank in req.touched or any(rank in ranks for ranks in req.replicas.values()):
                self._finish_error(req, 503, f"rank {rank} on host {host} {verb} ({why}); retry the request")

    def log_stats(self, now: float) -> None:
        """One log line: generation throughput since the last line, load, and the per-rank leak canary; then one
        line per data-plane edge (walk, producer -> consumer, signal, transport) with its bytes, count and
        p50/p99 transfer time."""
        since, tokens = self._stats_mark
        rate = (self.metrics.tokens_generated - tokens) / max(now - since, 1e-9)
        live = {r: st.live_tensors for r, st in sorted(self.metrics.rank_stats.items())}
        log.info("stats: %.1f tok/s, %d running, %d queued, finished %s, live tensors per rank %s, dead ranks %s",
                 rate, len(self._active), len(self._queue), dict(self.metrics.finished), live,
                 sorted(self.dead_ranks))
        for e in self.metrics.edges():
            log.info("edge %s: rank %d -> rank %d, %s via %s: %d transfer(s), %d bytes, p50 %.3f ms, p99 %.3f ms",
                     e.walk or "-", e.src, e.dst, e.signal or "-", e.via, e.count, e.nbytes, e.p50_s * 1e3,
                     e.p99_s * 1e3)
        self._stats_mark = (now, self.metrics.tokens_generated)

    def unservable_walks(self) -> list[str]:
        """Walks with no live replica left (the service is down for them)."""
        live = set(range(self.world_size)) - set(self.dead_ranks)
        return sorted({walk for walk, node in self._walk_nodes
                       if not any(set(r.ranks) <= live for r in self.placement.replicas(walk, node))})

    def _fail_all(self, status: int, message: str) -> None:
        for req in list(self._active.values()):
            self._finish_error(req, status, message)
        while self._queue:
            self._queue.popleft().sink(BackendError(status, message))

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active_count(self) -> int:
        return len(self._active)


def _deltas(out: Any, n_tokens: int) -> list[TextDelta | MediaDelta]:
    """What ``postprocess`` returned (text, a media delta, or a list of them) as deltas; the request's new token
    count rides on the first one (on an empty text delta when there is nothing else)."""
    items = out if isinstance(out, list) else [out]
    deltas: list[TextDelta | MediaDelta] = []
    for item in items:
        if isinstance(item, str):
            deltas.append(TextDelta(text=item, n_tokens=0))
        elif isinstance(item, (TextDelta, MediaDelta)):
            deltas.append(item)
        else:
            raise TypeError(f"postprocess returned {type(item).__name__}; expected str, TextDelta or MediaDelta")
    if not deltas:
        deltas.append(TextDelta(text="", n_tokens=0))
    first = deltas[0]
    deltas[0] = (TextDelta(first.text, first.n_tokens + n_tokens) if isinstance(first, TextDelta)
                 else MediaDelta(first.modality, first.data, first.metadata, first.n_tokens + n_tokens))
    return deltas
