"""Qwen3-MoE chat model: LlamaChat's walks (prefill, decode loop) around the MoE decoder of models/moe/model.py.

Registry key (models/__init__.py, added by the integrator): ``"qwen3_moe": MoEChat``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mstar_dist.distributed.tp import TPGroup
from mstar_dist.random_weights import mark_prepared
from models.llama.chat import LLM, LlamaChat
from models.moe.routers import parse_router_spec, resolve_router


DEFAULT_MOE_DIR = "~/.cache/mstar_dist/qwen3-moe-tiny"
"""Prepared on first start with a tiny random checkpoint of the HF Qwen3-MoE layout (models/moe/checkpoint.py)."""


class MoEChat(LlamaChat):
    """``model_kwargs``: LlamaChat's (``dtype``) plus ``router``: the router of every MoE block, a registry name
    ("topk", the default, HF's routing; "load_biased"), ``package.module:Class``, or ``{"name": ..., **kwargs}`` with
    the class's keyword arguments (models/moe/routers.py). The MoE model does not declare its pads inert (a
    batch-wide stateful router would count them), so its engine neither looks ahead nor pads prompts of different
    lengths into one forward, whatever ``engine:`` says."""

    name = "qwen3_moe"

    def __init__(self, weights_dir: str | None, **model_kwargs: Any):
        router = model_kwargs.pop("router", None)
        super().__init__(str(Path(weights_dir or DEFAULT_MOE_DIR).expanduser()), **model_kwargs)
        if router is not None:
            name, _ = parse_router_spec(router)  # ValueError now, on the conductor, for a bad spec or name
            resolve_router(name)
            self.model_kwargs["router"] = router
        self.router = router

    def _load_model(self, device: str, dtype: torch.dtype, tp: TPGroup):
        from models.moe.weights import load_moe

        return load_moe(self.weights_dir, device=device, dtype=dtype, tp=tp, router=self.router)

    def prepare_weights(self) -> None:
        import shutil
        import tempfile

        from models.moe.checkpoint import make_moe_checkpoint

        out = Path(self.weights_dir)
        if (out / "config.json").is_file():
            if out == Path(DEFAULT_MOE_DIR).expanduser():
                mark_prepared(out, 0, "scripts/make_moe_checkpoint.py")
            return
        if out != Path(DEFAULT_MOE_DIR).expanduser():
            raise FileNotFoundError(f"weights: {out} is not a checkpoint directory (only the default "
                                    f"{DEFAULT_MOE_DIR} is prepared automatically)")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
        try:  # the plain writer: the same bytes with or without transformers installed
            make_moe_checkpoint(tmp, seed=0, writer="plain")
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def load_frontend(self) -> None:
        from models.llama.tokenizer import ChatTokenizer
        from models.moe.config import MoEConfig

        self.tokenizer = ChatTokenizer(self.weights_dir)
        cfg = MoEConfig.from_hf(json.loads((Path(self.weights_dir) / "config.json").read_text()))
        self._context = min(self.engine.max_seq_len, cfg.max_position_embeddings)
