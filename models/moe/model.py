"""Qwen3-MoE decoder: Qwen3 attention (GQA, per-head q/k RMSNorm before RoPE) and sparse MoE blocks with a
pluggable router (models/moe/routers.py), optionally with Qwen2-MoE's sigmoid-gated shared expert.

Same interface as models/llama/model.py: `forward(input_ids, positions, cache, last_only)` and every attention
layer calls `cache.attend(layer_idx, q, k, v)`, so KVCacheEngine and StaticKVCache run it unchanged.

Experts are stored fused: `w_gate_up` (E, 2I, H) = [gate_proj; up_proj] per expert and `w_down` (E, H, I).
They are computed by grouping the token->expert assignments per expert (one matmul per expert that got tokens)
or, for decode-sized inputs and CUDA-graph capture, by gathering each assignment's expert weights (no host
sync); both give the same result.

Tensor parallelism (models/common/tp.py): attention heads are split as in Llama; every expert is split along
its intermediate dimension (each rank holds all E experts' I/size slice), so a rank's expert outputs are partial
sums of the true outputs; the router is replicated (identical routing on every rank, no communication), the
shared expert is split the same way and its gate replicated. Each rank adds its routed and shared partial sums
and the block does ONE all-reduce over the TP group. Dense (mlp_only) layers are column/row parallel.
Shape legend: B batch, T new tokens, N = B*T tokens, H hidden, E experts, k experts per token, I expert width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from models.common.linear import Linear
from models.common.tp import ColumnParallelLinear, RowParallelLinear, shard_cols, shard_rows, split_heads
from mstar_dist.distributed.tp import TPGroup
from models.llama.model import DecoderLM, RMSNorm, apply_rope
from models.moe.config import MoEConfig
from models.moe.routers import build_router, check_router_output

if TYPE_CHECKING:
    from mstar_dist.engine.kv_cache import AttentionCache


class Attention(nn.Module):
    """Qwen3 attention: fused wqkv (column-parallel per q/k/v part), q/k RMSNorm per head, RoPE, wo row-parallel."""

    def __init__(self, config: MoEConfig, layer_idx: int, tp: TPGroup) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads = split_heads(config.n_heads, config.n_kv_heads, tp)  # this rank's
        hd = self.head_dim = config.head_dim
        q, kv = config.n_heads * hd, config.n_kv_heads * hd
        self.wqkv = ColumnParallelLinear(config.hidden_size, q + 2 * kv, tp, parts=(q, kv, kv))
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.wo = RowParallelLinear(q, config.hidden_size, tp)  # all-reduce over the TP group

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: AttentionCache
                ) -> torch.Tensor:
        B, T, _ = x.shape
        nh, nkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x).view(B, T, nh + 2 * nkv, hd)
        q = apply_rope(self.q_norm(qkv[:, :, :nh]), cos, sin).transpose(1, 2)  # (B, nh, T, hd)
        k = apply_rope(self.k_norm(qkv[:, :, nh:nh + nkv]), cos, sin).transpose(1, 2)  # (B, nkv, T, hd)
        v = qkv[:, :, nh + nkv:].transpose(1, 2)  # (B, nkv, T, hd)
        out = cache.attend(self.layer_idx, q, k, v)  # (B, nh, T, hd)
        return self.wo(out.transpose(1, 2).reshape(B, T, nh * hd))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); gate/up column-parallel, down row-parallel (reduced unless reduce=False)."""

    def __init__(self, hidden: int, inter: int, tp: TPGroup, *, reduce: bool = True) -> None:
        super().__init__()
        self.w_gate_up = ColumnParallelLinear(hidden, 2 * inter, tp, parts=(inter, inter))
        self.w_down = RowParallelLinear(inter, hidden, tp, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)  # (..., I / tp_size) each
        return self.w_down(F.silu(gate) * up)


class FusedExperts(nn.Module):
    """The compute of E SwiGLU experts held fused: a subclass provides ``num_experts`` and the tensors ``w_gate_up``
    (E, 2I, H) = [gate_e; up_e] per expert and ``w_down`` (E, H, I), as parameters or buffers (on a TP rank I is its
    slice, and the output a partial sum, not reduced)."""

    num_experts: int
    w_gate_up: torch.Tensor
    w_down: torch.Tensor

    def forward(self, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (N, H), selected (N, k) int64, weights (N, k) -> sum_j weights * expert_j(x): (N, H), partial on TP."""
        n_assign = selected.numel()
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if n_assign <= self.num_experts or capturing:
            return self._gathered(x, selected, weights)
        return self._grouped(x, selected, weights)

    def _grouped(self, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sort the assignments by expert; one matmul pair per expert that got tokens (one host sync: the counts)."""
        k = selected.shape[1]
        flat = selected.reshape(-1)  # (N*k,)
        order = flat.argsort(stable=True)
        token = order // k  # token of each assignment, grouped by expert
        w = weights.reshape(-1)[order].to(x.dtype)[:, None]  # (N*k, 1)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = token[start:start + n]
                gate, up = F.linear(x[rows], self.w_gate_up[e]).chunk(2, dim=-1)  # (n, I) each
                out.index_add_(0, rows, F.linear(F.silu(gate) * up, self.w_down[e]) * w[start:start + n])
                start += n
        return out

    def _gathered(self, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Gather each assignment's expert weights and batch-matmul: no host sync (decode, CUDA graphs).

        Copies N*k experts' weights, at most E's when N*k <= E: at worst twice the grouped path's weight traffic.
        A fused grouped-GEMM kernel would replace both paths."""
        N, k = selected.shape
        flat = selected.reshape(-1)  # (N*k,)
        xs = x[:, None].expand(N, k, x.shape[1]).reshape(N * k, x.shape[1], 1)  # (N*k, H, 1)
        gate, up = torch.bmm(self.w_gate_up[flat], xs).squeeze(-1).chunk(2, dim=-1)  # (N*k, I) each
        y = torch.bmm(self.w_down[flat], (F.silu(gate) * up)[:, :, None]).squeeze(-1)  # (N*k, H)
        return (y.view(N, k, -1) * weights.to(x.dtype)[:, :, None]).sum(dim=1)


class Experts(FusedExperts):
    """E SwiGLU experts, fused; on a TP rank each holds its I/size slice and returns partial sums (not reduced)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        local = tp.split(inter, "MoE experts: moe_intermediate_size")
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * local, hidden).normal_(std=0.02))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, local).normal_(std=0.02))

    def weight_loader(self, name: str, full_parts: list[Any]) -> torch.Tensor:
        """This rank's fused tensor from per-expert HF tensors (tensors or safetensors slices): for `w_gate_up`
        [gate_0, up_0, gate_1, up_1, ...] each (I, H); for `w_down` [down_0, down_1, ...] each (H, I)."""
        E = self.num_experts
        if name == "w_gate_up" and len(full_parts) == 2 * E:
            return torch.stack([torch.cat((shard_rows(full_parts[2 * e], self.tp),
                                           shard_rows(full_parts[2 * e + 1], self.tp))) for e in range(E)])
        if name == "w_down" and len(full_parts) == E:
            return torch.stack([shard_cols(p, self.tp) for p in full_parts])
        raise ValueError(f"Experts: unexpected {len(full_parts)} parts for {name!r} with {E} experts")


class MoEBlock(nn.Module):
    """Router + experts (+ sigmoid-gated shared expert); ONE all-reduce over the TP group per forward."""

    def __init__(self, config: MoEConfig, layer_idx: int, tp: TPGroup, router: str | dict | None = None) -> None:
        super().__init__()
        self.layer_idx, self.tp = layer_idx, tp
        self.num_experts, self.k = config.num_experts, config.num_experts_per_tok
        self.router = build_router(router, layer_idx=layer_idx, hidden=config.hidden_size,
                                   num_experts=config.num_experts, k=config.num_experts_per_tok,
                                   norm_topk_prob=config.norm_topk_prob)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size, tp)
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(config.hidden_size, config.shared_expert_intermediate_size, tp, reduce=False)
            self.shared_expert_gate = Linear(config.hidden_size, 1)  # replicated

    def forward(self, h: torch.Tensor, router_states: Any = None, *, return_router_states: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """h (B, T, H) -> (B, T, H) [, the router's next state]. Collective: one all-reduce over `tp.group`
        (every TP rank must call it); routing needs no communication (the router is replicated)."""
        B, T, H = h.shape
        x = h.reshape(B * T, H)
        weights, selected, states = check_router_output(
            self.router(x, router_states), layer_idx=self.layer_idx, n_tokens=B * T, k=self.k,
            num_experts=self.num_experts, values=False)
        y = self.experts(x, selected, weights)  # (N, H), this rank's partial sum
        if self.shared_expert is not None:  # the gate scales a partial sum: still a partial sum of the true output
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        y = self.tp.all_reduce(y.contiguous()).view(B, T, H)
        return (y, states) if return_router_states else y


class Block(nn.Module):
    def __init__(self, config: MoEConfig, layer_idx: int, tp: TPGroup, router: str | dict | None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer_idx, tp)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sparse = config.is_sparse(layer_idx)
        self.mlp = MoEBlock(config, layer_idx, tp, router) if self.sparse \
            else SwiGLU(config.hidden_size, config.intermediate_size, tp)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: AttentionCache,
                router_states: Any) -> tuple[torch.Tensor, Any]:
        h = h + self.attn(self.attn_norm(h), cos, sin, cache)
        if not self.sparse:
            return h + self.mlp(self.mlp_norm(h)), router_states  # a dense layer passes the state through
        out, router_states = self.mlp(self.mlp_norm(h), router_states, return_router_states=True)
        return h + out, router_states


class Qwen3Moe(DecoderLM):
    """Decoder-only Qwen3-MoE. Build under `torch.device("meta")` and load with weights.load_moe.

    `tp`: the tensor-parallel group this model is one shard of (default: none); every member must run the same
    forward calls with the same inputs (two all-reduces per layer over `tp.group`); each holds
    `local_kv_heads` KV heads in its cache. `router`: the router spec of every MoE block (models/moe/routers.py).
    """

    def __init__(self, config: MoEConfig, tp: TPGroup = TPGroup.single(), router: str | dict | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        # query / KV heads on this rank: a TP rank's KV cache holds local_kv_heads heads
        self.local_heads, self.local_kv_heads = split_heads(config.n_heads, config.n_kv_heads, tp)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i, tp, router) for i in range(config.n_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)  # replicated: full logits on every rank
        self._finish_init()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: AttentionCache,
                last_only: bool = False, last_index: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions (B, T) -> fp32 logits (B, T, V), or (B, 1, V) for the last token only, or with
        ``last_index`` (B,) for token ``last_index[b]`` of row b (right-padded rows of a batched prefill).

        The caller has bound the cache for this pass. Router states start as None at every call and thread
        from each MoE block to the next.
        """
        h = self.embed(input_ids)  # (B, T, H)
        cos = self.rope_cos[positions].unsqueeze(2)  # (B, T, 1, hd)
        sin = self.rope_sin[positions].unsqueeze(2)
        router_states = None
        for layer in self.layers:
            h, router_states = layer(h, cos, sin, cache, router_states)
        return self._logits(h, last_only, last_index)
