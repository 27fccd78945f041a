"""The decoder half of diffusers' `AutoencoderKL` (SD 1.x/2.x, SDXL, SD3 and Flux VAEs), latents -> RGB.

Parameter names equal diffusers' checkpoint names (`post_quant_conv.*`, `decoder.*`), so a diffusers
`vae/diffusion_pytorch_model.safetensors` loads without renaming (weights.load_vae_decoder; the
encoder's tensors are skipped). Layer order follows diffusers' `Decoder`: conv_in, mid block (resnet,
single-head attention, resnet), up blocks from the widest channels down (layers_per_block + 1 resnets,
then a nearest-2x upsample + conv except in the last block), GroupNorm, SiLU, conv_out.

Shape legend: B batch, L latent channels, C channels, h/w latent size, H/W image size
(H = h * 2 ** (len(block_out_channels) - 1)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_EPS = 1e-6  # every GroupNorm of diffusers' VAE decoder


@dataclass(frozen=True)
class VaeConfig:
    """The fields of diffusers' `AutoencoderKL` config.json that the decoder depends on."""

    latent_channels: int = 4
    """L: channels of the latents the denoiser works in."""
    out_channels: int = 3
    """Image channels (RGB)."""
    in_channels: int = 3
    """Encoder input channels; unused by the decoder, kept so a written config round-trips."""
    block_out_channels: tuple[int, ...] = (64,)
    """Channels per resolution level, narrowest (full resolution) first, as in diffusers."""
    layers_per_block: int = 1
    """Encoder resnets per level; each decoder up block has one more."""
    norm_num_groups: int = 32
    """GroupNorm groups (must divide every entry of block_out_channels)."""
    scaling_factor: float = 0.18215
    """Latents the denoiser sees are (vae_latents - shift_factor) * scaling_factor."""
    shift_factor: float = 0.0
    """See scaling_factor (diffusers' null means 0)."""
    use_post_quant_conv: bool = True
    """A 1x1 conv before the decoder (SD 1.x/2.x/XL have it; SD3 and Flux do not)."""
    mid_block_add_attention: bool = True
    """The mid block has its self-attention layer."""

    def __post_init__(self) -> None:
        if not self.block_out_channels or any(c % self.norm_num_groups for c in self.block_out_channels):
            raise ValueError(f"VaeConfig: norm_num_groups ({self.norm_num_groups}) must divide every "
                             f"block_out_channels entry {self.block_out_channels}")

    @property
    def upsampling_factor(self) -> int:
        """Image pixels per latent pixel along each side: 2 ** (len(block_out_channels) - 1)."""
        return 2 ** (len(self.block_out_channels) - 1)

    @classmethod
    def from_diffusers(cls, config: dict[str, Any]) -> "VaeConfig":
        """Read an `AutoencoderKL` config.json dict; ValueError for a decoder this module does not build."""
        if config.get("_class_name", "AutoencoderKL") != "AutoencoderKL":
            raise ValueError(f"vae config is a {config['_class_name']}, not an AutoencoderKL")
        up = config.get("up_block_types", ["UpDecoderBlock2D"])
        if any(t != "UpDecoderBlock2D" for t in up) or config.get("act_fn", "silu") != "silu":
            raise ValueError(f"vae config: only UpDecoderBlock2D blocks and silu are supported, got "
                             f"up_block_types={up}, act_fn={config.get('act_fn')!r}")
        channels = tuple(config.get("block_out_channels", (64,)))
        if len(up) != len(channels):
            raise ValueError(f"vae config: {len(up)} up_block_types for {len(channels)} block_out_channels")
        names = ("latent_channels", "out_channels", "in_channels", "layers_per_block", "norm_num_groups",
                 "scaling_factor", "use_post_quant_conv", "mid_block_add_attention")
        fields = {k: config[k] for k in names if k in config}
        return cls(block_out_channels=channels, shift_factor=config.get("shift_factor") or 0.0, **fields)


class ResnetBlock(nn.Module):
    """diffusers `ResnetBlock2D` without time embedding: x + conv2(silu(gn2(conv1(silu(gn1(x))))))."""

    def __init__(self, cin: int, cout: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin, eps=_EPS)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, cout, eps=_EPS)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, cin, H, W) -> (B, cout, H, W)
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
        return skip + h


class SpatialAttention(nn.Module):
    """diffusers' mid-block `Attention`: one head of width C over the H*W positions, residual added."""

    def __init__(self, channels: int, groups: int) -> None:
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, channels, eps=_EPS)
        self.to_q = nn.Linear(channels, channels)
        self.to_k = nn.Linear(channels, channels)
        self.to_v = nn.Linear(channels, channels)
        self.to_out = nn.ModuleList([nn.Linear(channels, channels)])  # diffusers' [linear, dropout]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W)
        B, C, H, W = x.shape
        h = self.group_norm(x).view(B, C, H * W).transpose(1, 2)  # (B, HW, C)
        q, k, v = (proj(h).unsqueeze(1) for proj in (self.to_q, self.to_k, self.to_v))  # (B, 1, HW, C)
        out = F.scaled_dot_product_attention(q, k, v).squeeze(1)  # (B, HW, C)
        out = self.to_out[0](out).transpose(1, 2).reshape(B, C, H, W)
        return out + x


class Upsample(nn.Module):
    """Nearest-neighbour 2x, then a 3x3 conv (diffusers `Upsample2D(use_conv=True)`)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, C, 2H, 2W)
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class MidBlock(nn.Module):
    def __init__(self, channels: int, groups: int, attention: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(channels, channels, groups) for _ in range(2)])
        self.attentions = nn.ModuleList([SpatialAttention(channels, groups)] if attention else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x)
        for attn in self.attentions:
            x = attn(x)
        return self.resnets[1](x)


class UpBlock(nn.Module):
    def __init__(self, cin: int, cout: int, n_resnets: int, groups: int, upsample: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock(cin if i == 0 else cout, cout, groups) for i in range(n_resnets))
        self.upsamplers = nn.ModuleList([Upsample(cout)]) if upsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)
        return x


class Decoder(nn.Module):
    """diffusers `Decoder` (group-norm variant): (B, L, h, w) -> (B, out_channels, H, W)."""

    def __init__(self, config: VaeConfig) -> None:
        super().__init__()
        widths = list(reversed(config.block_out_channels))  # widest first
        groups = config.norm_num_groups
        self.conv_in = nn.Conv2d(config.latent_channels, widths[0], 3, padding=1)
        self.mid_block = MidBlock(widths[0], groups, config.mid_block_add_attention)
        self.up_blocks = nn.ModuleList(
            UpBlock(widths[max(i - 1, 0)], widths[i], config.layers_per_block + 1, groups,
                    upsample=i < len(widths) - 1)
            for i in range(len(widths)))
        self.conv_norm_out = nn.GroupNorm(groups, widths[-1], eps=_EPS)
        self.conv_out = nn.Conv2d(widths[-1], config.out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(z))  # (B, C_widest, h, w)
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))  # (B, 3, H, W)


class VaeDecoder(nn.Module):
    """Denoiser latents -> images. Build on meta and load with weights.load_vae_decoder."""

    def __init__(self, config: VaeConfig) -> None:
        super().__init__()
        self.config = config
        L = config.latent_channels
        self.post_quant_conv = nn.Conv2d(L, L, 1) if config.use_post_quant_conv else None
        self.decoder = Decoder(config)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, L, h, w) denoiser latents -> (B, 3, H, W) images, nominally in [-1, 1].

        Undoes the latent normalisation first, as diffusers' pipelines do before `vae.decode` (SD3/Flux:
        `latents / scaling_factor + shift_factor`; SD 1.x has no shift). The result is not clamped (nor
        is diffusers'); png.to_uint8 clamps. Runs in the weights' dtype and returns that dtype; SD-style
        VAEs overflow in float16 (diffusers' force_upcast), so load them in bfloat16 or float32.
        """
        z = latents.float() / self.config.scaling_factor + self.config.shift_factor  # (B, L, h, w)
        z = z.to(self.decoder.conv_in.weight.dtype)
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)

    forward = decode
