"""SNAC 24 kHz codec decoder (codes -> audio)."""

from models.snac.model import SNAC_24KHZ, SNAC_TINY, SnacConfig, SnacDecoder
from models.snac.weights import load_snac, read_snac_config, save_snac

__all__ = ["SNAC_24KHZ", "SNAC_TINY", "SnacConfig", "SnacDecoder", "load_snac", "read_snac_config", "save_snac"]
