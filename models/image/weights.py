"""Load the image family's components from a diffusers-like checkpoint directory (see checkpoint.py).

    transformer/  config.json (DenoiserConfig) + model.safetensors      -> load_denoiser
    vae/          config.json (AutoencoderKL) + *.safetensors           -> load_vae_decoder
    scheduler/    scheduler_config.json                                 -> scheduler.FlowMatchEuler.from_config

Modules are built on meta and the tensors assigned (cast to `dtype`, placed on `device`), as
models/llama/weights.py does; every loader returns its module in eval mode with grads off.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from models.image.denoiser import Denoiser, DenoiserConfig
from models.image.vae import VaeConfig, VaeDecoder

_VAE_SKIPPED = ("encoder.", "quant_conv.")  # the encoder half of an AutoencoderKL checkpoint
# Pre-0.14 diffusers names of the mid-block attention, still found in published VAE checkpoints.
_LEGACY_ATTN = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}
_LEGACY_RE = re.compile(r"\.attentions\.(\d+)\.(query|key|value|proj_attn)\.")


def _component_dir(path: str | Path, what: str) -> Path:
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path / 'config.json'} is missing: {path} is not a {what} directory "
                                f"(make one with scripts/make_image_checkpoint.py)")
    return path


def read_safetensors(path: Path, device: torch.device | str, dtype: torch.dtype,
                     skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """All tensors of path/*.safetensors except names starting with a `skip` prefix, cast and placed."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if not name.startswith(skip):
                    tensors[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return tensors


def assign_weights(model: nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
    """Assign `state` to a meta-built `model`; ValueError naming missing, unexpected or misshapen tensors."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{source}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(f"{source}: checkpoint has {len(unexpected)} unexpected tensors, e.g. {unexpected[:4]}")
    for name, param in expected.items():
        if state[name].shape != param.shape:
            raise ValueError(f"{source}: tensor {name} has shape {tuple(state[name].shape)}, "
                             f"config.json implies {tuple(param.shape)}")
    model.load_state_dict(state, strict=True, assign=True)
    model.eval().requires_grad_(False)


def load_denoiser(path: str | Path, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> Denoiser:
    """The denoiser of a checkpoint's transformer/ directory (config.json + *.safetensors)."""
    path = _component_dir(path, "denoiser (transformer/)")
    with torch.device("meta"):
        model = Denoiser(DenoiserConfig.from_dir(path))
    assign_weights(model, read_safetensors(path, device, dtype), path)
    return model


def load_vae_decoder(path: str | Path, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> VaeDecoder:
    """The decoder half of a diffusers AutoencoderKL directory (vae/: config.json + *.safetensors).

    The encoder's tensors (encoder.*, quant_conv.*) are not read; legacy attention names (query, key,
    value, proj_attn) are renamed as diffusers does. float16 overflows in SD-style VAEs: prefer
    bfloat16 or float32.
    """
    path = _component_dir(path, "VAE (vae/)")
    config = VaeConfig.from_diffusers(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        model = VaeDecoder(config)
    state = read_safetensors(path, device, dtype, skip=_VAE_SKIPPED)
    state = {_LEGACY_RE.sub(lambda m: f".attentions.{m[1]}.{_LEGACY_ATTN[m[2]]}.", k): v for k, v in state.items()}
    assign_weights(model, state, path)
    return model
