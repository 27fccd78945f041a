"""What every request and response type of the HTTP API shares: strict request objects that name unknown keys,
usage, the OpenAI error body.

A request object (:class:`Body`) is strict (``"5"`` is not an int, ``"yes"`` is not a bool) and rejects every key it
does not know with a 400 naming it and the closest known key (``max_token`` -> "did you mean 'max_tokens'?"), so a
typo fails instead of silently doing nothing. Two kinds of keys are known without being fields: ``IGNORED`` ones,
which OpenAI clients routinely send and which change nothing here (``user``, ``metadata``, ...): accepted and
dropped; and ``UNSUPPORTED`` ones, real features of OpenAI or vLLM this server does not implement: accepted only
with a value that asks for nothing (null, or the feature's "off" value), else a 400 saying they are not supported.
"""

from __future__ import annotations

import difflib
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

UNKNOWN_FIELD = "unknown_field"
"""The pydantic error type of an unknown or unsupported key; its ``ctx["param"]`` names the key (``checks``)."""
PARAM_CTX = "param"


class Unsupported:
    """A key this server knows but does not implement: the values that ask for nothing, and what to do instead."""

    def __init__(self, why: str, *off: Any) -> None:
        self.why, self.off = why, off

    def allows(self, value: Any) -> bool:
        return value is None or any(type(value) is type(o) and value == o for o in self.off)


def key_error(key: str, message: str) -> PydanticCustomError:
    """A validation error about ``key`` (its ``param``), with ``message`` as the client reads it."""
    return PydanticCustomError(UNKNOWN_FIELD, message.replace("{", "{{").replace("}", "}}"), {PARAM_CTX: key})


def key_problem(data: Any, known: frozenset[str] | set[str], unsupported: dict[str, Unsupported] | None = None
                ) -> tuple[str, str] | None:
    """(key, message) about the first key of ``unsupported`` in ``data`` whose value asks for the feature, or naming
    every key of ``data`` outside ``known`` (with the closest known name as a hint); None when all is well."""
    if not isinstance(data, dict):
        return None
    unsupported = unsupported or {}
    for key, rule in unsupported.items():
        if key in data and not rule.allows(data[key]):
            return key, f"{key} is not supported by this server: {rule.why}"
    unknown = [k for k in data if k not in known and k not in unsupported]
    if not unknown:
        return None
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), sorted(known), n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return str(unknown[0]), f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(hints)}"


def reject_unknown(data: Any, known: frozenset[str] | set[str], unsupported: dict[str, Unsupported] | None = None
                   ) -> None:
    """:func:`key_problem` as a validation error (its ``param`` the key)."""
    problem = key_problem(data, known, unsupported)
    if problem:
        raise key_error(*problem)


class Body(BaseModel):
    """A request object (or one inside a request): strict types, unknown keys a 400 (see the module docstring)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    IGNORED: ClassVar[frozenset[str]] = frozenset()
    """Keys accepted and dropped (documented in the OpenAPI document)."""
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = {}
    """Keys of features this server does not implement, accepted only with a value asking for nothing."""
    NULL_MEANS_DEFAULT: ClassVar[bool] = False
    """Treat ``"key": null`` as an absent key (OpenAI clients send null for "not set")."""

    @model_validator(mode="before")
    @classmethod
    def _screen_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known, dropped = _screen_sets(cls)
        reject_unknown(data, known, cls.UNSUPPORTED)
        return {k: v for k, v in data.items()
                if k not in dropped and not (cls.NULL_MEANS_DEFAULT and v is None)}

    @classmethod
    def field_keys(cls) -> frozenset[str]:
        """The keys of this object's fields as clients write them (a field's alias where it has one)."""
        keys = _FIELD_KEYS.get(cls)
        if keys is None:  # a class's fields are fixed once pydantic built it: computed once, not per request
            keys = _FIELD_KEYS[cls] = frozenset(field.alias or name for name, field in cls.model_fields.items())
        return keys


_FIELD_KEYS: dict[type, frozenset[str]] = {}
"""``Body.field_keys`` of each class that was asked."""
_SCREEN_SETS: dict[type, tuple[frozenset[str], frozenset[str]]] = {}
""":func:`_screen_sets` of each class that was asked."""


def _screen_sets(cls: type[Body]) -> tuple[frozenset[str], frozenset[str]]:
    """(the keys ``cls`` knows, those it accepts and drops), built once per class: every request object of every
    request is screened, so rebuilding them per object is per-request work for nothing."""
    sets = _SCREEN_SETS.get(cls)
    if sets is None:
        sets = _SCREEN_SETS[cls] = (cls.field_keys() | cls.IGNORED, frozenset(cls.IGNORED | cls.UNSUPPORTED.keys()))
    return sets


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None
    """The HTTP status, or OpenAI's code name where it has one (``model_not_found``)."""


class ErrorResponse(BaseModel):
    """OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo
