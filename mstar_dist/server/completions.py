"""``POST /v1/completions``: OpenAI's legacy completions as vLLM serves them (docs/architecture.md §9). Each prompt is
one backend request with ``n`` choices, run on the prompt as written (no chat template: the family's ``preprocess``
gets ``prompt``, or for token ids ``prompt_ids``); choice ``i * n + j`` is choice ``j`` of prompt ``i``. Streamed as
server-sent events of ``text_completion`` chunks (every prompt's choices interleaved as they come), or whole."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mstar_dist.server.backend import Finished, GenerationBackend, GenerationParams, TextDelta
from mstar_dist.server.chat import StreamUsage, openai_error
from mstar_dist.server.checks import (
    REQUEST_ID_HEADER, ApiError, check_modality, check_model, header_request_id, max_tokens, parse_body, served_context,
)
from mstar_dist.server.framing import SSE_DONE, SSE_MEDIA_TYPE, sse
from mstar_dist.server.http_metrics import HttpStats
from mstar_dist.server.openapi import body_doc
from mstar_dist.server.protocol import DEFAULT_MAX_TOKENS, CompletionRequest, Usage
from mstar_dist.server.relay import (
    ClosingStreamingResponse, Outcome, collect, events, finish_reasons, first_events, merged, run_all,
    until_disconnect,
)
from mstar_dist.server.tokenizer import (
    PromptTokenizer, check_ids, completion_logprobs, encode, first_token_text, need_tokenizer, tokenizer_of,
)


@dataclass
class Prompt:
    """One prompt of a request: its text (what ``echo`` repeats) and its token ids when the server knows them."""

    text: str
    ids: list[int] | None


def add_completions_route(app: FastAPI, backend: GenerationBackend, stats: HttpStats) -> None:
    """Registers ``/v1/completions`` on ``app`` (runs on the HTTP server's loop, like the app)."""

    @app.post("/v1/completions", openapi_extra=body_doc(CompletionRequest))
    async def completions(request: Request) -> Response:
        check_modality(backend, "text")
        req = await parse_body(request, CompletionRequest, served_context(backend))
        check_model(req.model, backend)
        request_id = header_request_id(request) or uuid.uuid4().hex
        prompts = read_prompts(req, backend)
        batch = [completion_params(req, prompt, request_id if len(prompts) == 1 else f"{request_id}-{i}", backend)
                 for i, prompt in enumerate(prompts)]
        reply = CompletionReply(f"cmpl-{request_id}", int(time.time()), backend.model_name, req.n, req.echo,
                                req.logprobs is not None, prompts, tokenizer_of(backend))
        headers = {REQUEST_ID_HEADER: request_id}
        if req.stream:
            streams = [events(backend, params) for params in batch]
            try:
                firsts = await first_events(request, streams, stats)
            except BaseException:
                for stream in streams:
                    await stream.aclose()
                raise
            options = req.stream_options
            usage = StreamUsage(options.include_usage if options else False,
                                options.continuous_usage_stats if options else False, 0)
            body = reply.sse(merged(streams, firsts), usage)
            return ClosingStreamingResponse(body, stats=stats, media_type=SSE_MEDIA_TYPE, headers=headers)
        work = run_all([collect(events(backend, params)) for params in batch])
        outcomes = await until_disconnect(request, work, stats)
        return JSONResponse(reply.body(outcomes), headers=headers)


def read_prompts(req: CompletionRequest, backend: GenerationBackend) -> list[Prompt]:
    """The request's prompts: token ids checked against the model's vocabulary (and written out as text, for echo);
    text encoded here when its ids are needed before the answer (echo with logprobs, running usage)."""
    tok = tokenizer_of(backend)
    wants_ids = (req.echo and req.logprobs is not None) or bool(
        req.stream and req.stream_options and req.stream_options.continuous_usage_stats)
    prompts, given = [], req.prompts()
    for i, prompt in enumerate(given):
        where = "prompt" if len(given) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            ids = encode(tok, prompt, None, where) if tok is not None and wants_ids else None
            prompts.append(Prompt(prompt, ids))
            continue
        tok = need_tokenizer(backend, "a prompt of token ids", where)
        ids = check_ids(tok, prompt, where)
        prompts.append(Prompt(_text(tok, ids), ids))
    return prompts


def _text(tok: PromptTokenizer, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False)


def completion_params(req: CompletionRequest, prompt: Prompt, request_id: str,
                      backend: GenerationBackend) -> GenerationParams:
    """One prompt's request: the prompt as written (ids when known), ``n`` choices, the prompt's log-probabilities
    when ``echo`` asks for them with ``logprobs``; without ``max_tokens``, OpenAI's 16 (or the server's limit when
    lower), which the family may lower to what the context leaves."""
    budget = max_tokens(req.max_tokens, backend, "max_tokens") if req.max_tokens is not None else \
        min(DEFAULT_MAX_TOKENS, backend.max_tokens_limit)
    return GenerationParams(
        request_id=request_id, prompt=prompt.text, messages=None, prompt_ids=prompt.ids,
        max_tokens=budget, max_tokens_given=req.max_tokens is not None, stream=req.stream,
        logprobs=req.logprobs, prompt_logprobs=req.logprobs if req.echo else None, n=req.n,
        **req.generation_fields(),
    )


@dataclass
class ChoiceState:
    """What a streamed choice has sent so far."""

    started: bool = False
    offset: int = 0
    """Characters of the choice's text sent so far (``logprobs.text_offset``)."""


@dataclass
class CompletionReply:
    id: str
    created: int
    model: str
    n: int
    echo: bool
    logprobs: bool
    """Whether the request asked for log-probabilities (``choices[].logprobs``)."""
    prompts: list[Prompt]
    tok: PromptTokenizer | None
    """The model's tokenizer (the text of an echoed prompt's first token), if it has one."""
    states: dict[int, ChoiceState] = field(default_factory=dict)

    def body(self, outcomes: list[Outcome]) -> dict[str, Any]:
        """The whole response: ``n`` choices per prompt, in order, and the usage of them all."""
        choices = []
        for i, outcome in enumerate(outcomes):
            for j, reason in enumerate(finish_reasons(outcome.finish, self.n)):
                choice = outcome.choice(j)
                text, logprobs = self.piece(i, j, choice.text, choice.logprobs, choice.prompt_logprobs)
                choices.append({"index": i * self.n + j, "text": text, "logprobs": logprobs, "finish_reason": reason})
        prompt = sum(o.finish.prompt_tokens for o in outcomes)
        completion = sum(o.finish.completion_tokens for o in outcomes)
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": Usage.of(prompt, completion).model_dump()}

    def piece(self, i: int, j: int, text: str, logprobs, prompt_logprobs) -> tuple[str, dict[str, Any] | None]:
        """The text and ``logprobs`` of choice ``j`` of prompt ``i`` to send now: the echoed prompt first on the
        choice's first piece."""
        state = self.states.setdefault(i * self.n + j, ChoiceState())
        entries: list = list(logprobs or ())
        prompt, first = self.prompts[i], ""
        if self.echo and not state.started:
            text = prompt.text + text
            entries = [*(prompt_logprobs or ()), *entries]
            if self.logprobs and prompt_logprobs and prompt_logprobs[0] is None:
                first = first_token_text(prompt.text, prompt.ids, self.tok, prompt_logprobs)
        state.started = True
        if not self.logprobs:
            return text, None
        out, state.offset = completion_logprobs(entries, first, state.offset)
        return text, out

    def chunk(self, choices: list[dict[str, Any]], usage: StreamUsage, running: Usage | None) -> bytes:
        body: dict[str, Any] = {"id": self.id, "object": "text_completion", "created": self.created,
                                "model": self.model, "choices": choices}
        if usage.keyed:
            body["usage"] = running.model_dump() if usage.continuous and running is not None else None
        return sse(body)

    async def sse(self, stream: AsyncIterator[tuple[int, Any]], usage: StreamUsage) -> AsyncIterator[bytes]:
        """Each prompt's choices' pieces as they come, each choice's finish when its prompt ends, [the usage], then
        ``data: [DONE]``; a failure is an error event."""
        prompt_tokens = [len(p.ids) if p.ids is not None else 0 for p in self.prompts]
        completion_tokens = [0] * len(self.prompts)
        out = b""
        try:
            async for i, event in stream:
                if isinstance(event, TextDelta):
                    completion_tokens[i] += event.n_tokens
                    text, logprobs = self.piece(i, event.index, event.text, event.logprobs, event.prompt_logprobs)
                    choice = {"index": i * self.n + event.index, "text": text, "logprobs": logprobs,
                              "finish_reason": None}
                    yield self.chunk([choice], usage, Usage.of(sum(prompt_tokens), sum(completion_tokens)))
                elif isinstance(event, Finished):
                    prompt_tokens[i], completion_tokens[i] = event.prompt_tokens, event.completion_tokens
                    running = Usage.of(sum(prompt_tokens), sum(completion_tokens))
                    yield self.finishes(i, event, usage, running)
            if usage.include:
                out += sse({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                            "choices": [], "usage": Usage.of(sum(prompt_tokens), sum(completion_tokens)).model_dump()})
        except ApiError as exc:
            out += sse(openai_error(exc).model_dump())
        finally:
            await stream.aclose()
        yield out + SSE_DONE

    def finishes(self, i: int, event: Finished, usage: StreamUsage, running: Usage) -> bytes:
        """The last chunk of each choice of prompt ``i`` (with the echo of a choice that produced nothing)."""
        out = b""
        for j, reason in enumerate(finish_reasons(event, self.n)):
            started = self.states.get(i * self.n + j, ChoiceState()).started
            text, logprobs = self.piece(i, j, "", [], None) if self.echo and not started else ("", None)
            choice = {"index": i * self.n + j, "text": text, "logprobs": logprobs, "finish_reason": reason}
            out += self.chunk([choice], usage, running)
        return out
