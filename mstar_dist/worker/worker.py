"""The rank's event loop (docs/architecture.md §2, §7): control messages in, data-plane transfers, batched node calls, results out.

Runs on the main thread and issues *all* of this rank's torch.distributed work (sends and receives on the pair
groups), so NCCL ops of a rank are never issued from two threads. Each turn of the loop (:meth:`Worker.poll_once`):
1. drains the control socket (``RunWalk``, ``Push``, ``TensorDesc``, ``StreamItems``/``StreamEnd``, ``NodeDone``,
   ``RemoveRequest``...); a message that overtakes its request's ``RunWalk`` is kept and applied when it starts;
2. polls in-flight transfers (a receive completes a waiting walk's input; a send releases the producer's ref);
3. feeds streamed chunks (from producer walks of other partitions, through each edge's chunk policy) into the
   consuming walks;
4. gathers every walk's ready node calls, hands each component all of its calls at once (continuous batching),
   and routes the results (``Emit`` to the conductor, ``StreamItems`` to a consumer rank, ``WalkDone`` when a
   walk ends). A ``StreamEnd`` the conductor routes through this rank is forwarded after its items.
A request that fails on this rank is reported in ``WalkDone.error``; the rank lives on. The loop blocks on the
control socket unless a call is runnable (1 ms slices while transfers are in flight; no blocking while an NCCL
transfer is, or a component's work that answers a call later is on the GPU (``Component.pending``), since their end
wakes nobody), after polling it without blocking for ``transport.spin_us`` (GPU ranks: a message that comes then is
taken without a wake-up).

The worker holds one part per concern, each owning its state: :class:`~mstar_dist.worker.runs.Runs` (the walks),
:class:`~mstar_dist.worker.transfers.Transfers` (the data plane), :class:`~mstar_dist.worker.streams.Streams`
(streaming edges), :class:`~mstar_dist.worker.spans.Spans` (walks across ranks) and
:class:`~mstar_dist.worker.tp.TPReplicas` (tensor parallelism). The per-token path (:meth:`Worker._step`,
:meth:`Worker._flush_emits`) stays here.
"""

from __future__ import annotations

import collections
import logging
import time
import traceback
from typing import Callable, Sequence

import torch

from mstar_dist import trace
from mstar_dist.control import messages as m
from mstar_dist.control.envelope import CONDUCTOR, Reject, is_rank, open_envelope, parse_rank, rank_name
from mstar_dist.control.port import ControlPort
from mstar_dist.engine.component import Component, WalkContext
from mstar_dist.engine.sampling import SamplingParams
from mstar_dist.graph.nodes import Section
from mstar_dist.graph.partitions import StreamingEdge
from mstar_dist.graph.walk import GraphError, NodeCall, WalkRun
from mstar_dist.telemetry import process_sample
from mstar_dist.transport.inline import encode_tensor
from mstar_dist.transport.router import Router
from mstar_dist.transport.store import TensorStore
from mstar_dist.worker.runs import Runs, host_inputs, resolve
from mstar_dist.worker.spans import Span, Spans, is_remote
from mstar_dist.worker.streams import Streams
from mstar_dist.worker.tp import TPPeerLost, TPReplicas, TPRole, tp_failure
from mstar_dist.worker.transfers import Transfers

__all__ = ["Worker"]

log = logging.getLogger(__name__)


class Worker:
    """One rank's worker. ``channel`` is this rank's control port (already connected to every peer); ``transport``
    its data plane (``transport/router.py``: inline, p2p, shm, mooncake chosen per tensor); ``store`` holds the
    tensors it keeps for other ranks."""

    def __init__(
        self,
        *,
        global_rank: int,
        graphs: dict[str, Section],
        components: dict[str, Component],
        channel: ControlPort,
        transport: Router,
        store: TensorStore,
        token: str,
        device: torch.device,
        inline_max_bytes: int,
        transfer_timeout_s: float = 120.0,
        streaming_edges: Sequence[StreamingEdge] = (),
        conductor_timeout_s: float | None = None,
        tp_roles: dict[str, TPRole] | None = None,
        backpressure_timeout_s: float = 10.0,
        spin_s: float = 0.0,
        form_pairs: Callable[..., dict] | None = None,
        incarnation: int = 0,
        rank0_up: Callable[[], bool] | None = None,
    ):
        """``form_pairs(prefix, pairs)``: forms fresh pair groups with a rejoining peer (``distributed/repair.py``;
        None: this rank cannot, and says so); ``incarnation``: how often this rank was restarted in place."""
        self.global_rank, self.name = global_rank, rank_name(global_rank)
        self.graphs, self.components = graphs, components
        self.channel, self.transport, self.store = channel, transport, store
        self.token, self.device, self.inline_max_bytes = token, device, inline_max_bytes
        self.spin_s = spin_s
        """Poll the control socket without blocking this long before sleeping in it (``transport.spin_us``)."""
        self.conductor_timeout_s = conductor_timeout_s
        self.rank0_up = rank0_up
        """Whether rank 0's host still answers (its launch store; may wait up to the rank timeout for an answer)."""
        self.rank0_gone = False
        """The conductor went silent and rank 0's host did not answer either."""
        self._silence_excused = False
        self.conductor_seen: float | None = None
        """When the conductor was last heard from; armed by its first message (the conductor starts last)."""
        self._last_check = time.monotonic()
        self.stats_every_s = 0.5
        """How often the rank reports ``Stats`` to the conductor."""
        self.stopping = False
        self.restart_asked = False
        """The conductor's ``Shutdown`` asked this rank alone to go and be restarted (not the deployment's end)."""
        self.conductor_silent = False
        """The loop ended because the conductor went silent: rank 0's host is gone, or the conductor declared this
        rank dead while it was stopped or starved and speaks to it no more (the rank tells which: ``rank.py``)."""
        self.incarnation = incarnation
        self.rejected_messages = 0
        """Control messages dropped: undecodable, without this launch's secret, or from a spoofed sender."""
        self.failed_reason: str | None = None
        self.runs = Runs()
        self._build_parts(streaming_edges=streaming_edges, tp_roles=tp_roles, form_pairs=form_pairs,
                          transfer_timeout_s=transfer_timeout_s, backpressure_timeout_s=backpressure_timeout_s)
        self._emits: dict[str, list[tuple[str, torch.Tensor]]] = collections.defaultdict(list)
        self._done_out: list[m.WalkDone] = []  # walks ended this turn: reported with its emits (``_flush_emits``)
        self._ended: set[str] = set()  # requests whose last walk here ended this turn: their emits go, then the list
        self._host_inputs_of: dict[str, frozenset[str]] = {}  # walk -> inline inputs kept on the host
        self._deferred_only = False  # the last step ran nothing: every call was deferred (no free KV slot)
        self._last_stats = 0.0
        self._handlers = _handlers(self)

    def _build_parts(self, *, streaming_edges: Sequence[StreamingEdge], tp_roles: dict[str, TPRole] | None,
                     form_pairs: Callable[..., dict] | None, transfer_timeout_s: float,
                     backpressure_timeout_s: float) -> None:
        """The loop's parts: transfers, streams, walks across ranks and TP replicas (each a module of worker/)."""
        removed = self.runs.removed
        self.transfers = Transfers(
            global_rank=self.global_rank, name=self.name, token=self.token, channel=self.channel,
            transport=self.transport, store=self.store, send=self._send, removed=removed, start_walk=self._start_walk,
            report_failure=self._report_failure, transfer_timeout_s=transfer_timeout_s,
            backpressure_timeout_s=backpressure_timeout_s, form_pairs=form_pairs)
        self.streams = Streams(
            edges=list(streaming_edges), graphs=self.graphs, name=self.name, runs=self.runs, transfers=self.transfers,
            send=self._send, removed=removed, fail_request=self._fail_request, flush_emits=self._flush_emits)
        self.spans = Spans(global_rank=self.global_rank, transport=self.transport, transfers=self.transfers,
                           send=self._send, removed=removed, fail_run=self._fail_run,
                           transfer_timeout_s=transfer_timeout_s)
        self.tp = TPReplicas(roles=dict(tp_roles or {}), name=self.name, device=self.device,
                             components=self.components, store=self.store, transfers=self.transfers, send=self._send,
                             transfer_timeout_s=transfer_timeout_s)

    # ---- loop ----
    def run(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Serve until a ``Shutdown`` message arrives or ``should_stop()`` is true. Never returns on its own.
        On the way out, TP replicas end in step: see :meth:`end_tp`."""
        try:
            while not self.stopping and not should_stop():
                self.poll_once(self._wait_ms())
        finally:
            self.end_tp()

    def poll_once(self, timeout_ms: int = 0) -> None:
        """One turn of the loop (see the module docstring): control messages (waiting up to ``timeout_ms`` for the
        first), transfers, TP followers' steps, streamed chunks, one step of node calls, then ``Stats`` when due and
        the conductor's heartbeat check."""
        stashed, self.transfers.stash = self.transfers.stash, []
        for sender, payload in stashed or self.channel.recv(timeout_ms, spin_s=self.spin_s):
            self.handle(sender, payload)
        self.transfers.poll()
        self.tp.run_follower_steps()
        self.streams.feed()
        self._step()
        self._maybe_send_stats()
        self._check_conductor()

    def _wait_ms(self) -> int:
        """How long the next turn may block on the control socket."""
        if not self._deferred_only and self._runnable():
            return 0  # a node call can run: poll at once
        if any(component.pending() for component in self.components.values()):
            return 0  # a component's work is on the GPU (a prefill): its end wakes nobody either
        if self.transfers.busy() or self.streams.busy() or self.spans.busy() or self.tp.follower.steps:
            # an NCCL transfer's end wakes nobody: poll for it rather than sleep up to 1 ms past it
            return 0 if self.transport.device_inflight() else 1
        self.transport.collect_garbage_if_held()  # idle: received arena tensors in cycles go back
        return 20

    def end_tp(self, drain_s: float = 10.0) -> None:
        """Leaders tell their followers that no step follows (``TPEnd``); followers run the steps they were sent
        until every leader said so, at most ``drain_s``. Members of a TP group stop together (one signal reaches
        them all): a follower that left first would leave its leader blocked in the collectives of a step sent
        just before, and with NCCL such a wait has no end."""
        waiting = self.tp.tell_end()
        deadline = time.monotonic() + drain_s
        while waiting - self.tp.ended:
            if time.monotonic() > deadline:
                log.warning("%s: stopping without the end of the TP steps of %s (its leader did not say within %g s)",
                            self.name, sorted(waiting - self.tp.ended), drain_s)
                return
            for sender, payload in self.channel.recv(5):
                self.handle(sender, payload)
            self.transfers.poll()
            self.tp.run_follower_steps()

    def held_requests(self) -> set[str]:
        """Requests this rank still holds anything of (walks, emits, streams, spans, waiting inputs): empty once
        every request it served has ended."""
        held = {rid for rid, _ in self.runs.by_key} | set(self._emits) | self.streams.requests()
        held |= {rid for rid, _ in self.spans.by_key} | {rid for (rid, _), a in self.spans.arrivals.items() if a}
        return held | {rid for rid, _ in self.transfers.waiting}

    def _send(self, peer: str, body: m.Message) -> None:
        if peer == CONDUCTOR and self._done_out:
            self._flush_emits()  # FIFO: the walks that ended before this message are reported before it
        self.channel.send(peer, m.encode(self.token, self.name, body))
        self.transport.flush()  # p2p sends wait for their descriptor to be out (docs/architecture.md §7)

    def handle(self, sender: str, payload: bytes) -> None:
        """Apply one control message from socket peer ``sender`` (dropped and counted unless it is this launch's,
        from the conductor or a rank, as it claims)."""
        env = open_envelope(payload, sender, self.token, _from_conductor_or_rank)
        if isinstance(env, Reject):
            self.rejected_messages += 1
            log.warning("%s: %s", self.name, env)
            return
        if sender == CONDUCTOR:
            self.conductor_seen = time.monotonic()
            self._silence_excused = False
        handler = self._handlers.get(type(env.body))
        if handler is None:
            log.warning("%s: unexpected %s from %r", self.name, type(env.body).__name__, sender)
        else:
            handler(env.body, sender)

    # ---- walks ----
    def _on_run_walk(self, msg: m.RunWalk) -> None:
        if trace.ON:
            trace.event("rank_runwalk", msg.request_id, walk=msg.walk)
        if msg.request_id in self.runs.removed:
            return
        missing = {name for name, value in msg.inputs.items()
                   if isinstance(value, m.TensorRef) and value.rank != self.global_rank}
        if missing:
            self.transfers.wait_for(msg, missing)
        else:
            self._start_walk(msg, {})

    def _start_walk(self, msg: m.RunWalk, received: dict[str, torch.Tensor]) -> None:
        key = (msg.request_id, msg.walk)
        try:
            span = self.spans.open(key, self.graphs[msg.walk], msg.node_ranks) if msg.node_ranks else None
            run = self._new_run(msg, received, span)
            if msg.stream_routes:
                self.streams.routes.setdefault(msg.request_id, {}).update(msg.stream_routes)  # partitions here add up
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            log.error("%s: request %s walk %s failed: %s", self.name, msg.request_id, msg.walk, error)
            self._report_failure(msg.request_id, msg.walk, error)
            return
        run.inputs = dict.fromkeys(run.inputs)  # delivered at construction; keep names only, free big tensors
        self.runs.add(run)
        if span is not None:
            self.spans.keep(key, span)
        if run.done:
            self._finish(run)
            self._flush_emits()

    def _new_run(self, msg: m.RunWalk, received: dict[str, torch.Tensor], span: Span | None) -> WalkRun:
        """The walk ``msg`` starts on this rank, its inputs delivered (kept tensors consumed here released)."""
        on_host = self._host_inputs_of.get(msg.walk)
        if on_host is None:
            on_host = self._host_inputs_of[msg.walk] = host_inputs(self.graphs[msg.walk], self.components)
        inputs = {name: resolve(value, received.get(name), store=self.store,
                                device=torch.device("cpu") if name in on_host else self.device)
                  for name, value in msg.inputs.items()}
        self.tp.keep_inputs((msg.request_id, msg.walk),
                            {name: v.uuid for name, v in msg.inputs.items() if isinstance(v, m.TensorRef)})
        for name in msg.release:  # consumed here, on the producer's own rank: the walk holds the tensor now
            self.store.unpersist(msg.inputs[name].uuid)
        ctx = WalkContext(
            request_id=msg.request_id, walk=msg.walk, walk_index=msg.walk_index, seed=msg.seed,
            sampling=SamplingParams.of(msg.sampling, seed=msg.seed),
            export=frozenset(msg.export), stop_token_ids=frozenset(msg.stop_token_ids),
        )
        emits, streamed = self._emits[msg.request_id], self.streams.out[msg.request_id]
        return WalkRun(
            request_id=msg.request_id, walk=msg.walk, section=self.graphs[msg.walk], inputs=inputs, ctx=ctx,
            loop_limits=dict(msg.loop_limits),
            on_emit=lambda signal, value: emits.append((signal, value)),
            on_stream=lambda signal, value: streamed.append((signal, value)),
            emitting_nodes=None if span is None else {n for n, r in span.node_ranks.items() if r == span.me},
            streamed_inputs=self.streams.streamed_inputs(msg.walk),
        )

    def _runnable(self) -> bool:
        """Some run has a call this rank runs: what ``_collect`` would find, without building the batches (the loop
        asks every turn, before ``_step`` collects them)."""
        spans = self.spans.by_key
        for key, run in self.runs.by_key.items():
            calls = run.outstanding
            if calls:
                span = spans.get(key)
                if span is None or any(span.is_local(call.node) for call in calls):
                    return True
        return False

    def _collect(self) -> dict[str, list[NodeCall]]:
        """Every runnable call (new ones and ones a component asked to retry), grouped by component."""
        by_component: dict[str, list[NodeCall]] = collections.defaultdict(list)
        spans = self.spans.by_key
        for key, run in self.runs.by_key.items():
            run.ready()
            span = spans.get(key) if spans else None
            for call in run.outstanding:
                if span is None or span.is_local(call.node):  # another rank runs it: its NodeDone completes it
                    by_component[call.node].append(call)
        return by_component

    def _step(self) -> None:
        finished: list[WalkRun] = self.spans.advance(self.runs.by_key) if self.spans.by_key else []
        progressed = False
        tp_roles = self.tp.roles
        for node, calls in self._collect().items():
            component = self.components.get(node)
            if component is None:
                results: list = [GraphError(f"node {node!r} is not placed on rank {self.global_rank}")] * len(calls)
            else:
                try:
                    role = tp_roles.get(node)
                    if role is not None and role.leads:
                        self.tp.lead(node, calls)
                    results = component.run_batch(calls)
                    if len(results) != len(calls):
                        raise RuntimeError(f"{node}.run_batch returned {len(results)} results for {len(calls)} calls")
                except Exception as exc:  # a broken batch fails exactly the requests in it
                    results = [exc] * len(calls)
                if node in tp_roles:
                    results = [tp_failure(tp_roles[node], r) for r in results]
            runs, spans = self.runs.by_key, self.spans.by_key
            for call, result in zip(calls, results):
                if not result:  # None or a Held (falsy): handed over again in a later turn
                    continue
                run = call.run
                key = (run.request_id, run.walk)
                if runs.get(key) is not run:
                    continue  # the request failed in another component's batch this turn
                progressed = True
                if isinstance(result, BaseException):
                    self._fail_run(run, result)
                    continue
                try:
                    span = spans.get(key) if spans else None
                    if span is not None:
                        self.spans.announce(span, run, call, result)
                    run.complete(call, result)
                except Exception as exc:
                    self._fail_run(run, exc)
                    continue
                if run.done:
                    finished.append(run)
        self._deferred_only = not progressed
        for run in finished:
            self._finish(run)
        self._flush_emits()

    def _flush_emits(self) -> None:
        """Send this step's emitted values of every request, and the walks that ended in it, to the conductor as one
        ``Emits`` message (after the step's streamed values have left for their consumers' ranks: a walk's end makes
        the conductor end its streams)."""
        out: list[m.Emit] = []
        failed: list[tuple[str, str]] = []  # failed once the message is out (a failure is reported after it)
        for request_id, items in self._emits.items():
            if not items:
                continue
            try:
                if len(items) == 1:  # a decode step's one token: every row, every step
                    signal, value = items[0]
                    out.append(m.Emit(request_id=request_id, signal=signal, values=[encode_tensor(value)]))
                else:
                    by_signal: dict[str, list] = collections.defaultdict(list)
                    for signal, value in items:
                        by_signal[signal].append(encode_tensor(value))  # it copies a device tensor to the host
                    out.extend(m.Emit(request_id=request_id, signal=signal, values=values)
                               for signal, values in by_signal.items())
            except Exception as exc:  # a component emitted something that is not a tensor
                failed.append((request_id, f"emitted value: {type(exc).__name__}: {exc}"))
            items.clear()
        for request_id in self._ended:
            if not self.runs.of(request_id):
                self._emits.pop(request_id, None)
        self._ended.clear()
        if self.streams.out:
            failed.extend(self.streams.flush())
        done, self._done_out = self._done_out, []
        if out or done:
            if trace.ON and out:  # stamped as it is handed to the socket (after, the conductor may be first on the clock)
                trace.first("rank_emits_sent", [e.request_id for e in out], n=len(out))
            self._send(CONDUCTOR, m.Emits(items=out, done=done))
        for request_id, error in failed:
            self._fail_request(request_id, error)

    def _finish(self, run: WalkRun) -> None:
        """Report the walk's end with this turn's emits (its own come first in that message: ``_flush_emits``)."""
        key = (run.request_id, run.walk)
        self.runs.drop(run)
        if not self.runs.of(run.request_id):
            self._ended.add(run.request_id)
        self.streams.drop(run.request_id, consumer=run)
        self.spans.close(key)
        self.tp.walk_ended(key)
        outputs: dict[str, m.Value] = {}
        for signal, value in run.outputs.items():
            if is_remote(value):
                continue  # the rank that produced it reports it
            if isinstance(value, list):  # accumulated loop output: one row per iteration
                value = torch.stack(value) if value else torch.empty(0)
            if not isinstance(value, torch.Tensor):
                continue
            nbytes = value.numel() * value.element_size()
            if signal in run.persist_signals or nbytes > self.inline_max_bytes:
                uuid = self.store.put(value, tag=run.request_id)
                self.tp.kept_output(uuid, run.request_id, signal)
                outputs[signal] = m.TensorRef(
                    uuid=uuid, rank=self.global_rank, shape=list(value.shape),
                    dtype=str(value.dtype).removeprefix("torch."), nbytes=nbytes,
                )
            else:
                outputs[signal] = encode_tensor(value.detach().to("cpu"))
        self._done_out.append(m.WalkDone(request_id=run.request_id, walk=run.walk, rank=self.global_rank,
                                         outputs=outputs, finish_reason=run.finish_reason))
        run.close()

    # ---- failures and removal ----
    def _fail_run(self, run: WalkRun, exc: BaseException) -> None:
        status = 503 if isinstance(exc, TPPeerLost) else 500
        log.error("%s: request %s failed in walk %s:\n%s", self.name, run.request_id, run.walk,
                  "".join(traceback.format_exception(exc)))
        self.runs.drop(run)
        run.close()
        self.spans.by_key.pop((run.request_id, run.walk), None)
        self._emits.pop(run.request_id, None)
        for component in self.components.values():
            component.release(run.request_id)
        self._send(CONDUCTOR, m.WalkDone(request_id=run.request_id, walk=run.walk, rank=self.global_rank,
                                         outputs={}, error=f"{type(exc).__name__}: {exc}", status=status))

    def _fail_request(self, request_id: str, error: str) -> None:
        """Fail every walk of a request on this rank (reported to the conductor once per walk)."""
        runs = self.runs.of(request_id)
        for run in runs:
            self._fail_run(run, RuntimeError(error))
        if not runs:
            log.error("%s: request %s: %s", self.name, request_id, error)

    def _report_failure(self, request_id: str, walk: str, error: str) -> None:
        """Tell the conductor that ``walk`` of the request failed here before it ran."""
        self._send(CONDUCTOR, m.WalkDone(request_id=request_id, walk=walk, rank=self.global_rank, outputs={},
                                         error=error))

    def _remove(self, request_id: str) -> None:
        for run in self.runs.remove(request_id):
            run.close()
        self.transfers.drop(request_id)
        self._emits.pop(request_id, None)
        self.streams.drop(request_id)
        self.spans.drop(request_id)
        self.tp.release(request_id)
        self.store.drop_tag(request_id)

    def _on_shutdown(self, msg: m.Shutdown) -> None:
        (log.warning if msg.error else log.debug)(  # a requested stop: the rank's exit line says it
            "%s: %s: %s", self.name, "asked to restart" if msg.restart else "shutdown requested", msg.reason)
        self.stopping = True
        self.restart_asked = msg.restart
        if msg.error:
            self.failed_reason = msg.reason

    # ---- health ----
    def _check_conductor(self) -> None:
        """Leave when the conductor on rank 0 went silent past the rank timeout. Its host is asked first: when it
        answers, the silence gets one more rank timeout (the conductor's process was stopped, or this rank was cut
        off and declared dead: the conductor then says so as soon as it hears from this rank); when it does not, rank
        0's host is gone and nobody will call us. A turn of the loop long after the last one means this process
        itself did not run (stopped, or its host froze): the conductor's silence meanwhile is not news, and the wait
        starts again."""
        now = time.monotonic()
        gap, self._last_check = now - self._last_check, now
        if self.conductor_timeout_s is None or self.conductor_seen is None:
            return
        if gap > m.OWN_PAUSE_S:
            self.conductor_seen += gap
        silent = now - self.conductor_seen
        if silent <= self.conductor_timeout_s:
            return
        if self.rank0_up is not None and not self._silence_excused:
            self._silence_excused = True
            if self.rank0_up():
                log.warning("%s: the conductor (rank 0) has been silent for %.0f s, but rank 0's host answers: "
                            "waiting for the conductor once more", self.name, silent)
                self.conductor_seen = self._last_check = time.monotonic()
                return
            self.rank0_gone = True
        self.failed_reason = (f"the conductor (rank 0) has been silent for {silent:.0f} s "
                              f"(limits.rank_timeout_s={self.conductor_timeout_s:g})")
        self.conductor_silent = True
        self.stopping = True

    def _maybe_send_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < self.stats_every_s:
            return
        self._last_stats = now
        st = self.transport.stats()
        engine: dict[str, int] = collections.Counter()
        for component in self.components.values():
            try:
                engine.update(component.stats())
            except Exception:
                log.exception("%s: %s.stats() failed", self.name, getattr(component, "name", "?"))
        self._send(CONDUCTOR, m.Stats(
            rank=self.global_rank, live_tensors=self.store.live_tensors, live_bytes=self.store.live_bytes,
            edge_bytes_sent=int(st.get("bytes_sent", 0)), edge_bytes_received=int(st.get("bytes_received", 0)),
            host_staging_copies=int(st.get("host_staging_copies", 0)), engine=dict(engine),
            rejected_messages=self.rejected_messages, edge_histograms=st.get("histograms", []), **process_sample(),
            arena_bytes_used=self.transport.arena_bytes_used(), edges=self.transport.edges.snapshot(),
            incarnation=self.incarnation,
        ))


def _from_conductor_or_rank(sender: str) -> bool:
    return sender == CONDUCTOR or is_rank(sender)


def _handlers(w: Worker) -> dict[type, Callable[[m.Message, str], None]]:
    """Message type -> what the worker does with one (body, sender); the sender of a rank's message is a rank."""
    return {
        m.Heartbeat: lambda body, sender: None,
        m.RunWalk: lambda body, sender: w._on_run_walk(body),
        m.TensorDesc: lambda body, sender: w.transfers.on_tensor_desc(body),
        m.Push: lambda body, sender: w.transfers.push(body, before=w.tp.push_shards),
        m.NodeDone: lambda body, sender: w.spans.on_node_done(body, parse_rank(sender)),
        m.TPStep: lambda body, sender: w.tp.follower.steps.append(body),
        m.TPPush: lambda body, sender: w.tp.on_tp_push(body),
        m.TPEnd: lambda body, sender: w.tp.ended.add(body.node),
        m.TransferAck: lambda body, sender: w.transfers.on_ack(body, sender),
        m.RankDown: lambda body, sender: w.transport.abort_peer(
            body.rank, f"rank {body.rank} was declared dead: {body.reason}"),
        m.AbortPair: lambda body, sender: w.transfers.on_abort_pair(body),
        m.Repair: lambda body, sender: w.transfers.on_repair(body),
        m.StreamItems: w.streams.on_message,
        m.StreamEnd: w.streams.on_message,
        m.RemoveRequest: lambda body, sender: w._remove(body.request_id),
        m.Shutdown: lambda body, sender: w._on_shutdown(body),
    }
