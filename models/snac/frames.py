"""Orpheus TTS's 7-code frames over the SNAC 24 kHz codebooks, and decoding a window of frames.

Orpheus speaks one frame (one code of codebook 0, `frame_samples` = 2048 samples at 24 kHz) as 7 tokens
`[a, b1, c1, c2, b2, c3, c4]`: codebook 0 gets a, codebook 1 gets b1, b2 and codebook 2 gets c1, c2, c3, c4,
each in time order. The token of frame slot s carries code `token_id - audio_offset - s * codebook_size`
(Orpheus: audio_offset 128266 = `<custom_token_10>`, codebook_size 4096), the convention of the Orpheus-TTS
decoder (`redistribute_codes`, `convert_to_audio`).
"""

from __future__ import annotations

import torch

from models.snac.model import GivenNoise, SnacDecoder

FRAME_CODES = 7
"""Tokens per Orpheus frame."""
ORPHEUS_AUDIO_OFFSET = 128266
"""Token id of code 0 in frame slot 0 for Orpheus (its Llama-3 tokenizer's `<custom_token_10>`)."""
_SLOTS = ((0,), (1, 4), (2, 3, 5, 6))
"""Frame slots of codebook 0, 1, 2, each in time order."""


def frames_to_codes(frames: torch.Tensor) -> list[torch.Tensor]:
    """Frames (F, 7) -> SNAC codes [(1, F), (1, 2F), (1, 4F)] (same dtype and device)."""
    if frames.dim() != 2 or frames.shape[1] != FRAME_CODES:
        raise ValueError(f"frames must have shape (F, {FRAME_CODES}), got {tuple(frames.shape)}")
    return [frames[:, list(slots)].reshape(1, -1) for slots in _SLOTS]


def codes_to_frames(codes: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `frames_to_codes`: [(1, F), (1, 2F), (1, 4F)] -> frames (F, 7)."""
    n_frames = codes[0].shape[-1]
    frames = codes[0].new_empty(n_frames, FRAME_CODES)
    for codes_i, slots in zip(codes, _SLOTS):
        if codes_i.shape != (1, n_frames * len(slots)):
            raise ValueError(f"codes have shapes {[tuple(c.shape) for c in codes]}, expected (1, F), (1, 2F), (1, 4F)")
        frames[:, list(slots)] = codes_i.view(n_frames, len(slots))
    return frames


def codes_from_tokens(token_ids: torch.Tensor, audio_offset: int, codebook_size: int) -> torch.Tensor:
    """Audio token ids (1-D, starting at a frame boundary: the first token after start-of-speech) -> codes
    (F, 7) int64 of the complete frames; a trailing partial frame is left out.

    ValueError naming the first position (index into token_ids) whose code is outside [0, codebook_size) for
    its slot, e.g. a non-audio token the caller did not strip.
    """
    n = token_ids.numel() // FRAME_CODES * FRAME_CODES
    ids = token_ids.reshape(-1)[:n].to(torch.int64)
    slot = torch.arange(n, device=ids.device) % FRAME_CODES
    codes = ids - audio_offset - slot * codebook_size
    bad = ((codes < 0) | (codes >= codebook_size)).nonzero()
    if bad.numel():
        pos = int(bad[0, 0])
        low = audio_offset + pos % FRAME_CODES * codebook_size
        raise ValueError(f"audio token {int(ids[pos])} at position {pos} (frame {pos // FRAME_CODES}, slot "
                         f"{pos % FRAME_CODES}) is outside that slot's ids [{low}, {low + codebook_size})")
    return codes.view(-1, FRAME_CODES)


@torch.inference_mode()
def decode_frames(decoder: SnacDecoder, frames: torch.Tensor, n_new: int, *, lookahead: int = 0,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Decode all F frames (F, 7) together and return only the samples of the `n_new` frames that end
    `lookahead` frames before the last: float32 audio (n_new * frame_samples,) on the decoder's device.

    The frames before them are left context; the decoder's convolutions are not causal, so `lookahead`
    frames after them (decoded but not returned) make their audio match a decode of the whole utterance
    more closely. lookahead=0 returns the newest frames (lowest latency). Orpheus's own streaming decoder
    decodes 4-frame windows and keeps samples 2048:4096, i.e. n_new=1, lookahead=2. Codes must be valid
    (see `codes_from_tokens`); `generator` is as in `SnacDecoder.forward`.
    """
    n_frames = frames.shape[0]
    if n_new < 1 or lookahead < 0 or n_new + lookahead > n_frames:
        raise ValueError(f"decode_frames: n_new={n_new} and lookahead={lookahead} do not fit in {n_frames} frames")
    device = next(decoder.parameters()).device
    audio = decoder(frames_to_codes(frames.to(device)), generator)  # (1, 1, F * frame_samples)
    frame_samples = decoder.config.frame_samples
    end = (n_frames - lookahead) * frame_samples
    return audio[0, 0, end - n_new * frame_samples:end].float()


def decode_windows(decoder: SnacDecoder, windows: torch.Tensor, n_new: int,
                   generators: list[torch.Generator]) -> torch.Tensor:
    """Batched :func:`decode_frames` (lookahead 0) of B windows of equal length: windows (B, F, 7) -> float32
    audio (B, n_new * frame_samples), the last ``n_new`` frames of each; row b's noise comes from ``generators[b]``
    alone (:func:`row_noise`), so a row's audio does not depend on the rows beside it."""
    B, n_frames, _ = windows.shape
    if not 1 <= n_new <= n_frames or len(generators) != B:
        raise ValueError(f"decode_windows: n_new={n_new}, {n_frames} frames, {len(generators)} generators for "
                         f"{B} windows")
    audio = decoder(window_codes(decoder, windows), row_noise(decoder, n_frames, generators))  # (B, 1, F * fs)
    return audio[:, 0, -n_new * decoder.config.frame_samples:].float()


def window_codes(decoder: SnacDecoder, windows: torch.Tensor) -> list[torch.Tensor]:
    """Windows (B, F, 7) -> the decoder's codes (B, F), (B, 2F), (B, 4F) on its device."""
    B, n_frames, _ = windows.shape
    device = next(decoder.parameters()).device
    codes = frames_to_codes(windows.reshape(B * n_frames, FRAME_CODES).to(device))  # rows of one long "frame" run
    return [c.reshape(B, -1) for c in codes]


def row_noise(decoder: SnacDecoder, n_frames: int, generators: list[torch.Generator],
              out: torch.Tensor | None = None) -> GivenNoise | None:
    """The noise of a decode of ``n_frames`` frames per window, each row's every noise block drawn at once from its own
    generator (one launch a row): (B, 1, T) views in block order, of ``out`` (rows, sum of T; rows 0..B-1 drawn, the
    rest left as they are) when given. None for a decoder without noise."""
    lengths = decoder.noise_lengths(n_frames)
    if not lengths:
        return None
    param = next(decoder.parameters())
    flat = out if out is not None else torch.empty((len(generators), sum(lengths)), device=param.device,
                                                   dtype=param.dtype)
    for row, gen in zip(flat, generators):
        row.normal_(generator=gen)
    return noise_views(flat, lengths)


def noise_views(flat: torch.Tensor, lengths: list[int]) -> GivenNoise:
    """``flat`` (B, sum of lengths) as one (B, 1, T) view per noise block."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return GivenNoise([flat[:, a:a + n].unsqueeze(1) for a, n in zip(starts, lengths)])


def to_pcm16(audio: torch.Tensor) -> torch.Tensor:
    """Float audio in [-1, 1] (clamped) -> int16 PCM, scaled by 32767 and rounded to nearest."""
    return (audio.float().clamp(-1.0, 1.0) * 32767).round().to(torch.int16)
