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
from typing import Any, Callable, Union

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
"""The kinds of structured output a request may ask for (``GuidedSpec.kind``)."""


class GuidedSpec(msgspec.Struct, frozen=True):
    """What a structured output must match (docs/architecture.md §8, "Structured outputs")."""

    kind: str
    """One of ``GUIDED_KINDS``."""
    spec: str = ""
    """json_schema: the schema as JSON text; json_object: unused (any JSON object); regex: the pattern; choice: a
    JSON list of the allowed strings; grammar: a Lark grammar (llguidance's dialect)."""

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise ValueError(f"guided.kind must be one of {', '.join(GUIDED_KINDS)}, got {self.kind!r}")


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
    a request that needs the ids up front), or sent by the client as ids (``/v1/completions`` with a token-id prompt,
    checked against the vocabulary; ``prompt`` then holds their text). None: the conductor's ``preprocess``
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
    ignore_eos: bool = False
    """Generation does not end at the model's EOS tokens (only at ``stop_token_ids``, stop strings and length)."""
    min_tokens: int = 0
    """The first ``min_tokens`` generated tokens cannot be an EOS or stop token (the engine masks them), and stop
    strings are not looked for before that many tokens."""
    min_p: float = 0.0
    """Sampled tokens keep only candidates whose probability is at least ``min_p`` x the most likely one's; 0: off."""
    repetition_penalty: float = 1.0
    """vLLM's / HF's: the logits of tokens seen in the prompt or the output so far are divided by it when positive,
    multiplied by it when negative; 1: off."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted once from the logit of every token the output contains so far."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once per time the output contains it so far."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (finish reason "stop") beside the model's EOS tokens."""
    include_stop_str_in_output: bool = False
    """The stop string (or stop token's text) that ended generation is part of the text."""
    skip_special_tokens: bool = True
    """Special tokens are left out of the text."""
    spaces_between_special_tokens: bool = True
    """vLLM's: with ``skip_special_tokens`` off, whether added tokens following each other are joined as the
    tokenizer decodes them (True) or by their raw text."""
    logprobs: int | None = None
    """Return the log-probability of every generated token and of the ``logprobs`` most likely alternatives at its
    place (``TextDelta.logprobs``); 0: the chosen token's only; None: none."""
    prompt_logprobs: int | None = None
    """Return the log-probability of every prompt token after the first, and of ``prompt_logprobs`` alternatives
    (``TextDelta.prompt_logprobs``, on the first delta of each choice); None: none."""
    n: int = 1
    """Independent samples of the same prompt (seeds ``seed + i``); their events carry ``index`` i."""
    guided: GuidedSpec | None = None
    """Structured output: every generated text is a sentence of this grammar (the engine masks other tokens)."""
    sampling_given: tuple[str, ...] | None = None
    """The sampling knobs the client wrote, whatever their values (names as above): a knob it left out takes the
    model family's default where the family has one (``RequestState.sampling_defaults``, e.g. a speech model's
    temperature). None (a caller that does not say): a knob at its neutral value takes the family's default."""


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One token's log-probability as the model computed it: the log-softmax of the logits the model gave at that
    place, before temperature, penalties or a grammar (vLLM's default, "raw" logprobs)."""

    token_id: int
    token: str
    """The token's text alone (its bytes decoded, U+FFFD for an incomplete character; a special token's content)."""
    token_bytes: bytes
    """The token's exact bytes (OpenAI's ``bytes``, as a list of ints there)."""
    logprob: float
    top: list[TokenLogprob] = []
    """The most likely tokens at that place, most likely first (``logprobs`` / ``prompt_logprobs`` of them; their
    own ``top`` is empty)."""


class TextDelta(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """New text since the previous delta (whole characters: the backend holds back partial UTF-8 bytes)."""

    text: str
    n_tokens: int
    """Tokens this delta accounts for (may be > 0 with empty text while a multi-byte character is pending)."""
    index: int = 0
    """The choice this delta belongs to (``GenerationParams.n`` > 1), 0 otherwise."""
    logprobs: list[TokenLogprob] | None = None
    """With ``GenerationParams.logprobs``: one entry per generated token of this delta, in order."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """With ``GenerationParams.prompt_logprobs``, on the first delta of each choice: one entry per prompt token,
    None for the first (nothing precedes it)."""


class ChoiceEnd(msgspec.Struct, frozen=True, array_like=True):
    """How one choice of a request with ``n`` > 1 ended."""

    index: int
    finish_reason: str
    completion_tokens: int


class Finished(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """The last item of every complete generation (one per request, whatever its ``n``)."""

    finish_reason: str
    """One of ``FINISH_REASONS``: "stop" (EOS or stop string), "length" (max_tokens or context), "abort"; with
    ``n`` > 1, choice 0's."""
    prompt_tokens: int
    """The prompt, counted once whatever the number of choices."""
    completion_tokens: int
    """Every choice's generated tokens together."""
    choices: list[ChoiceEnd] = []
    """With ``n`` > 1: each choice's end, by index; empty otherwise."""


class MediaDelta(msgspec.Struct, frozen=True, tag=True, omit_defaults=True):
    """A piece of non-text output as it is produced: ``modality`` "audio" (``data`` is little-endian PCM16,
    ``metadata`` has ``sample_rate`` and ``num_channels``) or "image" (``data`` is a PNG file, ``metadata`` has
    ``width`` and ``height``). ``n_tokens`` counts the generated tokens this piece accounts for."""

    modality: str
    data: bytes
    metadata: dict[str, Any] = {}
    n_tokens: int = 0
    index: int = 0
    """The choice this piece belongs to (``GenerationParams.n`` > 1), 0 otherwise."""


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
    deltas[0] = msgspec.structs.replace(first, n_tokens=first.n_tokens + n_tokens)
    return deltas


def joined(first: TextDelta, after: TextDelta) -> TextDelta | None:
    """One delta standing for ``first`` then ``after`` (text, tokens and logprobs in order), or None when they do not
    join: another choice, or ``after`` opens a choice (it carries the prompt's logprobs)."""
    if after.index != first.index or after.prompt_logprobs is not None:
        return None
    logprobs = first.logprobs if after.logprobs is None else \
        after.logprobs if first.logprobs is None else first.logprobs + after.logprobs
    return TextDelta(first.text + after.text, first.n_tokens + after.n_tokens, first.index, logprobs,
                     first.prompt_logprobs)


def token_logprob(table: list[list[float]], piece: Callable[[int], tuple[str, bytes]]) -> TokenLogprob:
    """One token's entry from its logprob table as the engine sends it (rows of (token id, logprob): the token, then
    the most likely tokens at its place), each token's text and bytes from ``piece(token id)`` (the family's
    tokenizer)."""
    (chosen, logprob), *top = table
    return TokenLogprob(int(chosen), *piece(int(chosen)), logprob,
                        [TokenLogprob(int(t), *piece(int(t)), lp) for t, lp in top])
