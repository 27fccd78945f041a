"""Small deterministic media files for the Qwen3-Omni tests (unit and e2e): PNG images, WAV clips, and the expected
audio of a chunk of codec frames."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

CHUNK, LEFT_CONTEXT = 25, 25
"""The code2wav chunk policy of the family's default (``model_kwargs.chunk`` / ``left_context``)."""
FRAME_SAMPLES, CHUNK_LOSS = 1920, 555
"""Samples per codec frame of the tiny checkpoint's code2wav (24 kHz), and the samples its causal transposed convs
crop from every decode: a chunk of n new frames is ``n * FRAME_SAMPLES - CHUNK_LOSS`` samples."""


def png(width: int = 64, height: int = 48, seed: int = 0, noise: bool = True) -> bytes:
    """Random pixels (``noise``), or one flat colour (a big image in few bytes)."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8) if noise else \
        np.full((height, width, 3), 90, dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def wav(seconds: float = 1.3, rate: int = 16000, freq: float = 500.0, subtype: str = "PCM_16") -> bytes:
    """A sine tone as a WAV file (``subtype`` "PCM_U8" makes a long clip small)."""
    import soundfile

    t = np.arange(int(seconds * rate)) / rate
    out = io.BytesIO()
    soundfile.write(out, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), rate, format="WAV",
                    subtype=subtype)
    return out.getvalue()


def chunk_frames(pcm_bytes: int) -> int:
    """New frames of an audio chunk of ``pcm_bytes`` bytes of PCM16 (ValueError when no whole count fits)."""
    frames, rest = divmod(pcm_bytes // 2 + CHUNK_LOSS, FRAME_SAMPLES)
    if rest:
        raise ValueError(f"{pcm_bytes} bytes of PCM16 are no whole number of codec frames")
    return frames


def check_chunks(sizes: list[int]) -> int:
    """Assert that audio chunks of these byte sizes follow the chunk policy (every chunk CHUNK new frames but the
    last, which holds 1..CHUNK); returns the frames in all."""
    frames = [chunk_frames(n) for n in sizes]
    assert frames, "no audio chunk"
    assert all(f == CHUNK for f in frames[:-1]) and 1 <= frames[-1] <= CHUNK, frames
    return sum(frames)
