"""The Qwen3-Omni thinker's vision and audio encoders against transformers' ``Qwen3OmniMoe*Encoder`` (fp32, CPU).

Small random configs of the published architecture, transformers' weights loaded into ours by name (strict, onto a
``meta`` build with ``assign=True``), inputs shaped as transformers' processors make them. A failure points to
models/qwen3_omni/vision.py (patch embedding, resampled positions, 2D rotary, per-image attention, mergers and the
order of the deepstack features), models/qwen3_omni/audio.py (chunking, the convolutions and their padding, windows,
output projection), models/common/segment_attention.py, or to models/qwen3_omni/token_counts.py when the number of
placeholders the front end inserts no longer equals the rows an encoder returns.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from models.qwen3_omni.audio import AUDIO_PREFIX, AudioConfig, AudioEncoder, unpad_features
from models.qwen3_omni.token_counts import audio_token_count, image_token_count
from models.qwen3_omni.vision import VISION_PREFIX, VisionConfig, VisionEncoder

transformers = pytest.importorskip("transformers")
hf_omni = pytest.importorskip("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe")
hf_config = pytest.importorskip("transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe")

pytestmark = pytest.mark.usefixtures("one_intraop_thread")

VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              num_position_embeddings=64, deepstack_visual_indexes=[0, 2], patch_size=16, temporal_patch_size=2,
              spatial_merge_size=2)
AUDIO = dict(encoder_layers=2, d_model=32, encoder_attention_heads=2, encoder_ffn_dim=64, downsample_hidden_size=16,
             output_dim=64, num_mel_bins=128, n_window=50, n_window_infer=200)
"""n_window_infer 200: windows of two chunks (26 tokens), so a few seconds of audio spans several windows."""


def _perturbed(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights everywhere (transformers initialises LayerNorms to 1/0 and some biases to 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return module.eval()


def _ours(cls, config, reference: torch.nn.Module):
    with torch.device("meta"):
        module = cls(config)
    module.load_state_dict(reference.state_dict(), strict=True, assign=True)
    assert not any(t.is_meta for t in [*module.parameters(), *module.buffers()])
    return module.eval()


@pytest.fixture(scope="module")
def vision_pair():
    torch.manual_seed(0)
    ref = _perturbed(hf_omni.Qwen3OmniMoeVisionEncoder(hf_config.Qwen3OmniMoeVisionEncoderConfig(**VISION)), 1)
    return ref, _ours(VisionEncoder, VisionConfig.from_hf(ref.config.to_dict()), ref)


def _audio_pair(**overrides):
    torch.manual_seed(0)
    config = hf_config.Qwen3OmniMoeAudioEncoderConfig(**{**AUDIO, **overrides})
    ref = _perturbed(hf_omni.Qwen3OmniMoeAudioEncoder(config), 2)
    return ref, _ours(AudioEncoder, AudioConfig.from_hf(ref.config.to_dict()), ref)


@pytest.fixture(scope="module")
def audio_pair():
    return _audio_pair()


def _images(*sizes: tuple[int, int]):
    """pixel_values and image_grid_thw exactly as transformers' Qwen2-VL image processor makes them."""
    vision_processing = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    processor = vision_processing.Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2,
                                                           min_pixels=32 * 32, max_pixels=256 * 256)
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    out = processor(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def _reference_vision(ref, pixel_values, grid_thw):
    with torch.no_grad():
        out = ref(pixel_values, grid_thw=grid_thw)
    return out.pooler_output, out.deepstack_features


@pytest.mark.parametrize("sizes", [[(64, 96)], [(64, 96), (130, 70)]], ids=["one-image", "two-grids"])
def test_vision_equals_transformers(vision_pair, sizes) -> None:
    ref, ours = vision_pair
    pixel_values, grid_thw = _images(*sizes)
    assert len({tuple(g) for g in grid_thw.tolist()}) == len(sizes)  # distinct grids in one call
    want, want_deep = _reference_vision(ref, pixel_values, grid_thw)
    with torch.no_grad():
        got = ours(pixel_values, grid_thw)
    torch.testing.assert_close(got.embeds, want, rtol=1e-5, atol=1e-5)
    assert len(got.deepstack) == len(VISION["deepstack_visual_indexes"])
    for g, w in zip(got.deepstack, want_deep):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert got.token_counts == [image_token_count(g) for g in grid_thw.tolist()]
    assert sum(got.token_counts) == want.shape[0]


def test_vision_video_grid_equals_transformers(vision_pair) -> None:
    """Two temporal patches of one item (a video): each frame attends within itself, positions repeat."""
    ref, ours = vision_pair
    grid_thw = torch.tensor([[2, 4, 6], [1, 2, 2]])
    pixel_values = torch.randn(int(grid_thw.prod(-1).sum()), ours.config.patch_dim,
                               generator=torch.Generator().manual_seed(4))
    want, want_deep = _reference_vision(ref, pixel_values, grid_thw)
    with torch.no_grad():
        got = ours(pixel_values, grid_thw)
    torch.testing.assert_close(got.embeds, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got.deepstack, want_deep):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_vision_items_do_not_see_each_other(vision_pair) -> None:
    """An image encoded in a batch of requests' images gives what it gives alone."""
    _, ours = vision_pair
    pixel_values, grid_thw = _images((64, 96), (130, 70))
    first = int(grid_thw[0].prod())
    items = [(pixel_values[:first], grid_thw[0].tolist()), (pixel_values[first:], grid_thw[1].tolist())]
    with torch.no_grad():
        together = ours.encode(items)
        alone = [ours.encode([item])[0] for item in items]
    for (embeds, deep), (embeds_1, deep_1), (_, grid) in zip(together, alone, items):
        assert embeds.shape == (image_token_count(grid), VISION["out_hidden_size"])
        torch.testing.assert_close(embeds, embeds_1, rtol=1e-5, atol=1e-6)
        for d, d1 in zip(deep, deep_1):
            torch.testing.assert_close(d, d1, rtol=1e-5, atol=1e-6)


def _clips(*seconds: float):
    """input_features + feature_attention_mask exactly as transformers' WhisperFeatureExtractor makes them (the
    feature extractor of the published checkpoint: 128 mels, padded to 30 s)."""
    extractor = transformers.WhisperFeatureExtractor(feature_size=128)
    rng = np.random.default_rng(5)
    waves = [(0.1 * rng.standard_normal(int(16000 * s))).astype(np.float32) for s in seconds]
    out = extractor(waves, sampling_rate=16000, return_attention_mask=True, padding="max_length",
                    return_tensors="pt")
    return out["input_features"], out["attention_mask"]


def _reference_audio(ref, clips: list[torch.Tensor]) -> torch.Tensor:
    """transformers' thinker: the clips' valid frames concatenated along time, their lengths beside."""
    with torch.no_grad():
        return ref(torch.cat(clips, dim=1), feature_lens=torch.tensor([c.shape[1] for c in clips])).last_hidden_state


def test_audio_one_clip_equals_transformers(audio_pair) -> None:
    ref, ours = audio_pair
    features, mask = _clips(3.37)
    clips = unpad_features(features, mask)
    assert clips[0].shape == (128, 337)  # not a multiple of a chunk (100 frames) nor of a window
    with torch.no_grad():
        got = ours.encode(clips)
    torch.testing.assert_close(got[0], _reference_audio(ref, clips), rtol=1e-5, atol=1e-5)
    assert got[0].shape == (audio_token_count(337), AUDIO["output_dim"])


@pytest.mark.parametrize("n_window_infer", [200, 800])
def test_audio_two_clips_equal_transformers(n_window_infer) -> None:
    """Clips of 5.37 s (537 frames: 5 chunks and a tail; 70 tokens, several windows at 200) and 3 s (a whole
    number of chunks) in one call; the published window (800) too."""
    ref, ours = _audio_pair(n_window_infer=n_window_infer)
    clips = unpad_features(*_clips(5.37, 3.0))
    assert [c.shape[1] for c in clips] == [537, 300]
    want = _reference_audio(ref, clips)
    with torch.no_grad():
        got = ours(torch.cat(clips, dim=1), [537, 300])
    torch.testing.assert_close(got.embeds, want, rtol=1e-5, atol=1e-5)
    assert got.token_counts == [audio_token_count(537), audio_token_count(300)] == [70, 39]
    assert [t.shape[0] for t in got.split()] == got.token_counts


def test_audio_short_clip_is_batch_invariant(audio_pair) -> None:
    """A clip under one chunk (0.6 s) batched with a long one: by default it gives what transformers gives for it
    alone (its chunk padded as if alone); with chunk_pad = the call's longest chunk, the whole call equals
    transformers' call (which pads every chunk to that)."""
    ref, ours = audio_pair
    long, short = unpad_features(*_clips(5.37, 0.6))
    assert short.shape[1] == 60
    with torch.no_grad():
        together = ours.encode([long, short])
        hf_call_wide = ours(torch.cat([long, short], dim=1), [537, 60], chunk_pad=100)
    torch.testing.assert_close(together[0], _reference_audio(ref, [long]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together[1], _reference_audio(ref, [short]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hf_call_wide.embeds, _reference_audio(ref, [long, short]), rtol=1e-5, atol=1e-5)


def test_placeholder_counts_equal_transformers_and_the_encoder(audio_pair) -> None:
    """What the front end inserts (token_counts, no torch) equals transformers' processor count and our rows."""
    lengths = torch.arange(1, 3001)
    want = hf_omni._get_feat_extract_output_lengths(lengths, 50).tolist()
    assert [audio_token_count(n) for n in lengths.tolist()] == want
    _, ours = audio_pair
    odd = [1, 2, 99, 100, 101, 250]
    with torch.no_grad():
        out = ours(torch.randn(128, sum(odd)), odd)
    assert out.token_counts == [audio_token_count(n) for n in odd] and out.embeds.shape[0] == sum(out.token_counts)
    assert image_token_count((1, 4, 6)) == 6 and image_token_count([2, 8, 4], 2) == 16


def test_placeholder_counts_import_no_torch() -> None:
    """The front end sizes prompts with token_counts; importing it must not pull torch into that process."""
    code = "import sys, models.qwen3_omni.token_counts; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def _name_shape(name: str) -> str:
    return re.sub(r"\.\d+(?=\.)", ".N", name)


def test_parameter_names_are_the_published_checkpoints() -> None:
    """Our state_dict keys under the published prefixes, digits as N: the name shapes of the released
    Qwen3-Omni-30B-A3B checkpoint's index for thinker.visual and thinker.audio_tower."""
    with torch.device("meta"):
        vision, audio = VisionEncoder(VisionConfig()), AudioEncoder(AudioConfig())
    got = {_name_shape(VISION_PREFIX + k) for k in vision.state_dict()}
    got |= {_name_shape(AUDIO_PREFIX + k) for k in audio.state_dict()}
    vision_names = ["blocks.N.attn.proj", "blocks.N.attn.qkv", "blocks.N.mlp.linear_fc1", "blocks.N.mlp.linear_fc2",
                    "blocks.N.norm1", "blocks.N.norm2", "merger.ln_q", "merger.mlp.N", "merger_list.N.ln_q",
                    "merger_list.N.mlp.N", "patch_embed.proj"]
    audio_names = ["conv2d1", "conv2d2", "conv2d3", "layers.N.fc1", "layers.N.fc2", "layers.N.final_layer_norm",
                   "layers.N.self_attn.k_proj", "layers.N.self_attn.out_proj", "layers.N.self_attn.q_proj",
                   "layers.N.self_attn.v_proj", "layers.N.self_attn_layer_norm", "ln_post", "proj1", "proj2"]
    want = {f"{VISION_PREFIX}{n}.{p}" for n in vision_names for p in ("weight", "bias")}
    want |= {f"{AUDIO_PREFIX}{n}.{p}" for n in audio_names for p in ("weight", "bias")}
    want |= {f"{VISION_PREFIX}pos_embed.weight", f"{AUDIO_PREFIX}conv_out.weight"}
    assert got == want
    assert vision.state_dict()["patch_embed.proj.weight"].shape == (1152, 3, 2, 16, 16)
    assert len(vision.merger_list) == 3 and len(audio.layers) == 32


def test_bfloat16_runs_close_to_float32(vision_pair, audio_pair) -> None:
    """The serving dtype: same module loaded in bfloat16 stays near the float32 result."""
    for ref, ours in (vision_pair, audio_pair):
        cls = type(ours)
        with torch.device("meta"):
            half = cls(ours.config)
        half.load_state_dict({k: v.to(torch.bfloat16) for k, v in ours.state_dict().items()}, assign=True)
        if cls is VisionEncoder:
            args = _images((64, 96))
        else:
            args = (unpad_features(*_clips(2.5))[0], [250])
        with torch.no_grad():
            want = ours(*args).embeds
            got = half(*args).embeds
        assert got.dtype == torch.bfloat16
        assert (got.float() - want).abs().max() < 0.05 * want.abs().max() + 0.05


@pytest.mark.parametrize("config, key", [
    (dict(deepstack_visual_indexes=[0, 5], depth=3), "deepstack_visual_indexes"),
    (dict(num_position_embeddings=50), "num_position_embeddings"),
    (dict(hidden_act="swish"), "hidden_act"),
    (dict(hidden_size=30, num_heads=2), "hidden_size"),
])
def test_vision_config_mistakes_name_the_key(config, key) -> None:
    with pytest.raises(ValueError, match=key):
        VisionConfig.from_hf(config)


@pytest.mark.parametrize("config, key", [
    (dict(n_window_infer=50), "n_window_infer"),
    (dict(d_model=30, encoder_attention_heads=4), "d_model"),
    (dict(encoder_layers=0), "encoder_layers"),
    (dict(activation_function="mish"), "activation_function"),
])
def test_audio_config_mistakes_name_the_key(config, key) -> None:
    with pytest.raises(ValueError, match=key):
        AudioConfig.from_hf(config)


def test_inputs_that_do_not_fit_are_refused(vision_pair, audio_pair) -> None:
    _, vision = vision_pair
    _, audio = audio_pair
    with pytest.raises(ValueError, match="grid_thw"):
        vision(torch.zeros(24, vision.config.patch_dim), [[1, 4, 5]])  # 5 columns: not whole 2x2 blocks
    with pytest.raises(ValueError, match="expected"):
        vision(torch.zeros(23, vision.config.patch_dim), [[1, 4, 6]])
    with pytest.raises(ValueError, match="num_mel_bins"):
        audio(torch.zeros(80, 100), [100])
    with pytest.raises(ValueError, match="sum"):
        audio(torch.zeros(128, 100), [60, 60])
    with pytest.raises(ValueError, match="chunk_pad"):
        audio(torch.zeros(128, 300), [300], chunk_pad=50)
