"""Tokenizer + chat template for an HF-layout weights directory, and a streaming detokenizer."""

from __future__ import annotations

import codecs
import functools
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders
from tokenizers.decoders import DecodeStream

from models.llama.chat_template import compile_chat_template, render_chat_template

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens of tokenizer_config.json that a chat template sees (HF's ``special_tokens_map``)."""


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes->unicode table: byte-level BPE spells byte b as one printable char."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in table.values())
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


class ChatTokenizer:
    """`tokenizer.json` (HF tokenizers) + the `chat_template` of `tokenizer_config.json` (jinja2)."""

    def __init__(self, weights_dir: str | Path) -> None:
        d = Path(weights_dir).expanduser()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if not (d / name).is_file():
                raise FileNotFoundError(f"{d / name} is missing (prepare the directory with "
                                        f"scripts/prepare_weights.py)")
        self._tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        self.special_tokens = {key: _token_content(cfg[key]) for key in SPECIAL_TOKEN_KEYS
                               if _token_content(cfg.get(key)) is not None}
        """Named special tokens the config sets (``{"bos_token": "<|im_start|>", ...}``), as HF passes them."""
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self._template = compile_chat_template(template) if template is not None else None
        self.eos_token_ids = self._eos_ids(d)
        """Ids that end generation: generation_config.json's eos_token_id plus the tokenizer's eos_token."""
        self._special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        self._byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        self._id_bytes: list[bytes] | None = None
        self._pieces: dict[int, tuple[str, bytes]] = {}
        self._added = self._added_splitter()
        self._piece_ids = functools.lru_cache(maxsize=PIECE_CACHE_SIZE)(self._encode_piece)

    def _eos_ids(self, d: Path) -> tuple[int, ...]:
        ids: set[int] = set()
        gen = d / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            ids.add(self._tok.token_to_id(self.eos_token))
        return tuple(sorted(ids))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the model's chat template, as HF's
        `apply_chat_template(messages, tokenize=False)` does (models/llama/chat_template.py)."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat_template in tokenizer_config.json")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must be {{'role': str, 'content': str}}, got {m!r}")
        return render_chat_template(self._template, messages, add_generation_prompt=add_generation_prompt,
                                    special_tokens=self.special_tokens)

    def encode_prompt(self, prompt: str | None, messages: list[dict[str, str]] | None) -> list[int]:
        """The ids of a request's prompt: ``messages`` through the chat template, else the raw ``prompt``. What
        ``LlamaChat.preprocess`` uses, and what an HTTP intake process runs in its place (``prompt_encoder``).

        The text is cut at its added tokens (``<|im_start|>``, ...) and the pieces between are encoded apart, each
        remembered: the parts of a prompt that the template writes on every request (SmolLM2's default system
        prompt, its role headers) then cost a lookup, not the pre-tokenizer's regular expressions (a short chat's
        encoding is dominated by them, and an intake takes a burst's requests one after another,
        docs/architecture.md §2). The tokenizer cuts at added tokens first too,
        so the ids are the whole text's; where its added tokens would take in the whitespace around them, or a
        normalizer runs first, the text is encoded whole."""
        text = self.apply_chat_template(messages) if messages is not None else prompt
        if self._added is None or not isinstance(text, str):
            return self.encode(text)
        splitter, added_ids = self._added
        ids: list[int] = []
        for i, piece in enumerate(splitter.split(text)):
            if i % 2:
                ids.append(added_ids[piece])
            elif len(piece) > PIECE_CACHE_MAX_CHARS:
                ids += self._encode_piece(piece)
            elif piece:
                ids += self._piece_ids(piece)
        return ids

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        return tuple(self._tok.encode(piece, add_special_tokens=False).ids)

    def _added_splitter(self) -> tuple[re.Pattern, dict[str, int]] | None:
        """A pattern whose ``split`` cuts text at the added tokens (kept, as the odd pieces) and their ids, or None
        where encoding the pieces apart could give other ids than the whole text's."""
        added = self._tok.get_added_tokens_decoder()
        if not added or self._tok.normalizer is not None \
                or any(t.lstrip or t.rstrip or t.single_word for t in added.values()):
            return None
        ids = {t.content: i for i, t in added.items()}
        # longest first: at one position the tokenizer takes the longest added token that matches
        alternatives = "|".join(re.escape(c) for c in sorted(ids, key=len, reverse=True))
        return re.compile(f"({alternatives})"), ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (e.g. <|im_start|>) map to their ids;
        add_special_tokens adds what the post-processor adds (a BOS for some models)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = True, method: str | None = None, *,
                            spaces_between: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens, method=method,
                                  spaces_between=spaces_between)

    def token_piece(self, token_id: int) -> tuple[str, bytes]:
        """One token alone as (text, bytes), for logprobs: byte-level BPE gives its exact bytes (the text decodes
        them, U+FFFD for an incomplete character); otherwise the tokenizer decodes it alone. An added token is its
        content."""
        piece = self._pieces.get(token_id)
        if piece is None:
            if self._byte_level:
                raw = self._token_bytes()[token_id] if 0 <= token_id < self.vocab_size else b""
                piece = (raw.decode("utf-8", errors="replace"), raw)
            else:
                text = self._tok.decode([token_id], skip_special_tokens=False)
                piece = (text, text.encode())
            self._pieces[token_id] = piece
        return piece

    def _token_bytes(self) -> list[bytes]:
        """Byte-level BPE: the exact bytes of every id (added tokens: their text in UTF-8), built once."""
        if self._id_bytes is None:
            table = _gpt2_byte_decoder()
            added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
            out = []
            for i in range(self.vocab_size):
                piece = added.get(i)
                if piece is not None:
                    out.append(piece.encode())
                else:
                    token = self._tok.id_to_token(i) or ""
                    out.append(bytes(table[c] for c in token) if all(c in table for c in token)
                               else token.encode())
            self._id_bytes = out
        return self._id_bytes


PIECE_CACHE_SIZE = 1024
PIECE_CACHE_MAX_CHARS = 8192
"""``ChatTokenizer.encode_prompt`` remembers the ids of up to ``PIECE_CACHE_SIZE`` pieces of text between added tokens,
each at most ``PIECE_CACHE_MAX_CHARS`` long (longer ones are encoded every time)."""

DETOKENIZERS = ("bytes", "stream", "window")
"""IncrementalDecoder's methods: a table of each id's bytes (byte-level BPE only), tokenizers' DecodeStream, or
re-decoding a window of ids in Python (the method before DecodeStream, kept as the reference and the fallback)."""


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    `push(ids)` returns the text completed by these ids ('' while a multi-byte character is still
    incomplete); `flush()` returns what is left at the end (an incomplete tail as U+FFFD). The
    concatenated deltas equal `tokenizer.decode(all_ids)` for valid UTF-8 output.
    `spaces_between` False (vLLM's ``spaces_between_special_tokens``, with special tokens kept): an added token that
    follows another is its raw content, whatever spacing the tokenizer's decoder would put before it, as vLLM does
    for fast tokenizers; byte-level BPE puts none, so there it changes nothing.
    `method` (default: "bytes" for byte-level BPE, else "stream"; the fastest first):
      * "bytes": ids map to exact bytes fed to an incremental UTF-8 decoder, O(1) per token; faster than
        DecodeStream on SmolLM2's tokenizer, so byte-level BPE keeps it;
      * "stream": `tokenizers.decoders.DecodeStream` re-decodes a short window of ids in Rust and holds back
        text ending in U+FFFD; faster than "window", whose deltas it reproduces exactly;
      * "window": the same algorithm in Python (the window is kept in every non-bytes method: `flush()` decodes
        the held-back tail from it, and "stream" falls back to it should DecodeStream refuse a window whose text
        does not extend the previous one).
    """

    def __init__(self, tokenizer: ChatTokenizer, skip_special_tokens: bool = True, method: str | None = None,
                 spaces_between: bool = True) -> None:
        method = method or ("bytes" if tokenizer._byte_level else "stream")
        if method not in DETOKENIZERS or (method == "bytes" and not tokenizer._byte_level):
            raise ValueError(f"detokenizer method {method!r}: one of {DETOKENIZERS} ('bytes' for byte-level BPE)")
        self.method = method
        self._tok = tokenizer
        self._skip = tokenizer._special_ids if skip_special_tokens else frozenset()
        self._bytes = tokenizer._token_bytes() if method == "bytes" else None
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stream = DecodeStream(skip_special_tokens=False) if method == "stream" else None
        self._ids: list[int] = []  # every id pushed (non-bytes methods); the window is ids[_prefix:]
        self._prefix = self._read = 0
        self._raw_added = None if spaces_between or skip_special_tokens or method == "bytes" else \
            {i: t.content for i, t in tokenizer._tok.get_added_tokens_decoder().items()}
        """Added token id -> its content, when one that follows another is written raw (``spaces_between`` off)."""
        self._after_added = False

    def push(self, ids: int | Iterable[int]) -> str:
        ids = [ids] if isinstance(ids, int) else [i for i in ids]
        ids = [i for i in ids if i not in self._skip]
        if self._bytes is not None:
            return self._utf8.decode(b"".join(self._bytes[i] for i in ids))
        if self._raw_added is not None:
            return "".join(self._raw_delta(i) for i in ids)
        if self._stream is None:
            self._ids += ids
            return self._window_delta(final=False)
        return "".join(self._stream_delta(i) for i in ids)

    def _raw_delta(self, token_id: int) -> str:
        """One id's text where an added token after another is written as its content."""
        if self._stream is None:
            self._ids.append(token_id)
            text = self._window_delta(final=False)
        else:
            text = self._stream_delta(token_id)
        raw = self._raw_added.get(token_id)
        if raw is not None and self._after_added:
            text = raw
        self._after_added = raw is not None
        return text

    def flush(self) -> str:
        if self._bytes is not None:
            return self._utf8.decode(b"", final=True)
        return self._window_delta(final=True)

    def _stream_delta(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                text = self._stream.step(self._tok._tok, token_id)
            except Exception:  # DecodeStreamError: the window's text does not start with its prefix's
                self._stream = None
            else:
                if text is None:
                    return ""
                self._prefix, self._read = self._read, len(self._ids)  # DecodeStream moved its window the same way
                return text
        return self._window_delta(final=False)

    def _window_delta(self, final: bool) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read], skip_special_tokens=False)
        text = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=False)
        if len(text) <= len(prefix_text) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text):]


def grammar_tokenizer(weights_dir: str | Path, vocab_size: int) -> Any:
    """The ``llguidance.LLTokenizer`` of an HF-layout directory's tokenizer.json, its vocabulary ``vocab_size`` wide
    (the model's logits) and its EOS the tokenizer's ``eos_token_ids`` (what structured output ends with): the KV
    engine's ``grammar_tokenizer`` (engine/grammar.py)."""
    import llguidance

    text = (Path(weights_dir).expanduser() / "tokenizer.json").read_text()
    eos = list(ChatTokenizer(weights_dir).eos_token_ids)
    return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos or None)
