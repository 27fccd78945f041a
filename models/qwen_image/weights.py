"""Load Qwen-Image's components from the published diffusers layout, unchanged:

    model_index.json
    transformer/   config.json + diffusion_pytorch_model[-0000K-of-0000N].safetensors (+ .index.json)
    text_encoder/  config.json (Qwen2.5-VL) + model[-0000K-of-0000N].safetensors (+ .index.json)
    vae/           config.json + diffusion_pytorch_model.safetensors
    scheduler/     scheduler_config.json
    tokenizer/     tokenizer.json, or vocab.json + merges.txt; tokenizer_config.json

Modules are built on ``meta`` and the tensors assigned (cast to ``dtype``, on ``device``); a sharded component's
``*.safetensors.index.json`` names its files. Every loader returns its module in eval mode with grads off and
raises ValueError naming the directory for missing, unexpected or misshapen tensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from models.qwen_image.text_encoder import TextConfig, TextEncoder
from models.qwen_image.transformer import QwenImageTransformer, TransformerConfig
from models.qwen_image.vae import VaeConfig, VaeDecoder

COMPONENTS = ("transformer", "text_encoder", "vae", "scheduler", "tokenizer")
"""The subdirectories of the published layout (model_index.json names them)."""


def check_layout(root: Path) -> None:
    """FileNotFoundError naming what is missing when ``root`` is not a Qwen-Image diffusers directory."""
    missing = [name for name in ("model_index.json", *COMPONENTS) if not (root / name).exists()]
    if missing:
        raise FileNotFoundError(f"{root} is not a Qwen-Image diffusers directory: {missing} missing (make one with "
                                f"scripts/make_qwen_image_checkpoint.py)")


def safetensors_files(path: Path) -> list[Path]:
    """The component's weight files: those an ``*.safetensors.index.json`` names, else every ``*.safetensors``."""
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{indexes[0]} names files that are missing: {absent}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def read_tensors(path: Path, rename: Callable[[str], str | None], device: torch.device | str,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors of the component at ``path`` under ``rename(name)`` (None: not read), cast and placed."""
    out: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                ours = rename(name)
                if ours is not None:
                    out[ours] = f.get_tensor(name).to(device=device, dtype=dtype)
    return out


def assign(model: nn.Module, state: dict[str, torch.Tensor], source: Path) -> nn.Module:
    """Assign ``state`` to a meta-built ``model`` (strict); ValueError naming the first problems."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{source}: checkpoint lacks {len(missing)} tensors (e.g. {missing[:3]}) and has "
                         f"{len(unexpected)} unexpected ones (e.g. {unexpected[:3]})")
    for name, param in expected.items():
        if state[name].shape != param.shape:
            raise ValueError(f"{source}: tensor {name} has shape {tuple(state[name].shape)}, config.json implies "
                             f"{tuple(param.shape)}")
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def load_transformer(path: str | Path, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> QwenImageTransformer:
    path = Path(path).expanduser()
    with torch.device("meta"):
        model = QwenImageTransformer(TransformerConfig.from_dir(path))
    return assign(model, read_tensors(path, lambda n: n, device, dtype), path)


def load_vae_decoder(path: str | Path, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> VaeDecoder:
    """The decoder half; the encoder's tensors (``encoder.*``, ``quant_conv.*``) are not read."""
    path = Path(path).expanduser()
    config = VaeConfig.from_dict(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        model = VaeDecoder(config)
    skip = ("encoder.", "quant_conv.")
    return assign(model, read_tensors(path, lambda n: None if n.startswith(skip) else n, device, dtype), path)


def text_encoder_name(name: str) -> str | None:
    """Checkpoint name -> ours: the language model's tensors under ``model.`` or ``model.language_model.``; the
    vision tower and the LM head are not read."""
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix) and not name.startswith("model.visual."):
            return name[len(prefix):]
    return None


def load_text_encoder(path: str | Path, device: torch.device | str = "cpu",
                      dtype: torch.dtype = torch.float32) -> TextEncoder:
    path = Path(path).expanduser()
    with torch.device("meta"):
        model = TextEncoder(TextConfig.from_dir(path))
    return assign(model, read_tensors(path, text_encoder_name, device, dtype), path)
