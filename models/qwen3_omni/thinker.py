"""The Qwen3-Omni thinker's text decoder: HF's ``Qwen3OmniMoeThinkerTextModel`` plus the LM head of
``Qwen3OmniMoeThinkerForConditionalGeneration``.

A Qwen3-MoE decoder (models/moe: routers through the router contract of models/moe/routers.py, the fused expert
compute, RMSNorm and the RoPE rotation of models/llama) with two multimodal additions:

- **M-RoPE.** Positions are (3, B, T): temporal, height and width. Each rotary frequency j < head_dim/2 takes its
  angle from one axis, interleaved as HF's ``Qwen3OmniMoeThinkerTextRotaryEmbedding.recomposition_frequencies``
  does: height when j % 3 == 1 and j < 3 * mrope_section[1], width when j % 3 == 2 and j < 3 * mrope_section[2],
  temporal otherwise. Positions (B, T) mean the same value on the three axes, which is plain RoPE: text-only
  prompts and every decode step take the same table lookup as the other decoders.
- **Deepstack.** The vision encoder's deepstack features (one (N, H) tensor per early layer) are added to the
  hidden states at the visual positions after decoder layers 0, 1, ... (HF's ``_deepstack_process``).

Inputs are token ids or input embeddings: ``embed(input_ids, mm_embeds, mm_mask)`` makes the latter (text
embeddings with image / audio embeddings placed at their placeholder tokens, as HF's ``masked_scatter``).

Parameter names are the published checkpoint's below ``thinker.``: ``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``...self_attn.{q,k}_norm.weight``,
``...{input,post_attention}_layernorm.weight``, ``...mlp.gate.weight`` (the router's), per expert
``...mlp.experts.{e}.{gate,up,down}_proj.weight``, ``model.norm.weight``, ``lm_head.weight``. The experts compute
from fused tensors (``w_gate_up`` (E, 2I, H), ``w_down`` (E, H, I), models/moe's ``FusedExperts``) of which the
per-expert parameters are views, so a state dict carries the published names and no second copy exists. Loading
with ``assign=True`` replaces the parameters: ``finish_load()`` fuses them again (and builds the RoPE tables).

Tensor parallelism (models/common/tp.py) as models/moe: q/k/v column-parallel, o_proj row-parallel (one all-reduce),
each expert split along its width with one all-reduce per MoE block, routers, norms, embedding and LM head
replicated. ``checkpoint_sources`` gives the loader (models/common/checkpoint.py) the published tensor of each
parameter; the per-expert modules cut their own shards (``weight_loader``).
Shape legend: B batch, T new tokens, H hidden, nh/nkv this rank's query/KV heads, hd head dim, E experts, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from models.common.linear import Linear
from models.common.tp import ColumnParallelLinear, RowParallelLinear, shard_cols, shard_rows, split_heads
from models.llama.model import DecoderLM, RMSNorm, apply_rope
from models.moe.config import MoEConfig
from models.moe.model import FusedExperts
from models.moe.routers import TopKRouter, build_router, check_router_output
from mstar_dist.distributed.tp import TPGroup

if TYPE_CHECKING:
    from mstar_dist.engine.kv_cache import AttentionCache

__all__ = ["ThinkerConfig", "Qwen3OmniThinker", "mrope_axes", "place"]

DEFAULT_ROPE_THETA = 1_000_000.0
"""The text config's RoPE base when config.json leaves it out (HF's default for this model)."""
MROPE_KEYS = ("mrope_section", "interleaved", "mrope_interleaved")
"""Keys of the text config's ``rope_scaling`` / ``rope_parameters`` that are M-RoPE's, not plain RoPE's."""


@dataclass(frozen=True)
class ThinkerConfig:
    """The thinker's text decoder as ``thinker_config.text_config`` of the published config.json gives it."""

    text: MoEConfig
    """The Qwen3-MoE decoder's hyperparameters (models/moe/config.py), RoPE without its M-RoPE keys."""
    mrope_section: tuple[int, int, int]
    """Rotary frequencies per axis (temporal, height, width); they add up to head_dim / 2."""

    def __post_init__(self) -> None:
        sec = self.mrope_section
        if len(sec) != 3 or any(not isinstance(s, int) or s < 0 for s in sec) or sum(sec) != self.text.head_dim // 2:
            raise ValueError(f"text_config.rope_scaling.mrope_section must be 3 non-negative ints adding up to "
                             f"head_dim / 2 = {self.text.head_dim // 2}, got {list(sec)!r}")

    @classmethod
    def from_hf(cls, thinker_config: dict[str, Any]) -> "ThinkerConfig":
        """From config.json's ``thinker_config`` (or a bare ``text_config`` dict); ValueError for what this model
        cannot run. The interleaving flags are read as HF's model reads them: the layout is always interleaved."""
        text = dict(thinker_config.get("text_config", thinker_config))
        text.setdefault("norm_topk_prob", True)  # Qwen3OmniMoeTextConfig's defaults where MoEConfig's differ
        if "rope_theta" not in text and "rope_theta" not in (text.get("rope_parameters") or {}):
            text["rope_theta"] = DEFAULT_ROPE_THETA
        section = None
        for key in ("rope_scaling", "rope_parameters"):
            rope = text.get(key)
            if isinstance(rope, dict):
                section = rope.get("mrope_section", section)
                text[key] = {k: v for k, v in rope.items() if k not in (*MROPE_KEYS, "type")}
        if section is None:
            raise ValueError("text_config: rope_scaling.mrope_section is missing (M-RoPE needs it)")
        return cls(text=MoEConfig.from_hf(text), mrope_section=tuple(section))


def mrope_axes(head_dim: int, section: Sequence[int]) -> list[int]:
    """The axis (0 temporal, 1 height, 2 width) of every rotary column (head_dim of them: the frequencies twice, as
    the rotate-half layout repeats them), interleaved as HF's ``recomposition_frequencies``."""
    half = head_dim // 2
    axes = [1 if j % 3 == 1 and j < 3 * section[1] else 2 if j % 3 == 2 and j < 3 * section[2] else 0
            for j in range(half)]
    return axes + axes


def place(h: torch.Tensor, mm_embeds: torch.Tensor, mm_mask: torch.Tensor) -> torch.Tensor:
    """``h`` (B, T, H) with row-major positions where ``mm_mask`` (B, T) is true replaced by the rows of
    ``mm_embeds`` (N, H), in order (HF's ``masked_scatter``); a new tensor. ValueError when N is not the number of
    placeholder positions."""
    n = int(mm_mask.sum())
    if mm_embeds.dim() != 2 or mm_embeds.shape[0] != n or mm_embeds.shape[1] != h.shape[-1]:
        raise ValueError(f"multimodal embeddings of shape {tuple(mm_embeds.shape)} do not fill {n} placeholder "
                         f"tokens of width {h.shape[-1]}")
    return h.masked_scatter(mm_mask[..., None].to(h.device), mm_embeds.to(h.device, h.dtype))


class ShardedWeight(nn.Module):
    """One published weight (out, in) that the fused compute uses through a view: this rank's rows (``dim=0``, a
    column-parallel cut) or columns (``dim=1``, row-parallel). ``weight_loader`` cuts the shard from the full
    tensor; not a ``Linear``, so nothing packs or calls it on its own."""

    def __init__(self, out_features: int, in_features: int, tp: TPGroup, dim: int) -> None:
        super().__init__()
        self.tp, self.dim = tp, dim
        if dim == 0:
            out_features = tp.split(out_features, "MoE experts: moe_intermediate_size")
        else:
            in_features = tp.split(in_features, "MoE experts: moe_intermediate_size")
        self.weight = nn.Parameter(torch.empty(out_features, in_features).normal_(std=0.02), requires_grad=False)

    def weight_loader(self, name: str, full_parts: Sequence[Any]) -> torch.Tensor:
        if name != "weight" or len(full_parts) != 1:
            raise ValueError(f"ShardedWeight: expected 1 part for 'weight', got {len(full_parts)} for {name!r}")
        return shard_rows(full_parts[0], self.tp) if self.dim == 0 else shard_cols(full_parts[0], self.tp)


class Expert(nn.Module):
    """The three published tensors of one expert (views into the fused ones of ``ThinkerExperts``)."""

    def __init__(self, hidden: int, inter: int, tp: TPGroup) -> None:
        super().__init__()
        self.gate_proj = ShardedWeight(inter, hidden, tp, dim=0)
        self.up_proj = ShardedWeight(inter, hidden, tp, dim=0)
        self.down_proj = ShardedWeight(hidden, inter, tp, dim=1)


class ThinkerExperts(FusedExperts):
    """E experts named as published (children ``0`` .. ``E-1``), computed from fused non-persistent buffers."""

    def __init__(self, num_experts: int, hidden: int, inter: int, tp: TPGroup) -> None:
        super().__init__()
        self.num_experts = num_experts
        for e in range(num_experts):
            self.add_module(str(e), Expert(hidden, inter, tp))
        self.register_buffer("w_gate_up", None, persistent=False)
        self.register_buffer("w_down", None, persistent=False)
        self.fuse()

    def fuse(self) -> None:
        """Stack the per-expert tensors into ``w_gate_up`` / ``w_down`` and make the parameters views of them (after
        ``load_state_dict(assign=True)`` replaced them; a no-op copy otherwise)."""
        experts = [self.get_submodule(str(e)) for e in range(self.num_experts)]
        inter = experts[0].gate_proj.weight.shape[0]
        self.w_gate_up = torch.stack([torch.cat((x.gate_proj.weight, x.up_proj.weight)) for x in experts])
        self.w_down = torch.stack([x.down_proj.weight for x in experts])
        for e, x in enumerate(experts):
            x.gate_proj.weight = nn.Parameter(self.w_gate_up[e, :inter], requires_grad=False)
            x.up_proj.weight = nn.Parameter(self.w_gate_up[e, inter:], requires_grad=False)
            x.down_proj.weight = nn.Parameter(self.w_down[e], requires_grad=False)


class SparseMoE(nn.Module):
    """Router (``gate``) + experts; ONE all-reduce over the TP group per forward (experts' partial sums)."""

    def __init__(self, config: MoEConfig, layer_idx: int, tp: TPGroup, router: str | dict | None) -> None:
        super().__init__()
        self.layer_idx, self.tp = layer_idx, tp
        self.num_experts, self.k = config.num_experts, config.num_experts_per_tok
        self.gate = build_router(router, layer_idx=layer_idx, hidden=config.hidden_size,
                                 num_experts=config.num_experts, k=config.num_experts_per_tok,
                                 norm_topk_prob=config.norm_topk_prob)
        self.experts = ThinkerExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size, tp)

    def forward(self, h: torch.Tensor, router_states: Any) -> tuple[torch.Tensor, Any]:
        """h (B, T, H) -> (B, T, H), the router's next state. Collective: one all-reduce over ``tp.group``."""
        B, T, H = h.shape
        x = h.reshape(B * T, H)
        weights, selected, states = check_router_output(
            self.gate(x, router_states), layer_idx=self.layer_idx, n_tokens=B * T, k=self.k,
            num_experts=self.num_experts, values=False)
        y = self.experts(x, selected, weights)  # (N, H), this rank's partial sum
        return self.tp.all_reduce(y.contiguous()).view(B, T, H), states


class DenseMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) of a layer in ``mlp_only_layers``; gate/up column-, down row-parallel."""

    def __init__(self, hidden: int, inter: int, tp: TPGroup) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, inter, tp)
        self.up_proj = ColumnParallelLinear(hidden, inter, tp)
        self.down_proj = RowParallelLinear(inter, hidden, tp)  # all-reduce over the TP group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Qwen3 attention with the published projections: q/k RMSNorm per head before the rotation, GQA."""

    def __init__(self, config: MoEConfig, layer_idx: int, tp: TPGroup) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads = split_heads(config.n_heads, config.n_kv_heads, tp)  # this rank's
        hd = self.head_dim = config.head_dim
        self.q_proj = ColumnParallelLinear(config.hidden_size, config.n_heads * hd, tp)
        self.k_proj = ColumnParallelLinear(config.hidden_size, config.n_kv_heads * hd, tp)
        self.v_proj = ColumnParallelLinear(config.hidden_size, config.n_kv_heads * hd, tp)
        self.o_proj = RowParallelLinear(config.n_heads * hd, config.hidden_size, tp)  # all-reduce over the group
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: AttentionCache
                ) -> torch.Tensor:
        B, T, _ = x.shape
        nh, nkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q = apply_rope(self.q_norm(self.q_proj(x).view(B, T, nh, hd)), cos, sin).transpose(1, 2)  # (B, nh, T, hd)
        k = apply_rope(self.k_norm(self.k_proj(x).view(B, T, nkv, hd)), cos, sin).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, nkv, hd).transpose(1, 2)  # (B, nkv, T, hd)
        out = cache.attend(self.layer_idx, q, k, v)  # (B, nh, T, hd)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, nh * hd))


class DecoderLayer(nn.Module):
    def __init__(self, config: MoEConfig, layer_idx: int, tp: TPGroup, router: str | dict | None) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, tp)
        self.sparse = config.is_sparse(layer_idx)
        self.mlp = SparseMoE(config, layer_idx, tp, router) if self.sparse \
            else DenseMLP(config.hidden_size, config.intermediate_size, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: AttentionCache,
                router_states: Any) -> tuple[torch.Tensor, Any]:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache)
        if not self.sparse:  # a dense layer passes the router state through
            return h + self.mlp(self.post_attention_layernorm(h)), router_states
        out, router_states = self.mlp(self.post_attention_layernorm(h), router_states)
        return h + out, router_states


class TextModel(nn.Module):
    """``thinker.model``: the embedding, the decoder layers and the final norm (the published names' owner)."""

    def __init__(self, config: MoEConfig, tp: TPGroup, router: str | dict | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp, router) for i in range(config.n_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3OmniThinker(DecoderLM):
    """The thinker's text decoder and LM head; its state dict is the published checkpoint's below ``thinker.``.

    Build under ``torch.device("meta")``, ``load_state_dict(state, assign=True)``, then ``finish_load()``. ``tp``:
    the TP group this model is one shard of (every member runs the same forwards: two all-reduces per layer over
    ``tp.group``; each holds ``local_kv_heads`` KV heads in its cache). ``router``: the router spec of every MoE
    block (models/moe/routers.py). The forward is the KV engine's (engine/kv_engine.py) with the multimodal inputs
    as keyword arguments; ``prefill_inputs`` names the call inputs the engine hands it.
    """

    prefill_inputs = ("inputs_embeds", "deepstack", "visual_mask")
    """Call inputs of a prefill that the KV engine passes to ``forward`` as keyword arguments, as given (a prompt
    with any of them is a forward of its own: B = 1); its ``position_ids`` (3, T) become ``positions``."""
    position_offsets = True
    """Decode positions are the cache position plus the request's offset (rope.py's ``rope_delta``)."""

    def __init__(self, config: ThinkerConfig, tp: TPGroup = TPGroup.single(),
                 router: str | dict | None = None) -> None:
        super().__init__()
        self.thinker_config = config
        self.config = config.text  # DecoderLM reads the decoder's hyperparameters (RoPE, tied head) here
        self.tp = tp
        self.local_heads, self.local_kv_heads = split_heads(config.text.n_heads, config.text.n_kv_heads, tp)
        self.model = TextModel(config.text, tp, router)
        self.lm_head = Linear(config.text.hidden_size, config.text.vocab_size)  # replicated: full logits per rank
        self._finish_init()
        axes = torch.tensor(mrope_axes(config.text.head_dim, config.mrope_section), device=self.embed.weight.device)
        self.register_buffer("mrope_axis", axes, persistent=False)  # (hd,) the axis of every rotary column
        # right-padding is inert unless a router keeps state across the batch's tokens (it would count the pads)
        self.pads_are_inert = all(type(layer.mlp.gate) is TopKRouter for layer in self.model.layers if layer.sparse)

    @property
    def embed(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def norm(self) -> RMSNorm:
        return self.model.norm

    def finish_load(self) -> None:
        """After ``load_state_dict(..., assign=True)``: fuse the experts again, tie the head if the config says so,
        and build the RoPE tables on the weights' device and dtype."""
        for layer in self.model.layers:
            if layer.sparse:
                layer.mlp.experts.fuse()
        self.tie_weights()
        self.init_rope_tables()
        self.mrope_axis = torch.tensor(mrope_axes(self.config.head_dim, self.thinker_config.mrope_section),
                                       device=self.embed.weight.device)

    def checkpoint_sources(self, prefix: str = "thinker.") -> dict[str, tuple[str, ...]]:
        """Our parameter name -> the published tensor that fills it (for models/common/checkpoint.py's loader):
        every state-dict entry under ``prefix`` but a tied head (the loader fills it with the embedding, as
        models/moe/weights.py does). A router without a ``weight`` has no entry: the loader must ignore that layer's
        ``mlp.gate.weight`` (models/moe/routers.py)."""
        names = [n for n in self.state_dict() if not (self.config.tie_word_embeddings and n == "lm_head.weight")]
        return {n: (prefix + n,) for n in names}

    def embed_input(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None,
                    mm_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Input embeddings (B, T, H): the token embeddings of ``input_ids`` (B, T), with ``mm_embeds`` (N, H) placed
        at the positions where ``mm_mask`` (B, T) is true (image and audio placeholders), row-major (``place``)."""
        h = self.embed(input_ids)
        if mm_embeds is None:
            return h
        if mm_mask is None:
            raise ValueError("multimodal embeddings need mm_mask (their placeholder positions)")
        return place(h, mm_embeds, mm_mask)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin (B, T, 1, hd) of positions (B, T) (one value on every axis) or (3, B, T) (M-RoPE)."""
        if positions.dim() == 2:
            return self.rope_cos[positions].unsqueeze(2), self.rope_sin[positions].unsqueeze(2)
        _, B, T = positions.shape
        axis = self.mrope_axis.view(1, 1, 1, -1).expand(1, B, T, -1)
        cos = self.rope_cos[positions].gather(0, axis)[0]  # (B, T, hd): each column from its own axis
        sin = self.rope_sin[positions].gather(0, axis)[0]
        return cos.unsqueeze(2), sin.unsqueeze(2)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: AttentionCache,
                last_only: bool = False, last_index: torch.Tensor | None = None, *,
                inputs_embeds: torch.Tensor | None = None, deepstack: Sequence[torch.Tensor] | None = None,
                visual_mask: torch.Tensor | None = None, capture: Sequence[int] = ()
                ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """fp32 logits (B, T, V), or (B, 1, V) of the last token (``last_only``) or of token ``last_index[b]`` of
        row b (right-padded rows of a batched prefill).

        ``input_ids`` (B, T); ``inputs_embeds`` (B, T, H), when given, replaces their embeddings (``embed_input``).
        ``positions`` (B, T) or (3, B, T). ``deepstack``: per early layer i an (N, H) tensor added after layer i at
        the N positions where ``visual_mask`` (B, T) is true (row-major). ``capture``: indices of HF's
        ``hidden_states`` to return as well, (logits, [(B, T, H) ...]): 0 the input embeddings, i < n_layers the
        output of layer i - 1 (before its deepstack addition). The caller has bound the cache for this pass.
        Router states start as None at every call and thread from each MoE block to the next.
        """
        if any(not 0 <= i < len(self.model.layers) for i in capture):
            raise ValueError(f"capture: hidden-state indices must be in [0, {len(self.model.layers)}), "
                             f"got {list(capture)}")
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds.to(self.embed.weight.dtype)
        visual = None
        if deepstack is not None and len(deepstack):
            if visual_mask is None:
                raise ValueError("deepstack features need visual_mask (where the visual tokens are)")
            visual = visual_mask.reshape(-1).nonzero().squeeze(1).to(h.device)  # (N,) flat token indices
        cos, sin = self.rope(positions)
        captured = [h] if 0 in capture else []
        router_states = None
        for i, layer in enumerate(self.model.layers):
            h, router_states = layer(h, cos, sin, cache, router_states)
            if i + 1 in capture:
                captured.append(h)
            if visual is not None and i < len(deepstack):
                h = h.reshape(-1, h.shape[-1]).index_add(0, visual, deepstack[i].to(h.device, h.dtype)).view(h.shape)
        logits = self._logits(h, last_only, last_index)
        return (logits, captured) if capture else logits
