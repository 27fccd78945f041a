"""What goes into the talker and how its codes come out: HF ``Qwen3OmniMoeForConditionalGeneration.generate``'s
talker inputs as functions of one request's tensors, the talker's sampling defaults, and a reference generation loop.

The talker's prompt (`prefill_embeds`) is the user part then the assistant part:

- user part: every position of the chat's user turns (`user_positions`: a position belongs to the turn opened by
  the latest ``<|im_start|>`` at or before it); a placeholder position (image/audio/video, `multimodal_mask`) takes
  ``hidden_projection`` of the thinker's accept-layer hidden state, any other ``text_projection`` of the thinker's
  input embedding;
- assistant part, 9 positions (``ASSISTANT_PREFIX``): ``text_projection`` of the thinker embeddings of
  ``<|im_start|>``, ``assistant``, ``\\n``; four ``tts_pad``; ``tts_bos``; the first generated text token - plus,
  from the fourth position on, the codec embeddings of [nothink, think_bos, think_eos, speaker, codec_pad,
  codec_bos].

Each decode step's input (`step_embeds`) is the sum of the previous frame's G codec embeddings plus one text entry
(`TextFeed`): the projected thinker embeddings of the generated text tokens from the second one on, then
``tts_eos``, then ``tts_pad`` for every later step.

Sampling (`TalkerSampling`, HF's defaults): codebook 0 with temperature 0.9, top-k 50, top-p 1.0, a repetition
penalty of 1.05 over the codebook-0 tokens generated so far and the codec special tokens suppressed; the residual
codebooks (`TalkerSampling.residual`) with top-k 50, top-p 0.8 at temperature 1. The engine's sampler
(engine/sampling.py) has no repetition penalty: `CodecLogitsProcessor` applies it, and the suppression, to the logits
before the engine samples.
Tensors here are one request's, without a batch dimension, unless a docstring says (B, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from models.qwen3_omni.talker import OmniTokens, Talker
from mstar_dist.engine.kv_cache import StaticKVCache
from mstar_dist.engine.sampling import SamplingParams

ASSISTANT_PREFIX = 9
"""Positions of the assistant part of the talker's prompt (3 prompt tokens, 4 pads, bos, the first text token)."""


# ---- cutting the thinker's prompt ---------------------------------------------------------------------------------

def user_positions(input_ids: torch.Tensor, tokens: OmniTokens) -> torch.Tensor:
    """input_ids (S,) of the thinker's prompt -> the positions (U,) int64, in order, of its user turns: position p
    is a user position when the token after the latest ``<|im_start|>`` at or before p (position 0's when there is
    none) is ``user``; a turn's ``<|im_start|>``, role, content, ``<|im_end|>`` and newline all count."""
    S = input_ids.shape[0]
    pos = torch.arange(S, device=input_ids.device)
    starts = torch.where(input_ids == tokens.im_start, pos, torch.full_like(pos, -1))
    latest = torch.cummax(starts, dim=0).values.clamp_min(0)
    role = input_ids[(latest + 1).clamp_max(S - 1)]
    return torch.nonzero(role == tokens.user).flatten()


def assistant_start(input_ids: torch.Tensor, tokens: OmniTokens) -> int:
    """The position of the last ``<|im_start|>assistant`` of the prompt (S,); ValueError when it has none (the
    chat template's generation prompt opens the assistant turn)."""
    hits = torch.nonzero((input_ids[:-1] == tokens.im_start) & (input_ids[1:] == tokens.assistant)).flatten()
    if not hits.numel():
        raise ValueError("the prompt has no '<|im_start|>assistant' turn: the talker starts from the assistant turn "
                         "the chat template's generation prompt opens")
    return int(hits[-1])


def multimodal_mask(input_ids: torch.Tensor, tokens: OmniTokens) -> torch.Tensor:
    """Bool mask of the image/audio/video placeholder positions of ``input_ids``."""
    return torch.isin(input_ids, torch.tensor(tokens.multimodal, dtype=input_ids.dtype, device=input_ids.device))


def prompt_ids(user_ids: torch.Tensor, tokens: OmniTokens) -> torch.Tensor:
    """The talker prompt's token ids (U + 9,): the user ids, then ``tts_pad`` for the assistant part; what the
    multimodal position rules (rope.py) read for the talker's prompt."""
    return torch.cat((user_ids, user_ids.new_full((ASSISTANT_PREFIX,), tokens.tts_pad)))


# ---- the talker's inputs ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TtsEmbeds:
    """``text_projection`` of the thinker embeddings of the three tts tokens, each (H,)."""

    bos: torch.Tensor
    """Opens the text stream (the assistant part's eighth position)."""
    eos: torch.Tensor
    """The text has ended (the step after the last text token)."""
    pad: torch.Tensor
    """No text (the assistant part's pads, every step after ``eos``)."""


def tts_embeds(talker: Talker, thinker_rows: torch.Tensor) -> TtsEmbeds:
    """thinker_rows (3, Dt): the thinker's input embeddings of [tts_bos, tts_eos, tts_pad] -> their projections."""
    bos, eos, pad = talker.text_projection(thinker_rows[None])[0]
    return TtsEmbeds(bos=bos, eos=eos, pad=pad)


def prefill_embeds(talker: Talker, *, user_embeds: torch.Tensor, user_hidden: torch.Tensor,
                   user_multimodal: torch.Tensor, assistant_embeds: torch.Tensor, speaker_id: int, tts: TtsEmbeds
                   ) -> torch.Tensor:
    """The talker's prompt embeddings (U + 9, H) (see the module docstring).

    user_embeds, user_hidden (U, Dt): the thinker's input embeddings and accept-layer hidden states at the user
    positions (`user_positions`); user_multimodal (U,) bool: which of them are placeholders; assistant_embeds (4, Dt):
    the thinker's input embeddings of ``<|im_start|>``, ``assistant``, ``\\n`` and the first generated token;
    speaker_id: the voice's codec id (``TalkerConfig.speaker_id``)."""
    H = talker.config.text.hidden_size
    if assistant_embeds.shape[0] != 4:
        raise ValueError(f"prefill_embeds: assistant_embeds must hold 4 rows, got {tuple(assistant_embeds.shape)}")
    user = user_embeds.new_empty((user_embeds.shape[0], H))
    mm = user_multimodal.bool()
    if mm.any():
        user[mm] = talker.hidden_projection(user_hidden[mm])
    user[~mm] = talker.text_projection(user_embeds[~mm])
    prompt = talker.text_projection(assistant_embeds)  # (4, H)
    text = torch.cat((prompt[:3], tts.pad.expand(4, H), tts.bos[None], prompt[3:4]))  # (9, H)
    codec = talker.config.codec
    ids = torch.tensor([codec.nothink, codec.think_bos, codec.think_eos, speaker_id, codec.pad, codec.bos],
                       device=text.device)
    codes = torch.cat((text.new_zeros((3, H)), talker.model.codec_embedding(ids)))  # (9, H)
    return torch.cat((user, text + codes))


def step_embeds(talker: Talker, codes: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """codes (B, G) of the frame just made, text (B, H) from `TextFeed` -> the next decode step's input (B, 1, H)."""
    cp = talker.code_predictor.model.codec_embedding
    parts = [talker.model.codec_embedding(codes[:, :1])] + [cp[j - 1](codes[:, j:j + 1])
                                                           for j in range(1, codes.shape[1])]
    return torch.cat(parts, dim=1).sum(dim=1, keepdim=True) + text[:, None]


class TextFeed:
    """The talker's text entry for each decode step, fed as the thinker streams its text.

    ``push`` the projected thinker embeddings (``Talker.text_projection``) of the generated text tokens from the
    second one on (the first is in the prompt), ``finish`` when the thinker's text has ended (its EOS token is never
    pushed). ``take`` hands step g entry g, then ``tts_eos`` once, then ``tts_pad`` for ever; None while the thinker
    has not produced step g's entry yet (the talker waits)."""

    def __init__(self, tts: TtsEmbeds) -> None:
        self.tts = tts
        self._rows: list[torch.Tensor] = []
        self._finished = False
        self._step = 0

    def push(self, projected: torch.Tensor) -> None:
        """projected (n, H): the next n text entries."""
        if self._finished:
            raise RuntimeError("TextFeed.push after finish()")
        self._rows.extend(projected.unbind(0))

    def finish(self) -> None:
        self._finished = True

    @property
    def finished(self) -> bool:
        return self._finished

    def take(self) -> torch.Tensor | None:
        """The next step's entry (H,), or None when the thinker has not produced it yet."""
        g, n = self._step, len(self._rows)
        if g < n:
            entry = self._rows[g]
        elif not self._finished:
            return None
        else:
            entry = self.tts.eos if g == n else self.tts.pad
        self._step += 1
        return entry


# ---- sampling -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TalkerSampling:
    """How codebook 0 is sampled; the defaults are HF ``generate``'s talker defaults."""

    temperature: float = 0.9
    """0 = greedy (then the residual codebooks are greedy too, as HF mirrors ``do_sample``)."""
    top_k: int = 50
    """Keep the k most likely codes; 0 = off."""
    top_p: float = 1.0
    """Nucleus mass; 1 = off."""
    repetition_penalty: float = 1.05
    """Divides (multiplies, when negative) the logit of every codebook-0 code generated so far; 1 = off."""
    min_p: float = 0.0
    """Codebook 0 keeps only codes at least min_p x as likely as the most likely one (after temperature); 0 = off
    (HF's talker has none)."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every codebook-0 code generated so far (vLLM's); 0 = off."""
    frequency_penalty: float = 0.0
    """Subtracted from a codebook-0 code's logit once per time it was generated (vLLM's); 0 = off."""

    def __post_init__(self) -> None:
        p = self.repetition_penalty
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or p <= 0:
            raise ValueError(f"talker repetition_penalty must be a finite number > 0, got {p!r}")
        try:  # the engine's checks of temperature, top_p, top_k, min_p and the penalties' ranges
            SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                           presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)
        except ValueError as exc:
            raise ValueError(f"talker sampling: {exc}") from None

    def params(self, seed: int | None) -> SamplingParams:
        """The engine's sampling parameters of codebook 0 (after `CodecLogitsProcessor`, which applies the
        penalties)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              seed=seed)

    def processor(self, vocab_size: int, suppress_tokens: tuple[int, ...] | list[int]) -> CodecLogitsProcessor:
        """The logits processing of codebook 0 with these penalties."""
        return CodecLogitsProcessor(vocab_size, suppress_tokens, self.repetition_penalty,
                                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)

    def residual(self, seed: int | None) -> SamplingParams:
        """The residual codebooks' parameters: HF's fixed top-k 50 and top-p 0.8 at temperature 1, greedy when
        codebook 0 is."""
        return SamplingParams(temperature=0.0 if self.temperature == 0 else 1.0, top_p=0.8, top_k=50, seed=seed)


class CodecLogitsProcessor:
    """The talker's own logits processing before sampling codebook 0: HF's ``RepetitionPenaltyLogitsProcessor``
    (over the codes generated so far, not the prompt), vLLM's frequency and presence penalties (over the same codes),
    then ``SuppressTokensLogitsProcessor``.

    The history is a (B, V) count of the codes each row has generated (`record` adds a step's codes; a bool mask
    serves a processor without frequency and presence penalties), so rows of different lengths share one call."""

    def __init__(self, vocab_size: int, suppress_tokens: tuple[int, ...] | list[int], repetition_penalty: float,
                 *, presence_penalty: float = 0.0, frequency_penalty: float = 0.0) -> None:
        self.vocab_size = vocab_size
        self.penalty = float(repetition_penalty)
        self.presence, self.frequency = float(presence_penalty), float(frequency_penalty)
        self.suppress = torch.zeros(vocab_size, dtype=torch.bool)
        self.suppress[list(suppress_tokens)] = True

    def logit_bias(self) -> torch.Tensor:
        """(V,) fp32: -inf at the suppressed codes, 0 elsewhere - the suppression alone, as the KV engine's
        ``logit_bias`` takes it (the repetition penalty has no engine counterpart)."""
        return torch.zeros(self.vocab_size).masked_fill(self.suppress, float("-inf"))

    def history(self, rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """An empty history (rows, V) of counts."""
        return torch.zeros((rows, self.vocab_size), dtype=torch.float32, device=device)

    @staticmethod
    def record(seen: torch.Tensor, codes: torch.Tensor) -> None:
        """Add codes (B,) to the history (B, V), in place."""
        if seen.dtype == torch.bool:
            seen.scatter_(1, codes.view(-1, 1), True)
        else:
            seen.scatter_add_(1, codes.view(-1, 1), torch.ones((codes.numel(), 1), dtype=seen.dtype,
                                                               device=seen.device))

    def __call__(self, logits: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """logits (B, V) fp32, seen (B, V) counts (or bool) -> processed logits (B, V) (a new tensor)."""
        made = seen if seen.dtype == torch.bool else seen > 0
        if self.penalty != 1.0:
            penalised = torch.where(logits < 0, logits * self.penalty, logits / self.penalty)
            logits = torch.where(made, penalised, logits)
        if self.presence or self.frequency:
            logits = logits - self.frequency * seen.to(logits.dtype) - self.presence * made.to(logits.dtype)
        return logits.masked_fill(self.suppress.to(logits.device), float("-inf"))


# ---- a reference generation loop ----------------------------------------------------------------------------------

Code0Pick = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(logits (1, V) fp32, history (1, V) bool) -> code (1,): how codebook 0 is chosen."""
ResidualPick = Callable[[torch.Tensor, int], torch.Tensor]
"""(logits (1, V) fp32, codebook 1..G-1) -> code (1,): how a residual codebook is chosen."""


@torch.inference_mode()
def generate_codes(talker: Talker, prompt: torch.Tensor, feed: TextFeed, *, max_frames: int, pick_code0: Code0Pick,
                   pick_residual: ResidualPick) -> torch.Tensor:
    """One request's frames (n, G), n <= max_frames, generated as HF's talker ``generate``: prefill ``prompt``
    (T, H) at positions 0..T-1, then per step pick codebook 0 (stop at codec EOS or after ``max_frames``), let the
    code predictor fill the frame, and feed `step_embeds` of it with the feed's next entry. ``feed`` must be
    finished or hold every entry the loop takes (RuntimeError otherwise). A single-request loop over the engine's
    cache, for tests and as the definition the serving walk follows step by step."""
    t = talker.config.text
    T = prompt.shape[0]
    cache = StaticKVCache(t.n_layers, talker.local_kv_heads, t.head_dim, max_slots=1, max_seq_len=T + max_frames + 1,
                          dtype=prompt.dtype, device=prompt.device)
    slot = cache.alloc()
    cache.bind([slot], [0], T)
    logits, hidden = talker(prompt[None], torch.arange(T, device=prompt.device)[None], cache, last_only=True,
                            return_hidden=True)
    seen = torch.zeros((1, t.vocab_size), dtype=torch.float32, device=prompt.device)
    frames: list[torch.Tensor] = []
    while True:
        code0 = pick_code0(logits[:, -1], seen)  # (1,)
        if int(code0) == talker.config.codec.eos or len(frames) == max_frames:
            break
        CodecLogitsProcessor.record(seen, code0)
        residual = talker.code_predictor.residual_codes(hidden[:, -1], talker.model.codec_embedding(code0),
                                                        pick_residual)
        frames.append(torch.cat((code0[:, None], residual), dim=1))  # (1, G)
        text = feed.take()
        if text is None:
            raise RuntimeError(f"generate_codes: the text feed has no entry for step {len(frames)} and is not finished")
        pos = T + len(frames) - 1
        cache.bind([slot], [pos], 1)
        logits, hidden = talker(step_embeds(talker, frames[-1], text[None]),
                                torch.tensor([[pos]], device=prompt.device), cache, return_hidden=True)
    G = talker.config.num_code_groups
    return torch.cat(frames) if frames else torch.empty((0, G), dtype=torch.long, device=prompt.device)
