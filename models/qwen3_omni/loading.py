"""Build each Qwen3-Omni module a rank serves from a checkpoint of the published layout: on ``meta``, then only its
own tensors read from the shards that hold them (weights.py), on the rank's device and dtype.

``load_thinker`` takes a TP group (models/common/tp.py: each rank reads its rows or columns only); the encoders, the
talker and code2wav run on one rank each. ``thinker_rows`` reads single rows of the thinker's embedding table (the
talker's tts embeddings are the thinker's embeddings of three tokens: the talker's rank reads those rows only).
"""

from __future__ import annotations

from pathlib import Path

import torch

from models.qwen3_omni.audio import AUDIO_PREFIX, AudioConfig, AudioEncoder
from models.qwen3_omni.code2wav import Code2Wav, Code2WavConfig
from models.qwen3_omni.config import Qwen3OmniConfig
from models.qwen3_omni.talker import Talker, TalkerConfig
from models.qwen3_omni.thinker import Qwen3OmniThinker, ThinkerConfig
from models.qwen3_omni.vision import VISION_PREFIX, VisionConfig, VisionEncoder
from models.qwen3_omni.weights import ShardedCheckpoint, load_weights, read_tensors
from mstar_dist.distributed.tp import TPGroup

THINKER_PREFIX = "thinker."
EMBED_NAME = "thinker.model.embed_tokens.weight"
"""The thinker's input embedding table in the published layout."""


def load_thinker(weights_dir: str | Path, config: Qwen3OmniConfig, *, device: str, dtype: torch.dtype,
                 tp: TPGroup = TPGroup.single(), router: str | dict | None = None) -> Qwen3OmniThinker:
    """The thinker's text decoder and head: this rank's shard of them (``tp``), ready to run."""
    with torch.device("meta"):
        model = Qwen3OmniThinker(ThinkerConfig.from_hf(dict(config.thinker)), tp=tp, router=router)
    sources = model.checkpoint_sources(THINKER_PREFIX)
    if model.config.tie_word_embeddings:
        sources["lm_head.weight"] = (EMBED_NAME,)
    used = {name for names in sources.values() for name in names}
    with ShardedCheckpoint(weights_dir) as ckpt:  # a router without a weight leaves its layer's gate tensor unread
        unread = [n for n in ckpt.names(THINKER_PREFIX + "model.layers.") if n.endswith(".mlp.gate.weight")
                  and n not in used]
    load_weights(model, weights_dir, THINKER_PREFIX, exclude=(VISION_PREFIX, AUDIO_PREFIX, *unread),
                 sources=sources, dtype=dtype, device=device)
    model.finish_load()
    return model.eval()


def load_vision(weights_dir: str | Path, config: Qwen3OmniConfig, *, device: str, dtype: torch.dtype
                ) -> VisionEncoder:
    with torch.device("meta"):
        model = VisionEncoder(VisionConfig.from_hf(config.vision))
    return load_weights(model, weights_dir, VISION_PREFIX, dtype=dtype, device=device).eval()


def load_audio(weights_dir: str | Path, config: Qwen3OmniConfig, *, device: str, dtype: torch.dtype
               ) -> AudioEncoder:
    with torch.device("meta"):
        model = AudioEncoder(AudioConfig.from_hf(config.audio))
    return load_weights(model, weights_dir, AUDIO_PREFIX, dtype=dtype, device=device).eval()


def load_talker(weights_dir: str | Path, config: Qwen3OmniConfig, *, device: str, dtype: torch.dtype,
                router: str | dict | None = None) -> Talker:
    """The talker and its code predictor; its routers probed on the loaded weights. Its state dict speaks the
    published names through hooks (talker.py), so the tensors are read whole and loaded through them."""
    with torch.device("meta"):
        model = Talker(TalkerConfig.from_hf(config.to_hf()), router=router)
    model.load_state_dict(read_tensors(weights_dir, "talker.", dtype=dtype, device=device), strict=True, assign=True)
    model.check_routers()
    return model.eval()


def load_code2wav(weights_dir: str | Path, config: Qwen3OmniConfig, *, device: str, dtype: torch.dtype
                  ) -> Code2Wav:
    with torch.device("meta"):
        model = Code2Wav(Code2WavConfig.from_hf(dict(config.code2wav)))
    load_weights(model, weights_dir, "code2wav.", dtype=dtype, device=device)
    model.init_buffers()
    return model.eval()


def thinker_rows(weights_dir: str | Path, ids: list[int], *, device: str, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of the thinker's embedding table, (len(ids), Dt): each read alone from its shard."""
    with ShardedCheckpoint(weights_dir) as ckpt:
        table = ckpt.slice(EMBED_NAME)
        rows = [table[i:i + 1] for i in ids]
    return torch.cat(rows).to(device=device, dtype=dtype)
