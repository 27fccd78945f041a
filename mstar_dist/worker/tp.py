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
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar_dist.control import messages as m
from mstar_dist.engine.component import WalkContext
from mstar_dist.engine.sampling import SamplingParams
from mstar_dist.graph.walk import NodeCall, NodeResult
from mstar_dist.transport.inline import decode_tensor, encode_tensor


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
            sampling=m.Sampling(temperature=ctx.sampling.temperature, top_p=ctx.sampling.top_p,
                                top_k=ctx.sampling.top_k),
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
                    sampling=SamplingParams(temperature=c.sampling.temperature, top_p=c.sampling.top_p,
                                            top_k=c.sampling.top_k, seed=c.seed),
                    export=frozenset(c.export), stop_token_ids=frozenset(c.stop_token_ids))
            calls.append(NodeCall(run=_Shim(c.request_id, c.walk, ctx), node=step.node, inputs=inputs,
                                  iteration=c.iteration))
        return calls

    def keep(self, calls: list[NodeCall], results: list[Any], store: Any) -> None:
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
