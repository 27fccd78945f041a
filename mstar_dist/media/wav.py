"""Media containers the server writes around a model's raw output: WAV (RIFF, 16-bit PCM). No torch.

Audio deltas carry little-endian PCM16 (``mstar_dist.events.MediaDelta``); a WAV file is a 44-byte header plus
those bytes unchanged. Images already arrive as PNG files and need nothing here.
"""

from __future__ import annotations

import struct

BYTES_PER_SAMPLE = 2
"""PCM16: every sample of every channel is 2 bytes, little-endian."""
WAV_HEADER_BYTES = 44
UNKNOWN_SIZE = 0xFFFFFFFF
"""RIFF and data sizes of a streamed WAV whose length is not known when the header is sent."""


def wav_header(sample_rate: int, num_channels: int, n_samples: int | None) -> bytes:
    """The 44-byte RIFF/WAVE header of 16-bit PCM audio with ``n_samples`` sample frames (one sample per
    channel each), to be followed by exactly ``n_samples * num_channels * 2`` bytes of PCM.

    ``n_samples=None`` gives the streaming form, for a body whose length is unknown when the header goes out:
    the RIFF and ``data`` chunk sizes are 0xFFFFFFFF, as OpenAI's speech API and most streaming TTS servers
    send. Readers that honour the size (Python's ``wave``, ffmpeg, browsers) then read PCM to the end of the
    stream. Raises ValueError for a non-positive rate or channel count, or audio too long for RIFF's 32-bit
    sizes (about 6 h of 48 kHz stereo).
    """
    if sample_rate <= 0 or num_channels <= 0:
        raise ValueError(f"WAV needs sample_rate > 0 and num_channels > 0, got {sample_rate} and {num_channels}")
    block_align = num_channels * BYTES_PER_SAMPLE
    if n_samples is None:
        riff_size = data_size = UNKNOWN_SIZE
    else:
        data_size = n_samples * block_align
        if not 0 <= data_size <= UNKNOWN_SIZE - (WAV_HEADER_BYTES - 8):
            raise ValueError(f"{n_samples} samples of {num_channels} channel(s) do not fit a WAV file")
        riff_size = data_size + WAV_HEADER_BYTES - 8
    fmt = struct.pack("<HHIIHH", 1, num_channels, sample_rate, sample_rate * block_align, block_align,
                      8 * BYTES_PER_SAMPLE)  # 1 = PCM
    return (b"RIFF" + struct.pack("<I", riff_size) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
            + b"data" + struct.pack("<I", data_size))


def wav_bytes(pcm: bytes, sample_rate: int, num_channels: int) -> bytes:
    """A complete WAV file holding ``pcm`` (little-endian PCM16, channels interleaved) unchanged.

    Raises ValueError when ``pcm`` is not a whole number of sample frames (``2 * num_channels`` bytes each).
    """
    frame = num_channels * BYTES_PER_SAMPLE
    if num_channels > 0 and len(pcm) % frame:
        raise ValueError(f"{len(pcm)} bytes of PCM16 is not a whole number of {num_channels}-channel frames "
                         f"({frame} bytes each)")
    return wav_header(sample_rate, num_channels, len(pcm) // frame if num_channels > 0 else 0) + pcm
