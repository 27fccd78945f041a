"""Qwen-Image's text encoder: the language model of Qwen2.5-VL (``text_encoder/``; transformers'
``Qwen2_5_VLForConditionalGeneration`` is the reference), run over a text-only prompt to its final normed hidden
states. The vision tower and the LM head are in the checkpoint but not read.

    ids (B, T) -> embed -> layers (RMSNorm, GQA attention with q/k/v bias and RoPE, RMSNorm, SwiGLU) -> norm

Text-only positions are equal on M-RoPE's three axes, where M-RoPE is ordinary 1-D RoPE (rotate-half form), so the
``mrope_section`` split does not change a value. Causal attention, no KV cache: the prompt is encoded once per
request. Checkpoint names: ``model.layers.*`` (as transformers saves it and as published) or
``model.language_model.layers.*``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TextConfig:
    """The text part of text_encoder/config.json."""

    vocab_size: int
    """Embedding rows."""
    hidden_size: int
    """Width of the hidden states (the transformer's joint_attention_dim)."""
    intermediate_size: int
    """SwiGLU width."""
    num_hidden_layers: int
    """Decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (GQA)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 1000000.0
    """RoPE base."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, config: dict) -> "TextConfig":
        """From a Qwen2.5-VL config.json (``text_config``, or the older flat layout)."""
        text = config.get("text_config") or config
        if text.get("use_sliding_window"):
            raise ValueError("text_encoder/config.json: use_sliding_window=true is not supported (Qwen2.5-VL as "
                             "Qwen-Image publishes it attends to the whole prompt)")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        theta = rope.get("rope_theta", text.get("rope_theta", config.get("rope_theta", 1000000.0)))
        return cls(vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
                   intermediate_size=text["intermediate_size"], num_hidden_layers=text["num_hidden_layers"],
                   num_attention_heads=text["num_attention_heads"], num_key_value_heads=text["num_key_value_heads"],
                   rms_norm_eps=text.get("rms_norm_eps", 1e-6), rope_theta=float(theta))

    @classmethod
    def from_dir(cls, path: str | Path) -> "TextConfig":
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()))


class RMSNorm(nn.Module):
    """Qwen2's RMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: TextConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Mlp(nn.Module):
    def __init__(self, c: TextConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: TextConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = Mlp(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextEncoder(nn.Module):
    """``forward(ids)`` (B, T) -> final normed hidden states (B, T, hidden) (transformers' ``hidden_states[-1]``)."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def rope(self, t: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.config.head_dim
        inv = 1.0 / (self.config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(device, torch.float)
                                                / d))
        angles = torch.arange(t, device=device, dtype=torch.float)[:, None] * inv[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        cos, sin = self.rope(ids.shape[1], ids.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)
