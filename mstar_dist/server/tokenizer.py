"""The served model's tokenizer as the HTTP side uses it: ``/tokenize`` and ``/detokenize``, token-id prompts checked
against the vocabulary, prompts counted up front (``continuous_usage_stats``), and token ids turned into the strings
of OpenAI's log-probability shapes.

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

UNKNOWN_TOKEN_CACHE = 1 << 16
"""Token strings remembered per tokenizer (a vocabulary's worth for the models served here)."""


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


class TokenStrings:
    """Token ids -> the strings and bytes of OpenAI's log-probability shapes (each token decoded alone, special tokens
    kept, as vLLM does), remembered per id."""

    def __init__(self, tok: PromptTokenizer) -> None:
        self.tok = tok
        self._text: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self.tok.decode([token_id], skip_special_tokens=False)
            if len(self._text) < UNKNOWN_TOKEN_CACHE:
                self._text[token_id] = text
        return text

    def chat_entry(self, lp: TokenLogprob) -> dict[str, Any]:
        """``choices[].logprobs.content[]`` of one generated token."""
        text = self.text(lp.token_id)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8", "replace")),
                "top_logprobs": [self._top(token_id, logprob) for token_id, logprob in lp.top]}

    def _top(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


def completion_logprobs(strings: TokenStrings, entries: list[TokenLogprob | None], prompt_ids: list[int],
                        offset: int) -> tuple[dict[str, Any], int]:
    """``choices[].logprobs`` of ``entries`` whose text starts at character ``offset`` of the choice's text, and the
    offset after them. A None entry is a prompt's first token, which has no log-probability: its id is taken from
    ``prompt_ids`` at the same place."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for i, lp in enumerate(entries):
        token_id = lp.token_id if lp is not None else (prompt_ids[i] if i < len(prompt_ids) else None)
        if token_id is None:
            continue
        text = strings.text(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(lp.logprob)
        top = {strings.text(t): logprob for t, logprob in lp.top}
        top.setdefault(text, lp.logprob)  # the chosen token is always there, as vLLM does
        out["top_logprobs"].append(top)
    return out, offset
