"""Qwen-Image's MMDiT denoiser (the published ``transformer/``; diffusers' ``QwenImageTransformer2DModel`` is the
reference the parity tests compare against).

    packed latents (B, N, 64) --img_in--> image stream (B, N, d)
    prompt embeddings (B, T, 3584) --RMSNorm, txt_in--> text stream (B, T, d)
    t in [0, 1] --sinusoid(256) of t*1000 -> MLP--> temb (B, d)
    per block (double stream): each stream gets its own adaLN (shift/scale/gate x 2 from SiLU(temb)),
        joint attention over [text; image] with per-stream q/k/v, RMS-normed q and k per head and 3-axis RoPE,
        per-stream output projections and GELU(tanh) MLPs, gated residuals
    final: adaLN (scale, shift) + LayerNorm on the image stream -> proj_out -> velocity (B, N, 64)

RoPE: frame/height/width axes of widths ``axes_dims_rope``; image positions are centred (height and width run
from -h/2 to h/2 - 1, diffusers' ``scale_rope=True``), text positions continue after the largest image index.
Parameter names equal the published checkpoint's, so ``diffusion_pytorch_model*.safetensors`` load unchanged.
No text padding mask: the rows of a batch share one prompt length (the serving nodes run batch 1, where the
pipeline passes no mask either).
Shape legend: B batch, N image tokens (h/2 * w/2 of the latent), T text tokens, d = heads x head_dim.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROPE_THETA = 10000
ROPE_POSITIONS = 4096
"""Positions of the RoPE tables per axis (image side in tokens + text tokens must stay below)."""
_EPS = 1e-6


@dataclass(frozen=True)
class TransformerConfig:
    """transformer/config.json of the published checkpoint (the keys our forward reads)."""

    in_channels: int = 64
    """Packed latent channels: VAE z_dim x patch_size^2."""
    out_channels: int = 16
    """VAE z_dim; the output has out_channels x patch_size^2 channels per token."""
    patch_size: int = 2
    """Latent pixels per token side (the pipeline packs 2x2)."""
    num_layers: int = 60
    """Double-stream blocks."""
    attention_head_dim: int = 128
    """Width of one head."""
    num_attention_heads: int = 24
    """Heads; d = heads x head_dim."""
    joint_attention_dim: int = 3584
    """Width of the prompt embeddings (the text encoder's hidden size)."""
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    """RoPE widths of the frame, height and width axes (they sum to attention_head_dim)."""

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, config: dict) -> "TransformerConfig":
        """From config.json; ValueError naming a key whose feature this implementation lacks."""
        for key in ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"):
            if config.get(key):
                raise ValueError(f"transformer/config.json: {key}={config[key]!r} is not supported (Qwen-Image "
                                 f"text-to-image has it false)")
        fields = {k: config[k] for k in cls.__dataclass_fields__ if k in config}
        if "axes_dims_rope" in fields:
            fields["axes_dims_rope"] = tuple(fields["axes_dims_rope"])
        out = cls(**fields)
        if sum(out.axes_dims_rope) != out.attention_head_dim:
            raise ValueError(f"transformer/config.json: axes_dims_rope {list(out.axes_dims_rope)} must sum to "
                             f"attention_head_dim {out.attention_head_dim}")
        return out

    @classmethod
    def from_dir(cls, path: str | Path) -> "TransformerConfig":
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistic in float32 (diffusers' RMSNorm with an affine weight, no bias)."""

    def __init__(self, dim: int, eps: float = _EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return x * self.weight


class FeedForward(nn.Module):
    """Linear(d, 4d) -> GELU(tanh) -> Linear(4d, d); names ``net.0.proj`` and ``net.2`` as published."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        proj = nn.Module()
        proj.proj = nn.Linear(dim, 4 * dim)
        self.net = nn.ModuleList([proj, nn.Identity(), nn.Linear(4 * dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](F.gelu(self.net[0].proj(x), approximate="tanh"))


def timestep_features(t: torch.Tensor, dim: int = 256, scale: float = 1000.0) -> torch.Tensor:
    """(B,) times in [0, 1] -> (B, dim) [cos, sin] features of scale * t (frequencies 10000^(-k/half))."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = scale * (t[:, None].float() * freqs[None, :])
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class TimestepEmbedding(nn.Module):
    """``time_text_embed``: sinusoid -> Linear -> SiLU -> Linear (names as published)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        emb = nn.Module()
        emb.linear_1, emb.linear_2 = nn.Linear(256, dim), nn.Linear(dim, dim)
        self.timestep_embedder = emb

    def forward(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        e = self.timestep_embedder
        return e.linear_2(F.silu(e.linear_1(timestep_features(t).to(dtype))))


def rope_table(index: torch.Tensor, dim: int) -> torch.Tensor:
    """complex64 (len(index), dim/2): e^(i * index * theta^(-2k/dim))."""
    inv = 1.0 / torch.pow(ROPE_THETA, torch.arange(0, dim, 2, device="cpu").to(torch.float32).div(dim))
    angles = torch.outer(index, inv)
    return torch.polar(torch.ones_like(angles), angles)


class Rope(nn.Module):
    """3-axis RoPE tables for positions 0.. and -1, -2, ... (the negative half of centred image rows/columns)."""

    def __init__(self, axes: tuple[int, int, int]) -> None:
        super().__init__()
        self.axes = axes
        pos = torch.arange(ROPE_POSITIONS, device="cpu")  # on the CPU even under a meta build: tables, not weights
        neg = -pos.flip(0) - 1
        self.pos = [rope_table(pos, a) for a in axes]
        self.neg = [rope_table(neg, a) for a in axes]
        self._cache: dict = {}

    def forward(self, h: int, w: int, text_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(image (h*w, hd/2), text (text_len, hd/2)) complex rotations for an h x w token grid."""
        key = (h, w, text_len, device)
        if key not in self._cache:
            start = max(h // 2, w // 2)
            if start + text_len > ROPE_POSITIONS or h > ROPE_POSITIONS:
                raise ValueError(f"image of {h}x{w} tokens with {text_len} text tokens exceeds the RoPE table "
                                 f"({ROPE_POSITIONS} positions)")
            frame = self.pos[0][:1].view(1, 1, -1).expand(h, w, -1)
            rows = torch.cat([self.neg[1][ROPE_POSITIONS - (h - h // 2):], self.pos[1][:h // 2]])
            cols = torch.cat([self.neg[2][ROPE_POSITIONS - (w - w // 2):], self.pos[2][:w // 2]])
            image = torch.cat([frame, rows.view(h, 1, -1).expand(h, w, -1), cols.view(1, w, -1).expand(h, w, -1)],
                              dim=-1).reshape(h * w, -1)
            text = torch.cat([p[start:start + text_len] for p in self.pos], dim=-1)
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[key] = (image.to(device), text.to(device))
        return self._cache[key]


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x (B, S, H, D) with adjacent pairs as complex numbers, rotated by freqs (S, D/2)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs[:, None, :]).flatten(3).type_as(x)


class JointAttention(nn.Module):
    """Attention over [text; image]: per-stream projections, per-head RMS q/k norms, RoPE, one softmax."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, inner), nn.Linear(dim, inner), nn.Linear(dim, inner)
        self.add_q_proj, self.add_k_proj = nn.Linear(dim, inner), nn.Linear(dim, inner)
        self.add_v_proj = nn.Linear(dim, inner)
        self.norm_q, self.norm_k = RMSNorm(head_dim), RMSNorm(head_dim)
        self.norm_added_q, self.norm_added_k = RMSNorm(head_dim), RMSNorm(head_dim)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Identity()])
        self.to_add_out = nn.Linear(inner, dim)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        split = lambda x: x.unflatten(-1, (-1, self.head_dim))  # noqa: E731
        iq, ik, iv = self.norm_q(split(self.to_q(img))), self.norm_k(split(self.to_k(img))), split(self.to_v(img))
        tq, tk = self.norm_added_q(split(self.add_q_proj(txt))), self.norm_added_k(split(self.add_k_proj(txt)))
        tv = split(self.add_v_proj(txt))
        img_freqs, txt_freqs = rope
        iq, ik = apply_rope(iq, img_freqs), apply_rope(ik, img_freqs)
        tq, tk = apply_rope(tq, txt_freqs), apply_rope(tk, txt_freqs)
        q, k, v = (torch.cat(pair, dim=1).transpose(1, 2) for pair in ((tq, iq), (tk, ik), (tv, iv)))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2, 3).to(q.dtype)
        n_txt = txt.shape[1]
        return self.to_out[0](out[:, n_txt:].contiguous()), self.to_add_out(out[:, :n_txt].contiguous())


def _modulate(x: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm(x) * (1 + scale) + shift, and the gate, from params = [shift, scale, gate] (B, 3d)."""
    shift, scale, gate = params.chunk(3, dim=-1)
    x = F.layer_norm(x, x.shape[-1:], eps=_EPS)
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1), gate.unsqueeze(1)


class Block(nn.Module):
    """One double-stream block (published names: img_mod, txt_mod, attn, img_mlp, txt_mlp)."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.attn = JointAttention(dim, heads, head_dim)
        self.img_mlp, self.txt_mlp = FeedForward(dim), FeedForward(dim)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, temb: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        img_mod1, img_mod2 = self.img_mod(temb).chunk(2, dim=-1)
        txt_mod1, txt_mod2 = self.txt_mod(temb).chunk(2, dim=-1)
        img_in, img_gate = _modulate(img, img_mod1)
        txt_in, txt_gate = _modulate(txt, txt_mod1)
        img_attn, txt_attn = self.attn(img_in, txt_in, rope)
        img = img + img_gate * img_attn
        txt = txt + txt_gate * txt_attn
        img_in, img_gate = _modulate(img, img_mod2)
        img = img + img_gate * self.img_mlp(img_in)
        txt_in, txt_gate = _modulate(txt, txt_mod2)
        txt = txt + txt_gate * self.txt_mlp(txt_in)
        if img.dtype == torch.float16:  # as published: keep fp16 activations finite
            img, txt = img.clip(-65504, 65504), txt.clip(-65504, 65504)
        return img, txt


class QwenImageTransformer(nn.Module):
    """The denoiser: ``forward(latents, t, text, h, w)`` -> velocity, all (B, ...) with B sharing h, w."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        d = config.inner_dim
        self.pos_embed = Rope(config.axes_dims_rope)
        self.time_text_embed = TimestepEmbedding(d)
        self.txt_norm = RMSNorm(config.joint_attention_dim)
        self.img_in = nn.Linear(config.in_channels, d)
        self.txt_in = nn.Linear(config.joint_attention_dim, d)
        self.transformer_blocks = nn.ModuleList(
            Block(d, config.num_attention_heads, config.attention_head_dim) for _ in range(config.num_layers))
        norm_out = nn.Module()
        norm_out.linear = nn.Linear(d, 2 * d)
        self.norm_out = norm_out
        self.proj_out = nn.Linear(d, config.patch_size ** 2 * config.out_channels)

    def forward(self, latents: torch.Tensor, t: torch.Tensor, text: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """latents (B, h*w, in_channels) packed; t (B,) in [0, 1] (sigma); text (B, T, joint_attention_dim);
        h, w: the token grid. Returns (B, h*w, patch^2 * out_channels)."""
        img = self.img_in(latents)
        txt = self.txt_in(self.txt_norm(text))
        temb = self.time_text_embed(t.to(img.dtype), img.dtype)
        rope = self.pos_embed(h, w, txt.shape[1], img.device)
        for block in self.transformer_blocks:
            img, txt = block(img, txt, temb, rope)
        scale, shift = self.norm_out.linear(F.silu(temb).to(img.dtype)).chunk(2, dim=1)
        img = F.layer_norm(img, img.shape[-1:], eps=_EPS) * (1 + scale)[:, None, :] + shift[:, None, :]
        return self.proj_out(img)
