"""Bytes on the wire: JSON as the routes write it (compact, UTF-8, no character that line-splitting clients would
take for a line end), server-sent events, NDJSON lines and base64."""

from __future__ import annotations

import base64
import json
from typing import Any

from pydantic import BaseModel

NDJSON_MEDIA_TYPE = "application/x-ndjson; charset=utf-8"
SSE_MEDIA_TYPE = "text/event-stream; charset=utf-8"
SSE_DONE = b"data: [DONE]\n\n"

LINE_BREAKERS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})
"""Characters JSON may leave unescaped that ``str.splitlines`` (and so httpx's ``iter_lines``) takes for line ends:
a generated token holding one would cut a streamed line in two for such clients. Escaped, they are still valid JSON
(control characters below U+0020, the rest of splitlines' set, are always escaped)."""


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(LINE_BREAKERS).encode("utf-8")


def ndjson_line(line: BaseModel) -> bytes:
    return json_bytes(line.model_dump()) + b"\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json_bytes(obj) + b"\n\n"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
