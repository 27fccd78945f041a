"""Tensor-parallel (TP) layers that take their group explicitly, and the loaders that cut a weight's shard.

A TP group of `size` ranks splits every big matmul of a model (Megatron style):

- `ColumnParallelLinear` splits the *output* features: rank r holds rows [r*out/size, (r+1)*out/size) of the
  weight (out, in) and produces that slice of the output. No communication.
- `RowParallelLinear` splits the *input* features: rank r holds columns [r*in/size, (r+1)*in/size), multiplies
  its slice of the input and produces a partial sum of the full output, summed over the group by one all-reduce
  (or left partial with ``reduce=False`` for a caller that sums several partial outputs and reduces once).

The group is the runtime's `mstar_dist.distributed.tp.TPGroup` (the rank inside the group, its process group, its
size). Every collective here runs on `TPGroup.group` and its peers are exactly the group's members. Nothing here
looks at the world group. With `TPGroup.single()` (no TP) the layers are plain `Linear`s: same shapes, no
collective.

Loaders: `shard_rows` / `shard_cols` take a full tensor *or* a safetensors slice (`safe_open(...).get_slice`);
with a slice only this rank's rows/columns are read from disk. A fused weight ([q; k; v], [gate; up]) is
sharded part by part and the shards concatenated (`ColumnParallelLinear.weight_loader`), so each rank holds
[q_r; k_r; v_r], not a slice that straddles two parts.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from models.common.linear import Linear
from mstar_dist.distributed.tp import TPGroup

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "shard_rows", "shard_cols", "split_heads"]


def _shape(t: Any) -> list[int]:
    return list(t.get_shape()) if hasattr(t, "get_shape") else list(t.shape)


def shard_rows(t: Any, tp: TPGroup) -> torch.Tensor:
    """This rank's slice of dim 0 of `t` (a column-parallel weight's output features), read from `t`.

    `t` is a tensor or a safetensors slice; ValueError when dim 0 does not divide by the TP size.
    """
    n = tp.split(_shape(t)[0], f"dim 0 of a tensor of shape {_shape(t)}")
    return t[tp.rank * n:(tp.rank + 1) * n]


def shard_cols(t: Any, tp: TPGroup) -> torch.Tensor:
    """This rank's slice of dim 1 of a 2-D `t` (a row-parallel weight's input features), read from `t`."""
    shape = _shape(t)
    if len(shape) != 2:
        raise ValueError(f"shard_cols needs a 2-D tensor, got shape {shape}")
    n = tp.split(shape[1], f"dim 1 of a tensor of shape {shape}")
    return t[:, tp.rank * n:(tp.rank + 1) * n]


class ColumnParallelLinear(Linear):
    """y_r = x @ W_r^T: this rank's slice of the output features; no communication.

    x (..., in_features) replicated on every rank -> (..., out_features / size). `parts` names the widths of a
    fused weight's parts (default one part): each part is split over the group separately and the local
    weight is [part0_r; part1_r; ...]. ValueError when a part (or out_features) does not divide by the size.
    """

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, *,
                 parts: Sequence[int] | None = None) -> None:
        parts = tuple(parts) if parts is not None else (out_features,)
        if sum(parts) != out_features:
            raise ValueError(f"ColumnParallelLinear: parts {parts} do not add up to out_features ({out_features})")
        local = [tp.split(p, "ColumnParallelLinear: out_features" if len(parts) == 1
                          else f"ColumnParallelLinear: part {i} of out_features {parts}")
                 for i, p in enumerate(parts)]
        super().__init__(in_features, sum(local))
        self.tp = tp
        self.parts = parts
        """Full (unsharded) widths of the fused parts, in order."""
        self.local_parts = tuple(local)
        """This rank's widths of the parts (each part / size)."""

    def weight_loader(self, name: str, full_parts: Sequence[Any]) -> torch.Tensor:
        """The local `weight` from the full parts (tensors or safetensors slices, (part_i, in) each)."""
        if name != "weight" or len(full_parts) != len(self.parts):
            raise ValueError(f"ColumnParallelLinear: expected {len(self.parts)} parts for 'weight', "
                             f"got {len(full_parts)} for {name!r}")
        return torch.cat([shard_rows(p, self.tp) for p in full_parts])


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r @ W_r^T, where x_r is this rank's slice of the input features.

    x (..., in_features / size) -> (..., out_features). With ``reduce=True`` the partial sums are all-reduced
    over `tp.group` (peers: every member of the TP group; blocks as `TPGroup.all_reduce`), so every rank returns
    the full y. With ``reduce=False`` the caller gets this rank's partial sum and must reduce it itself.
    """

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, *, reduce: bool = True) -> None:
        super().__init__(tp.split(in_features, "RowParallelLinear: in_features"), out_features)
        self.tp = tp
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.reduce and self.tp.size > 1:
            y = self.tp.all_reduce(y.contiguous())
        return y

    def weight_loader(self, name: str, full_parts: Sequence[Any]) -> torch.Tensor:
        """The local `weight` (out, in/size) from the full weight (out, in), a tensor or a safetensors slice."""
        if name != "weight" or len(full_parts) != 1:
            raise ValueError(f"RowParallelLinear: expected 1 part for 'weight', got {len(full_parts)} for {name!r}")
        return shard_cols(full_parts[0], self.tp)


def split_heads(n_heads: int, n_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """(query heads, KV heads) held by one rank of `tp`; ValueError naming tp_size and both head counts unless
    the TP size divides both (KV heads are split, not replicated: each rank's KV cache holds its own heads)."""
    if n_heads % tp.size or n_kv_heads % tp.size:
        raise ValueError(f"tp_size ({tp.size}) must divide both n_heads ({n_heads}) and "
                         f"n_kv_heads ({n_kv_heads})")
    return n_heads // tp.size, n_kv_heads // tp.size
