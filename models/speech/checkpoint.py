"""Write a random Orpheus-TTS-layout speech LLM checkpoint (Llama-3.2 shape + speech tokenizer) from a seed.

    python scripts/make_speech_checkpoint.py --out DIR [--size tiny|small|3b] [--seed 0] [--codebook-size N] [--with-codec]

DIR gets what an Orpheus-style speech family loads, in HF layout: config.json (Llama, llama3 rope_scaling,
rope_theta 500000, tied embeddings), model.safetensors (N(0, 0.02) weights, norms 1; fp32 for tiny, bf16 for
3b), tokenizer.json + tokenizer_config.json, generation_config.json (eos = end_of_speech) and speech.json (the
ids of models/llama/speech_tokens.py, which can also be derived from the tokenizer alone).

The tokenizer is a byte-level BPE trained on CORPUS below, then a block of 256 special tokens placed as in
Llama-3 (<|begin_of_text|> at +0, <|end_of_text|> +1, <|eot_id|> +9, the rest reserved), then Orpheus's
<custom_token_0> .. <custom_token_{9 + 7 * N}>. `3b` pads the BPE part to 128000 ids with unused tokens and
the end to Orpheus's vocab of 156940 with further custom tokens, so the special ids Orpheus-TTS's code uses
(<|begin_of_text|> 128000, <|eot_id|> 128009, start_of_speech 128257 .. start_of_ai 128261, audio codes from
128266) and every tensor shape equal canopylabs/orpheus-3b-0.1-ft's; text ids do not. `small` is the same layout
(every id, vocabulary 156940, codebook 4096, llama3 rope scaling) at hidden 48 and 2 layers, in float32. `tiny`
(hidden 64, 2 layers, codebook 64 like our tiny SNAC codec) has the same token names without the padding.
The same arguments give byte-identical files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import struct
import sys
import time
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from models.common.checkpoint import prepare_once
from models.llama.config import Llama3RopeScaling, LlamaConfig
from models.llama.speech_tokens import AUDIO_TOKEN_BASE, CODES_PER_FRAME, SpeechTokens, custom_token
from mstar_dist.random_weights import write_marker

MADE_BY = "scripts/make_speech_checkpoint.py"

CORPUS = """\
The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork, trimmed the
wick and polished the great lens until it shone like water. Ships passing in the night never saw him, but they
saw his light, and that was enough for him.

In the morning the village woke slowly. The baker opened her shutters first, then the fishermen walked down to
the harbour with their nets over their shoulders. Children ran along the sea wall, counting the boats that had
come home and the gulls that followed them.

Speech is sound shaped by breath. When we talk, the voice rises and falls, pauses and hurries, laughs and
sighs. A good reader does not only say the words on the page; she gives them a rhythm, a warmth and a
character, so that the listener hears a person and not a machine.

How are you today? I am well, thank you. Would you like a cup of tea, or perhaps some coffee? Let me know what
you think, and we can talk about the weather, the news, or the book you were reading last week.

Numbers and names matter too: seven, twelve, one hundred and twenty-one; Tara, Leah, Jess, Leo, Dan, Mia, Zac
and Zoe. Clear speech makes every one of them easy to understand.
"""

BPE_VOCAB = 1024
"""Upper bound for the BPE trainer; the small corpus stops it earlier."""
LLAMA3_SPECIALS = 256
"""Llama-3's special-token block after the text vocabulary."""
LLAMA3_SPECIAL_NAMES = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 9: "<|eot_id|>"}
"""Index in that block -> name; the other slots are <|reserved_special_token_k|>."""
ROPE_SCALING = Llama3RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192)
"""Llama-3.2's."""
SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                 max_position_embeddings=16384),
    "small": dict(hidden_size=48, intermediate_size=128, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=8,
                  max_position_embeddings=131072),
    "3b": dict(hidden_size=3072, intermediate_size=8192, n_layers=28, n_heads=24, n_kv_heads=8, head_dim=128,
               max_position_embeddings=131072),
}
"""``small``: canopylabs/orpheus-3b-0.1-ft's config (Llama-3.2-3B: llama3 rope scaling, rope_theta 500000, 3 query heads
per KV head, tied embeddings, 131072 positions) shrunk in width and depth only."""
LAYOUT = {"tiny": dict(codebook_size=64, text_vocab=None, vocab=None, dtype=torch.float32),
          "small": dict(codebook_size=4096, text_vocab=128000, vocab=156940, dtype=torch.float32),
          "3b": dict(codebook_size=4096, text_vocab=128000, vocab=156940, dtype=torch.bfloat16)}
"""text_vocab: ids before the special block (None: the BPE's own size); vocab: total (None: no padding)."""
_CHUNK_ELEMS = 1 << 24
"""Random values are drawn and written this many elements at a time, bounding peak memory."""


def build_tokenizer(codebook_size: int, text_vocab: int | None, vocab: int | None) -> Tokenizer:
    """Byte-level BPE on CORPUS + Llama-3's special block + Orpheus's custom tokens (see module docstring).

    text_vocab pads the BPE ids with <|reserved_text_token_k|>; vocab pads the end with more custom tokens.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    names = []
    if text_vocab is not None:
        if text_vocab < tok.get_vocab_size():
            raise ValueError(f"text_vocab {text_vocab} is smaller than the BPE's {tok.get_vocab_size()} tokens")
        names += [f"<|reserved_text_token_{k}|>" for k in range(text_vocab - tok.get_vocab_size())]
    reserved = iter(range(LLAMA3_SPECIALS))
    names += [LLAMA3_SPECIAL_NAMES.get(i) or f"<|reserved_special_token_{next(reserved)}|>"
              for i in range(LLAMA3_SPECIALS)]
    n_custom = AUDIO_TOKEN_BASE + CODES_PER_FRAME * codebook_size
    if vocab is not None:
        n_custom = max(n_custom, vocab - tok.get_vocab_size() - len(names))
    names += [custom_token(n) for n in range(n_custom)]
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    if vocab is not None and tok.get_vocab_size() != vocab:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens, layout asks for {vocab}")
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(  # like Llama-3: encode(..., add_special_tokens) adds BOS
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def model_config(size: str, vocab_size: int, bos_token_id: int, eos_token_id: int) -> LlamaConfig:
    """Llama-3.2's hyperparameters (rope_theta 500000, llama3 scaling, tied head) at `size`'s dims."""
    return LlamaConfig(vocab_size=vocab_size, **SIZES[size], rope_theta=500000.0, rope_scaling=ROPE_SCALING,
                       rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=bos_token_id,
                       eos_token_ids=(eos_token_id,))


def hf_tensor_shapes(config: LlamaConfig) -> list[tuple[str, tuple[int, ...]]]:
    """HF `LlamaForCausalLM` tensor names and shapes, tied head (no lm_head.weight)."""
    d, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    shapes = [("model.embed_tokens.weight", (config.vocab_size, d))]
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (d,)),
                   (p + "self_attn.q_proj.weight", (config.n_heads * hd, d)),
                   (p + "self_attn.k_proj.weight", (config.n_kv_heads * hd, d)),
                   (p + "self_attn.v_proj.weight", (config.n_kv_heads * hd, d)),
                   (p + "self_attn.o_proj.weight", (d, config.n_heads * hd)),
                   (p + "post_attention_layernorm.weight", (d,)),
                   (p + "mlp.gate_proj.weight", (inter, d)),
                   (p + "mlp.up_proj.weight", (inter, d)),
                   (p + "mlp.down_proj.weight", (d, inter))]
    return shapes + [("model.norm.weight", (d,))]


def write_random_safetensors(path: Path, shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                             seed: int) -> None:
    """Stream a safetensors file: 1-D tensors (norms) are ones, the rest N(0, 0.02) from one seeded generator,
    drawn in file order in chunks of whole rows, so peak memory stays near _CHUNK_ELEMS elements."""
    st_dtype, itemsize = {torch.float32: ("F32", 4), torch.bfloat16: ("BF16", 2)}[dtype]
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes:
        nbytes = math.prod(shape) * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    gen = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, shape in shapes:
            if len(shape) == 1:
                f.write(_raw_bytes(torch.ones(shape, dtype=dtype)))
                continue
            rows = max(1, _CHUNK_ELEMS // shape[1])
            for start in range(0, shape[0], rows):
                chunk = torch.randn((min(rows, shape[0] - start), shape[1]), generator=gen).mul_(0.02)
                f.write(_raw_bytes(chunk.to(dtype)))


def _raw_bytes(t: torch.Tensor) -> bytes:
    """Little-endian bytes of a contiguous CPU tensor (numpy has no bf16, so view it as int16)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def make_speech_checkpoint(out: Path, size: str, seed: int, codebook_size: int | None) -> SpeechTokens:
    """Write the checkpoint into `out` (created; FileExistsError if it holds files) and return its tokens."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    layout = LAYOUT[size]
    codebook_size = codebook_size or layout["codebook_size"]
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    tok = build_tokenizer(codebook_size, layout["text_vocab"], layout["vocab"])
    tok.save(str(out / "tokenizer.json"))
    tokens = SpeechTokens.from_tokenizer_dir(out, codebook_size)
    config = model_config(size, tok.get_vocab_size(), bos_token_id=tokens.begin_of_text,
                          eos_token_id=tokens.end_of_speech)
    dtype_name = str(layout["dtype"]).removeprefix("torch.")
    _write_json(out / "config.json", {**config.to_hf(), "torch_dtype": dtype_name})
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "model_max_length": config.max_position_embeddings, "clean_up_tokenization_spaces": False})
    _write_json(out / "generation_config.json", {"bos_token_id": tokens.begin_of_text,
                                                 "eos_token_id": tokens.end_of_speech})
    _write_json(out / "speech.json", tokens.ids())
    write_random_safetensors(out / "model.safetensors", hf_tensor_shapes(config), layout["dtype"], seed)
    write_marker(out, seed, MADE_BY)
    return tokens


def write_speech_family(out: Path, size: str = "tiny", seed: int = 0) -> Path:
    """The directory the speech family (models/speech/orpheus.py) serves from: the LLM checkpoint of ``size`` in
    ``out`` and a SNAC decoder of the matching size in ``out/snac`` (tiny: codebook 64; small: the tiny codec with
    Orpheus's 4096 codes; 3b: the 24 kHz codec)."""
    from models.snac import SNAC_24KHZ, SNAC_TINY, SnacDecoder, save_snac

    snac_config = {"tiny": SNAC_TINY, "small": dataclasses.replace(SNAC_TINY, codebook_size=4096)}.get(size, SNAC_24KHZ)
    make_speech_checkpoint(Path(out), size, seed, snac_config.codebook_size)
    torch.manual_seed(seed)
    save_snac(SnacDecoder(snac_config), Path(out) / "snac")
    write_marker(Path(out) / "snac", seed, MADE_BY)
    return Path(out)


def write_tiny_speech_checkpoint(out: Path) -> Path:
    """The default speech weights prepared on first start (tiny, seed 0), written once (``prepare_once``)."""
    return prepare_once(out, "config.json", lambda tmp: write_speech_family(tmp, "tiny", 0))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--size", default="tiny", choices=sorted(SIZES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codebook-size", type=int, default=None, help="default: 64 for tiny, 4096 for small and 3b")
    p.add_argument("--with-codec", action="store_true", help="also write the matching SNAC decoder to OUT/snac")
    args = p.parse_args(argv)
    start = time.perf_counter()
    if args.with_codec:
        write_speech_family(args.out, args.size, args.seed)
    else:
        make_speech_checkpoint(args.out, args.size, args.seed, args.codebook_size)
    print(f"{args.size} speech checkpoint written to {args.out} in {time.perf_counter() - start:.1f} s")
