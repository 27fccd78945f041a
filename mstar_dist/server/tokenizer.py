"""The served model's tokenizer as the HTTP side uses it (``/tokenize`` and ``/detokenize``, token-id prompts checked
against the vocabulary, prompts counted up front for ``continuous_usage_stats``), and the engine's log-probabilities
(:class:`mstar_dist.events.TokenLogprob`, text and bytes included) in OpenAI's chat and completion shapes.

A backend offers its family's prompt encoder as ``tokenizer`` (optional, read with :func:`tokenizer_of`): an intake
the one it encodes prompts with, the in-process backend the one the runtime builds from
``CompositeModel.prompt_encoder``. A family without one (its ``preprocess`` shapes prompts its own way) has no
tokenizer here: what needs one is a 400.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from mstar_dist.events import TokenLogprob
from mstar_dist.server.backend import GenerationBackend
from mstar_dist.server.checks import ApiError

@runtime_checkable
class PromptTokenizer(Protocol):
    """A family's prompt encoder (``models.llama.tokenizer.ChatTokenizer`` for instance)."""

    @property
    def vocab_size(self) -> int: ...

    def encode_prompt(self, prompt: str | None, messages: list[dict[str, str]] | None) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def tokenizer_of(backend: GenerationBackend) -> PromptTokenizer | None:
    """The backend's tokenizer, or None."""
    tok = getattr(backend, "tokenizer", None)
    return tok if isinstance(tok, PromptTokenizer) else None


def need_tokenizer(backend: GenerationBackend, what: str, param: str | None = None) -> PromptTokenizer:
    """The backend's tokenizer; a 400 saying ``what`` needs one when it has none."""
    tok = tokenizer_of(backend)
    if tok is None:
        raise ApiError(400, f"{what} needs the model's tokenizer, and {backend.model_name!r} has none that this "
                            "server can use (its family shapes prompts itself)", param)
    return tok


def check_ids(tok: PromptTokenizer, ids: list[int], param: str) -> list[int]:
    """``ids`` when each is in the vocabulary; else a 400 naming the first that is not."""
    vocab = tok.vocab_size
    for i, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise ApiError(400, f"{param}[{i}] = {token} is not a token id of this model (its vocabulary has {vocab} "
                                "tokens)", param)
    return ids


def encode(tok: PromptTokenizer, prompt: str | None, messages: list[dict[str, str]] | None, param: str) -> list[int]:
    """The prompt's ids as the family would compute them; the encoder's complaint is a 400."""
    try:
        return list(tok.encode_prompt(prompt, messages))
    except (ValueError, TypeError) as exc:
        raise ApiError(400, f"{param} cannot be encoded: {exc}", param) from None


def chat_logprob(lp: TokenLogprob) -> dict[str, Any]:
    """``choices[].logprobs.content[]`` of one generated token (its alternatives in ``top_logprobs``)."""
    return {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token_bytes),
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token_bytes)} for t in lp.top]}


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """``choices[].logprobs`` of a chat completion (or of one streamed chunk)."""
    return {"content": [chat_logprob(lp) for lp in entries], "refusal": None}


def completion_logprobs(entries: list[TokenLogprob | None], first_token: str, offset: int
                        ) -> tuple[dict[str, Any], int]:
    """``choices[].logprobs`` of ``entries`` whose text starts at character ``offset`` of the choice's text, and the
    offset after them. A None entry is a prompt's first token, which has no log-probability: its text is
    ``first_token``."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in entries:
        text = first_token if lp is None else lp.token
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(lp.logprob)
        top = {t.token: t.logprob for t in lp.top}
        top.setdefault(lp.token, lp.logprob)  # the chosen token is always there, as vLLM does
        out["top_logprobs"].append(top)
    return out, offset


def first_token_text(prompt: str, prompt_ids: list[int] | None, tok: PromptTokenizer | None,
                     entries: list[TokenLogprob | None]) -> str:
    """The text of a prompt's first token, which its log-probability entry (None) does not carry: decoded when the
    prompt's ids and the tokenizer are known, else what the other tokens' texts leave of the prompt's start."""
    if tok is not None and prompt_ids:
        return tok.decode(prompt_ids[:1], skip_special_tokens=False)
    rest = sum(len(lp.token) for lp in entries if lp is not None)
    return prompt[:max(len(prompt) - rest, 0)]
