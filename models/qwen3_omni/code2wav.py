"""Qwen3-Omni's code2wav: codec frames (B, Q, frames) -> a 24 kHz waveform, one-shot or streamed in chunks.

Architecture (HF's ``Qwen3OmniMoeCode2Wav``): each frame's Q codes are embedded (one table, codebook q offset by
q * codebook_size) and averaged; a small transformer (sliding-window causal attention, RoPE, RMSNorm, SwiGLU, layer
scales) runs at the frame rate; ConvNeXt stages upsample by ``upsampling_ratios``; a causal conv decoder (blocks of
SnakeBeta, a causal transposed conv by ``upsample_rates[i]``, three dilated residual units) reaches one sample per
``total_upsample`` (1920 in the published checkpoint: 12.5 frames a second at 24 kHz); the output is clamped to
[-1, 1]. Everything is causal: a sample depends only on the frames up to its own.

Every causal transposed conv crops ``kernel - stride`` samples at each end, so a decode of n frames yields a fixed
number of samples fewer than n * total_upsample (`Code2Wav.samples`); a chunked decode loses them once per chunk.

Streaming (`Code2WavStream`, the CODE2WAV node's chunk policy): chunks of ``chunk`` new frames (default 25), each
decoded with up to ``left_context`` frames before it (default 25) whose samples are dropped, and exactly one final
chunk when the frames end: the remainder, or no frames (no samples) when none is left. The chunks are
`mstar_dist.graph.streaming.LeftContext`'s, so the concatenated audio equals HF's
``chunked_decode(codes, chunk_size=chunk, left_context_size=left_context)``.
Parameter names are the published checkpoint's under ``code2wav.``.
Shape legend: B rows, Q codebooks, T frames, C channels, S samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.llama.model import RMSNorm, apply_rope
from mstar_dist.graph.streaming import Chunk, LeftContext, StreamBuffer

SAMPLE_RATE = 24000
"""Samples per second of the waveform (the checkpoint's codec; config.json does not carry it)."""


@dataclass(frozen=True)
class Code2WavConfig:
    """config.json's ``code2wav_config``."""

    codebook_size: int
    """Codes per codebook."""
    num_quantizers: int
    """Codebooks per frame (Q); equals the talker's ``num_code_groups``."""
    hidden_size: int
    """Width of the frame-rate transformer and the ConvNeXt stages."""
    n_layers: int
    """Transformer layers (``num_hidden_layers``)."""
    n_heads: int
    """Query heads (``num_attention_heads``)."""
    n_kv_heads: int
    """Key/value heads (``num_key_value_heads``)."""
    head_dim: int
    """Width of one head (``head_dim``, else hidden_size / heads)."""
    intermediate_size: int
    """SwiGLU width of the transformer."""
    sliding_window: int
    """Frames each frame attends to, itself included."""
    decoder_dim: int
    """Channels entering the conv decoder; halved by every decoder block."""
    upsample_rates: tuple[int, ...]
    """Upsampling of each decoder block."""
    upsampling_ratios: tuple[int, ...]
    """Upsampling of each ConvNeXt stage (before the decoder)."""
    rope_theta: float = 10000.0
    """RoPE base of the transformer."""
    rms_norm_eps: float = 1e-5
    """Epsilon of the transformer's RMSNorms."""
    layer_scale_initial_scale: float = 0.01
    """Initial value of the layer scales (a fresh random model's)."""

    @property
    def total_upsample(self) -> int:
        """Samples per frame."""
        return int(np.prod(self.upsampling_ratios + self.upsample_rates))

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Code2WavConfig:
        """Read ``code2wav_config``; ValueError naming the key for what is missing or not runnable."""
        def get(key: str, default: Any = None) -> Any:
            value = hf.get(key, default)
            if value is None:
                raise ValueError(f"code2wav_config: missing key {key!r}")
            return value

        if hf.get("attention_bias"):
            raise ValueError("code2wav_config: attention_bias=true is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"code2wav_config: hidden_act={hf['hidden_act']!r} is not supported (silu only)")
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        heads = int(get("num_attention_heads"))
        config = cls(codebook_size=int(get("codebook_size")), num_quantizers=int(get("num_quantizers")),
                     hidden_size=int(get("hidden_size")), n_layers=int(get("num_hidden_layers")), n_heads=heads,
                     n_kv_heads=int(hf.get("num_key_value_heads") or heads),
                     head_dim=int(hf.get("head_dim") or get("hidden_size") // heads),
                     intermediate_size=int(get("intermediate_size")), sliding_window=int(get("sliding_window")),
                     decoder_dim=int(get("decoder_dim")), upsample_rates=tuple(get("upsample_rates")),
                     upsampling_ratios=tuple(get("upsampling_ratios")),
                     rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
                     rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                     layer_scale_initial_scale=float(hf.get("layer_scale_initial_scale", 0.01)))
        if config.decoder_dim % 2 ** len(config.upsample_rates):
            raise ValueError(f"code2wav_config: decoder_dim ({config.decoder_dim}) must divide by "
                             f"2 ** len(upsample_rates) = {2 ** len(config.upsample_rates)}")
        if config.n_heads % config.n_kv_heads:
            raise ValueError(f"code2wav_config: num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({config.n_kv_heads})")
        return config


# ---- causal convolutions ------------------------------------------------------------------------------------------

class CausalConv(nn.Module):
    """Conv1d padded on the left by (effective kernel - stride), and on the right just enough to complete the last
    stride: output frame t sees inputs up to t * stride."""

    def __init__(self, c_in: int, c_out: int, kernel: int, *, dilation: int = 1, stride: int = 1, groups: int = 1
                 ) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride=stride, dilation=dilation, groups=groups)
        self.stride = stride
        self.span = (kernel - 1) * dilation + 1
        self.left = self.span - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, C, T) -> (B, C', ceil(T / stride))."""
        n = x.shape[-1]
        steps = math.ceil((n - self.span + self.left) / self.stride + 1)
        right = (steps - 1) * self.stride + self.span - self.left - n
        return self.conv(F.pad(x, (self.left, right)))


class CausalTransConv(nn.Module):
    """ConvTranspose1d cropped by (kernel - stride) at both ends: T frames -> T * stride - (kernel - stride)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(c_in, c_out, kernel, stride=stride)
        self.crop = kernel - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y[..., self.crop:y.shape[-1] - self.crop]


class ConvNeXtBlock(nn.Module):
    """x + gamma * pwconv2(GELU(pwconv1(LayerNorm(causal depthwise conv7(x))))), over (B, C, T)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dwconv(x).transpose(1, 2))  # (B, T, C)
        h = self.gamma * self.pwconv2(F.gelu(self.pwconv1(h)))
        return x + h.transpose(1, 2)


class SnakeBeta(nn.Module):
    """x + sin(x * e^alpha)^2 / (e^beta + 1e-9), per channel of (B, C, T)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(dim))
        self.beta = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = torch.exp(self.alpha)[None, :, None]
        beta = torch.exp(self.beta)[None, :, None]
        return x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)


class ResidualUnit(nn.Module):
    """x + conv1x1(snake(dilated causal conv7(snake(x))))."""

    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    """``decoder.{i+1}``: SnakeBeta, a causal transposed conv upsampling by ``rate`` (channels halved), and residual
    units with dilations 1, 3, 9."""

    def __init__(self, c_in: int, rate: int) -> None:
        super().__init__()
        c_out = c_in // 2
        self.block = nn.ModuleList([SnakeBeta(c_in), CausalTransConv(c_in, c_out, 2 * rate, rate),
                                    *(ResidualUnit(c_out, d) for d in (1, 3, 9))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.block:
            x = layer(x)
        return x


# ---- the frame-rate transformer -----------------------------------------------------------------------------------

class Attention(nn.Module):
    """Sliding-window causal self-attention with RoPE (no q/k norms)."""

    def __init__(self, config: Code2WavConfig) -> None:
        super().__init__()
        c = config
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.n_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.n_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.n_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, self.n_heads, self.head_dim), cos, sin).transpose(1, 2)
        k = apply_rope(self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim), cos, sin).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # (B, nh, T, hd)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: Code2WavConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LayerScale(nn.Module):
    def __init__(self, dim: int, initial: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), initial))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class TransformerLayer(nn.Module):
    def __init__(self, config: Code2WavConfig) -> None:
        super().__init__()
        H = config.hidden_size
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(H, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, config.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(H, config.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(H, config.layer_scale_initial_scale)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(h), cos, sin, mask))
        return h + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(h)))


class PreTransformer(nn.Module):
    """``code2wav.pre_transformer``: the transformer over frame embeddings (B, T, H), positions 0..T-1."""

    def __init__(self, config: Code2WavConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        c, T, device = self.config, h.shape[1], h.device
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float, device=device)
                                           / c.head_dim))
        f = torch.arange(T, device=device, dtype=torch.float)[:, None] * inv_freq  # (T, hd/2)
        cos = torch.cat((f.cos(), f.cos()), dim=-1).to(h.dtype)[None, :, None]  # (1, T, 1, hd)
        sin = torch.cat((-f.sin(), f.sin()), dim=-1).to(h.dtype)[None, :, None]
        i = torch.arange(T, device=device)
        gap = i[:, None] - i[None, :]  # query minus key position
        mask = (gap >= 0) & (gap < c.sliding_window)  # (T, T)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.norm(h)


# ---- code2wav -----------------------------------------------------------------------------------------------------

class Code2Wav(nn.Module):
    """``code2wav.``: codes (B, Q, T) -> waveform (B, 1, S) in [-1, 1] at `SAMPLE_RATE`. Build on ``meta`` and load
    with ``load_state_dict(published_state, assign=True)`` (``code_offset`` is recomputed, not loaded: call
    ``init_buffers()`` after an assign-load)."""

    def __init__(self, config: Code2WavConfig) -> None:
        super().__init__()
        c = self.config = config
        self.total_upsample = config.total_upsample
        self.pre_transformer = PreTransformer(c)
        self.code_embedding = nn.Embedding(c.codebook_size * c.num_quantizers, c.hidden_size)
        self.upsample = nn.ModuleList(nn.ModuleList([CausalTransConv(c.hidden_size, c.hidden_size, r, r),
                                                     ConvNeXtBlock(c.hidden_size)]) for r in c.upsampling_ratios)
        out_dim = c.decoder_dim // 2 ** len(c.upsample_rates)
        blocks = [DecoderBlock(c.decoder_dim // 2 ** i, r) for i, r in enumerate(c.upsample_rates)]
        self.decoder = nn.ModuleList([CausalConv(c.hidden_size, c.decoder_dim, 7), *blocks, SnakeBeta(out_dim),
                                      CausalConv(out_dim, 1, 7)])
        self.register_buffer("code_offset", torch.empty(1, c.num_quantizers, 1, dtype=torch.long), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)build ``code_offset`` (codebook q's rows start at q * codebook_size) on the weights' device."""
        c, device = self.config, self.code_embedding.weight.device
        self.code_offset = (torch.arange(c.num_quantizers, device=device) * c.codebook_size).view(1, -1, 1)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (B, Q, T) int64 -> waveform (B, 1, `samples(T)`), clamped to [-1, 1]."""
        if codes.dim() != 3 or codes.shape[1] != self.config.num_quantizers:
            raise ValueError(f"code2wav: codes must be (B, {self.config.num_quantizers}, frames), "
                             f"got {tuple(codes.shape)}")
        h = self.pre_transformer(self.code_embedding(codes + self.code_offset).mean(dim=1))  # (B, T, H)
        x = h.transpose(1, 2)  # (B, H, T)
        for stage in self.upsample:
            for layer in stage:
                x = layer(x)
        for layer in self.decoder:
            x = layer(x)
        return x.clamp(min=-1, max=1)

    def samples(self, frames: int) -> int:
        """Samples a decode of ``frames`` frames yields (the causal transposed convs' crops are lost once)."""
        n = frames
        for r in self.config.upsampling_ratios:
            n = n * r  # kernel == stride: nothing cropped
        for r in self.config.upsample_rates:
            n = n * r - r  # kernel 2r, stride r: (n - 1) * r + 2r - 2r
        return max(n, 0)

    def decode_chunk(self, codes: torch.Tensor, n_context: int) -> torch.Tensor:
        """codes (B, Q, n_context + n) -> the waveform of the n new frames (B, 1, samples(n_context + n) -
        n_context * total_upsample): the context frames' samples are decoded and dropped. No frames -> no samples."""
        if codes.shape[-1] == n_context:
            return codes.new_zeros((codes.shape[0], 1, 0), dtype=self.code_embedding.weight.dtype)
        return self(codes)[..., n_context * self.total_upsample:]

    def chunked_decode(self, codes: torch.Tensor, chunk: int = 25, left_context: int = 25) -> torch.Tensor:
        """codes (B, Q, T) -> the concatenated waveform of `Code2WavStream`'s chunks (HF's ``chunked_decode``)."""
        stream = Code2WavStream(self, chunk=chunk, left_context=left_context)
        wavs = [audio for audio, _ in stream.push(codes)] + [audio for audio, _ in stream.finish()]
        return torch.cat(wavs, dim=-1)


class Code2WavStream:
    """One request's streaming decode: push frames as the talker makes them; get each chunk's audio as soon as its
    frames are in (see the module docstring for the chunk policy). Not thread-safe; nothing blocks."""

    def __init__(self, code2wav: Code2Wav, *, chunk: int = 25, left_context: int = 25) -> None:
        self.code2wav = code2wav
        self.policy = LeftContext(chunk=chunk, left_context=left_context)
        self._buffer = StreamBuffer(self.policy)

    def push(self, codes: torch.Tensor) -> list[tuple[torch.Tensor, bool]]:
        """codes (B, Q, n) of the next n frames -> (audio (B, 1, S), is_final=False) of every chunk now complete."""
        self._buffer.push(codes.permute(2, 0, 1))  # items are frames: (n, B, Q)
        return self._decode(self._buffer.pop_ready())

    def finish(self) -> list[tuple[torch.Tensor, bool]]:
        """The frames have ended: the chunks left, the last one (the remainder, possibly empty) with is_final=True."""
        self._buffer.producer_done()
        return self._decode(self._buffer.pop_ready())

    @torch.inference_mode()
    def _decode(self, chunks: list[Chunk]) -> list[tuple[torch.Tensor, bool]]:
        out = []
        for chunk in chunks:
            if chunk.data.dim() != 3:  # a final chunk of a stream that never got a frame
                weight = self.code2wav.code_embedding.weight
                out.append((weight.new_zeros((1, 1, 0)), chunk.is_final))
                continue
            codes = chunk.data.permute(1, 2, 0)  # (B, Q, n_context + n)
            out.append((self.code2wav.decode_chunk(codes, chunk.n_context), chunk.is_final))
        return out
