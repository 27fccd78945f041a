"""Write a random-weight checkpoint of the text-to-image family (layout: models/image/checkpoint.py).

    python scripts/make_image_checkpoint.py --out DIR [--size tiny|1b] [--seed 0] [--text-dim 64]
                                            [--dtype float32|bfloat16]

--text-dim must equal the hidden size of the Llama checkpoint used as text encoder (SmolLM2-135M: 576).
The images of a random model are noise; speed and plumbing do not depend on the weights' values.
tiny: ~0.2 M denoiser parameters, 64x64 images from 32x32x4 latents (CPU). 1b: 1.13e9 denoiser parameters
(SD3-shaped VAE, 8x) for GPU benchmarks; about 4.5 GB in float32, needs that much free memory to write.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from models.image.checkpoint import write_image_checkpoint  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory to create (existing files are overwritten)")
    p.add_argument("--size", default="tiny", choices=["tiny", "1b"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text-dim", type=int, default=64, help="hidden size of the text encoder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args()
    out = write_image_checkpoint(args.out, size=args.size, seed=args.seed, text_dim=args.text_dim,
                                 dtype=getattr(torch, args.dtype))
    print(f"random {args.size} image checkpoint (text_dim {args.text_dim}) written to {out}")


if __name__ == "__main__":
    main()
