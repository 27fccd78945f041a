"""The special tokens of an Orpheus-TTS-style speech LLM (a Llama that writes SNAC codes as tokens).

Orpheus (canopyai/Orpheus-TTS) extends the Llama-3 tokenizer with added tokens `<custom_token_N>`:
N = 1 start_of_speech, 2 end_of_speech (the stop token), 3 start_of_human, 4 end_of_human, 5 start_of_ai;
N >= 10 are audio codes. SNAC's three levels are interleaved 1 + 2 + 4 per frame, so the model writes 7 codes a
frame and the k-th of them (k = position % 7, counted from the first audio token) is taken from its own block:
    token id = audio_offset + k * codebook_size + code,    audio_offset = id of <custom_token_10>
(Orpheus: 128266 and 4096). Every id here is looked up by token name, so a real Orpheus tokenizer.json and
the one scripts/make_speech_checkpoint.py writes are read the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

CODES_PER_FRAME = 7
"""Audio tokens per SNAC frame (1 coarse + 2 middle + 4 fine codes)."""
AUDIO_TOKEN_BASE = 10
"""N of the first audio code token `<custom_token_N>`."""
CUSTOM_TOKENS = {"start_of_speech": 1, "end_of_speech": 2, "start_of_human": 3, "end_of_human": 4,
                 "start_of_ai": 5}
"""Role -> N of its `<custom_token_N>`."""


def custom_token(n: int) -> str:
    return f"<custom_token_{n}>"


@dataclass(frozen=True)
class SpeechTokens:
    """Token ids of the speech prompt and of the audio codes, plus the tokenizer that encodes the text."""

    begin_of_text: int
    """`<|begin_of_text|>`: opens the text inside the human turn."""
    end_of_text: int
    """`<|eot_id|>`: closes the text inside the human turn."""
    start_of_speech: int
    """`<custom_token_1>`: the last prompt token; audio codes follow."""
    end_of_speech: int
    """`<custom_token_2>`: the model's stop token."""
    start_of_human: int
    """`<custom_token_3>`."""
    end_of_human: int
    """`<custom_token_4>`."""
    start_of_ai: int
    """`<custom_token_5>`."""
    audio_offset: int
    """Id of `<custom_token_10>`, the code 0 of the first position of a frame."""
    codebook_size: int
    """Codes per SNAC codebook (4096 for Orpheus's snac_24khz); the 7 positions' id blocks are this wide."""
    tokenizer: Tokenizer = field(repr=False, compare=False)
    """The text tokenizer (tokenizer.json)."""

    @classmethod
    def from_tokenizer_dir(cls, tokenizer_dir: str | Path, codebook_size: int) -> "SpeechTokens":
        """Read `tokenizer_dir/tokenizer.json` and find every id by its token name.

        FileNotFoundError without tokenizer.json; ValueError when a token is missing or the audio tokens
        `<custom_token_10>` .. `<custom_token_{9 + 7 * codebook_size}>` do not have consecutive ids.
        """
        path = Path(tokenizer_dir).expanduser() / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing")
        if not isinstance(codebook_size, int) or codebook_size <= 0:
            raise ValueError(f"codebook_size must be a positive int, got {codebook_size!r}")
        tok = Tokenizer.from_file(str(path))

        def lookup(name: str) -> int:
            i = tok.token_to_id(name)
            if i is None:
                raise ValueError(f"{path}: no token {name!r}, so this is not an Orpheus-style speech tokenizer")
            return i

        audio_offset = lookup(custom_token(AUDIO_TOKEN_BASE))
        n_audio = CODES_PER_FRAME * codebook_size
        last_name = custom_token(AUDIO_TOKEN_BASE + n_audio - 1)
        if tok.token_to_id(last_name) != audio_offset + n_audio - 1:
            raise ValueError(f"{path}: {custom_token(AUDIO_TOKEN_BASE)} has id {audio_offset}, so {last_name} "
                             f"should have id {audio_offset + n_audio - 1}, but it has {tok.token_to_id(last_name)} "
                             f"(is codebook_size={codebook_size} right?)")
        return cls(begin_of_text=lookup("<|begin_of_text|>"), end_of_text=lookup("<|eot_id|>"),
                   **{role: lookup(custom_token(n)) for role, n in CUSTOM_TOKENS.items()},
                   audio_offset=audio_offset, codebook_size=codebook_size, tokenizer=tok)

    def ids(self) -> dict[str, int]:
        """Every id and the codebook size by name (what speech.json holds)."""
        return {"begin_of_text": self.begin_of_text, "end_of_text": self.end_of_text,
                **{role: getattr(self, role) for role in CUSTOM_TOKENS},
                "audio_offset": self.audio_offset, "codebook_size": self.codebook_size}

    def prompt_ids(self, voice: str | None, text: str) -> list[int]:
        """Orpheus's prompt for `text` spoken by `voice` (None: no voice prefix).

        [start_of_human, begin_of_text] + encode("{voice}: {text}") + [end_of_text, end_of_human,
        start_of_ai, start_of_speech], as Orpheus-TTS's `_format_prompt` builds it (its tokenizer call adds
        the begin_of_text).
        """
        content = f"{voice}: {text}" if voice else text
        body = self.tokenizer.encode(content, add_special_tokens=False).ids
        return [self.start_of_human, self.begin_of_text, *body,
                self.end_of_text, self.end_of_human, self.start_of_ai, self.start_of_speech]

    def is_audio(self, token_id: int) -> bool:
        return 0 <= token_id - self.audio_offset < CODES_PER_FRAME * self.codebook_size

    def audio_code(self, token_id: int) -> tuple[int, int]:
        """(code, position in frame 0..6) of an audio token; ValueError for any other token."""
        if not self.is_audio(token_id):
            raise ValueError(f"token {token_id} is not an audio token (those are {self.audio_offset} .. "
                             f"{self.audio_offset + CODES_PER_FRAME * self.codebook_size - 1})")
        position, code = divmod(token_id - self.audio_offset, self.codebook_size)
        return code, position

    def audio_token(self, code: int, position: int) -> int:
        """The token id of `code` at audio position `position` (any count from the first audio token)."""
        if not 0 <= code < self.codebook_size:
            raise ValueError(f"code {code} is outside the codebook [0, {self.codebook_size})")
        return self.audio_offset + (position % CODES_PER_FRAME) * self.codebook_size + code
