"""``POST /v1/chat/completions``: the request, and the response and stream shapes exactly as OpenAI's (the
``openai`` package's ``ChatCompletion`` / ``ChatCompletionChunk``).

Fields beyond OpenAI's are vLLM's extra parameters (:class:`ExtraSampling`). Fields OpenAI clients send that change
nothing here are accepted and ignored (:data:`OPENAI_CHAT_IGNORED`); features of OpenAI or vLLM that are not
implemented are a 400 when asked for (:data:`CHAT_UNSUPPORTED`); any other key is a 400 naming it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from mstar_dist.server.protocol.base import Body, Unsupported, Usage, key_error
from mstar_dist.server.protocol.messages import ChatMessage
from mstar_dist.server.protocol.sampling import LOGPROBS_MAX, N_MAX, SAMPLING_UNSUPPORTED, ExtraSampling

OPENAI_CHAT_IGNORED = frozenset({
    "function_call", "functions", "metadata", "parallel_tool_calls", "prediction", "prompt_cache_key",
    "reasoning_effort", "safety_identifier", "service_tier", "store", "tool_choice", "tools", "user", "verbosity",
    "guided_decoding_backend",
})
"""Chat completion fields this server accepts and ignores: bookkeeping that changes no output (``metadata``,
``store``, ``user``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier``, ``prediction``, a latency hint),
hints its chat templates do not take (``reasoning_effort``, ``verbosity``), vLLM's choice of grammar engine
(``guided_decoding_backend``: there is one), and, until tool calling is implemented, ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``functions`` and ``function_call`` (the model answers in text)."""

VLLM_UNSUPPORTED = {
    "use_beam_search": Unsupported("beam search is not implemented", False),
    "length_penalty": Unsupported("it applies to beam search, which is not implemented", 1, 1.0),
    "best_of": Unsupported("ask for n choices instead", 1),
    "prompt_logprobs": Unsupported("use POST /v1/completions with echo and logprobs for the prompt's"),
    "allowed_token_ids": Unsupported("use guided_choice or guided_regex to constrain the answer"),
    "bad_words": Unsupported("use guided_regex to constrain the answer", []),
    "truncate_prompt_tokens": Unsupported("prompts are never truncated: shorten the prompt"),
    "return_tokens_as_token_ids": Unsupported("token strings are the tokens' text", False),
    "priority": Unsupported("requests are served in arrival order", 0),
    "guided_whitespace_pattern": Unsupported("the grammar engine's default whitespace is used"),
}
"""vLLM's extra parameters this server does not implement (accepted only with their "off" value)."""

CHAT_UNSUPPORTED = {
    **SAMPLING_UNSUPPORTED, **VLLM_UNSUPPORTED,
    "web_search_options": Unsupported("this server does not search the web"),
    "echo": Unsupported("chat answers never repeat the prompt; use POST /v1/completions", False),
    "add_generation_prompt": Unsupported("the chat template always ends with the assistant's turn", True),
    "continue_final_message": Unsupported("the answer is always a new assistant turn", False),
    "add_special_tokens": Unsupported("the chat template writes the special tokens", False),
    "chat_template": Unsupported("the model's own chat template is used"),
    "chat_template_kwargs": Unsupported("the model's own chat template is used", {}),
    "documents": Unsupported("the chat template takes no documents; put them in a message"),
}


class StreamOptions(Body):
    include_usage: bool = False
    """A last chunk with empty ``choices`` carries the request's usage (every other chunk has ``usage: null``)."""
    continuous_usage_stats: bool = False
    """vLLM's: every chunk carries the usage so far."""


CHAT_AUDIO_FORMATS = ("wav", "pcm16")
"""``audio.format`` of a chat completion: a whole WAV file, or raw little-endian PCM16 (the only one streamed)."""


class AudioOutput(Body):
    """Chat ``audio``: how to speak the answer when ``modalities`` holds "audio". ``voice`` is the family's (a 400
    lists its voices; left out, its default voice); ``format`` defaults to "wav", or "pcm16" when streaming."""

    voice: str | None = None
    format: Literal["wav", "pcm16"] | None = None


class ChatCompletionRequest(ExtraSampling):
    """Unknown fields are rejected (a 400 naming them), except OpenAI's own in :data:`OPENAI_CHAT_IGNORED`.

    ``n`` choices (1 to ``N_MAX``) share the prompt. ``logprobs: true`` returns each generated token's
    log-probability (``choices[].logprobs.content``), with ``top_logprobs`` (0 to ``LOGPROBS_MAX``) alternatives.
    ``modalities``: ["text"] (the default) or ["text", "audio"]; with "audio" the answer is also spoken (``audio``
    says how) and comes back as ``message.audio`` (``id``, base64 ``data``, ``transcript``, ``expires_at``) or,
    streamed, as ``delta.audio`` chunks of base64 PCM16 beside the text deltas."""

    IGNORED = OPENAI_CHAT_IGNORED
    UNSUPPORTED = CHAT_UNSUPPORTED

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    n: int = Field(1, ge=1, le=N_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=LOGPROBS_MAX)
    modalities: list[Literal["text", "audio"]] | None = Field(None, min_length=1)
    audio: AudioOutput | None = None

    @field_validator("modalities")
    @classmethod
    def _check_modalities(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (len(set(value)) != len(value) or "text" not in value):
            raise ValueError(f'{value!r} is not supported: use ["text"] or ["text", "audio"]')
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> ChatCompletionRequest:
        if self.stream and self.wants_audio() and self.audio is not None and self.audio.format == "wav":
            raise key_error("audio.format", 'audio.format "wav" cannot be streamed: use "pcm16" with "stream": true')
        if self.top_logprobs is not None and not self.logprobs:
            raise key_error("top_logprobs", 'top_logprobs needs "logprobs": true')
        if self.wants_audio() and (self.n > 1 or self.logprobs):
            raise key_error("n" if self.n > 1 else "logprobs",
                            "a spoken answer comes as one choice without logprobs: leave n and logprobs out")
        return self

    def wants_audio(self) -> bool:
        return self.modalities is not None and "audio" in self.modalities

    def output_modalities(self) -> list[str]:
        return ["text", "audio"] if self.wants_audio() else ["text"]

    def audio_format(self) -> str:
        """The format spoken audio comes back in (see :class:`AudioOutput`)."""
        if self.audio is not None and self.audio.format is not None:
            return self.audio.format
        return "pcm16" if self.stream else "wav"

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens`` (OpenAI's rule)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        """``GenerationParams.logprobs``: None, or how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobEntry(BaseModel):
    """``choices[].logprobs.content[]``: one generated token."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None
    refusal: None = None


class ChatAudio(BaseModel):
    """``message.audio`` of a chat completion asked for with ``modalities: ["text", "audio"]``."""

    id: str
    data: str
    """base64 of a whole WAV file, or of raw little-endian PCM16 (``audio.format``)."""
    transcript: str
    """What the audio says: the answer's text."""
    expires_at: int
    """Unix time after which the server no longer holds this audio: now (it keeps none, so a later turn must send
    the transcript as the assistant's content)."""


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    audio: ChatAudio | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    """One SSE event. With ``stream_options.include_usage`` every chunk carries ``usage: null`` and one last
    chunk with empty ``choices`` carries the usage; with ``continuous_usage_stats`` every chunk carries the usage so
    far."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mstar_dist"
    max_model_len: int
    weights: str = "checkpoint"
    """What the weights are: "random-test" for a random checkpoint made by scripts/ (its output is noise by design),
    "checkpoint" otherwise."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
