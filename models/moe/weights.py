"""Load an HF-layout Qwen3-MoE checkpoint (config.json + *.safetensors) into `Qwen3Moe`, or one TP shard of it.

HF layout (per-expert tensors, as Qwen's checkpoints and transformers' save_pretrained write them):
`model.layers.N.mlp.gate.weight` (E, H), `model.layers.N.mlp.experts.M.{gate,up,down}_proj.weight`, and for the
shared-expert variant `mlp.shared_expert.{gate,up,down}_proj.weight` and `mlp.shared_expert_gate.weight` (1, H).
Experts are fused at load ([gate_M; up_M] stacked over M) from only this rank's slice of each tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from models.common.checkpoint import SafetensorsDir, load_sharded_state, read_hf_config
from mstar_dist.distributed.tp import TPGroup
from models.moe.config import MoEConfig
from models.moe.model import Qwen3Moe
from models.moe.routers import probe_router


def read_config(weights_dir: str | Path) -> MoEConfig:
    return read_hf_config(weights_dir, MoEConfig.from_hf, "write a random one with scripts/make_moe_checkpoint.py")


def _swiglu_sources(ours: str, hf: str) -> dict[str, tuple[str, ...]]:
    return {ours + "w_gate_up.weight": (hf + "gate_proj.weight", hf + "up_proj.weight"),
            ours + "w_down.weight": (hf + "down_proj.weight",)}


def _hf_sources(config: MoEConfig, router_has_weight: list[bool]) -> dict[str, tuple[str, ...]]:
    """Our parameter name -> the HF tensors that make it (fused along dim 0, or per expert; before sharding)."""
    sources = {"embed.weight": ("model.embed_tokens.weight",), "norm.weight": ("model.norm.weight",)}
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = ("lm_head.weight",)
    for i in range(config.n_layers):
        p, hf = f"layers.{i}.", f"model.layers.{i}."
        sources[p + "attn_norm.weight"] = (hf + "input_layernorm.weight",)
        sources[p + "attn.wqkv.weight"] = tuple(hf + f"self_attn.{x}_proj.weight" for x in "qkv")
        sources[p + "attn.q_norm.weight"] = (hf + "self_attn.q_norm.weight",)
        sources[p + "attn.k_norm.weight"] = (hf + "self_attn.k_norm.weight",)
        sources[p + "attn.wo.weight"] = (hf + "self_attn.o_proj.weight",)
        sources[p + "mlp_norm.weight"] = (hf + "post_attention_layernorm.weight",)
        if not config.is_sparse(i):
            sources.update(_swiglu_sources(p + "mlp.", hf + "mlp."))
            continue
        if router_has_weight[i]:
            sources[p + "mlp.router.weight"] = (hf + "mlp.gate.weight",)
        experts = range(config.num_experts)
        sources[p + "mlp.experts.w_gate_up"] = tuple(hf + f"mlp.experts.{e}.{x}_proj.weight"
                                                     for e in experts for x in ("gate", "up"))
        sources[p + "mlp.experts.w_down"] = tuple(hf + f"mlp.experts.{e}.down_proj.weight" for e in experts)
        if config.shared_expert_intermediate_size:
            sources.update(_swiglu_sources(p + "mlp.shared_expert.", hf + "mlp.shared_expert."))
            sources[p + "mlp.shared_expert_gate.weight"] = (hf + "mlp.shared_expert_gate.weight",)
    return sources


def _router_tensors(model: Qwen3Moe, config: MoEConfig) -> list[bool]:
    """Per layer: whether its router takes the checkpoint's gate weight. ValueError for a router holding other
    tensors (nothing could load them)."""
    has_weight = []
    for i, layer in enumerate(model.layers):
        router = getattr(layer.mlp, "router", None)
        names = set(router.state_dict()) if isinstance(router, torch.nn.Module) else set()
        if names - {"weight"}:
            raise ValueError(f"layer {i}: router {type(router).__name__} has tensors {sorted(names - {'weight'})} "
                             f"that the checkpoint cannot fill (a router's only checkpoint tensor is `weight`, "
                             f"from mlp.gate.weight)")
        has_weight.append("weight" in names)
    return has_weight


def load_moe(weights_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
             tp: TPGroup = TPGroup.single(), router: str | dict | None = None) -> tuple[Qwen3Moe, MoEConfig]:
    """Build `Qwen3Moe` (this rank's TP shard, `router` in every MoE block) on meta and assign the checkpoint.

    Reads only this rank's shard of every sharded tensor (no collective: the TP group gives its size and
    rank_in_group). Every router is probed on a real input after loading (ValueError naming the layer if it
    breaks the contract). Returns the model in eval mode with grads off and the full config;
    `model.local_kv_heads` is what this rank's KV cache must hold. FileNotFoundError for a missing directory,
    config.json or safetensors file; ValueError for a checkpoint that does not match its config or a TP size
    that does not divide the heads, the expert width or the MLP widths.
    """
    weights_dir = Path(weights_dir).expanduser()
    config = read_config(weights_dir)
    with torch.device("meta"):
        model = Qwen3Moe(config, tp=tp, router=router)
    router_has_weight = _router_tensors(model, config)
    gates = {f"model.layers.{i}.mlp.gate.weight" for i, w in enumerate(router_has_weight)
             if config.is_sparse(i) and not w}  # routers without weights ignore the checkpoint's gate

    def ignored(name: str) -> bool:
        return name in gates or (config.tie_word_embeddings and name == "lm_head.weight")

    with SafetensorsDir(weights_dir) as ckpt:
        state = load_sharded_state(model, _hf_sources(config, router_has_weight), ckpt, device=device, dtype=dtype,
                                   source=weights_dir, ignored=ignored)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign=True replaced the shared Parameter with two
    model.init_rope_tables()
    unloaded = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if unloaded:  # e.g. a custom router's non-persistent buffer: nothing in the checkpoint gives it values
        raise ValueError(f"{weights_dir}: tensors {unloaded[:4]} were not loaded (still on meta)")
    model.eval().requires_grad_(False)
    for i, layer in enumerate(model.layers):
        if layer.sparse:
            probe_router(layer.mlp.router, layer_idx=i, hidden=config.hidden_size, k=config.num_experts_per_tok,
                         num_experts=config.num_experts, device=device, dtype=dtype)
    return model, config
