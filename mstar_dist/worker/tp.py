"""Tensor-parallel replicas in lockstep (docs/architecture.md §4b).

A TP replica of a node is ``tp_size`` ranks; its first rank is the **leader**. The conductor talks to the leader
only: it holds the request's walk, batches its calls, emits to the client and sends outgoing edges, like any rank.
Before the leader runs a batch of a TP component it sends each follower a ``TPStep`` with the same calls (request,
walk, seed, sampling, iteration and inputs: small ones inline, a kept tensor's shard as a ``ShardRef``), then runs
it; every follower runs the same batch in the same order, so the collectives inside the forward (all-reduce after
the row-parallel layers, on the replica's own TP group) pair up. Followers keep no walks: per (request, walk) they
keep only the walk context (its sampling generator advances exactly as the leader's), and per request the shards
of kept outputs they produced (a P/D KV cache), which a ``TPPush`` from the leader sends to their counterpart on the
consuming replica. A request's removal reaches followers *through the leader's step stream* (``TPStep.release``),
never from the conductor directly: a removal that overtook a step still holding the request would change the
batch on one rank only and unpair the collectives. Kept shards are tagged with the request and freed with it.

Ranks here are global ranks; ``rank_in_group`` is the index in the replica's rank tuple.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed  # noqa: F401 -- DistError, for TP batch failures

from mstar_dist.control import messages as m
from mstar_dist.control.envelope import rank_name
from mstar_dist.engine.component import Component, WalkContext
from mstar_dist.engine.sampling import SamplingParams
from mstar_dist.graph.walk import NodeCall, NodeResult
from mstar_dist.transport.inline import decode_tensor, encode_tensor
from mstar_dist.transport.store import TensorStore
from mstar_dist.worker.transfers import Transfers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPRole:
    """This rank's place in the TP replica of one node."""

    node: str
    ranks: tuple[int, ...]
    """The replica's global ranks; ranks[0] leads."""
    me: int

    @property
    def rank_in_group(self) -> int:
        return self.ranks.index(self.me)

    @property
    def leads(self) -> bool:
        return self.ranks[0] == self.me

    @property
    def followers(self) -> tuple[int, ...]:
        return self.ranks[1:]


def shard_uuid(uuid: str, rank_in_group: int) -> str:
    """The name under which shard ``rank_in_group`` of the kept tensor ``uuid`` travels and is kept."""
    return uuid if rank_in_group == 0 else f"{uuid}#{rank_in_group}"


def step_for(calls: list[NodeCall], refs: dict[tuple[str, str], dict[str, str]], rank_in_group: int) -> m.TPStep:
    """The leader's batch as follower ``rank_in_group`` replays it. ``refs``: (request, walk) -> input signal ->
    the uuid of the kept tensor it came from (those inputs are sharded: each follower uses its own shard)."""
    out = []
    for call in calls:
        ctx: WalkContext = call.ctx
        kept = refs.get((call.request_id, call.run.walk), {})
        inputs: dict[str, Any] = {}
        for name, value in call.inputs.items():
            if name in kept:
                inputs[name] = m.ShardRef(uuid=shard_uuid(kept[name], rank_in_group))
            elif isinstance(value, torch.Tensor):
                inputs[name] = encode_tensor(value)
        out.append(m.TPCall(
            request_id=call.request_id, walk=call.run.walk, walk_index=ctx.walk_index, seed=ctx.seed,
            sampling=m.Sampling(**ctx.sampling.knobs()),
            iteration=call.iteration, inputs=inputs, export=sorted(ctx.export),
            stop_token_ids=sorted(ctx.stop_token_ids)))
    return m.TPStep(node=calls[0].node, calls=out)


@dataclass
class _Shim:
    """What a component reads of ``NodeCall.run`` on a follower: the request id and the walk context."""

    request_id: str
    walk: str
    ctx: WalkContext


@dataclass
class Follower:
    """A follower's side of every TP replica it belongs to: pending steps, walk contexts, kept shards."""

    device: torch.device
    steps: collections.deque = field(default_factory=collections.deque)
    contexts: dict[tuple[str, str, int], WalkContext] = field(default_factory=dict)
    kept: dict[tuple[str, str], str] = field(default_factory=dict)
    """(request, signal) -> uuid in this rank's store of its shard of a kept output."""
    since: dict[int, float] = field(default_factory=dict)

    def calls_of(self, step: m.TPStep, resolve) -> list[NodeCall] | None:
        """The step's calls, or None while a ShardRef input has not arrived (``resolve(uuid)`` returns the
        tensor, None while in flight, or raises)."""
        calls = []
        for c in step.calls:
            inputs: dict[str, Any] = {}
            for name, value in c.inputs.items():
                if isinstance(value, m.ShardRef):
                    tensor = resolve(value.uuid)
                    if tensor is None:
                        return None
                    inputs[name] = tensor
                else:
                    inputs[name] = decode_tensor(value, self.device)
            key = (c.request_id, c.walk, c.walk_index)
            ctx = self.contexts.get(key)
            if ctx is None:
                ctx = self.contexts[key] = WalkContext(
                    request_id=c.request_id, walk=c.walk, walk_index=c.walk_index, seed=c.seed,
                    sampling=SamplingParams.of(c.sampling, seed=c.seed),
                    export=frozenset(c.export), stop_token_ids=frozenset(c.stop_token_ids))
            calls.append(NodeCall(run=_Shim(c.request_id, c.walk, ctx), node=step.node, inputs=inputs,
                                  iteration=c.iteration))
        return calls

    def keep(self, calls: list[NodeCall], results: list[Any], store: TensorStore) -> None:
        """Keep this rank's shards of exported outputs (the leader's persisted ones) for a later TPPush."""
        for call, result in zip(calls, results):
            if isinstance(result, NodeResult):
                for signal in call.ctx.export:
                    value = result.outputs.get(signal)
                    if isinstance(value, torch.Tensor):
                        self.kept[(call.request_id, signal)] = store.put(value, tag=call.request_id)

    def forget(self, request_id: str) -> None:
        """The leader released the request (in its step order): drop its walk contexts."""
        for key in [k for k in self.contexts if k[0] == request_id]:
            del self.contexts[key]

    def waited(self, step: m.TPStep) -> float:
        return time.monotonic() - self.since.setdefault(id(step), time.monotonic())


class TPPeerLost(RuntimeError):
    """A TP batch failed in its collectives: a member of the replica died or its group broke (a 503)."""


def tp_failure(role: TPRole, result: Any) -> Any:
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


class TPReplicas:
    """This rank's part in the TP replicas of its nodes (see the module docstring): as a leader it hands each
    batch to its followers first; as a follower it replays its leaders' steps. Runs on the worker's loop."""

    def __init__(self, *, roles: dict[str, TPRole], name: str, device: torch.device,
                 components: dict[str, Component], store: TensorStore, transfers: Transfers,
                 send: Callable[[str, m.Message], None], transfer_timeout_s: float) -> None:
        self.roles = roles
        """Node -> this rank's role in the node's TP replica (only nodes with tp_size > 1)."""
        self.name, self.components, self.store = name, components, store
        self.transfers = transfers
        self._send = send
        self.transfer_timeout_s = transfer_timeout_s
        self.follower = Follower(device)
        self.ended: set[str] = set()
        """Nodes whose TP leader said no step follows (``TPEnd``)."""
        self._input_refs: dict[tuple[str, str], dict[str, str]] = {}  # (request, walk) -> kept input -> uuid
        self._kept_signal: dict[str, tuple[str, str]] = {}  # uuid of a kept output -> (request, signal)

    # ---- leader ----
    def lead(self, node: str, calls: list[NodeCall]) -> None:
        """Before a TP leader runs a batch: every follower gets the same batch (its own shards of kept inputs)."""
        role = self.roles[node]
        for i, follower in enumerate(role.followers, start=1):
            self._send(rank_name(follower), step_for(calls, self._input_refs, i))

    def keep_inputs(self, key: tuple[str, str], refs: dict[str, str]) -> None:
        """Walk ``key`` takes these inputs (name -> uuid) from kept tensors: its followers use their shards."""
        if refs and self.roles:
            self._input_refs[key] = refs

    def kept_output(self, uuid: str, request_id: str, signal: str) -> None:
        """Output ``signal`` of the request was kept as ``uuid``: a push of it pushes the followers' shards too."""
        if self.roles:
            self._kept_signal[uuid] = (request_id, signal)

    def push_shards(self, msg: m.Push) -> None:
        """Before the leader pushes its shard of a kept tensor to a TP replica: its followers push theirs."""
        if len(msg.tp_dst) > 1 and msg.uuid in self._kept_signal:
            request_id, signal = self._kept_signal[msg.uuid]
            role = next(r for r in self.roles.values() if r.leads)
            for i, follower in enumerate(role.followers, start=1):
                self._send(rank_name(follower), m.TPPush(request_id=request_id, signal=signal, dst=msg.tp_dst[i],
                                                         uuid=shard_uuid(msg.uuid, i), release=msg.release))

    def walk_ended(self, key: tuple[str, str]) -> None:
        self._input_refs.pop(key, None)

    def release(self, request_id: str) -> None:
        """Release a removed request in this rank's components; a follower's TP components in its leader's step
        order (``TPStep.release``), never on the conductor's word."""
        for key in [k for k in self._input_refs if k[0] == request_id]:
            del self._input_refs[key]
        for uuid in [u for u, (rid, _) in self._kept_signal.items() if rid == request_id]:
            del self._kept_signal[uuid]
        for node, component in self.components.items():
            role = self.roles.get(node)
            if role is not None and not role.leads:
                continue  # released in the leader's step order (TPStep.release)
            component.release(request_id)
            if role is not None:
                for follower in role.followers:
                    self._send(rank_name(follower), m.TPStep(node=node, calls=[], release=[request_id]))

    def tell_end(self) -> set[str]:
        """Tell followers that no step follows (``TPEnd``); the nodes whose leaders this rank must still hear say
        so (those not known dead)."""
        for node, role in self.roles.items():
            if role.leads:
                for follower in role.followers:
                    try:
                        self._send(rank_name(follower), m.TPEnd(node=node))
                    except Exception:  # the follower's socket is gone: it left already
                        log.debug("%s: could not tell rank %d that TP steps of %s end", self.name, follower, node)
        return {node for node, role in self.roles.items()
                if not role.leads and not self.transfers.transport.is_dead(role.ranks[0])}

    # ---- follower ----
    def on_tp_push(self, msg: m.TPPush) -> None:
        uuid = self.follower.kept.pop((msg.request_id, msg.signal), None)
        if uuid is None:
            log.error("%s: no shard of %r for %s to push", self.name, msg.signal, msg.request_id)
            return
        self.transfers.push(m.Push(request_id=msg.request_id, uuid=uuid, dst=msg.dst, release=msg.release),
                            wire_uuid=msg.uuid)

    def run_follower_steps(self) -> None:
        """Replay the leaders' batches in the order they were sent; a step waits for its shards to arrive."""
        follower = self.follower
        while follower.steps:
            step = follower.steps[0]
            for request_id in step.release:
                self.components[step.node].release(request_id)
                follower.forget(request_id)
            step.release.clear()
            try:
                calls = follower.calls_of(step, self.transfers.take)
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
