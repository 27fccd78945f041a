"""Load an HF-layout Llama checkpoint directory (config.json + *.safetensors) into `Llama`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from models.llama.config import LlamaConfig
from models.llama.model import Llama

_IGNORED = re.compile(r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # old checkpoints carry this buffer


def read_config(weights_dir: str | Path) -> LlamaConfig:
    weights_dir = Path(weights_dir).expanduser()
    path = weights_dir / "config.json"
    if not weights_dir.is_dir():
        raise FileNotFoundError(f"weights directory {weights_dir} does not exist "
                                f"(prepare it with scripts/prepare_weights.py)")
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {weights_dir} is not an HF-layout weights directory")
    return LlamaConfig.from_hf(json.loads(path.read_text()))


def _read_hf_tensors(weights_dir: Path, device: torch.device | str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    files = sorted(weights_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {weights_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                short = name.removeprefix("model.")
                if _IGNORED.fullmatch(short):
                    continue
                tensors[short] = f.get_tensor(name).to(device=device, dtype=dtype)
    return tensors


def _hf_sources(config: LlamaConfig) -> dict[str, tuple[str, ...]]:
    """Our parameter name -> the HF tensors (names without "model.") concatenated along dim 0 to make it.

    q/k/v fuse into `wqkv` and gate/up into `w_gate_up`; a tied head has no source (it is the embedding).
    """
    sources = {"embed.weight": ("embed_tokens.weight",), "norm.weight": ("norm.weight",)}
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = ("lm_head.weight",)
    for i in range(config.n_layers):
        p = f"layers.{i}."  # the same prefix in both namings
        sources[p + "attn_norm.weight"] = (p + "input_layernorm.weight",)
        sources[p + "attn.wqkv.weight"] = tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv")
        sources[p + "attn.wo.weight"] = (p + "self_attn.o_proj.weight",)
        sources[p + "mlp_norm.weight"] = (p + "post_attention_layernorm.weight",)
        sources[p + "mlp.w_gate_up.weight"] = (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        sources[p + "mlp.w_down.weight"] = (p + "mlp.down_proj.weight",)
    return sources


def _to_our_names(hf: dict[str, torch.Tensor], config: LlamaConfig, source: Path) -> dict[str, torch.Tensor]:
    """Rename and fuse HF tensors; ValueError naming what is missing or left over."""
    if config.tie_word_embeddings:
        hf.pop("lm_head.weight", None)  # some tied checkpoints still store the head: it is the embedding
    sources = _hf_sources(config)
    missing = [n for parts in sources.values() for n in parts if n not in hf]
    if missing:
        raise ValueError(f"{source}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")
    ours = {name: torch.cat([hf.pop(n) for n in parts]) if len(parts) > 1 else hf.pop(parts[0])
            for name, parts in sources.items()}
    if hf:
        raise ValueError(f"{source}: checkpoint has {len(hf)} unexpected tensors, e.g. {sorted(hf)[:4]}")
    if config.tie_word_embeddings:
        ours["lm_head.weight"] = ours["embed.weight"]
    return ours


def load_llama(weights_dir: str | Path, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> tuple[Llama, LlamaConfig]:
    """Build `Llama` on meta and assign the checkpoint's tensors (cast to `dtype`, placed on `device`).

    Returns the model in eval mode with grads off. FileNotFoundError for a missing directory, config.json
    or safetensors file; ValueError for a checkpoint that does not match its config.
    """
    weights_dir = Path(weights_dir).expanduser()
    config = read_config(weights_dir)
    with torch.device("meta"):
        model = Llama(config)
    state = _to_our_names(_read_hf_tensors(weights_dir, device, dtype), config, weights_dir)
    for name, param in model.state_dict().items():
        if state[name].shape != param.shape:
            raise ValueError(f"{weights_dir}: tensor for {name} has shape {tuple(state[name].shape)}, "
                             f"config.json implies {tuple(param.shape)}")
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign=True replaced the shared Parameter with two
    model.init_rope_tables()
    model.eval().requires_grad_(False)
    return model, config
