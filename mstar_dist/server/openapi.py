"""The app's OpenAPI document (``GET /openapi.json``), describing every request body.

The routes parse their bodies themselves (``checks.parse_body``: our error format, strict types), so FastAPI
knows nothing of them; each POST route declares its body here with ``openapi_extra=body_doc(Model)`` and
:func:`install_openapi` adds the pydantic models' JSON schemas to ``components.schemas``. The document also says
what this deployment accepts beyond the models' types: the served model's name, ``max_tokens`` up to the
server's limit, ``n`` = 1, exactly one of ``prompt`` / ``messages``, non-empty stop strings; and, with an API
key, the bearer scheme on every route but ``/health``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from mstar_dist.server.backend import GenerationBackend
from mstar_dist.server.checks import REQUEST_ID_HEADER
from mstar_dist.server.protocol import OPENAI_CHAT_IGNORED

_REF = "#/components/schemas/{model}"
REQUEST_ID_PARAM = {
    "name": REQUEST_ID_HEADER, "in": "header", "required": False,
    "description": "Request id to use (and to pin sampling); a new one is made when absent.",
    "schema": {"type": "string", "minLength": 1, "maxLength": 128, "pattern": "^[A-Za-z0-9._:-]+$"},
}


def body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a POST route whose JSON body is ``model`` (and which takes ``X-Request-Id``)."""
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "parameters": [REQUEST_ID_PARAM]}


def install_openapi(app: FastAPI, backend: GenerationBackend, bodies: list[type[BaseModel]], *,
                    api_key: bool) -> None:
    """Make ``app.openapi()`` return the document with ``bodies``' schemas, this deployment's limits and, with
    ``api_key``, the bearer security scheme. Built once, on the first request for it."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                              description="mstar_dist: native /generate and OpenAI-compatible routes.")
            _, defs = models_json_schema([(m, "validation") for m in bodies], ref_template=_REF)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(defs.get("$defs", {}))
            _describe_deployment(schemas, backend)
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
        if "stop" in props:
            text = {"type": "string", "minLength": 1}
            props["stop"] = {"anyOf": [text, {"type": "array", "items": text}, {"type": "null"}]}
    if "ChatCompletionRequest" in schemas:
        chat = schemas["ChatCompletionRequest"]
        chat["properties"]["n"] = {"type": "integer", "enum": [1], "default": 1}
        chat["additionalProperties"] = False  # OpenAI's other fields are accepted and ignored, others a 400
        chat["description"] += f" Accepted and ignored: {', '.join(sorted(OPENAI_CHAT_IGNORED))}."
    if "GenerateRequest" in schemas:
        generate = schemas["GenerateRequest"]
        generate["properties"]["prompt"] = {"type": "string", "minLength": 1}
        generate["properties"]["messages"] = {"type": "array", "minItems": 1,
                                              "items": {"$ref": _REF.format(model="ChatMessage")}}
        generate["oneOf"] = [{"required": ["prompt"]}, {"required": ["messages"]}]


def _add_bearer(doc: dict[str, Any]) -> None:
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                       "description": "the server's --api-key"}}
    doc["security"] = [{"bearer": []}]
    for method in doc["paths"].get("/health", {}).values():
        method["security"] = []
