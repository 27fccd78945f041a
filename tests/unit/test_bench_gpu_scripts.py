"""The one-GPU benchmarks' own logic, checked on a CPU so a device run does not fail first time: speech's playback
stall and per-concurrency token counts (scripts/bench_composite.py), and the 30B-A3B MoE benchmark's shape, random
model and engine/bare-loop drivers (scripts/bench_moe30b.py) on the tiny shape.

A failure here means a speech JSON would call a stalling stream smooth (or the reverse), a --tokens-at value would
be misread, the "30B-A3B" shape is not Qwen3-30B-A3B's size, or the MoE benchmark's drivers break before measuring.
"""

from __future__ import annotations

import math

import pytest
import torch

from scripts.bench_composite import parse_args, playback_stall, tokens_at
from scripts.bench_moe30b import SHAPES, bare_decode, build_engine, engine_decode, make_cache, random_moe


def test_a_stream_that_stays_ahead_of_playback_never_stalls():
    # 0.1 s chunks arriving every 0.05 s: the player always has audio
    assert playback_stall([(0.2 + 0.05 * k, 0.1) for k in range(10)]) == 0.0


def test_late_chunks_add_up_to_the_stall():
    # first chunk at 1.0 plays until 1.5; the second arrives at 2.0 (0.5 s dry) and plays until 2.5; the third
    # arrives at 2.6 (0.1 s dry)
    assert playback_stall([(1.0, 0.5), (2.0, 0.5), (2.6, 0.5)]) == pytest.approx(0.6)


def test_tokens_at_overrides_only_the_concurrencies_named():
    args = parse_args(["speech", "--weights", "w", "--out", "o", "--streams", "1", "128", "256",
                       "--max-tokens", "560", "--tokens-at", "128:280", "256:140", "--placement", "colocated"])
    assert [tokens_at(args, n) for n in args.streams] == [560, 280, 140]
    assert args.placement == "colocated"


@pytest.mark.parametrize("bad", ["128", "x:1", "0:5"])
def test_a_bad_tokens_at_is_refused(bad):
    with pytest.raises(SystemExit):
        parse_args(["speech", "--weights", "w", "--out", "o", "--tokens-at", bad])


def test_the_30b_a3b_shape_has_qwen3_30b_a3b_parameter_count():
    from models.moe.model import Qwen3Moe

    with torch.device("meta"):
        model = Qwen3Moe(SHAPES["30b-a3b"])
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(30.53e9, rel=2e-3)


def test_the_full_qwen_image_layout_is_the_published_denoiser_and_vae():
    """The image benchmark's ``--make full`` must time the published model's sizes, not a guess at them."""
    from models.qwen_image.checkpoint import LAYOUTS, _module_shapes, _VaeEncoderLayout, text_encoder_shapes
    from models.qwen_image.transformer import QwenImageTransformer, TransformerConfig
    from models.qwen_image.vae import VaeConfig, VaeDecoder

    full = LAYOUTS["full"]
    with torch.device("meta"):
        denoiser = QwenImageTransformer(TransformerConfig.from_dict(full["transformer"]))
        vae = VaeConfig.from_dict(full["vae"])
        vae_shapes = _module_shapes(VaeDecoder(vae), _VaeEncoderLayout(vae))
    assert sum(p.numel() for p in denoiser.parameters()) == pytest.approx(20.43e9, rel=2e-3)
    assert sum(math.prod(s) for s in vae_shapes.values()) == pytest.approx(126.9e6, rel=2e-3)
    text = text_encoder_shapes(full)
    assert text["visual.merger.mlp.2.weight"][0] == text["model.embed_tokens.weight"][1] == \
        full["transformer"]["joint_attention_dim"]  # the conditioning is as wide as the denoiser takes it


def test_engine_and_bare_loop_drivers_run_the_tiny_shape():
    config = SHAPES["tiny"]
    model = random_moe(config, "cpu", torch.float32)
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
    assert 0.015 < model.layers[0].mlp.experts.w_down.std().item() < 0.025
    prompts = torch.randint(config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(0)).tolist()
    eng = build_engine(model, config, "cpu", max_batch=3, max_seq_len=64)
    row = engine_decode(eng, prompts, 4, "cpu")
    assert row["steps"] == 4 and row["tok_s"] > 0
    assert eng.cache.num_free == eng.cache.max_slots  # every request released
    cache = make_cache(config, 3, 64, torch.float32, "cpu", decode_kernel=False)
    assert bare_decode(model, cache, None, prompts, 4)["tok_s"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_device_writer_writes_what_the_cpu_writer_does_but_the_values(tmp_path, dtype):
    from safetensors import safe_open

    from models.speech.checkpoint import write_random_safetensors
    from scripts.bench_composite import write_random_on_device

    shapes = [("a.weight", (300, 64)), ("norm.weight", (64,)), ("b.weight", (7, 5))]
    write_random_safetensors(tmp_path / "cpu.safetensors", shapes, dtype, 0)
    write_random_on_device(tmp_path / "dev.safetensors", shapes, dtype, 0, device="cpu")
    assert (tmp_path / "cpu.safetensors").stat().st_size == (tmp_path / "dev.safetensors").stat().st_size
    with safe_open(str(tmp_path / "cpu.safetensors"), "pt") as cpu, safe_open(str(tmp_path / "dev.safetensors"),
                                                                              "pt") as dev:
        assert list(cpu.keys()) == list(dev.keys())
        for name, shape in shapes:
            a, b = cpu.get_tensor(name), dev.get_tensor(name)
            assert a.shape == b.shape == shape and a.dtype == b.dtype == dtype
        assert torch.equal(dev.get_tensor("norm.weight"), torch.ones(64, dtype=dtype))
        assert 0.018 < dev.get_tensor("a.weight").float().std().item() < 0.022


def test_make_writes_a_speech_family_through_the_device_writer(tmp_path):
    from safetensors import safe_open

    from scripts.bench_composite import make_checkpoint

    args = parse_args(["speech", "--weights", str(tmp_path / "orpheus"), "--out", "o", "--make", "tiny"])
    make_checkpoint(args, device="cpu")
    with safe_open(str(tmp_path / "orpheus" / "model.safetensors"), "pt") as f:
        assert "model.embed_tokens.weight" in f.keys()
        assert 0.015 < f.get_tensor("model.layers.0.mlp.up_proj.weight").std().item() < 0.025
    assert (tmp_path / "orpheus" / "snac").is_dir() and (tmp_path / "orpheus" / "speech.json").is_file()
