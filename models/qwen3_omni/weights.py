"""Load the published Qwen3-Omni layout (``model.safetensors.index.json`` -> shards) into modules built on meta.

A rank loads one part of the checkpoint at a time, named by a prefix of the published tensor names:
``thinker.model.`` (the text decoder), ``thinker.lm_head.``, ``thinker.visual.``, ``thinker.audio_tower.``,
``talker.``, ``code2wav.``. Only the shards holding the wanted tensors are opened (the index says which), and a
tensor is read through a safetensors slice, so a TP rank reads only its rows or columns.

Module keys: by default a module's ``state_dict()`` key ``k`` is the checkpoint tensor ``prefix + k`` (our modules
keep the published names). A module that fuses tensors (e.g. experts stacked for grouped
matmuls) passes ``sources``: its key -> the checkpoint tensors that make it, in the order they concatenate along
dim 0. TP slicing belongs to the module (docs/architecture.md §4b): a submodule with ``weight_loader(attr, parts)`` (models/common/tp.py's
parallel linears, models/moe's experts) gets the parts as lazy slices and returns its shard; any other tensor is
read whole (models/common/checkpoint.py). Non-persistent buffers (rotary tables, fixed position encodings) are not
in the checkpoint: they stay on meta for the module to fill.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from models.common.checkpoint import load_sharded_state

INDEX_FILE = "model.safetensors.index.json"
"""The shard index of the published layout: ``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``."""


def _header_names(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return list(f.keys())


def read_weight_map(weights_dir: str | Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index; a directory without one (a single
    ``model.safetensors``, or shards without an index) is mapped by reading each file's header.
    FileNotFoundError naming the directory, or a shard the index names that is absent; ValueError for an index
    without a ``weight_map`` object."""
    d = Path(weights_dir).expanduser()
    if not d.is_dir():
        raise FileNotFoundError(f"weights directory {d} does not exist")
    index = d / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: expected a non-empty 'weight_map' object")
        for file in sorted(set(weight_map.values())):
            if not (d / file).is_file():
                raise FileNotFoundError(f"{d / file} is missing (named by {index})")
        return dict(weight_map)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no {INDEX_FILE} and no *.safetensors files in {d}")
    return {name: f.name for f in files for name in _header_names(f)}


class ShardedCheckpoint:
    """A weights directory's tensors by published name; a shard is opened the first time one of its tensors is
    read, and stays open until ``close`` (or the end of the ``with`` block)."""

    def __init__(self, weights_dir: str | Path) -> None:
        self.weights_dir = Path(weights_dir).expanduser()
        self.weight_map = read_weight_map(self.weights_dir)
        """Tensor name -> shard file name."""
        self._stack = ExitStack()
        self._open: dict[str, Any] = {}

    def __enter__(self) -> "ShardedCheckpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    @property
    def opened_files(self) -> list[str]:
        """The shard files read so far, in the order they were opened."""
        return list(self._open)

    def names(self, prefix: str = "", exclude: Sequence[str] = ()) -> list[str]:
        """Sorted names starting with `prefix` and with none of `exclude` (from the index: no shard is opened)."""
        return sorted(n for n in self.weight_map if n.startswith(prefix) and not n.startswith(tuple(exclude)))

    def slice(self, name: str) -> Any:
        """A lazy view of tensor `name` (a safetensors slice: indexing it reads only the indexed part);
        KeyError naming the tensor when the checkpoint lacks it."""
        file = self.weight_map.get(name)
        if file is None:
            raise KeyError(f"{self.weights_dir}: no tensor {name!r}")
        handle = self._open.get(file)
        if handle is None:
            handle = self._stack.enter_context(safe_open(str(self.weights_dir / file), framework="pt", device="cpu"))
            self._open[file] = handle
        return handle.get_slice(name)

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name`, read whole."""
        return self.slice(name)[:]


class _Scope:
    """The view of a checkpoint that models/common/checkpoint.py's ``load_sharded_state`` checks against: only the
    names under one prefix count (the rest belong to other modules)."""

    def __init__(self, ckpt: ShardedCheckpoint, names: Iterable[str]) -> None:
        self._ckpt = ckpt
        self._names = set(names)

    def names(self) -> set[str]:
        return set(self._names)

    def slice(self, name: str) -> Any:
        return self._ckpt.slice(name)


def read_tensors(weights_dir: str | Path, prefix: str, *, exclude: Sequence[str] = (),
                 dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` (and none under `exclude`), keyed without the prefix, read whole from only the
    shards that hold them. ValueError when nothing in the checkpoint starts with `prefix`."""
    with ShardedCheckpoint(weights_dir) as ckpt:
        names = ckpt.names(prefix, exclude)
        if not names:
            raise ValueError(f"{ckpt.weights_dir}: no tensor starts with {prefix!r}")
        return {n[len(prefix):]: ckpt.tensor(n).to(device=device, dtype=dtype) for n in names}


def load_weights(module: nn.Module, weights_dir: str | Path, prefix: str, *, exclude: Sequence[str] = (),
                 sources: Mapping[str, Sequence[str]] | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu") -> nn.Module:
    """Assign the checkpoint's tensors under `prefix` to `module` (built on meta; its TP shard when it has
    ``weight_loader``s) and return it.

    `exclude`: prefixes under `prefix` that other modules load (e.g. ``("thinker.visual.",
    "thinker.audio_tower.")`` for a text decoder loaded with ``prefix="thinker."``). `sources`: module key ->
    full checkpoint names (module docstring); by default ``prefix + key`` for every key of ``module.state_dict()``.
    `dtype` None keeps the stored dtype. Strict: ValueError naming the module keys the checkpoint cannot fill,
    the checkpoint tensors under `prefix` that no key takes, and any shape that differs (after TP slicing).
    """
    keys = list(module.state_dict())
    plan = {k: (prefix + k,) for k in keys} if sources is None else {k: tuple(v) for k, v in sources.items()}
    unplanned = sorted(set(keys) - set(plan))
    if unplanned:
        raise ValueError(f"module keys {unplanned[:8]} have no checkpoint source (of {len(unplanned)})")
    with ShardedCheckpoint(weights_dir) as ckpt:
        used = {n for parts in plan.values() for n in parts}
        scope = set(ckpt.names(prefix, exclude)) | (used & set(ckpt.weight_map))
        missing = sorted(used - set(ckpt.weight_map))
        if missing:
            raise ValueError(f"{ckpt.weights_dir}: checkpoint lacks {len(missing)} tensors the module needs, "
                             f"e.g. {missing[:8]}")
        state = load_sharded_state(module, plan, _Scope(ckpt, scope), device=device, dtype=dtype,
                                   source=ckpt.weights_dir)
    extra = sorted(set(state) - set(keys))
    if extra:
        raise ValueError(f"sources name keys the module lacks: {extra[:8]}")
    module.load_state_dict(state, strict=True, assign=True)
    return module
