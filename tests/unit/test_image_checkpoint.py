"""make_image_checkpoint's writer -> our loaders (and diffusers'), then one tiny text-to-image pass.

A failure here points to models/image/checkpoint.py (names, shapes or config.json fields that our loaders
or diffusers' AutoencoderKL do not accept; non-deterministic weights; random weights that blow up) or to
the loaders in models/image/weights.py. The last test runs every component in order, as the runtime will.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from models.image.checkpoint import write_image_checkpoint
from models.image.denoiser import preset
from models.image.png import encode_png, to_uint8
from models.image.scheduler import FlowMatchEuler, cfg_combine
from models.image.weights import load_denoiser, load_vae_decoder

pytestmark = pytest.mark.usefixtures("one_intraop_thread")

TEXT_DIM = 48


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_image_checkpoint(tmp_path_factory.mktemp("image") / "tiny", size="tiny", seed=0, text_dim=TEXT_DIM)


def test_writer_is_deterministic(ckpt, tmp_path) -> None:
    again = write_image_checkpoint(tmp_path / "again", size="tiny", seed=0, text_dim=TEXT_DIM)
    other = write_image_checkpoint(tmp_path / "other", size="tiny", seed=1, text_dim=TEXT_DIM)
    for file in ("transformer/model.safetensors", "vae/diffusion_pytorch_model.safetensors"):
        assert (ckpt / file).read_bytes() == (again / file).read_bytes(), file
        assert (ckpt / file).read_bytes() != (other / file).read_bytes(), file


def test_loaders_round_trip(ckpt) -> None:
    denoiser = load_denoiser(ckpt / "transformer")
    assert denoiser.config == preset("tiny", text_dim=TEXT_DIM)
    written = load_file(ckpt / "transformer" / "model.safetensors")
    loaded = denoiser.state_dict()
    assert written.keys() == loaded.keys()
    assert all(torch.equal(written[k], loaded[k]) for k in written)
    vae = load_vae_decoder(ckpt / "vae")
    written = load_file(ckpt / "vae" / "diffusion_pytorch_model.safetensors")
    assert {k for k in written if not k.startswith(("encoder.", "quant_conv."))} == vae.state_dict().keys()
    scheduler = FlowMatchEuler.from_config(ckpt / "scheduler")
    assert (scheduler.num_train_timesteps, scheduler.shift) == (1000, 3.0)


def test_diffusers_loads_the_written_vae(ckpt) -> None:
    diffusers = pytest.importorskip("diffusers")
    ref, info = diffusers.AutoencoderKL.from_pretrained(ckpt / "vae", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    latents = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(load_vae_decoder(ckpt / "vae").decode(latents),
                                   ref.decode(latents / ref.config.scaling_factor).sample, rtol=1e-4, atol=1e-5)


def test_tiny_text_to_image_gives_a_finite_png(ckpt) -> None:
    """64x64 image from 32x32x4 latents, 2 Euler steps with CFG run as one batch of [cond; uncond]."""
    denoiser, vae = load_denoiser(ckpt / "transformer"), load_vae_decoder(ckpt / "vae")
    scheduler = FlowMatchEuler.from_config(ckpt / "scheduler")
    g = torch.Generator().manual_seed(0)
    text = torch.randn(1, 3, TEXT_DIM, generator=g).expand(2, -1, -1)  # stand-in for LLM hidden states
    mask = torch.tensor([[True] * 3, [False] * 3])  # row 1: unconditional
    x = torch.randn(1, 4, 32, 32, generator=g)
    sigmas, timesteps = scheduler.sigmas(2), scheduler.timesteps(2)
    with torch.no_grad():
        for i in range(2):
            v_cond, v_uncond = denoiser(torch.cat([x, x]), timesteps[i], text, mask).chunk(2)
            x = scheduler.step(cfg_combine(v_cond, v_uncond, 4.0), sigmas[i], sigmas[i + 1], x)
        image = vae.decode(x)  # (1, 3, 64, 64)
    assert image.shape == (1, 3, 64, 64) and torch.isfinite(image).all()
    png = encode_png(to_uint8(image[0]))
    assert png.startswith(b"\x89PNG") and len(png) > 64 * 64  # noise does not compress
