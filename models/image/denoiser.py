"""DiT-style flow-matching denoiser conditioned on LLM hidden states through cross-attention.

    x (B, C, h, w) --patchify (conv p x p, stride p) + 2-D sin-cos positions--> tokens (B, N, d)
    t (B,) --sinusoid(256) -> MLP--> c (B, d)               text (B, T, d_text) --MLP--> (B, T, d)
    per block:  x += gate1 * SelfAttn(modulate(LN(x), shift1, scale1))        (adaLN from c: 6 vectors)
                x += CrossAttn(LN_affine(x), [null; text], key padding mask)
                x += gate2 * MLP(modulate(LN(x), shift2, scale2))
    final:      Linear(modulate(LN(x), shift, scale)) -> unpatchify -> velocity (B, C, h, w)

Conditioning contract. The cross-attention keys are always [null_text; projected text]: a learned null
token sits in front of every sequence. Text None (or a text_mask with no True) leaves the null token
alone, which is the unconditional branch of classifier-free guidance; so cond and uncond can run as one
batch (uncond rows: any text, mask all False). The null token also keeps every softmax row defined.

Conventions: t is diffusers' timestep, sigma * num_train_timesteps (scheduler.FlowMatchEuler.timesteps);
the output is the velocity noise - x_0 that FlowMatchEuler.step integrates. Sinusoid and positions follow
diffusers (`get_timestep_embedding(flip_sin_to_cos=True, downscale_freq_shift=0)`,
`get_2d_sincos_pos_embed`); the tests compare them. No dropout, no randomness in forward.
Shape legend: B batch, C latent channels, h/w latent size, p patch, N = (h/p)(w/p) tokens, d hidden,
nh heads, hd head width, T text tokens, S = 1 + T context tokens.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

_FREQ_DIM = 256  # width of the sinusoidal timestep features (DiT, SD3, PixArt)
_LN_EPS = 1e-6


@dataclass(frozen=True)
class DenoiserConfig:
    """Hyperparameters; written as transformer/config.json."""

    in_channels: int = 4
    """C: latent channels (the VAE's latent_channels)."""
    patch_size: int = 2
    """p: latent pixels per token side; h and w must be multiples of it."""
    hidden_size: int = 64
    """d: token width."""
    depth: int = 2
    """Transformer blocks."""
    num_heads: int = 4
    """Heads of self- and cross-attention (divides hidden_size)."""
    text_dim: int = 64
    """Width of the conditioning hidden states (the text encoder's hidden size)."""
    mlp_ratio: float = 4.0
    """MLP hidden width / d."""

    def __post_init__(self) -> None:
        for name in ("in_channels", "patch_size", "hidden_size", "depth", "num_heads", "text_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"DenoiserConfig.{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads or self.hidden_size % 4:
            raise ValueError(f"DenoiserConfig: hidden_size ({self.hidden_size}) must be a multiple of 4 "
                             f"(2-D sin-cos positions) and of num_heads ({self.num_heads})")
        if not self.mlp_ratio > 0:
            raise ValueError(f"DenoiserConfig.mlp_ratio must be > 0, got {self.mlp_ratio!r}")

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @classmethod
    def from_dir(cls, path: str | Path) -> "DenoiserConfig":
        """Read config.json from a checkpoint's transformer/ directory (keys starting with _ are ignored)."""
        file = Path(path).expanduser() / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing: not a denoiser checkpoint directory")
        fields = {k: v for k, v in json.loads(file.read_text()).items() if not k.startswith("_")}
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"{file}: unknown denoiser config keys {unknown}")
        return cls(**fields)

    def to_json(self) -> str:
        return json.dumps({"_class_name": "MstarDenoiser", **asdict(self)}, indent=2) + "\n"


_PRESETS = {
    # ~0.4 M parameters: unit tests and CPU runs (64x64 images = 32x32 latents of the tiny VAE = 256 tokens).
    "tiny": dict(in_channels=4, patch_size=2, hidden_size=64, depth=2, num_heads=4),
    # 22 d^2 per block (adaLN 6, self-attn 4, cross-attn 4, MLP 8) x 12 blocks at d=2048: >1e9, GPU benchmarks.
    "1b": dict(in_channels=16, patch_size=2, hidden_size=2048, depth=12, num_heads=16),
}


def preset(name: str, text_dim: int = 64) -> DenoiserConfig:
    """The named size ("tiny" or "1b") conditioned on text of width text_dim."""
    if name not in _PRESETS:
        raise ValueError(f"unknown denoiser preset {name!r} (known: {sorted(_PRESETS)})")
    return DenoiserConfig(text_dim=text_dim, **_PRESETS[name])


def timestep_embedding(t: torch.Tensor, dim: int = _FREQ_DIM, max_period: float = 10000.0) -> torch.Tensor:
    """t (B,) -> float32 (B, dim) features [cos(t f_i), sin(t f_i)], f_i = max_period ** (-i / (dim/2))."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    args = t.float()[:, None] * torch.exp(exponent)[None]  # (B, half)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def sincos_pos_embed_2d(dim: int, grid_h: int, grid_w: int, device: torch.device | str | None = None
                        ) -> torch.Tensor:
    """float32 (grid_h * grid_w, dim), row-major: token (i, j) gets [emb(j), emb(i)], emb(pos) of width
    dim/2 = [sin(pos w_k), cos(pos w_k)], w_k = 10000 ** (-k / (dim/4)); computed in float64 as diffusers.
    """
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64, device=device) / (dim / 4))

    def emb(pos: torch.Tensor) -> torch.Tensor:  # (M,) -> (M, dim/2)
        out = torch.outer(pos.double(), omega)
        return torch.cat([out.sin(), out.cos()], dim=1)

    rows = torch.arange(grid_h, device=device).repeat_interleave(grid_w)  # i of each token
    cols = torch.arange(grid_w, device=device).repeat(grid_h)  # j of each token
    return torch.cat([emb(cols), emb(rows)], dim=1).float()


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift  # x (B, N, d); shift/scale (B, 1, d)


class Mlp(nn.Module):
    def __init__(self, d_in: int, d_hidden: int, d_out: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = F.silu(h) if self.act == "silu" else F.gelu(h, approximate="tanh")
        return self.fc2(h)


class SelfAttention(nn.Module):
    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.wqkv = nn.Linear(d, 3 * d)
        self.wo = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, d)
        B, N, d = x.shape
        qkv = self.wqkv(x).view(B, N, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # (B, nh, N, hd)
        return self.wo(out.transpose(1, 2).reshape(B, N, d))


class CrossAttention(nn.Module):
    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.wq = nn.Linear(d, d)
        self.wkv = nn.Linear(d, 2 * d)
        self.wo = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, ctx_mask: torch.Tensor | None) -> torch.Tensor:
        """x (B, N, d) attends to ctx (B, S, d); ctx_mask (B, S) bool, True = attend (None: all)."""
        B, N, d = x.shape
        nh, hd = self.n_heads, d // self.n_heads
        q = self.wq(x).view(B, N, nh, hd).transpose(1, 2)  # (B, nh, N, hd)
        kv = self.wkv(ctx).view(B, ctx.shape[1], 2, nh, hd).permute(2, 0, 3, 1, 4)  # (2, B, nh, S, hd)
        mask = None if ctx_mask is None else ctx_mask[:, None, None, :]  # (B, 1, 1, S)
        out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask)  # (B, nh, N, hd)
        return self.wo(out.transpose(1, 2).reshape(B, N, d))


class Block(nn.Module):
    def __init__(self, config: DenoiserConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.adaln = nn.Linear(d, 6 * d)  # shift1, scale1, gate1, shift2, scale2, gate2
        self.attn = SelfAttention(d, config.num_heads)
        self.norm_cross = nn.LayerNorm(d, eps=_LN_EPS)
        self.cross_attn = CrossAttention(d, config.num_heads)
        self.mlp = Mlp(d, config.mlp_hidden, d, act="gelu")

    def forward(self, x: torch.Tensor, c: torch.Tensor, ctx: torch.Tensor, ctx_mask: torch.Tensor | None
                ) -> torch.Tensor:
        """x (B, N, d); c (B, d) = silu(timestep embedding); ctx (B, S, d); ctx_mask (B, S) or None."""
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaln(c).unsqueeze(1).chunk(6, dim=-1)  # (B, 1, d)
        d = x.shape[-1]
        x = x + gate1 * self.attn(_modulate(F.layer_norm(x, (d,), eps=_LN_EPS), shift1, scale1))
        x = x + self.cross_attn(self.norm_cross(x), ctx, ctx_mask)
        return x + gate2 * self.mlp(_modulate(F.layer_norm(x, (d,), eps=_LN_EPS), shift2, scale2))


class FinalLayer(nn.Module):
    def __init__(self, config: DenoiserConfig) -> None:
        super().__init__()
        d, p = config.hidden_size, config.patch_size
        self.adaln = nn.Linear(d, 2 * d)  # shift, scale
        self.linear = nn.Linear(d, p * p * config.in_channels)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:  # (B, N, d) -> (B, N, p*p*C)
        shift, scale = self.adaln(c).unsqueeze(1).chunk(2, dim=-1)
        return self.linear(_modulate(F.layer_norm(x, (x.shape[-1],), eps=_LN_EPS), shift, scale))


class Denoiser(nn.Module):
    """Velocity model. Build under `torch.device("meta")` and load with weights.load_denoiser."""

    def __init__(self, config: DenoiserConfig) -> None:
        super().__init__()
        self.config = config
        d, p = config.hidden_size, config.patch_size
        self.patch_embed = nn.Conv2d(config.in_channels, d, kernel_size=p, stride=p)
        self.time_embed = Mlp(_FREQ_DIM, d, d, act="silu")
        self.text_proj = Mlp(config.text_dim, d, d, act="gelu")
        self.null_text = nn.Parameter(torch.empty(d))
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.final = FinalLayer(config)
        self._pos_cache: dict[tuple, torch.Tensor] = {}  # (gh, gw, device, dtype) -> (N, d); derived, not state

    def prepare_text(self, text: torch.Tensor | None, text_mask: torch.Tensor | None, batch: int
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Conditioning -> (ctx (B, S, d), ctx_mask (B, S) bool or None = attend to all).

        text (B, T, text_dim) or None (unconditional: ctx is the null token alone); text_mask (B, T),
        bool or 0/1 like an HF attention_mask, True/1 = real token, None = all real. The result depends
        only on the text, so a caller may compute it once per request and pass it to `denoise` each step.
        """
        w = self.patch_embed.weight
        null = self.null_text.view(1, 1, -1).expand(batch, 1, -1)  # (B, 1, d)
        if text is None:
            return null, None
        if text.ndim != 3 or text.shape[0] != batch or text.shape[2] != self.config.text_dim:
            raise ValueError(f"text must be (B={batch}, T, text_dim={self.config.text_dim}), "
                             f"got {tuple(text.shape)}")
        ctx = torch.cat([null, self.text_proj(text.to(w.dtype))], dim=1)  # (B, 1 + T, d)
        if text_mask is None:
            return ctx, None
        if text_mask.shape != text.shape[:2]:
            raise ValueError(f"text_mask must be {tuple(text.shape[:2])}, got {tuple(text_mask.shape)}")
        keep_null = torch.ones(batch, 1, dtype=torch.bool, device=ctx.device)
        return ctx, torch.cat([keep_null, text_mask.to(device=ctx.device, dtype=torch.bool)], dim=1)  # (B, 1+T)

    def forward(self, x: torch.Tensor, t: torch.Tensor | float, text: torch.Tensor | None = None,
                text_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, C, h, w) noisy latents at timestep t (scalar or (B,), in [0, num_train_timesteps]);
        text as in `prepare_text` (None: unconditional) -> velocity (B, C, h, w) in x's dtype."""
        ctx, ctx_mask = self.prepare_text(text, text_mask, batch=x.shape[0])
        return self.denoise(x, t, ctx, ctx_mask)

    def denoise(self, x: torch.Tensor, t: torch.Tensor | float, ctx: torch.Tensor,
                ctx_mask: torch.Tensor | None) -> torch.Tensor:
        """`forward` with the conditioning already prepared by `prepare_text`."""
        B, C, h, w = x.shape
        p, dtype = self.config.patch_size, self.patch_embed.weight.dtype
        if C != self.config.in_channels or h % p or w % p:
            raise ValueError(f"x must be (B, {self.config.in_channels}, h, w) with h, w multiples of {p}, "
                             f"got {tuple(x.shape)}")
        tokens = self.patch_embed(x.to(dtype)).flatten(2).transpose(1, 2)  # (B, N, d)
        tokens = tokens + self._pos_embed(h // p, w // p, tokens.device, dtype)
        t = torch.as_tensor(t, dtype=torch.float32, device=x.device).reshape(-1).expand(B)
        c = F.silu(self.time_embed(timestep_embedding(t).to(dtype)))  # (B, d)
        for block in self.blocks:
            tokens = block(tokens, c, ctx, ctx_mask)
        return self._unpatchify(self.final(tokens, c), h // p, w // p).to(x.dtype)

    def _pos_embed(self, gh: int, gw: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (gh, gw, device, dtype)
        if key not in self._pos_cache:
            table = sincos_pos_embed_2d(self.config.hidden_size, gh, gw, device)
            self._pos_cache[key] = table.to(dtype)
        return self._pos_cache[key]  # (N, d)

    def _unpatchify(self, out: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
        """(B, N, p*p*C), patch-pixel order (row, col, channel) -> (B, C, gh*p, gw*p)."""
        p, C = self.config.patch_size, self.config.in_channels
        out = out.view(out.shape[0], gh, gw, p, p, C).permute(0, 5, 1, 3, 2, 4)  # (B, C, gh, p, gw, p)
        return out.reshape(out.shape[0], C, gh * p, gw * p)
