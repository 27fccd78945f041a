"""Qwen3-Omni's preprocessing: decoded images and audio -> the encoders' inputs, and the prompt's placeholders
expanded to one token per encoder output. numpy and Pillow only (no torch): the front end and the intakes run it.

The reference is transformers' ``Qwen3OmniMoeProcessor`` with the sub-processors the checkpoint's
``preprocessor_config.json`` names (``Qwen2VLImageProcessor``, ``WhisperFeatureExtractor``); the results are equal
to theirs (tests/unit/test_qwen3omni_processor.py):

- **image** (numpy ``uint8`` ``(H, W, 3)`` RGB, what ``mstar_dist.media.image.decode_image`` gives): resized with
  Pillow (the config's ``resample``, bicubic) to the ``smart_resize`` size (each side a multiple of
  ``patch_size * merge_size``, the area within ``[min_pixels, max_pixels]``, the aspect ratio kept as closely as
  that allows), rescaled by ``rescale_factor`` and normalised by ``image_mean`` / ``image_std``, repeated
  ``temporal_patch_size`` times along time (a still image is one temporal patch), and cut into patches in the
  order the vision encoder reads them: ``(grid_h * grid_w, C * T * P * P)``, every ``merge x merge`` block of
  patches consecutive, with ``grid_thw = (1, grid_h, grid_w)``. Equal bit for bit to transformers' Pillow backend
  of the image processor (``Qwen2VLImageProcessorPil``); its torchvision backend, chosen where torchvision is
  installed, resizes with torch's bicubic instead, whose pixels can differ slightly from Pillow's.
- **audio** (mono float32 at ``sampling_rate``, what ``mstar_dist.media.audio.decode_audio`` gives): Whisper's
  log-mel (periodic Hann window of ``n_fft``, hop ``hop_length``, reflect-padded centre frames, the power spectrum
  through ``feature_size`` Slaney mel filters, log10, floored 8 below the clip's maximum, ``(x + 4) / 4``), with
  no truncation (the processor calls the extractor with ``truncation=False``): ``n_samples // hop_length`` frames
  per clip. Computed in float64; transformers' default path computes the STFT in float32 with torch, and the two
  differ by that path's rounding (about 3e-5 at most, see the test); its numpy path agrees to 1e-6.
- **prompt**: each ``<|image_pad|>`` becomes ``t * h * w / merge^2`` of itself, each ``<|audio_pad|>`` as many as
  the audio encoder outputs for the clip's frames.

Batched audio, one difference by default: transformers pads a call's clips to the longest before the STFT, so a
short clip's last frames (and its frame count, when its length is not a multiple of the hop) depend on what it is
batched with. Here each clip is computed as if alone (its features are a function of its own samples, as the
audio encoder's rows are of its features); ``batch_padding=True`` reproduces the reference's call-wide padding.
Both agree for a call of one clip.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mstar_dist.media.errors import MediaError
from models.qwen3_omni.token_counts import audio_token_count, image_token_count

PUBLISHED_PREPROCESSOR_CONFIG: dict[str, Any] = {
    "chunk_length": 300, "dither": 0.0, "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128,
    "hop_length": 160, "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessor",
    "image_std": [0.5, 0.5, 0.5], "max_pixels": 12845056, "merge_size": 2, "min_pixels": 3136, "n_fft": 400,
    "n_samples": 4800000, "nb_max_frames": 30000, "padding_side": "right", "padding_value": 0.0, "patch_size": 16,
    "processor_class": "Qwen3OmniMoeProcessor", "return_attention_mask": True, "sampling_rate": 16000,
    "temporal_patch_size": 2,
}
"""``preprocessor_config.json`` of the published ``Qwen3-Omni-30B-A3B-Instruct``."""

IMAGE_DEFAULTS: dict[str, Any] = {
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 1280, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "rescale_factor": 1 / 255, "resample": 3,
}
"""What transformers' ``Qwen2VLImageProcessor`` uses for a key its config leaves out (``resample`` 3: bicubic)."""
AUDIO_DEFAULTS: dict[str, Any] = {
    "feature_size": 80, "sampling_rate": 16000, "hop_length": 160, "n_fft": 400, "padding_value": 0.0,
    "dither": 0.0, "padding_side": "right", "n_window": 50,
}
"""What transformers' ``WhisperFeatureExtractor`` (and, for ``n_window``, ``Qwen3OmniMoeProcessor``) uses for a key
the config leaves out."""
MAX_ASPECT_RATIO = 200
"""Longest over shortest side above which ``smart_resize`` refuses an image, as transformers' does."""
LOG_FLOOR_DECADES = 8.0
"""Whisper's dynamic range: log-mel values are floored this many decades (log10) below the clip's maximum."""


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The image half of ``preprocessor_config.json`` (transformers' ``Qwen2VLImageProcessor`` keys)."""

    patch_size: int
    """Side of a square patch in pixels (16 in the published checkpoint)."""
    temporal_patch_size: int
    """Frames per temporal patch; a still image is repeated this many times."""
    merge_size: int
    """Patches merged per side into one thinker token (the vision encoder's ``spatial_merge_size``)."""
    min_pixels: int
    """Least area after resizing (``min_pixels``, or ``size.shortest_edge``)."""
    max_pixels: int
    """Largest area after resizing (``max_pixels``, or ``size.longest_edge``)."""
    image_mean: tuple[float, float, float]
    """Per-channel mean subtracted after rescaling (RGB)."""
    image_std: tuple[float, float, float]
    """Per-channel standard deviation divided by after the mean."""
    rescale_factor: float
    """Multiplies the uint8 pixels first (1/255)."""
    resample: int
    """Pillow's resampling filter for the resize (``PIL.Image.Resampling``; 3 is bicubic)."""

    def __post_init__(self) -> None:
        for key in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            if getattr(self, key) <= 0:
                raise ValueError(f"preprocessor config: {key} must be > 0, got {getattr(self, key)}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"preprocessor config: min_pixels ({self.min_pixels}) > max_pixels ({self.max_pixels})")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or 0.0 in self.image_std:
            raise ValueError(f"preprocessor config: image_mean and image_std need 3 values, std non-zero; got "
                             f"{self.image_mean} and {self.image_std}")
        if self.resample not in {int(r) for r in Image.Resampling}:
            raise ValueError(f"preprocessor config: resample must be a PIL.Image.Resampling value, got "
                             f"{self.resample}")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged block of patches."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values per patch row: channels x temporal patch x patch x patch."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size


@dataclass(frozen=True)
class AudioFeatureConfig:
    """The audio half of ``preprocessor_config.json`` (transformers' ``WhisperFeatureExtractor`` keys), plus the
    processor's ``n_window`` for token counts."""

    feature_size: int
    """Mel bands (128 in the published checkpoint)."""
    sampling_rate: int
    """The rate clips must arrive at (16000)."""
    hop_length: int
    """Samples between frames (160: 100 frames a second)."""
    n_fft: int
    """Window and FFT length in samples (400)."""
    padding_value: float
    """What shorter clips are padded with under ``batch_padding`` (silence: 0.0)."""
    n_window: int
    """Half the audio encoder's chunk in frames (the encoder convolves chunks of ``2 * n_window`` frames)."""

    def __post_init__(self) -> None:
        for key in ("feature_size", "sampling_rate", "hop_length", "n_fft", "n_window"):
            if getattr(self, key) <= 0:
                raise ValueError(f"preprocessor config: {key} must be > 0, got {getattr(self, key)}")

    @property
    def min_samples(self) -> int:
        """Shortest clip: the centre frames' reflect padding (``n_fft // 2``) needs more samples than it."""
        return self.n_fft // 2 + 1


@dataclass(frozen=True)
class PreprocessorConfig:
    """Both halves of a checkpoint's ``preprocessor_config.json``."""

    image: ImageProcessorConfig
    """How images become patches."""
    audio: AudioFeatureConfig
    """How audio becomes log-mel frames."""

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "PreprocessorConfig":
        """Read a ``preprocessor_config.json`` dict. A key left out takes transformers' default (IMAGE_DEFAULTS,
        AUDIO_DEFAULTS); ``size: {shortest_edge, longest_edge}`` stands for ``min_pixels`` / ``max_pixels`` where
        those are absent. ValueError names a key whose value is not supported (a ``do_*`` switch turned off,
        ``dither`` other than 0, ``padding_side`` other than ``right``)."""
        for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if config.get(key, True) is not True:
                raise ValueError(f"preprocessor config: {key}={config[key]!r} is not supported (Qwen3-Omni's "
                                 f"processor resizes, rescales and normalises every image)")
        size = dict(config.get("size") or {})
        img = {**IMAGE_DEFAULTS, **{k: config[k] for k in IMAGE_DEFAULTS if k in config}}
        img["min_pixels"] = config.get("min_pixels", size.get("shortest_edge", IMAGE_DEFAULTS["min_pixels"]))
        img["max_pixels"] = config.get("max_pixels", size.get("longest_edge", IMAGE_DEFAULTS["max_pixels"]))
        aud = {**AUDIO_DEFAULTS, **{k: config[k] for k in AUDIO_DEFAULTS if k in config}}
        if aud.pop("dither") != 0.0:
            raise ValueError(f"preprocessor config: dither={config['dither']!r} is not supported (random noise "
                             f"would make features irreproducible); use 0.0")
        if aud.pop("padding_side") != "right":
            raise ValueError(f"preprocessor config: padding_side={config['padding_side']!r} is not supported; "
                             f"use 'right'")
        image = ImageProcessorConfig(
            **{k: int(img[k]) for k in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels",
                                        "max_pixels", "resample")},
            image_mean=_three(img["image_mean"], "image_mean"), image_std=_three(img["image_std"], "image_std"),
            rescale_factor=float(img["rescale_factor"]))
        audio = AudioFeatureConfig(**{k: int(aud[k]) for k in ("feature_size", "sampling_rate", "hop_length",
                                                               "n_fft", "n_window")},
                                   padding_value=float(aud["padding_value"]))
        return cls(image=image, audio=audio)

    @classmethod
    def load(cls, path: str | Path) -> "PreprocessorConfig":
        """Read ``preprocessor_config.json`` (``path`` is the file or the checkpoint directory holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "preprocessor_config.json"
        return cls.from_dict(json.loads(path.read_text()))


def published_config() -> PreprocessorConfig:
    """The published checkpoint's preprocessing (PUBLISHED_PREPROCESSOR_CONFIG)."""
    return PreprocessorConfig.from_dict(PUBLISHED_PREPROCESSOR_CONFIG)


def _three(value: Any, key: str) -> tuple[float, float, float]:
    values = [float(value)] * 3 if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != 3:
        raise ValueError(f"preprocessor config: {key} needs 3 values (RGB), got {value!r}")
    return values[0], values[1], values[2]


# --- images -----------------------------------------------------------------------------------------------------


@dataclass
class ImageInputs:
    """A call's images as the vision encoder takes them (transformers' ``pixel_values`` / ``image_grid_thw``)."""

    pixel_values: np.ndarray
    """(sum of t*h*w over images, C*T*P*P) float32: every image's patches, in image order."""
    grid_thw: np.ndarray
    """(n_images, 3) int64: each image's patch grid (t, h, w); t is 1 for a still image."""
    merge_size: int
    """Patches per side merged into one token."""

    @property
    def token_counts(self) -> list[int]:
        """Thinker tokens (``<|image_pad|>``) per image."""
        return [image_token_count(g, self.merge_size) for g in self.grid_thw.tolist()]


def smart_resize(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) an image is resized to: both multiples of ``factor``, the area within
    ``[min_pixels, max_pixels]`` where the rounding allows, the aspect ratio as close as that allows.

    Sides are rounded to the nearest multiple (Python's round: halves to even); an area over ``max_pixels`` is scaled
    down and floored, one under ``min_pixels`` scaled up and ceiled. Raises MediaError when the longer side is more
    than MAX_ASPECT_RATIO times the shorter.
    """
    if height <= 0 or width <= 0:
        raise MediaError(f"the image has no pixels ({height}x{width})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(f"the image is {width}x{height}: its aspect ratio "
                         f"{max(height, width) / min(height, width):.1f} is over {MAX_ASPECT_RATIO}; crop or pad it")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def image_grid(height: int, width: int, config: ImageProcessorConfig) -> tuple[int, int, int]:
    """The patch grid (t, h, w) of an image of ``height x width`` pixels, without touching its pixels."""
    h, w = smart_resize(height, width, factor=config.factor, min_pixels=config.min_pixels,
                        max_pixels=config.max_pixels)
    return 1, h // config.patch_size, w // config.patch_size


def image_patches(image: np.ndarray, config: ImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One RGB image (``uint8``, ``(H, W, 3)``) -> its patches ``(t*h*w, C*T*P*P)`` float32 and grid (t, h, w)."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"image_patches takes uint8 RGB of shape (H, W, 3), got {image.dtype} {image.shape}")
    t, gh, gw = image_grid(image.shape[0], image.shape[1], config)
    p, m = config.patch_size, config.merge_size
    resized = Image.fromarray(image).resize((gw * p, gh * p), resample=Image.Resampling(config.resample))
    # the reference rescales in float64 and rounds to float32 once, then normalises in float32
    pixels = (np.asarray(resized).astype(np.float64) * config.rescale_factor).astype(np.float32)
    pixels = (pixels - np.array(config.image_mean, np.float32)) / np.array(config.image_std, np.float32)
    blocks = pixels.reshape(gh // m, m, p, gw // m, m, p, 3)
    blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5)  # (gh/m, gw/m, m, m, C, P, P): a merge block's patches adjacent
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], config.temporal_patch_size, p, p))
    return np.ascontiguousarray(frames.reshape(gh * gw, config.patch_dim)), (t, gh, gw)


def process_images(images: Sequence[np.ndarray], config: ImageProcessorConfig) -> ImageInputs:
    """A call's images -> ImageInputs (their patches concatenated in order, one grid row each)."""
    if not images:
        raise ValueError("process_images needs at least one image")
    patches, grids = zip(*(image_patches(image, config) for image in images))
    return ImageInputs(pixel_values=np.concatenate(patches, axis=0), grid_thw=np.array(grids, dtype=np.int64),
                       merge_size=config.merge_size)


# --- audio ------------------------------------------------------------------------------------------------------


@dataclass
class AudioInputs:
    """A call's clips as the audio encoder takes them: each clip's valid log-mel frames."""

    features: list[np.ndarray]
    """Per clip, (feature_size, n_frames) float32: transformers' ``input_features[i]`` where its
    ``feature_attention_mask[i]`` is set."""
    n_window: int
    """The encoder's half chunk in frames, for token counts."""

    @property
    def lengths(self) -> np.ndarray:
        """(n_clips,) int64 frames per clip (transformers' ``feature_attention_mask.sum(-1)``)."""
        return np.array([f.shape[1] for f in self.features], dtype=np.int64)

    @property
    def token_counts(self) -> list[int]:
        """Thinker tokens (``<|audio_pad|>``) per clip."""
        return [audio_token_count(f.shape[1], self.n_window) for f in self.features]


MEL_TOP_HZ = 8000.0
"""Upper edge of the mel filters: Whisper's extractor fixes it at 8 kHz whatever the sampling rate."""
# The Slaney scale: linear (3 mel per 200 Hz) below 1 kHz = mel 15, logarithmic (27 mel per factor 6.4) above.
# The operations are written in the order transformers' audio_utils uses, so the filters match it bit for bit.


def _hz_to_mel(hz: float) -> float:
    if hz < 1000.0:
        return 3.0 * hz / 200.0
    return float(15.0 + np.log(hz / 1000.0) * (27.0 / np.log(6.4)))


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    hz = 200.0 * mel / 3.0
    above = mel >= 15.0
    hz[above] = 1000.0 * np.exp(np.log(6.4) / 27.0 * (mel[above] - 15.0))
    return hz


def mel_filter_bank(config: AudioFeatureConfig) -> np.ndarray:
    """(n_fft // 2 + 1, feature_size) float64 Slaney-scale, Slaney-normalised triangular filters from 0 Hz to
    MEL_TOP_HZ: librosa's ``filters.mel(norm="slaney")`` transposed, as Whisper's extractor builds it."""
    edges_hz = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(MEL_TOP_HZ), config.feature_size + 2))
    bins_hz = np.linspace(0, config.sampling_rate // 2, config.n_fft // 2 + 1)
    gaps = np.diff(edges_hz)
    offsets = edges_hz[None, :] - bins_hz[:, None]  # (bins, feature_size + 2)
    rising = -offsets[:, :-2] / gaps[:-1]
    falling = offsets[:, 2:] / gaps[1:]
    filters = np.maximum(0.0, np.minimum(rising, falling))
    return filters * (2.0 / (edges_hz[2:] - edges_hz[:-2]))[None, :]  # equal area per band


STFT_BLOCK_FRAMES = 2048
"""Frames transformed at once: bounds the float64 work arrays of a long clip to a few MB."""


def log_mel(waveform: np.ndarray, config: AudioFeatureConfig, filters: np.ndarray | None = None) -> np.ndarray:
    """A mono float32 waveform -> Whisper's log-mel features, (feature_size, len // hop_length) float32.

    Frames are centred (the waveform reflect-padded by ``n_fft // 2``), windowed by a periodic Hann window and
    transformed; the frame past the last full hop is dropped, as Whisper does. ``filters``: mel_filter_bank(config),
    passed to skip rebuilding it. Raises MediaError for a clip of fewer than ``config.min_samples`` samples.
    """
    x = np.asarray(waveform, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError(f"log_mel takes mono samples (one axis), got shape {x.shape}")
    if x.shape[0] < config.min_samples:
        raise MediaError(f"the audio clip has {x.shape[0]} samples, fewer than the {config.min_samples} "
                         f"({config.min_samples / config.sampling_rate * 1000:.1f} ms) its features need")
    filters = mel_filter_bank(config) if filters is None else filters
    n_frames = x.shape[0] // config.hop_length
    padded = np.pad(x.astype(np.float64), config.n_fft // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, config.n_fft)[::config.hop_length][:n_frames]
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(config.n_fft) / config.n_fft)  # periodic Hann
    mel = np.empty((n_frames, config.feature_size), dtype=np.float64)
    for start in range(0, n_frames, STFT_BLOCK_FRAMES):
        spectrum = np.fft.rfft(frames[start:start + STFT_BLOCK_FRAMES] * window, axis=-1)
        power = spectrum.real ** 2 + spectrum.imag ** 2
        mel[start:start + STFT_BLOCK_FRAMES] = power @ filters
    log_spec = np.log10(np.maximum(mel, 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - LOG_FLOOR_DECADES)
    return np.ascontiguousarray(((log_spec + 4.0) / 4.0).T, dtype=np.float32)


def process_audio(clips: Sequence[np.ndarray], config: AudioFeatureConfig, *,
                  batch_padding: bool = False) -> AudioInputs:
    """A call's clips (mono float32 at ``config.sampling_rate``) -> AudioInputs.

    ``batch_padding=False``: each clip alone, ``len // hop_length`` frames. ``batch_padding=True``: as transformers'
    processor does for one call, every clip zero-padded (``padding_value``) to the longest before the transform and
    its frames cut where the padded sample mask, taken every ``hop_length``, ends (so a shorter clip whose length is
    not a multiple of the hop keeps one frame more than alone).
    """
    if not clips:
        raise ValueError("process_audio needs at least one clip")
    clips = [np.asarray(c, dtype=np.float32) for c in clips]
    for c in clips:
        if c.ndim != 1:
            raise ValueError(f"process_audio takes mono clips (one axis), got shape {c.shape}")
    filters = mel_filter_bank(config)
    if not batch_padding:
        return AudioInputs(features=[log_mel(c, config, filters) for c in clips], n_window=config.n_window)
    longest = max(c.shape[0] for c in clips)
    hop = config.hop_length
    features = []
    for c in clips:
        padded = np.pad(c, (0, longest - c.shape[0]), constant_values=np.float32(config.padding_value))
        valid = min(-(-c.shape[0] // hop), longest // hop)  # mask[::hop] kept, its last entry dropped off-hop
        features.append(np.ascontiguousarray(log_mel(padded, config, filters)[:, :valid]))
    return AudioInputs(features=features, n_window=config.n_window)


# --- token counts and the prompt ----------------------------------------------------------------------------------
def expand_placeholders(ids: Sequence[int], *, image_token_id: int, audio_token_id: int,
                        image_token_counts: Sequence[int] = (), audio_token_counts: Sequence[int] = ()) -> list[int]:
    """The prompt's token ids with the k-th ``image_token_id`` repeated ``image_token_counts[k]`` times and the k-th
    ``audio_token_id`` ``audio_token_counts[k]`` times (the chat template writes one of each per item).

    Raises ValueError when the prompt's placeholders and the items differ in number (a prompt that spells a
    placeholder out in its text has one more than the request has items).
    """
    counts = {image_token_id: list(image_token_counts), audio_token_id: list(audio_token_counts)}
    found = {tid: sum(1 for i in ids if i == tid) for tid in counts}
    for tid, name in ((image_token_id, "image"), (audio_token_id, "audio")):
        if found[tid] != len(counts[tid]):
            raise ValueError(f"the prompt holds {found[tid]} {name} placeholder(s) but {len(counts[tid])} {name} "
                             f"item(s) were given")
    queues = {tid: iter(c) for tid, c in counts.items()}
    out: list[int] = []
    for i in ids:
        out.extend([i] * next(queues[i]) if i in queues else (i,))
    return out


def expand_prompt_text(text: str, *, image_token_counts: Sequence[int] = (), audio_token_counts: Sequence[int] = (),
                       image_token: str = "<|image_pad|>", audio_token: str = "<|audio_pad|>") -> str:
    """``expand_placeholders`` on the prompt's text, before tokenizing (what transformers' processor does)."""
    counts = {image_token: list(image_token_counts), audio_token: list(audio_token_counts)}
    for token, items in counts.items():
        if text.count(token) != len(items):
            raise ValueError(f"the prompt holds {text.count(token)} {token} placeholder(s) but {len(items)} item(s) "
                             f"were given")
    queues = {token: iter(items) for token, items in counts.items()}
    pattern = re.compile("|".join(re.escape(token) for token in counts))
    return pattern.sub(lambda m: m.group() * next(queues[m.group()]), text)


@dataclass
class PromptInputs:
    """A prompt with its media, ready for the encoders and the thinker."""

    ids: list[int]
    """The prompt's token ids, placeholders expanded."""
    images: ImageInputs | None
    """The images' patches and grids, or None without images."""
    audio: AudioInputs | None
    """The clips' features, or None without audio."""


def prepare_prompt(ids: Sequence[int], *, images: Sequence[np.ndarray] = (), clips: Sequence[np.ndarray] = (),
                   config: PreprocessorConfig, image_token_id: int, audio_token_id: int,
                   batch_padding: bool = False) -> PromptInputs:
    """Everything transformers' ``Qwen3OmniMoeProcessor`` does for one prompt, at the token level: images and
    clips processed, the prompt's placeholders expanded to their counts. Raises MediaError for media the model
    cannot take (an aspect ratio over MAX_ASPECT_RATIO, a clip too short), ValueError for a placeholder count that
    does not match the items."""
    image_inputs = process_images(images, config.image) if images else None
    audio_inputs = process_audio(clips, config.audio, batch_padding=batch_padding) if clips else None
    expanded = expand_placeholders(
        ids, image_token_id=image_token_id, audio_token_id=audio_token_id,
        image_token_counts=image_inputs.token_counts if image_inputs else (),
        audio_token_counts=audio_inputs.token_counts if audio_inputs else ())
    return PromptInputs(ids=expanded, images=image_inputs, audio=audio_inputs)
