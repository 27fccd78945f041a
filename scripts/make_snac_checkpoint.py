"""Write a SNAC decoder checkpoint with random weights in the hub layout (config.json + model.safetensors).

    python scripts/make_snac_checkpoint.py --out DIR [--size tiny|24khz] [--seed 0]

tiny: the 24 kHz structure (3 codebooks, vq_strides 4/2/1, 2048 samples per frame) at small widths, for CPU
tests and CI. 24khz: the shapes of hubertsiuzdak/snac_24khz, for timing on machines that cannot receive the
real weights. Only the decoder half is written (what `models.snac.load_snac` reads); the audio is noise-like.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from models.snac import SNAC_24KHZ, SNAC_TINY, SnacDecoder, save_snac  # noqa: E402
from mstar_dist.random_weights import write_marker  # noqa: E402

SIZES = {"tiny": SNAC_TINY, "24khz": SNAC_24KHZ}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="directory to write (created if missing)")
    p.add_argument("--size", default="tiny", choices=sorted(SIZES))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    model = SnacDecoder(SIZES[args.size])
    out = save_snac(model, args.out)
    write_marker(out, args.seed, "scripts/make_snac_checkpoint.py")
    n_params = sum(t.numel() for t in model.parameters())
    print(f"random SNAC {args.size} decoder ({n_params / 1e6:.2f} M parameters) written to {out}")


if __name__ == "__main__":
    main()
