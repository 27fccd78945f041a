"""A bias-free linear layer (model-agnostic): the one class every model's projections use, so a CPU fast path or a
quantised kernel has one place to live.

CPU fast path (``pack_for_cpu``): MKL's fp32 GEMM through ``F.linear`` is slow at a decode batch's few rows (on the
2-core dev machine, torch 2.13, the 49152x576 LM head of SmolLM2 takes 4.4 ms at 1 row, 15.7 at 8, 20.4 at 12 and
10.4 at 16). oneDNN's inner product over a weight reordered once into its blocked layout runs the same GEMM at 8 rows
in 5.6 ms (the 3072x576 gate/up projection in 0.41 ms against 0.68); its results differ from ``F.linear``'s by
rounding only (~1e-4 on outputs of order 20). At 1-2 rows it is no faster (0.34 against 0.29 ms for gate/up), so a
packed layer keeps its dense weight and takes ``F.linear`` below ``PACKED_MIN_ROWS`` rows: the packed copy doubles the
memory of the layers it covers. The copy is a plain attribute, not a buffer (``state_dict`` and ``.to`` leave it
out): pack a model once it is loaded where it runs.

History (decision D23 in bench/results/README.md): it used to multiply ``w @ x^T`` on the CPU for decode-sized
inputs, which MKL once ran 2-3x faster than ``F.linear``; with torch 2.13 that path is 2-3x *slower* than
``F.linear`` at 1-2 rows.
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
