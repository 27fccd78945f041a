"""Fused pointwise kernels of a decoder block, in Triton (docs/architecture.md §8, "Fused pointwise").

A captured forward of a small model is hundreds of kernels of a few microseconds each, and its pointwise work took
one kernel per torch op. What a block does
between its GEMMs and its attention is three patterns vLLM and SGLang also fuse:

- ``add_rms_norm``: the residual add and the RMSNorm after it (two kernels -> one, twice a block);
- ``silu_mul``: SwiGLU's ``silu(gate) * up`` over the fused gate/up projection (two -> one);
- ``rope``: the rotation of the queries and keys (``x * cos``, the roll and the ``addcmul``: three -> one).

Each kernel rounds where the torch ops it replaces round (bf16 after the add, after ``silu``, after ``x * cos``), so
its output equals theirs up to the last bit of an fp32 ``exp`` or square root. Where Triton does not run, the model
keeps those torch ops (``Llama.fuse_pointwise``). ``available`` says whether the kernels can run on a device (Triton
importable, and CUDA, or Triton's interpreter for the CPU tests)."""

from __future__ import annotations

import torch

# where these kernels run is where the cache's do: one answer (Triton importable; CUDA, or its interpreter on the CPU)
from mstar_dist.engine.decode_attention import available, triton

__all__ = ["available", "wanted", "add_rms_norm", "silu_mul", "rope"]


# ---- the kernels (CPU wheels of torch come without Triton: the model keeps its torch ops there) ----
if triton is not None:
    import triton.language as tl

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, x_stride, r_stride, d, eps,
                             BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(sum_ptr.dtype.element_ty)  # rounded as the add's own output is
        tl.store(sum_ptr + row * d + cols, summed, mask=mask)
        s = summed.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / d + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * d + cols, (s * inv * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, x_stride, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)  # silu's rounding
        tl.store(out_ptr + row * inter + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, x_stride, heads, H_PAD: tl.constexpr, HD: tl.constexpr):
        # every head of one token: a program per (token, head) made tens of thousands of programs of one head's
        # elements for a batch of prompts
        token = tl.program_id(0)
        h = tl.arange(0, H_PAD)[:, None]
        cols = tl.arange(0, HD)[None, :]
        inside = h < heads
        src = x_ptr + token * x_stride + h * HD
        x = tl.load(src + cols, mask=inside, other=0.0).to(tl.float32)
        rotated = tl.load(src + (cols + HD // 2) % HD, mask=inside, other=0.0).to(tl.float32)  # roll by half: [x2, x1]
        cos = tl.load(cos_ptr + token * HD + cols).to(tl.float32)
        sin = tl.load(sin_ptr + token * HD + cols).to(tl.float32)
        scaled = (x * cos).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as ``x * cos`` is
        tl.store(out_ptr + (token * heads + h) * HD + cols, (scaled + rotated * sin).to(out_ptr.dtype.element_ty),
                 mask=inside)


def wanted(choice: str, device: str, model: torch.nn.Module) -> bool:
    """Whether ``model`` on ``device`` runs its pointwise work as these kernels, for ``engine.fused_pointwise`` =
    ``choice`` (mstar_dist/config/engine.py): ``auto`` on CUDA where they run and the model has a fused path,
    ``torch`` never, ``triton`` always, and a ValueError naming the key where it cannot."""
    if choice == "torch":
        return False
    if choice == "triton":
        if not hasattr(model, "fuse_pointwise"):
            raise ValueError(f"engine.fused_pointwise: triton, but the {type(model).__name__} model has no fused path "
                             "(use auto or torch)")
        if not available(device):
            why = "Triton is not installed" if triton is None else f"not on {device}"
            raise ValueError(f"engine.fused_pointwise: triton needs Triton on a CUDA device, and {why}")
        return True
    return device.startswith("cuda") and available(device) and hasattr(model, "fuse_pointwise")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as (rows, last dim) without a copy: every dim but the last must flatten into one row stride."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual), each shaped as ``x``: one kernel instead of two."""
    d = x.shape[-1]
    xs, rs = _rows(x), _rows(residual)
    out = torch.empty(xs.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(xs.shape, dtype=x.dtype, device=x.device)
    if xs.shape[0]:
        _add_rms_norm_kernel[(xs.shape[0],)](xs, rs, weight, out, summed, xs.stride(0), rs.stride(0), d, eps,
                                             BLOCK=triton.next_power_of_2(d))
    return out.view(x.shape), summed.view(x.shape)


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` = [gate; up] on its last dim: (..., 2I) -> (..., I), one kernel."""
    inter = gate_up.shape[-1] // 2
    xs = _rows(gate_up)
    out = torch.empty((xs.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if xs.shape[0]:
        _silu_mul_kernel[(xs.shape[0], triton.cdiv(inter, SILU_BLOCK))](xs, out, xs.stride(0), inter,
                                                                      BLOCK=SILU_BLOCK)
    return out.view(*gate_up.shape[:-1], inter)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``models.llama.model.apply_rope`` in one kernel: x (B, T, heads, hd), each token's heads at one stride (a view
    of the fused QKV projection); cos / sin_signed (B, T, 1, hd) -> the rotated heads, contiguous. ``hd`` a power of
    two."""
    B, T, heads, hd = x.shape
    if hd & (hd - 1) or x.stride(3) != 1 or x.stride(2) != hd or x.stride(0) != T * x.stride(1):
        raise ValueError(f"rope: heads of a power-of-two size, contiguous within a token, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    out = torch.empty((B, T, heads, hd), dtype=x.dtype, device=x.device)
    if B * T:
        cos2, sin2 = cos.reshape(B * T, hd).contiguous(), sin_signed.reshape(B * T, hd).contiguous()
        _rope_kernel[(B * T,)](x, cos2, sin2, out, x.stride(1), heads, H_PAD=triton.next_power_of_2(heads), HD=hd)
    return out
