"""Write a random Qwen-Image checkpoint in the published diffusers layout (models/qwen_image/checkpoint.py).

    python scripts/make_qwen_image_checkpoint.py --out DIR [--seed 0] [--size tiny|full] [--device cpu|cuda]

``tiny`` is what serving prepares; ``full`` has the published denoiser (20.4B) and VAE in bfloat16, about 41 GB (draw
it with ``--device cuda``: on one CPU core its values take the better part of an hour).
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
    p.add_argument("--size", choices=["tiny", "full"], default="tiny")
    p.add_argument("--device", default="cpu", help="where the values are drawn (other devices draw other values)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    make_qwen_image_checkpoint(args.out, seed=args.seed, size=args.size, device=args.device)
    print(f"Qwen-Image {args.size} checkpoint (seed {args.seed}) written to {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
