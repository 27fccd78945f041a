"""Inline transport: a tensor encoded as bytes inside a control message.

Small tensors (token ids, short chunks, scalars) ride inside the INPUTS message instead of going over a pair
group: one eager NCCL/gloo op costs far more than a few hundred bytes of msgpack (docs/architecture.md §7).

`InlineTensor` is the wire type the control messages embed. The bytes are the tensor's raw memory in row-major
order and the host's byte order (little-endian on every machine we run on), so encode/decode is one copy each
way and works for every dtype, including the ones numpy lacks (bfloat16) or stores differently (bool).
"""

from __future__ import annotations

import math
import struct
import sys
from array import array
from collections.abc import Sequence

import numpy as np
import torch

from mstar_dist.control.messages import InlineTensor  # the wire type lives with the messages (no torch there)

__all__ = ["encode_tensor", "encode_ids", "decode_ids", "decode_tensor", "dtype_to_str",
           "str_to_dtype"]


_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16",
        "int64", "int32", "int16", "int8", "uint8", "bool",
        "uint16", "uint32", "uint64",
        "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}
_NUMPY = {name: np.dtype(name) for name in ("float64", "float32", "float16", "int64", "int32", "int16", "int8",
                                            "uint8", "bool")}
"""Wire dtypes numpy reads the same way torch does: decoded through numpy, less per-call overhead than torch's
frombuffer/view/reshape (a decode step's tokens are many one-element tensors)."""


_INT64 = struct.Struct("<q").pack
"""One int64 in the wire's (little-endian) byte order."""


def dtype_to_str(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype ("float32", "bfloat16", "bool", ...). ValueError for unsupported dtypes."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be put on the wire; supported: {sorted(_DTYPES)}") from None


def str_to_dtype(name: str) -> torch.dtype:
    """Inverse of `dtype_to_str`. ValueError naming the unknown name."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown wire dtype {name!r}; supported: {sorted(_DTYPES)}") from None


def encode_tensor(t: torch.Tensor) -> InlineTensor:
    """Copy `t` (any device, any strides, any supported dtype) into an `InlineTensor`.

    A CUDA tensor is copied to the host here (this blocks until the producing kernels are done); that is the
    inline path's price and the reason it is only used below `inline_max_bytes`.
    """
    if t.dtype is torch.int64 and t.is_cpu and t.numel() == 1:
        # one token id, every row of every decode step: no numpy round trip and no torch.device built for the test
        return InlineTensor("int64", [1] if t.dim() == 1 else list(t.shape), _INT64(t.item()))
    dtype = dtype_to_str(t.dtype)
    shape = list(t.shape)
    # reshape(-1) makes 0-d tensors 1-d and non-contiguous ones contiguous; the uint8 view then works for
    # every element size (bool and bfloat16 included) without going through numpy's dtype table.
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    data = flat.contiguous().view(torch.uint8).numpy().tobytes()
    return InlineTensor(dtype=dtype, shape=shape, data=data)


def encode_ids(ids: Sequence[int]) -> InlineTensor:
    """A prompt's token ids as the 1-d int64 `InlineTensor` that `encode_tensor` makes of them, built straight from
    the ints: a tensor made of a prompt only to be turned back into bytes (``torch.tensor`` then
    ``encode_tensor``) would be most of the conductor's work per request, and the conductor admits a burst's
    requests one after another (docs/architecture.md §2). OverflowError for an id outside int64."""
    raw = _wire_order(array("q", ids))
    return InlineTensor(dtype="int64", shape=[len(raw)], data=raw.tobytes())


def decode_ids(values: Sequence[InlineTensor]) -> list[int]:
    """The elements of int64 `InlineTensor`s as one flat list of ints, without a tensor (the conductor's path for a
    decode step's tokens: ``CompositeModel.id_signals``). ValueError for another dtype or a truncated payload."""
    ids: list[int] = []
    for it in values:
        if it.dtype != "int64" or len(it.data) != 8 * math.prod(it.shape):
            raise ValueError(f"decode_ids: int64 values only, got {it.dtype} shape {it.shape} in {len(it.data)} bytes")
        raw = array("q")
        raw.frombytes(it.data)
        ids.extend(_wire_order(raw))
    return ids


def _wire_order(raw: array) -> array:
    """``raw`` in the wire's little-endian order (a no-op on every machine we run on), swapped in place."""
    if sys.byteorder != "little":
        raw.byteswap()
    return raw


def decode_tensor(it: InlineTensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """Rebuild the tensor described by `it` on `device` (a fresh, writable, contiguous tensor). On CUDA the copy is
    queued on the current stream without waiting for it (use the tensor on that stream, or sync first).

    ValueError if the byte count does not match dtype and shape (a truncated or foreign message).
    """
    dtype = str_to_dtype(it.dtype)
    numel = math.prod(it.shape)
    itemsize = dtype.itemsize
    if len(it.data) != numel * itemsize:
        raise ValueError(
            f"inline tensor carries {len(it.data)} bytes but dtype {it.dtype} shape {it.shape} "
            f"needs {numel * itemsize}"
        )
    if numel == 0:
        out = torch.empty(it.shape, dtype=dtype)
    elif it.dtype in _NUMPY:  # bytearray: a writable buffer; this is the one host copy
        out = torch.from_numpy(np.frombuffer(bytearray(it.data), dtype=_NUMPY[it.dtype]).reshape(it.shape))
    else:
        # bytearray: torch.frombuffer needs a writable buffer; this is the one host copy.
        raw = torch.frombuffer(bytearray(it.data), dtype=torch.uint8)
        out = raw.view(dtype).reshape(it.shape)
    if device == "cpu" or torch.device(device).type == "cpu":
        return out
    if torch.device(device).type == "cuda":
        # through pinned memory, asynchronously: a copy from pageable memory first waits for every kernel queued
        # on the stream (a decode step launched ahead, docs/architecture.md §8), stalling the rank's loop
        return out.pin_memory().to(device, non_blocking=True)
    return out.to(device)
