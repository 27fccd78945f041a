"""Decoded images -> 8-bit RGB -> PNG bytes, with the standard library's zlib and struct only.

to_uint8 matches diffusers' `VaeImageProcessor.postprocess(output_type="pil")` value for value:
(x * 0.5 + 0.5).clamp(0, 1) * 255 in float32, rounded half to even (torch.round, as numpy's round).

encode_png writes one IHDR (8-bit truecolour, no interlace), one IDAT and IEND. Every row uses filter 0
(none) and zlib level 6, so for the same pixels and the same zlib build the bytes are identical.
"""

from __future__ import annotations

import struct
import zlib

import torch

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_ZLIB_LEVEL = 6


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """(3, H, W) or (B, 3, H, W) images nominally in [-1, 1] -> uint8 (H, W, 3) or (B, H, W, 3) on CPU.

    Values outside [-1, 1] are clamped. ValueError for NaN or inf (a diverged model, not an image).
    """
    if images.ndim not in (3, 4) or images.shape[-3] != 3:
        raise ValueError(f"images must be (3, H, W) or (B, 3, H, W), got {tuple(images.shape)}")
    x = images.detach().float().cpu()
    if not torch.isfinite(x).all():
        raise ValueError("images contain NaN or inf")
    x = ((x * 0.5 + 0.5).clamp(0, 1) * 255).round()  # round half to even
    return x.to(torch.uint8).movedim(-3, -1).contiguous()  # (..., H, W, 3)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def encode_png(rgb: torch.Tensor) -> bytes:
    """uint8 (H, W, 3) RGB on any device -> the bytes of a PNG file."""
    if rgb.dtype != torch.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3 or 0 in rgb.shape:
        raise ValueError(f"rgb must be a non-empty uint8 (H, W, 3) tensor, got {rgb.dtype} {tuple(rgb.shape)}")
    H, W, _ = rgb.shape
    rows = rgb.detach().cpu().reshape(H, W * 3)
    filtered = torch.cat([torch.zeros(H, 1, dtype=torch.uint8), rows], dim=1)  # filter byte 0 per row
    header = struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0)  # 8-bit, truecolour, deflate, adaptive, no interlace
    return (_SIGNATURE + _chunk(b"IHDR", header)
            + _chunk(b"IDAT", zlib.compress(filtered.numpy().tobytes(), _ZLIB_LEVEL))
            + _chunk(b"IEND", b""))
