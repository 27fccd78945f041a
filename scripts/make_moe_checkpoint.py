"""Write a small random Qwen3-MoE checkpoint (HF layout + tokenizer): see models/moe/checkpoint.py.

    python scripts/make_moe_checkpoint.py --out DIR [--seed 0] [--shared-expert N] [--writer auto|transformers|plain]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from models.moe.checkpoint import main  # noqa: E402

if __name__ == "__main__":
    main()
