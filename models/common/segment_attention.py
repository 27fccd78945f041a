"""Bidirectional attention over packed segments: the rows of several independent sequences laid end to end, each
attending only within itself (vision encoders' per-image attention, audio encoders' per-window attention).

Segments of equal length are stacked and run as one batched ``scaled_dot_product_attention`` call, so there is no
block-diagonal mask to build (its size grows with the square of all rows together) and no dependency on a varlen
kernel; a call holds as many SDPA launches as distinct segment lengths, usually one or two.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: Sequence[int]) -> torch.Tensor:
    """Softmax attention of ``q`` over ``k``/``v`` within each segment; scale ``1 / sqrt(head_dim)``.

    q, k, v: (N, H, D) with N = sum(seqlens), segments contiguous and in order. Returns (N, H, D).
    """
    n_rows = q.shape[0]
    if sum(seqlens) != n_rows or any(n <= 0 for n in seqlens):
        raise ValueError(f"segment_attention: segment lengths {list(seqlens)} must be positive and sum to the "
                         f"{n_rows} rows")
    starts: dict[int, list[int]] = {}
    offset = 0
    for n in seqlens:
        starts.setdefault(n, []).append(offset)
        offset += n
    if len(seqlens) == 1:
        return _attend(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)).squeeze(0)
    out = torch.empty_like(q)
    for n, firsts in starts.items():
        rows = (torch.tensor(firsts, device=q.device)[:, None] + torch.arange(n, device=q.device)).flatten()
        shape = (len(firsts), n, *q.shape[1:])  # (S, n, H, D)
        out[rows] = _attend(q[rows].view(shape), k[rows].view(shape), v[rows].view(shape)).flatten(0, 1)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(S, n, H, D) each -> (S, n, H, D): full attention within each of the S stacked segments."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (S, H, n, D)
    return o.transpose(1, 2)
