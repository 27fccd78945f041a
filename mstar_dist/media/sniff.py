"""A container's kind from its first bytes (its magic number). No third-party imports.

Decoders look before they parse: the kind picks the one parser that may read the data (untrusted bytes never go
through every plugin a library has), and names what the data is when it is not what was asked for ("the data is a
PNG image, not audio").
"""

from __future__ import annotations

IMAGE_KINDS = frozenset({"png", "jpeg", "webp", "gif", "bmp", "tiff", "heif"})
"""Image containers ``sniff`` recognises (only some of them are decoded: see ``media.image``)."""
AUDIO_KINDS = frozenset({"wav", "mp3", "flac", "ogg", "aiff", "mp4", "webm", "aac"})
"""Audio (or audio-bearing) containers ``sniff`` recognises (only some are decoded: see ``media.audio``)."""


def _riff_kind(head: bytes) -> str | None:
    form = head[8:12]
    return {b"WAVE": "wav", b"WEBP": "webp"}.get(form)


def _mpeg_kind(head: bytes) -> str | None:
    """MPEG audio frame sync (11 bits set): layer bits 00 mean AAC in an ADTS stream, anything else MPEG-1/2 audio."""
    if len(head) < 2 or head[0] != 0xFF or head[1] & 0xE0 != 0xE0:
        return None
    return "aac" if head[1] & 0x06 == 0 else "mp3"


def sniff(data: bytes) -> str | None:
    """The container's kind (a name in IMAGE_KINDS or AUDIO_KINDS), or None when the first bytes match none."""
    head = bytes(data[:16])
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head[:4] in (b"RIFF", b"RF64") and len(head) >= 12:
        return _riff_kind(head)
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:2] == b"BM":
        return "bmp"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"
    if head[4:8] == b"ftyp":
        return "heif" if head[8:12] in (b"heic", b"heix", b"mif1", b"avif", b"avis") else "mp4"
    if head.startswith(b"fLaC"):
        return "flac"
    if head.startswith(b"OggS"):
        return "ogg"
    if head.startswith(b"ID3"):
        return "mp3"
    if head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
        return "aiff"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "webm"
    return _mpeg_kind(head)


def describe(kind: str | None) -> str:
    """``'png'`` -> ``'a PNG image'``, ``'wav'`` -> ``'WAV audio'``; None -> ``'not a known image or audio format'``."""
    if kind is None:
        return "not a known image or audio format"
    if kind in IMAGE_KINDS:
        return f"a {kind.upper()} image"
    return f"{kind.upper()} audio"
