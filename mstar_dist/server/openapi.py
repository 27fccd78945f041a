"""The app's OpenAPI document (``GET /openapi.json``), describing every request body.

The routes parse their bodies themselves (``checks.parse_body``: our error format, strict types), so FastAPI
knows nothing of them; each POST route declares its body here with ``openapi_extra=body_doc(Model)`` and
:func:`install_openapi` adds the pydantic models' JSON schemas to ``components.schemas``. The document also says
what this deployment accepts beyond the models' types: the served model's name, ``max_tokens`` up to the
server's limit, exactly one of ``prompt`` / ``messages``, non-empty stop strings, the keys accepted and ignored and
those accepted only with their "off" value (``Body.IGNORED`` / ``UNSUPPORTED``), the family's ``model_kwargs`` knobs
when the backend lists them, token ids within the vocabulary, the content parts and output ``modalities`` the model
takes, base64 media data and image URLs on the allowed hosts, the multipart body of ``/generate`` for a model that
takes media; and, with an API key, the bearer scheme on every route but ``/health``.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from mstar_dist.config.deployment import MediaConfig
from mstar_dist.events import INPUT_MEDIA
from mstar_dist.server.backend import GenerationBackend
from mstar_dist.server.checks import REQUEST_ID_HEADER, inputs_of, outputs_of
from mstar_dist.server.protocol import GUIDED_FIELDS, TOKEN_ID_MAX, Body
from mstar_dist.server.tokenizer import tokenizer_of

_REF = "#/components/schemas/{model}"
_B64 = "(?:[A-Za-z0-9+/]{4})+"
"""Base64 with no padding needed (a multiple of 3 bytes): enough for generated requests to be valid."""
REQUEST_ID_PARAM = {
    "name": REQUEST_ID_HEADER, "in": "header", "required": False,
    "description": "Request id to use (and to pin sampling); a new one is made when absent.",
    "schema": {"type": "string", "minLength": 1, "maxLength": 128, "pattern": "^[A-Za-z0-9._:-]+$"},
}


def body_doc(model: type[BaseModel], multipart: dict[str, Any] | None = None) -> dict[str, Any]:
    """``openapi_extra`` for a POST route whose JSON body is ``model`` (and which takes ``X-Request-Id``); with
    ``multipart`` (:func:`multipart_doc`), the route also takes that ``multipart/form-data`` body."""
    schema = {"$ref": _REF.format(model=model.__name__)}
    content: dict[str, Any] = {"application/json": {"schema": schema}}
    if multipart:
        content["multipart/form-data"] = multipart
    return {"requestBody": {"required": True, "content": content}, "parameters": [REQUEST_ID_PARAM]}


def multipart_doc(backend: GenerationBackend) -> dict[str, Any] | None:
    """The ``multipart/form-data`` body of ``/generate`` for a model that takes images or audio (None for a model that
    takes neither): the JSON body as the ``request`` field, files in ``image`` / ``audio`` fields (``media_input``)."""
    taken = [kind for kind in INPUT_MEDIA if kind in inputs_of(backend)]
    if not taken:
        return None
    props: dict[str, Any] = {"request": {"type": "string", "contentMediaType": "application/json",
                                         "description": "the JSON body of POST /generate (GenerateRequest) as text; "
                                                        "the files are added to its last user message"}}
    types = {"image": "image/png, image/jpeg, image/webp", "audio": "audio/wav, audio/mpeg, audio/flac, audio/ogg"}
    for kind in taken:
        props[kind] = {"type": "array", "items": {"type": "string", "format": "binary"}}
    return {"schema": {"type": "object", "required": ["request"], "properties": props},
            "encoding": {kind: {"contentType": types[kind]} for kind in taken}}


def install_openapi(app: FastAPI, backend: GenerationBackend, bodies: list[type[BaseModel]], *,
                    api_key: bool, media: MediaConfig | None = None) -> None:
    """Make ``app.openapi()`` return the document with ``bodies``' schemas, this deployment's limits (``media``: its
    media limits and image URL hosts) and, with ``api_key``, the bearer security scheme. Built once, on the first
    request for it."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                              description="mstar_dist: native /generate and OpenAI-compatible routes.")
            _, defs = models_json_schema([(m, "validation") for m in bodies], ref_template=_REF)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(defs.get("$defs", {}))
            _describe_keys(schemas, backend)
            _describe_deployment(schemas, backend)
            _describe_media(schemas, backend, media or MediaConfig())
            _describe_messages(schemas)
            _describe_guided(schemas)
            if api_key:
                _add_bearer(doc)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi


def _describe_deployment(schemas: dict[str, Any], backend: GenerationBackend) -> None:
    limit = backend.max_tokens_limit
    for name, schema in schemas.items():
        props = schema.get("properties", {})
        if "model" in props:
            props["model"] = {"anyOf": [{"type": "string", "enum": [backend.model_name]}, {"type": "null"}],
                              "description": "the served model (GET /v1/models); null or absent means it"}
        for key in ("max_tokens", "max_completion_tokens"):
            if key in props:
                props[key] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": limit}, {"type": "null"}],
                              "description": f"at most {limit} (this server's limit)"}
        if "stop_token_ids" in props:
            ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": TOKEN_ID_MAX}}
            props["stop_token_ids"] = {"anyOf": [ids, {"type": "null"}], "description": "token ids that end the answer"}
        if "stop" in props:
            text = {"type": "string", "minLength": 1}
            props["stop"] = {"anyOf": [text, {"type": "array", "items": text}, {"type": "null"}]}
    tok = tokenizer_of(backend)
    top = (tok.vocab_size if tok is not None else TOKEN_ID_MAX + 1) - 1
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": top}}
    if "CompletionRequest" in schemas:
        texts = [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": {
            "type": "string", "minLength": 1}}]
        schemas["CompletionRequest"]["properties"]["prompt"] = {
            "anyOf": texts + ([ids, {"type": "array", "minItems": 1, "items": ids}] if tok is not None else []),
            "description": "a string, a list of strings" + (", a list of token ids or a list of token-id lists"
                                                            if tok is not None else " (this model reads no token ids)")}
    if "DetokenizeRequest" in schemas:
        schemas["DetokenizeRequest"]["properties"]["tokens"] = {**ids, "minItems": 0}
    for name in ("GenerateRequest", "TokenizeRequest"):
        if name in schemas:
            body = schemas[name]
            body["properties"]["prompt"] = {"type": "string", "minLength": 1 if name == "GenerateRequest" else 0}
            body["properties"]["messages"] = {"type": "array", "minItems": 1,
                                              "items": {"$ref": _REF.format(model="ChatMessage")}}
            body["oneOf"] = [{"required": ["prompt"]}, {"required": ["messages"]}]


def _body_classes(cls: type[Body] = Body) -> list[type[Body]]:
    return [sub for direct in cls.__subclasses__() for sub in (direct, *_body_classes(direct))]


def _describe_keys(schemas: dict[str, Any], backend: GenerationBackend) -> None:
    """The keys each request object accepts beyond its fields: ``IGNORED`` ones (any value), ``UNSUPPORTED`` ones
    (only their "off" values); and ``model_kwargs``' family knobs when the backend lists them (else any key)."""
    for cls in _body_classes():
        schema = schemas.get(cls.__name__)
        if schema is None or "properties" not in schema:
            continue
        props = schema["properties"]
        for key in sorted(cls.IGNORED):
            props[key] = {"description": "accepted and ignored"}
        for key, rule in cls.UNSUPPORTED.items():
            props[key] = {"enum": [None, *rule.off], "description": f"not supported ({rule.why}): only these values"}
    knobs = getattr(backend, "model_knobs", None)
    if "ModelKwargs" in schemas and knobs is not None:
        kwargs = schemas["ModelKwargs"]
        for knob in knobs:
            kwargs["properties"].setdefault(knob, {"description": "the model family's knob (it checks the value)"})
        kwargs["additionalProperties"] = False


def _describe_media(schemas: dict[str, Any], backend: GenerationBackend, media: MediaConfig) -> None:
    """Content parts only of the kinds this model takes, their data as base64 within ``media.max_item_bytes``, image
    URLs as ``data:`` URLs or on the allowed hosts; ``modalities`` only what this model produces."""
    taken = inputs_of(backend)
    parts = {"image_url": ("ImagePart", "image"), "input_audio": ("AudioPart", "audio")}
    content = schemas.get("ChatMessage", {}).get("properties", {}).get("content", {})
    for branch in content.get("anyOf", []):
        items = branch.get("items", {})
        for tag, (name, kind) in parts.items():
            if kind not in taken and "oneOf" in items:
                items["oneOf"] = [ref for ref in items["oneOf"] if ref.get("$ref") != _REF.format(model=name)]
                items.get("discriminator", {}).get("mapping", {}).pop(tag, None)
    b64_length = 4 * -(-media.max_item_bytes // 3)
    if "InputAudio" in schemas:
        schemas["InputAudio"]["properties"]["data"] = {"type": "string", "pattern": f"^{_B64}$", "minLength": 4,
                                                       "maxLength": b64_length, "description": "base64 of the file"}
    if "ImageURL" in schemas:
        urls = [f"^data:image/(png|jpeg|webp);base64,{_B64}$"]
        if media.allowed_domains:
            hosts = "|".join(re.escape(host) for host in media.allowed_domains)
            urls.append(f"^https?://({hosts})(:[0-9]{{1,5}})?/[^ ]*$")
        schemas["ImageURL"]["properties"]["url"] = {"type": "string", "pattern": "|".join(f"({u})" for u in urls),
                                                    "maxLength": b64_length + 40,
                                                    "description": "a data: URL, or an http(s) URL on an allowed "
                                                                   "host (media.allowed_domains)"}
    outputs = outputs_of(backend)
    if "ChatCompletionRequest" in schemas:
        choices = [["text"], ["text", "audio"], ["audio", "text"]] if "audio" in outputs else [["text"]]
        schemas["ChatCompletionRequest"]["properties"]["modalities"] = {"anyOf": [{"enum": choices}, {"type": "null"}]}
    if "GenerateRequest" in schemas:
        item = {"type": "string", "enum": list(outputs)}
        schemas["GenerateRequest"]["properties"]["modalities"] = {
            "anyOf": [{"type": "array", "items": item, "minItems": 1, "uniqueItems": True}, {"type": "null"}]}


def _describe_guided(schemas: dict[str, Any]) -> None:
    """At most one structured-output constraint a request, and ``json_schema`` with its type (the validators' rules,
    which a schema of the fields cannot say)."""
    pairs = [[a, b] for i, a in enumerate(GUIDED_FIELDS) for b in GUIDED_FIELDS[i + 1:]]
    for schema in schemas.values():
        if "guided_json" in schema.get("properties", {}):
            schema["not"] = {"anyOf": [{"required": pair} for pair in pairs]}
    if "ResponseFormat" in schemas:
        schemas["ResponseFormat"]["anyOf"] = [
            {"properties": {"type": {"enum": ["text", "json_object"]}}},
            {"required": ["type", "json_schema"], "properties": {"json_schema": {"type": "object"}}}]


_VALUE = r'("[a-z0-9 ]{0,12}"|-?(0|[1-9][0-9]{0,5})|true|false|null)'
_ARGUMENTS = rf'^\{{("[a-z_]{{1,12}}": ?{_VALUE}(, ?"[a-z_]{{1,12}}": ?{_VALUE}){{0,4}})?\}}$'
"""Flat JSON objects as text: the form of tool-call arguments the document describes (the server takes any object)."""


def _describe_messages(schemas: dict[str, Any]) -> None:
    """A chat message as ``ChatMessage`` accepts it: content (not null) unless it is an assistant turn, and tool calls
    only in an assistant turn (the class says so in its validators, which a schema of its fields cannot)."""
    msg = schemas.get("ChatMessage")
    if msg is None:
        return
    content = msg["properties"].get("content", {})
    content["anyOf"] = [branch for branch in content.get("anyOf", []) if branch.get("type") != "null"]
    msg["required"] = [key for key in msg.get("required", []) if key != "content"]
    called = schemas.get("CalledFunction", {}).get("properties", {})
    if "arguments" in called:  # any JSON object as text is taken; the pattern shows fuzzers the flat form
        called["arguments"] = {"type": "string", "pattern": _ARGUMENTS,
                               "description": "the call's arguments: a JSON object as text"}
    msg["anyOf"] = [{"required": ["content"], "not": {"required": ["tool_calls"]}},
                    {"required": ["role", "tool_calls"], "properties": {
                        "role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}}}]


def _add_bearer(doc: dict[str, Any]) -> None:
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                       "description": "the server's --api-key"}}
    doc["security"] = [{"bearer": []}]
    for method in doc["paths"].get("/health", {}).values():
        method["security"] = []
