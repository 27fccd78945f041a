"""SNAC (Multi-Scale Neural Audio Codec) decoder: codes -> audio, without the `snac` package.

Only the decoding half of SNAC lives here: the residual VQ's from-codes path (embedding lookup, out
projection, repeat by stride, sum over codebooks) and the convolutional decoder. Module and parameter names
mirror the published checkpoints (`quantizer.quantizers.{i}.*`, `decoder.model.{j}.*`) so that
`models/snac/weights.py` maps a checkpoint onto this module by name; the weight-normed convolutions are
stored folded (one plain `weight`), since serving never trains.

Shape legend: B batch, n codes of codebook 0, T latent frames (n * vq_strides[0]), C channels, S samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Union

import torch
import torch.nn.functional as F
from torch import nn

ATTN_HEAD_DIM = 64  # SNAC's local attention always uses 64-wide heads


@dataclass(frozen=True)
class SnacConfig:
    """SNAC hyperparameters, with the keys of a SNAC `config.json` (hub repos `hubertsiuzdak/snac_*`)."""

    sampling_rate: int
    """Audio samples per second (24000 for the speech model Orpheus uses)."""
    encoder_dim: int
    """Encoder width; the decoder only needs it to derive `latent_dim`."""
    encoder_rates: tuple[int, ...]
    """Encoder downsampling factors; the decoder only needs their count to derive `latent_dim`."""
    decoder_dim: int
    """Channels after the decoder's input convolution; each upsampling block halves them."""
    decoder_rates: tuple[int, ...]
    """Upsampling factor of each decoder block; their product is `hop_length`."""
    attn_window_size: int | None
    """Window (in latent frames) of the local attention after the input convolution; None: no attention."""
    codebook_size: int
    """Codes per codebook (valid codes are 0 .. codebook_size - 1)."""
    codebook_dim: int
    """Width of one codebook entry (factorized codes, projected up to `latent_dim`)."""
    vq_strides: tuple[int, ...]
    """Latent frames one code of each codebook covers, coarsest first (24 kHz: 4, 2, 1)."""
    noise: bool
    """Decoder blocks add learned-scale Gaussian noise after upsampling (non-deterministic output)."""
    depthwise: bool
    """Input and residual convolutions are depthwise (grouped per channel)."""
    latent_dim: int | None = None
    """Latent width; None (what the hub configs say) means encoder_dim * 2 ** len(encoder_rates)."""

    def __post_init__(self) -> None:
        for name in ("sampling_rate", "encoder_dim", "decoder_dim", "codebook_size", "codebook_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"SnacConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        for name in ("encoder_rates", "decoder_rates", "vq_strides"):
            value = getattr(self, name)
            if not value or any(not isinstance(r, int) or r <= 0 for r in value):
                raise ValueError(f"SnacConfig.{name} must be a non-empty list of positive ints, got {value!r}")
        if self.decoder_dim % 2 ** len(self.decoder_rates):
            raise ValueError(f"SnacConfig.decoder_dim ({self.decoder_dim}) must be divisible by "
                             f"2 ** len(decoder_rates) ({2 ** len(self.decoder_rates)})")
        if self.attn_window_size is not None:
            if self.attn_window_size <= 0 or self.decoder_dim % ATTN_HEAD_DIM:
                raise ValueError(f"SnacConfig: attention needs attn_window_size > 0 (got {self.attn_window_size}) "
                                 f"and decoder_dim a multiple of {ATTN_HEAD_DIM} (got {self.decoder_dim})")

    @property
    def latent_channels(self) -> int:
        """Width of the quantized latent the decoder starts from."""
        return self.latent_dim or self.encoder_dim * 2 ** len(self.encoder_rates)

    @property
    def hop_length(self) -> int:
        """Audio samples per latent frame: the product of `decoder_rates` (512 at 24 kHz)."""
        return math.prod(self.decoder_rates)

    @property
    def frame_samples(self) -> int:
        """Audio samples one code of codebook 0 covers: hop_length * vq_strides[0] (2048 at 24 kHz)."""
        return self.hop_length * self.vq_strides[0]

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "SnacConfig":
        """Read a SNAC config.json dict; ValueError naming an unknown or missing key."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"SNAC config: unknown key {unknown[0]!r} (known: {sorted(known)})")
        missing = [f.name for f in fields(cls) if f.name not in raw and f.name != "latent_dim"]
        if missing:
            raise ValueError(f"SNAC config: missing key {missing[0]!r}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})

    def to_json(self) -> dict[str, Any]:
        """The config.json dict (lists for tuples; `latent_dim` only when set, as in the hub files)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out["latent_dim"] is None:
            del out["latent_dim"]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


SNAC_24KHZ = SnacConfig(sampling_rate=24000, encoder_dim=48, encoder_rates=(2, 4, 8, 8), decoder_dim=1024,
                        decoder_rates=(8, 8, 4, 2), attn_window_size=None, codebook_size=4096, codebook_dim=8,
                        vq_strides=(4, 2, 1), noise=True, depthwise=True)
"""hubertsiuzdak/snac_24khz, the codec Orpheus TTS speaks in."""

SNAC_TINY = SnacConfig(sampling_rate=24000, encoder_dim=8, encoder_rates=(2, 4, 8, 8), decoder_dim=64,
                       decoder_rates=(8, 8, 4, 2), attn_window_size=None, codebook_size=64, codebook_dim=4,
                       vq_strides=(4, 2, 1), noise=True, depthwise=True)
"""The 24 kHz structure (3 codebooks, same hop and frame_samples) at small widths, for CPU tests."""


def _conv(c_in: int, c_out: int, kernel: int, *, dilation: int = 1, groups: int = 1, bias: bool = True) -> nn.Conv1d:
    """A length-preserving convolution (odd kernel, 'same' padding)."""
    return nn.Conv1d(c_in, c_out, kernel, dilation=dilation, padding=(kernel - 1) // 2 * dilation,
                     groups=groups, bias=bias)


class Snake(nn.Module):
    """Snake activation x + sin²(αx)/α with a learned α per channel."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, T) -> (B, C, T)
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class ResidualUnit(nn.Module):
    """x + conv1(snake(conv7_dilated(snake(x)))), length preserving."""

    def __init__(self, dim: int, dilation: int, groups: int):
        super().__init__()
        self.block = nn.Sequential(Snake(dim), _conv(dim, dim, 7, dilation=dilation, groups=groups),
                                   Snake(dim), _conv(dim, dim, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


class NoiseBlock(nn.Module):
    """Adds N(0, 1) noise, one draw per (batch, time) shared by all channels, scaled per channel by conv1(x)."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = _conv(dim, dim, 1, bias=False)

    def forward(self, x: torch.Tensor, generator: Noise = None) -> torch.Tensor:
        B, _, T = x.shape
        if isinstance(generator, GivenNoise):
            noise = generator.next(B, T)
        else:
            noise = torch.randn((B, 1, T), generator=generator, device=x.device, dtype=x.dtype)
        return x + noise * self.linear(x)


class GivenNoise:
    """Noise drawn before a forward (so that a CUDA graph can replay it): the decoder's noise blocks take these
    tensors in block order, one (B, 1, T) each."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors, self._at = tensors, 0

    def next(self, B: int, T: int) -> torch.Tensor:
        if self._at >= len(self.tensors):
            raise ValueError(f"GivenNoise: {len(self.tensors)} tensors given, a noise block asked for another")
        noise = self.tensors[self._at]
        if noise.shape != (B, 1, T):
            raise ValueError(f"GivenNoise: noise block {self._at} needs ({B}, 1, {T}), given {tuple(noise.shape)}")
        self._at += 1
        return noise


Noise = Union[torch.Generator, GivenNoise, None]
"""Where a decode's noise comes from: one generator for the batch, noise drawn before (``frames.row_noise``: each
row's from its own generator), or the global RNG (None)."""


class DecoderBlock(nn.Module):
    """Snake, transposed conv upsampling by `stride` (T -> T * stride), optional noise, 3 residual units."""

    def __init__(self, c_in: int, c_out: int, stride: int, *, noise: bool, groups: int):
        super().__init__()
        layers: list[nn.Module] = [
            Snake(c_in),
            nn.ConvTranspose1d(c_in, c_out, 2 * stride, stride=stride, padding=math.ceil(stride / 2),
                               output_padding=stride % 2),
        ]
        if noise:
            layers.append(NoiseBlock(c_out))
        layers += [ResidualUnit(c_out, dilation, groups) for dilation in (1, 3, 9)]
        self.block = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, generator: Noise = None) -> torch.Tensor:
        for layer in self.block:
            x = layer(x, generator) if isinstance(layer, NoiseBlock) else layer(x)
        return x


class LocalAttention(nn.Module):
    """Pre-norm multi-head self-attention within non-overlapping windows of `window` latent frames, with
    rotary positions counted from each window's start; residual. T must be a multiple of `window`."""

    def __init__(self, dim: int, window: int):
        super().__init__()
        self.window, self.n_heads = window, dim // ATTN_HEAD_DIM
        self.norm = nn.LayerNorm(dim)
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, T) -> (B, C, T)
        B, C, T = x.shape
        n, H, D = self.window, self.n_heads, ATTN_HEAD_DIM
        if T % n:
            raise ValueError(f"local attention: {T} latent frames is not a multiple of the window {n}")
        qkv = self.to_qkv(self.norm(x.transpose(1, 2)))  # (B, T, 3C), q | k | v, heads outer within each
        q, k, v = qkv.view(B, T // n, n, 3, H, D).permute(3, 0, 4, 1, 2, 5)  # each (B, H, W, n, D)
        cos, sin = _rotary_tables(n, D, x.device, q.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v)  # (B, H, W, n, D)
        out = self.to_out(out.permute(0, 2, 3, 1, 4).reshape(B, T, C))
        return x + out.transpose(1, 2)


def _rotary_tables(n: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos and sin, each (n, head_dim), of positions 0..n-1; the two halves of head_dim repeat the
    frequencies 10000^(-2i/head_dim). Built in float32 whatever the model's dtype."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(n, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Decoder(nn.Module):
    """Latent (B, latent_channels, T) -> audio (B, 1, T * hop_length) in [-1, 1]."""

    def __init__(self, config: SnacConfig):
        super().__init__()
        latent, dim = config.latent_channels, config.decoder_dim
        if config.depthwise:
            layers: list[nn.Module] = [_conv(latent, latent, 7, groups=latent), _conv(latent, dim, 1)]
        else:
            layers = [_conv(latent, dim, 7)]
        if config.attn_window_size is not None:
            layers.append(LocalAttention(dim, config.attn_window_size))
        for i, stride in enumerate(config.decoder_rates):
            c_in, c_out = dim // 2 ** i, dim // 2 ** (i + 1)
            layers.append(DecoderBlock(c_in, c_out, stride, noise=config.noise,
                                       groups=c_out if config.depthwise else 1))
        layers += [Snake(c_out), _conv(c_out, 1, 7)]
        self.model = nn.ModuleList(layers)  # indices are the checkpoint's `decoder.model.{j}`

    def forward(self, z: torch.Tensor, generator: Noise = None) -> torch.Tensor:
        for layer in self.model:
            z = layer(z, generator) if isinstance(layer, DecoderBlock) else layer(z)
        return torch.tanh(z)


class Codebook(nn.Module):
    """One codebook's from-codes path: embedding lookup, then a 1x1 projection up to the latent width."""

    def __init__(self, config: SnacConfig):
        super().__init__()
        self.codebook = nn.Embedding(config.codebook_size, config.codebook_dim)
        self.out_proj = _conv(config.codebook_dim, config.latent_channels, 1)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:  # (B, n_i) -> (B, latent, n_i)
        return self.out_proj(self.codebook(codes).transpose(1, 2))


class CodesToLatent(nn.Module):
    """Sum over codebooks of each codebook's latent, repeated `vq_strides[i]` times along time."""

    def __init__(self, config: SnacConfig):
        super().__init__()
        self.strides = config.vq_strides
        self.quantizers = nn.ModuleList(Codebook(config) for _ in config.vq_strides)

    def forward(self, codes: list[torch.Tensor]) -> torch.Tensor:  # -> (B, latent, T)
        z = 0
        for codebook, stride, codes_i in zip(self.quantizers, self.strides, codes):
            z = z + codebook(codes_i).repeat_interleave(stride, dim=-1)
        return z


class SnacDecoder(nn.Module):
    """SNAC codes -> audio. Parameters are named as in the checkpoints (`quantizer.*`, `decoder.*`)."""

    def __init__(self, config: SnacConfig):
        super().__init__()
        self.config = config
        self.quantizer = CodesToLatent(config)  # named as the checkpoint's residual VQ, whose decode half it is
        self.decoder = Decoder(config)

    def noise_lengths(self, n_frames: int) -> list[int]:
        """The time steps of each noise block's draw (block order) when decoding ``n_frames`` frames (codes of
        codebook 0); empty without noise."""
        if not self.config.noise:
            return []
        steps = n_frames * self.config.vq_strides[0]
        return [steps * math.prod(self.config.decoder_rates[:i + 1]) for i in range(len(self.config.decoder_rates))]

    def forward(self, codes: list[torch.Tensor], generator: Noise = None) -> torch.Tensor:
        """codes[i]: integer tensor (B, n * vq_strides[0] // vq_strides[i]), coarsest codebook first (24 kHz:
        [B, n], [B, 2n], [B, 4n]). Returns float audio (B, 1, n * frame_samples) in [-1, 1].

        With `config.noise` the output is random: noise comes from `generator` (on the model's device), from
        noise drawn before (`GivenNoise`), or the global RNG when None. It equals `snac.SNAC.decode` only when both
        draw from the same RNG state (one randn per decoder block, in block order); with noise off it is
        deterministic.
        """
        self._check_codes(codes)
        return self.decoder(self.quantizer(codes), generator)

    def _check_codes(self, codes: list[torch.Tensor]) -> None:
        strides = self.config.vq_strides
        if len(codes) != len(strides):
            raise ValueError(f"SNAC decode: got {len(codes)} code tensors, the model has {len(strides)} codebooks")
        frames = [c.shape[-1] * s for c, s in zip(codes, strides)]
        if any(c.dim() != 2 for c in codes) or len(set(frames)) != 1 or len({c.shape[0] for c in codes}) != 1:
            raise ValueError(f"SNAC decode: code shapes {[tuple(c.shape) for c in codes]} do not cover the same "
                             f"(B, latent frames) at vq_strides {list(strides)}")
