"""Write a small random Qwen3-Omni checkpoint in the published layout: see models/qwen3_omni/checkpoint.py.

    python scripts/make_qwen3omni_checkpoint.py --out DIR [--seed 0] [--dtype float32|bfloat16] [--max-shard-kb 400]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from models.qwen3_omni.checkpoint import main  # noqa: E402

if __name__ == "__main__":
    main()
