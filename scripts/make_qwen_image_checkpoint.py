"""Write a small random Qwen-Image checkpoint in the published diffusers layout (models/qwen_image/checkpoint.py).

    python scripts/make_qwen_image_checkpoint.py --out DIR [--seed 0]

The directory loads unchanged in this server (``weights: DIR``, ``model: qwen-image``), in diffusers'
``QwenImagePipeline.from_pretrained`` and in transformers; it carries ``mstar_random_weights.json`` (its pictures
are noise by design).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.qwen_image.checkpoint import make_qwen_image_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    start = time.perf_counter()
    make_qwen_image_checkpoint(args.out, seed=args.seed)
    print(f"Qwen-Image checkpoint (seed {args.seed}) written to {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
