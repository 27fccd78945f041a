"""``POST /tokenize`` and ``POST /detokenize``, as vLLM has them: the served model's tokenizer, for a model that
has one (a 400 otherwise). ``/tokenize`` takes ``prompt`` (the text as written) or ``messages`` (through the chat
template, as ``/v1/chat/completions`` encodes them); ``/detokenize`` takes ``tokens``."""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

from mstar_dist.server.protocol.base import Body, key_error
from mstar_dist.server.protocol.messages import ChatMessage
from mstar_dist.server.protocol.sampling import TOKEN_ID_MAX

TOKENS_MAX = 1 << 20
"""Most token ids one ``/detokenize`` takes."""


class TokenizeRequest(Body):
    """Exactly one of ``prompt`` / ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            given = "both" if self.prompt is not None else "neither"
            raise ValueError(f"give exactly one of 'prompt' (a string) or 'messages' (a chat list); got {given}")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int] = Field(max_length=TOKENS_MAX)

    @model_validator(mode="after")
    def _check_ids(self) -> DetokenizeRequest:
        for i, token in enumerate(self.tokens):
            if not 0 <= token <= TOKEN_ID_MAX:
                raise key_error("tokens", f"tokens[{i}] = {token} is not a token id (0 to {TOKEN_ID_MAX})")
        return self


class DetokenizeResponse(BaseModel):
    prompt: str
