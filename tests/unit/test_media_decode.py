"""Decoding the media a request carries (``mstar_dist.media.image``, ``mstar_dist.media.audio``), on files written here.

A failure means a client's PNG/JPEG/WebP or WAV/MP3/FLAC/OGG no longer decodes to the pixels or samples the reference
pipelines (Pillow as transformers drives it, transformers' ``load_audio`` / librosa) get, audio reaches the model at
the wrong rate or pitch, or bad input (not media, truncated, corrupt, the wrong ``format``, over a limit, a
decompression bomb) is not a MediaError that says what to fix and names the limit: a 500, a hang, or a worker out of
memory instead of a 400.
"""

from __future__ import annotations

import base64
import io
import math
import struct
import subprocess
import sys
import warnings
import zlib

import numpy as np
import pytest

Image = pytest.importorskip("PIL.Image")
soundfile = pytest.importorskip("soundfile")
pytest.importorskip("soxr")

from PIL import ImageOps  # noqa: E402

from mstar_dist.media.audio import AUDIO_FORMATS, decode_audio, resample  # noqa: E402
from mstar_dist.media.errors import MediaError  # noqa: E402
from mstar_dist.media.image import decode_image  # noqa: E402
from mstar_dist.media.sniff import sniff  # noqa: E402

BIG = 10**9
SUBTYPES = {"wav": "PCM_16", "flac": "PCM_16", "ogg": "VORBIS", "mp3": "MPEG_LAYER_III"}


def image_bytes(array: np.ndarray, fmt: str, **save) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format=fmt, **save)
    return out.getvalue()


def audio_bytes(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    if fmt == "mp3" and "MP3" not in soundfile.available_formats():
        pytest.skip("this libsndfile cannot write MP3")
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format=fmt.upper(), subtype=SUBTYPES[fmt])
    return out.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height`` RGB pixels, followed by a few bytes of pixel data."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


def rgb(seed: int, h: int = 23, w: int = 37) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8)


def tone(freq: float, rate: int, seconds: float, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


# --- images -----------------------------------------------------------------------------------------------------


def test_png_decodes_to_its_exact_pixels_as_uint8_hwc_rgb():
    src = rgb(0)
    out = decode_image(image_bytes(src, "PNG"), max_bytes=BIG, max_pixels=BIG)
    assert out.dtype == np.uint8 and out.shape == (23, 37, 3)
    np.testing.assert_array_equal(out, src)


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP"])
def test_lossy_formats_decode_to_pillows_pixels(fmt):
    data = image_bytes(rgb(1), fmt, quality=90)
    expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    np.testing.assert_array_equal(decode_image(data, max_bytes=BIG, max_pixels=BIG), expected)


def test_transparency_is_composited_onto_white():
    rgba = np.zeros((2, 3, 4), dtype=np.uint8)
    rgba[0, 0] = (10, 20, 30, 0)      # fully transparent: white
    rgba[0, 1] = (10, 20, 30, 255)    # opaque: itself
    rgba[0, 2] = (0, 0, 0, 128)       # half: grey
    out = decode_image(image_bytes(rgba, "PNG"), max_bytes=BIG, max_pixels=BIG)
    assert tuple(out[0, 0]) == (255, 255, 255)
    assert tuple(out[0, 1]) == (10, 20, 30)
    assert all(120 <= v <= 135 for v in out[0, 2])
    palette = Image.fromarray(np.array([[0, 1]], dtype=np.uint8), mode="P")
    palette.putpalette([200, 0, 0, 0, 0, 200] + [0] * 762)
    buf = io.BytesIO()
    palette.save(buf, format="PNG", transparency=0)
    out = decode_image(buf.getvalue(), max_bytes=BIG, max_pixels=BIG)
    assert tuple(out[0, 0]) == (255, 255, 255) and tuple(out[0, 1]) == (0, 0, 200)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P", "CMYK"])
def test_colour_conversion_equals_transformers(mode):
    image_transforms = pytest.importorskip("transformers.image_transforms")
    rs = np.random.RandomState(2)
    bands = {"RGBA": 4, "LA": 2, "L": 1, "P": 1, "CMYK": 4}[mode]
    array = rs.randint(0, 256, (9, 13, bands) if bands > 1 else (9, 13), dtype=np.uint8)
    image = Image.fromarray(array)  # L, LA or RGBA by the band count
    image = image.convert(mode) if mode != image.mode else image
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    reference = image_transforms.convert_to_rgb(Image.open(io.BytesIO(buf.getvalue())), return_numpy=True)
    np.testing.assert_array_equal(decode_image(buf.getvalue(), max_bytes=BIG, max_pixels=BIG), reference)


def test_exif_orientation_is_applied():
    src = rgb(3, h=8, w=16)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    data = image_bytes(src, "JPEG", exif=exif.tobytes(), quality=95)
    out = decode_image(data, max_bytes=BIG, max_pixels=BIG)
    assert out.shape == (16, 8, 3)
    np.testing.assert_array_equal(out, np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data)))))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_truncated_image_is_a_media_error(fmt):
    data = image_bytes(rgb(4, h=64, w=64), fmt)
    for cut in (len(data) // 2, 24):
        with pytest.raises(MediaError, match="truncated or corrupt"):
            decode_image(data[:cut], max_bytes=BIG, max_pixels=BIG)


def test_corrupt_png_is_a_media_error():
    data = bytearray(image_bytes(rgb(5, h=64, w=64), "PNG"))
    start = data.index(b"IDAT") + 4
    data[start + 10:start + 60] = bytes(range(50))
    with pytest.raises(MediaError, match="truncated or corrupt"):
        decode_image(bytes(data), max_bytes=BIG, max_pixels=BIG)


def test_not_an_image_says_what_it_is():
    with pytest.raises(MediaError, match="match no image format"):
        decode_image(b"this is plain text, not a picture", max_bytes=BIG, max_pixels=BIG)
    with pytest.raises(MediaError, match="it is WAV audio"):
        decode_image(audio_bytes(tone(440, 16000, 0.1), 16000, "wav"), max_bytes=BIG, max_pixels=BIG)
    with pytest.raises(MediaError, match="empty"):
        decode_image(b"", max_bytes=BIG, max_pixels=BIG)


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "TIFF"])
def test_other_image_formats_are_refused_by_name(fmt):
    with pytest.raises(MediaError, match=f"not PNG, JPEG or WebP \\(it is a {fmt} image\\)"):
        decode_image(image_bytes(rgb(6), fmt), max_bytes=BIG, max_pixels=BIG)


def test_image_over_max_bytes_names_the_limit():
    data = image_bytes(rgb(7), "PNG")
    assert decode_image(data, max_bytes=len(data), max_pixels=BIG).shape == (23, 37, 3)
    with pytest.raises(MediaError, match=f"max_bytes = {len(data) - 1}") as e:
        decode_image(data, max_bytes=len(data) - 1, max_pixels=BIG)
    assert (e.value.limit, e.value.limit_value) == ("max_bytes", len(data) - 1)


def test_image_over_max_pixels_is_refused_on_its_header():
    """The file holds a few bytes of pixels for a 5000x5000 canvas: the header's size is refused first (decoding
    would report truncation instead)."""
    data = png_claiming(5000, 5000)
    with pytest.raises(MediaError, match="5000x5000 = 25000000 pixels.*max_pixels = 1000000") as e:
        decode_image(data, max_bytes=BIG, max_pixels=1_000_000)
    assert (e.value.limit, e.value.limit_value) == ("max_pixels", 1_000_000)
    src = rgb(8)
    assert decode_image(image_bytes(src, "PNG"), max_bytes=BIG, max_pixels=23 * 37).shape == (23, 37, 3)
    with pytest.raises(MediaError, match="max_pixels"):
        decode_image(image_bytes(src, "PNG"), max_bytes=BIG, max_pixels=23 * 37 - 1)


@pytest.mark.parametrize("side", [10_000, 20_000])  # over Pillow's warning limit; over its error limit
def test_pillows_decompression_bomb_check_becomes_a_media_error(side):
    data = png_claiming(side, side)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(MediaError, match="max_pixels = 1000000") as e:
            decode_image(data, max_bytes=BIG, max_pixels=1_000_000)
        assert e.value.limit == "max_pixels"
        with pytest.raises(MediaError, match=f"MAX_IMAGE_PIXELS = {Image.MAX_IMAGE_PIXELS}"):
            decode_image(data, max_bytes=BIG, max_pixels=10**12)
    assert not [w for w in seen if issubclass(w.category, Image.DecompressionBombWarning)]


# --- audio ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", AUDIO_FORMATS)
def test_each_format_decodes_to_mono_float32(fmt):
    src = tone(440, 16000, 1.0)
    out = decode_audio(audio_bytes(src, 16000, fmt), format=fmt, target_rate=16000, max_bytes=BIG, max_seconds=60)
    assert out.dtype == np.float32 and out.ndim == 1 and out.shape[0] == 16000
    if fmt in ("wav", "flac"):  # lossless up to PCM16 quantisation
        np.testing.assert_allclose(out, src, atol=1 / 32768)
    else:
        assert np.corrcoef(out, src)[0, 1] > 0.99


@pytest.mark.parametrize("fmt", AUDIO_FORMATS)
@pytest.mark.parametrize("rate,channels", [(16000, 1), (8000, 2), (22050, 1), (44100, 2), (48000, 1)])
def test_samples_equal_transformers_load_audio(fmt, rate, channels):
    audio_utils = pytest.importorskip("transformers.audio_utils")
    src = np.random.RandomState(rate + channels).uniform(-0.5, 0.5, (int(rate * 0.7), channels)).astype(np.float32)
    data = audio_bytes(src, rate, fmt)
    ours = decode_audio(data, format=None, target_rate=16000, max_bytes=BIG, max_seconds=60)
    reference = audio_utils.load_audio(base64.b64encode(data).decode(), sampling_rate=16000, backend="soundfile")
    assert ours.shape == reference.shape
    np.testing.assert_array_equal(ours, reference)


def test_stereo_is_averaged_to_mono():
    left, right = tone(440, 16000, 0.5), tone(880, 16000, 0.5, amplitude=0.25)
    data = audio_bytes(np.stack([left, right], axis=1), 16000, "wav")
    out = decode_audio(data, format="wav", target_rate=16000, max_bytes=BIG, max_seconds=60)
    np.testing.assert_allclose(out, (left + right) / 2, atol=1 / 32768)


def dominant_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(samples.shape[0])))
    return float(np.argmax(spectrum) * rate / samples.shape[0])


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_resampling_reaches_16k_with_length_and_pitch_kept(rate):
    for freq in (440.0, 3000.0):
        src = tone(freq, rate, 1.5)
        out = decode_audio(audio_bytes(src, rate, "wav"), format="wav", target_rate=16000, max_bytes=BIG,
                           max_seconds=60)
        assert out.shape[0] == math.ceil(src.shape[0] * 16000 / rate)
        assert abs(dominant_hz(out, 16000) - freq) <= 16000 / out.shape[0] + 1e-6
        middle = out[2000:-2000]  # away from the filter's edges
        assert abs(np.sqrt(np.mean(middle**2)) - 0.5 / np.sqrt(2)) < 0.01


def test_resample_leaves_the_target_rate_alone_and_refuses_bad_input():
    x = tone(440, 16000, 0.1)
    assert resample(x, 16000, 16000) is x
    down = resample(tone(1000, 48000, 0.5), 48000, 16000)
    assert down.dtype == np.float32 and down.shape == (8000,)
    with pytest.raises(ValueError, match="mono"):
        resample(np.zeros((10, 2), np.float32), 48000, 16000)
    with pytest.raises(ValueError, match="> 0"):
        resample(x, 0, 16000)


def test_declared_format_must_match_the_data():
    data = audio_bytes(tone(440, 16000, 0.2), 16000, "wav")
    with pytest.raises(MediaError, match="given as 'mp3' but the data is WAV audio; set format to 'wav'"):
        decode_audio(data, format="mp3", target_rate=16000, max_bytes=BIG, max_seconds=60)
    assert decode_audio(data, format=" WAV ", target_rate=16000, max_bytes=BIG, max_seconds=60).shape == (3200,)
    with pytest.raises(MediaError, match="unsupported audio format 'aac'; supported: wav, mp3, flac, ogg"):
        decode_audio(data, format="aac", target_rate=16000, max_bytes=BIG, max_seconds=60)


def test_not_audio_and_other_containers_are_refused_by_name():
    with pytest.raises(MediaError, match="it is a PNG image"):
        decode_audio(image_bytes(rgb(9), "PNG"), format=None, target_rate=16000, max_bytes=BIG, max_seconds=60)
    with pytest.raises(MediaError, match="match no audio format"):
        decode_audio(b"definitely not audio" * 10, format=None, target_rate=16000, max_bytes=BIG, max_seconds=60)
    aiff = io.BytesIO()
    soundfile.write(aiff, tone(440, 16000, 0.1), 16000, format="AIFF")
    with pytest.raises(MediaError, match="it is AIFF audio"):
        decode_audio(aiff.getvalue(), format=None, target_rate=16000, max_bytes=BIG, max_seconds=60)
    with pytest.raises(MediaError, match="empty"):
        decode_audio(b"", format="wav", target_rate=16000, max_bytes=BIG, max_seconds=60)


@pytest.mark.parametrize("fmt", AUDIO_FORMATS)
def test_cut_short_audio_is_a_media_error(fmt):
    data = audio_bytes(tone(440, 16000, 1.0), 16000, fmt)
    cuts = (30, 12) if fmt in ("wav", "mp3") else (len(data) // 2, 30, 12)
    for cut in cuts:
        with pytest.raises(MediaError, match="does not decode|match no audio format"):
            decode_audio(data[:cut], format=None, target_rate=16000, max_bytes=BIG, max_seconds=60)


def test_wav_and_mp3_cut_in_their_samples_decode_what_arrived():
    """A WAV's header may be a streaming one with no length, and MP3 is a stream of frames: samples that stop early
    are what the clip is."""
    data = audio_bytes(tone(440, 16000, 1.0), 16000, "wav")
    out = decode_audio(data[:44 + 2 * 4000], format="wav", target_rate=16000, max_bytes=BIG, max_seconds=60)
    assert out.shape == (4000,)
    data = audio_bytes(tone(440, 16000, 3.0), 16000, "mp3")
    out = decode_audio(data[:len(data) // 2], format="mp3", target_rate=16000, max_bytes=BIG, max_seconds=60)
    assert 0 < out.shape[0] < 48000


def test_corrupt_flac_is_a_media_error():
    data = bytearray(audio_bytes(np.random.RandomState(0).uniform(-.5, .5, 16000).astype(np.float32), 16000, "flac"))
    data[len(data) // 2:len(data) // 2 + 300] = bytes(300)
    with pytest.raises(MediaError, match="FLAC audio does not decode"):
        decode_audio(bytes(data), format="flac", target_rate=16000, max_bytes=BIG, max_seconds=60)


def test_audio_over_max_bytes_names_the_limit():
    data = audio_bytes(tone(440, 16000, 0.2), 16000, "wav")
    with pytest.raises(MediaError, match=f"{len(data)} bytes, over the limit max_bytes = 1000") as e:
        decode_audio(data, format="wav", target_rate=16000, max_bytes=1000, max_seconds=60)
    assert (e.value.limit, e.value.limit_value) == ("max_bytes", 1000)


def test_too_long_audio_is_refused_on_its_header():
    """A one-second FLAC whose STREAMINFO claims an hour: refused from the header, before any sample is decoded."""
    data = bytearray(audio_bytes(np.zeros(16000, np.float32), 16000, "flac"))
    fields = int.from_bytes(data[18:26], "big")  # rate(20) channels(3) bits(5) total samples(36)
    fields = (fields >> 36 << 36) | (16000 * 3600)
    data[18:26] = fields.to_bytes(8, "big")
    with pytest.raises(MediaError, match="3600.0 s long, over the limit max_seconds = 600") as e:
        decode_audio(bytes(data), format="flac", target_rate=16000, max_bytes=BIG, max_seconds=600)
    assert (e.value.limit, e.value.limit_value) == ("max_seconds", 600)
    ten_minutes = audio_bytes(np.zeros(8000 * 601, np.float32), 8000, "flac")
    assert len(ten_minutes) < 100_000  # small on the wire, long once decoded
    with pytest.raises(MediaError, match="601.0 s long"):
        decode_audio(ten_minutes, format="flac", target_rate=16000, max_bytes=BIG, max_seconds=600)
    short = audio_bytes(np.zeros(8000 * 2, np.float32), 8000, "ogg")
    assert decode_audio(short, format="ogg", target_rate=16000, max_bytes=BIG, max_seconds=2).shape == (32000,)


def test_non_finite_samples_are_refused():
    samples = tone(440, 16000, 0.1)
    samples[10] = np.nan
    out = io.BytesIO()
    soundfile.write(out, samples, 16000, format="WAV", subtype="FLOAT")
    with pytest.raises(MediaError, match="NaN or infinite"):
        decode_audio(out.getvalue(), format="wav", target_rate=16000, max_bytes=BIG, max_seconds=60)


# --- shared -----------------------------------------------------------------------------------------------------


def test_sniff_names_containers_by_their_magic_bytes():
    assert sniff(image_bytes(rgb(10), "PNG")) == "png"
    assert sniff(image_bytes(rgb(10), "JPEG")) == "jpeg"
    assert sniff(image_bytes(rgb(10), "WEBP")) == "webp"
    for fmt in AUDIO_FORMATS:
        assert sniff(audio_bytes(tone(440, 16000, 0.2), 16000, fmt)) == fmt
    assert sniff(b"\xff\xf1\x50\x80") == "aac"  # ADTS: frame sync with layer bits 00
    assert sniff(b"") is None and sniff(b"hello") is None


def test_media_error_is_a_value_error():
    assert issubclass(MediaError, ValueError)


def test_decoders_import_no_torch():
    code = ("import sys, mstar_dist.media.image, mstar_dist.media.audio, mstar_dist.media.wav; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
