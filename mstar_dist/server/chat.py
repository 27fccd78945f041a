"""``POST /v1/chat/completions``: ``n`` choices, streamed as server-sent events or whole, with log-probabilities
when asked for, spoken too when the request asks for ``modalities: ["text", "audio"]`` (docs/architecture.md §9).

The common stream (one choice, no log-probabilities, no running usage) writes each token's event from bytes built
once per model and shape (``chunk_template``); the others build their events as dicts.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mstar_dist import trace
from mstar_dist.config.deployment import MediaConfig
from mstar_dist.server.backend import Finished, GenerationBackend, GenerationParams, MediaDelta, TextDelta
from mstar_dist.server.checks import (
    REQUEST_ID_HEADER, ApiError, check_modality, check_model, check_outputs, error_body, family_field,
    header_request_id, max_tokens, parse_body, served_context,
)
from mstar_dist.server.framing import SSE_DONE, SSE_MEDIA_TYPE, b64, json_bytes, sse
from mstar_dist.server.http_metrics import HttpStats
from mstar_dist.server.media_input import gather_media, media_limits
from mstar_dist.server.media_routes import DEFAULT_SAMPLE_RATE, AudioFormat, join_audio, wav_file
from mstar_dist.server.openapi import body_doc
from mstar_dist.server.protocol import (
    AssistantMessage, ChatAudio, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChunkChoice, ChunkDelta, ErrorResponse, Usage, normalize_messages,
)
from mstar_dist.server.relay import (
    ClosingStreamingResponse, Outcome, collect, events, finish_reasons, start_stream, until_disconnect,
)
from mstar_dist.server.tokenizer import chat_logprobs, encode, tokenizer_of


AUDIO_FIELDS = {"voice": "audio.voice"}
"""The family's knobs -> the chat fields they come from (its 400 about a voice names ``audio.voice``)."""


def add_chat_route(app: FastAPI, backend: GenerationBackend, stats: HttpStats, media: MediaConfig) -> None:
    """Registers ``/v1/chat/completions`` on ``app`` (runs on the HTTP server's loop, like the app)."""

    @app.post("/v1/chat/completions", openapi_extra=body_doc(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        arrived = time.monotonic() if trace.ON else 0.0
        check_modality(backend, "text")
        req = await parse_body(request, ChatCompletionRequest, served_context(backend))
        check_model(req.model, backend)
        request_id = header_request_id(request) or uuid.uuid4().hex
        params = await chat_params(req, request_id, backend, media)
        reply = ChatReply(f"chatcmpl-{request_id}", int(time.time()), backend.model_name, req.n, req.logprobs)
        audio_id = f"audio-{request_id}" if req.wants_audio() else None
        headers = {REQUEST_ID_HEADER: request_id}
        if trace.ON:
            trace.event_at(arrived, "http_arrived", request_id, route="/v1/chat/completions")
            trace.event("http_prepared", request_id)
        if req.stream:
            try:
                stream, first = await start_stream(request, backend, params, stats)
            except ApiError as exc:
                raise family_field(exc, AUDIO_FIELDS) from None
            options = req.stream_options
            usage = StreamUsage.of(options.include_usage if options else False,
                                   options.continuous_usage_stats if options else False, params)
            body = reply.sse(stream, first, usage=usage, audio_id=audio_id)
            return ClosingStreamingResponse(body, stats=stats, media_type=SSE_MEDIA_TYPE, headers=headers)
        try:
            outcome = await until_disconnect(request, collect(events(backend, params)), stats)
        except ApiError as exc:
            raise family_field(exc, AUDIO_FIELDS) from None
        audio = chat_audio(audio_id, req.audio_format(), outcome, request_id) if audio_id else None
        return JSONResponse(reply.body(outcome, audio), headers=headers)


async def chat_params(req: ChatCompletionRequest, request_id: str, backend: GenerationBackend,
                      media: MediaConfig) -> GenerationParams:
    """The chat request as the backend takes it: its media fetched and checked, the voice as the family's knob, the
    prompt encoded here when its length is needed before the answer (``continuous_usage_stats``)."""
    if req.wants_audio():
        check_outputs(backend, ["audio"], "modalities")
    items = await gather_media(req.messages, backend, media)
    voice = req.audio.voice if req.wants_audio() and req.audio is not None else None
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    messages = normalize_messages(req.messages)
    prompt_ids = None
    tok = tokenizer_of(backend)
    if req.stream and req.stream_options and req.stream_options.continuous_usage_stats and tok and not items:
        prompt_ids = encode(tok, None, messages, "messages")
    return GenerationParams(
        request_id=request_id, prompt=None, messages=messages,
        max_tokens=max_tokens(req.requested_max_tokens(), backend, param),
        max_tokens_given=req.requested_max_tokens() is not None, stream=req.stream,
        model_kwargs={"voice": voice} if voice is not None else {}, prompt_ids=prompt_ids,
        media=items, media_limits=media_limits(media) if items else None,
        output_modalities=req.output_modalities(), logprobs=req.logprobs_k(), n=req.n,
        **req.generation_fields(),
    )


@dataclass(frozen=True)
class StreamUsage:
    """What a stream says of its usage: a last chunk with it (``include_usage``), and on every chunk the usage so far
    (``continuous``, vLLM's ``continuous_usage_stats``; the prompt's length from the start when the server encoded
    it, else from the end)."""

    include: bool
    continuous: bool
    prompt_tokens: int

    @classmethod
    def of(cls, include: bool, continuous: bool, params: GenerationParams) -> StreamUsage:
        return cls(include, continuous, len(params.prompt_ids) if params.prompt_ids is not None else 0)

    @property
    def keyed(self) -> bool:
        """Whether chunks carry a ``usage`` key at all."""
        return self.include or self.continuous


@dataclass
class ChatReply:
    id: str
    created: int
    model: str
    n: int = 1
    logprobs: bool = False
    """Whether the request asked for log-probabilities (``choices[].logprobs``)."""

    def body(self, outcome: Outcome, audio: ChatAudio | None = None) -> dict[str, Any]:
        """The whole response; ``message.audio`` only when the request asked for audio."""
        f = outcome.finish
        reasons = finish_reasons(f, self.n)
        choices = []
        for i in range(self.n):
            choice = outcome.choice(i)
            message = AssistantMessage(content=choice.text, audio=audio if i == 0 else None)
            choices.append(ChatChoice(index=i, message=message, finish_reason=reasons[i]))
        body = ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=Usage.of(f.prompt_tokens, f.completion_tokens)).model_dump()
        for i, choice in enumerate(body["choices"]):
            if choice["message"]["audio"] is None:
                del choice["message"]["audio"]
            if self.logprobs:
                choice["logprobs"] = chat_logprobs(outcome.choice(i).logprobs)
        return body

    def chunk(self, choices: list[dict[str, Any]], usage: StreamUsage, completion_tokens: int | None = None,
              prompt_tokens: int | None = None) -> bytes:
        """One event: ``choices`` and, as ``usage`` says, the usage so far (``completion_tokens``) or null."""
        chunk: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                 "model": self.model, "choices": choices}
        if usage.keyed:
            tokens = prompt_tokens if prompt_tokens is not None else usage.prompt_tokens
            chunk["usage"] = Usage.of(tokens, completion_tokens).model_dump() if (
                usage.continuous and completion_tokens is not None) else None
        return sse(chunk)

    async def sse(self, stream, first, *, usage: StreamUsage, audio_id: str | None = None) -> AsyncIterator[bytes]:
        """``data: {chunk}`` events, then ``data: [DONE]`` (see :meth:`plain_sse` and :meth:`rich_sse`)."""
        if self.n == 1 and not self.logprobs and not usage.continuous:
            body = self.plain_sse(stream, first, include_usage=usage.include, audio_id=audio_id)
        else:
            body = self.rich_sse(stream, first, usage)
        async for out in body:
            yield out

    async def rich_sse(self, stream, first, usage: StreamUsage) -> AsyncIterator[bytes]:
        """Events of ``n`` choices, with log-probabilities and running usage as asked: each choice's role, then the
        content deltas as they come (each with its choice's index), then each choice's finish, [the usage]."""
        tokens = 0
        out = b"".join(self.chunk([_choice(i, {"role": "assistant", "content": ""})], usage, tokens)
                       for i in range(self.n))
        try:
            event = first
            while not isinstance(event, Finished):
                if isinstance(event, TextDelta):
                    tokens += event.n_tokens
                    logprobs = chat_logprobs(event.logprobs or []) if self.logprobs else None
                    out += self.chunk([_choice(event.index, {"content": event.text}, logprobs)], usage, tokens)
                    yield out
                    out = b""
                event = await stream.__anext__()
            prompt = event.prompt_tokens
            for i, reason in enumerate(finish_reasons(event, self.n)):
                out += self.chunk([_choice(i, {}, finish=reason)], usage, event.completion_tokens, prompt)
            if usage.include:
                final = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                         "model": self.model, "choices": [],
                         "usage": Usage.of(prompt, event.completion_tokens).model_dump()}
                out += sse(final)
        except ApiError as exc:
            out += sse(openai_error(exc).model_dump())
        finally:
            await stream.aclose()
        yield out + SSE_DONE

    def _event(self, delta: dict[str, Any], include_usage: bool) -> bytes:
        """One event whose delta is ``delta`` as given (the audio shapes, which ``ChunkDelta`` does not model)."""
        chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                    choices=[ChunkChoice(delta=ChunkDelta())], usage=None).model_dump(mode="json")
        chunk["choices"][0]["delta"] = delta
        if not include_usage:
            del chunk["usage"]
        return sse(chunk)

    def _spoken(self, event: TextDelta | MediaDelta, include_usage: bool, audio_id: str) -> bytes:
        """The event of one delta of a spoken answer: text as ``content`` and as the audio's ``transcript``, audio as
        ``audio.data`` (base64 PCM16, OpenAI's streamed audio); other media are left out."""
        if isinstance(event, TextDelta):
            return self._event({"content": event.text, "audio": {"id": audio_id, "transcript": event.text}},
                               include_usage)
        if event.modality == "audio":
            return self._event({"audio": {"id": audio_id, "data": b64(event.data)}}, include_usage)
        return b""

    def typed_chunk(self, choices: list[ChunkChoice], usage: Usage | None, include_usage: bool) -> bytes:
        chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                    usage=usage).model_dump(mode="json")
        if not include_usage:
            del chunk["usage"]
        return sse(chunk)

    def content_framing(self, include_usage: bool) -> tuple[bytes, bytes]:
        """The bytes around a content delta's JSON string in its event: what ``typed_chunk`` writes for
        ``[ChunkChoice(delta=ChunkDelta(content=text))]``, cut at the text (built once per response, so a token's
        event costs one string encoding, not two pydantic models and a dump)."""
        head, tail = chunk_template(self.model, include_usage, "content")
        return self.fill(head), tail

    def fill(self, template: bytes) -> bytes:
        """A ``chunk_template`` with this response's id and creation time."""
        return template.replace(_TEMPLATE_ID, json_bytes(self.id), 1).replace(
            _TEMPLATE_CREATED, b'"created":%d' % self.created, 1)

    async def plain_sse(self, stream, first, *, include_usage: bool,
                        audio_id: str | None = None) -> AsyncIterator[bytes]:
        """One choice's events: role, content deltas, finish_reason, [usage], then ``data: [DONE]``.
        Media deltas are left out, unless ``audio_id`` is set (the request asked for audio): then text deltas carry
        ``audio.transcript`` too, audio deltas come as ``audio.data`` and one last ``audio.expires_at`` precedes the
        finish."""
        # events that are ready together leave in one body chunk, one socket write (an intake takes a burst's
        # requests one after another, so each write it saves shortens the queue: docs/architecture.md §2): the role
        # with the first content delta, and the finish with the usage and [DONE]
        out = self.fill(chunk_template(self.model, include_usage, "role"))
        try:
            head, tail = self.content_framing(include_usage)
            event = first
            while not isinstance(event, Finished):
                if audio_id is not None:
                    out += self._spoken(event, include_usage, audio_id)
                elif isinstance(event, TextDelta):
                    out += head + json_bytes(event.text) + tail
                if out:
                    yield out
                    out = b""
                event = await stream.__anext__()
            if audio_id is not None:
                out += self._event({"audio": {"id": audio_id, "expires_at": int(time.time())}}, include_usage)
            out += self.fill(chunk_template(self.model, include_usage, "finish", event.finish_reason))
            if include_usage:
                out += self.typed_chunk([], Usage.of(event.prompt_tokens, event.completion_tokens), True)
        except ApiError as exc:
            out += sse(openai_error(exc).model_dump())
        finally:
            await stream.aclose()
        yield out + SSE_DONE


def _choice(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
            finish: str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def chat_audio(audio_id: str, fmt: str, outcome: Outcome, request_id: str) -> ChatAudio:
    """``message.audio``: all audio deltas as one WAV file or raw PCM16, the answer's text as its transcript."""
    pcm, audio_format = join_audio(outcome.media, request_id)
    audio_format = audio_format or AudioFormat(DEFAULT_SAMPLE_RATE, 1)
    data = wav_file(pcm, audio_format, request_id) if fmt == "wav" else pcm
    return ChatAudio(id=audio_id, data=b64(data), transcript=outcome.text, expires_at=int(time.time()))


def openai_error(exc: ApiError) -> ErrorResponse:
    return ErrorResponse.model_validate(error_body("/v1/", exc))


_TEMPLATE_MARK = "\x00mstar-template\x00"
_TEMPLATE_ID = json_bytes(_TEMPLATE_MARK)
_TEMPLATE_CREATED = b'"created":4611686018427387904'  # 2 ** 62: no real time, and anchored on its key


@functools.lru_cache(maxsize=64)
def chunk_template(model: str, include_usage: bool, kind: str, finish_reason: str | None = None):
    """The bytes of a streamed chat completion's fixed events with a placeholder id and creation time
    (``ChatReply.fill`` puts a response's own in): the role event (``kind="role"``), the finish event
    (``"finish"``, with ``finish_reason``), and the (head, tail) around a content delta's text (``"content"``, the
    tail needs no filling). Built by the same pydantic models and dump as any other event, once per model and shape,
    instead of three such builds per streamed request on its intake."""
    reply = ChatReply(_TEMPLATE_MARK, 2 ** 62, model)
    if kind == "role":
        return reply.typed_chunk([ChunkChoice(delta=ChunkDelta(role="assistant", content=""))], None, include_usage)
    if kind == "finish":
        return reply.typed_chunk([ChunkChoice(delta=ChunkDelta(), finish_reason=finish_reason)], None, include_usage)
    marker = "\x00"
    whole = reply.typed_chunk([ChunkChoice(delta=ChunkDelta(content=marker))], None, include_usage)
    head, tail = whole.split(b'"content":' + json_bytes(marker), 1)
    return head + b'"content":', tail
