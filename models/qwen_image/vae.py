"""The decoder of Qwen-Image's VAE (``vae/``; diffusers' ``AutoencoderKLQwenImage`` is the reference), for a
single image.

The published VAE is a causal video autoencoder (Wan's): 3-D convolutions padded with two zero frames in front.
For one frame only the kernels' last time tap meets real data, so each ``CausalConv3d`` here keeps the published
5-D weight and convolves in 2-D with ``weight[:, :, -1]`` — the same sums as diffusers' first-frame decode. The
temporal upsamplers' ``time_conv`` is loaded but never runs on a first frame (diffusers skips it there too).

    latents (B, z, h, w) * std + mean -> post_quant_conv -> conv_in -> mid (res, attention, res)
      -> up blocks (res x (num_res_blocks + 1), upsample x2 nearest-exact + conv halving channels)
      -> RMS norm, SiLU, conv_out -> clamp [-1, 1] -> RGB (B, 3, H, W), H = h * 2^(levels - 1)

Parameter names equal the published checkpoint's (``post_quant_conv.*``, ``decoder.*``); the encoder's tensors
(``encoder.*``, ``quant_conv.*``) are skipped by the loader.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class VaeConfig:
    """vae/config.json of the published checkpoint (the keys the decoder reads)."""

    base_dim: int = 96
    """Channels of the outermost level; level i has base_dim * dim_mult[i]."""
    z_dim: int = 16
    """Latent channels."""
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    """Channel multipliers per level, outermost first."""
    num_res_blocks: int = 2
    """Residual blocks per level (the decoder has one more per level)."""
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    """Per downsampling level, whether time is halved too (the spelling is diffusers')."""
    latents_mean: tuple[float, ...] = field(default=(0.0,) * 16)
    """Per-channel latent mean the decoder adds back."""
    latents_std: tuple[float, ...] = field(default=(1.0,) * 16)
    """Per-channel latent std the decoder multiplies back."""

    @property
    def scale_factor(self) -> int:
        """Pixels per latent pixel per side (the pipeline's ``vae_scale_factor``)."""
        return 2 ** len(self.temperal_downsample)

    @classmethod
    def from_dict(cls, config: dict) -> "VaeConfig":
        fields = {k: config[k] for k in cls.__dataclass_fields__ if k in config}
        for key in ("dim_mult", "temperal_downsample", "latents_mean", "latents_std"):
            if key in fields:
                fields[key] = tuple(fields[key])
        out = cls(**fields)
        if len(out.temperal_downsample) != len(out.dim_mult) - 1:
            raise ValueError(f"vae/config.json: temperal_downsample has {len(out.temperal_downsample)} entries, "
                             f"dim_mult {list(out.dim_mult)} needs {len(out.dim_mult) - 1}")
        if len(out.latents_mean) != out.z_dim or len(out.latents_std) != out.z_dim:
            raise ValueError(f"vae/config.json: latents_mean and latents_std need z_dim={out.z_dim} entries")
        return out


class CausalConv3d(nn.Module):
    """A published causal 3-D conv (weight (out, in, kt, kh, kw)) applied to one frame: 2-D conv with the last
    time tap, spatial zero padding (kh - 1) / 2."""

    def __init__(self, cin: int, cout: int, kernel: tuple[int, int, int]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cout, cin, *kernel))
        self.bias = nn.Parameter(torch.empty(cout))
        self.padding = (kernel[1] - 1) // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight[:, :, -1], self.bias, padding=self.padding)


class ChannelRMSNorm(nn.Module):
    """L2-normalise over channels, times sqrt(channels) and gamma (published shape (C, 1, 1, 1) or (C, 1, 1))."""

    def __init__(self, dim: int, video: bool = True) -> None:
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim, 1, 1, 1) if video else torch.ones(dim, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = x.dtype in (torch.float16, torch.bfloat16)
        normed = F.normalize(x.float() if low else x, dim=1).to(x.dtype)
        return normed * self.scale * self.gamma.reshape(-1, 1, 1)


class ResidualBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = ChannelRMSNorm(cin), ChannelRMSNorm(cout)
        self.conv1 = CausalConv3d(cin, cout, (3, 3, 3))
        self.conv2 = CausalConv3d(cout, cout, (3, 3, 3))
        self.conv_shortcut = CausalConv3d(cin, cout, (1, 1, 1)) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_shortcut(x)
        x = self.conv1(F.silu(self.norm1(x)))
        return self.conv2(F.silu(self.norm2(x))) + h


class AttentionBlock(nn.Module):
    """Single-head self-attention over the pixels of the frame."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = ChannelRMSNorm(dim, video=False)
        self.to_qkv = nn.Conv2d(dim, 3 * dim, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, hh, ww = x.shape
        qkv = self.to_qkv(self.norm(x)).reshape(b, 1, 3 * c, hh * ww).permute(0, 1, 3, 2).contiguous()
        q, k, v = qkv.chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v).squeeze(1).permute(0, 2, 1).reshape(b, c, hh, ww)
        return self.proj(out) + x


class MidBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


class Upsample(nn.Module):
    """x2 nearest-exact (in float32, as published) then a 3x3 conv halving the channels; ``time_conv`` only for
    the temporal mode (weights kept, unused on a single frame)."""

    def __init__(self, dim: int, temporal: bool) -> None:
        super().__init__()
        self.resample = nn.Sequential(nn.Identity(), nn.Conv2d(dim, dim // 2, 3, padding=1))
        if temporal:
            self.time_conv = CausalConv3d(dim, 2 * dim, (3, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x.float(), scale_factor=(2.0, 2.0), mode="nearest-exact").type_as(x)
        return self.resample[1](x)


class UpBlock(nn.Module):
    def __init__(self, cin: int, cout: int, num_res_blocks: int, upsample: str | None) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(ResidualBlock(cin if i == 0 else cout, cout) for i in range(num_res_blocks + 1))
        self.upsamplers = nn.ModuleList([Upsample(cout, upsample == "3d")]) if upsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return self.upsamplers[0](x) if self.upsamplers is not None else x


class Decoder(nn.Module):
    def __init__(self, config: VaeConfig) -> None:
        super().__init__()
        mult = config.dim_mult
        dims = [config.base_dim * u for u in (mult[-1], *mult[::-1])]
        temporal_up = config.temperal_downsample[::-1]
        self.conv_in = CausalConv3d(config.z_dim, dims[0], (3, 3, 3))
        self.mid_block = MidBlock(dims[0])
        self.up_blocks = nn.ModuleList()
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            upsample = None if i == len(mult) - 1 else ("3d" if temporal_up[i] else "2d")
            self.up_blocks.append(UpBlock(cin // 2 if i > 0 else cin, cout, config.num_res_blocks, upsample))
        self.norm_out = ChannelRMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], 3, (3, 3, 3))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.norm_out(x)))


class VaeDecoder(nn.Module):
    """``decode(latents)``: (B, z_dim, h, w) normalised latents -> RGB (B, 3, H, W) in [-1, 1]."""

    def __init__(self, config: VaeConfig) -> None:
        super().__init__()
        self.config = config
        self.post_quant_conv = CausalConv3d(config.z_dim, config.z_dim, (1, 1, 1))
        self.decoder = Decoder(config)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        dtype = self.post_quant_conv.weight.dtype
        mean = torch.tensor(self.config.latents_mean).view(1, -1, 1, 1).to(latents.device, dtype)
        inv_std = 1.0 / torch.tensor(self.config.latents_std).view(1, -1, 1, 1).to(latents.device, dtype)
        z = latents.to(dtype) / inv_std + mean
        return self.decoder(self.post_quant_conv(z)).clamp(-1.0, 1.0)
