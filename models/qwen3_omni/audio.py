"""The Qwen3-Omni thinker's audio encoder: a clip's log-mel features -> thinker-width audio tokens.

The architecture of transformers' ``Qwen3OmniMoeAudioEncoder`` (a Whisper-style encoder over chunks):
1. each clip's frames are cut into chunks of ``2 * n_window`` frames (the last one shorter); every chunk goes
   through three Conv2d of stride 2 over (mel, time) with GELU, and its (channels x mel) features are projected
   to d_model (``conv_out``): a full chunk of 100 frames becomes 13 tokens;
2. sinusoidal positions, counted from 0 within each chunk, are added;
3. ``encoder_layers`` pre-LayerNorm transformer layers whose attention stays inside windows of
   ``n_window_infer // (2 * n_window)`` chunks' tokens of one clip;
4. LayerNorm, Linear, GELU, Linear to the thinker's hidden size (``output_dim``).

Padding, and why a clip's rows do not depend on its batch: the convolutions run over chunks padded to one width,
and a padded chunk's last valid outputs read the padding's activations (not zeros) from the second convolution on.
The reference pads every chunk of a call to the call's longest chunk, so a short clip's tokens there change with
what it is batched with. Here each clip's chunks are padded as if the clip were alone (to its own longest chunk,
``min(frames, 2 * n_window)``): the positions past that width are zeroed between the convolutions, which is what a
convolution's zero padding reads. Both agree whenever every clip of the call has at least ``2 * n_window`` frames
(one second), and for a call of one clip; ``forward(chunk_pad=...)`` reproduces the reference's call-wide padding.

Parameter names equal the published checkpoint's under ``thinker.audio_tower.`` (``AUDIO_PREFIX``); the sinusoids
are computed, not stored, so the module holds no buffers: built on ``meta``, loaded with ``assign=True``.

Shape legend: F n_mels, L a clip's frames, B chunks of a call, c downsample_hidden_size, n tokens of a call,
d d_model, H heads, O output_dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.common.segment_attention import segment_attention
from models.qwen3_omni.token_counts import audio_token_count, downsampled_frames
from models.qwen3_omni.vision import ACTIVATIONS

AUDIO_PREFIX = "thinker.audio_tower."
"""Where the audio encoder's tensors sit in the published checkpoint (``thinker.audio_tower.layers.0.fc1.weight``)."""


@dataclass(frozen=True)
class AudioConfig:
    """``thinker_config.audio_config`` of the checkpoint's config.json; defaults are transformers'."""

    num_mel_bins: int = 128
    """F: log-mel bins per frame (the feature extractor's ``feature_size``)."""
    encoder_layers: int = 32
    """Transformer layers."""
    encoder_attention_heads: int = 20
    """Attention heads per layer."""
    encoder_ffn_dim: int = 5120
    """Width of the layers' MLPs."""
    d_model: int = 1280
    """d: width of the layers (even: half sine, half cosine positions)."""
    activation_function: str = "gelu"
    """Activation of the layers' MLPs and of the output projection (the convolutions always use exact GELU)."""
    max_source_positions: int = 1500
    """Longest chunk, in tokens, the sinusoidal positions are defined for."""
    n_window: int = 50
    """Half the chunk length in frames: chunks of ``2 * n_window`` frames are convolved apart."""
    n_window_infer: int = 800
    """Attention window in frames: ``n_window_infer // (2 * n_window)`` chunks' tokens attend to each other."""
    conv_chunksize: int = 500
    """Chunks per convolution call (bounds the activations' memory)."""
    downsample_hidden_size: int = 480
    """c: channels of the convolutions."""
    output_dim: int = 3584
    """O: the thinker's hidden size, the width of the audio tokens."""

    def __post_init__(self) -> None:
        for name in ("num_mel_bins", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim", "d_model",
                     "max_source_positions", "n_window", "n_window_infer", "conv_chunksize",
                     "downsample_hidden_size", "output_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"audio_config.{name} must be a positive int, got {value!r}")
        if self.d_model % self.encoder_attention_heads or self.d_model % 2:
            raise ValueError(f"audio_config: d_model ({self.d_model}) must be even and a multiple of "
                             f"encoder_attention_heads ({self.encoder_attention_heads})")
        if self.n_window_infer < 2 * self.n_window:
            raise ValueError(f"audio_config.n_window_infer ({self.n_window_infer}) must be at least one chunk, "
                             f"2 * n_window = {2 * self.n_window} frames")
        if self.max_source_positions < self.chunk_tokens:
            raise ValueError(f"audio_config.max_source_positions ({self.max_source_positions}) is shorter than a "
                             f"chunk's {self.chunk_tokens} tokens")
        if self.activation_function not in ACTIVATIONS:
            raise ValueError(f"audio_config.activation_function {self.activation_function!r} is not one of "
                             f"{sorted(ACTIVATIONS)}")

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "AudioConfig":
        """Read ``thinker_config.audio_config``; keys this encoder does not use are ignored."""
        return cls(**{f: config[f] for f in cls.__dataclass_fields__ if f in config})

    @property
    def chunk_frames(self) -> int:
        """Frames of a full chunk."""
        return 2 * self.n_window

    @property
    def chunk_tokens(self) -> int:
        """Tokens of a full chunk."""
        return downsampled_frames(self.chunk_frames)

    @property
    def window_tokens(self) -> int:
        """Tokens of a full attention window."""
        return self.chunk_tokens * (self.n_window_infer // self.chunk_frames)

    def token_count(self, n_frames: int) -> int:
        """Audio tokens of a clip of ``n_frames`` frames (token_counts.audio_token_count with this n_window)."""
        return audio_token_count(n_frames, self.n_window)


class AudioAttention(nn.Module):
    def __init__(self, config: AudioConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads = config.encoder_attention_heads
        self.k_proj = nn.Linear(d, d, bias=True)
        self.v_proj = nn.Linear(d, d, bias=True)
        self.q_proj = nn.Linear(d, d, bias=True)
        self.out_proj = nn.Linear(d, d, bias=True)

    def forward(self, x: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (proj(x).view(n, self.n_heads, -1) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(segment_attention(q, k, v, seqlens).reshape(n, -1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, config: AudioConfig) -> None:
        super().__init__()
        self.self_attn = AudioAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.fc1 = nn.Linear(config.d_model, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, config.d_model)
        self.final_layer_norm = nn.LayerNorm(config.d_model)
        self.act = ACTIVATIONS[config.activation_function]

    def forward(self, x: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), seqlens)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


def sinusoids(length: int, channels: int, device: torch.device, max_timescale: float = 10000.0) -> torch.Tensor:
    """(length, channels) float32 positions: sines then cosines of geometrically spaced frequencies."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2, device=device).float())
    scaled = torch.arange(length, device=device)[:, None] * inv_timescales[None, :]
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


def unpad_features(input_features: torch.Tensor, feature_attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """The feature extractor's padded batch (clips, F, frames) + its mask (clips, frames) -> each clip's valid
    frames as (F, L_i), the input ``AudioEncoder.encode`` takes."""
    mask = feature_attention_mask.bool()
    return [features[:, keep] for features, keep in zip(input_features, mask)]


@dataclass
class AudioOutput:
    """What the encoder gives the thinker for one call's clips, rows in clip order."""

    embeds: torch.Tensor
    """(n, O): the audio tokens, one per audio placeholder."""
    token_counts: list[int]
    """Tokens per clip, = token_counts.audio_token_count of its frames."""

    def split(self) -> list[torch.Tensor]:
        """Per clip: its (tokens, O) embeddings."""
        return list(self.embeds.split(self.token_counts))


class AudioEncoder(nn.Module):
    """``thinker.audio_tower``: log-mel features of one or more clips -> audio tokens of the thinker's width.

    Build: ``with torch.device("meta"): enc = AudioEncoder(AudioConfig.from_hf(audio_config))``, then
    ``enc.load_state_dict(tensors_without_prefix, assign=True)``.
    """

    def __init__(self, config: AudioConfig) -> None:
        super().__init__()
        self.config = config
        c, d = config.downsample_hidden_size, config.d_model
        self.conv2d1 = nn.Conv2d(1, c, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(c, c, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(c, c, 3, 2, padding=1)
        self.conv_out = nn.Linear(c * downsampled_frames(config.num_mel_bins), d, bias=False)
        self.layers = nn.ModuleList(AudioEncoderLayer(config) for _ in range(config.encoder_layers))
        self.ln_post = nn.LayerNorm(d)
        self.proj1 = nn.Linear(d, d)
        self.proj2 = nn.Linear(d, config.output_dim)
        self.act = ACTIVATIONS[config.activation_function]

    def forward(self, input_features: torch.Tensor, feature_lens: torch.Tensor | Sequence[int],
                chunk_pad: int | None = None) -> AudioOutput:
        """Encode a call's clips at once.

        input_features: (F, sum of L_i), the clips' valid frames concatenated along time in clip order (what the
        reference's thinker makes of the feature extractor's ``input_features`` and ``feature_attention_mask``);
        feature_lens: each clip's L_i. chunk_pad: pad every chunk to this many frames before the convolutions, as
        the reference does with the call's longest chunk; None pads each clip's chunks as if it were alone (the
        module docstring says why).
        """
        lengths = self._check(input_features, feature_lens)
        chunks, pads = self._chunk_plan(lengths, chunk_pad)
        x = self._downsample(input_features, chunks, pads)  # (n, d)
        counts = [self.config.token_count(n) for n in lengths]
        window = self.config.window_tokens
        seqlens = [size for n in counts for size in [window] * (n // window) + [n % window] if size]
        for layer in self.layers:
            x = layer(x, seqlens)
        x = self.proj2(self.act(self.proj1(self.ln_post(x))))
        return AudioOutput(embeds=x, token_counts=counts)

    def encode(self, clips: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per clip its (F, L_i) features (``unpad_features`` gives them) -> its (tokens, O) embeddings, all clips
        in one forward."""
        if not clips:
            return []
        return self.forward(torch.cat(list(clips), dim=1), [c.shape[1] for c in clips]).split()

    def _check(self, input_features: torch.Tensor, feature_lens: torch.Tensor | Sequence[int]) -> list[int]:
        lengths = [int(n) for n in (feature_lens.tolist() if isinstance(feature_lens, torch.Tensor) else feature_lens)]
        bins = self.config.num_mel_bins
        if input_features.dim() != 2 or input_features.shape[0] != bins:
            raise ValueError(f"audio encoder: input_features of shape {tuple(input_features.shape)} must be "
                             f"(num_mel_bins={bins}, frames)")
        if not lengths or min(lengths) <= 0 or sum(lengths) != input_features.shape[1]:
            raise ValueError(f"audio encoder: feature lengths {lengths} must be positive and sum to the "
                             f"{input_features.shape[1]} frames of input_features")
        return lengths

    def _chunk_plan(self, lengths: list[int], chunk_pad: int | None) -> tuple[list[int], list[int]]:
        """Every chunk's frames, and the width its clip's chunks are padded to, in clip order."""
        size = self.config.chunk_frames
        chunks, pads = [], []
        for n in lengths:
            full, tail = divmod(n, size)
            clip_chunks = [size] * full + ([tail] if tail else [])
            chunks += clip_chunks
            pads += [min(n, size) if chunk_pad is None else chunk_pad] * len(clip_chunks)
        if chunk_pad is not None and chunk_pad < max(chunks):
            raise ValueError(f"audio encoder: chunk_pad ({chunk_pad}) is shorter than the longest chunk "
                             f"({max(chunks)} frames)")
        return chunks, pads

    def _downsample(self, features: torch.Tensor, chunks: list[int], pads: list[int]) -> torch.Tensor:
        """(F, frames) -> (n, d): the chunks' convolved tokens plus their positions, padding rows dropped."""
        width = max(pads)
        pieces = features.T.split(chunks)  # (chunk frames, F) each
        padded = nn.utils.rnn.pad_sequence(pieces, batch_first=True)  # (B, longest chunk, F)
        padded = F.pad(padded, (0, 0, 0, width - padded.shape[1])).transpose(1, 2).unsqueeze(1)  # (B, 1, F, width)
        padded = padded.to(self.conv2d1.weight.dtype)
        ragged = any(p != width for p in pads)
        step = self.config.conv_chunksize
        outs = []
        for start in range(0, len(chunks), step):
            h = padded[start:start + step]
            for depth, conv in enumerate((self.conv2d1, self.conv2d2, self.conv2d3), start=1):
                h = F.gelu(conv(h))
                if ragged and depth < 3:  # what a convolution over the clip alone reads past its width: zeros
                    valid = [downsampled_frames(p, depth) for p in pads[start:start + step]]
                    h = h * _time_mask(valid, h.shape[-1], h)
            outs.append(h)
        h = torch.cat(outs) if len(outs) > 1 else outs[0]  # (B, c, F', t)
        b, c, f, t = h.shape
        h = self.conv_out(h.permute(0, 3, 1, 2).reshape(b, t, c * f))  # (B, t, d)
        h = h + sinusoids(t, self.config.d_model, h.device).to(h.dtype)
        keep = _time_mask([downsampled_frames(n) for n in chunks], t, h).squeeze(1).squeeze(1).bool()  # (B, t)
        return h[keep]


def _time_mask(lengths: list[int], width: int, like: torch.Tensor) -> torch.Tensor:
    """(B, 1, 1, width) in ``like``'s dtype: 1 for the first lengths[b] time steps of row b, else 0."""
    steps = torch.arange(width, device=like.device)
    mask = steps[None, :] < torch.tensor(lengths, device=like.device)[:, None]
    return mask[:, None, None, :].to(like.dtype)
