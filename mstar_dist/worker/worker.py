"""The rank's event loop (docs/architecture.md §2, §7): control messages in, data-plane transfers, batched node calls, results out.

Runs on the main thread and issues *all* of this rank's torch.distributed work (sends and receives on the pair
groups), so NCCL ops of a rank are never issued from two threads. Each turn of the loop:
1. drains the control socket (``RunWalk``, ``Push``, ``TensorDesc``, ``StreamItems``/``StreamEnd``, ``StopLoops``,
   ``RemoveRequest``); a message that overtakes its request's ``RunWalk`` is kept and applied when it starts;
2. polls in-flight transfers (a receive completes a waiting walk's input; a send releases the producer's ref);
3. feeds streamed chunks (from producer walks of other partitions, through each edge's chunk policy) into the
   consuming walks;
4. gathers every walk's ready node calls, hands each component all of its calls at once (continuous batching),
   and routes the results (``Emit`` to the conductor, ``StreamItems`` to a consumer rank, ``WalkDone`` when a
   walk ends). A ``StreamEnd`` the conductor routes through this rank is forwarded after its items.
A request that fails on this rank is reported in ``WalkDone.error``; the rank lives on. Walks are keyed by
(request, walk): two partitions of one request may run on the same rank. The loop blocks on the control socket
unless a call is runnable (1 ms slices while transfers are in flight; no blocking while an NCCL transfer is, or a
component's work that answers a call later is on the GPU (``Component.pending``), since their end wakes nobody),
after polling it without blocking for ``transport.spin_us`` (GPU ranks: a message that comes then is taken without a
wake-up).
"""

from __future__ import annotations

import collections
import logging
import re
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed  # noqa: F401 -- DistError, for TP batch failures

from mstar_dist import trace
from mstar_dist.control import messages as m
from mstar_dist.control.port import ControlPort
from mstar_dist.engine.component import Component, WalkContext
from mstar_dist.engine.sampling import SamplingParams
from mstar_dist.graph.nodes import Section, iter_nodes, node_names
from mstar_dist.graph.partitions import StreamingEdge
from mstar_dist.graph.streaming import StreamBuffer
from mstar_dist.graph.walk import GraphError, NodeCall, WalkRun
from mstar_dist.telemetry import process_sample
from mstar_dist.transport.base import ArenaFull, Done
from mstar_dist.transport.inline import decode_tensor, encode_tensor
from mstar_dist.transport.router import Router
from mstar_dist.transport.store import TensorStore
from mstar_dist.worker.spans import REMOTE, Arrived, Span, is_remote, receive
from mstar_dist.worker.tp import Follower, TPRole, shard_uuid, step_for

log = logging.getLogger(__name__)

CONDUCTOR = "conductor"
_RANK_NAME = re.compile(r"rank\d+")


def rank_name(global_rank: int) -> str:
    return f"rank{global_rank}"


@dataclass
class _Waiting:
    """A RunWalk whose inputs include tensors still in flight from other ranks."""

    msg: m.RunWalk
    missing: set[str]
    since: float = field(default_factory=time.monotonic)


@dataclass
class _Outgoing:
    transfer: Any
    uuid: str
    release: bool
    dst: int = -1
    since: float = field(default_factory=time.monotonic)


class Worker:
    """One rank's worker. ``channel`` is this rank's ControlChannel (already connected to every peer);
    ``transport`` its data plane (``transport/router.py``: inline, p2p, shm, mooncake chosen per tensor)."""

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
        streaming_edges: list[StreamingEdge] = (),
        conductor_timeout_s: float | None = None,
        tp_roles: dict[str, TPRole] | None = None,
        backpressure_timeout_s: float = 10.0,
        spin_s: float = 0.0,
    ):
        self.global_rank = global_rank
        self.spin_s = spin_s
        """Poll the control socket without blocking this long before sleeping in it (``transport.spin_us``)."""
        self.graphs = graphs
        self.components = components
        self.channel = channel
        self.transport = transport
        self.store = store
        self.token = token
        self.device = device
        self.inline_max_bytes = inline_max_bytes
        self.transfer_timeout_s = transfer_timeout_s
        self.backpressure_timeout_s = backpressure_timeout_s
        self.name = rank_name(global_rank)
        self._stash: list[tuple[str, bytes]] = []  # messages set aside while a send waited for arena room
        self._runs: dict[tuple[str, str], WalkRun] = {}  # (request, walk): partitions may share a rank
        self._walks_of: dict[str, dict[str, WalkRun]] = {}  # request -> walk -> run: _runs by request, for _runs_of
        self._waiting: dict[str, _Waiting] = {}
        self._incoming: dict[str, Any] = {}  # uuid -> Transfer (posted in descriptor order)
        self._incoming_req: dict[str, str] = {}  # uuid -> request id
        self._outgoing: list[_Outgoing] = []
        self._emits: dict[str, list[tuple[str, torch.Tensor]]] = collections.defaultdict(list)
        self._done_out: list[m.WalkDone] = []  # walks ended this turn: reported with its emits (``_flush_emits``)
        self._ended: set[str] = set()  # requests whose last walk here ended this turn: their emits go, then the list
        self._removed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._early_stops: dict[str, list[str]] = collections.defaultdict(list)
        self._stream_edges = {e.signal: e for e in streaming_edges}
        self._host_inputs_of: dict[str, frozenset[str]] = {}  # walk -> inline inputs kept on the host
        self._streamed_inputs_of: dict[str, frozenset[str]] = {}  # walk -> inputs that arrive on streaming edges
        self._stream_routes: dict[str, dict[str, int]] = {}  # request -> signal -> consumer rank
        self._stream_out: dict[str, list[tuple[str, torch.Tensor]]] = collections.defaultdict(list)
        self._streams: dict[tuple[str, str], StreamBuffer] = {}  # (request, signal) -> consumer-side buffer
        self._chunks: dict[tuple[str, str], collections.deque] = collections.defaultdict(collections.deque)
        self._stream_in: dict[tuple[str, str], collections.deque] = collections.defaultdict(collections.deque)
        """(request, signal) -> received stream items (tensors or transfers in flight) and ends, in order."""
        self._spans: dict[tuple[str, str], Span] = {}  # (request, walk) -> this rank's copy of a spanning walk
        self._arrivals: dict[tuple[str, str], dict] = collections.defaultdict(dict)  # NodeDone by (node, seq)
        self._draining: list[Any] = []  # receives of removed requests, kept until they complete
        self.tp_roles = dict(tp_roles or {})
        """Node -> this rank's role in the node's TP replica (only nodes with tp_size > 1)."""
        self._follower = Follower(device)
        self._tp_ended: set[str] = set()  # nodes whose TP leader said no step follows (TPEnd)
        self._input_refs: dict[tuple[str, str], dict[str, str]] = {}  # (request, walk) -> kept input -> uuid
        self._kept_signal: dict[str, tuple[str, str]] = {}  # uuid of a kept output -> (request, signal)
        self._last_stats = 0.0
        self.stopping = False
        self.rejected_messages = 0
        """Control messages dropped: undecodable, without this launch's secret, or from a spoofed sender."""
        self.failed_reason: str | None = None
        self._deferred_only = False  # the last step ran nothing: every call was deferred (no free KV slot)
        self.conductor_timeout_s = conductor_timeout_s
        self._conductor_seen: float | None = None  # armed by the first heartbeat (the conductor starts last)

    # ---- loop ----
    def run(self, should_stop=lambda: False) -> None:
        """Serve until a ``Shutdown`` message arrives or ``should_stop()`` is true. Never returns on its own.
        On the way out, TP replicas end in step: see :meth:`_end_tp`."""
        try:
            self._serve(should_stop)
        finally:
            self._end_tp()

    def _end_tp(self, drain_s: float = 10.0) -> None:
        """Leaders tell their followers that no step follows (``TPEnd``); followers run the steps they were sent
        until every leader said so, at most ``drain_s``. Members of a TP group stop together (one signal reaches
        them all): a follower that left first would leave its leader blocked in the collectives of a step sent
        just before, and with NCCL such a wait has no end."""
        for node, role in self.tp_roles.items():
            if role.leads:
                for follower in role.followers:
                    try:
                        self._send(rank_name(follower), m.TPEnd(node=node))
                    except Exception:  # the follower's socket is gone: it left already
                        log.debug("%s: could not tell rank %d that TP steps of %s end", self.name, follower, node)
        waiting = {node for node, role in self.tp_roles.items()
                   if not role.leads and not self.transport.is_dead(role.ranks[0])}
        deadline = time.monotonic() + drain_s
        while waiting - self._tp_ended:
            if time.monotonic() > deadline:
                log.warning("%s: stopping without the end of the TP steps of %s (its leader did not say within %g s)",
                            self.name, sorted(waiting - self._tp_ended), drain_s)
                return
            for sender, payload in self.channel.recv(5):
                self._handle(sender, payload)
            self._poll_transfers()
            self._run_follower_steps()

    def _serve(self, should_stop) -> None:
        while not self.stopping and not should_stop():
            # Poll at once only when a node call can run; wait briefly while transfers are in flight.
            if not self._deferred_only and self._runnable():
                timeout_ms = 0
            elif self._pending_calls():
                timeout_ms = 0  # a component's work is on the GPU (a prefill): its end wakes nobody either
            elif self._incoming or self._outgoing or self._waiting or self._chunks or self._in_flight() \
                    or self._follower.steps:
                # an NCCL transfer's end wakes nobody: poll for it rather than sleep up to 1 ms past it
                timeout_ms = 0 if self.transport.device_inflight() else 1
            else:
                timeout_ms = 20
                self.transport.collect_garbage_if_held()  # idle: received arena tensors in cycles go back
            stashed, self._stash = self._stash, []
            for sender, payload in stashed or self.channel.recv(timeout_ms, spin_s=self.spin_s):
                self._handle(sender, payload)
            self._poll_transfers()
            self._run_follower_steps()
            self._feed_streams()
            self._step()
            self._maybe_send_stats()
            self._check_conductor()

    def _pending_calls(self) -> bool:
        return any(component.pending() for component in self.components.values())

    def _send(self, peer: str, body: m.Message) -> None:
        if peer == CONDUCTOR and self._done_out:
            self._flush_emits()  # FIFO: the walks that ended before this message are reported before it
        self.channel.send(peer, m.encode(self.token, self.name, body))
        self.transport.flush()  # p2p sends wait for their descriptor to be out (docs/architecture.md §7)

    def _handle(self, sender: str, payload: bytes) -> None:
        try:
            env = m.decode(payload)
        except Exception as exc:
            self.rejected_messages += 1
            log.warning("%s: dropped an undecodable control message from %r: %s", self.name, sender, exc)
            return
        if env.token != self.token:
            self.rejected_messages += 1
            log.warning("%s: rejected a message from %r without this launch's deployment secret", self.name, sender)
            return
        if env.sender != sender or not (sender == CONDUCTOR or _RANK_NAME.fullmatch(sender)):
            self.rejected_messages += 1
            log.warning("%s: rejected a message from unknown sender %r (claims to be %r)", self.name, sender,
                        env.sender)
            return
        body = env.body
        if sender == CONDUCTOR:
            self._conductor_seen = time.monotonic()
        if isinstance(body, m.Heartbeat):
            return
        if isinstance(body, m.RunWalk):
            self._on_run_walk(body)
        elif isinstance(body, m.TensorDesc):
            self._on_tensor_desc(body)
        elif isinstance(body, m.Push):
            self._on_push(body)
        elif isinstance(body, m.NodeDone):
            self._on_node_done(body, int(sender[4:]))
        elif isinstance(body, m.TPStep):
            self._follower.steps.append(body)
        elif isinstance(body, m.TPPush):
            self._on_tp_push(body)
        elif isinstance(body, m.TPEnd):
            self._tp_ended.add(body.node)
        elif isinstance(body, m.TransferAck):
            if sender != CONDUCTOR:
                self.transport.on_ack(int(sender[4:]), body)
        elif isinstance(body, m.RankDown):
            self.transport.abort_peer(body.rank, f"rank {body.rank} was declared dead: {body.reason}")
        elif isinstance(body, m.AbortPair):
            self._abort_pair(body.src, body.dst, f"peer rank{body.src if body.dst == self.global_rank else body.dst}: "
                                                 f"{body.reason}", tell_peer=False)
        elif isinstance(body, (m.StreamItems, m.StreamEnd)):
            try:
                self._on_stream(body, sender)
            except Exception as exc:  # a malformed or out-of-order stream fails its request, not the rank
                self._fail_request(body.request_id, f"stream {body.signal!r}: {type(exc).__name__}: {exc}")
        elif isinstance(body, m.StopLoops):
            runs = self._runs_of(body.request_id)
            for run in runs:
                span = self._spans.get((run.request_id, run.walk))
                if span is not None:
                    span.pending_stops.append(body.loop)  # every copy must stop in the same iteration
                else:
                    run.stop_loop(body.loop)
            if not runs and body.request_id not in self._removed:
                self._early_stops[body.request_id].append(body.loop)  # overtook its RunWalk: replay then
        elif isinstance(body, m.RemoveRequest):
            self._remove(body.request_id)
        elif isinstance(body, m.Shutdown):
            log.info("%s: shutdown requested: %s", self.name, body.reason)
            self.stopping = True
            if body.error:
                self.failed_reason = body.reason
        else:
            log.warning("%s: unexpected %s from %r", self.name, type(body).__name__, sender)

    # ---- messages ----
    def _on_run_walk(self, msg: m.RunWalk) -> None:
        if trace.ON:
            trace.event("rank_runwalk", msg.request_id, walk=msg.walk)
        if msg.request_id in self._removed:
            return
        missing = {
            name
            for name, value in msg.inputs.items()
            if isinstance(value, m.TensorRef) and value.rank != self.global_rank
        }
        if missing:
            self._waiting[(msg.request_id, msg.walk)] = _Waiting(msg=msg, missing=missing)
            self._try_start_waiting((msg.request_id, msg.walk))
        else:
            self._start_walk(msg, {})

    def _on_tensor_desc(self, desc: m.TensorDesc) -> None:
        # Post the receive now, in descriptor order, whatever the request's state: the sender is already sending
        # (and an arena slot read or dropped goes back to the producer).
        try:
            transfer = self.transport.post_recv(desc.value, desc.src, walk=desc.walk, signal=desc.signal)
        except Exception as exc:
            # the sender's isend is already posted: with no matching receive, every later transfer on the pair
            # would pair up with the wrong partner. The pair is dead for good, on both sides.
            transfer = _Failed(f"{type(exc).__name__}: {exc}")
            self._abort_pair(desc.src, self.global_rank, f"posting a receive failed: {exc}")
        self._incoming[desc.uuid] = transfer
        self._incoming_req[desc.uuid] = desc.request_id
        if trace.ON:  # the P/D handoff: the KV's descriptor is here and its receive posted
            trace.event("rank_tensor_desc", desc.request_id, signal=desc.signal)

    def _on_push(self, msg: m.Push, wire_uuid: str | None = None) -> None:
        """Send a kept tensor to ``msg.dst`` (descriptor first, named ``wire_uuid`` or its own uuid). A TP shard
        (``msg.tp_dst``): every follower of the producing replica sends its own shard to its counterpart."""
        if trace.ON:
            trace.event("rank_push", msg.request_id, dst=msg.dst)
        try:
            tensor = self.store.get(msg.uuid)
        except KeyError as exc:
            log.error("%s: push of %s for %s: %s", self.name, msg.uuid, msg.request_id, exc)
            return
        if len(msg.tp_dst) > 1 and msg.uuid in self._kept_signal:
            request_id, signal = self._kept_signal[msg.uuid]
            role = next(r for r in self.tp_roles.values() if r.leads)
            for i, follower in enumerate(role.followers, start=1):
                self._send(rank_name(follower), m.TPPush(request_id=request_id, signal=signal, dst=msg.tp_dst[i],
                                                         uuid=shard_uuid(msg.uuid, i), release=msg.release))
        if self._pair_dead(self.global_rank, msg.dst):
            self._fail_push(msg, f"the data plane to rank {msg.dst} is dead")
            return
        try:
            transfer, value = self._post_send(tensor, msg.dst)
        except Exception as exc:  # nothing was posted, no descriptor goes out
            if not isinstance(exc, ArenaFull):
                self._abort_pair(self.global_rank, msg.dst, f"posting a send failed: {exc}")
            self._fail_push(msg, f"cannot send {msg.signal or msg.uuid!r} to rank {msg.dst}: {exc}")
            return
        self._send(rank_name(msg.dst), m.TensorDesc(request_id=msg.request_id, uuid=wire_uuid or msg.uuid,
                                                    src=self.global_rank, value=value, walk=msg.walk,
                                                    signal=msg.signal))
        self._outgoing.append(_Outgoing(transfer, msg.uuid, msg.release, msg.dst))

    # ---- tensor parallelism (see mstar_dist/worker/tp.py) ----
    def _on_tp_push(self, msg: m.TPPush) -> None:
        uuid = self._follower.kept.pop((msg.request_id, msg.signal), None)
        if uuid is None:
            log.error("%s: no shard of %r for %s to push", self.name, msg.signal, msg.request_id)
            return
        self._on_push(m.Push(request_id=msg.request_id, uuid=uuid, dst=msg.dst, release=msg.release),
                      wire_uuid=msg.uuid)

    def _lead_tp(self, node: str, calls: list[NodeCall]) -> None:
        """Before a TP leader runs a batch: every follower gets the same batch (its own shards of kept inputs)."""
        role = self.tp_roles[node]
        for i, follower in enumerate(role.followers, start=1):
            self._send(rank_name(follower), step_for(calls, self._input_refs, i))

    def _run_follower_steps(self) -> None:
        """Replay the leaders' batches in the order they were sent; a step waits for its shards to arrive."""
        follower = self._follower
        while follower.steps:
            step = follower.steps[0]
            for request_id in step.release:
                self.components[step.node].release(request_id)
                follower.forget(request_id)
            step.release.clear()
            try:
                calls = follower.calls_of(step, self._shard)
            except Exception as exc:  # a shard that cannot arrive: the leader's collectives fail by timeout
                log.error("%s: TP step of %s cannot run: %s", self.name, step.node, exc)
                calls = []
            if calls is None:
                if follower.waited(step) > self.transfer_timeout_s:
                    log.error("%s: a TP step of %s waited %.0f s for its shards; dropping it", self.name,
                              step.node, self.transfer_timeout_s)
                    follower.steps.popleft()
                return
            follower.steps.popleft()
            follower.since.pop(id(step), None)
            if calls:
                try:
                    results = self.components[step.node].run_batch(calls)
                except Exception as exc:  # the leader's copy of this batch fails the same way (or its peers')
                    log.error("%s: TP batch of %s failed: %s", self.name, step.node, exc)
                    continue
                follower.keep(calls, results, self.store)

    def _shard(self, uuid: str) -> torch.Tensor | None:
        """This follower's shard ``uuid`` once its receive completed (None while in flight)."""
        transfer = self._incoming.get(uuid)
        if transfer is None:
            return None
        state = _state(transfer)
        if state == "pending":
            return None
        del self._incoming[uuid], self._incoming_req[uuid]
        if state != "done":
            raise RuntimeError(f"shard {uuid} did not arrive: {state}")
        return transfer.tensor

    def _fail_push(self, msg: m.Push, error: str) -> None:
        """The consumer will get no descriptor: fail the request now rather than at its input timeout."""
        log.error("%s: push of %s for %s: %s", self.name, msg.uuid, msg.request_id, error)
        self._send(CONDUCTOR, m.WalkDone(request_id=msg.request_id, walk=msg.walk, rank=self.global_rank,
                                         outputs={}, error=error))

    def _post_send(self, tensor: torch.Tensor, dst: int) -> tuple[Any, m.Carried]:
        """Post ``tensor`` for global rank ``dst`` on the data plane; returns the transfer and the value for the
        message. Backpressure: while the chosen arena is full, lets acknowledgements in (other messages wait in
        order) and retries, for at most ``backpressure_timeout_s``; then ArenaFull naming the arena."""
        deadline = None
        while True:
            try:
                return self.transport.post_send(tensor, dst)
            except ArenaFull as exc:
                now = time.monotonic()
                deadline = deadline or now + self.backpressure_timeout_s
                if now > deadline:
                    raise ArenaFull(f"{exc}, still after {self.backpressure_timeout_s:g} s "
                                    f"(transport.backpressure_timeout_s): its consumers hold what it sent") from None
                self._let_acks_in()

    def _let_acks_in(self) -> None:
        """Send the acknowledgements we owe, apply the ones that arrived, and stash every other message."""
        for peer, ack in self.transport.poll():
            self._send(rank_name(peer), ack)
        for sender, payload in self.channel.recv(1):
            try:
                env = m.decode(payload)
            except Exception:
                env = None
            if (env is not None and isinstance(env.body, m.TransferAck) and env.token == self.token
                    and env.sender == sender and _RANK_NAME.fullmatch(sender)):
                self.transport.on_ack(int(sender[4:]), env.body)
            else:
                self._stash.append((sender, payload))

    def _post_values(self, values: list[tuple[str, Any]], dst: int, what: str) -> tuple[list, list]:
        """Post each (signal, tensor) for global rank ``dst``, in order; returns the values for the message and
        the transfers to watch. On a failure nothing stays posted: arena slots are taken back, p2p sends (still
        deferred: their descriptors have not gone out) are withdrawn, and a pair left out of step otherwise (a
        send nobody will receive, or a failure that is not the arena's or the value's) is aborted on both sides;
        then it raises."""
        carried, transfers, posted = [], [], []
        try:
            for signal, value in values:
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"{what} {signal!r} is a {type(value).__name__}; only tensors cross ranks")
                if self._pair_dead(self.global_rank, dst):
                    raise RuntimeError(f"the data plane to rank {dst} is dead")
                transfer, value = self._post_send(value, dst)
                carried.append(value)
                posted.append(transfer)
                if not isinstance(transfer, Done):
                    transfers.append(_Outgoing(transfer, "", False, dst))
        except Exception as exc:
            if not isinstance(exc, (ArenaFull, TypeError)):
                self._abort_pair(self.global_rank, dst, f"posting a send failed: {exc}")
            else:  # nothing went out yet: arena slots come back, deferred p2p sends are withdrawn
                for transfer, value in zip(posted, carried):
                    self.transport.cancel(dst, transfer, value, str(exc))
            raise
        return carried, transfers

    def _remove(self, request_id: str) -> None:
        self._removed[request_id] = None
        while len(self._removed) > 100_000:
            self._removed.popitem(last=False)
        for run in self._runs_of(request_id):
            self._drop_run(run).close()
        for key in [k for k in self._waiting if k[0] == request_id]:
            del self._waiting[key]
        self._emits.pop(request_id, None)
        self._early_stops.pop(request_id, None)
        self._drop_streams(request_id)
        self._drop_spans(request_id)
        for key in [k for k in self._input_refs if k[0] == request_id]:
            del self._input_refs[key]
        for uuid in [u for u, (rid, _) in self._kept_signal.items() if rid == request_id]:
            del self._kept_signal[uuid]
        for node, component in self.components.items():
            role = self.tp_roles.get(node)
            if role is not None and not role.leads:
                continue  # released in the leader's step order (TPStep.release)
            component.release(request_id)
            if role is not None:
                for follower in role.followers:
                    self._send(rank_name(follower), m.TPStep(node=node, calls=[], release=[request_id]))
        self.store.drop_tag(request_id)

    # ---- transfers ----
    def _poll_transfers(self) -> None:
        for peer, ack in self.transport.poll():  # arena slots we read or let go: the producers may reuse them
            self._send(rank_name(peer), ack)
        still = []
        now = time.monotonic()
        for out in self._outgoing:
            state = _state(out.transfer)
            if state not in ("done", "pending"):
                log.error("%s: send of %s to rank %d failed: %s", self.name, out.uuid, out.dst, state)
                self._abort_pair(self.global_rank, out.dst, f"a send failed: {state}")
            elif state == "done":
                if out.release:
                    try:
                        self.store.unpersist(out.uuid)
                    except KeyError:
                        pass  # the request was removed meanwhile
            elif now - out.since > self.transfer_timeout_s:
                # a send that never completes: the pair is dead for good (docs/architecture.md §7); the consumer's input wait
                # times out and fails its request
                log.error("%s: send of %s to rank %d did not complete within %.0f s; aborting the pair",
                          self.name, out.uuid, out.dst, self.transfer_timeout_s)
                self._abort_pair(self.global_rank, out.dst, "a send timed out")
            else:
                still.append(out)
        self._outgoing = still
        for key in list(self._waiting):
            self._try_start_waiting(key)
        for uuid in [u for u, t in self._incoming.items()
                     if self._incoming_req[u] in self._removed and _state(t) != "pending"]:
            del self._incoming[uuid], self._incoming_req[uuid]

    def _try_start_waiting(self, key: tuple[str, str]) -> None:
        waiting = self._waiting[key]
        ready: dict[str, torch.Tensor] = {}
        for name in waiting.missing:
            ref = waiting.msg.inputs[name]
            transfer = self._incoming.get(ref.uuid)
            state = "pending" if transfer is None else _state(transfer)
            if state not in ("done", "pending"):
                del self._waiting[key], self._incoming[ref.uuid], self._incoming_req[ref.uuid]
                self._abort_pair(ref.rank, self.global_rank, f"a receive failed: {state}")
                self._fail(waiting.msg, f"input {name!r} from rank {ref.rank} failed: {state}")
                return
            if transfer is None and self._pair_dead(ref.rank, self.global_rank):
                del self._waiting[key]
                self._fail(waiting.msg, f"input {name!r} cannot arrive: the pair from rank {ref.rank} is dead")
                return
            if state == "pending":
                if time.monotonic() - waiting.since > self.transfer_timeout_s:
                    del self._waiting[key]
                    if transfer is not None:  # a posted receive that never completed: the pair is out of step
                        self._abort_pair(ref.rank, self.global_rank, "a receive timed out")
                    self._fail(waiting.msg, f"input {name!r} from rank {ref.rank} did not arrive within "
                               f"{self.transfer_timeout_s:.0f} s")
                return
            ready[name] = transfer.tensor
        for name in waiting.missing:
            uuid = waiting.msg.inputs[name].uuid
            del self._incoming[uuid], self._incoming_req[uuid]
        del self._waiting[key]
        if trace.ON:  # every input from another rank has landed: the walk starts now
            trace.event("rank_inputs_landed", waiting.msg.request_id, walk=waiting.msg.walk)
        self._start_walk(waiting.msg, ready)

    # ---- walks ----
    def _start_walk(self, msg: m.RunWalk, received: dict[str, torch.Tensor]) -> None:
        try:
            on_host = self._host_inputs(msg.walk)
            inputs = {name: self._resolve(value, received.get(name), name in on_host)
                      for name, value in msg.inputs.items()}
            refs = {name: v.uuid for name, v in msg.inputs.items() if isinstance(v, m.TensorRef)}
            if refs and self.tp_roles:
                self._input_refs[(msg.request_id, msg.walk)] = refs
            for name in msg.release:  # consumed here, on the producer's own rank: the walk holds the tensor now
                self.store.unpersist(msg.inputs[name].uuid)
            section = self.graphs[msg.walk]
            ctx = WalkContext(
                request_id=msg.request_id,
                walk=msg.walk,
                walk_index=msg.walk_index,
                seed=msg.seed,
                sampling=SamplingParams(
                    temperature=msg.sampling.temperature, top_p=msg.sampling.top_p, top_k=msg.sampling.top_k,
                    seed=msg.seed,
                ),
                export=frozenset(msg.export),
                stop_token_ids=frozenset(msg.stop_token_ids),
            )
            emits = self._emits[msg.request_id]
            streamed = self._stream_out[msg.request_id]
            key = (msg.request_id, msg.walk)
            span = Span(section, dict(msg.node_ranks), self.global_rank, arrived=self._arrivals[key]) \
                if msg.node_ranks else None
            run = WalkRun(
                request_id=msg.request_id,
                walk=msg.walk,
                section=section,
                inputs=inputs,
                ctx=ctx,
                loop_limits=dict(msg.loop_limits),
                on_emit=lambda signal, value: emits.append((signal, value)),
                on_stream=lambda signal, value: streamed.append((signal, value)),
                emitting_nodes=None if span is None else {n for n, r in span.node_ranks.items() if r == span.me},
                streamed_inputs=self._streamed_inputs(msg.walk),
            )
            if msg.stream_routes:
                self._stream_routes[msg.request_id] = dict(msg.stream_routes)
        except Exception as exc:
            self._fail(msg, f"{type(exc).__name__}: {exc}")
            return
        run.inputs = dict.fromkeys(run.inputs)  # delivered at construction; keep names only, free big tensors
        self._runs[key] = run
        self._walks_of.setdefault(msg.request_id, {})[msg.walk] = run
        if span is not None:
            self._spans[key] = span
        for loop in self._early_stops.pop(msg.request_id, ()):
            run.stop_loop(loop)
        if run.done:
            self._finish(run)
            self._flush_emits()

    def _resolve(self, value: m.Value, received: torch.Tensor | None, on_host: bool = False) -> torch.Tensor:
        if isinstance(value, m.TensorRef):
            return received if received is not None else self.store.get(value.uuid)
        if isinstance(value, m.Remote):
            return REMOTE
        return decode_tensor(value, "cpu" if on_host else self.device)

    def _host_inputs(self, walk: str) -> frozenset[str]:
        """The walk's inputs that stay on the host when they arrive inline: those that every node of the walk taking
        them runs here, in a component that moves them to its device itself (``Component.host_inputs``)."""
        found = self._host_inputs_of.get(walk)
        if found is None:
            takers: dict[str, list] = collections.defaultdict(list)
            for node in iter_nodes(self.graphs[walk]):
                for name in (*node.inputs, *node.optional_inputs):
                    takers[name].append(self.components.get(node.name))
            found = self._host_inputs_of[walk] = frozenset(
                name for name, comps in takers.items()
                if all(c is not None and name in c.host_inputs for c in comps))
        return found

    def _streamed_inputs(self, walk: str) -> frozenset[str]:
        found = self._streamed_inputs_of.get(walk)
        if found is None:
            names = node_names(self.graphs[walk])
            found = self._streamed_inputs_of[walk] = frozenset(
                e.signal for e in self._stream_edges.values() if e.dst_node in names)
        return found

    def _runnable(self) -> bool:
        """Some run has a call this rank runs: what ``_collect`` would find, without building the batches (the loop
        asks every turn, before ``_step`` collects them)."""
        for key, run in self._runs.items():
            calls = run.outstanding
            if calls:
                span = self._spans.get(key)
                if span is None or any(span.is_local(call.node) for call in calls):
                    return True
        return False

    def _collect(self) -> dict[str, list[NodeCall]]:
        """Every runnable call (new ones and ones a component asked to retry), grouped by component."""
        by_component: dict[str, list[NodeCall]] = collections.defaultdict(list)
        spans = self._spans
        for key, run in self._runs.items():
            run.ready()
            span = spans.get(key) if spans else None
            for call in run.outstanding:
                if span is None or span.is_local(call.node):  # another rank runs it: its NodeDone completes it
                    by_component[call.node].append(call)
        return by_component

    def _step(self) -> None:
        finished: list[WalkRun] = self._advance_spans()
        progressed = False
        for node, calls in self._collect().items():
            component = self.components.get(node)
            if component is None:
                results: list = [GraphError(f"node {node!r} is not placed on rank {self.global_rank}")] * len(calls)
            else:
                try:
                    role = self.tp_roles.get(node)
                    if role is not None and role.leads:
                        self._lead_tp(node, calls)
                    results = component.run_batch(calls)
                    if len(results) != len(calls):
                        raise RuntimeError(f"{node}.run_batch returned {len(results)} results for {len(calls)} calls")
                except Exception as exc:  # a broken batch fails exactly the requests in it
                    results = [exc] * len(calls)
                if node in self.tp_roles:
                    results = [_tp_failure(self.tp_roles[node], r) for r in results]
            runs, spans = self._runs, self._spans
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
                        self._announce(span, run, call, result)
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
                    out.append(m.Emit(request_id=request_id, walk="", signal=signal, values=[encode_tensor(value)]))
                else:
                    by_signal: dict[str, list] = collections.defaultdict(list)
                    for signal, value in items:
                        by_signal[signal].append(encode_tensor(value))  # it copies a device tensor to the host
                    out.extend(m.Emit(request_id=request_id, walk="", signal=signal, values=values)
                               for signal, values in by_signal.items())
            except Exception as exc:  # a component emitted something that is not a tensor
                failed.append((request_id, f"emitted value: {type(exc).__name__}: {exc}"))
            items.clear()
        for request_id in self._ended:
            if not self._runs_of(request_id):
                self._emits.pop(request_id, None)
        self._ended.clear()
        for request_id, items in list(self._stream_out.items()):
            if items:
                try:
                    self._flush_stream(request_id, items)
                except Exception as exc:  # a streamed value that cannot travel fails its request
                    failed.append((request_id, f"streamed value: {type(exc).__name__}: {exc}"))
                items.clear()
        done, self._done_out = self._done_out, []
        if out or done:
            if trace.ON and out:  # stamped as it is handed to the socket (after, the conductor may be first on the clock)
                trace.first("rank_emits_sent", [e.request_id for e in out], n=len(out))
            self._send(CONDUCTOR, m.Emits(items=out, done=done))
        for request_id, error in failed:
            self._fail_request(request_id, error)

    def _flush_stream(self, request_id: str, items: list[tuple[str, torch.Tensor]]) -> None:
        """Send a request's streamed values to their consumers' ranks: one message per signal, small values
        inline, large ones on the pair right after it (device to device on GPUs)."""
        routes = self._stream_routes.get(request_id, {})
        by_signal: dict[str, list] = collections.defaultdict(list)
        for signal, value in items:
            by_signal[signal].append(value)
        for signal, values in by_signal.items():
            if signal not in routes:
                log.error("%s: request %s streamed %r with no consumer route", self.name, request_id, signal)
                continue
            dst = routes[signal]
            carried, transfers = self._post_values([(signal, v) for v in values], dst, "streamed")
            self._send(rank_name(dst), m.StreamItems(request_id=request_id, signal=signal, values=carried))
            self._outgoing.extend(transfers)

    def _finish(self, run: WalkRun) -> None:
        """Report the walk's end with this turn's emits (its own come first in that message: ``_flush_emits``)."""
        self._drop_run(run)
        if not self._runs_of(run.request_id):
            self._ended.add(run.request_id)
        self._drop_streams(run.request_id, consumer=run)
        self._spans.pop((run.request_id, run.walk), None)
        self._arrivals.pop((run.request_id, run.walk), None)
        self._input_refs.pop((run.request_id, run.walk), None)
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
                uuid = self.store.put(value, refs=0, persist=True, tag=run.request_id)
                if self.tp_roles:
                    self._kept_signal[uuid] = (run.request_id, signal)
                outputs[signal] = m.TensorRef(
                    uuid=uuid, rank=self.global_rank, shape=list(value.shape),
                    dtype=str(value.dtype).removeprefix("torch."), nbytes=nbytes,
                )
            else:
                outputs[signal] = encode_tensor(value.detach().to("cpu"))
        self._done_out.append(m.WalkDone(request_id=run.request_id, walk=run.walk, rank=self.global_rank,
                                         outputs=outputs, finish_reason=run.finish_reason))
        run.close()

    def _fail_run(self, run: WalkRun, exc: BaseException) -> None:
        status = 503 if isinstance(exc, TPPeerLost) else 500
        log.error("%s: request %s failed in walk %s:\n%s", self.name, run.request_id, run.walk,
                  "".join(traceback.format_exception(exc)))
        self._drop_run(run)
        run.close()
        self._spans.pop((run.request_id, run.walk), None)
        self._emits.pop(run.request_id, None)
        for component in self.components.values():
            component.release(run.request_id)
        self._send(CONDUCTOR, m.WalkDone(request_id=run.request_id, walk=run.walk, rank=self.global_rank,
                                         outputs={}, error=f"{type(exc).__name__}: {exc}", status=status))

    def _abort_pair(self, src: int, dst: int, reason: str, tell_peer: bool = True) -> None:
        """After a failure on the directed pair (src, dst): declare the data plane to the peer dead for good here
        and, unless the peer told us, on the peer."""
        peer = dst if src == self.global_rank else src
        if self.transport.is_dead(peer):
            return
        log.error("%s: data plane to rank %d (pair %d -> %d) is dead for good: %s", self.name, peer, src, dst, reason)
        self.transport.abort_peer(peer, reason)
        if tell_peer and peer != self.global_rank:
            self._send(rank_name(peer), m.AbortPair(src=src, dst=dst, reason=reason))

    def _pair_dead(self, src: int, dst: int) -> bool:
        return self.transport.is_dead(dst if src == self.global_rank else src)

    def _fail_request(self, request_id: str, error: str) -> None:
        """Fail every walk of a request on this rank (reported to the conductor once per walk)."""
        runs = self._runs_of(request_id)
        for run in runs:
            self._fail_run(run, RuntimeError(error))
        if not runs:
            log.error("%s: request %s: %s", self.name, request_id, error)

    def _fail(self, msg: m.RunWalk, error: str) -> None:
        log.error("%s: request %s walk %s failed: %s", self.name, msg.request_id, msg.walk, error)
        self._send(CONDUCTOR, m.WalkDone(request_id=msg.request_id, walk=msg.walk, rank=self.global_rank,
                                         outputs={}, error=error))

    # ---- walks across ranks (see mstar_dist/worker/spans.py) ----
    def _announce(self, span: Span, run: WalkRun, call: NodeCall, result: Any) -> None:
        """Tell every other rank of the walk that ``call`` (a node of ours) finished: its outputs, real values for
        the signals their nodes consume, and the loop stops every copy must apply with it."""
        stops = span.take_stops()
        for loop in stops:
            run.stop_loop(loop)
        produced = list(dict.fromkeys(e.signal for e in span.nodes[call.node].outputs if e.signal in result.outputs))
        seq = span.seq(call)
        span.forget(call)
        for peer in span.peers:
            signals = [s for s in span.consumed_on(call.node, peer) if s in result.outputs]
            carried, transfers = self._post_values([(s, result.outputs[s]) for s in signals], peer,
                                                   f"node {call.node!r} output")
            self._send(rank_name(peer), m.NodeDone(
                request_id=run.request_id, walk=run.walk, node=call.node, seq=seq, signals=produced,
                values=dict(zip(signals, carried)), stop=bool(result.stop), stop_loops=stops,
            ))
            self._outgoing.extend(transfers)

    def _on_node_done(self, msg: m.NodeDone, src: int) -> None:
        values: dict[str, Any] = {}
        for signal, value in msg.values.items():  # receives in message order: the sender sends in this order
            try:
                values[signal] = receive(value, src=src, plane=self.transport, walk=msg.walk, signal=signal)
            except Exception as exc:
                values[signal] = _Failed(f"{type(exc).__name__}: {exc}")
                self._abort_pair(src, self.global_rank, f"posting a receive failed: {exc}")
        if msg.request_id in self._removed:
            self._draining.extend(v for v in values.values() if not isinstance(v, torch.Tensor))
            return
        self._arrivals[(msg.request_id, msg.walk)][(msg.node, msg.seq)] = Arrived(msg, values)

    def _advance_spans(self) -> list[WalkRun]:
        """Complete other ranks' node calls in this rank's copies whose results arrived; the runs that ended."""
        finished = []
        for key, span in list(self._spans.items()):
            run = self._runs.get(key)
            for call, arrived in span.arrivals(run) if run is not None else ():
                states = [_state(v) for v in arrived.values.values() if not isinstance(v, torch.Tensor)]
                broken = [st for st in states if st not in ("done", "pending")]
                if broken or ("pending" in states and time.monotonic() - arrived.since > self.transfer_timeout_s):
                    why = broken[0] if broken else f"not complete within {self.transfer_timeout_s:.0f} s"
                    self._abort_pair(span.node_ranks[call.node], self.global_rank, f"a receive: {why}")
                    self._fail_run(run, RuntimeError(f"output of node {call.node!r} from rank "
                                                     f"{span.node_ranks[call.node]}: {why}"))
                    break
                if "pending" in states:
                    break  # results apply in call order
                del span.arrived[(call.node, span.seq(call))]
                span.forget(call)
                try:
                    for loop in arrived.msg.stop_loops:
                        run.stop_loop(loop)
                    run.complete(call, span.result_of(arrived))
                except Exception as exc:
                    self._fail_run(run, exc)
                    break
                if run.done:
                    finished.append(run)
                    break
        return finished

    def _in_flight(self) -> bool:
        """Receives this loop must poll soon: values of other ranks' nodes, streamed items, drained ones."""
        if self._draining:
            self._draining = [t for t in self._draining if _state(t) == "pending"]
        return bool(self._draining or self._stream_in or any(self._arrivals.values()))

    def _drop_spans(self, request_id: str) -> None:
        for key in [k for k in self._arrivals if k[0] == request_id]:
            for arrived in self._arrivals.pop(key).values():
                self._draining.extend(v for v in arrived.values.values() if not isinstance(v, torch.Tensor))
        for key in [k for k in self._spans if k[0] == request_id]:
            del self._spans[key]

    # ---- streaming edges (consumer side) ----
    def _on_stream(self, msg: m.StreamItems | m.StreamEnd, sender: str) -> None:
        if msg.request_id in self._removed:
            return
        if isinstance(msg, m.StreamEnd) and msg.forward_to >= 0:  # we produced it: end it after our items
            self._flush_emits()
            self._send(rank_name(msg.forward_to), m.StreamEnd(request_id=msg.request_id, signal=msg.signal))
            return
        edge = self._stream_edges.get(msg.signal)
        if edge is None:
            log.warning("%s: stream %r for %s is not a streaming edge of this model", self.name, msg.signal,
                        msg.request_id)
            return
        key = (msg.request_id, msg.signal)
        if key not in self._streams:  # items may arrive before the consuming walk: buffered until it starts
            self._streams[key] = StreamBuffer(edge.policy)
        if isinstance(msg, m.StreamEnd):
            self._stream_in[key].append(None)
        else:  # post the receives now, in message order: the producer is already sending
            src = int(sender.removeprefix("rank"))
            walk = f"{edge.src_partition}->{edge.dst_partition}"  # the edge crosses partitions: label it by both
            self._stream_in[key].extend(receive(v, src=src, plane=self.transport, walk=walk, signal=msg.signal)
                                        for v in msg.values)
        self._take_stream_items(key)

    def _take_stream_items(self, key: tuple[str, str]) -> None:
        """Move received items (in order; a transfer still in flight holds back the ones after it) into the
        stream's buffer, and its ready chunks into the consumer's queue."""
        pending, buffer = self._stream_in[key], self._streams[key]
        while pending:
            head = pending[0]
            if head is None:
                buffer.producer_done()
            elif isinstance(head, torch.Tensor):
                buffer.push(head)
            else:
                state = _state(head)
                if state == "pending":
                    break
                if state != "done":
                    raise RuntimeError(f"a streamed item did not arrive: {state}")
                buffer.push(head.tensor)
            pending.popleft()
        if not pending:
            del self._stream_in[key]
        self._chunks[key].extend(buffer.pop_ready())

    def _feed_streams(self) -> None:
        """Deliver buffered chunks to consuming walks, oldest first; a walk takes at most what its loop can queue."""
        for key in list(self._stream_in):
            try:
                self._take_stream_items(key)
            except Exception as exc:
                self._drop_streams(key[0])
                self._fail_request(key[0], f"stream {key[1]!r}: {type(exc).__name__}: {exc}")
        for key in [k for k, q in self._chunks.items() if q]:
            request_id, signal = key
            edge = self._stream_edges[signal]
            run = next((r for r in self._runs_of(request_id) if edge.dst_node in node_names(r.section)), None)
            if run is None:
                continue
            queue = self._chunks[key]
            while queue:
                chunk = queue[0]
                values = {signal: chunk.data}
                optional = self._node_inputs(run, edge.dst_node)
                if f"{signal}_final" in optional:
                    values[f"{signal}_final"] = torch.tensor([chunk.is_final])
                if f"{signal}_context" in optional:
                    values[f"{signal}_context"] = torch.tensor([chunk.n_context])
                try:
                    run.deliver_many(edge.dst_node, values)
                except GraphError:
                    break  # the consumer's input queue is full: retry on a later turn
                queue.popleft()
        for key in [k for k, q in self._chunks.items() if not q]:
            del self._chunks[key]

    @staticmethod
    def _node_inputs(run: WalkRun, node: str) -> tuple[str, ...]:
        return next(n.optional_inputs for n in iter_nodes(run.section) if n.name == node)

    def _runs_of(self, request_id: str) -> list[WalkRun]:
        """The request's walks on this rank (an index: a scan of every run, twice for each walk that ends, made a
        25-row prefill's end quadratic in the runs on the rank)."""
        walks = self._walks_of.get(request_id)
        return list(walks.values()) if walks else []

    def _drop_run(self, run: WalkRun) -> WalkRun:
        """Forget ``run`` (if it is still the one this rank runs for its request and walk)."""
        key = (run.request_id, run.walk)
        if self._runs.get(key) is run:
            del self._runs[key]
            walks = self._walks_of[run.request_id]
            del walks[run.walk]
            if not walks:
                del self._walks_of[run.request_id]
        return run

    def _drop_streams(self, request_id: str, consumer: WalkRun | None = None) -> None:
        """Forget a request's consumer-side buffers (only those feeding ``consumer`` when given)."""
        for key in [k for k in self._streams if k[0] == request_id]:
            if consumer is None or self._stream_edges[key[1]].dst_node in node_names(consumer.section):
                del self._streams[key]
                self._chunks.pop(key, None)
                self._draining.extend(t for t in self._stream_in.pop(key, ()) if t is not None
                                      and not isinstance(t, torch.Tensor))
        if consumer is None:
            self._stream_routes.pop(request_id, None)
            self._stream_out.pop(request_id, None)

    def _check_conductor(self) -> None:
        """Exit (non-zero) when the conductor on rank 0 went silent: its host died and nobody will call us."""
        if self.conductor_timeout_s is None or self._conductor_seen is None:
            return
        silent = time.monotonic() - self._conductor_seen
        if silent > self.conductor_timeout_s:
            self.failed_reason = (f"the conductor (rank 0) has been silent for {silent:.0f} s "
                                  f"(limits.rank_timeout_s={self.conductor_timeout_s:g}); its host is gone")
            log.error("%s: %s", self.name, self.failed_reason)
            self.stopping = True

    def _maybe_send_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < 0.5:
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
            rank=self.global_rank,
            live_tensors=self.store.live_tensors,
            live_bytes=self.store.live_bytes,
            edge_bytes_sent=int(st.get("bytes_sent", 0)),
            edge_bytes_received=int(st.get("bytes_received", 0)),
            host_staging_copies=int(st.get("host_staging_copies", 0)),
            engine=dict(engine),
            rejected_messages=self.rejected_messages,
            edge_histograms=st.get("histograms", []),
            **process_sample(),
            arena_bytes_used=self.transport.arena_bytes_used(),
            edges=self.transport.edges.snapshot(),
        ))


class TPPeerLost(RuntimeError):
    """A TP batch failed in its collectives: a member of the replica died or its group broke (a 503)."""


def _tp_failure(role: TPRole, result: Any) -> Any:
    """A collective error of a TP batch as :class:`TPPeerLost` naming the replica's other ranks; else as is."""
    if not isinstance(result, BaseException) or isinstance(result, TPPeerLost):
        return result
    text = str(result)
    if not (isinstance(result, torch.distributed.DistError) or "Connection" in text or "Gloo" in text
            or "NCCL" in text):
        return result
    others = [r for r in role.ranks if r != role.me]
    who = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {others}"
    return TPPeerLost(f"{who} of the tensor-parallel replica {list(role.ranks)} of {role.node!r} is unreachable "
                      f"(died or its group broke): {text}")


class _Failed:
    """Stands for a transfer that could not even be posted."""

    def __init__(self, reason: str):
        self.reason = reason

    def done(self) -> bool:
        raise RuntimeError(self.reason)


def _state(transfer: Any) -> str:
    """``"done"``, ``"pending"``, or the error that broke the transfer (a dead peer raises at once)."""
    try:
        return "done" if transfer.done() else "pending"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"

