"""Reading Qwen-Image checkpoints: the tiny one's random-weights marker, the published tokenizer files (vocab.json +
merges.txt, no tokenizer.json), and clear errors for a directory that is not the published layout.

A failure here points to models/qwen_image/checkpoint.py (the marker), pipeline.load_tokenizer, weights.py (layout
and tensor checks) or the config readers of transformer.py / scheduler.py.
"""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from models.qwen_image.checkpoint import RANDOM_MARKER, make_qwen_image_checkpoint
from models.qwen_image.family import QwenImage
from models.qwen_image.pipeline import PROMPT_TEMPLATE, load_tokenizer
from models.qwen_image.scheduler import FlowMatchSchedule
from models.qwen_image.transformer import TransformerConfig
from models.qwen_image.weights import check_layout, load_vae_decoder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_qwen_image_checkpoint(tmp_path_factory.mktemp("qwen-image") / "ckpt", seed=3)


def test_the_made_checkpoint_says_its_weights_are_random(tiny):
    assert json.loads((tiny / RANDOM_MARKER).read_text()) == {
        "weights": "random-test", "seed": 3, "made_by": "scripts/make_qwen_image_checkpoint.py"}


def test_the_published_tokenizer_files_tokenize_like_tokenizer_json(tiny, tmp_path):
    spec = json.loads((tiny / "tokenizer" / "tokenizer.json").read_text())["model"]
    published = tmp_path / "tokenizer"
    published.mkdir()
    (published / "vocab.json").write_text(json.dumps(spec["vocab"]))
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["merges"]]
    (published / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    shutil.copy(tiny / "tokenizer" / "tokenizer_config.json", published)
    text = PROMPT_TEMPLATE.format("a red fox, 3 cats & émigrés\nat dawn")
    assert load_tokenizer(published).encode(text).ids == load_tokenizer(tiny / "tokenizer").encode(text).ids


def test_a_directory_without_the_published_layout_names_what_is_missing(tiny, tmp_path):
    shutil.copytree(tiny, tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "ckpt" / "vae")
    with pytest.raises(FileNotFoundError, match=r"\['vae'\] missing"):
        check_layout(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match="not a Qwen-Image diffusers directory"):
        QwenImage(str(tmp_path / "ckpt")).prepare_weights()


def test_a_misshapen_tensor_is_named(tiny, tmp_path):
    shutil.copytree(tiny / "vae", tmp_path / "vae")
    file = tmp_path / "vae" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(file)
    tensors["decoder.conv_out.bias"] = tensors["decoder.conv_out.bias"][:2]
    save_file(tensors, file)
    with pytest.raises(ValueError, match="decoder.conv_out.bias has shape"):
        load_vae_decoder(tmp_path / "vae")


def test_configs_asking_for_what_is_not_implemented_are_refused(tmp_path):
    with pytest.raises(ValueError, match="guidance_embeds"):
        TransformerConfig.from_dict({"guidance_embeds": True})
    (tmp_path / "scheduler_config.json").write_text(json.dumps({"use_karras_sigmas": True}))
    with pytest.raises(ValueError, match="use_karras_sigmas"):
        FlowMatchSchedule.from_config(tmp_path)


def test_the_text_encoder_config_reads_both_layouts():
    from models.qwen_image.text_encoder import TextConfig

    flat = {"vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
            "num_attention_heads": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}  # as transformers 4.5x wrote it
    nested = {"text_config": {**flat, "rope_theta": None, "rope_parameters": {"rope_theta": 1000000.0}}}
    assert TextConfig.from_hf(flat) == TextConfig.from_hf(nested) and TextConfig.from_hf(flat).head_dim == 128
    with pytest.raises(ValueError, match="use_sliding_window"):
        TextConfig.from_hf({**flat, "use_sliding_window": True})


def test_model_kwargs_are_checked(tiny):
    with pytest.raises(ValueError, match=r"model_kwargs \(default_size.*width must be a multiple of 8"):
        QwenImage(str(tiny), default_size="36x32").load_frontend()
    with pytest.raises(ValueError, match=r"unknown keys \['sizes'\]"):
        QwenImage(None, sizes=[1])
    with pytest.raises(ValueError, match="default_size must be WIDTHxHEIGHT"):
        QwenImage(None, default_size="big")


def test_a_bfloat16_checkpoint_loads_into_float32_with_its_stored_values(tmp_path, monkeypatch):
    """The published checkpoint (and ``--make full``) stores bfloat16: the family loads it into whatever dtype it runs
    in, and the values are the stored ones."""
    import torch

    import models.qwen_image.checkpoint as checkpoint
    from models.qwen_image.weights import load_transformer

    monkeypatch.setitem(checkpoint.LAYOUTS, "tiny", {**checkpoint.LAYOUTS["tiny"], "dtype": torch.bfloat16})
    root = make_qwen_image_checkpoint(tmp_path / "bf16", seed=3)
    stored = load_file(next((root / "transformer").glob("*00001-of-*.safetensors")))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    model = load_transformer(root / "transformer", "cpu", torch.float32)
    params = dict(model.named_parameters())
    name = next(n for n, t in stored.items() if t.dim() == 2 and n in params)
    assert params[name].dtype == torch.float32 and torch.equal(params[name], stored[name].float())
