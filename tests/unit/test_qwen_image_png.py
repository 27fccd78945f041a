"""to_uint8 against diffusers' image post-processing, and encode_png read back by Pillow.

A failure here points to models/qwen_image/png.py: the [-1, 1] -> [0, 255] mapping or its rounding (half to
even, as numpy), the channel order, or the PNG chunk layout / CRCs / row filter bytes.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from models.qwen_image.png import encode_png, to_uint8

diffusers = pytest.importorskip("diffusers")
Image = pytest.importorskip("PIL.Image")


def _images() -> torch.Tensor:
    """(2, 3, 16, 24) random images plus out-of-range values and values that land on k + 0.5 after scaling."""
    x = torch.randn(2, 3, 16, 24, generator=torch.Generator().manual_seed(0)) * 0.7
    x[0, 0, 0, :4] = torch.tensor([-3.0, 3.0, -1.0, 1.0])
    halves = torch.arange(24, dtype=torch.float32) * 11 + 0.5  # k + 0.5 in [0, 255], k odd and even
    x[1, 1, 0, :] = halves / 127.5 - 1  # (x * 0.5 + 0.5) * 255 lands on or next to k + 0.5
    return x


def test_to_uint8_equals_diffusers_postprocess() -> None:
    images = _images()
    ours = to_uint8(images)
    assert ours.shape == (2, 16, 24, 3) and ours.dtype == torch.uint8
    pils = diffusers.image_processor.VaeImageProcessor().postprocess(images, output_type="pil")
    for i, pil in enumerate(pils):
        assert np.array_equal(ours[i].numpy(), np.asarray(pil)), f"image {i}"
    assert to_uint8(images[1]).equal(ours[1])  # a single (3, H, W) image


def test_to_uint8_rejects_nan() -> None:
    with pytest.raises(ValueError, match="NaN"):
        to_uint8(torch.full((3, 2, 2), float("nan")))


@pytest.mark.parametrize("shape", [(1, 1), (16, 24), (37, 5)])
def test_png_decodes_to_the_same_pixels(shape) -> None:
    rgb = torch.randint(0, 256, (*shape, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    data = encode_png(rgb)
    assert data == encode_png(rgb.clone())  # deterministic bytes
    with Image.open(io.BytesIO(data)) as img:
        img.load()  # verifies every CRC and the zlib stream
        assert img.mode == "RGB" and img.size == (shape[1], shape[0])
        assert np.array_equal(np.asarray(img), rgb.numpy())


def test_png_rejects_wrong_dtype() -> None:
    with pytest.raises(ValueError, match="uint8"):
        encode_png(torch.zeros(4, 4, 3))
