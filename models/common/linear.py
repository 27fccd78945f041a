"""A bias-free linear layer (model-agnostic): the one class every model's projections use, so a CPU fast path or a
quantised kernel has one place to live.

History (docs/notes.md): it used to multiply ``w @ x^T`` on the CPU for decode-sized inputs, which MKL once ran
2-3x faster than ``F.linear``; with torch 2.13 on our 2-core machine that path is 2-3x *slower* than ``F.linear``
at 1-2 rows (SmolLM2-135M decode at batch 1: 101 ms per step against HF's 55 ms), so every device now takes
``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """nn.Linear without bias."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
