"""Load an HF-layout Llama checkpoint directory (config.json + *.safetensors) into `Llama`, or one TP shard of it."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from models.common.checkpoint import SafetensorsDir, load_sharded_state, read_hf_config
from mstar_dist.distributed.tp import TPGroup
from models.llama.config import LlamaConfig
from models.llama.model import Llama

_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # old checkpoints carry this buffer


def read_config(weights_dir: str | Path) -> LlamaConfig:
    return read_hf_config(weights_dir, LlamaConfig.from_hf, "prepare it with scripts/prepare_weights.py")


def _hf_sources(config: LlamaConfig) -> dict[str, tuple[str, ...]]:
    """Our parameter name -> the HF tensors concatenated along dim 0 to make it (before TP sharding).

    q/k/v fuse into `wqkv` and gate/up into `w_gate_up`; a tied head has no source (it is the embedding).
    """
    sources = {"embed.weight": ("model.embed_tokens.weight",), "norm.weight": ("model.norm.weight",)}
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = ("lm_head.weight",)
    for i in range(config.n_layers):
        p, hf = f"layers.{i}.", f"model.layers.{i}."
        sources[p + "attn_norm.weight"] = (hf + "input_layernorm.weight",)
        sources[p + "attn.wqkv.weight"] = tuple(hf + f"self_attn.{x}_proj.weight" for x in "qkv")
        sources[p + "attn.wo.weight"] = (hf + "self_attn.o_proj.weight",)
        sources[p + "mlp_norm.weight"] = (hf + "post_attention_layernorm.weight",)
        sources[p + "mlp.w_gate_up.weight"] = (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")
        sources[p + "mlp.w_down.weight"] = (hf + "mlp.down_proj.weight",)
    return sources


def load_llama(weights_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               tp: TPGroup = TPGroup.single()) -> tuple[Llama, LlamaConfig]:
    """Build `Llama` (this rank's TP shard) on meta and assign the checkpoint's tensors (cast, placed on `device`).

    Reads only this rank's shard of every sharded tensor from the safetensors files (no collective: the TP
    group is only used for its size and rank_in_group). Returns the model in eval mode with grads off and the
    full (unsharded) config; `model.local_kv_heads` is what this rank's KV cache must hold. FileNotFoundError
    for a missing directory, config.json or safetensors file; ValueError for a checkpoint that does not match
    its config, or a TP size that does not divide the heads or the MLP width.
    """
    weights_dir = Path(weights_dir).expanduser()
    config = read_config(weights_dir)
    with torch.device("meta"):
        model = Llama(config, tp=tp)

    def ignored(name: str) -> bool:  # some tied checkpoints still store the head: it is the embedding
        return bool(_IGNORED.fullmatch(name)) or (config.tie_word_embeddings and name == "lm_head.weight")

    with SafetensorsDir(weights_dir) as ckpt:
        state = load_sharded_state(model, _hf_sources(config), ckpt, device=device, dtype=dtype,
                                   source=weights_dir, ignored=ignored)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign=True replaced the shared Parameter with two
    model.init_rope_tables()
    model.eval().requires_grad_(False)
    return model, config
