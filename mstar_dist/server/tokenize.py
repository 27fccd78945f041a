"""``POST /tokenize`` and ``POST /detokenize``, as vLLM has them, through the served model's tokenizer
(``server/tokenizer.py``; a model without one is a 400). Native routes: errors are ``{"error": "<message>"}``."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from mstar_dist.server.backend import GenerationBackend
from mstar_dist.server.checks import ApiError, check_model, parse_body, served_context
from mstar_dist.server.openapi import body_doc
from mstar_dist.server.protocol import (
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, normalize_messages,
)
from mstar_dist.server.tokenizer import check_ids, encode, need_tokenizer


def add_tokenize_routes(app: FastAPI, backend: GenerationBackend) -> None:
    """Registers ``/tokenize`` and ``/detokenize`` on ``app`` (runs on the HTTP server's loop, like the app)."""

    @app.post("/tokenize", openapi_extra=body_doc(TokenizeRequest))
    async def tokenize(request: Request) -> JSONResponse:
        """``prompt`` (as written) or ``messages`` (through the chat template, as a chat completion encodes them) ->
        ``{count, max_model_len, tokens}``."""
        req = await parse_body(request, TokenizeRequest, served_context(backend))
        check_model(req.model, backend)
        tok = need_tokenizer(backend, "/tokenize")
        if req.messages is not None:
            if any(not isinstance(m.content, str) and any(p.type != "text" for p in m.content) for m in req.messages):
                raise ApiError(400, "/tokenize counts text only: leave image and audio parts out", "messages")
            ids = encode(tok, None, normalize_messages(req.messages), "messages")
        else:
            ids = encode(tok, req.prompt, None, "prompt")
        body = TokenizeResponse(count=len(ids), max_model_len=backend.max_context_tokens, tokens=ids)
        return JSONResponse(body.model_dump())

    @app.post("/detokenize", openapi_extra=body_doc(DetokenizeRequest))
    async def detokenize(request: Request) -> JSONResponse:
        """``tokens`` -> ``{prompt}``: their text, special tokens written out."""
        req = await parse_body(request, DetokenizeRequest, served_context(backend))
        check_model(req.model, backend)
        tok = need_tokenizer(backend, "/detokenize")
        text = tok.decode(check_ids(tok, req.tokens, "tokens"), skip_special_tokens=False)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())
