"""Write a small random Qwen3-MoE checkpoint in HF layout, with a tokenizer, from a seed.

    python scripts/make_moe_checkpoint.py --out DIR [--seed 0] [--shared-expert N] [--writer auto|transformers|plain]

DIR gets config.json (Qwen3MoeForCausalLM; `shared_expert_intermediate_size` when N > 0), model.safetensors
(per-expert tensors, the layout Qwen's checkpoints use), tokenizer.json + tokenizer_config.json (a byte-level BPE
trained on CORPUS plus Qwen's <|endoftext|>, <|im_start|>, <|im_end|> and a ChatML chat template) and
generation_config.json (eos = <|im_end|>, <|endoftext|>). Default shape (TINY): hidden 64, 4 heads of 16, 2 KV
heads, 4 experts of width 32, top-2 (renormalised), 2 layers, every layer sparse.

Writers: "transformers" builds `Qwen3MoeForCausalLM(config)` after `torch.manual_seed(seed)` and saves its
weights (HF's own init: N(0, 0.02), norms 1); "plain" needs no transformers and draws the same distribution
from a seeded generator (different values). "auto" uses transformers when it is importable and the config has
no shared expert (Qwen3-MoE has none; the shared-expert variant is always written plainly).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from models.moe.config import MoEConfig
from mstar_dist.random_weights import write_marker

CORPUS = """\
The river runs past the old mill and under the stone bridge. In spring the water is high and fast; in late
summer it slows, and children wade across it to the meadow on the other side.
What would you like to know? I can answer questions, write a short poem, or explain how something works.
Experts in a mixture each learn a part of the task, and a small router decides which of them sees each token.
Paris is the capital of France. Rome is the capital of Italy. Seven plus five is twelve.
"""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")
"""ChatML, as Qwen's instruct models use it (without the tool-calling and thinking parts)."""

TINY = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
            head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
            rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=2048)
"""MoEConfig fields of the default checkpoint (vocab and special ids come from the tokenizer)."""


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE on CORPUS, then SPECIAL_TOKENS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def hf_tensor_shapes(config: MoEConfig) -> list[tuple[str, tuple[int, ...]]]:
    """HF `Qwen3MoeForCausalLM` tensor names and shapes (per-expert layout; + Qwen2-MoE's shared expert)."""
    d, hd = config.hidden_size, config.head_dim
    shapes = [("model.embed_tokens.weight", (config.vocab_size, d))]

    def mlp(prefix: str, inter: int) -> list[tuple[str, tuple[int, ...]]]:
        return [(prefix + "gate_proj.weight", (inter, d)), (prefix + "up_proj.weight", (inter, d)),
                (prefix + "down_proj.weight", (d, inter))]

    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (d,)),
                   (p + "self_attn.q_proj.weight", (config.n_heads * hd, d)),
                   (p + "self_attn.k_proj.weight", (config.n_kv_heads * hd, d)),
                   (p + "self_attn.v_proj.weight", (config.n_kv_heads * hd, d)),
                   (p + "self_attn.o_proj.weight", (d, config.n_heads * hd)),
                   (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,)),
                   (p + "post_attention_layernorm.weight", (d,))]
        if not config.is_sparse(i):
            shapes += mlp(p + "mlp.", config.intermediate_size)
            continue
        shapes.append((p + "mlp.gate.weight", (config.num_experts, d)))
        for e in range(config.num_experts):
            shapes += mlp(p + f"mlp.experts.{e}.", config.moe_intermediate_size)
        if config.shared_expert_intermediate_size:
            shapes += mlp(p + "mlp.shared_expert.", config.shared_expert_intermediate_size)
            shapes.append((p + "mlp.shared_expert_gate.weight", (1, d)))
    shapes.append(("model.norm.weight", (d,)))
    if not config.tie_word_embeddings:
        shapes.append(("lm_head.weight", (config.vocab_size, d)))
    return shapes


def _plain_tensors(config: MoEConfig, seed: int) -> dict[str, torch.Tensor]:
    """1-D tensors (norms) ones, the rest N(0, 0.02), drawn in hf_tensor_shapes order from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen).mul_(0.02)
            for name, shape in hf_tensor_shapes(config)}


def _transformers_tensors(config: MoEConfig, seed: int) -> dict[str, torch.Tensor]:
    """HF's own random init of Qwen3MoeForCausalLM(config), as save_pretrained would write it (per expert)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf = {k: v for k, v in config.to_hf().items() if k not in ("architectures", "model_type")}
    torch.manual_seed(seed)
    state = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf)).state_dict()
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):  # (E, 2I, H) -> per-expert gate/up (I, H)
            base = name.removesuffix("gate_up_proj")
            gate, up = t.chunk(2, dim=1)  # (E, I, H) each
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate[e], up[e]
        elif name.endswith("mlp.experts.down_proj"):  # (E, H, I) -> per-expert (H, I)
            base = name.removesuffix("down_proj")
            for e, down in enumerate(t):
                out[f"{base}{e}.down_proj.weight"] = down
        elif not (config.tie_word_embeddings and name == "lm_head.weight"):
            out[name] = t
    return out


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def make_moe_checkpoint(out: str | Path, *, seed: int = 0, writer: str = "auto", **overrides: Any) -> MoEConfig:
    """Write the checkpoint into `out` (created; FileExistsError if it holds files) and return its config.

    `overrides` replace fields of TINY (e.g. shared_expert_intermediate_size=48, n_layers=3,
    mlp_only_layers=(1,)); vocab_size and the special ids always come from the tokenizer.
    """
    if writer not in ("auto", "transformers", "plain"):
        raise ValueError(f"writer must be 'auto', 'transformers' or 'plain', got {writer!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    tok = build_tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = MoEConfig(**{**TINY, **overrides, "vocab_size": tok.get_vocab_size(),
                          "eos_token_ids": (ids["<|im_end|>"],)})
    if writer == "auto":
        try:
            import transformers  # noqa: F401
            writer = "plain" if config.shared_expert_intermediate_size else "transformers"
        except ImportError:
            writer = "plain"
    if writer == "transformers" and config.shared_expert_intermediate_size:
        raise ValueError("the transformers writer cannot write a shared expert (Qwen3-MoE has none): use 'plain'")
    tensors = _transformers_tensors(config, seed) if writer == "transformers" else _plain_tensors(config, seed)
    save_file({k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "config.json", {**config.to_hf(), "torch_dtype": "float32"})
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE, "model_max_length": 2048,
        "clean_up_tokenization_spaces": False})
    _write_json(out / "generation_config.json", {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]})
    write_marker(out, seed, "scripts/make_moe_checkpoint.py")
    return config


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shared-expert", type=int, default=0, metavar="N",
                   help="shared_expert_intermediate_size (0: none, Qwen3-MoE)")
    p.add_argument("--writer", default="auto", choices=["auto", "transformers", "plain"])
    args = p.parse_args(argv)
    start = time.perf_counter()
    config = make_moe_checkpoint(args.out, seed=args.seed, writer=args.writer,
                                 shared_expert_intermediate_size=args.shared_expert)
    print(f"MoE checkpoint ({config.n_layers} layers, {config.num_experts} experts, top-{config.num_experts_per_tok})"
          f" written to {args.out} in {time.perf_counter() - start:.1f} s")
