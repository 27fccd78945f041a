"""SNAC 24 kHz codec decoder (codes -> audio) and the Orpheus 7-code frame layout over it."""

from models.snac.frames import (
    ORPHEUS_AUDIO_OFFSET, codes_from_tokens, codes_to_frames, decode_frames, frames_to_codes, to_pcm16,
)
from models.snac.model import SNAC_24KHZ, SNAC_TINY, SnacConfig, SnacDecoder
from models.snac.weights import load_snac, read_snac_config, save_snac

__all__ = [
    "ORPHEUS_AUDIO_OFFSET", "SNAC_24KHZ", "SNAC_TINY", "SnacConfig", "SnacDecoder", "codes_from_tokens",
    "codes_to_frames", "decode_frames", "frames_to_codes", "load_snac", "read_snac_config", "save_snac", "to_pcm16",
]
