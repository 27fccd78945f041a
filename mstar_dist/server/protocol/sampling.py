"""The sampling and output fields of the text routes: OpenAI's (temperature, top_p, seed, stop, presence_penalty,
frequency_penalty), vLLM's extra parameters with vLLM's meaning (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, include_stop_str_in_output, skip_special_tokens, spaces_between_special_tokens; a
temperature below ``GREEDY_BELOW`` is greedy) and structured outputs
(``response_format``, vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and
``structured_outputs``), turned into :class:`mstar_dist.events.GenerationParams` fields by
:meth:`ExtraSampling.generation_fields`.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from mstar_dist.events import GuidedSpec
from mstar_dist.server.protocol.base import Body, Unsupported, key_error

TOP_K_MAX = 2**31 - 1
TOKEN_ID_MAX = 2**31 - 1
"""Largest token id a request may name (the vocabulary, when the server knows it, is checked where it is used)."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
LOGPROBS_MAX = 20
"""Most alternatives per token a request may ask for (vLLM's default ``max_logprobs``)."""
N_MAX = 16
"""Most choices (``n``) per prompt."""
REPETITION_PENALTY_MAX = 100.0
GREEDY_BELOW = 1e-5
"""vLLM's rule: a temperature below this samples greedily (logits divided by a tinier one overflow to infinities)."""

SAMPLING_UNSUPPORTED = {
    "logit_bias": Unsupported("per-request logit biases are not implemented; leave it out", {}),
}
"""OpenAI's sampling fields this server does not implement: only their "off" values are accepted."""


KNOB_NAMES = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty", "min_tokens")
"""The request fields that are sampling knobs a model family may give defaults to (``GenerationParams``' names)."""


class SamplingKnobs(Body):
    """Token sampling fields shared by every route that samples (validated the same way): OpenAI's temperature,
    top_p, presence and frequency penalties, vLLM's top_k, min_p and repetition_penalty (on the speech route as on
    vLLM's text routes: top-level keys, which the openai client sends with ``extra_body``)."""

    NULL_MEANS_DEFAULT = True

    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy; at most 2")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus mass in (0, 1]")
    top_k: int = Field(0, ge=-1, description="0 or -1 disables")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX, description="fixes sampling (a 64-bit integer)")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the top token's probability")
    repetition_penalty: float = Field(1.0, gt=0.0, le=REPETITION_PENALTY_MAX, description="vLLM's; 1 disables")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's; 0 disables")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's; 0 disables")

    def knob_fields(self) -> dict[str, Any]:
        """These knobs as :class:`GenerationParams` keywords, with ``sampling_given``: the knobs the client wrote
        (whatever their value), so that only those it left out take the model family's defaults."""
        return {"temperature": self.temperature_value(), "top_p": self.top_p, "top_k": self.top_k_value(),
                "seed": self.seed, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "sampling_given": tuple(name for name in KNOB_NAMES if name in self.model_fields_set)}

    def temperature_value(self) -> float:
        """The temperature the engine samples with: 0 (greedy) below :data:`GREEDY_BELOW`, as vLLM does."""
        return 0.0 if self.temperature < GREEDY_BELOW else self.temperature

    def top_k_value(self) -> int:
        """0 for disabled; a k beyond any vocabulary is clamped (it keeps every token either way, and must fit
        the control plane's int64)."""
        return min(max(self.top_k, 0), TOP_K_MAX)


class Sampling(SamplingKnobs):
    """Sampling fields of the text routes: the knobs plus stop strings."""

    stop: str | list[str] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        stops = [value] if isinstance(value, str) else value
        if value is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
            raise ValueError(f"stop must be a string or a list of strings, got {value!r:.80}")
        if value is not None and any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class JsonSchemaFormat(Body):
    """``response_format.json_schema``: OpenAI's ``{name, schema, strict, description}``."""

    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON schema the answer follows")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Body):
    """OpenAI's ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {"name", "schema"}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs "json_schema": {"name": ..., "schema": {...}}')
        return self


class StructuredOutputs(Body):
    """vLLM's ``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs")


class ExtraSampling(Sampling):
    """The knobs, stop strings, vLLM's extra parameters and structured outputs (every field means what it means in
    vLLM; see :class:`mstar_dist.events.GenerationParams`)."""

    UNSUPPORTED = SAMPLING_UNSUPPORTED

    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, description="no end of sequence before this many tokens")
    stop_token_ids: list[int] | None = Field(None, description="token ids that end the answer")
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("stop_token_ids")
    @classmethod
    def _check_ids(cls, value: list[int] | None) -> list[int] | None:
        for i, token in enumerate(value or ()):
            if not 0 <= token <= TOKEN_ID_MAX:
                raise ValueError(f"[{i}] = {token} is not a token id (0 to {TOKEN_ID_MAX})")
        return value

    @model_validator(mode="after")
    def _check_guided(self) -> ExtraSampling:
        given = [name for name in GUIDED_FIELDS if getattr(self, name) is not None
                 and not (name == "response_format" and self.response_format.type == "text")]
        if len(given) > 1:
            raise key_error(given[1], f"give one structured-output constraint, not {' and '.join(given)}")
        self.guided()  # a bad constraint is a 400 now, not when the request is sent on
        return self

    def guided(self) -> GuidedSpec | None:
        """The structured-output constraint, whichever field gave it (None: free text)."""
        if self.response_format is not None and self.response_format.type != "text":
            schema = self.response_format.json_schema.schema_ if self.response_format.json_schema else None
            if schema is None:
                return GuidedSpec("json_object", "")
            return GuidedSpec("json_schema", json.dumps(schema))
        if self.guided_json is not None:
            return GuidedSpec("json_schema", _schema_text(self.guided_json, "guided_json"))
        if self.guided_regex is not None:
            return GuidedSpec("regex", _regex(self.guided_regex, "guided_regex"))
        if self.guided_choice is not None:
            return GuidedSpec("choice", json.dumps(self.guided_choice))
        if self.guided_grammar is not None:
            return GuidedSpec("grammar", _grammar(self.guided_grammar, "guided_grammar"))
        if self.structured_outputs is not None:
            return _structured(self.structured_outputs)
        return None

    def generation_fields(self) -> dict[str, Any]:
        """These fields as :class:`GenerationParams` keywords (beyond max_tokens, which each route bounds)."""
        return {**self.knob_fields(), "stop": self.stop_list(), "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
                "stop_token_ids": list(self.stop_token_ids or ()),
                "include_stop_str_in_output": self.include_stop_str_in_output,
                "skip_special_tokens": self.skip_special_tokens,
                "spaces_between_special_tokens": self.spaces_between_special_tokens, "guided": self.guided()}


def _schema_text(schema: dict[str, Any] | str, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise key_error(param, f"{param} is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise key_error(param, f"{param} must be a JSON schema object")
    return json.dumps(schema)


def _regex(pattern: str, param: str) -> str:
    if not pattern:
        raise key_error(param, f"{param} must be a non-empty regular expression")
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise key_error(param, f"{param} is not a regular expression: {exc}") from None
    return pattern


def _grammar(grammar: str, param: str) -> str:
    if not grammar.strip():
        raise key_error(param, f"{param} must be a non-empty grammar")
    return grammar


def _structured(so: StructuredOutputs) -> GuidedSpec:
    given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(so, name) is not None]
    given += ["json_object"] if so.json_object else []
    if len(given) != 1:
        names = [g.rstrip("_") for g in given]
        raise key_error("structured_outputs", "structured_outputs needs exactly one of json, regex, choice, grammar, "
                                              f"json_object: true; got {', '.join(names) or 'none'}")
    if so.json_ is not None:
        return GuidedSpec("json_schema", _schema_text(so.json_, "structured_outputs.json"))
    if so.regex is not None:
        return GuidedSpec("regex", _regex(so.regex, "structured_outputs.regex"))
    if so.choice is not None:
        if not so.choice:
            raise key_error("structured_outputs.choice", "structured_outputs.choice must list at least one string")
        return GuidedSpec("choice", json.dumps(so.choice))
    if so.grammar is not None:
        return GuidedSpec("grammar", _grammar(so.grammar, "structured_outputs.grammar"))
    return GuidedSpec("json_object", "")
