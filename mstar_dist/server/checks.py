"""Request checking shared by every route: JSON bodies parsed with one readable message (strict JSON: no NaN or
Infinity, no lone surrogate escapes), the served model, the route's output modality, ``X-Request-Id``. Every failure
is an :class:`ApiError` with a 4xx status saying what to fix and, where one field is at fault, naming it
(``param``); the app's error handler renders it in the route family's error format.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from mstar_dist.server.backend import GenerationBackend
from mstar_dist.server.protocol import PARAM_CTX

REQUEST_ID_HEADER = "X-Request-Id"
MODALITY_ROUTES = {"text": "POST /v1/chat/completions", "audio": "POST /v1/audio/speech",
                   "image": "POST /v1/images/generations"}
"""The OpenAI route that serves each output modality (``/generate`` serves them all)."""
_OUTPUT = {"text": "text", "audio": "audio", "image": "images"}

M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    """A request failure with the status and message the client sees; ``param`` names the offending field,
    ``headers`` go on the response (``Retry-After`` on a 429)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = dict(headers or {})
        self.code = code
        """OpenAI's code name for this error (``model_not_found``); None: the status is the code."""


def error_body(path: str, exc: ApiError) -> dict[str, Any]:
    """The error body of the route family ``path`` belongs to: OpenAI's ``{"error": {"message", "type", "param",
    "code"}}`` on ``/v1`` routes, ``{"error": "<message>"}`` on the native ones."""
    if not path.startswith("/v1/"):
        return {"error": exc.message}
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    if exc.status == 401:
        kind = "authentication_error"
    return {"error": {"message": exc.message, "type": kind, "param": exc.param,
                      "code": exc.code if exc.code is not None else exc.status}}


async def parse_body(request: Request, model: type[M], context: dict[str, Any] | None = None) -> M:
    """Parses the JSON body into ``model``; any mistake in it is a 400 naming the field (every route family).
    ``context``: pydantic's validation context (:func:`served_context`).

    Reads the whole body, so afterwards the next ASGI ``receive()`` only reports a disconnect."""
    return parse_json(await request.body(), model, context=context)


def served_context(backend: GenerationBackend) -> dict[str, Any]:
    """What a request's validation knows of the served model: its name, what it reads (``ChatMessage``) and the
    family's request knobs when the backend lists them (``model_knobs``, for ``ModelKwargs``; None: not listed)."""
    knobs = getattr(backend, "model_knobs", None)
    return {"model": backend.model_name, "inputs": inputs_of(backend),
            "knobs": None if knobs is None else tuple(knobs)}


def parse_json(raw: bytes | str, model: type[M], what: str = "request body", *,
               context: dict[str, Any] | None = None) -> M:
    """``raw`` (JSON text) as ``model``; a mistake is a 400 naming ``what`` or the field."""
    if not raw.strip():
        raise ApiError(400, f"{what} is empty: send a JSON object (Content-Type: application/json)")
    try:
        obj = json.loads(raw, parse_constant=_no_constant, parse_float=_number)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ApiError(400, f"{what} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"{what} must be a JSON object, got {_json_type(obj)}")
    data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
    if _SURROGATE_ESCAPE.search(data):
        check_unicode(obj)
    if _LONG_NUMBER.search(data):
        check_integers(obj)
    try:
        return model.model_validate(obj, context=context)
    except ValidationError as exc:
        raise ApiError(400, _describe(exc), _param(exc.errors(include_url=False)[0])) from None


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate: only then may the parsed text hold one alone (a raw one is invalid UTF-8)."""


def _number(text: str) -> int | float:
    """A JSON number with a fraction or exponent: an int when it is a whole number (``4.0``, ``1e3``), as JSON Schema
    counts it an integer and vLLM's lax parsing accepts it for an int field; a float field takes the int as it is."""
    value = float(text)
    return int(value) if value.is_integer() and abs(value) < 2 ** 63 else value


_LONG_NUMBER = re.compile(rb"[0-9]{19}")
"""A run of 19 digits: only then may the parsed body hold an integer beyond 64 bits."""
INT_RANGE = (-(2 ** 63), 2 ** 64 - 1)
"""The integers a request may hold anywhere: what travels on the wire (msgspec) and fits the engine's types."""


def check_integers(obj: Any, where: str = "") -> None:
    """A 400 naming the first integer of ``obj`` outside :data:`INT_RANGE` (no field means anything with one)."""
    if isinstance(obj, int) and not isinstance(obj, bool):
        if not INT_RANGE[0] <= obj <= INT_RANGE[1]:
            raise ApiError(400, f"{where or 'the body'}: {obj} is out of range (integers here are 64-bit)",
                           where or None)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            check_integers(value, f"{where}.{key}" if where else str(key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            check_integers(value, f"{where}[{i}]")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def check_unicode(obj: Any, where: str = "") -> None:
    """A 400 naming the first string (or key) of ``obj`` holding a lone UTF-16 surrogate (``"\\ud800"``): such text
    has no UTF-8 form, so nothing after the parser could encode it."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ApiError(400, f"{where or 'the body'} holds a lone surrogate escape "
                                f"({obj[exc.start]!r} at character {exc.start}), which is not text: send valid "
                                "Unicode (a surrogate only as one half of a pair)", where or None) from None
    elif isinstance(obj, dict):
        for key, value in obj.items():
            check_unicode(key, f"{where}.{key!r}" if where else repr(key))
            check_unicode(value, f"{where}.{key}" if where else key)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            check_unicode(value, f"{where}[{i}]")


def _param(err: dict[str, Any]) -> str | None:
    """The field a validation error is about: its location, and for an unknown or unsupported key the key."""
    where = _loc(err["loc"])
    key = (err.get("ctx") or {}).get(PARAM_CTX)
    if key is not None:
        where = f"{where}.{key}" if where else str(key)
    return where or None


def _describe(exc: ValidationError) -> str:
    """One readable line per problem: ``messages[0].role: Input should be 'system', ... (got 'robot')``."""
    problems = []
    for err in exc.errors(include_url=False):
        where = _loc(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "field required"
        elif err["type"] not in ("value_error", "extra_forbidden") and not isinstance(err["input"], dict | list):
            msg += f" (got {json.dumps(err['input'])[:60]})" if _jsonable(err["input"]) else ""
        problems.append(f"{where}: {msg}" if where else msg)
    return "invalid request: " + "; ".join(problems)


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _json_type(value: Any) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def check_model(model: str | None, backend: GenerationBackend) -> None:
    """A request naming a model must name the served one; another is a 404 (OpenAI's ``model_not_found``)."""
    if model is not None and model != backend.model_name:
        raise ApiError(
            404,
            f"The model {model!r} does not exist: this server serves {backend.model_name!r} (see GET /v1/models)",
            "model", code="model_not_found",
        )


def outputs_of(backend: GenerationBackend) -> tuple[str, ...]:
    """Every modality the backend's model can produce (``output_modalities``; else its one ``output_modality``)."""
    return tuple(getattr(backend, "output_modalities", None) or (backend.output_modality,))


def inputs_of(backend: GenerationBackend) -> tuple[str, ...]:
    """What requests to the backend's model may carry (``input_modalities``; else text alone)."""
    return tuple(getattr(backend, "input_modalities", None) or ("text",))


def check_outputs(backend: GenerationBackend, asked: list[str] | None, param: str) -> None:
    """Every modality in ``asked`` is one the model produces; else a 400 saying it has no such output."""
    have = outputs_of(backend)
    for modality in asked or ():
        if modality not in have:
            raise ApiError(400, f"{backend.model_name!r} has no {modality} output (it produces "
                                f"{' and '.join(have)}): leave {modality!r} out of {param}", param)


def check_modality(backend: GenerationBackend, needed: str) -> None:
    """The route serves ``needed`` output; a model that cannot produce it is a 400 naming the route it serves."""
    have = backend.output_modality
    if needed not in outputs_of(backend):
        served = MODALITY_ROUTES.get(have, "no OpenAI route")
        raise ApiError(400, f"{MODALITY_ROUTES[needed]} needs a model that produces {_OUTPUT[needed]}; "
                            f"{backend.model_name!r} produces {_OUTPUT.get(have, have)}: use {served} or "
                            "POST /generate", "model")


def max_tokens(requested: int | None, backend: GenerationBackend, param: str) -> int:
    """The request's token budget: ``requested`` if within the backend's limit, the limit if not given."""
    limit = backend.max_tokens_limit
    if requested is None:
        return limit
    if requested > limit:
        raise ApiError(400, f"{param} is {requested}, above this server's limit of {limit}; ask for at most {limit}",
                       param)
    return requested


def family_field(exc: ApiError, fields: dict[str, str]) -> ApiError:
    """``exc`` naming its field when it is the family's 400 about one of its knobs (the message starts with the
    knob's name: "voice 'carol' is not one of ..."): ``fields`` maps the family's knob to the request field the
    client wrote it in. Anything else is returned as it is."""
    if exc.status != 400 or exc.param is not None:
        return exc
    knob = exc.message.split(" ", 1)[0].rstrip(":")
    if knob not in fields:
        return exc
    return ApiError(400, exc.message, fields[knob], exc.headers, exc.code)


def header_request_id(request: Request) -> str | None:
    """The client's ``X-Request-Id``, if it sent a valid one (1-128 characters of ``[A-Za-z0-9._:-]``)."""
    value = request.headers.get(REQUEST_ID_HEADER)
    if value is None:
        return None
    if not (0 < len(value) <= 128 and all(c.isascii() and (c.isalnum() or c in "._:-") for c in value)):
        raise ApiError(400, f"{REQUEST_ID_HEADER} must be 1-128 characters of [A-Za-z0-9._:-]", REQUEST_ID_HEADER)
    return value
