"""Llama 3.x RoPE scaling (`rope_scaling` of type llama3, as in Llama-3.2 and Orpheus-TTS) against HF transformers.

A failure here points to: `LlamaConfig.from_hf`/`to_hf` (reading transformers 4's `rope_scaling` or 5's
`rope_parameters`, writing it back) if the config or the frequencies differ; `llama3_inv_freq` or `rope_tables`
in models/llama/model.py if the inverse frequencies differ from HF's; the model's position handling on the
KV-cache path if prefill matches but decode steps do not.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from models.llama.config import Llama3RopeScaling, LlamaConfig
from models.llama.model import llama3_inv_freq, rope_tables
from models.llama.weights import load_llama
from mstar_dist.engine.kv_cache import StaticKVCache

transformers = pytest.importorskip("transformers")

# original_max_position_embeddings=64 with head_dim 16 and theta 500000 puts one frequency below the
# high-frequency wavelength (64/4 = 16 positions: kept), one between the bounds (blended) and six above 64
# (divided by `factor`), so a 90-token prompt crosses both boundaries.
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}
PROMPT_LEN, DECODE_STEPS = 90, 4


def hf_config(**overrides):
    kwargs = dict(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0, rope_scaling=dict(SCALING),
                  max_position_embeddings=256, tie_word_embeddings=True, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(hf_config()).eval()
    out = tmp_path_factory.mktemp("llama3_rope")
    hf_model.save_pretrained(out)
    assert list(out.glob("*.safetensors")), "save_pretrained wrote no safetensors"
    return hf_model, out


def test_config_reads_scaling_in_every_layout_and_writes_it_back(checkpoint) -> None:
    _, path = checkpoint
    saved = json.loads((path / "config.json").read_text())  # transformers 5: rope_parameters; 4: rope_scaling
    config = LlamaConfig.from_hf(saved)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                    original_max_position_embeddings=64)
    old_key = {k: v for k, v in SCALING.items() if k != "rope_type"} | {"type": "llama3"}
    v4 = {**config.to_hf(), "rope_scaling": old_key}
    assert LlamaConfig.from_hf(v4) == config
    assert LlamaConfig.from_hf(config.to_hf()) == config
    assert config.to_hf()["rope_scaling"] == SCALING


def test_inverse_frequencies_equal_hf_and_scaling_changes_them(checkpoint) -> None:
    hf_model, path = checkpoint
    config = LlamaConfig.from_hf(hf_config().to_dict())
    hd = config.head_dim
    plain = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
    scaled = llama3_inv_freq(plain, config.rope_scaling)
    torch.testing.assert_close(scaled, hf_model.model.rotary_emb.inv_freq, atol=0, rtol=0)
    kept = scaled == plain
    divided = torch.isclose(scaled, plain / 8.0, rtol=1e-6, atol=0)
    assert kept.sum() >= 1 and divided.sum() >= 1 and (~kept & ~divided).sum() >= 1, (plain, scaled)
    cos, _ = rope_tables(config, torch.float32)
    plain_cos, _ = rope_tables(dataclasses.replace(config, rope_scaling=None), torch.float32)
    assert not torch.allclose(cos[:PROMPT_LEN], plain_cos[:PROMPT_LEN], atol=1e-3)
    # Our written config.json read by HF gives the same frequencies (transformers 4 layout, read by 4 and 5).
    from_ours = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.to_hf()))
    torch.testing.assert_close(from_ours.model.rotary_emb.inv_freq, scaled, atol=0, rtol=0)


@torch.inference_mode()
def test_prefill_and_decode_logits_match_hf(checkpoint) -> None:
    hf_model, path = checkpoint
    model, config = load_llama(path)
    assert config.rope_scaling is not None and config.tie_word_embeddings
    ids = torch.randint(0, config.vocab_size, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    cache = StaticKVCache(n_layers=config.n_layers, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
                          max_slots=1, max_seq_len=PROMPT_LEN + DECODE_STEPS)
    slot = cache.alloc()
    cache.bind([slot], [0], PROMPT_LEN)
    ours = model(ids, torch.arange(PROMPT_LEN)[None], cache)  # (1, T, V), every position
    out = hf_model(ids, use_cache=True)
    torch.testing.assert_close(ours, out.logits, atol=1e-4, rtol=1e-4)
    token = ours[:, -1:].argmax(-1)  # (1, 1)
    for step in range(DECODE_STEPS):
        pos = PROMPT_LEN + step
        cache.bind([slot], [pos], 1)
        ours = model(token, torch.tensor([[pos]]), cache)
        out = hf_model(token, past_key_values=out.past_key_values, use_cache=True)
        torch.testing.assert_close(ours, out.logits, atol=1e-4, rtol=1e-4, msg=f"decode step {step}")
        token = ours[:, -1:].argmax(-1)
    cache.free(slot)


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 4.0}, {"type": "linear", "factor": 2.0},
                                  {"factor": 8.0}])
def test_unsupported_rope_type_is_a_value_error(rope: dict) -> None:
    hf = {**hf_config().to_dict(), "rope_scaling": rope, "rope_parameters": None}
    with pytest.raises(ValueError, match=f"rope_scaling.rope_type={rope.get('rope_type', rope.get('type'))!r}"):
        LlamaConfig.from_hf(hf)


def test_bad_llama3_values_are_value_errors() -> None:
    base = {**hf_config().to_dict(), "rope_parameters": None}
    with pytest.raises(ValueError, match="lacks \\['high_freq_factor'\\]"):
        LlamaConfig.from_hf({**base, "rope_scaling": {k: v for k, v in SCALING.items() if k != "high_freq_factor"}})
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        LlamaConfig.from_hf({**base, "rope_scaling": {**SCALING, "low_freq_factor": 4.0}})
    with pytest.raises(ValueError, match="'mscale'"):
        LlamaConfig.from_hf({**base, "rope_scaling": {**SCALING, "mscale": 1.0}})
