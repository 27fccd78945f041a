"""Qwen3-Omni's preprocessing (``models/qwen3_omni/processor.py``) against transformers' processors.

A failure means the vision encoder sees other patches than transformers' ``Qwen2VLImageProcessor`` makes (a resize,
normalisation or patch order off: the thinker then reads another picture), the audio encoder other log-mel frames
than ``WhisperFeatureExtractor`` (configured as the published ``preprocessor_config.json`` and called as
``Qwen3OmniMoeProcessor`` calls it), or a prompt with more or fewer ``<|image_pad|>`` / ``<|audio_pad|>`` tokens than
the encoders produce rows (the thinker fails or misplaces the media). Parity: pixels and grids exact; log-mel within
1e-6 of transformers' numpy path and within 5e-5 of its default torch path (float32 STFT rounding); token ids exact.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("PIL")

from mstar_dist.media.errors import MediaError  # noqa: E402
from models.qwen3_omni.processor import (  # noqa: E402
    AUDIO_DEFAULTS, IMAGE_DEFAULTS, PUBLISHED_PREPROCESSOR_CONFIG, PreprocessorConfig,
    audio_token_count, expand_placeholders, expand_prompt_text, image_grid, image_token_count, log_mel,
    mel_filter_bank, prepare_prompt, process_audio, process_images, published_config, smart_resize,
)

CONFIG = published_config()
SIZES = [(1, 1), (5, 7), (37, 53), (224, 224), (333, 517), (31, 3001), (3001, 17), (64, 6400)]
"""Tiny, odd, square, very wide, very tall, and an aspect ratio at 100."""
CLIP_SAMPLES = [201, 1600, 16007, 32077, 16000 * 30 + 3]
"""The shortest clip, a tenth of a second, lengths off the hop, two seconds, thirty seconds."""
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
            "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"]


def pixels(seed: int, h: int, w: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8)


def speechlike(seed: int, n: int) -> np.ndarray:
    """Smoothed noise in bursts with silent gaps: a wide dynamic range, like speech."""
    rs = np.random.RandomState(seed)
    bursts = np.sin(np.arange(n) / 800) > 0
    return (np.convolve(rs.randn(n), np.hanning(50), "same") * 0.05 * bursts).astype(np.float32)


@pytest.fixture(scope="module")
def hf_image():
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    keys = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "image_mean", "image_std")
    return pil.Qwen2VLImageProcessorPil(**{k: PUBLISHED_PREPROCESSOR_CONFIG[k] for k in keys})


@pytest.fixture(scope="module")
def hf_audio():
    transformers = pytest.importorskip("transformers")
    keys = ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft", "padding_value", "dither",
            "return_attention_mask")
    return transformers.WhisperFeatureExtractor(**{k: PUBLISHED_PREPROCESSOR_CONFIG[k] for k in keys})


def whisper(extractor, clips, *, numpy_path=False, monkeypatch=None):
    """transformers' features and mask, called as Qwen3OmniMoeProcessor calls the extractor."""
    if numpy_path:
        module = sys.modules[type(extractor).__module__]
        monkeypatch.setattr(module, "is_torch_available", lambda: False)
    out = extractor(clips, sampling_rate=16000, padding=True, truncation=False, return_attention_mask=True)
    return out["input_features"], out["attention_mask"].astype(bool)


@pytest.fixture(scope="module")
def hf_processor(hf_image, hf_audio):
    """transformers' Qwen3OmniMoeProcessor over a word-level tokenizer holding Qwen's special tokens (no video
    processor: transformers' needs torchvision, and no video goes through it)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "describe": 1, "this": 2, "and": 3, "that": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    names = {"image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>", "video_token": "<|video_pad|>",
             "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
             "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"}
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, extra_special_tokens=names)

    class WithoutVideo(transformers.Qwen3OmniMoeProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    return WithoutVideo(image_processor=hf_image, video_processor=None, feature_extractor=hf_audio,
                        tokenizer=tokenizer)


# --- config -----------------------------------------------------------------------------------------------------


def test_published_config_is_read_and_missing_keys_take_transformers_defaults(tmp_path):
    assert CONFIG.image.patch_size == 16 and CONFIG.image.factor == 32 and CONFIG.image.patch_dim == 1536
    assert CONFIG.image.image_mean == (0.5, 0.5, 0.5) and CONFIG.image.max_pixels == 12845056
    assert CONFIG.audio.feature_size == 128 and CONFIG.audio.hop_length == 160 and CONFIG.audio.n_window == 50
    bare = PreprocessorConfig.from_dict({})
    assert bare.image.patch_size == IMAGE_DEFAULTS["patch_size"] and bare.audio.feature_size == 80
    sized = PreprocessorConfig.from_dict({"size": {"shortest_edge": 100, "longest_edge": 10_000}})
    assert (sized.image.min_pixels, sized.image.max_pixels) == (100, 10_000)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PUBLISHED_PREPROCESSOR_CONFIG))
    assert PreprocessorConfig.load(tmp_path) == CONFIG == PreprocessorConfig.load(tmp_path / "preprocessor_config.json")


def test_transformers_defaults_are_the_classes_defaults(hf_image):
    transformers = pytest.importorskip("transformers")
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    image, audio = pil.Qwen2VLImageProcessorPil(), transformers.WhisperFeatureExtractor()
    assert [image.patch_size, image.temporal_patch_size, image.merge_size, image.size["shortest_edge"],
            image.size["longest_edge"], list(image.image_mean), list(image.image_std), image.rescale_factor,
            int(image.resample)] == [IMAGE_DEFAULTS[k] for k in ("patch_size", "temporal_patch_size", "merge_size",
                                                                 "min_pixels", "max_pixels", "image_mean",
                                                                 "image_std", "rescale_factor", "resample")]
    assert [audio.feature_size, audio.sampling_rate, audio.hop_length, audio.n_fft, audio.padding_value,
            audio.dither, audio.padding_side] == [AUDIO_DEFAULTS[k] for k in ("feature_size", "sampling_rate",
                                                                             "hop_length", "n_fft", "padding_value",
                                                                             "dither", "padding_side")]
    assert transformers.Qwen3OmniMoeProcessor.n_window == AUDIO_DEFAULTS["n_window"]


@pytest.mark.parametrize("key,value", [("dither", 1e-5), ("do_normalize", False), ("padding_side", "left"),
                                       ("patch_size", 0), ("image_std", [0.5, 0.0, 0.5]), ("resample", 42)])
def test_unsupported_config_values_name_the_key(key, value):
    with pytest.raises(ValueError, match=key):
        PreprocessorConfig.from_dict({**PUBLISHED_PREPROCESSOR_CONFIG, key: value})


# --- images -----------------------------------------------------------------------------------------------------


def test_smart_resize_equals_transformers():
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    for h in (1, 15, 16, 17, 47, 48, 49, 100, 223, 1000, 3583, 5000):
        for w in (1, 16, 48, 80, 99, 512, 1001, 4000):
            if max(h, w) / min(h, w) > 200:
                continue
            for lo, hi in ((3136, 12845056), (100_000, 200_000)):
                expected = pil.smart_resize(h, w, factor=32, min_pixels=lo, max_pixels=hi)
                assert smart_resize(h, w, factor=32, min_pixels=lo, max_pixels=hi) == expected, (h, w, lo, hi)


def test_aspect_ratio_over_200_is_a_media_error():
    with pytest.raises(MediaError, match="aspect ratio 201.0 is over 200"):
        smart_resize(1, 201, factor=32, min_pixels=3136, max_pixels=12845056)
    with pytest.raises(MediaError, match="aspect ratio"):
        process_images([pixels(0, 3, 700)], CONFIG.image)


@pytest.mark.parametrize("h,w", SIZES)
def test_image_patches_equal_transformers(hf_image, h, w):
    from PIL import Image

    image = pixels(h * w, h, w)
    ours = process_images([image], CONFIG.image)
    reference = hf_image(images=[Image.fromarray(image)])
    np.testing.assert_array_equal(ours.grid_thw, reference["image_grid_thw"])
    assert ours.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(ours.pixel_values, reference["pixel_values"])
    assert ours.grid_thw.tolist() == [list(image_grid(h, w, CONFIG.image))]


def test_images_over_max_pixels_and_several_images_equal_transformers():
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    from PIL import Image

    config = PreprocessorConfig.from_dict({"min_pixels": 4096, "max_pixels": 150_000})  # transformers' defaults else
    reference_processor = pil.Qwen2VLImageProcessorPil(min_pixels=4096, max_pixels=150_000)
    images = [pixels(1, 1000, 1500), pixels(2, 9, 9), pixels(3, 250, 60)]
    ours = process_images(images, config.image)
    reference = reference_processor(images=[Image.fromarray(i) for i in images])
    np.testing.assert_array_equal(ours.grid_thw, reference["image_grid_thw"])
    np.testing.assert_array_equal(ours.pixel_values, reference["pixel_values"])
    assert all(h * w * 14 * 14 <= 150_000 for _, h, w in ours.grid_thw.tolist())


def test_patch_rows_follow_merge_blocks_and_repeat_in_time():
    """An image already on the grid (no resize), each pixel holding its patch's index: a row holds one patch,
    twice (two temporal frames), and the four patches of a 2x2 merge block are consecutive rows."""
    config = PreprocessorConfig.from_dict({**PUBLISHED_PREPROCESSOR_CONFIG, "image_mean": 0.0, "image_std": 1.0,
                                           "rescale_factor": 1.0, "min_pixels": 1})
    grid_h, grid_w = 4, 6
    patch_index = np.arange(grid_h * grid_w).reshape(grid_h, grid_w)
    image = np.repeat(np.repeat(patch_index, 16, axis=0), 16, axis=1).astype(np.uint8)
    out = process_images([np.stack([image] * 3, axis=-1)], config.image)
    assert out.grid_thw.tolist() == [[1, grid_h, grid_w]]
    rows = out.pixel_values.reshape(grid_h * grid_w, 3 * 2 * 16 * 16)
    assert all(np.all(row == row[0]) for row in rows)
    order = [int(row[0]) for row in rows]
    expected = [patch_index[2 * bh + mh, 2 * bw + mw]
                for bh in range(grid_h // 2) for bw in range(grid_w // 2) for mh in range(2) for mw in range(2)]
    assert order == expected
    assert out.token_counts == [grid_h * grid_w // 4]


def test_image_inputs_are_checked():
    with pytest.raises(ValueError, match="uint8 RGB"):
        process_images([np.zeros((4, 4, 4), np.uint8)], CONFIG.image)
    with pytest.raises(ValueError, match="at least one"):
        process_images([], CONFIG.image)


# --- audio ------------------------------------------------------------------------------------------------------


def test_mel_filters_equal_transformers_bit_for_bit(hf_audio):
    np.testing.assert_array_equal(mel_filter_bank(CONFIG.audio), hf_audio.mel_filters)


@pytest.mark.parametrize("n", CLIP_SAMPLES)
def test_log_mel_equals_whisper_feature_extractor(hf_audio, monkeypatch, n):
    clip = speechlike(n, n)
    ours = process_audio([clip], CONFIG.audio)
    features, mask = whisper(hf_audio, [clip])
    assert ours.lengths.tolist() == mask.sum(-1).tolist() == [n // 160]
    assert ours.features[0].dtype == np.float32 and ours.features[0].shape == (128, n // 160)
    np.testing.assert_allclose(ours.features[0], features[0][:, mask[0]], rtol=0, atol=5e-5)  # torch float32 STFT
    features, mask = whisper(hf_audio, [clip], numpy_path=True, monkeypatch=monkeypatch)
    np.testing.assert_allclose(ours.features[0], features[0][:, mask[0]], rtol=0, atol=1e-6)


def test_log_mel_of_a_pure_tone_and_of_silence(hf_audio, monkeypatch):
    tone = (0.5 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)).astype(np.float32)
    silence = np.zeros(8000, np.float32)
    for clip in (tone, silence):
        features, mask = whisper(hf_audio, [clip], numpy_path=True, monkeypatch=monkeypatch)
        np.testing.assert_allclose(log_mel(clip, CONFIG.audio), features[0][:, mask[0]], rtol=0, atol=1e-6)


def test_batch_padding_equals_transformers_batch_and_default_is_each_clip_alone(hf_audio, monkeypatch):
    clips = [speechlike(1, 1600), speechlike(2, 16007), speechlike(3, 32077)]
    batched = process_audio(clips, CONFIG.audio, batch_padding=True)
    features, mask = whisper(hf_audio, clips, numpy_path=True, monkeypatch=monkeypatch)
    assert batched.lengths.tolist() == mask.sum(-1).tolist() == [10, 101, 200]  # 16007 samples: one frame more
    for i, f in enumerate(batched.features):
        np.testing.assert_allclose(f, features[i][:, mask[i]], rtol=0, atol=1e-6)
    alone = process_audio(clips, CONFIG.audio)
    assert alone.lengths.tolist() == [10, 100, 200]
    for clip, f in zip(clips, alone.features):
        one, one_mask = whisper(hf_audio, [clip], numpy_path=True, monkeypatch=monkeypatch)
        np.testing.assert_allclose(f, one[0][:, one_mask[0]], rtol=0, atol=1e-6)


def test_a_clip_too_short_for_its_frames_is_a_media_error():
    with pytest.raises(MediaError, match="200 samples, fewer than the 201"):
        process_audio([np.zeros(200, np.float32)], CONFIG.audio)
    with pytest.raises(ValueError, match="mono"):
        process_audio([np.zeros((400, 2), np.float32)], CONFIG.audio)


def test_token_counts_equal_transformers():
    processing = pytest.importorskip("transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe")
    frames = np.arange(0, 4000)
    expected = processing._get_feat_extract_output_lengths(frames, 50)
    assert [audio_token_count(int(n)) for n in frames] == expected.tolist()
    assert image_token_count((1, 4, 6)) == 6 and image_token_count((2, 8, 8), 2) == 32
    with pytest.raises(ValueError, match="multiples of spatial_merge_size"):
        image_token_count((1, 3, 4))


# --- the prompt -------------------------------------------------------------------------------------------------


PROMPT = ("<|im_start|> describe <|vision_start|><|image_pad|><|vision_end|> and "
          "<|audio_start|><|audio_pad|><|audio_end|> this <|vision_start|><|image_pad|><|vision_end|> that "
          "<|audio_start|><|audio_pad|><|audio_end|> <|im_end|>")


def check_against(reference, ours, image_token_id, audio_token_id):
    assert ours.ids == reference["input_ids"][0]
    np.testing.assert_array_equal(ours.images.pixel_values, reference["pixel_values"])
    np.testing.assert_array_equal(ours.images.grid_thw, reference["image_grid_thw"])
    mask = reference["feature_attention_mask"].astype(bool)
    assert ours.audio.lengths.tolist() == mask.sum(-1).tolist()
    for i, f in enumerate(ours.audio.features):  # transformers' torch STFT inside: its float32 rounding
        np.testing.assert_allclose(f, reference["input_features"][i][:, mask[i]], rtol=0, atol=5e-5)
    assert ours.ids.count(image_token_id) == sum(ours.images.token_counts)
    assert ours.ids.count(audio_token_id) == sum(ours.audio.token_counts)


def test_prompt_with_several_items_equals_qwen3omni_processor(hf_processor):
    from PIL import Image

    images, clips = [pixels(4, 37, 53), pixels(5, 20, 900)], [speechlike(6, 16007), speechlike(7, 40000)]
    reference = hf_processor(text=[PROMPT], images=[Image.fromarray(i) for i in images], audio=clips)
    tokens = {"image_token_id": hf_processor.image_token_id, "audio_token_id": hf_processor.audio_token_id}
    ids = hf_processor.tokenizer(PROMPT)["input_ids"]
    ours = prepare_prompt(ids, images=images, clips=clips, config=CONFIG, batch_padding=True, **tokens)
    check_against(reference, ours, **tokens)
    text = expand_prompt_text(PROMPT, image_token_counts=ours.images.token_counts,
                              audio_token_counts=ours.audio.token_counts)
    assert hf_processor.tokenizer(text)["input_ids"] == ours.ids
    alone = prepare_prompt(ids, images=images, clips=clips, config=CONFIG, **tokens)
    assert alone.audio.lengths.tolist() == [100, 250]  # the 16007-sample clip not padded by its neighbour


@pytest.mark.parametrize("n", CLIP_SAMPLES[:4])
def test_prompt_with_one_clip_equals_qwen3omni_processor(hf_processor, n):
    from PIL import Image

    prompt = ("<|im_start|> describe <|audio_start|><|audio_pad|><|audio_end|> "
              "<|vision_start|><|image_pad|><|vision_end|>")
    image, clip = pixels(n, 61, 45), speechlike(n, n)
    reference = hf_processor(text=[prompt], images=[Image.fromarray(image)], audio=[clip])
    tokens = {"image_token_id": hf_processor.image_token_id, "audio_token_id": hf_processor.audio_token_id}
    ours = prepare_prompt(hf_processor.tokenizer(prompt)["input_ids"], images=[image], clips=[clip], config=CONFIG,
                          **tokens)
    check_against(reference, ours, **tokens)


def test_placeholder_counts_must_match_the_items():
    with pytest.raises(ValueError, match="2 image placeholder.*1 image item"):
        expand_placeholders([5, 9, 9], image_token_id=9, audio_token_id=8, image_token_counts=[4])
    with pytest.raises(ValueError, match="0 audio placeholder.*1 audio item"):
        expand_placeholders([5, 9], image_token_id=9, audio_token_id=8, image_token_counts=[4],
                            audio_token_counts=[3])
    assert expand_placeholders([1, 9, 2, 8, 9], image_token_id=9, audio_token_id=8, image_token_counts=[2, 1],
                               audio_token_counts=[3]) == [1, 9, 9, 2, 8, 8, 8, 9]
    assert expand_prompt_text("a<A>b<I>", image_token="<I>", audio_token="<A>", image_token_counts=[2],
                              audio_token_counts=[1]) == "a<A>b<I><I>"
    with pytest.raises(ValueError, match="1 <I> placeholder"):
        expand_prompt_text("<I>", image_token="<I>", audio_token="<A>")


def test_processor_imports_no_torch():
    code = "import sys, models.qwen3_omni.processor; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
