"""Component interface: what a worker runs for a graph node (docs/architecture.md §8).

The worker hands a component every ready call for it at once, across requests, so an engine batches what it can
(decode steps of many requests in one forward). ``run_batch`` returns one entry per call: a ``NodeResult``, an
exception (that request fails, the others go on), or a ``Held(reason)`` (not now: e.g. no free KV slot, or its work
is still on the device; engine/scheduler.py names the reasons): the worker hands the same call over again later.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from mstar_dist.engine.sampling import SamplingParams, make_generator
from mstar_dist.engine.scheduler import Held
from mstar_dist.graph.walk import NodeCall, NodeResult


@dataclass
class WalkContext:
    """Per (request, walk) facts a component may use; built by the worker from ``RunWalk``."""

    request_id: str
    walk: str
    walk_index: int
    seed: int
    """Seed of this walk: the request's seed advanced by one per completed walk (docs/architecture.md §4)."""
    sampling: SamplingParams
    """How this walk's tokens are drawn (temperature, top-p, top-k; seeded with ``seed``)."""
    export: frozenset[str] = frozenset()
    """Persisted outputs a consumer on another rank needs: the producer must materialise them."""
    stop_token_ids: frozenset[int] = frozenset()
    state: dict[str, Any] = field(default_factory=dict)
    """Component-private per-walk state (e.g. the seeded sampling generator)."""

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """This walk's sampling generator (seeded from ``sampling.seed``, the walk's seed), made on first use. The
        KV engine draws its uniforms on the CPU (no device launch per row); the device is fixed at first use."""
        gen = self.state.get("generator")
        if gen is None:
            gen = self.state["generator"] = make_generator(self.sampling, device)
        return gen


class Component(ABC):
    name: str
    host_inputs: frozenset[str] = frozenset()
    """Inputs this component moves to its device itself. One that arrives inline (inside the control message) is
    handed over on the host instead of being copied to the device on the current stream, where it would queue behind
    the work already there (the KV engine copies prompt ids on the stream its prefill runs on)."""

    @abstractmethod
    def run_batch(self, calls: list[NodeCall]) -> list[NodeResult | BaseException | Held]:
        """Run ready calls (from several requests); one entry per call, in order."""

    def pending(self) -> bool:
        """True while calls this component held will complete with no new input (a prefill still on the device):
        the worker then polls instead of blocking on its socket, and hands the calls over again."""
        return False

    def release(self, request_id: str) -> None:
        """Free everything this component keeps for ``request_id`` (KV slots). Idempotent."""

    def warmup(self) -> None:
        """Run once after loading so the first request is not slow."""

    def close(self) -> None:
        """Let go of device state that must not outlive the process groups, before they are destroyed at exit: a
        CUDA graph that captured NCCL collectives keeps their communicator busy, and destroying it then never
        returns (docs/architecture.md §2, teardown). The component is not used afterwards."""

    def stats(self) -> dict[str, int]:
        return {}
