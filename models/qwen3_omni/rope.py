"""M-RoPE position ids of a Qwen3-Omni thinker prompt (HF's ``get_rope_index``) and the decode offset.

Pure functions of the prompt's ids, its images' patch grids and its audio clips' lengths: the front end computes them
per request (numpy and plain Python only: importing this module loads no torch), and they travel with the request.

Every position is a triple (temporal, height, width). A text token takes one value on the three axes: the largest
position so far plus one. An image span (its ``image_token_id`` placeholders, right after ``vision_start_token_id``)
is a grid of merged patches, (t, h / merge, w / merge) in row-major order, whose token at (i, j, k) takes
(start + i * position_id_per_seconds, start + j, start + k), ``start`` being the position the span's first token
would take as text. An audio span (its ``audio_token_id`` placeholders, right after ``audio_start_token_id``)
counts on like text. The decode offset ``rope_delta`` = (largest position + 1) - prompt length: the token at cache
position p (p >= prompt length) takes p + rope_delta on every axis.

Left out: video (``video_token_id`` spans, whose temporal positions depend on seconds per grid) and
``use_audio_in_video`` (a video's audio interleaved with its frames); a prompt with them is a ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from models.qwen3_omni.token_counts import audio_token_count, image_token_count

__all__ = ["RopeTokens", "audio_token_count", "image_token_count", "rope_index", "decode_position"]


@dataclass(frozen=True)
class RopeTokens:
    """What the positions depend on, from config.json's ``thinker_config``."""

    image_token_id: int
    """The placeholder of one merged image patch."""
    audio_token_id: int
    """The placeholder of one audio-encoder output frame."""
    video_token_id: int
    """The placeholder of one merged video patch (video is not supported: named in the error)."""
    vision_start_token_id: int
    """The token before an image's placeholders."""
    audio_start_token_id: int
    """The token before an audio clip's placeholders."""
    spatial_merge_size: int = 2
    """Patches merged per side into one token (``vision_config.spatial_merge_size``)."""
    position_id_per_seconds: int = 25
    """Temporal step between frames of a grid (``position_id_per_seconds``); an image has one frame."""
    audio_n_window: int = 50
    """``audio_config.n_window``: half the audio encoder's chunk of log-mel frames."""

    @classmethod
    def from_hf(cls, thinker_config: dict[str, Any]) -> "RopeTokens":
        """From config.json's ``thinker_config`` dict; ValueError naming a missing token id. Missing numbers take
        transformers' defaults for this model."""
        ids = {}
        for key in ("image_token_id", "audio_token_id", "video_token_id", "vision_start_token_id",
                    "audio_start_token_id"):
            if not isinstance(thinker_config.get(key), int):
                raise ValueError(f"thinker_config.{key} must be a token id, got {thinker_config.get(key)!r}")
            ids[key] = thinker_config[key]
        vision = thinker_config.get("vision_config") or {}
        audio = thinker_config.get("audio_config") or {}
        return cls(**ids, spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
                   position_id_per_seconds=int(thinker_config.get("position_id_per_seconds", 25)),
                   audio_n_window=int(audio.get("n_window", 50)))


def _span(ids: Sequence[int], start: int, token: int, n: int, what: str) -> None:
    """ValueError unless ``ids[start:start + n]`` are all ``token`` and the run ends there."""
    end = start + n
    run = end <= len(ids) and all(x == token for x in ids[start:end])
    if not run or (end < len(ids) and ids[end] == token):
        have = next((j for j in range(start, len(ids)) if ids[j] != token), len(ids)) - start
        raise ValueError(f"{what}: the prompt has {have} placeholder tokens where the input needs {n}")


def _image_positions(grid_thw: Sequence[int], tokens: RopeTokens, start: int) -> np.ndarray:
    """(3, n) positions of one image span whose first token would be at text position ``start``."""
    t, h, w = (int(x) for x in grid_thw)
    gh, gw = h // tokens.spatial_merge_size, w // tokens.spatial_merge_size
    frames = np.repeat(np.arange(t) * tokens.position_id_per_seconds, gh * gw)
    rows = np.tile(np.repeat(np.arange(gh), gw), t)
    cols = np.tile(np.arange(gw), t * gh)
    return np.stack([frames, rows, cols]).astype(np.int64) + start


def rope_index(input_ids: Sequence[int], tokens: RopeTokens, image_grids: Sequence[Sequence[int]] = (),
               audio_lengths: Sequence[int] = ()) -> tuple[np.ndarray, int]:
    """(positions (3, T) int64, rope_delta) of one prompt (see the module docstring).

    ``image_grids``: each image's patch grid (t, h, w), in prompt order (the image processor's ``image_grid_thw``);
    ``audio_lengths``: each clip's log-mel frames, in prompt order (HF's ``audio_seqlens``). ValueError when the
    prompt's placeholder spans do not match them (count or length), or it holds video."""
    ids = [int(x) for x in input_ids]
    out = np.empty((3, len(ids)), dtype=np.int64)
    images, audios = list(image_grids), list(audio_lengths)
    nxt = i = 0  # the position the next text token takes; the token index
    while i < len(ids):
        tok = ids[i]
        out[:, i] = nxt  # text, or the start token of a span
        nxt, i = nxt + 1, i + 1
        if tok == tokens.vision_start_token_id and i < len(ids) and ids[i] == tokens.image_token_id:
            if not images:
                raise ValueError(f"image: the prompt has more image spans than the {len(image_grids)} images given")
            grid = images.pop(0)
            n = image_token_count(grid, tokens.spatial_merge_size)
            _span(ids, i, tokens.image_token_id, n, f"image {len(image_grids) - len(images) - 1}")
            pos = _image_positions(grid, tokens, nxt)
            out[:, i:i + n] = pos
            nxt, i = int(pos.max()) + 1, i + n
        elif tok == tokens.audio_start_token_id and i < len(ids) and ids[i] == tokens.audio_token_id:
            if not audios:
                raise ValueError(f"audio: the prompt has more audio spans than the {len(audio_lengths)} clips given")
            frames = audios.pop(0)
            if frames <= 0:
                raise ValueError(f"audio: feature length must be positive, got {frames}")
            n = audio_token_count(frames, tokens.audio_n_window)
            _span(ids, i, tokens.audio_token_id, n, f"audio {len(audio_lengths) - len(audios) - 1}")
            out[:, i:i + n] = np.arange(nxt, nxt + n)
            nxt, i = nxt + n, i + n
        elif tok == tokens.video_token_id:
            raise ValueError("video input is not supported by this model's front end")
        elif tok in (tokens.image_token_id, tokens.audio_token_id):
            raise ValueError(f"token {tok} (a placeholder) at index {i - 1} is not inside an image or audio span")
    if images or audios:
        raise ValueError(f"the prompt has spans for {len(image_grids) - len(images)} of {len(image_grids)} images "
                         f"and {len(audio_lengths) - len(audios)} of {len(audio_lengths)} audio clips")
    return out, nxt - len(ids)


def decode_position(cache_position: int, rope_delta: int) -> int:
    """The rotary position (the same on every axis) of the token at ``cache_position`` after the prompt."""
    return cache_position + rope_delta
