"""The rank's side of the data plane (docs/architecture.md §7): kept tensors pushed to other ranks, walk inputs
that arrive from them, backpressure on a full arena, acknowledgements, and the pairs given up on.

Sends: a ``Push`` from the conductor sends a kept tensor to its consumer (a ``TensorDesc``, then the transfer);
values between workers (a ``NodeDone``'s, a stream's) are posted by :meth:`Transfers.post_values`. A send in flight is
watched until it completes (a released tensor is unpersisted then) or times out (the pair is aborted). Receives: a
``TensorDesc`` posts its receive at once, in descriptor order; a ``RunWalk`` whose inputs are still in flight waits
(:meth:`Transfers.wait_for`) and starts once they landed. Receives of removed requests are drained: kept until they
complete, so that an arena slot goes back to its producer. Pairs formed again: a ``Repair`` (a peer restarted in
place and rejoins, or this rank is that peer) forms the fresh pair groups on a helper thread (both members block in
the store until the other came) while the loop goes on serving, then revives the peer on the data plane and answers
``Repaired`` (docs/architecture.md §10). Every method runs on the worker's loop.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Iterable

import torch

from mstar_dist import trace
from mstar_dist.control import messages as m
from mstar_dist.control.envelope import CONDUCTOR, is_rank, open_envelope, parse_rank, rank_name
from mstar_dist.control.port import ControlPort
from mstar_dist.transport.base import ArenaFull, Done
from mstar_dist.transport.router import Router
from mstar_dist.transport.store import TensorStore

log = logging.getLogger(__name__)


class PostFailed:
    """Stands for a transfer that could not even be posted."""

    def __init__(self, reason: str):
        self.reason = reason

    def done(self) -> bool:
        raise RuntimeError(self.reason)


def transfer_state(transfer: Any) -> str:
    """``"done"``, ``"pending"``, or the error that broke the transfer (a dead peer raises at once)."""
    try:
        return "done" if transfer.done() else "pending"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


@dataclass
class Waiting:
    """A RunWalk whose inputs include tensors still in flight from other ranks."""

    msg: m.RunWalk
    missing: set[str]
    """The inputs still to land (``TensorRef``s held by other ranks)."""
    since: float = field(default_factory=time.monotonic)


@dataclass
class Outgoing:
    """A send in flight, watched until it completes."""

    transfer: Any
    uuid: str
    """The kept tensor sent ("" for a value between workers)."""
    release: bool
    """Unpersist the kept tensor once the send completed."""
    dst: int = -1
    since: float = field(default_factory=time.monotonic)


class PairJob:
    """Fresh pair groups being formed on a helper thread for one ``Repair``."""

    def __init__(self, msg: m.Repair, pairs: list[tuple[int, int]], form: Callable[..., dict]) -> None:
        self.msg, self.pairs = msg, pairs
        self.groups: dict | None = None
        self.error = ""
        self.thread = threading.Thread(target=self._run, args=(form,), name=f"repair-{msg.rank}", daemon=True)
        self.thread.start()

    def _run(self, form: Callable[..., dict]) -> None:
        try:
            self.groups = form(self.msg.prefix, self.pairs)
        except Exception as exc:  # noqa: BLE001 - reported to the conductor in Repaired.error
            self.error = f"{type(exc).__name__}: {exc}"


class Transfers:
    """Every transfer of this rank in flight, and the walks waiting for theirs (see the module docstring)."""

    def __init__(self, *, global_rank: int, name: str, token: str, channel: ControlPort, transport: Router,
                 store: TensorStore, send: Callable[[str, m.Message], None], removed: Container[str],
                 start_walk: Callable[[m.RunWalk, dict[str, torch.Tensor]], None],
                 report_failure: Callable[[str, str, str], None], transfer_timeout_s: float,
                 backpressure_timeout_s: float, form_pairs: Callable[..., dict] | None = None) -> None:
        """``start_walk(msg, received)`` starts a waiting walk once its inputs landed; ``report_failure(request_id,
        walk, error)`` tells the conductor a walk failed here; ``form_pairs(prefix, pairs)`` forms fresh pair groups
        (blocking: it runs on a helper thread)."""
        self.global_rank, self.name, self.token = global_rank, name, token
        self.channel, self.transport, self.store = channel, transport, store
        self._send, self._removed = send, removed
        self._start_walk, self._report_failure = start_walk, report_failure
        self.transfer_timeout_s = transfer_timeout_s
        self.backpressure_timeout_s = backpressure_timeout_s
        self.stash: list[tuple[str, bytes]] = []
        """Control messages set aside while a send waited for arena room (the loop takes them first)."""
        self.waiting: dict[tuple[str, str], Waiting] = {}
        """(request, walk) -> a walk waiting for inputs from other ranks."""
        self.incoming: dict[str, Any] = {}
        """uuid -> receive posted for a ``TensorDesc`` (in descriptor order)."""
        self._incoming_req: dict[str, str] = {}  # uuid -> request id
        self.outgoing: list[Outgoing] = []
        self._draining: list[Any] = []  # receives of removed requests, kept until they complete
        self._form_pairs = form_pairs
        self.repairs: list[PairJob] = []
        """Pairs being formed again with a rejoining rank."""

    def busy(self) -> bool:
        """Transfers in flight: the loop polls for their end (nobody wakes it)."""
        if self._draining:
            self._draining = [t for t in self._draining if transfer_state(t) == "pending"]
        return bool(self.incoming or self.outgoing or self.waiting or self._draining or self.repairs)

    def drain(self, transfers: Iterable[Any]) -> None:
        """Keep receives nobody will read until they complete (see the module docstring)."""
        self._draining.extend(transfers)

    # ---- pairs ----
    def abort_pair(self, src: int, dst: int, reason: str, tell_peer: bool = True) -> None:
        """After a failure on the directed pair (src, dst): declare the data plane to the peer dead for good here
        and, unless the peer told us, on the peer."""
        peer = dst if src == self.global_rank else src
        if self.transport.is_dead(peer):
            return
        log.error("%s: data plane to rank %d (pair %d -> %d) is dead for good: %s", self.name, peer, src, dst, reason)
        self.transport.abort_peer(peer, reason)
        if tell_peer and peer != self.global_rank:
            self._send(rank_name(peer), m.AbortPair(src=src, dst=dst, reason=reason))

    def on_abort_pair(self, msg: m.AbortPair) -> None:
        peer = msg.src if msg.dst == self.global_rank else msg.dst
        self.abort_pair(msg.src, msg.dst, f"peer rank{peer}: {msg.reason}", tell_peer=False)

    def on_ack(self, msg: m.TransferAck, sender: str) -> None:
        """A consumer read (or let go) arena slots this rank lent it."""
        rank = parse_rank(sender)
        if rank is not None:
            self.transport.on_ack(rank, msg)

    def pair_dead(self, src: int, dst: int) -> bool:
        return self.transport.is_dead(dst if src == self.global_rank else src)

    def on_repair(self, msg: m.Repair) -> None:
        """Rank ``msg.rank`` rejoins (or this rank does): send to its new endpoint, then form this rank's pairs with
        it anew on a helper thread (``_finish_repairs`` revives the peers once they are formed)."""
        if msg.rank != self.global_rank and msg.endpoint:
            self.channel.reconnect(rank_name(msg.rank), msg.endpoint)
        for peer, endpoint in msg.endpoints.items():  # ranks that rejoined before this one: their new processes
            self.channel.reconnect(rank_name(peer), endpoint)
        if msg.rank != self.global_rank:  # transports without pair groups (shm, mooncake) serve it again at once;
            self.transport.revive_peer(msg.rank, {})  # p2p once its fresh pairs are formed (below)
        mine = [pair for pair in msg.pairs if self.global_rank in pair]
        if not mine:
            self._send(CONDUCTOR, m.Repaired(rank=self.global_rank, joined=msg.rank))
        elif self._form_pairs is None:
            self._send(CONDUCTOR, m.Repaired(rank=self.global_rank, joined=msg.rank,
                                             error=f"rank {self.global_rank} cannot form pairs again"))
        else:
            self.repairs.append(PairJob(msg, mine, self._form_pairs))

    def _finish_repairs(self) -> None:
        still = []
        for job in self.repairs:
            if job.thread.is_alive():
                still.append(job)
                continue
            if job.groups is not None:
                for peer in sorted({p for pair in job.groups for p in pair} - {self.global_rank}):
                    self.transport.revive_peer(peer, {pair: g for pair, g in job.groups.items() if peer in pair})
                log.info("%s: pairs %s formed again", self.name, sorted(job.groups))
            else:
                log.error("%s: forming pairs %s again failed: %s", self.name, job.pairs, job.error)
            self._send(CONDUCTOR, m.Repaired(rank=self.global_rank, joined=job.msg.rank, error=job.error))
        self.repairs = still

    # ---- sends ----
    def push(self, msg: m.Push, wire_uuid: str | None = None,
             before: Callable[[m.Push], None] | None = None) -> None:
        """Send a kept tensor to ``msg.dst`` (descriptor first, named ``wire_uuid`` or its own uuid); ``before``
        runs once the tensor is found (a TP leader tells its followers to push their shards)."""
        if trace.ON:
            trace.event("rank_push", msg.request_id, dst=msg.dst)
        try:
            tensor = self.store.get(msg.uuid)
        except KeyError as exc:
            log.error("%s: push of %s for %s: %s", self.name, msg.uuid, msg.request_id, exc)
            return
        if before is not None:
            before(msg)
        if self.pair_dead(self.global_rank, msg.dst):
            self._fail_push(msg, f"the data plane to rank {msg.dst} is dead")
            return
        try:
            transfer, value = self.post_send(tensor, msg.dst)
        except Exception as exc:  # nothing was posted, no descriptor goes out
            if not isinstance(exc, ArenaFull):
                self.abort_pair(self.global_rank, msg.dst, f"posting a send failed: {exc}")
            self._fail_push(msg, f"cannot send {msg.signal or msg.uuid!r} to rank {msg.dst}: {exc}")
            return
        self._send(rank_name(msg.dst), m.TensorDesc(request_id=msg.request_id, uuid=wire_uuid or msg.uuid,
                                                    src=self.global_rank, value=value, walk=msg.walk,
                                                    signal=msg.signal))
        self.outgoing.append(Outgoing(transfer, msg.uuid, msg.release, msg.dst))

    def _fail_push(self, msg: m.Push, error: str) -> None:
        """The consumer will get no descriptor: fail the request now rather than at its input timeout."""
        log.error("%s: push of %s for %s: %s", self.name, msg.uuid, msg.request_id, error)
        self._report_failure(msg.request_id, msg.walk, error)

    def post_send(self, tensor: torch.Tensor, dst: int) -> tuple[Any, m.Carried]:
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
            env = open_envelope(payload, sender, self.token, is_rank)
            if isinstance(env, m.Envelope) and isinstance(env.body, m.TransferAck):
                self.transport.on_ack(parse_rank(sender), env.body)
            else:
                self.stash.append((sender, payload))

    def post_values(self, values: list[tuple[str, Any]], dst: int, what: str) -> tuple[list, list[Outgoing]]:
        """Post each (signal, tensor) for global rank ``dst``, in order; returns the values for the message and
        the transfers to watch (the caller adds them to ``outgoing`` once its message is out). On a failure nothing
        stays posted: arena slots are taken back, p2p sends (still deferred: their descriptors have not gone out)
        are withdrawn, and a pair left out of step otherwise (a send nobody will receive, or a failure that is not
        the arena's or the value's) is aborted on both sides; then it raises."""
        carried, transfers, posted = [], [], []
        try:
            for signal, value in values:
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"{what} {signal!r} is a {type(value).__name__}; only tensors cross ranks")
                if self.pair_dead(self.global_rank, dst):
                    raise RuntimeError(f"the data plane to rank {dst} is dead")
                transfer, value = self.post_send(value, dst)
                carried.append(value)
                posted.append(transfer)
                if not isinstance(transfer, Done):
                    transfers.append(Outgoing(transfer, "", False, dst))
        except Exception as exc:
            if not isinstance(exc, (ArenaFull, TypeError)):
                self.abort_pair(self.global_rank, dst, f"posting a send failed: {exc}")
            else:  # nothing went out yet: arena slots come back, deferred p2p sends are withdrawn
                for transfer, value in zip(posted, carried):
                    self.transport.cancel(dst, transfer, value, str(exc))
            raise
        return carried, transfers

    # ---- receives ----
    def on_tensor_desc(self, desc: m.TensorDesc) -> None:
        # Post the receive now, in descriptor order, whatever the request's state: the sender is already sending
        # (and an arena slot read or dropped goes back to the producer).
        try:
            transfer = self.transport.post_recv(desc.value, desc.src, walk=desc.walk, signal=desc.signal)
        except Exception as exc:
            # the sender's isend is already posted: with no matching receive, every later transfer on the pair
            # would pair up with the wrong partner. The pair is dead for good, on both sides.
            transfer = PostFailed(f"{type(exc).__name__}: {exc}")
            self.abort_pair(desc.src, self.global_rank, f"posting a receive failed: {exc}")
        self.incoming[desc.uuid] = transfer
        self._incoming_req[desc.uuid] = desc.request_id
        if trace.ON:  # the P/D handoff: the KV's descriptor is here and its receive posted
            trace.event("rank_tensor_desc", desc.request_id, signal=desc.signal)

    def take(self, uuid: str) -> torch.Tensor | None:
        """The tensor received as ``uuid`` once its receive completed (None while in flight or not yet posted);
        raises when it broke."""
        transfer = self.incoming.get(uuid)
        if transfer is None:
            return None
        state = transfer_state(transfer)
        if state == "pending":
            return None
        del self.incoming[uuid], self._incoming_req[uuid]
        if state != "done":
            raise RuntimeError(f"shard {uuid} did not arrive: {state}")
        return transfer.tensor

    def wait_for(self, msg: m.RunWalk, missing: set[str]) -> None:
        """Start ``msg``'s walk once its ``missing`` inputs landed (at once if they have)."""
        key = (msg.request_id, msg.walk)
        self.waiting[key] = Waiting(msg=msg, missing=missing)
        self._try_start(key)

    def drop(self, request_id: str) -> None:
        """The request was removed: its walks wait no more."""
        for key in [k for k in self.waiting if k[0] == request_id]:
            del self.waiting[key]

    def poll(self) -> None:
        """Send the acknowledgements we owe, watch the sends in flight, start the walks whose inputs landed, install
        the pairs formed again."""
        if self.repairs:
            self._finish_repairs()
        for peer, ack in self.transport.poll():  # arena slots we read or let go: the producers may reuse them
            self._send(rank_name(peer), ack)
        still = []
        now = time.monotonic()
        for out in self.outgoing:
            state = transfer_state(out.transfer)
            if state not in ("done", "pending"):
                log.error("%s: send of %s to rank %d failed: %s", self.name, out.uuid, out.dst, state)
                self.abort_pair(self.global_rank, out.dst, f"a send failed: {state}")
            elif state == "done":
                if out.release:
                    try:
                        self.store.unpersist(out.uuid)
                    except KeyError:
                        pass  # the request was removed meanwhile
            elif now - out.since > self.transfer_timeout_s:
                # a send that never completes: the pair is dead for good (docs/architecture.md §7); the consumer's
                # input wait times out and fails its request
                log.error("%s: send of %s to rank %d did not complete within %.0f s; aborting the pair",
                          self.name, out.uuid, out.dst, self.transfer_timeout_s)
                self.abort_pair(self.global_rank, out.dst, "a send timed out")
            else:
                still.append(out)
        self.outgoing = still
        for key in list(self.waiting):
            self._try_start(key)
        for uuid in [u for u, t in self.incoming.items()
                     if self._incoming_req[u] in self._removed and transfer_state(t) != "pending"]:
            del self.incoming[uuid], self._incoming_req[uuid]

    def _try_start(self, key: tuple[str, str]) -> None:
        waiting = self.waiting[key]
        ready: dict[str, torch.Tensor] = {}
        for name in waiting.missing:
            ref = waiting.msg.inputs[name]
            transfer = self.incoming.get(ref.uuid)
            state = "pending" if transfer is None else transfer_state(transfer)
            if state not in ("done", "pending"):
                del self.waiting[key], self.incoming[ref.uuid], self._incoming_req[ref.uuid]
                self.abort_pair(ref.rank, self.global_rank, f"a receive failed: {state}")
                self._fail(waiting.msg, f"input {name!r} from rank {ref.rank} failed: {state}")
                return
            if transfer is None and self.pair_dead(ref.rank, self.global_rank):
                del self.waiting[key]
                self._fail(waiting.msg, f"input {name!r} cannot arrive: the pair from rank {ref.rank} is dead")
                return
            if state == "pending":
                if time.monotonic() - waiting.since > self.transfer_timeout_s:
                    del self.waiting[key]
                    if transfer is not None:  # a posted receive that never completed: the pair is out of step
                        self.abort_pair(ref.rank, self.global_rank, "a receive timed out")
                    self._fail(waiting.msg, f"input {name!r} from rank {ref.rank} did not arrive within "
                               f"{self.transfer_timeout_s:.0f} s")
                return
            ready[name] = transfer.tensor
        for name in waiting.missing:
            uuid = waiting.msg.inputs[name].uuid
            del self.incoming[uuid], self._incoming_req[uuid]
        del self.waiting[key]
        if trace.ON:  # every input from another rank has landed: the walk starts now
            trace.event("rank_inputs_landed", waiting.msg.request_id, walk=waiting.msg.walk)
        self._start_walk(waiting.msg, ready)

    def _fail(self, msg: m.RunWalk, error: str) -> None:
        log.error("%s: request %s walk %s failed: %s", self.name, msg.request_id, msg.walk, error)
        self._report_failure(msg.request_id, msg.walk, error)
