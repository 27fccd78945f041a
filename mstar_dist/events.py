"""What a request produces, as plain data shared by the model families, the conductor, the intakes and the HTTP server.

A request yields zero or more deltas — :class:`TextDelta` (text), :class:`MediaDelta` (audio or image bytes with
their metadata) — then exactly one :class:`Finished`, or fails with a :class:`BackendError`. The deltas and
``Finished`` are msgspec structs: the very objects the conductor hands an in-process sink are the ones it sends to an
HTTP intake process (``control/messages.py`` ``Outputs``); a failure crosses as :class:`Failed`, the data of its
``BackendError`` (:func:`to_wire` and :func:`from_wire` are the one translation, used at both ends). No torch, no
sockets: the server and its tests import this without a process group (docs/architecture.md §6).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

import msgspec

FINISH_REASONS = ("stop", "length", "abort")
"""Finish reasons a client can see."""
REQUEST_ENDS = (*FINISH_REASONS, "error")
"""How a request can end, as ``/metrics`` counts them: one of ``FINISH_REASONS``, or "error" (an error status)."""
MODALITIES = ("text", "audio", "image")
"""What a model family can emit to the client."""


INPUT_MEDIA = ("image", "audio")
"""What a request may carry beside text (``MediaItem.kind``)."""
AUDIO_INPUT_FORMATS = ("wav", "mp3", "flac", "ogg")
"""Container formats of an input audio clip (OpenAI's ``input_audio.format`` names)."""


class MediaItem(msgspec.Struct, frozen=True):
    """One image or audio clip of a request, as the client sent it: raw bytes (base64 and URLs are the HTTP
    server's business) and the format it declared. Not decoded yet: the family decodes it in ``preprocess``
    (``mstar_dist.media``), within the request's :class:`MediaLimits`."""

    kind: str
    """One of ``INPUT_MEDIA``: "image" or "audio"."""
    data: bytes
    """The file as sent: a PNG, JPEG, WebP... image, or a WAV, MP3, FLAC or OGG clip."""
    format: str
    """For an image its declared MIME type ("image/png"), or "" when nothing declared one (the decoder looks at the
    bytes); for audio one of ``AUDIO_INPUT_FORMATS``. A declaration the bytes contradict is the decoder's 400."""
    message: int
    """Index in ``GenerationParams.messages`` of the message whose content held this item."""
    offset: int
    """Characters of that message's ``content`` (its text parts joined) that came before this item: the item stood
    between ``content[:offset]`` and ``content[offset:]``. Items at one offset keep their order in the list."""
    source: str
    """Where the client put it, for error messages: ``messages[0].content[2]`` (or ``files[1]`` for an upload)."""
    detail: str | None = None
    """An image's ``image_url.detail`` ("auto", "low", "high") when the client gave one."""


class MediaLimits(msgspec.Struct, frozen=True):
    """The deployment's ``media:`` limits that only decoding can check, handed to the family with each request that
    carries media (its ``preprocess`` passes them to the decoders). A breach is a ``ValueError`` (a 400) naming the
    key and its value, e.g. "messages[0].content[1]: the image is 5000x5000 = 25000000 pixels, above
    media.max_image_pixels = 16777216"."""

    max_item_bytes: int
    """``media.max_item_bytes``: already checked on the bytes as sent (the decoder's ``max_bytes``)."""
    max_image_pixels: int
    """``media.max_image_pixels``: width x height of a decoded image."""
    max_audio_seconds: float
    """``media.max_audio_seconds``: duration of a decoded clip."""


GUIDED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
"""What a structured-output request constrains its text to (``GuidedSpec.kind``)."""


class GuidedSpec(msgspec.Struct, frozen=True):
    """A structured-output constraint, as the HTTP server parsed it from ``response_format`` or vLLM's ``guided_*``
    fields; the engine compiles it into a per-row token mask (an unsupported feature is a 400 naming it)."""

    kind: str
    """One of ``GUIDED_KINDS``."""
    spec: str
    """By kind: "json_schema" the schema as JSON text; "json_object" "" (any JSON object); "regex" the pattern;
    "choice" a JSON array of the allowed strings; "grammar" the grammar text (EBNF / GBNF)."""


@dataclass(frozen=True)
class GenerationParams:
    """One validated request, as the backend receives it (already checked against the backend's limits)."""

    request_id: str
    """Pinned by the client (native ``request_id``, ``X-Request-Id``) or generated; unique per request."""
    prompt: str | None
    """Raw prompt text; exactly one of ``prompt`` / ``messages`` is set."""
    messages: list[dict[str, str]] | None
    """Chat messages normalised to ``{"role": str, "content": str}`` (text parts joined); the backend applies
    the model's chat template."""
    max_tokens: int
    """Upper bound on generated tokens, 1 <= max_tokens <= backend.max_tokens_limit."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables."""
    top_k: int = 0
    """0 disables."""
    seed: int | None = None
    """Fixes the request's sampling seed when set (see docs/architecture.md §4)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: the conductor cuts the text at the first one and ends the request (finish reason "stop");
    the client never sees the stop string or anything after it."""
    stream: bool = False
    """Whether the client streams; informational (the backend yields deltas either way)."""
    max_tokens_given: bool = True
    """False when the client did not ask for a number: ``max_tokens`` is then the service's default limit and the
    backend may lower it to what the context leaves after the prompt (instead of rejecting the request)."""
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    """Per-request knobs of the model family (``voice``, ``steps``, ``guidance_scale``, ``width``...), JSON
    values. The family validates them in ``preprocess``: an unknown or out-of-range knob is a 400 naming it."""
    prompt_ids: list[int] | None = None
    """The prompt's token ids, for a family with a prompt encoder (``CompositeModel.prompt_encoder``, whose
    ``preprocess`` takes them instead of tokenizing): encoded by the HTTP side (an intake process, or the server for
    a request that needs the count up front), or sent by the client as ids (``/v1/completions`` with a token-id
    prompt, checked against the vocabulary; ``prompt`` then holds their text). None: the conductor's ``preprocess``
    tokenizes."""
    media: list[MediaItem] = field(default_factory=list)
    """The images and audio clips of ``messages``, in the order the client gave them (checked for count, size,
    base64, declared format and URL policy; not decoded). Only for a family that takes them (the backend's
    ``input_modalities``); the server refuses them for any other with a 400."""
    media_limits: MediaLimits | None = None
    """The decoding limits for ``media``; set whenever ``media`` is not empty."""
    output_modalities: list[str] | None = None
    """What the client asked to receive, a subset of ``MODALITIES`` the backend produces (chat ``modalities``:
    ["text"] or ["text", "audio"]; ``/v1/audio/speech``: ["audio"]); None: whatever the family gives by default. A
    family that can speak starts its speech partitions only when "audio" is asked for."""
    # Sampling and output knobs beyond temperature / top-p / top-k: OpenAI's and vLLM's extra parameters, with vLLM's
    # meaning; the HTTP server validates them, the engine and the conductor apply them.
    min_p: float = 0.0
    """Drop tokens whose probability is below ``min_p`` times the most likely token's; 0 disables. In [0, 1]."""
    repetition_penalty: float = 1.0
    """vLLM's: the logit of a token already in the prompt or the output is divided by it when positive, multiplied
    when negative; 1 disables. > 0."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens (until ``max_tokens`` or a stop string)."""
    min_tokens: int = 0
    """End-of-sequence tokens and ``stop_token_ids`` cannot end the request before this many tokens."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the request like an end-of-sequence token (finish reason "stop")."""
    include_stop_str_in_output: bool = False
    """Keep the stop string that ended the request at the end of the text."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    spaces_between_special_tokens: bool = True
    """Put a space between special tokens in the text (when they are not skipped)."""
    logprobs: int | None = None
    """None: no log-probabilities; k >= 0: each generated token's log-probability and its k most likely
    alternatives (``TextDelta.logprobs``)."""
    prompt_logprobs: int | None = None
    """None: none; k >= 0: each prompt token's log-probability and k alternatives (``TextDelta.prompt_logprobs``)."""
    n: int = 1
    """Independent samples of the one prompt (its KV shared); each delta says its choice (``TextDelta.index``)."""
    guided: GuidedSpec | None = None
    """Constrain the text to a JSON schema, a regular expression, a choice or a grammar; None: free text."""


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One token's log-probability as the model computed it, and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []
    """(token id, log-probability) of the most likely tokens at this position, most likely first (as many as
    asked for; the chosen token may be among them)."""


class TextDelta(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """New text since the previous delta (whole characters: the backend holds back partial UTF-8 bytes)."""

    text: str
    n_tokens: int
    """Tokens this delta accounts for (may be > 0 with empty text while a multi-byte character is pending)."""
    index: int = 0
    """The choice this delta belongs to, 0 <= index < ``GenerationParams.n``."""
    logprobs: list[TokenLogprob] | None = None
    """With ``GenerationParams.logprobs``: one entry per token this delta accounts for, in order."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """With ``GenerationParams.prompt_logprobs``, on a choice's first delta: one entry per prompt token (None for
    the first, which has no log-probability), its ``token_id`` the prompt's id."""

    def joins(self, after: TextDelta) -> bool:
        """Whether ``after`` may be sent as one delta with this one (:meth:`join`): same choice, no log-probabilities
        to keep apart."""
        return after.index == self.index and self.prompt_logprobs is None and after.prompt_logprobs is None \
            and (self.logprobs is None) == (after.logprobs is None)

    def join(self, after: TextDelta) -> TextDelta:
        """This delta followed by ``after`` (which :meth:`joins` it) as one."""
        logprobs = None if self.logprobs is None else [*self.logprobs, *(after.logprobs or ())]
        return TextDelta(self.text + after.text, self.n_tokens + after.n_tokens, self.index, logprobs)


class Finished(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """The last item of every complete generation."""

    finish_reason: str
    """One of ``FINISH_REASONS``: "stop" (EOS or stop string), "length" (max_tokens or context), "abort"."""
    prompt_tokens: int
    completion_tokens: int
    """Generated tokens of every choice together."""
    finish_reasons: list[str] = []
    """With ``GenerationParams.n`` > 1, each choice's finish reason in index order (empty: ``[finish_reason]``)."""

    def reasons(self, n: int) -> list[str]:
        """The finish reason of each of ``n`` choices."""
        return list(self.finish_reasons) if self.finish_reasons else [self.finish_reason] * n


class MediaDelta(msgspec.Struct, frozen=True, tag=True):
    """A piece of non-text output as it is produced: ``modality`` "audio" (``data`` is little-endian PCM16,
    ``metadata`` has ``sample_rate`` and ``num_channels``) or "image" (``data`` is a PNG file, ``metadata`` has
    ``width`` and ``height``). ``n_tokens`` counts the generated tokens this piece accounts for."""

    modality: str
    data: bytes
    metadata: dict[str, Any] = {}
    n_tokens: int = 0


GenerationEvent = Union[TextDelta, MediaDelta, Finished]


class BackendError(Exception):
    """A request-level failure with the HTTP status the client should see.

    4xx: the request is wrong (``BackendError(400, "prompt is 9000 tokens, context is 8192")``).
    5xx: the service failed this request (503 when not serving, 500 for a model failure naming the rank).
    """

    def __init__(self, status: int, message: str, *, retry_after_s: int | None = None) -> None:
        if not 400 <= status <= 599:
            raise ValueError(f"BackendError status must be a 4xx/5xx HTTP status, got {status}")
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s
        """Seconds after which a retry may succeed (overload: 429, 503); sent as ``Retry-After``."""

    def __repr__(self) -> str:
        return f"BackendError({self.status}, {self.message!r})"


class Failed(msgspec.Struct, frozen=True, tag=True):
    """A :class:`BackendError` as data, where an event crosses a socket (an exception does not)."""

    status: int
    message: str
    retry_after_s: int | None = None


OutputEvent = Union[TextDelta, MediaDelta, Finished, BackendError]
"""What a request's sink receives from the conductor."""
WireEvent = Union[TextDelta, MediaDelta, Finished, Failed]
"""An ``OutputEvent`` as it crosses a socket (``control/messages.py`` ``Outputs``)."""


def to_wire(event: Any) -> WireEvent:
    """``event`` as it is sent: a ``BackendError`` as ``Failed``; anything but an output event as a 500."""
    if isinstance(event, (TextDelta, MediaDelta, Finished)):
        return event
    if isinstance(event, BackendError):
        return Failed(event.status, event.message, event.retry_after_s)
    return Failed(500, f"{type(event).__name__}: {event}")


def from_wire(event: WireEvent) -> OutputEvent:
    """What a sink would have received for ``event`` (the inverse of :func:`to_wire`)."""
    if isinstance(event, Failed):
        return BackendError(event.status, event.message, retry_after_s=event.retry_after_s)
    return event


def as_deltas(out: Any, n_tokens: int) -> list[TextDelta | MediaDelta]:
    """What a family's ``postprocess`` returned (text, a media delta, or a list of them) as deltas; the request's new
    token count rides on the first one (on an empty text delta when there is nothing else). TypeError for anything
    else."""
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
