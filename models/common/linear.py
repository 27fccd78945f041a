"""A bias-free linear layer (model-agnostic): the one class every model's projections use, so a CPU fast path or a
quantised kernel has one place to live.

CPU fast path (``pack_for_cpu``): MKL's fp32 GEMM through ``F.linear`` is slow at a decode batch's few rows (slower
at 8 or 12 rows than at 16). oneDNN's inner product over a weight reordered once into its blocked layout runs the same
GEMM at a few rows much faster; its results differ from ``F.linear``'s by rounding only. At 1-2 rows it is no faster,
so a packed layer keeps its dense weight and takes ``F.linear`` below ``PACKED_MIN_ROWS`` rows: the packed copy
doubles the memory of the layers it covers. The copy is a plain attribute, not a buffer (``state_dict`` and ``.to``
leave it out): pack a model once it is loaded where it runs. (A ``w @ x^T`` product for decode-sized inputs, once
faster than ``F.linear`` with MKL, is slower with current torch, so it is not used.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKED_MIN_ROWS = 3
"""Rows (tokens in the batch) from which a packed layer takes oneDNN's inner product rather than ``F.linear``."""

PACK_BATCH_HINT = 8
"""The batch size oneDNN chooses its weight layout for (8 decode rows ran fastest with it; any row count works)."""


class Linear(nn.Linear):
    """nn.Linear without bias."""

    packed: torch.Tensor | None = None
    """The weight reordered for oneDNN (``pack_for_cpu``), or None: then every call is ``F.linear``."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.numel() >= PACKED_MIN_ROWS * x.shape[-1]:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)

    def pack(self) -> None:
        """Reorder the weight for oneDNN's CPU inner product (inference only: no autograd through it). Call again
        after the weight changes; ``unpack`` drops the packed copy."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_BATCH_HINT)

    def unpack(self) -> None:
        self.packed = None


def _can_pack(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``pack_for_cpu`` packs a weight on ``device`` of ``dtype``: fp32 on the CPU with oneDNN built in (half
    precision keeps ``F.linear``: not measured here)."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_for_cpu(model: nn.Module) -> int:
    """Pack every ``Linear`` of ``model`` (fp32 weights on the CPU) for oneDNN; returns how many it packed. A layer
    whose weight is elsewhere or of another dtype is left as it is."""
    n = 0
    for module in model.modules():
        if isinstance(module, Linear) and _can_pack(module.weight.device, module.weight.dtype):
            module.pack()
            n += 1
    return n
