"""Write an HF-layout Llama checkpoint with random weights shaped like an existing one.

    python scripts/make_random_checkpoint.py --like DIR --out OUT [--dtype bfloat16] [--seed 0]

For GPU machines that cannot receive the real weights (the SmolLM2 GGUF is larger than what a device command
carries): DIR needs only config.json and the tokenizer files; OUT gets those plus a random model.safetensors of
the same shapes. Speed and "split == colocated" do not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from mstar_dist.random_weights import write_marker  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--like", required=True, help="directory with config.json and tokenizer files")
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    src, out = Path(args.like), Path(args.out)
    torch.manual_seed(args.seed)
    config = LlamaConfig.from_pretrained(src)
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    write_marker(out, args.seed, "scripts/make_random_checkpoint.py")
    print(f"random {config.num_hidden_layers}-layer checkpoint written to {out}")


if __name__ == "__main__":
    main()
