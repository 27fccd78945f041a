"""VaeDecoder against diffusers' AutoencoderKL: same checkpoint directory, same latents, same images.

A failure here points to models/image/vae.py (layer order, GroupNorm groups/eps, the mid-block attention,
the upsampling, the scaling/shift applied before decoding) or to the loader in models/image/weights.py
(names, skipped encoder tensors, legacy attention names).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.image.weights import load_vae_decoder

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.usefixtures("one_intraop_thread")

SD_LIKE = dict(block_out_channels=(32, 64), layers_per_block=1, latent_channels=4, norm_num_groups=8,
               scaling_factor=0.5)
FLUX_LIKE = dict(block_out_channels=(16, 32, 32), layers_per_block=2, latent_channels=8, norm_num_groups=8,
                 scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)


def _save_reference(tmp_path, **config):
    """A diffusers AutoencoderKL with seeded, perturbed weights (so every tensor matters), saved to tmp_path."""
    torch.manual_seed(0)
    n = len(config["block_out_channels"])
    vae = diffusers.AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * n,
                                  up_block_types=("UpDecoderBlock2D",) * n, **config).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.1 * torch.randn_like(p))
    vae.save_pretrained(tmp_path)
    return vae


def _reference_decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """What diffusers' SD3/Flux pipelines do with the denoiser's final latents."""
    shift = vae.config.shift_factor or 0.0
    with torch.no_grad():
        return vae.decode(latents / vae.config.scaling_factor + shift).sample


@pytest.mark.parametrize("config", [SD_LIKE, FLUX_LIKE], ids=["sd", "flux"])
def test_decode_equals_diffusers(tmp_path, config) -> None:
    ref = _save_reference(tmp_path, **config)
    ours = load_vae_decoder(tmp_path)
    latents = torch.randn(2, config["latent_channels"], 8, 12, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        image = ours.decode(latents)
    factor = 2 ** (len(config["block_out_channels"]) - 1)
    assert image.shape == (2, 3, 8 * factor, 12 * factor)
    torch.testing.assert_close(image, _reference_decode(ref, latents), rtol=1e-4, atol=1e-5)


def test_legacy_attention_names_load(tmp_path) -> None:
    ref = _save_reference(tmp_path, **SD_LIKE)
    file = tmp_path / "diffusion_pytorch_model.safetensors"
    renames = {".to_q.": ".query.", ".to_k.": ".key.", ".to_v.": ".value.", ".to_out.0.": ".proj_attn."}
    state = load_file(file)
    for name in [n for n in state if ".attentions." in n]:
        new = name
        for a, b in renames.items():
            new = new.replace(a, b)
        state[new] = state.pop(name)
    save_file(state, file)
    latents = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(load_vae_decoder(tmp_path).decode(latents), _reference_decode(ref, latents),
                                   rtol=1e-4, atol=1e-5)


def test_missing_tensor_is_named(tmp_path) -> None:
    _save_reference(tmp_path, **SD_LIKE)
    file = tmp_path / "diffusion_pytorch_model.safetensors"
    state = load_file(file)
    del state["decoder.conv_out.weight"]
    save_file(state, file)
    with pytest.raises(ValueError, match="decoder.conv_out.weight"):
        load_vae_decoder(tmp_path)
