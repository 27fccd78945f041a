"""The native ``POST /generate``: any modality, streamed as NDJSON lines or whole; a JSON body, or for a model that
takes media a ``multipart/form-data`` body (the JSON in its ``request`` field, files in ``image`` / ``audio`` fields,
added to the last user message in the order sent: ``media_input.read_multipart``). The line format is
``protocol.native``'s docstring: text as UTF-8 strings, media as base64, ``metadata.encoding`` saying which."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mstar_dist import trace
from mstar_dist.config.deployment import MediaConfig
from mstar_dist.server.backend import Finished, GenerationBackend, GenerationParams, MediaDelta, TextDelta
from mstar_dist.server.checks import (
    REQUEST_ID_HEADER, ApiError, check_model, check_outputs, header_request_id, max_tokens, parse_body, parse_json,
    served_context,
)
from mstar_dist.server.framing import NDJSON_MEDIA_TYPE, b64, json_bytes, ndjson_line
from mstar_dist.server.http_metrics import HttpStats
from mstar_dist.server.media_input import gather_media, media_limits, read_multipart
from mstar_dist.server.media_routes import join_audio
from mstar_dist.server.openapi import body_doc, multipart_doc
from mstar_dist.server.protocol import (
    MEDIA_ENCODING, TEXT_ENCODING, GenerateOutput, GenerateRequest, GenerateResponse, StreamLine, Usage,
    normalize_messages,
)
from mstar_dist.server.relay import ClosingStreamingResponse, Outcome, collect, events, start_stream, until_disconnect


def add_generate_route(app: FastAPI, backend: GenerationBackend, stats: HttpStats, media: MediaConfig,
                       max_body_bytes: int) -> None:
    """Registers ``/generate`` on ``app`` (runs on the HTTP server's loop, like the app)."""

    @app.post("/generate", openapi_extra=body_doc(GenerateRequest, multipart_doc(backend)))
    async def generate(request: Request) -> Response:
        arrived = time.monotonic() if trace.ON else 0.0
        uploads = []
        if request.headers.get("content-type", "").split(";")[0].strip().lower() == "multipart/form-data":
            text, uploads = await read_multipart(request, media, max_body_bytes)
            req = parse_json(text, GenerateRequest, "the 'request' field", context=served_context(backend))
        else:
            req = await parse_body(request, GenerateRequest, served_context(backend))
        check_model(req.model, backend)
        check_outputs(backend, req.modalities, "modalities")
        kw = req.model_kwargs
        request_id = req.request_id or header_request_id(request) or uuid.uuid4().hex
        items = await gather_media(req.messages, backend, media, uploads)
        params = GenerationParams(
            request_id=request_id,
            prompt=req.prompt,
            messages=normalize_messages(req.messages) if req.messages is not None else None,
            max_tokens=max_tokens(kw.max_tokens, backend, "model_kwargs.max_tokens"),
            max_tokens_given=kw.max_tokens is not None,
            stream=req.stream,
            model_kwargs=kw.family_knobs(),
            media=items,
            media_limits=media_limits(media) if items else None,
            output_modalities=req.modalities,
            **kw.generation_fields(),
        )
        headers = {REQUEST_ID_HEADER: request_id}
        if trace.ON:
            trace.event_at(arrived, "http_arrived", request_id, route="/generate")
            trace.event("http_prepared", request_id)
        if req.stream:
            stream, first = await start_stream(request, backend, params, stats)
            body = ndjson_body(stream, first, request_id)
            return ClosingStreamingResponse(body, stats=stats, media_type=NDJSON_MEDIA_TYPE, headers=headers)
        outcome = await until_disconnect(request, collect(events(backend, params)), stats)
        response = generate_response(request_id, outcome, text_model=backend.output_modality == "text")
        return JSONResponse(response.model_dump(), headers=headers)


async def ndjson_body(stream, first, request_id: str) -> AsyncIterator[bytes]:
    """NDJSON lines (see ``protocol.native``): one per delta, then one final or error line."""
    try:
        text_head = b'{"modality":"text","data":'
        text_meta = b',"metadata":{"encoding":"utf-8","request_id":' + json_bytes(request_id) + b',"n_tokens":'
        event = first
        while not isinstance(event, Finished):
            if isinstance(event, TextDelta):  # the per-token line, written directly (what delta_line gives)
                yield b"".join((text_head, json_bytes(event.text), text_meta, str(event.n_tokens).encode("ascii"),
                                b"}}\n"))
            else:
                yield ndjson_line(delta_line(event, request_id))
            event = await stream.__anext__()
        usage = Usage.of(event.prompt_tokens, event.completion_tokens).model_dump()
        meta = {"request_id": request_id, "finish_reason": event.finish_reason, "usage": usage}
        yield ndjson_line(StreamLine(modality="text", metadata=meta))
    except ApiError as exc:
        meta = {"request_id": request_id, "status": exc.status, "message": exc.message}
        yield ndjson_line(StreamLine(modality="error", metadata=meta))
    finally:
        await stream.aclose()


def delta_line(event: TextDelta | MediaDelta, request_id: str) -> StreamLine:
    meta = {"request_id": request_id, "n_tokens": event.n_tokens}
    if isinstance(event, TextDelta):
        return StreamLine(modality="text", data=event.text, metadata={"encoding": TEXT_ENCODING, **meta})
    return StreamLine(modality=event.modality, data=b64(event.data),
                      metadata={"encoding": MEDIA_ENCODING, **event.metadata, **meta})


def generate_response(request_id: str, outcome: Outcome, *, text_model: bool) -> GenerateResponse:
    """``outputs``: the text (always for a text model, else when there is any), then all audio as one entry,
    then one entry per image."""
    f = outcome.finish
    outputs = []
    if text_model or outcome.text:
        text_meta = {"encoding": TEXT_ENCODING, "mime_type": "text/plain; charset=utf-8",
                     "n_tokens": f.completion_tokens}
        outputs.append(GenerateOutput(modality="text", data=outcome.text, metadata=text_meta))
    outputs += media_outputs(outcome.media)
    return GenerateResponse(request_id=request_id, text=outcome.text, finish_reason=f.finish_reason,
                            usage=Usage.of(f.prompt_tokens, f.completion_tokens), outputs=outputs)


def media_outputs(media: list[MediaDelta]) -> list[GenerateOutput]:
    outputs = []
    pcm, fmt = join_audio(media)
    if fmt is not None:
        n_tokens = sum(m.n_tokens for m in media if m.modality == "audio")
        meta = {"encoding": MEDIA_ENCODING, "mime_type": "audio/pcm", "sample_rate": fmt.sample_rate,
                "num_channels": fmt.num_channels, "n_tokens": n_tokens}
        outputs.append(GenerateOutput(modality="audio", data=b64(pcm), metadata=meta))
    for image in (m for m in media if m.modality == "image"):
        meta = {"encoding": MEDIA_ENCODING, **image.metadata, "mime_type": "image/png", "n_tokens": image.n_tokens}
        outputs.append(GenerateOutput(modality="image", data=b64(image.data), metadata=meta))
    return outputs
