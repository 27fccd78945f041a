"""The Qwen3-Omni thinker's vision encoder: image (or video) patches -> thinker-width tokens plus deepstack features.

The architecture of transformers' ``Qwen3OmniMoeVisionEncoder`` (the Qwen3-VL vision tower):
1. patch embedding: each row of ``pixel_values`` is one ``C x T x P x P`` patch (Qwen2-VL's image processor lays
   them out so) and a Conv3d whose kernel equals its stride maps it to width d. That convolution is one matrix
   product per patch, so it runs as ``F.linear`` on the Conv3d's weight (the checkpoint's shape and name);
2. a learned square table of absolute positions, resampled bilinearly (corners aligned) to each item's patch grid;
3. ``depth`` pre-LayerNorm blocks whose attention rotates queries and keys by the patch's row and column (2D RoPE,
   ``head_dim / 4`` frequencies per axis) and stays within one frame of one item;
4. the merger: LayerNorm, then every ``m x m`` block of patches concatenated (the processor emits a block's
   patches consecutively) and an MLP to the thinker's width D; after each block named in
   ``deepstack_visual_indexes`` a deepstack merger (the same, with the LayerNorm after the concatenation) gives the
   features the thinker adds to its first decoder layers' hidden states at the image's positions.

Every item's rows depend only on that item, so a batch of requests' images runs as one call. Parameter names equal
the published checkpoint's under ``thinker.visual.`` (``VISION_PREFIX``); the module holds no buffers, so it is built
on ``meta`` and loaded with ``load_state_dict(..., assign=True)`` with nothing left to initialise.

Shape legend: N patches of a call, d hidden_size, H heads, hd head_dim, m spatial_merge_size, M = N / m^2 tokens,
D out_hidden_size (the thinker's hidden size).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.common.segment_attention import segment_attention
from models.qwen3_omni.token_counts import image_token_count

VISION_PREFIX = "thinker.visual."
"""Where the vision encoder's tensors sit in the published checkpoint (``thinker.visual.blocks.0.attn.qkv.weight``)."""

_LN_EPS = 1e-6  # every LayerNorm of the vision tower

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}
"""The config's activation names (transformers' spelling) this package implements."""


@dataclass(frozen=True)
class VisionConfig:
    """``thinker_config.vision_config`` of the checkpoint's config.json; defaults are transformers'."""

    depth: int = 27
    """Vision blocks."""
    hidden_size: int = 1152
    """d: width of the blocks."""
    hidden_act: str = "gelu_pytorch_tanh"
    """Activation of the blocks' MLPs (the mergers always use exact GELU)."""
    intermediate_size: int = 4304
    """Width of the blocks' MLPs."""
    num_heads: int = 16
    """Attention heads per block."""
    in_channels: int = 3
    """C: colour channels of a patch."""
    patch_size: int = 16
    """P: patch side in pixels."""
    temporal_patch_size: int = 2
    """T: frames per patch (an image is repeated T times by the processor)."""
    spatial_merge_size: int = 2
    """m: patches per side of the block that becomes one thinker token."""
    out_hidden_size: int = 3584
    """D: the thinker's hidden size, the width of the merged tokens and deepstack features."""
    num_position_embeddings: int = 2304
    """Entries of the learned absolute-position table, a square grid (2304 = 48 x 48)."""
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    """Blocks after which a deepstack merger taps the hidden states (0-based block index)."""
    rope_theta: float = 10000.0
    """Base of the 2D rotary frequencies (``rope_parameters.rope_theta``; the published config leaves it out)."""

    def __post_init__(self) -> None:
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                     "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "num_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"vision_config.{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision_config: hidden_size ({self.hidden_size}) / num_heads ({self.num_heads}) must "
                             f"be a whole head_dim divisible by 4 (2D rotary: head_dim / 4 frequencies per axis)")
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ValueError(f"vision_config.num_position_embeddings ({self.num_position_embeddings}) must be a "
                             f"square (the learned positions are a square grid)")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad or len(set(self.deepstack_visual_indexes)) != len(self.deepstack_visual_indexes):
            raise ValueError(f"vision_config.deepstack_visual_indexes {list(self.deepstack_visual_indexes)} must be "
                             f"distinct block indexes of a {self.depth}-block encoder")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {self.hidden_act!r} is not one of {sorted(ACTIVATIONS)}")
        if not self.rope_theta > 0:
            raise ValueError(f"vision_config rope_theta must be > 0, got {self.rope_theta!r}")

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "VisionConfig":
        """Read ``thinker_config.vision_config``; keys this encoder does not use are ignored."""
        names = ("depth", "hidden_size", "hidden_act", "intermediate_size", "num_heads", "in_channels", "patch_size",
                 "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "num_position_embeddings")
        fields: dict[str, Any] = {k: config[k] for k in names if k in config}
        if "deepstack_visual_indexes" in config:
            fields["deepstack_visual_indexes"] = tuple(config["deepstack_visual_indexes"])
        theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
        if theta is not None:
            fields["rope_theta"] = float(theta)
        return cls(**fields)

    @property
    def head_dim(self) -> int:
        """hd: width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one row of ``pixel_values``: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def grid_side(self) -> int:
        """Side of the learned position grid."""
        return math.isqrt(self.num_position_embeddings)


@dataclass
class VisionOutput:
    """What the encoder gives the thinker for one call's items, rows in item order."""

    embeds: torch.Tensor
    """(M, D): the merged tokens, one per image placeholder."""
    deepstack: list[torch.Tensor]
    """One (M, D) tensor per deepstack block, in block order: added to the thinker's first decoder layers."""
    token_counts: list[int]
    """Tokens (rows of ``embeds``) per item, = token_counts.image_token_count of its grid."""

    def split(self) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        """Per item: its (tokens, D) embeddings and its deepstack features."""
        embeds = self.embeds.split(self.token_counts)
        deep = [feature.split(self.token_counts) for feature in self.deepstack]
        return [(embeds[i], [d[i] for d in deep]) for i in range(len(self.token_counts))]


class PatchEmbed(nn.Module):
    """(N, C*T*P*P) patches -> (N, d). The weight keeps the Conv3d's shape (d, C, T, P, P) of the checkpoint."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.flatten(1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.n_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], seqlens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.n_heads, -1).unbind(1)  # (N, H, hd) each
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return self.proj(segment_attention(q, k, v, seqlens).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=_LN_EPS)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=_LN_EPS)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """(N, d) -> (M, D): each block of m*m consecutive patches concatenated, then Linear, GELU, Linear.

    The final merger normalises each patch before the concatenation; the deepstack mergers (``postshuffle``)
    normalise the concatenated block.
    """

    def __init__(self, config: VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.width = config.hidden_size * config.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.ln_q = nn.LayerNorm(self.width if postshuffle else config.hidden_size, eps=_LN_EPS)
        self.mlp = nn.ModuleList([nn.Linear(self.width, self.width), nn.GELU(),
                                  nn.Linear(self.width, config.out_hidden_size)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x.reshape(-1, self.width)) if self.postshuffle else self.ln_q(x).reshape(-1, self.width)
        for layer in self.mlp:
            x = layer(x)
        return x


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (N, H, hd) by the per-row angles ``cos``/``sin`` (N, hd), in float32 as the reference does."""
    xf = x.float()
    return (xf * cos[:, None] + rotate_half(xf) * sin[:, None]).to(x.dtype)


def merge_block_order(h: int, w: int, m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column (each (h*w,) long) of every patch of an h x w grid in the processor's order: m x m blocks
    in raster order, the patches of a block consecutive (raster within the block)."""
    rows = torch.arange(h, device=device).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
    cols = torch.arange(w, device=device).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
    return rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()


def _axis_taps(size: int, side: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bilinear taps (lower, upper index) and the upper tap's weight resampling ``side`` entries to ``size`` with
    the end points aligned (``F.interpolate(..., align_corners=True)``)."""
    src = torch.arange(size, device=device, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    lower = src.floor()
    return lower.long(), (lower.long() + 1).clamp(max=side - 1), src - lower


class VisionEncoder(nn.Module):
    """``thinker.visual``: flattened patches of one or more items -> merged tokens and deepstack features.

    Build: ``with torch.device("meta"): enc = VisionEncoder(VisionConfig.from_hf(vision_config))``, then
    ``enc.load_state_dict(tensors_without_prefix, assign=True)``.
    """

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, postshuffle=False)
        self.merger_list = nn.ModuleList(PatchMerger(config, postshuffle=True)
                                         for _ in config.deepstack_visual_indexes)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> VisionOutput:
        """Encode a call's items at once.

        pixel_values: (N, C*T*P*P), the items' patches concatenated in item order, each item's patches in the
        processor's order (Qwen2-VL's image processor: ``pixel_values``); grid_thw: (n_items, 3), each item's
        (frames / T, rows, columns) of patches (the processor's ``image_grid_thw``). Patches attend within their
        own frame of their own item only.
        """
        grids = self._check(pixel_values, grid_thw)
        x = self.patch_embed(pixel_values)  # (N, d)
        absolute, rope = self._positions(grids, x.device)
        x = x + absolute.to(x.dtype)
        seqlens = [h * w for t, h, w in grids for _ in range(t)]
        order = self.config.deepstack_visual_indexes
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, rope, seqlens)
            if i in order:
                deepstack.append(self.merger_list[order.index(i)](x))
        counts = [image_token_count(g, self.config.spatial_merge_size) for g in grids]
        return VisionOutput(embeds=self.merger(x), deepstack=deepstack, token_counts=counts)

    def encode(self, items: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> list[tuple[torch.Tensor,
                                                                                     list[torch.Tensor]]]:
        """Per item (its patches (n_i, C*T*P*P), its (t, h, w)) -> (its (tokens, D) embeddings, its deepstack
        features), all items in one forward."""
        if not items:
            return []
        patches = torch.cat([p for p, _ in items]) if len(items) > 1 else items[0][0]
        return self.forward(patches, [tuple(g) for _, g in items]).split()

    def _check(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]
               ) -> list[tuple[int, int, int]]:
        grid_rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_rows]
        for grid in grids:
            image_token_count(grid, self.config.spatial_merge_size)  # ValueError for a grid the merger cannot take
        n = sum(t * h * w for t, h, w in grids)
        if pixel_values.dim() != 2 or pixel_values.shape != (n, self.config.patch_dim):
            raise ValueError(f"vision encoder: pixel_values of shape {tuple(pixel_values.shape)} do not match "
                             f"grid_thw {grids}: expected ({n}, {self.config.patch_dim})")
        return grids

    def _positions(self, grids: list[tuple[int, int, int]], device: torch.device
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Absolute position embeddings (N, d), float32, and the rotary cos/sin (N, hd) of every patch of the call;
        the frames of an item share their grid's positions."""
        absolute, angles, done = [], [], {}
        for t, h, w in grids:
            if (h, w) not in done:
                done[(h, w)] = self._grid_positions(h, w, device)
            grid_absolute, grid_angles = done[(h, w)]
            absolute.append(grid_absolute.repeat(t, 1))
            angles.append(grid_angles.repeat(t, 1))
        theta = torch.cat(angles) if len(angles) > 1 else angles[0]
        return (torch.cat(absolute) if len(absolute) > 1 else absolute[0]), (theta.cos(), theta.sin())

    def _grid_positions(self, h: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame of an h x w grid: (h*w, d) bilinearly resampled learned positions and (h*w, hd) rotary angles
        ([row freqs, column freqs] twice, so the rotation covers the whole head)."""
        cfg = self.config
        rows, cols = merge_block_order(h, w, cfg.spatial_merge_size, device)
        side = cfg.grid_side
        r0, r1, fr = (tap[rows] for tap in _axis_taps(h, side, device))
        c0, c1, fc = (tap[cols] for tap in _axis_taps(w, side, device))
        index = torch.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], dim=-1)  # (hw, 4)
        weight = torch.stack([(1 - fr) * (1 - fc), (1 - fr) * fc, fr * (1 - fc), fr * fc], dim=-1)
        absolute = (F.embedding(index, self.pos_embed.weight).float() * weight[..., None]).sum(1)
        half = cfg.head_dim // 2
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, half, 2, device=device, dtype=torch.float32) / half)
        by_row, by_col = rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq  # (hw, hd / 4) each
        return absolute, torch.cat([by_row, by_col, by_row, by_col], dim=-1)
