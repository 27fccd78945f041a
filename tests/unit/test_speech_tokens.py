"""The tiny Orpheus-layout speech checkpoint of models/speech/checkpoint.py and models/llama/speech_tokens.py.

A failure here points to: the script (files, tokenizer layout, the hand-written safetensors, determinism) if HF
or our loader cannot read its output or the ids move; `SpeechTokens` (name lookup, prompt format, the
audio-token <-> (code, position) arithmetic) if the ids, the prompt or the codes are wrong; `ChatTokenizer`
if it cannot load a speech tokenizer or does not stop on end_of_speech.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models.llama.speech_tokens import CODES_PER_FRAME, SpeechTokens, custom_token
from models.llama.tokenizer import ChatTokenizer
from models.llama.weights import load_llama
from mstar_dist.engine.kv_cache import StaticKVCache

CODEBOOK = 64  # the tiny default
VOICE, TEXT = "tara", "Hello there, how are you today? <laugh> Fine."


def load_script():
    import models.speech.checkpoint as module

    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("speech") / "tiny"
    load_script().main(["--out", str(out), "--size", "tiny", "--seed", "0"])
    return out


@pytest.fixture(scope="module")
def tokens(tiny: Path) -> SpeechTokens:
    return SpeechTokens.from_tokenizer_dir(tiny, CODEBOOK)


def test_ids_resolve_by_name_and_match_speech_json(tiny: Path, tokens: SpeechTokens) -> None:
    assert tokens.ids() == json.loads((tiny / "speech.json").read_text())
    tok = tokens.tokenizer
    for role, n in {"start_of_speech": 1, "end_of_speech": 2, "start_of_human": 3, "end_of_human": 4,
                    "start_of_ai": 5}.items():
        assert getattr(tokens, role) == tok.token_to_id(custom_token(n))
    assert tokens.audio_offset == tok.token_to_id("<custom_token_10>")
    assert (tokens.begin_of_text, tokens.end_of_text) == (tok.token_to_id("<|begin_of_text|>"),
                                                          tok.token_to_id("<|eot_id|>"))
    assert json.loads((tiny / "generation_config.json").read_text())["eos_token_id"] == tokens.end_of_speech
    with pytest.raises(ValueError, match="codebook_size=65"):  # its last audio token is past the tokenizer's
        SpeechTokens.from_tokenizer_dir(tiny, 65)


def test_prompt_is_orpheus_format_and_round_trips(tiny: Path, tokens: SpeechTokens) -> None:
    ids = tokens.prompt_ids(VOICE, TEXT)
    text = tokens.tokenizer.decode(ids, skip_special_tokens=False)
    assert text == f"<custom_token_3><|begin_of_text|>{VOICE}: {TEXT}<|eot_id|>" \
                   f"<custom_token_4><custom_token_5><custom_token_1>"
    assert tokens.tokenizer.encode(text, add_special_tokens=False).ids == ids
    # Orpheus-TTS builds it from an HF tokenizer call, which adds <|begin_of_text|> itself.
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tiny)
    orpheus = [tokens.start_of_human, *hf_tok(f"{VOICE}: {TEXT}").input_ids,
               tokens.end_of_text, tokens.end_of_human, tokens.start_of_ai, tokens.start_of_speech]
    assert orpheus == ids


def test_audio_token_maps_to_code_and_position(tokens: SpeechTokens) -> None:
    codes = [0, 5, 63, 17, 1, 40, 2, 63, 0, 9, 33, 12, 62, 7]  # two frames
    for position, code in enumerate(codes):
        token = tokens.audio_token(code, position)
        k = position % CODES_PER_FRAME
        assert tokens.tokenizer.id_to_token(token) == custom_token(10 + k * CODEBOOK + code)
        assert token - tokens.audio_offset - k * CODEBOOK == code  # Orpheus's decoder arithmetic
        assert tokens.audio_code(token) == (code, k)
    for not_audio in (tokens.start_of_speech, tokens.end_of_speech, tokens.audio_offset + 7 * CODEBOOK):
        assert not tokens.is_audio(not_audio)
        with pytest.raises(ValueError, match="not an audio token"):
            tokens.audio_code(not_audio)


def test_chat_tokenizer_loads_and_stops_on_end_of_speech(tiny: Path, tokens: SpeechTokens) -> None:
    tok = ChatTokenizer(tiny)
    assert tok.vocab_size == json.loads((tiny / "config.json").read_text())["vocab_size"]
    assert tok.eos_token_ids == tuple(sorted((tokens.end_of_text, tokens.end_of_speech)))
    assert tok.encode(TEXT) == tokens.tokenizer.encode(TEXT, add_special_tokens=False).ids
    decoder = tok.incremental_decoder()
    audio = [tokens.audio_token(c, i) for i, c in enumerate(range(7))]
    assert decoder.push([*tokens.prompt_ids(VOICE, TEXT), *audio, tokens.end_of_speech]) + decoder.flush() \
        == f"{VOICE}: {TEXT}"  # special tokens skipped


@torch.inference_mode()
def test_weights_load_in_ours_and_hf_with_equal_logits(tiny: Path, tokens: SpeechTokens) -> None:
    transformers = pytest.importorskip("transformers")
    model, config = load_llama(tiny)
    assert config.rope_scaling is not None and config.rope_theta == 500000.0 and config.tie_word_embeddings
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    ids = torch.tensor([tokens.prompt_ids(VOICE, TEXT)])
    cache = StaticKVCache(n_layers=config.n_layers, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
                          max_slots=1, max_seq_len=ids.shape[1])
    cache.bind([cache.alloc()], [0], ids.shape[1])
    ours = model(ids, torch.arange(ids.shape[1])[None], cache)
    torch.testing.assert_close(ours, hf_model(ids).logits, atol=1e-4, rtol=1e-4)


def test_same_seed_same_files_other_seed_other_weights(tiny: Path, tmp_path: Path) -> None:
    script = load_script()
    script.make_speech_checkpoint(tmp_path / "same", "tiny", seed=0, codebook_size=None)
    script.make_speech_checkpoint(tmp_path / "other", "tiny", seed=1, codebook_size=None)
    for f in tiny.iterdir():
        assert (tmp_path / "same" / f.name).read_bytes() == f.read_bytes(), f.name
    assert (tmp_path / "other" / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()
    assert (tmp_path / "other" / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()


def test_3b_layout_has_orpheus_ids_and_shapes() -> None:
    """The ids canopylabs/orpheus-3b-0.1-ft's code hard-codes (engine_class.py, decoder.py)."""
    script = load_script()
    layout = script.LAYOUT["3b"]
    tok = script.build_tokenizer(layout["codebook_size"], layout["text_vocab"], layout["vocab"])
    assert tok.get_vocab_size() == 156940
    ids = {name: tok.token_to_id(name) for name in ("<|begin_of_text|>", "<|eot_id|>", "<custom_token_1>",
                                                    "<custom_token_2>", "<custom_token_3>", "<custom_token_10>")}
    assert list(ids.values()) == [128000, 128009, 128257, 128258, 128259, 128266]
    shapes = dict(script.hf_tensor_shapes(script.model_config("3b", 156940, bos_token_id=0, eos_token_id=1)))
    assert shapes["model.embed_tokens.weight"] == (156940, 3072)
    assert shapes["model.layers.27.self_attn.k_proj.weight"] == (8 * 128, 3072)
    assert shapes["model.layers.27.mlp.down_proj.weight"] == (3072, 8192)
    assert "lm_head.weight" not in shapes  # tied
