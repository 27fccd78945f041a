"""Audio bytes (WAV, MP3, FLAC, OGG) -> mono float32 at a target rate, with limits checked before decoding. No torch.

Decoding is libsndfile's (the ``soundfile`` package; its wheels carry libsndfile >= 1.1, which reads MP3 through
mpg123 and OGG Vorbis / Opus), resampling is soxr's. The steps are those of ``librosa.load`` and of transformers'
``load_audio`` with its soundfile backend, so a clip decodes to the same samples here as there:
channels averaged to mono, soxr at its ``HQ`` quality, the result cut or zero-padded to
``ceil(frames * target_rate / rate)`` samples.

Order of checks, cheapest first: byte count, the declared ``format`` against the container's magic bytes, the
header's frame count against ``max_seconds`` (a few kilobytes of FLAC can hold hours of silence), and only then the
samples. WAV and MP3 whose data stops early decode what arrived (a WAV header may be a streaming one with no
length, and mpg123 reads MPEG frames as a stream); FLAC and OGG that stop early are errors, as is any file whose
header does not parse.
"""

from __future__ import annotations

import io
import math

import numpy as np
import soundfile
import soxr

from mstar_dist.media.errors import MediaError, check_size
from mstar_dist.media.sniff import describe, sniff

AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")
"""The ``format`` names the server accepts (OpenAI's ``input_audio.format``), each also a container kind of
``media.sniff``."""
RESAMPLE_QUALITY = "soxr_hq"
"""soxr's quality preset; librosa's default resampler (``res_type="soxr_hq"``) and transformers' use it."""


def decode_audio(data: bytes, *, format: str | None, target_rate: int, max_bytes: int,
                 max_seconds: float) -> np.ndarray:
    """Decode one WAV, MP3, FLAC or OGG file to mono float32 samples at ``target_rate`` Hz: shape ``(n,)``.

    ``format``: the declared container (one of AUDIO_FORMATS, any case), or None to take it from the data. Raises
    MediaError when the data is empty or over ``max_bytes``, is not audio or is audio of another format, does not
    match ``format``, ``format`` is not supported, the header says it is longer than ``max_seconds`` (checked before
    the samples are decoded), it holds no samples or non-finite ones, or it does not decode.
    """
    if target_rate <= 0 or max_seconds <= 0:
        raise ValueError(f"target_rate and max_seconds must be > 0, got {target_rate} and {max_seconds}")
    declared = _declared_format(format)
    check_size(data, what="audio", max_bytes=max_bytes)
    kind = sniff(data)
    if kind not in AUDIO_FORMATS:
        found = f"it is {describe(kind)}" if kind else "its first bytes match no audio format"
        raise MediaError(f"the audio is not {', '.join(AUDIO_FORMATS[:-1])} or {AUDIO_FORMATS[-1]} ({found}); send one "
                         f"of those")
    if declared is not None and declared != kind:
        raise MediaError(f"the audio's format is given as {declared!r} but the data is {describe(kind)}; set "
                         f"format to {kind!r} or send {declared.upper()} data")
    samples, rate = _read(data, kind, max_seconds)
    return resample(samples, rate, target_rate)


def _declared_format(format: str | None) -> str | None:
    if format is None:
        return None
    name = format.strip().lower()
    if name not in AUDIO_FORMATS:
        raise MediaError(f"unsupported audio format {format!r}; supported: {', '.join(AUDIO_FORMATS)}")
    return name


def _read(data: bytes, kind: str, max_seconds: float) -> tuple[np.ndarray, int]:
    """Mono float32 samples and their rate; the header's length is checked against ``max_seconds`` first."""
    name = kind.upper()
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            rate, frames = f.samplerate, f.frames
            if rate <= 0:
                raise MediaError(f"the {name} audio declares a sample rate of {rate} Hz")
            if frames > max_seconds * rate:
                raise MediaError(f"the audio is {frames / rate:.1f} s long, over the limit max_seconds = "
                                 f"{max_seconds:g}; send a shorter clip", limit="max_seconds",
                                 limit_value=max_seconds)
            samples = f.read(dtype="float32", always_2d=True)
    except MediaError:
        raise
    except Exception as e:  # libsndfile on untrusted bytes: LibsndfileError, and whatever its readers raise
        raise MediaError(f"the {name} audio does not decode ({e}): it is truncated or corrupt; send a valid "
                         f"{name} file") from e
    if samples.shape[0] == 0:
        raise MediaError(f"the {name} audio holds no samples")
    if not np.isfinite(samples).all():
        raise MediaError(f"the {name} audio holds NaN or infinite samples")
    # channels averaged to mono in float32, as librosa and transformers do (a mono file stays bit-exact)
    mono = samples.T.mean(axis=0) if samples.shape[1] > 1 else samples[:, 0]
    return np.ascontiguousarray(mono, dtype=np.float32), rate


def resample(samples: np.ndarray, rate: int, target_rate: int) -> np.ndarray:
    """Mono float32 ``samples`` at ``rate`` Hz -> float32 at ``target_rate`` Hz (soxr, RESAMPLE_QUALITY), exactly
    ``ceil(len * target_rate / rate)`` samples long (soxr's output cut or zero-padded to it, as librosa does).
    Unchanged (as float32) when the rates are equal."""
    if rate <= 0 or target_rate <= 0:
        raise ValueError(f"sample rates must be > 0, got {rate} and {target_rate}")
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim != 1:
        raise ValueError(f"resample takes mono samples (one axis), got shape {samples.shape}")
    if rate == target_rate:
        return samples
    n_out = math.ceil(samples.shape[0] * target_rate / rate)
    out = soxr.resample(samples, rate, target_rate, quality=RESAMPLE_QUALITY)
    out = np.pad(out, (0, max(0, n_out - out.shape[0])))[:n_out]
    return np.ascontiguousarray(out, dtype=np.float32)
