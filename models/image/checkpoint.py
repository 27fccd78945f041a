"""Write a random-weight checkpoint directory of the image family, laid out like a diffusers pipeline.

    OUT/model_index.json
    OUT/transformer/config.json, model.safetensors                      (DenoiserConfig, our names)
    OUT/vae/config.json, diffusion_pytorch_model.safetensors            (AutoencoderKL layout, both halves)
    OUT/scheduler/scheduler_config.json                                 (FlowMatchEulerDiscreteScheduler)

The text encoder is a separate Llama checkpoint; the denoiser's text_dim must equal its hidden size.
Nothing here imports diffusers: the VAE tensors are written under diffusers' names and shapes (the encoder
half too, so diffusers' AutoencoderKL.from_pretrained loads the directory; our loader skips it).

Weights come from one seeded CPU generator per component, tensors in name order: matrices and conv
kernels ~ N(0, 1/fan_in) (variance-preserving), biases 0, norm scales 1, the null text token ~ N(0, 1).
Every layer either feeds a norm or a gated residual, so a random model gives finite (noise-like) images.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from models.image.denoiser import Denoiser, preset
from models.image.vae import MidBlock, ResnetBlock, VaeConfig, VaeDecoder
from mstar_dist.random_weights import write_marker

# The VAE of each size. Downsampling factor 2 ** (len(block_out_channels) - 1): tiny 2 (64x64 image =
# 32x32x4 latents = 256 tokens at patch 2), 1b 8 with SD3's shape (1024x1024 = 128x128x16 = 4096 tokens).
_VAE_SIZES = {
    "tiny": dict(latent_channels=4, block_out_channels=[32, 64], layers_per_block=1, norm_num_groups=32,
                 scaling_factor=0.18215, shift_factor=None, use_quant_conv=True, use_post_quant_conv=True),
    "1b": dict(latent_channels=16, block_out_channels=[128, 256, 512, 512], layers_per_block=2,
               norm_num_groups=32, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
               use_post_quant_conv=False),
}
_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}


def vae_config_json(size: str) -> dict:
    """The AutoencoderKL config.json of `size` ("tiny" or "1b")."""
    levels = len(_VAE_SIZES[size]["block_out_channels"])
    return {"_class_name": "AutoencoderKL", "in_channels": 3, "out_channels": 3, "act_fn": "silu",
            "down_block_types": ["DownEncoderBlock2D"] * levels, "up_block_types": ["UpDecoderBlock2D"] * levels,
            "mid_block_add_attention": True, "force_upcast": True, **_VAE_SIZES[size]}


class _EncoderLayout(nn.Module):
    """The names and shapes of diffusers' `Encoder` + quant_conv (built on meta only, never run)."""

    def __init__(self, config: VaeConfig, use_quant_conv: bool) -> None:
        super().__init__()
        ch, groups, L = config.block_out_channels, config.norm_num_groups, config.latent_channels
        encoder = nn.Module()
        encoder.conv_in = nn.Conv2d(config.in_channels, ch[0], 3, padding=1)
        encoder.down_blocks = nn.ModuleList()
        for i, cout in enumerate(ch):
            block = nn.Module()
            block.resnets = nn.ModuleList(ResnetBlock(ch[max(i - 1, 0)] if j == 0 else cout, cout, groups)
                                          for j in range(config.layers_per_block))
            if i < len(ch) - 1:
                down = nn.Module()
                down.conv = nn.Conv2d(cout, cout, 3, stride=2)
                block.downsamplers = nn.ModuleList([down])
            encoder.down_blocks.append(block)
        encoder.mid_block = MidBlock(ch[-1], groups, config.mid_block_add_attention)
        encoder.conv_norm_out = nn.GroupNorm(groups, ch[-1])
        encoder.conv_out = nn.Conv2d(ch[-1], 2 * L, 3, padding=1)
        self.encoder = encoder
        if use_quant_conv:
            self.quant_conv = nn.Conv2d(2 * L, 2 * L, 1)


def _random_tensor(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    if len(shape) >= 2:
        return torch.randn(shape, generator=gen) / math.sqrt(math.prod(shape[1:]))
    if name.endswith("bias"):
        return torch.zeros(shape)
    if name.endswith("weight"):
        return torch.ones(shape)  # LayerNorm / GroupNorm scale
    return torch.randn(shape, generator=gen)


def random_state(modules: list[nn.Module], seed: int, dtype: torch.dtype = torch.float32
                 ) -> dict[str, torch.Tensor]:
    """Random tensors (rules in the module docstring) for the union of the modules' state dicts."""
    shapes = {name: t.shape for m in modules for name, t in m.state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    return {name: _random_tensor(name, shapes[name], gen).to(dtype) for name in sorted(shapes)}


def randomize_(model: nn.Module, seed: int) -> nn.Module:
    """Fill a (meta- or CPU-built) model with `random_state` in place; returns it in eval mode, no grads."""
    model.load_state_dict(random_state([model], seed), assign=True)
    return model.eval().requires_grad_(False)


def write_image_checkpoint(out: str | Path, size: str = "tiny", seed: int = 0, text_dim: int = 64,
                           dtype: torch.dtype = torch.float32) -> Path:
    """Write the directory described in the module docstring; returns `out`. Overwrites existing files."""
    out = Path(out).expanduser()
    config = preset(size, text_dim=text_dim)
    vae_json = vae_config_json(size)
    if config.in_channels != vae_json["latent_channels"]:
        raise ValueError(f"size {size}: denoiser in_channels {config.in_channels} != VAE latent_channels "
                         f"{vae_json['latent_channels']}")
    vae_config = VaeConfig.from_diffusers(vae_json)
    with torch.device("meta"):
        denoiser = Denoiser(config)
        halves = [VaeDecoder(vae_config), _EncoderLayout(vae_config, vae_json["use_quant_conv"])]
    for sub in ("transformer", "vae", "scheduler"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    (out / "transformer" / "config.json").write_text(config.to_json())
    save_file(random_state([denoiser], seed, dtype), out / "transformer" / "model.safetensors")
    (out / "vae" / "config.json").write_text(json.dumps(vae_json, indent=2) + "\n")
    save_file(random_state(halves, seed + 1, dtype), out / "vae" / "diffusion_pytorch_model.safetensors")
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(_SCHEDULER, indent=2) + "\n")
    index = {"_class_name": "MstarImagePipeline", "transformer": ["models.image", "Denoiser"],
             "vae": ["diffusers", "AutoencoderKL"], "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    write_marker(out, seed, "scripts/make_image_checkpoint.py")
    return out



def write_tiny_image_family(out: Path) -> Path:
    """The default image weights prepared on first start (see :func:`write_image_family`)."""
    return write_image_family(out, "tiny")


def write_image_family(out: Path, size: str = "tiny") -> Path:
    """The directory the image family (models/image/family.py) serves from: the image checkpoint of ``size``
    (``1b`` in bfloat16) plus a tiny Llama text encoder (with its tokenizer) in ``out/text_encoder`` whose hidden
    size is the denoiser's text_dim; written atomically (a new directory renamed into place)."""
    import shutil
    import tempfile

    from models.speech.checkpoint import make_speech_checkpoint

    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        make_speech_checkpoint(tmp / "text_encoder", "tiny", seed=0, codebook_size=1)
        text_dim = json.loads((tmp / "text_encoder" / "config.json").read_text())["hidden_size"]
        write_image_checkpoint(tmp, size=size, seed=0, text_dim=text_dim,
                               dtype=torch.float32 if size == "tiny" else torch.bfloat16)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
