"""Read an HF-layout safetensors checkpoint into a model built on `meta`: only this TP rank's shard of each tensor.

A model family describes its checkpoint as `sources`: our parameter name -> the checkpoint tensors (full HF
names, in the order they fuse along dim 0) that make it. The module owning the parameter decides how a TP rank
cuts its shard: a module with ``weight_loader(attr, parts)`` (models/common/tp.py's parallel linears, MoE
experts) returns the local tensor from the parts, given as safetensors slices so that only the shard is read
from disk; any other module's parameter is replicated (the parts are read whole and concatenated).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from mstar_dist.logs import progress_bar


def prepare_once(out: str | Path, complete: str, make: Callable[[Path], Any]) -> Path:
    """``out`` made by ``make(directory)`` unless it already holds the file ``complete``: written into a temporary
    sibling and renamed, so a crash never leaves a half-written ``out`` (how a family prepares its default checkpoint
    on first start). Another process on this host that renamed its copy first wins; ``out`` is returned."""
    out = Path(out).expanduser()
    if (out / complete).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        make(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process on this host renamed its copy first
            if not (out / complete).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_hf_config(weights_dir: str | Path, from_hf: Callable[[dict], Any], prepare_hint: str) -> Any:
    """``from_hf`` of the ``config.json`` in ``weights_dir``; FileNotFoundError naming the directory (and
    ``prepare_hint``, how to make one) or the missing file."""
    weights_dir = Path(weights_dir).expanduser()
    path = weights_dir / "config.json"
    if not weights_dir.is_dir():
        raise FileNotFoundError(f"weights directory {weights_dir} does not exist ({prepare_hint})")
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {weights_dir} is not an HF-layout weights directory")
    return from_hf(json.loads(path.read_text()))


class SafetensorsDir:
    """Every *.safetensors file of a directory, opened once; tensors are looked up by their full name."""

    def __init__(self, weights_dir: Path) -> None:
        files = sorted(Path(weights_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {weights_dir}")
        self._stack = ExitStack()
        self._where: dict[str, Any] = {}
        for file in files:
            handle = self._stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            for name in handle.keys():
                self._where[name] = handle

    def __enter__(self) -> "SafetensorsDir":
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def names(self) -> set[str]:
        return set(self._where)

    def slice(self, name: str) -> Any:
        """A lazy view of tensor `name` (safetensors PySafeSlice): indexing it reads only the indexed part."""
        return self._where[name].get_slice(name)


def load_sharded_state(model: nn.Module, sources: dict[str, tuple[str, ...]], ckpt: SafetensorsDir, *,
                       device: torch.device | str, dtype: torch.dtype, source: Path,
                       ignored: Callable[[str], bool] = lambda name: False) -> dict[str, torch.Tensor]:
    """Our state dict for `model` (built on meta, possibly TP-sharded) from `ckpt`, cast to `dtype` on `device`.

    ValueError (naming `source`) for checkpoint tensors that `sources` needs and the files lack, for tensors
    the files hold that neither `sources` uses nor `ignored` accepts, and for a tensor whose (sharded) shape is
    not the model's. Parameters of `model` absent from `sources` are not filled here (e.g. a tied head).
    """
    names = ckpt.names()
    missing = [n for parts in sources.values() for n in parts if n not in names]
    if missing:
        raise ValueError(f"{source}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:4]}")
    used = {n for parts in sources.values() for n in parts}
    extra = sorted(n for n in names - used if not ignored(n))
    if extra:
        raise ValueError(f"{source}: checkpoint has {len(extra)} unexpected tensors, e.g. {extra[:4]}")
    expected = model.state_dict()  # meta tensors: shapes only
    state: dict[str, torch.Tensor] = {}
    bar = progress_bar(sources.items(), desc=f"loading {Path(source).name}", total=len(sources), unit="tensor")
    for name, parts in bar:
        module_name, _, attr = name.rpartition(".")
        loader = getattr(model.get_submodule(module_name), "weight_loader", None)
        slices = [ckpt.slice(n) for n in parts]
        if loader is not None:
            tensor = loader(attr, slices)
        else:
            tensor = torch.cat([s[:] for s in slices]) if len(slices) > 1 else slices[0][:]
        if tensor.shape != expected[name].shape:
            raise ValueError(f"{source}: tensor for {name} has shape {tuple(tensor.shape)} on this rank, "
                             f"config.json implies {tuple(expected[name].shape)}")
        state[name] = tensor.to(device=device, dtype=dtype)
    return state
