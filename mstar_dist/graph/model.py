"""The contract between the runtime and a model family (docs/architecture.md §4).

A model declares its walks (``graphs``), builds the components placed on a rank (``build_component``), and drives
a request on the conductor: ``preprocess`` (tokenize), ``start`` (first walk), ``after_walk`` (next walk or done),
``postprocess`` (values emitted to the client -> text, audio or image deltas). Model code never sees ranks or
transports, but a family may look at the deployment's layout (:class:`Layout`) before it builds its walks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from mstar_dist.config.engine import EngineConfig
from mstar_dist.events import GenerationParams, MediaItem, MediaLimits
from mstar_dist.graph.nodes import Section
from mstar_dist.graph.partitions import Partition, StreamingEdge


@dataclass(frozen=True)
class Layout:
    """Where a deployment places the model's nodes, as its config says, before any walk exists: node name ->
    the global ranks that run it (any walk). A family whose walks depend on the deployment reads this in
    :meth:`CompositeModel.configure` (e.g. a parallel-guidance walk only when the guidance branches have ranks
    of their own). Every rank gets the same layout from the same config."""

    node_ranks: dict[str, frozenset[int]] = field(default_factory=dict)

    @classmethod
    def from_node_groups(cls, node_groups) -> "Layout":
        ranks: dict[str, set[int]] = {}
        for group in node_groups:
            for node in group.node_names:
                ranks.setdefault(node, set()).update(group.ranks)
        return cls({node: frozenset(r) for node, r in ranks.items()})

    def placed(self, node: str) -> bool:
        return node in self.node_ranks

    def ranks(self, node: str) -> frozenset[int]:
        return self.node_ranks.get(node, frozenset())


@dataclass
class WalkStep:
    """The next walk of a request: its name, its inputs (tensors, tensors already encoded for the wire
    (`InlineTensor`, e.g. `inline.encode_ids`), or store references) and loop limits."""

    walk: str
    inputs: dict[str, Any]
    loop_limits: dict[str, int] = field(default_factory=dict)
    keep: frozenset[str] = frozenset()
    """Inputs that are kept tensors (walk outputs with ``persist``) a later walk will consume again. Every other
    kept-tensor input is consumed by this walk: its producer drops it once it is sent (or read, on its own rank)."""


@dataclass
class RequestState:
    """What the conductor knows about one request; ``data`` is the model's own per-request state."""

    request_id: str
    seed: int
    max_tokens: int
    max_tokens_given: bool = True
    """False when the client left max_tokens to the service: preprocess may lower it to fit the context."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    """Set by the model when it ends the request itself (e.g. EOS right after prefill)."""
    knobs: dict[str, Any] = field(default_factory=dict)
    """The request's model knobs (native ``model_kwargs`` beyond sampling, or a route's family fields such as
    ``voice``); ``preprocess`` validates them (``ValueError`` naming the knob and its allowed range: a 400)."""
    media: list[MediaItem] = field(default_factory=list)
    """The request's images and audio clips (``GenerationParams.media``: raw bytes, declared format, where each stood
    in ``messages``), only for a family whose ``input_modalities`` take them. ``preprocess`` decodes them within
    ``media_limits`` (a ``ValueError`` naming the item and the limit: a 400)."""
    media_limits: MediaLimits | None = None
    """The deployment's decoding limits (pixels, seconds, bytes); set whenever ``media`` is not empty."""
    output_modalities: list[str] | None = None
    """What the client asked to receive (``GenerationParams.output_modalities``); None: the family's default. A
    family that speaks on request runs its speech partitions only when "audio" is in it (``start_done``)."""
    params: GenerationParams | None = None
    """The request as the client sent it (its sampling and detokenisation knobs: ``logprobs``,
    ``skip_special_tokens``, ``include_stop_str_in_output``...); None outside the conductor (tests)."""
    stop_ids: frozenset[int] | None = None
    """The token ids that end this request's generation: the model's ``stop_token_ids()`` unless ``ignore_eos``, plus
    the request's ``stop_token_ids`` (the ranks stop on the same set); None: the model's own."""
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    """Sampling knobs the family sets in ``preprocess`` for its walks, used where the client left the knob at its
    neutral value (e.g. a speech model's ``repetition_penalty``); names as ``GenerationParams``'."""
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def penalized(self) -> bool:
        """Some penalty is on for the request's walks (its own knobs, else the family's ``sampling_defaults``): a
        decode rank that imports its KV needs the prompt's ids too (the KV engine's ``prompt_ids``)."""
        given = getattr(self.params, "sampling_given", None)
        for name, off in PENALTIES.items():
            value = getattr(self.params, name, off)
            if name in self.sampling_defaults and ((name not in given) if given is not None else value == off):
                value = self.sampling_defaults[name]
            if value != off:
                return True
        return False


PENALTIES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
"""The penalty knobs and the value that turns each off."""


class CompositeModel(ABC):
    """A model family. Instances are built on every rank from ``(weights_dir, model_kwargs)``."""

    name: str = "model"
    output_modality: str = "text"
    """What ``postprocess`` produces for clients: "text", "audio" or "image" (routes check it)."""
    output_modalities: frozenset[str] = frozenset()
    """Every modality ``postprocess`` can produce when a request asks for it (``RequestState.output_modalities``),
    e.g. {"text", "audio"} for a model that answers in text and speech; empty: ``output_modality`` alone."""
    input_modalities: frozenset[str] = frozenset({"text"})
    """What requests may carry: "text", plus "image" and / or "audio" for a family whose ``preprocess`` takes
    ``RequestState.media``. The HTTP server refuses any other media with a 400 before the family sees it."""
    tp_nodes: frozenset[str] = frozenset()
    """Nodes this family can shard over a TP group (``build_component(..., tp=TPGroup)``); placing any other
    node with ``tp_size > 1`` is a startup error."""

    def __init__(self, weights_dir: str | None, **model_kwargs: Any):
        self.weights_dir = weights_dir
        self.model_kwargs = model_kwargs
        self.layout = Layout()
        self.engine = EngineConfig()

    def configure(self, layout: Layout, engine: EngineConfig | None = None) -> None:
        """Called once, before :meth:`graphs`, with the deployment's layout and its ``engine:`` (on every rank and on
        the front end alike). Default: keep them in ``self.layout`` and ``self.engine`` (a family reads what its front
        end needs there, such as the context ``max_seq_len`` leaves); a family whose walks depend on the placement
        builds them from the layout."""
        self.layout = layout
        if engine is not None:
            self.engine = engine

    @abstractmethod
    def graphs(self) -> dict[str, Section]:
        """Walk name -> section. Pure: a function of the model's kwargs and ``self.layout``, the same on every rank
        (ranks compare a digest of it at startup)."""

    def partitions(self) -> list[Partition]:
        """Groups of walks that run concurrently for one request. Default: one partition with every walk."""
        return [Partition("main", tuple(self.graphs()))]

    def streaming_edges(self) -> list[StreamingEdge]:
        """Signals streamed from a walk of one partition into a node of another, through a chunk policy.

        The consumer node receives each chunk as input ``signal`` plus optional inputs ``<signal>_final`` (bool,
        the last chunk: its stop check should end its loop) and ``<signal>_context`` (leading items that an earlier
        chunk already carried).
        """
        return []

    def start_done(self, state: "RequestState") -> set[str]:
        """Partitions that need not run for this request (e.g. no audio asked for). Default: none."""
        return set()

    default_weights_dir: str | None = None
    """The weights path this family prepares by itself on first start (``prepare_weights``), if any. Any other
    ``weights:`` path that does not exist is a config error naming the key (checked before ranks start)."""

    def prepare_weights(self) -> None:
        """Make ``weights_dir`` exist (called once per host before loading). Default: nothing to do."""

    def weights_dirs(self) -> list[str]:
        """Every directory this family reads weights from: the server says the model's weights are random (and its
        output noise) when any of them carries the random-weights marker (``mstar_dist.random_weights``). Default:
        ``weights_dir``."""
        return [self.weights_dir] if self.weights_dir else []

    @abstractmethod
    def build_component(self, node: str, *, device: str, walks: set[str], engine: EngineConfig | None = None) -> Any:
        """Build and load the component ``node`` for this rank (an :class:`mstar_dist.engine.component.Component`).
        ``engine``: the engine policy of this node on this rank (the deployment's ``engine:`` with its node group's
        overrides; None: ``self.engine``), for a component that runs an engine (``EngineConfig.on`` applies the
        rank's device and TP group to it). For a node in :attr:`tp_nodes` placed with ``tp_size > 1`` the runtime
        also passes ``tp`` (:class:`mstar_dist.distributed.tp.TPGroup`): build only this rank's shard, reduce on ``tp.group``."""

    # ---- conductor side (rank 0) ----
    def load_frontend(self) -> None:
        """Load what the conductor needs (tokenizer, templates)."""

    def prompt_encoder(self) -> tuple[str, dict[str, Any]] | None:
        """How an HTTP intake process (docs/architecture.md §2) may turn a request's prompt into token ids itself, so
        that the one conductor thread does not: ``("package.module:Factory", kwargs)``, where the module imports no
        torch and ``Factory(**kwargs).encode_prompt(prompt, messages)`` gives exactly the ids ``preprocess`` would
        compute. ``preprocess`` then finds them in ``state.data["prompt_ids"]``. None (the default): the conductor
        tokenizes."""
        return None

    @property
    def max_context_tokens(self) -> int:
        return 1 << 30

    @property
    def id_signals(self) -> frozenset[str]:
        """Emitted signals whose values are int64 token ids that ``postprocess`` wants as Python ints: the conductor
        hands it the ids of such a message's values as one flat ``list[int]`` instead of tensors (a decode token's
        tensor was made on the conductor only to be turned back into an int). Empty (the default): tensors."""
        return frozenset()

    @abstractmethod
    def preprocess(self, state: RequestState, prompt: str | None, messages: list[dict] | None) -> None:
        """Tokenize into ``state.data``; raise ``ValueError`` with a message for the client on bad input."""

    @abstractmethod
    def start(self, state: RequestState) -> WalkStep | list[WalkStep]:
        """The first walk of each partition that starts now (one step, or one per partition)."""

    @abstractmethod
    def after_walk(self, state: RequestState, walk: str, outputs: dict[str, Any]) -> WalkStep | None:
        """Next walk of the same partition, or ``None``: that partition is done (the request is done when every
        partition is)."""

    @abstractmethod
    def postprocess(self, state: RequestState, signal: str, values: list[Any]) -> Any:
        """Values a node emitted to the client (tensors; for ``id_signals``, their ids as one list of ints) -> new text
        (a ``str``, possibly empty while a character is incomplete), or :class:`mstar_dist.events.MediaDelta` (audio,
        image), or a list of them. Count generated tokens in ``state.completion_tokens``. Stop strings are the
        conductor's business, not the model's."""

    def finish_text(self, state: RequestState) -> str:
        """Text still held back when the request ends (an incomplete character, flushed)."""
        return ""

    def stop_token_ids(self) -> list[int]:
        return []
