"""The tiny Qwen3-Omni checkpoint (models/qwen3_omni/checkpoint.py), its config reader (config.py) and its loader
(weights.py).

A failure here points to: the writer (names or shapes that are not the published checkpoint's, an index that does
not cover the shards, bytes that change between runs, token ids the tokenizer does not hold, a chat template that
drops a media part), the config reader (a malformed config accepted, or rejected without naming the key), or the
loader (a shard opened that holds none of the wanted tensors, a missing or unexpected key not named, a TP slice not
taken from the module's ``weight_loader``). The transformers tests check the layout against the reference: its
``Qwen3OmniMoeForConditionalGeneration`` loads the directory with no missing or unexpected keys, and its tokenizer,
image processor, feature extractor and processor load from it.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import nn

from models.llama.chat_template import compile_chat_template, render_chat_template
from models.qwen3_omni import checkpoint as ck
from models.qwen3_omni import weights as qw
from models.qwen3_omni.config import Qwen3OmniConfig, read_config, rope_parameters

pytestmark = pytest.mark.usefixtures("one_intraop_thread")

IMAGE_PART = {"type": "image", "image": "ignored.png"}
AUDIO_PART = {"type": "audio", "audio": "ignored.wav"}
TRANSFORMERS = "5.25"
"""The reference tests use the API of transformers 5.25 (its in-memory module names moved after 5.17; the PIL
image-processor backend)."""
MEDIA_PROMPT = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                "<|vision_start|><|image_pad|><|vision_end|><|audio_start|><|audio_pad|><|audio_end|>"
                "What is this?<|im_end|>\n<|im_start|>assistant\n")


def media_messages(image: object = IMAGE_PART, audio: object = AUDIO_PART) -> list[dict]:
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [image, audio, {"type": "text", "text": "What is this?"}]}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("omni") / "tiny"
    ck.make_qwen3omni_checkpoint(out, seed=0)
    return out


def shard_contents(d) -> dict[str, list[str]]:
    out = {}
    for f in sorted(d.glob("model-*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out[f.name] = list(h.keys())
    return out


# --- the writer ---------------------------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_bytes_and_another_seed_other_weights(ckpt, tmp_path) -> None:
    again = tmp_path / "again"
    ck.make_qwen3omni_checkpoint(again, seed=0)
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert (ckpt / name).read_bytes() == (again / name).read_bytes(), name
    other = tmp_path / "other"
    ck.make_qwen3omni_checkpoint(other, seed=1)
    shard = "model-00001-of-00009.safetensors"
    assert (ckpt / shard).read_bytes() != (other / shard).read_bytes()
    assert (ckpt / "config.json").read_bytes() == (other / "config.json").read_bytes()


def test_the_index_maps_every_tensor_of_the_shards_exactly_once(ckpt) -> None:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    contents = shard_contents(ckpt)
    assert len(contents) >= 5  # sharded although tiny, as the published checkpoint is
    held = [name for names in contents.values() for name in names]
    assert len(held) == len(set(held))
    assert index["weight_map"] == {name: file for file, names in contents.items() for name in names}
    config = read_config(ckpt)
    shapes = dict(qw.tensor_shapes(config))
    assert set(index["weight_map"]) == set(shapes)
    assert index["metadata"]["total_size"] == 4 * sum(math.prod(s) for s in shapes.values())
    for file, names in contents.items():
        with safe_open(str(ckpt / file), framework="pt") as h:
            assert all(tuple(h.get_slice(n).get_shape()) == shapes[n] for n in names), file
        assert os.path.getsize(ckpt / file) < ck.DEFAULT_MAX_SHARD_BYTES + 64 * 1024 or len(names) == 1


def published_size_config() -> dict:
    """The published Qwen3-Omni-30B-A3B-Instruct sizes and ids over TINY's layout."""
    hf = ck.tiny_config()
    th, tk, c2w = hf["thinker_config"], hf["talker_config"], hf["code2wav_config"]
    th["text_config"].update(vocab_size=152064, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                             head_dim=128, num_hidden_layers=48, num_experts=128, num_experts_per_tok=8,
                             moe_intermediate_size=768, intermediate_size=768)
    th["vision_config"].update(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304,
                               out_hidden_size=2048, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24])
    th["audio_config"].update(d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120,
                              downsample_hidden_size=480, output_dim=2048)
    tk["text_config"].update(vocab_size=3072, hidden_size=1024, num_attention_heads=16, num_key_value_heads=2,
                             head_dim=128, num_hidden_layers=20, num_experts=128, num_experts_per_tok=6,
                             moe_intermediate_size=384, shared_expert_intermediate_size=768, intermediate_size=2048)
    tk["code_predictor_config"].update(vocab_size=2048, hidden_size=1024, intermediate_size=3072,
                                       num_hidden_layers=5, num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=128, num_code_groups=16)
    tk.update(thinker_hidden_size=2048, num_code_groups=16, accept_hidden_layer=24)
    c2w.update(codebook_size=2048, hidden_size=1024, num_attention_heads=16, num_key_value_heads=16,
               intermediate_size=3072, num_hidden_layers=8, num_quantizers=16, decoder_dim=1536)
    return hf


def test_at_the_published_sizes_the_names_and_shapes_are_the_published_checkpoints() -> None:
    # The published checkpoint holds 28,010 tensors and 35,259,818,545 parameters; spot shapes from its index.
    shapes = dict(qw.tensor_shapes(Qwen3OmniConfig.from_hf(published_size_config())))
    assert len(shapes) == 28010
    assert sum(math.prod(s) for s in shapes.values()) == 35_259_818_545
    assert shapes["thinker.model.layers.47.mlp.experts.127.gate_proj.weight"] == (768, 2048)
    assert shapes["thinker.visual.merger_list.2.ln_q.weight"] == (4608,)
    assert shapes["thinker.visual.patch_embed.proj.weight"] == (1152, 3, 2, 16, 16)
    assert shapes["thinker.audio_tower.conv_out.weight"] == (1280, 7680)
    assert shapes["talker.model.layers.19.mlp.shared_expert_gate.weight"] == (1, 1024)
    assert shapes["talker.code_predictor.lm_head.14.weight"] == (2048, 1024)
    assert shapes["code2wav.code_embedding.weight"] == (32768, 1024)
    assert shapes["code2wav.decoder.1.block.1.conv.weight"] == (1536, 768, 16)
    assert shapes["code2wav.decoder.6.conv.weight"] == (1, 96, 7)


def test_the_written_config_reads_back_and_its_ids_are_the_tokenizers(ckpt) -> None:
    config = read_config(ckpt)
    assert config == Qwen3OmniConfig.from_hf(ck.TINY)
    assert json.loads((ckpt / "config.json").read_text()) == ck.TINY
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    t = config.tokens
    expected = {t.im_start: "<|im_start|>", t.im_end: "<|im_end|>", t.tts_pad: "<tts_pad>",
                t.tts_bos: "<tts_text_bos>", t.tts_eos: "<tts_text_eod>", t.image: "<|image_pad|>",
                t.video: "<|video_pad|>", t.audio: "<|audio_pad|>", t.vision_start: "<|vision_start|>",
                t.vision_end: "<|vision_end|>", t.audio_start: "<|audio_start|>", t.audio_end: "<|audio_end|>",
                t.system: "system", t.user: "user", t.assistant: "assistant"}
    assert {i: tok.id_to_token(i) for i in expected} == expected
    assert tok.get_vocab_size() == 1057 <= config.thinker_text["vocab_size"]
    assert config.speakers == {"chelsie": 381, "ethan": 382, "aiden": 383}
    assert config.speaker_id(" Ethan ") == 382
    assert config.codec.eos == 230 and config.num_code_groups == 4


def test_role_words_are_single_tokens_at_the_ids_tiny_documents() -> None:
    # The ids come from BPE training; a tokenizers release that trains differently shows up here first.
    tok = ck.build_tokenizer()
    assert {w: tok.encode(w).ids for w in ck.ROLE_IDS} == {w: [i] for w, i in ck.ROLE_IDS.items()}


def test_values_follow_the_init_rules_in_the_chosen_dtype(ckpt, tmp_path) -> None:
    t = qw.read_tensors(ckpt, "")
    assert all(v.dtype == torch.float32 for v in t.values())
    assert torch.equal(t["thinker.visual.blocks.0.attn.qkv.bias"], torch.zeros(96))
    assert torch.equal(t["thinker.model.norm.weight"], torch.ones(64))
    assert torch.equal(t["code2wav.decoder.1.block.0.alpha"], torch.zeros(64))
    assert torch.equal(t["code2wav.pre_transformer.layers.0.mlp_layer_scale.scale"], torch.ones(32))
    assert abs(t["thinker.model.embed_tokens.weight"].std().item() - 0.02) < 0.002
    conv = t["code2wav.decoder.1.block.2.conv1.conv.weight"]  # (32, 32, 7): gain / sqrt(fan_in)
    assert abs(conv.std().item() - ck.CONV_GAIN / math.sqrt(32 * 7)) < 0.01
    bf16 = tmp_path / "bf16"
    ck.make_qwen3omni_checkpoint(bf16, dtype="bfloat16")
    assert read_config(bf16).dtype == "bfloat16"
    b = qw.read_tensors(bf16, "code2wav.")
    assert all(v.dtype == torch.bfloat16 for v in b.values())
    assert torch.equal(b["code_embedding.weight"], t["code2wav.code_embedding.weight"].bfloat16())


def test_the_chat_template_places_each_media_part_where_it_stands(ckpt) -> None:
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == json.loads((ckpt / "chat_template.json").read_text())["chat_template"]
    template = compile_chat_template(cfg["chat_template"])
    special = {"eos_token": cfg["eos_token"], "pad_token": cfg["pad_token"]}
    assert render_chat_template(template, media_messages(), add_generation_prompt=True,
                                special_tokens=special) == MEDIA_PROMPT
    openai_parts = media_messages({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                                  {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}})
    assert render_chat_template(template, openai_parts, add_generation_prompt=True,
                                special_tokens=special) == MEDIA_PROMPT
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert render_chat_template(template, turns, add_generation_prompt=False, special_tokens=special) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n")
    ids = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(MEDIA_PROMPT).ids
    assert ids.count(ck.TOKEN_IDS["<|image_pad|>"]) == 1 and ids.count(ck.TOKEN_IDS["<|audio_pad|>"]) == 1


def test_writer_refuses_a_non_empty_directory_and_bad_arguments(ckpt, tmp_path) -> None:
    with pytest.raises(FileExistsError):
        ck.make_qwen3omni_checkpoint(ckpt)
    with pytest.raises(ValueError, match="dtype"):
        ck.make_qwen3omni_checkpoint(tmp_path / "a", dtype="float64")
    bad = ck.tiny_config()
    bad["code2wav_config"]["num_quantizers"] = 8
    with pytest.raises(ValueError, match="code2wav_config.num_quantizers"):
        ck.make_qwen3omni_checkpoint(tmp_path / "b", config=bad)


def test_the_writer_and_loader_need_no_transformers(ckpt, tmp_path) -> None:
    # Serving writes the default checkpoint on first start, where transformers (a test dependency) may be absent.
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from models.qwen3_omni.checkpoint import make_qwen3omni_checkpoint\n"
            "from models.qwen3_omni.weights import read_tensors\n"
            f"make_qwen3omni_checkpoint({str(tmp_path / 'c')!r})\n"
            f"read_tensors({str(tmp_path / 'c')!r}, 'talker.')\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    assert (tmp_path / "c" / "config.json").read_bytes() == (ckpt / "config.json").read_bytes()


def test_the_default_checkpoint_is_written_once(tmp_path) -> None:
    out = ck.write_default_checkpoint(tmp_path / "cache" / "qwen3omni")
    assert read_config(out) == Qwen3OmniConfig.from_hf(ck.TINY)
    stamp = (out / "config.json").stat().st_mtime_ns
    assert ck.write_default_checkpoint(out) == out
    assert (out / "config.json").stat().st_mtime_ns == stamp
    assert [p.name for p in out.parent.iterdir()] == ["qwen3omni"]  # no temporary sibling left behind


# --- the config reader --------------------------------------------------------------------------------------


def broken(path: str, value: object) -> dict:
    hf = ck.tiny_config()
    *parents, key = path.split(".")
    node = hf
    for p in parents:
        node = node[p]
    if value is KeyError:
        del node[key]
    else:
        node[key] = value
    return hf


@pytest.mark.parametrize("path, value", [
    ("model_type", "qwen3_moe"),
    ("thinker_config.text_config.hidden_size", KeyError),
    ("thinker_config.vision_config", None),
    ("thinker_config.image_token_id", 5000),
    ("talker_config.image_token_id", 7),
    ("im_end_token_id", -1),
    ("talker_config.codec_eos_token_id", 2000),
    ("talker_config.speaker_id", {}),
    ("talker_config.thinker_hidden_size", 32),
    ("talker_config.accept_hidden_layer", 9),
    ("code2wav_config.codebook_size", 64),
    ("dtype", "float64"),
])
def test_a_malformed_config_is_a_value_error_naming_the_key(path, value) -> None:
    with pytest.raises(ValueError, match=path.replace(".", r"\.")):
        Qwen3OmniConfig.from_hf(broken(path, value))


def test_an_unknown_voice_lists_the_checkpoints_voices() -> None:
    config = Qwen3OmniConfig.from_hf(ck.TINY)
    with pytest.raises(ValueError, match=r"\['aiden', 'chelsie', 'ethan'\]"):
        config.speaker_id("nova")


def test_rope_settings_read_from_either_spelling() -> None:
    legacy = ck.TINY["thinker_config"]["text_config"]
    assert rope_parameters(legacy, "t") == {"interleaved": True, "mrope_interleaved": True,
                                            "mrope_section": [6, 5, 5], "rope_type": "default", "rope_theta": 1000000}
    assert rope_parameters({"rope_parameters": {"rope_type": "default", "rope_theta": 5.0}}, "t")["rope_theta"] == 5.0
    assert rope_parameters({}, "t") == {"rope_type": "default", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match=r"t\.rope_parameters\.rope_type"):
        rope_parameters({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "t")


def test_read_config_names_a_missing_directory_or_file(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="make_qwen3omni_checkpoint"):
        read_config(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_config(tmp_path)


# --- the loader ---------------------------------------------------------------------------------------------


def meta_module(shapes: dict[str, tuple[int, ...]]) -> nn.Module:
    """A plain module whose parameters are exactly `shapes` (dotted names), built on meta."""
    root = nn.Module()
    with torch.device("meta"):
        for name, shape in shapes.items():
            *path, leaf = name.split(".")
            mod = root
            for part in path:
                if part not in mod._modules:
                    mod.add_module(part, nn.Module())
                mod = mod._modules[part]
            mod.register_parameter(leaf, nn.Parameter(torch.empty(shape)))
    return root


def names_under(ckpt, prefix: str) -> dict[str, tuple[int, ...]]:
    return {n[len(prefix):]: s for n, s in qw.tensor_shapes(read_config(ckpt)) if n.startswith(prefix)}


def test_a_component_loads_from_only_the_shards_that_hold_it(ckpt, monkeypatch) -> None:
    opened = []
    real = qw.safe_open
    monkeypatch.setattr(qw, "safe_open", lambda path, **kw: opened.append(os.path.basename(path)) or real(path, **kw))
    module = qw.load_weights(meta_module(names_under(ckpt, "thinker.visual.")), ckpt, "thinker.visual.")
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    holding = {f for n, f in weight_map.items() if n.startswith("thinker.visual.")}
    assert set(opened) == holding and len(holding) < len(set(weight_map.values()))
    expected = qw.read_tensors(ckpt, "thinker.visual.")
    got = module.state_dict()
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert not any(p.is_meta for p in module.parameters())


def test_a_rank_reads_its_tp_shard_through_the_modules_weight_loader(ckpt) -> None:
    class RowShard(nn.Module):
        """Holds rank 1 of 2's rows of a weight; the loader hands it the lazy slice."""

        def __init__(self, rows: int, cols: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(rows // 2, cols))
            self.seen: list[str] = []

        def weight_loader(self, attr: str, parts: list) -> torch.Tensor:
            self.seen.append(type(parts[0]).__name__)
            rows = parts[0].get_shape()[0] // 2
            return parts[0][rows:2 * rows]

    shapes = names_under(ckpt, "thinker.model.")
    module = meta_module({k: v for k, v in shapes.items() if k != "layers.0.self_attn.q_proj.weight"})
    with torch.device("meta"):
        module.layers._modules["0"].self_attn.add_module("q_proj", RowShard(128, 64))
    qw.load_weights(module, ckpt, "thinker.model.")
    full = qw.read_tensors(ckpt, "thinker.model.layers.0.self_attn.")["q_proj.weight"]
    q = module.layers._modules["0"].self_attn.q_proj
    assert torch.equal(q.weight, full[64:128]) and q.seen == ["PySafeSlice"]


def test_missing_and_unexpected_keys_are_errors_naming_them(ckpt) -> None:
    shapes = names_under(ckpt, "code2wav.")
    with pytest.raises(ValueError, match=r"code2wav\.extra\.weight"):
        qw.load_weights(meta_module({**shapes, "extra.weight": (2,)}), ckpt, "code2wav.")
    fewer = {k: v for k, v in shapes.items() if k != "upsample.1.1.gamma"}
    with pytest.raises(ValueError, match=r"code2wav\.upsample\.1\.1\.gamma"):
        qw.load_weights(meta_module(fewer), ckpt, "code2wav.")
    wrong = {**shapes, "pre_transformer.norm.weight": (31,)}
    with pytest.raises(ValueError, match="pre_transformer.norm.weight"):
        qw.load_weights(meta_module(wrong), ckpt, "code2wav.")


def test_exclude_and_sources_let_a_module_take_part_of_a_prefix_and_fuse_tensors(ckpt) -> None:
    encoders = ("visual.", "audio_tower.")
    shapes = {k: v for k, v in names_under(ckpt, "thinker.").items() if not k.startswith(encoders)}
    attn = "model.layers.1.self_attn."
    qkv = tuple(f"{attn}{x}_proj." for x in "qkv")
    fused = {k: v for k, v in shapes.items() if not k.startswith(qkv)}
    fused[attn + "wqkv.weight"] = (128 + 64 + 64, 64)
    sources = {k: ("thinker." + k,) for k in fused}
    sources[attn + "wqkv.weight"] = tuple(f"thinker.{attn}{x}_proj.weight" for x in "qkv")
    module = qw.load_weights(meta_module(fused), ckpt, "thinker.", exclude=tuple("thinker." + e for e in encoders),
                             sources=sources, dtype=torch.bfloat16)
    parts = qw.read_tensors(ckpt, "thinker." + attn)
    want = torch.cat([parts[f"{x}_proj.weight"] for x in "qkv"]).bfloat16()
    assert torch.equal(module.state_dict()[attn + "wqkv.weight"], want)
    with pytest.raises(ValueError, match=r"unexpected tensors.*thinker\.audio_tower"):  # without exclude
        qw.load_weights(meta_module(shapes), ckpt, "thinker.")


def test_a_directory_without_an_index_is_mapped_from_its_files(tmp_path) -> None:
    save_file({"a.weight": torch.ones(2, 3)}, str(tmp_path / "model.safetensors"))
    assert qw.read_weight_map(tmp_path) == {"a.weight": "model.safetensors"}
    module = qw.load_weights(meta_module({"weight": (2, 3)}), tmp_path, "a.")
    assert torch.equal(module.weight, torch.ones(2, 3))
    with pytest.raises(ValueError, match="'b.'"):
        qw.read_tensors(tmp_path, "b.")
    with pytest.raises(FileNotFoundError):
        qw.read_weight_map(tmp_path / "none")


def test_a_shard_that_is_absent_is_named_only_when_needed(ckpt, tmp_path) -> None:
    part = tmp_path / "part"
    part.mkdir()
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    keep = {f for n, f in weight_map.items() if n.startswith("code2wav.")}
    for f in keep | {"model.safetensors.index.json", "config.json"}:
        (part / f).write_bytes((ckpt / f).read_bytes())
    assert qw.read_tensors(part, "code2wav.").keys() == qw.read_tensors(ckpt, "code2wav.").keys()
    with pytest.raises(FileNotFoundError, match="model-00001-of-00009"):
        qw.read_tensors(part, "thinker.audio_tower.")


# --- against transformers -----------------------------------------------------------------------------------


def test_transformers_loads_the_checkpoint_with_no_missing_or_unexpected_keys(ckpt) -> None:
    transformers = pytest.importorskip("transformers", minversion=TRANSFORMERS)
    model, info = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(ckpt, output_loading_info=True)
    assert {k: list(v) for k, v in info.items()} == {"missing_keys": [], "unexpected_keys": [],
                                                     "mismatched_keys": [], "error_msgs": []}
    ours = qw.read_tensors(ckpt, "thinker.model.layers.0.mlp.experts.")
    fused = model.thinker.model.language_model.layers[0].mlp.experts.gate_up_proj  # (E, 2I, H): [gate_e; up_e]
    assert torch.equal(fused[3], torch.cat([ours["3.gate_proj.weight"], ours["3.up_proj.weight"]]))
    assert model.config.talker_config.speaker_id == ck.SPEAKERS
    assert model.config.thinker_config.text_config.head_dim == 32


def test_transformers_tokenizer_and_media_processors_load_and_render_an_image_and_audio_prompt(ckpt) -> None:
    transformers = pytest.importorskip("transformers", minversion=TRANSFORMERS)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert type(tok).__name__ == "Qwen2Tokenizer"
    assert (tok.image_token_id, tok.audio_token_id, tok.video_token_id) == (1036, 1056, 1037)
    assert (tok.vision_bos_token, tok.audio_bos_token, tok.eos_token) == ("<|vision_start|>", "<|audio_start|>",
                                                                          "<|im_end|>")
    assert tok.apply_chat_template(media_messages(), add_generation_prompt=True, tokenize=False) == MEDIA_PROMPT
    text = "Hello wörld, café e\u0301 12345 it's<|image_pad|>  \n\n x<|im_end|>"
    assert tok(text)["input_ids"] == Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(text).ids
    image = transformers.AutoImageProcessor.from_pretrained(ckpt, backend="pil")
    assert (image.patch_size, image.merge_size, image.temporal_patch_size) == (16, 2, 2)
    features = transformers.AutoFeatureExtractor.from_pretrained(ckpt)
    assert (type(features).__name__, features.feature_size, features.sampling_rate) == (
        "WhisperFeatureExtractor", 128, 16000)


def test_transformers_processor_expands_an_image_and_an_audio_clip_from_the_chat_template(ckpt, monkeypatch) -> None:
    transformers = pytest.importorskip("transformers", minversion=TRANSFORMERS)
    from PIL import Image

    try:
        import torchvision  # noqa: F401  (transformers' video processor needs it)
        processor = transformers.AutoProcessor.from_pretrained(ckpt)
    except ImportError:  # build the processor from the directory's other parts; no video in this test
        from transformers.processing_utils import ProcessorMixin

        monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
        processor = transformers.Qwen3OmniMoeProcessor(
            image_processor=transformers.AutoImageProcessor.from_pretrained(ckpt, backend="pil"),
            video_processor=None, feature_extractor=transformers.AutoFeatureExtractor.from_pretrained(ckpt),
            tokenizer=transformers.AutoTokenizer.from_pretrained(ckpt),
            chat_template=json.loads((ckpt / "chat_template.json").read_text())["chat_template"])
    picture = Image.fromarray((np.random.default_rng(0).random((100, 150, 3)) * 255).astype(np.uint8))
    clip = (np.random.default_rng(1).standard_normal(2 * 16000) * 0.1).astype(np.float32)  # 2 s at 16 kHz
    messages = media_messages({"type": "image", "image": picture}, {"type": "audio", "audio": clip})
    assert processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == MEDIA_PROMPT
    out = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                        return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    assert ids.count(1036) == int(out["image_grid_thw"].prod()) // 4 > 0
    assert ids.count(1056) == 26  # 13 audio-encoder outputs per second
    assert out["input_features"].shape[1] == 128
    config = copy.deepcopy(ck.TINY)
    assert out["pixel_values"].shape[1] == 3 * 2 * 16 * 16 == (
        config["thinker_config"]["vision_config"]["in_channels"] * 2 * 16 * 16)
