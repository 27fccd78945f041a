"""Image bytes (PNG, JPEG, WebP) -> an RGB array, with limits checked before pixels are decoded. No torch.

``decode_image`` returns numpy ``uint8`` of shape ``(H, W, 3)``, RGB, rows top to bottom: what a model's image
processor reads (a plain array crosses processes and needs no Pillow on the other side). Two conversions happen on
the way, both as the reference pipelines do them:
- the EXIF orientation tag is applied (transformers' ``load_image`` does the same), so a phone photo comes upright;
- transparency is composited onto white (transformers' image processors do this when they convert to RGB), so a
  transparent PNG does not turn black where it is see-through.

Order of checks, cheapest first: byte count, container kind from the magic bytes (only the matching Pillow plugin
parses the data), the header's width x height against ``max_pixels`` (a small file can claim a huge canvas: a
decompression bomb), and only then the pixel data, where a truncated or corrupt file fails.
"""

from __future__ import annotations

import io
import threading
import warnings

import numpy as np
from PIL import Image, ImageOps

from mstar_dist.media.errors import MediaError, check_size
from mstar_dist.media.sniff import describe, sniff

PILLOW_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
"""Container kind (``media.sniff``) -> the Pillow plugin that decodes it: the image formats the server accepts."""

_BOMB_FILTER_LOCK = threading.Lock()
"""Serialises the warnings filter that turns Pillow's DecompressionBombWarning into an error: ``catch_warnings``
swaps the process's filter list, and two threads swapping it at once could leave one's filter installed."""


def decode_image(data: bytes, *, max_bytes: int, max_pixels: int) -> np.ndarray:
    """Decode one PNG, JPEG or WebP file to RGB: numpy ``uint8``, shape ``(H, W, 3)`` (upright, alpha on white).

    The first frame of an animated file is taken. Raises MediaError when the data is empty or over ``max_bytes``,
    is not an image, is an image format other than these three, claims more than ``max_pixels`` pixels (checked on
    the header, before decoding), trips Pillow's own decompression-bomb limit (``PIL.Image.MAX_IMAGE_PIXELS``, which
    applies when ``max_pixels`` is above it), or is truncated or corrupt.
    """
    if max_pixels <= 0:
        raise ValueError(f"max_pixels must be > 0, got {max_pixels}")
    check_size(data, what="image", max_bytes=max_bytes)
    kind = sniff(data)
    if kind not in PILLOW_FORMATS:
        found = f"it is {describe(kind)}" if kind else "its first bytes match no image format"
        raise MediaError(f"the image is not PNG, JPEG or WebP ({found}); send one of those")
    image = _open(data, kind, max_pixels)
    width, height = image.size
    if width * height > max_pixels:
        raise MediaError(f"the image is {width}x{height} = {width * height} pixels, over the limit max_pixels = "
                         f"{max_pixels}; send a smaller image", limit="max_pixels", limit_value=max_pixels)
    try:
        image.load()
        rgb = to_rgb(ImageOps.exif_transpose(image))
    except Exception as e:  # a decoder on untrusted bytes fails in many types: OSError, struct.error, zlib.error...
        raise MediaError(f"the {kind.upper()} image is truncated or corrupt ({e}); send the whole file") from e
    return np.asarray(rgb, dtype=np.uint8)


def _open(data: bytes, kind: str, max_pixels: int) -> Image.Image:
    """Parse the header with the one plugin of ``kind``; Pillow's bomb warning and error become MediaError (Pillow
    raises them while opening, before the size is ours to check)."""
    name = kind.upper()
    with _BOMB_FILTER_LOCK, warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=[PILLOW_FORMATS[kind]])
        except (Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
            # Pillow checks the header's size before ours can; name the tighter of the two limits
            limit = min(max_pixels, Image.MAX_IMAGE_PIXELS or max_pixels)
            whose = "max_pixels" if limit == max_pixels else "Pillow's PIL.Image.MAX_IMAGE_PIXELS"
            raise MediaError(f"the image has more pixels than the limit {whose} = {limit} ({e}); send a smaller "
                             f"image", limit="max_pixels", limit_value=limit) from e
        except Exception as e:  # UnidentifiedImageError, OSError, SyntaxError, struct.error... from a bad header
            raise MediaError(f"the data starts like a {name} file but does not parse ({e}): it is truncated or "
                             f"corrupt; send a valid {name} file") from e
    if min(image.size) <= 0:
        raise MediaError(f"the {name} image has no pixels (size {image.size[0]}x{image.size[1]})")
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """An RGB copy of ``image``; any transparency (an alpha band, or a palette's or a grey image's transparent
    colour) is composited onto opaque white, as transformers' ``convert_to_rgb`` does."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")
