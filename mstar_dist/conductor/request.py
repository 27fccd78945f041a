"""One request as the conductor holds it while it runs, and how its seeds are drawn (docs/architecture.md §4)."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any

from mstar_dist.conductor.commands import Sink
from mstar_dist.conductor.routes import Choice
from mstar_dist.conductor.stop_strings import StopTrimmer
from mstar_dist.events import GenerationParams
from mstar_dist.graph.model import RequestState
from mstar_dist.graph.partitions import PartitionTracker


def walk_seed(request_seed: int, partition_index: int, walk_index: int) -> int:
    """The seed of a walk: the request's seed advanced by one per completed walk of its partition.

    Counting per partition keeps the seeds independent of how concurrent partitions interleave; partitions after
    the first are offset so that their walks never share a seed with the first partition's.
    """
    return (request_seed + partition_index * 1_000_003 + walk_index) & 0x7FFF_FFFF_FFFF_FFFF


def request_seed(params: GenerationParams, pinned_id: bool) -> int:
    """The pinned ``seed``, else a hash of a pinned request id, else random."""
    if params.seed is not None:
        return int(params.seed)
    if pinned_id:
        return int.from_bytes(hashlib.sha256(params.request_id.encode()).digest()[:7], "little")
    return random.getrandbits(56)


def request_state(params: GenerationParams, pinned_id: bool) -> RequestState:
    """What the model family sees of a new request (``CompositeModel.preprocess`` and after)."""
    state = RequestState(request_id=params.request_id, seed=request_seed(params, pinned_id),
                         max_tokens=params.max_tokens, max_tokens_given=params.max_tokens_given,
                         knobs=dict(params.model_kwargs), media=params.media, media_limits=params.media_limits,
                         output_modalities=params.output_modalities)
    if params.prompt_ids is not None:
        state.data["prompt_ids"] = params.prompt_ids  # encoded by an intake (``CompositeModel.prompt_encoder``)
    return state


@dataclass
class Request:
    """A running request: the model's state, where its walks run, and what its client has been sent."""

    state: RequestState
    params: GenerationParams
    sink: Sink
    choice: Choice
    """The replicas chosen at admission (possibly shared with other requests: read only)."""
    arrived: float
    wire_id: str
    """The id on the wire: the client's id plus an incarnation number, so a pinned id can be reused at once
    without a rank mistaking the new request for the removed one."""
    stops: StopTrimmer
    """Cuts the text at the request's stop strings (the one place they are applied)."""
    pinned_id: bool = False
    """The client chose the id (it seeds sampling): a retry on another replica keeps it."""
    first_token_at: float | None = None
    last_token_at: float | None = None
    touched: set[int] = field(default_factory=set)
    """Every rank a walk of the request was sent to (each is told to forget it at the end)."""
    partitions: PartitionTracker | None = None
    stream_src: dict[str, int] = field(default_factory=dict)
    """Streaming signal -> the rank of the last walk dispatched to produce it."""
    finish_reason: str | None = None
    """Why the first partition's walks ended (``WalkDone.finish_reason``), if they said."""
    pieces: dict[str, tuple[set[int], dict[str, Any]]] = field(default_factory=dict)
    """Walk -> (ranks whose ``WalkDone`` is still due, outputs gathered so far) for a walk that spans ranks."""

    def walk_ranks(self, walk: str) -> list[int]:
        """Global ranks running some node of ``walk`` for this request, sorted."""
        return self.choice.walk_ranks(walk)

    def rank_of(self, walk: str, node: str) -> int:
        return self.choice.rank_of(walk, node)
