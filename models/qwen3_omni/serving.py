"""Build each node of the Qwen3-Omni family on a rank (``Qwen3Omni.build_component``): load its modules from the
checkpoint (loading.py) on the rank's device and dtype, and wrap them in the component that serves them, sized by the
node's engine policy (``engine:``, mstar_dist/config/engine.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from models.common.linear import pack_for_cpu
from models.qwen3_omni import loading
from models.qwen3_omni.config import read_config
from models.qwen3_omni.nodes import Code2WavNode, EncodeNode
from models.qwen3_omni.talker_engine import TalkerEngine
from models.qwen3_omni.talker_io import tts_embeds
from models.qwen3_omni.thinker_engine import OmniThinkerLM, ThinkerEngine
from mstar_dist.config.engine import EngineConfig
from mstar_dist.distributed.tp import TPGroup
from mstar_dist.engine import decode_attention
from mstar_dist.engine.kv_cache import StaticKVCache


def encode_node(weights_dir: str | Path, *, device: str, dtype: torch.dtype, engine: EngineConfig,
                router: str | dict | None) -> EncodeNode:
    config = read_config(weights_dir)
    vision = loading.load_vision(weights_dir, config, device=device, dtype=dtype)
    audio = loading.load_audio(weights_dir, config, device=device, dtype=dtype)
    return EncodeNode(vision, audio, torch.device(device), dtype)


def thinker_engine(weights_dir: str | Path, *, device: str, dtype: torch.dtype, engine: EngineConfig,
                   router: str | dict | None, tp: TPGroup | None = None) -> ThinkerEngine:
    """This rank's shard of the thinker (``tp``) in a KV engine. Fused pointwise kernels stay off: the thinker's
    layers are its own, not models/llama's."""
    config = read_config(weights_dir)
    tp = tp or TPGroup.single()
    policy = engine.on(device, tp.size)
    thinker = loading.load_thinker(weights_dir, config, device=device, dtype=dtype, tp=tp, router=router)
    if policy.cpu_packed_linear:
        pack_for_cpu(thinker)  # fp32 CPU weights only: a no-op elsewhere
    t = config.tokens
    model = OmniThinkerLM(thinker, image_token=t.image, placeholders=(t.image, t.audio, t.video),
                          accept_layer=int(config.talker["accept_hidden_layer"]))
    text = thinker.config
    cache = StaticKVCache(
        decode_kernel=decode_attention.wanted(policy.decode_attention, device, policy.cuda_graphs),
        n_layers=text.n_layers, n_kv_heads=model.local_kv_heads, head_dim=text.head_dim,
        max_slots=policy.max_batch + (1 if policy.cuda_graphs else 0),  # + the graphs' scratch slot
        max_seq_len=min(policy.max_seq_len, text.max_position_embeddings), dtype=dtype, device=device)
    return ThinkerEngine(model, cache, torch.device(device), policy, name="THINKER")


def talker_engine(weights_dir: str | Path, *, device: str, dtype: torch.dtype, engine: EngineConfig,
                  router: str | dict | None) -> TalkerEngine:
    """The talker and its code predictor, a KV cache of ``max_batch`` requests of ``max_seq_len`` positions (its
    prompt and frames), and the tts embeddings (three rows of the thinker's table, read alone)."""
    config = read_config(weights_dir)
    policy = engine.on(device)
    talker = loading.load_talker(weights_dir, config, device=device, dtype=dtype, router=router)
    if policy.cpu_packed_linear:
        pack_for_cpu(talker)
    t = config.tokens
    rows = loading.thinker_rows(weights_dir, [t.tts_bos, t.tts_eos, t.tts_pad], device=device, dtype=dtype)
    with torch.inference_mode():
        tts = tts_embeds(talker, rows)
    text = talker.config.text
    cache = StaticKVCache(n_layers=text.n_layers, n_kv_heads=talker.local_kv_heads, head_dim=text.head_dim,
                          max_slots=policy.max_batch, max_seq_len=policy.max_seq_len, dtype=dtype, device=device)
    return TalkerEngine(talker, cache, torch.device(device), tts)


def code2wav_node(weights_dir: str | Path, *, device: str, dtype: torch.dtype, engine: EngineConfig,
                  router: str | dict | None) -> Code2WavNode:
    model = loading.load_code2wav(weights_dir, read_config(weights_dir), device=device, dtype=dtype)
    return Code2WavNode(model, torch.device(device))
