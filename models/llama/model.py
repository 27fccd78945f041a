"""Llama-family decoder (Llama 2/3/3.x shapes, SmolLM2): RoPE (HF rotate-half layout, optionally
llama3-scaled), GQA, RMSNorm, SwiGLU.

The model knows nothing about batching or cache layout: every attention layer hands its q/k/v to
`cache.attend(layer_idx, q, k, v)` (see mstar_dist.engine.kv_cache.AttentionCache).

Parameters are fused where it saves kernel launches on the decode path (gpt-fast style): `wqkv` is
[q_proj; k_proj; v_proj] and `w_gate_up` is [gate_proj; up_proj]. weights.py maps HF names onto them. Where Triton
runs, `Llama.fuse_pointwise` also fuses the pointwise work between them (models/common/fused.py).
Shape legend: B batch, T new tokens, d hidden, nh/nkv query/KV heads, hd head dim, I MLP width, V vocab.

Tensor parallelism (models/common/tp.py): `Llama(config, tp=...)` builds one rank's shard. Query and KV heads
are split over the TP group (wqkv column-parallel per q/k/v part, wo row-parallel: one all-reduce), the MLP's
gate/up are column-parallel and down row-parallel (a second all-reduce per block); the embedding, norms and
LM head are replicated (the simplest correct choice: every rank computes the full logits, no gather). With
`TPGroup.single()` (the default) every layer is the plain `Linear` and nothing communicates.
In the TP case nh/nkv below are this rank's heads (`Llama.local_heads`, `Llama.local_kv_heads`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from models.common import fused
from models.common.linear import Linear
from models.common.tp import ColumnParallelLinear, RowParallelLinear, split_heads
from mstar_dist.distributed.tp import TPGroup
from models.llama.config import Llama3RopeScaling, LlamaConfig

if TYPE_CHECKING:
    from mstar_dist.engine.kv_cache import AttentionCache


__all__ = ["Linear", "RMSNorm", "Llama", "apply_rope", "llama3_inv_freq", "rope_tables"]  # Linear moved to models/common


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1's adjustment of RoPE inverse frequencies (fp32 in, fp32 out, same shape).

    With r = original_max_position_embeddings / wavelength (how many turns a frequency makes over the
    pretraining context) and s = (r - low_freq_factor) / (high_freq_factor - low_freq_factor) clamped to
    [0, 1], the new frequency is (1 - s) * f / factor + s * f: slow frequencies (s = 0) are divided by
    `factor`, fast ones (s = 1) are kept, and those between are blended. Same values as transformers'
    `_compute_llama3_parameters`.
    """
    wavelength = 2 * math.pi / inv_freq
    turns = scaling.original_max_position_embeddings / wavelength
    s = ((turns - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0.0, 1.0)
    return (1 - s) * inv_freq / scaling.factor + s * inv_freq


def rope_tables(config: LlamaConfig, dtype: torch.dtype, device: torch.device | str | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin, each (max_pos, hd), for `apply_rope`.

    HF rotate-half: out = x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]. We fold the
    minus sign into the table (sin_signed = [-sin, sin]) so the rotation is a roll: [x2, x1] * sin_signed.
    Frequencies are computed in fp32 exactly as HF does (config.rope_scaling adjusts them), then cast.
    """
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device)
                                           .float() / hd))  # (hd/2,)
    if config.rope_scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, config.rope_scaling)
    pos = torch.arange(config.max_position_embeddings, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv_freq)  # (max_pos, hd/2)
    cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)
    sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x (B, T, heads, hd); cos/sin_signed (B, T, 1, hd) -> rotated x, contiguous."""
    rotated = torch.roll(x, shifts=x.shape[-1] // 2, dims=-1)  # [x2, x1]
    return torch.addcmul(x * cos, rotated, sin_signed)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int, tp: TPGroup) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads = split_heads(config.n_heads, config.n_kv_heads, tp)  # this rank's
        hd = self.head_dim = config.head_dim
        q, kv = config.n_heads * hd, config.n_kv_heads * hd
        self.wqkv = ColumnParallelLinear(config.hidden_size, q + 2 * kv, tp, parts=(q, kv, kv))
        self.wo = RowParallelLinear(q, config.hidden_size, tp)  # all-reduce over the TP group
        self.fused = False  # Llama.fuse_pointwise

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: AttentionCache
                ) -> torch.Tensor:
        B, T, _ = x.shape
        nh, nkv, hd = self.n_heads, self.n_kv_heads, self.head_dim  # this rank's heads
        qkv = self.wqkv(x).view(B, T, nh + 2 * nkv, hd)
        rotate = fused.rope if self.fused else apply_rope
        qk = rotate(qkv[:, :, :nh + nkv], cos, sin)  # q and k rotated in one pass: (B, T, nh+nkv, hd)
        q = qk[:, :, :nh].transpose(1, 2)  # (B, nh, T, hd)
        k = qk[:, :, nh:].transpose(1, 2)  # (B, nkv, T, hd)
        v = qkv[:, :, nh + nkv:].transpose(1, 2)  # (B, nkv, T, hd)
        out = cache.attend(self.layer_idx, q, k, v)  # (B, nh, T, hd)
        return self.wo(out.transpose(1, 2).reshape(B, T, nh * hd))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TPGroup) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.w_gate_up = ColumnParallelLinear(config.hidden_size, 2 * inter, tp, parts=(inter, inter))
        self.w_down = RowParallelLinear(inter, config.hidden_size, tp)  # all-reduce over the TP group
        self.fused = False  # Llama.fuse_pointwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w_gate_up(x)  # [gate; up], (B, T, I / tp_size) each
        if self.fused:
            return self.w_down(fused.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int, tp: TPGroup) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer_idx, tp)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: AttentionCache
                ) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), cos, sin, cache)
        return h + self.mlp(self.mlp_norm(h))


class DecoderLM(nn.Module):
    """What every decoder-only model here shares around its blocks (Llama, and Qwen3-MoE in models/moe): the
    embedding, final norm and LM head (tied when the config says so), the RoPE tables, and reading the logits of
    the last (or each row's own last) token. A subclass builds ``embed``, ``norm``, ``lm_head`` and calls
    ``_finish_init``."""

    config: LlamaConfig

    def _finish_init(self) -> None:
        self.tie_weights()
        # rope_tables reads head_dim, rope_theta, rope_scaling, max_position_embeddings of any config that has them
        cos, sin = rope_tables(self.config, dtype=self.embed.weight.dtype, device=self.embed.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_pos, hd)
        self.register_buffer("rope_sin", sin, persistent=False)  # (max_pos, hd), signed

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (call again after assign-loading)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def init_rope_tables(self) -> None:
        """(Re)build the RoPE tables on the weights' device and dtype (they are not in the checkpoint)."""
        w = self.embed.weight
        self.rope_cos, self.rope_sin = rope_tables(self.config, dtype=w.dtype, device=w.device)

    def _logits(self, h: torch.Tensor, last_only: bool, last_index: torch.Tensor | None) -> torch.Tensor:
        """Final hidden states (B, T, d) -> fp32 logits (B, T, V); (B, 1, V) of the last token with ``last_only``,
        or of token ``last_index[b]`` of row b (right-padded rows of a batched prefill)."""
        if last_index is not None:
            h = h.gather(1, last_index.view(-1, 1, 1).expand(-1, 1, h.shape[-1]))  # (B, 1, d)
        elif last_only:
            h = h[:, -1:]  # (B, 1, d)
        return self.lm_head(self.norm(h)).float()


class Llama(DecoderLM):
    """Decoder-only Llama. Build under `torch.device("meta")` and load with weights.load_llama.

    `tp`: the tensor-parallel group this model is one shard of (default: none). Every member of the group must
    run the same forward calls in the same order with the same inputs (two all-reduces per block over
    `tp.group`); each holds `local_kv_heads` KV heads in its cache. ValueError unless tp.size divides n_heads,
    n_kv_heads and intermediate_size.
    """

    pads_are_inert = True
    """Right-padding a row changes nothing for its real tokens (causal attention, no state across rows), so
    prompts of different lengths may share a prefill forward (engine/kv_engine.py)."""

    def __init__(self, config: LlamaConfig, tp: TPGroup = TPGroup.single()) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        # query / KV heads on this rank: a TP rank's KV cache holds local_kv_heads heads
        self.local_heads, self.local_kv_heads = split_heads(config.n_heads, config.n_kv_heads, tp)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i, tp) for i in range(config.n_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.fused = False  # fuse_pointwise
        self._finish_init()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: AttentionCache,
                last_only: bool = False, last_index: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions (B, T) -> fp32 logits (B, T, V), or (B, 1, V) for the last token only, or with
        ``last_index`` (B,) for token ``last_index[b]`` of row b (right-padded rows of a batched prefill).

        The caller has bound the cache for this pass (e.g. StaticKVCache.bind); positions index RoPE.
        """
        return self._logits(self._blocks(input_ids, positions, cache), last_only, last_index)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: AttentionCache
                      ) -> torch.Tensor:
        """input_ids, positions (B, T) -> the final normed hidden states (B, T, d): a prefill without the LM head
        (text conditioning for another model). The cache is bound by the caller, as for ``forward``."""
        return self.norm(self._blocks(input_ids, positions, cache))

    def fuse_pointwise(self, on: bool = True) -> None:
        """Run the blocks' pointwise work as the fused Triton kernels of models/common/fused.py (the device must
        run them: ``fused.available``): each residual add with the norm after it, SwiGLU's activation and product,
        the rotation of queries and keys. The same results as the torch ops up to an fp32 rounding."""
        self.fused = bool(on)
        for layer in self.layers:
            layer.attn.fused = layer.mlp.fused = self.fused

    def _blocks(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: AttentionCache) -> torch.Tensor:
        h = self.embed(input_ids)  # (B, T, d)
        cos = self.rope_cos[positions].unsqueeze(2)  # (B, T, 1, hd)
        sin = self.rope_sin[positions].unsqueeze(2)
        if self.fused:
            return self._fused_blocks(h, cos, sin, cache)
        for layer in self.layers:
            h = layer(h, cos, sin, cache)
        return h

    def _fused_blocks(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: AttentionCache
                      ) -> torch.Tensor:
        """``Block.forward`` of every layer with each residual add fused into the norm that follows it (the next
        block's, or its own MLP's); the last add stays a plain one, the final norm being ``_logits``'."""
        layers = self.layers
        x = layers[0].attn_norm(h)
        for i, layer in enumerate(layers):
            x, h = fused.add_rms_norm(layer.attn(x, cos, sin, cache), h, layer.mlp_norm.weight, layer.mlp_norm.eps)
            m = layer.mlp(x)
            if i + 1 < len(layers):
                following = layers[i + 1].attn_norm
                x, h = fused.add_rms_norm(m, h, following.weight, following.eps)
            else:
                h = h + m
        return h
