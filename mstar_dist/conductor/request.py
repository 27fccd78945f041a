"""One request as the conductor holds it while it runs, and how its seeds are drawn (docs/architecture.md §4)."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

from mstar_dist.conductor.commands import Sink
from mstar_dist.control import messages as m
from mstar_dist.engine.grammar import compile_guided
from mstar_dist.engine.sampling import KNOBS, SamplingParams
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


def request_state(params: GenerationParams, pinned_id: bool, model_stop_ids: Sequence[int] = ()) -> RequestState:
    """What the model family sees of a new request (``CompositeModel.preprocess`` and after); ``model_stop_ids``: the
    model's ``stop_token_ids()``."""
    state = RequestState(request_id=params.request_id, seed=request_seed(params, pinned_id),
                         max_tokens=params.max_tokens, max_tokens_given=params.max_tokens_given,
                         knobs=dict(params.model_kwargs), media=params.media, media_limits=params.media_limits,
                         output_modalities=params.output_modalities, params=params,
                         stop_ids=frozenset(() if params.ignore_eos else model_stop_ids) | set(params.stop_token_ids))
    if params.prompt_ids is not None:
        state.data["prompt_ids"] = params.prompt_ids  # encoded by an intake (``CompositeModel.prompt_encoder``)
    return state


def check_knobs(params: GenerationParams) -> None:
    """ValueError (a 400) naming a sampling knob out of range or a grammar that cannot run, before anything runs: the
    same conversion and compiler the ranks use (``SamplingParams.of``, ``grammar.compile_guided``)."""
    SamplingParams.of(params, seed=None)
    if isinstance(params.n, bool) or not isinstance(params.n, int) or params.n < 1:
        raise ValueError(f"n must be an int >= 1, got {params.n!r}")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids must be token ids (ints >= 0), got {params.stop_token_ids!r}")
    if params.guided is not None:
        compile_guided(params.guided.kind, params.guided.spec)


def wire_sampling(params: GenerationParams, defaults: dict[str, Any], made: int) -> m.Sampling:
    """The request's sampling knobs for a walk that follows ``made`` generated tokens: each knob the client left
    neutral takes the family's default if it set one (``RequestState.sampling_defaults``), and ``min_tokens`` counts
    from the walk's first token."""
    knobs = {name: getattr(params, name) for name in KNOBS}
    for name, value in defaults.items():
        if takes_default(params, name):
            knobs[name] = value
    knobs["min_tokens"] = max(0, params.min_tokens - made)
    return m.Sampling(**knobs)


NEUTRAL = SamplingParams()
"""Every knob at the value that changes nothing."""


def takes_default(params: GenerationParams, name: str) -> bool:
    """Whether the request's knob ``name`` takes the family's default: the client did not write it
    (``GenerationParams.sampling_given``), or, where that is not known, left it at its neutral value."""
    if params.sampling_given is not None:
        return name not in params.sampling_given
    return getattr(params, name) == getattr(NEUTRAL, name)


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
    stops: StopTrimmer = field(init=False)
    """Cuts the text at the request's stop strings (the one place they are applied)."""
    sampling: m.Sampling = field(init=False)
    """Its sampling knobs on the wire (``wire_sampling``), for walks that follow no generated token."""
    stop_ids: list[int] = field(init=False)
    """The token ids that end its generation (``RequestState.stop_ids``), as every ``RunWalk`` carries them."""
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

    def __post_init__(self) -> None:
        params, state = self.params, self.state
        self.stops = StopTrimmer(params.stop, params.include_stop_str_in_output)
        self.sampling = wire_sampling(params, state.sampling_defaults, 0)
        self.stop_ids = sorted(state.stop_ids)

    def walk_sampling(self) -> m.Sampling:
        """The sampling knobs of the request's next walk (its ``min_tokens`` counted from the walk's first token)."""
        if not self.params.min_tokens:
            return self.sampling
        return wire_sampling(self.params, self.state.sampling_defaults, self.state.completion_tokens)

    def walk_ranks(self, walk: str) -> list[int]:
        """Global ranks running some node of ``walk`` for this request, sorted."""
        return self.choice.walk_ranks(walk)

    def rank_of(self, walk: str, node: str) -> int:
        return self.choice.rank_of(walk, node)
