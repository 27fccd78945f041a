"""Qwen-Image's networks against the references on small random configs: diffusers' QwenImageTransformer2DModel,
AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler and QwenImagePipeline, transformers'
Qwen2_5_VLForConditionalGeneration. The reference model is built with its own random init, saved with
save_pretrained and read back by our loader, so the names and layouts of real files are checked too.

A failure here points to models/qwen_image/: transformer.py (RoPE centring, adaLN order, joint attention),
vae.py (the single-frame causal convs, the channel RMS norm, the upsampling), text_encoder.py (RoPE, GQA, the
final norm), scheduler.py (the dynamic shift, shift_terminal, the Euler step or the norm-rescaled CFG),
pipeline.py (template, dropped prefix, packing) or weights.py (names, shards).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from models.qwen_image.checkpoint import SCHEDULER, make_qwen_image_checkpoint  # noqa: E402
from models.qwen_image.pipeline import (DROP_IDX, PROMPT_TEMPLATE, Networks, generate, initial_noise,  # noqa: E402
                                        load_tokenizer, prompt_ids, unpack)
from models.qwen_image.png import to_uint8  # noqa: E402
from models.qwen_image.scheduler import FlowMatchSchedule  # noqa: E402
from models.qwen_image.weights import load_text_encoder, load_transformer, load_vae_decoder  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_qwen_image_checkpoint(tmp_path_factory.mktemp("qwen-image") / "ckpt", seed=0)


def test_transformer_output_matches_diffusers(tmp_path):
    torch.manual_seed(0)
    ref = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, axes_dims_rope=(4, 6, 6)).eval()
    with torch.no_grad():  # the random init leaves the output projections at zero: give every tensor values
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    ours = load_transformer(tmp_path)
    for h, w, t_len in [(4, 6, 5), (3, 5, 7)]:  # odd sizes: the centred RoPE's halves differ
        x, text = torch.randn(1, h * w, 16), torch.randn(1, t_len, 24)
        t = torch.tensor([0.73])
        with torch.no_grad():
            expect = ref(hidden_states=x, encoder_hidden_states=text, timestep=t, img_shapes=[[(1, h, w)]],
                         return_dict=False)[0]
            got = ours(x, t, text, h, w)
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


def test_vae_decode_matches_diffusers(tmp_path):
    torch.manual_seed(1)
    ref = diffusers.AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 2], num_res_blocks=1,
                                           temperal_downsample=[False, True]).eval()
    ref.save_pretrained(tmp_path)
    ours = load_vae_decoder(tmp_path)
    z = torch.randn(1, 16, 6, 5)
    mean = torch.tensor(ref.config.latents_mean).view(1, 16, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(ref.config.latents_std).view(1, 16, 1, 1, 1)
    with torch.no_grad():
        expect = ref.decode(z[:, :, None] / inv_std + mean, return_dict=False)[0][:, :, 0]
        got = ours.decode(z)
    assert got.shape == (1, 3, 24, 20)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


def test_text_encoder_hidden_states_match_transformers(tmp_path):
    torch.manual_seed(2)
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32))
    ref = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    ref.save_pretrained(tmp_path, max_shard_size="50KB")
    ours = load_text_encoder(tmp_path)
    ids = torch.randint(0, 96, (1, 19))
    with torch.no_grad():
        expect = ref(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True).hidden_states[-1]
        got = ours(ids)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", [SCHEDULER, {**SCHEDULER, "time_shift_type": "linear", "shift_terminal": None},
                                    {"num_train_timesteps": 1000, "shift": 3.0}])
def test_scheduler_timesteps_and_sigmas_equal_diffusers(tmp_path, config):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    (tmp_path / "scheduler_config.json").write_text(__import__("json").dumps(config))
    ours = FlowMatchSchedule.from_config(tmp_path)
    ref = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(tmp_path)
    for steps, seq in [(1, 16), (2, 64), (4, 256), (9, 1000), (50, 6889)]:
        if steps < ours.min_steps:  # diffusers divides by zero there (NaN sigmas); we refuse
            with pytest.raises(ValueError, match="steps must be at least 2"):
                ours.sigmas(steps, seq)
            continue
        mu = calculate_shift(seq, ref.config.get("base_image_seq_len", 256), ref.config.get("max_image_seq_len", 4096),
                             ref.config.get("base_shift", 0.5), ref.config.get("max_shift", 1.15))
        ref.set_timesteps(steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        assert torch.equal(ours.sigmas(steps, seq), ref.sigmas)
        assert torch.equal(ours.timesteps(steps, seq), ref.timesteps)


def _reference_pipeline(root):
    pipe = diffusers.QwenImagePipeline.from_pretrained(root)  # float32, as saved
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _ours(root):
    return Networks(load_text_encoder(root / "text_encoder"), load_transformer(root / "transformer"),
                    load_vae_decoder(root / "vae"), FlowMatchSchedule.from_config(root / "scheduler"))


@pytest.fixture(scope="module")
def one_step(tiny, tmp_path_factory):
    """The tiny checkpoint without shift_terminal, where a single step is defined (it divides by zero there)."""
    import json
    import shutil

    root = tmp_path_factory.mktemp("one-step") / "ckpt"
    shutil.copytree(tiny, root)
    config = json.loads((root / "scheduler" / "scheduler_config.json").read_text())
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps({**config, "shift_terminal": None}))
    return root


@pytest.mark.parametrize("steps, scale, size, root", [
    (1, 4.0, (32, 48), "one_step"), (2, 4.0, (32, 48), "tiny"), (3, 2.5, (40, 24), "tiny"),
    (2, 1.0, (32, 32), "tiny")])
def test_denoising_and_the_picture_match_the_diffusers_pipeline(request, steps, scale, size, root):
    """One full denoising step, and two and three (one step is undefined under the published shift_terminal): the
    template, the dropped prefix, both prompts, true CFG with the norm rescale, the shifted schedule, the Euler
    step, the VAE and the PNG's pixels."""
    root = request.getfixturevalue(root)
    pipe, nets = _reference_pipeline(root), _ours(root)
    tok = load_tokenizer(root / "tokenizer")
    width, height = size
    h, w = height // 4, width // 4  # the tiny VAE's scale factor
    noise = initial_noise(torch.Generator().manual_seed(5), 16, h, w)
    kwargs = dict(prompt="a red fox in the snow", negative_prompt=" ", true_cfg_scale=scale, height=height,
                  width=width, num_inference_steps=steps, latents=noise.clone())
    with torch.no_grad():
        latents = pipe(**kwargs, output_type="latent").images
        expect = pipe(**kwargs, output_type="np").images[0]
    ids = prompt_ids(tok, "a red fox in the snow"), prompt_ids(tok, " ")
    got = generate(nets, *ids, noise, h, w, steps, scale)
    # the latents before the VAE, through the same loop
    nets_latents = _loop_latents(nets, *ids, noise, h, w, steps, scale)
    torch.testing.assert_close(nets_latents, latents, rtol=1e-5, atol=1e-5)
    assert np.array_equal(to_uint8(got[0]).numpy(), (expect * 255).round().astype("uint8"))


def _loop_latents(nets, cond_ids, neg_ids, noise, h, w, steps, scale):
    class Identity(torch.nn.Module):
        def decode(self, x):
            return x

    from models.qwen_image.pipeline import pack

    return pack(generate(Networks(nets.text_encoder, nets.transformer, Identity(), nets.schedule),
                         cond_ids, neg_ids, noise, h, w, steps, scale))


def test_the_tiny_checkpoint_loads_in_diffusers_and_transformers_with_no_missing_keys(tiny):
    for cls, sub in [(diffusers.QwenImageTransformer2DModel, "transformer"),
                     (diffusers.AutoencoderKLQwenImage, "vae"),
                     (transformers.Qwen2_5_VLForConditionalGeneration, "text_encoder")]:
        _, info = cls.from_pretrained(tiny / sub, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (sub, info)
    hf = transformers.AutoTokenizer.from_pretrained(tiny / "tokenizer")
    ours = load_tokenizer(tiny / "tokenizer")
    text = PROMPT_TEMPLATE.format("a red fox, 3 cats & émigrés")
    assert hf(text).input_ids == ours.encode(text).ids
    assert len(ours.encode(PROMPT_TEMPLATE.split("{}")[0]).ids) == DROP_IDX  # as in Qwen's vocabulary


def test_unpack_inverts_pack():
    from models.qwen_image.pipeline import pack

    x = torch.randn(1, 16, 6, 4)
    assert torch.equal(unpack(pack(x), 6, 4), x)
