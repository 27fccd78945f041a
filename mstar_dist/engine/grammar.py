"""Structured outputs (docs/architecture.md §8, "Structured outputs"): a request's ``GuidedSpec`` as an llguidance
grammar, and the per-request matchers whose token masks the KV engine applies to its rows' logits.

`compile_guided` is what the conductor checks a request with before anything runs (a ValueError naming the
unsupported feature, which the HTTP layer answers with a 400) and what a rank builds its matchers from (cached per
spec). `GuidedRows` lives in a KV engine: one matcher per request that asked for a grammar, and each step's masks of
those rows computed on the host together (llguidance's executor, without the GIL) into one bitmask, unpacked on the
host (numpy's unpackbits: torch's bit arithmetic costs a CPU step more than the grammar does) into the (rows, vocab)
bool mask of forbidden tokens, which goes to the device with the step's other inputs (pinned memory) and is applied
there with one masked_fill (engine/logits.py).

A matcher sees every token its request generated: a decode step consumes the token it starts from before the step's
mask is computed, and a prefill's mask is the grammar's start. So a matcher made at a request's first decode step on
a decode rank (P/D: the prefill ran elsewhere) consumes the prefill's token there, as the prefill rank's own would
have. The host must know that token before the step: a row with a grammar never runs in a lookahead step
(engine/kv_engine.py). The tokenizer comes from the model family (the engine's ``grammar_tokenizer``; the engine does
not import the zoo), built when the first request needs it.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any, Callable

import numpy as np
import torch

log = logging.getLogger(__name__)

JSON_OBJECT = '{"type": "object"}'
"""The schema of ``json_object`` (OpenAI's JSON mode): any JSON object."""
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How JSON is laid out: one space after separators, no other whitespace (``json.dumps``'s layout), so a model
cannot fill its budget with whitespace between the values it must write; a schema's ``"x-guidance"`` key may say
otherwise (llguidance's options: ``{"whitespace_flexible": true}``)."""


@functools.lru_cache(maxsize=256)
def compile_guided(kind: str, spec: str) -> str:
    """The llguidance grammar of a ``GuidedSpec`` (kind, spec). ValueError naming what is wrong: a spec that does not
    parse, or a feature llguidance does not implement (a JSON-schema key, a format, a regex construct)."""
    from llguidance import LLMatcher

    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except ValueError as exc:
            raise ValueError(f"guided json_schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"guided json_schema must be a JSON object, got {type(schema).__name__}")
        grammar = LLMatcher.grammar_from_json_schema(spec, defaults=JSON_LAYOUT)
    elif kind == "json_object":
        grammar = LLMatcher.grammar_from_json_schema(JSON_OBJECT, defaults=JSON_LAYOUT)
    elif kind == "regex":
        grammar = LLMatcher.grammar_from_regex(spec)
    elif kind == "choice":
        grammar = LLMatcher.grammar_from_lark(_choice_lark(spec))
    elif kind == "grammar":
        grammar = LLMatcher.grammar_from_lark(spec)
    else:
        raise ValueError(f"guided kind {kind!r} is not one of json_schema, json_object, regex, choice, grammar")
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if failed or messages:  # a warning is a feature the grammar would silently ignore: refused too
        raise ValueError(f"guided {kind}: not supported: {'; '.join(messages)}")
    return grammar


def _choice_lark(spec: str) -> str:
    """A Lark grammar matching exactly one of the JSON list of strings ``spec``."""
    try:
        choices = json.loads(spec)
    except ValueError as exc:
        raise ValueError(f"guided choice must be a JSON list of strings: {exc}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"guided choice must be a non-empty JSON list of non-empty strings, got {spec!r}")
    return "start: " + " | ".join(json.dumps(c) for c in choices)


class GuidedRows:
    """One engine's matchers, by request id (see the module docstring)."""

    def __init__(self, tokenizer: Callable[[], Any] | None, engine: str) -> None:
        """``tokenizer()`` builds the model's ``llguidance.LLTokenizer`` (its vocabulary the logits' width); None: this
        engine's model offers none, and a request with a grammar fails naming ``engine``."""
        self._make_tokenizer = tokenizer
        self._tokenizer = None
        self._executor = None
        self._engine = engine
        self._matchers: dict[str, Any] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    @property
    def width(self) -> int:
        """Words of 32 tokens in a row's mask."""
        return (self._tokenizer.vocab_size + 31) // 32

    def advance(self, request_id: str, guided: Any, token: int | None) -> None:
        """Make the request's matcher when it has none (from ``guided``, a GuidedSpec), then let it consume
        ``token``, the token the step starts from (None at a prefill: the grammar starts there)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            matcher = self._matchers[request_id] = self._new_matcher(guided)
        if token is not None and not matcher.consume_token(token) and not matcher.is_stopped():
            log.warning("%s: request %s: token %d leaves its grammar (%s); only EOS is allowed from here",
                        self._engine, request_id, token, matcher.get_error())

    def forbidden(self, request_ids: list[str]) -> torch.Tensor:
        """(len(request_ids), 32 x width) bool on the host, row i True at the tokens request i may not write next
        (token t is bit t % 32 of word t // 32 of llguidance's mask). A matcher in error allows only EOS, so its
        request ends."""
        from llguidance.torch import fill_next_token_bitmask_par

        matchers = [self._matchers[rid] for rid in request_ids]
        bitmask = torch.full((len(matchers), self.width), -1, dtype=torch.int32)
        fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little").view(np.bool_)
        for i, m in enumerate(matchers):
            if m.is_error():
                allowed[i] = False
                allowed[i, self._tokenizer.eos_tokens] = True
        return torch.from_numpy(~allowed)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def _new_matcher(self, guided: Any) -> Any:
        import llguidance

        if self._tokenizer is None:
            if self._make_tokenizer is None:
                raise ValueError(f"{self._engine}: this model offers no tokenizer for structured output")
            self._tokenizer = self._make_tokenizer()
            self._executor = llguidance.LLExecutor()
        matcher = llguidance.LLMatcher(self._tokenizer, compile_guided(guided.kind, guided.spec), log_level=0)
        if matcher.is_error():
            raise ValueError(f"guided {guided.kind}: {matcher.get_error()}")
        return matcher


def apply_mask(logits: torch.Tensor, forbidden: torch.Tensor) -> torch.Tensor:
    """logits (G, V) with the tokens ``forbidden`` (G, W) (on logits' device; `GuidedRows.forbidden`) marks at -inf,
    in place; tokens past its width are forbidden."""
    vocab, width = logits.shape[1], forbidden.shape[1]
    if width >= vocab:
        return logits.masked_fill_(forbidden[:, :vocab], float("-inf"))
    logits[:, width:] = float("-inf")
    logits[:, :width].masked_fill_(forbidden, float("-inf"))
    return logits
