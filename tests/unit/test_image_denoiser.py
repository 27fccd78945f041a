"""The DiT denoiser: embeddings against diffusers, shapes, determinism, batching and the conditioning contract.

A failure here points to models/image/denoiser.py: the timestep or position features (parity tests), the
patchify/unpatchify round trip (shape tests), batch-dependent computation (batch tests), or the null-token /
key-padding-mask contract that classifier-free guidance relies on (conditioning tests).
"""

from __future__ import annotations

import pytest
import torch

from models.image.checkpoint import randomize_
from models.image.denoiser import Denoiser, preset, sincos_pos_embed_2d, timestep_embedding

pytestmark = pytest.mark.usefixtures("one_intraop_thread")

TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def model() -> Denoiser:
    with torch.device("meta"):
        m = Denoiser(preset("tiny", text_dim=32))
    return randomize_(m, seed=0)


def _inputs(batch: int = 2, size: int = 16, tokens: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, size, size, generator=g)  # (B, C, h, w)
    t = torch.rand(batch, generator=g) * 1000
    text = torch.randn(batch, tokens, 32, generator=g)  # (B, T, text_dim)
    return x, t, text


def test_timestep_embedding_equals_diffusers() -> None:
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    t = torch.tensor([0.0, 1.0, 17.5, 999.0])
    ref = embeddings.get_timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0)
    assert torch.equal(timestep_embedding(t, 256), ref)


def test_pos_embed_equals_diffusers() -> None:
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    ref = embeddings.get_2d_sincos_pos_embed(64, (6, 6), base_size=6, output_type="pt").float()
    assert torch.equal(sincos_pos_embed_2d(64, 6, 6), ref)


def test_velocity_has_the_latent_shape(model) -> None:
    x, t, text = _inputs(size=12)
    x = x[..., :10]  # non-square latents
    v = model(x, t, text)
    assert v.shape == x.shape and v.dtype == x.dtype and torch.isfinite(v).all()
    with pytest.raises(ValueError, match="multiples of 2"):
        model(x[..., :9], t, text)


def test_same_inputs_give_identical_bytes(model) -> None:
    x, t, text = _inputs()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(model(x, t, text, mask), model(x.clone(), t.clone(), text.clone(), mask.clone()))


def test_batch_of_two_equals_two_batches_of_one(model) -> None:
    x, t, text = _inputs()
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    both = model(x, t, text, mask)
    for i in range(2):
        torch.testing.assert_close(both[i:i + 1], model(x[i:i + 1], t[i:i + 1], text[i:i + 1], mask[i:i + 1]), **TOL)


def test_scalar_timestep_broadcasts(model) -> None:
    x, _, text = _inputs()
    torch.testing.assert_close(model(x, 500.0, text), model(x, torch.tensor([500.0, 500.0]), text), **TOL)


def test_padding_tokens_are_ignored(model) -> None:
    x, t, text = _inputs(tokens=3)
    padded = torch.cat([text, torch.randn(2, 4, 32)], dim=1)  # (B, 7, text_dim), last 4 are padding
    mask = torch.tensor([[1] * 3 + [0] * 4] * 2)
    torch.testing.assert_close(model(x, t, padded, mask), model(x, t, text), **TOL)


def test_unconditional_is_the_null_token_and_batches_with_conditional(model) -> None:
    """CFG in one batch: rows with an all-False mask are the text=None branch."""
    x, t, text = _inputs(batch=1)
    cond, uncond = model(x, t, text), model(x, t, None)
    assert not torch.allclose(cond, uncond)  # the text reaches the output
    batched = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([text, text]),
                    torch.tensor([[True] * 5, [False] * 5]))
    torch.testing.assert_close(batched[:1], cond, **TOL)
    torch.testing.assert_close(batched[1:], uncond, **TOL)


def test_prepared_text_is_reusable(model) -> None:
    x, t, text = _inputs()
    ctx, ctx_mask = model.prepare_text(text, None, batch=2)
    assert torch.equal(model.denoise(x, t, ctx, ctx_mask), model(x, t, text))


def test_1b_preset_has_a_billion_parameters_without_allocating() -> None:
    with torch.device("meta"):
        big = Denoiser(preset("1b", text_dim=64))
    params = list(big.parameters())
    assert all(p.is_meta for p in params)
    assert sum(p.numel() for p in params) == 1_125_523_520 >= 1e9
