"""Write a random Orpheus-layout speech checkpoint (LLM + tokenizer, optionally the SNAC codec): see
models/speech/checkpoint.py.

    python scripts/make_speech_checkpoint.py --out DIR [--size tiny|small|3b] [--seed 0] [--codebook-size N] [--with-codec]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from models.speech.checkpoint import main  # noqa: E402

if __name__ == "__main__":
    main()
