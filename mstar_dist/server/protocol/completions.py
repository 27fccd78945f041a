"""``POST /v1/completions``: OpenAI's legacy completions, as vLLM serves them. The prompt is the model's input as
written (no chat template): a string, a list of strings (one choice per prompt, in order), a list of token ids, or a
list of such lists. Shapes exactly as the ``openai`` package's ``Completion`` (streamed chunks too)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from mstar_dist.server.protocol.base import Unsupported, Usage, key_error
from mstar_dist.server.protocol.chat import StreamOptions, VLLM_UNSUPPORTED
from mstar_dist.server.protocol.sampling import (
    LOGPROBS_MAX, N_MAX, SAMPLING_UNSUPPORTED, TOKEN_ID_MAX, ExtraSampling,
)

PROMPTS_MAX = 64
"""Most prompts in one request."""
DEFAULT_MAX_TOKENS = 16
"""OpenAI's (and vLLM's) default ``max_tokens`` for completions."""

COMPLETION_UNSUPPORTED = {
    **SAMPLING_UNSUPPORTED,
    **{k: v for k, v in VLLM_UNSUPPORTED.items() if k not in ("best_of", "prompt_logprobs")},
    "prompt_logprobs": Unsupported("use echo with logprobs for the prompt's"),
    "suffix": Unsupported("the model writes after the prompt only (no insertion)"),
    "add_special_tokens": Unsupported("the prompt is encoded as written", False),
}
COMPLETION_IGNORED = frozenset({"user", "metadata", "store", "service_tier", "guided_decoding_backend"})
"""Completion fields accepted and ignored (bookkeeping that changes no output)."""


class CompletionRequest(ExtraSampling):
    """``prompt``; ``max_tokens`` (default 16, or the server's limit when lower); ``echo`` (the prompt before the answer, and with ``logprobs`` the
    prompt's log-probabilities); ``logprobs`` k (0 to ``LOGPROBS_MAX``: each token's log-probability and its k most
    likely alternatives); ``n`` choices per prompt, ``best_of`` only equal to ``n``; ``suffix`` is refused."""

    IGNORED = COMPLETION_IGNORED
    UNSUPPORTED = COMPLETION_UNSUPPORTED

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, a list of token ids, or a list of token-id lists")
    max_tokens: int | None = Field(None, gt=0, description=f"default {DEFAULT_MAX_TOKENS} (OpenAI's), or the "
                                                            "server's limit when that is lower")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=LOGPROBS_MAX)
    n: int = Field(1, ge=1, le=N_MAX)
    best_of: int | None = Field(None, ge=1, le=N_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        # one clear message instead of one per branch of the union
        if isinstance(value, str):
            if not value:
                raise ValueError("the prompt is empty: send some text")
            return value
        if not isinstance(value, list) or not value:
            raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists, "
                             f"not {'an empty list' if value == [] else type(value).__name__}")
        if len(value) > PROMPTS_MAX and not all(_is_id(v) for v in value):
            raise ValueError(f"{len(value)} prompts; send at most {PROMPTS_MAX} in one request")
        if all(isinstance(v, str) for v in value):
            for i, text in enumerate(value):
                if not text:
                    raise ValueError(f"[{i}] is empty: send some text")
            return value
        if all(_is_id(v) for v in value):
            _check_ids(value, "")
            return value
        if all(isinstance(v, list) for v in value):
            for i, ids in enumerate(value):
                if not ids or not all(_is_id(t) for t in ids):
                    raise ValueError(f"[{i}] must be a non-empty list of token ids")
                _check_ids(ids, f"[{i}]")
            return value
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists "
                         "(one kind throughout)")

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise key_error("best_of", f"best_of is {self.best_of} and n is {self.n}: best_of must equal n (choosing "
                                       "the best of more samples is not supported)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and _is_id(p[0])):
            return [p]
        return list(p)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_ids(ids: list[int], where: str) -> None:
    for i, token in enumerate(ids):
        if not 0 <= token <= TOKEN_ID_MAX:
            raise ValueError(f"{where}[{i}] = {token} is not a token id (0 to {TOKEN_ID_MAX})")


class CompletionLogprobs(BaseModel):
    """``choices[].logprobs``: per token of ``text`` (the echoed prompt's first, when ``echo``)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """The whole response, and each streamed chunk (same shape: a chunk's text is the new text, its finish_reason
    null until the choice ends)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
