"""How many placeholder tokens an image or an audio clip takes in the thinker's prompt.

Pure functions of an image's patch grid and a clip's log-mel length, with no torch, so that the front end
(processor.py expanding placeholders, rope.py laying out positions) sizes a prompt without importing the encoders.
The encoders (vision.py, audio.py) produce exactly these many rows per item; tests/unit/test_qwen3omni_encoders.py
holds them to it.
"""

from __future__ import annotations

from collections.abc import Sequence

AUDIO_CONVS = 3
"""Stride-2 convolutions of the audio encoder's downsampling (time axis halved, rounded up, by each)."""


def downsampled_frames(n_frames: int, n_convs: int = AUDIO_CONVS) -> int:
    """Frames left of ``n_frames`` after ``n_convs`` convolutions of kernel 3, stride 2, padding 1 (0 stays 0)."""
    for _ in range(n_convs):
        n_frames = (n_frames - 1) // 2 + 1 if n_frames > 0 else 0
    return n_frames


def audio_token_count(n_frames: int, n_window: int = 50) -> int:
    """Audio tokens (placeholders) of a clip of ``n_frames`` log-mel frames.

    The encoder convolves chunks of ``2 * n_window`` frames apart (the last one shorter), so the count is the
    full chunks' outputs plus the tail's. Equal to transformers' ``_get_feat_extract_output_lengths`` for the
    published ``n_window`` of 50 (that function writes a full chunk's 13 tokens as a constant; this one derives it,
    so a config with another ``n_window`` still gets the count the encoder produces).
    """
    if n_frames < 0 or n_window <= 0:
        raise ValueError(f"audio_token_count: n_frames ({n_frames}) must be >= 0 and n_window ({n_window}) > 0")
    full, tail = divmod(n_frames, 2 * n_window)
    return full * downsampled_frames(2 * n_window) + downsampled_frames(tail)


def image_token_count(grid_thw: Sequence[int], spatial_merge_size: int = 2) -> int:
    """Image (or video) tokens of one item whose patch grid is ``(t, h, w)``: every ``merge x merge`` block of
    patches becomes one token of the thinker."""
    t, h, w = (int(x) for x in grid_thw)
    if min(t, h, w) <= 0 or h % spatial_merge_size or w % spatial_merge_size:
        raise ValueError(f"image grid_thw {tuple(grid_thw)}: t, h, w must be positive and h, w multiples of "
                         f"spatial_merge_size ({spatial_merge_size})")
    return t * h * w // (spatial_merge_size * spatial_merge_size)
