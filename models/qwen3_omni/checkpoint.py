"""Write a small random Qwen3-Omni checkpoint in the layout of the published ``Qwen3-Omni-30B-A3B-Instruct``.

    python scripts/make_qwen3omni_checkpoint.py --out DIR [--seed 0] [--dtype float32|bfloat16] [--max-shard-kb 400]

DIR gets ``config.json`` (TINY: ``thinker_config`` with text/vision/audio configs, ``talker_config`` with text and
code-predictor configs and the speakers, ``code2wav_config``, the token ids), ``model-0000K-of-0000N.safetensors``
shards with ``model.safetensors.index.json``, ``tokenizer.json`` + ``tokenizer_config.json`` (a byte-level BPE
trained on CORPUS with Qwen's pre-tokenizer, then Qwen3-Omni's 33 added tokens in their published order, and
CHAT_TEMPLATE), ``chat_template.json``, ``preprocessor_config.json`` (Qwen2-VL image processor and Whisper feature
extractor settings) and ``generation_config.json``.

Tensor names and shapes are the published checkpoint's (``weights.tensor_shapes``). Values come from a generator
seeded by (seed, tensor name), so a tensor's values do not depend on which others exist: matrices N(0, 0.02),
convolution kernels N(0, (CONV_GAIN / sqrt(fan_in))^2), biases 0, SnakeBeta's log-scales (``alpha``, ``beta``) 0,
every other 1-D tensor (norm weights, layer scales) 1. The same seed gives the same bytes. No transformers needed: serving writes the default checkpoint
on first start (``write_default_checkpoint``).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from models.common.checkpoint import prepare_once
from models.qwen3_omni.config import ARCHITECTURE, MODEL_TYPE, Qwen3OmniConfig
from models.qwen3_omni.weights import Shapes, tensor_shapes
from mstar_dist.random_weights import write_marker

DEFAULT_QWEN3OMNI_DIR = "~/.cache/mstar_dist/qwen3omni-tiny"
"""Where serving prepares the default checkpoint (seed 0, float32) on first start."""

CORPUS = """\
system
You are a helpful assistant that can see pictures, listen to sounds and answer with text or speech.
user
Describe this image in one sentence.
assistant
The picture shows a red bicycle leaning against a brick wall, with a small dog sleeping in the shade.
user
What do you hear in this audio clip? Transcribe the speech, please.
assistant
A woman reads the weather forecast: light rain in the morning, sunshine after noon.
user
How many people are in the photo?
assistant
There are three people: two adults and a child holding a kite.
system
Answer briefly and politely. If you are not sure, say so.
user
Listen carefully and tell me which instrument plays the melody.
assistant
It sounds like a violin, then a flute; a piano plays quietly in the background.
user
Could you read the text on the sign?
assistant
It says: closed for repairs, please use the entrance on the left.
user
Is the sky in this picture cloudy or clear?
assistant
It is mostly clear with a few clouds over the mountains.
A train whistle sounds twice, then a crowd laughs and someone starts to play the piano.
The chart compares monthly sales; the blue bars grow steadily from January to June.
The river runs past the old mill and under the stone bridge. In spring the water is high and fast.
Paris is the capital of France. Rome is the capital of Italy. Tokyo is the capital of Japan.
Seven plus five is twelve. Nine times eight is seventy two. One hundred minus forty is sixty.
Good morning! How can I help you today? Sure, here is a short summary of the article you sent.
The cat jumped onto the kitchen table, knocked over a glass of milk and ran out into the garden.
Mountains rise behind the village; snow covers the peaks from November until the end of April.
A speaker with a calm voice explains how vaccines train the immune system to recognise a virus.
Experts in a mixture each learn a part of the task, and a small router decides which of them sees each token.
The talker turns the thinker's words into sound, frame by frame, while the thinker keeps writing.
Images are cut into patches of sixteen by sixteen pixels, and neighbouring patches are merged in pairs.
Audio is resampled to sixteen kilohertz and turned into a log mel spectrogram before the encoder reads it.
She painted the door bright yellow, planted tulips by the fence and hung a lantern over the porch.
The museum opens at ten o'clock; children under twelve enter for free on the first Sunday of the month.
Heavy footsteps echo in the hallway, a door creaks open and a phone begins to ring somewhere far away.
The recipe needs two cups of flour, one cup of sugar, three eggs, a pinch of salt and some lemon zest.
We walked along the beach at sunset, collecting shells and watching the waves roll onto the sand.
Her voice sounds happy and excited as she announces the winners of the school science competition.
I'm not sure, but it looks like a lighthouse on a cliff, painted with red and white stripes.
Numbers in the table: 3, 14, 15, 92, 65 and 35; their sum is 224 and their average is about 37.
"""
"""Training text of the tiny BPE; the role lines make ``system``, ``user`` and ``assistant`` single tokens, as in
Qwen's vocabulary (the talker finds turns by them)."""

PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+")
"""Qwen2's split pattern (transformers' ``Qwen2Tokenizer`` rebuilds its pipeline with it, so ours must match)."""

ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False), ("<|audio_start|>", True), ("<|audio_end|>", True),
    ("<tts_pad>", True), ("<tts_text_bos>", True), ("<tts_text_eod>", True), ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)
"""Qwen3-Omni's added tokens (content, special) in id order: the published ids are 151643 + position."""

REGULAR_VOCAB = 1024
"""Byte-level BPE tokens before the added ones (256 bytes + 768 merges of CORPUS)."""
TOKEN_IDS = {content: REGULAR_VOCAB + i for i, (content, _) in enumerate(ADDED_TOKENS)}
"""Added token -> id in the tiny vocabulary (``<|im_start|>`` 1025, ``<|image_pad|>`` 1036, ``<|audio_pad|>`` 1056)."""
ROLE_IDS = {"system": 456, "user": 333, "assistant": 332}
"""BPE ids of the role words (``system_token_id`` ...), as tokenizers trains CORPUS; a unit test pins them."""
THINKER_VOCAB = 1088
"""Rows of the thinker's embedding and head: the tokenizer's 1057 ids padded to a multiple of 64, as Qwen pads."""
CODEBOOK = 128
"""Codes per codebook (talker's first codebook, code predictor, code2wav)."""
CODEC_IDS = {"pad": CODEBOOK + 100, "bos": CODEBOOK + 101, "eos": CODEBOOK + 102, "nothink": CODEBOOK + 107,
             "think_bos": CODEBOOK + 108, "think_eos": CODEBOOK + 109}
"""Talker control ids, at the published offsets from the codebook size (2148 = 2048 + 100, ...)."""
SPEAKERS = {"chelsie": CODEBOOK + 253, "ethan": CODEBOOK + 254, "aiden": CODEBOOK + 255}
"""The published voices, at the published offsets (2301 = 2048 + 253, ...)."""


def _rope(section: list[int] | None) -> dict[str, Any] | None:
    if section is None:
        return None
    return {"interleaved": True, "mrope_interleaved": True, "mrope_section": section, "rope_type": "default",
            "type": "default"}


def _moe_text(vocab: int, hidden: int, heads: int, kv: int, head_dim: int, layers: int, inter: int, moe: int,
              shared: int, section: list[int], model_type: str) -> dict[str, Any]:
    return {"attention_bias": False, "attention_dropout": 0.0, "decoder_sparse_step": 1, "head_dim": head_dim,
            "hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": inter,
            "max_position_embeddings": 32768, "mlp_only_layers": [], "model_type": model_type,
            "moe_intermediate_size": moe, "norm_topk_prob": True, "num_attention_heads": heads, "num_experts": 4,
            "num_experts_per_tok": 2, "num_hidden_layers": layers, "num_key_value_heads": kv,
            "rms_norm_eps": 1e-06, "rope_scaling": _rope(section), "rope_theta": 1000000,
            "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": shared, "sliding_window": None,
            "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False, "vocab_size": vocab}


def _media_ids() -> dict[str, int]:
    return {"audio_end_token_id": TOKEN_IDS["<|audio_end|>"], "audio_start_token_id": TOKEN_IDS["<|audio_start|>"],
            "audio_token_id": TOKEN_IDS["<|audio_pad|>"], "image_token_id": TOKEN_IDS["<|image_pad|>"],
            "video_token_id": TOKEN_IDS["<|video_pad|>"], "vision_start_token_id": TOKEN_IDS["<|vision_start|>"]}


def _thinker_config() -> dict[str, Any]:
    """Thinker: 3-layer MoE decoder (width 64, 4 query heads of 32 over 2 KV heads, 4 experts top-2), a 3-block
    vision encoder (width 32, deepstack after blocks 0 and 1) and a 2-layer audio encoder (width 32, 128 mels)."""
    text = _moe_text(THINKER_VOCAB, 64, 4, 2, 32, 3, 32, 32, 0, [6, 5, 5], "qwen3_omni_moe_text")
    text["use_qk_norm"] = True
    vision = {"apply_vit_abs_pos_embed": True, "deepstack_visual_indexes": [0, 1], "depth": 3,
              "hidden_act": "gelu_pytorch_tanh", "hidden_size": 32, "image_size": 128, "in_channels": 3,
              "in_chans": 3, "initializer_range": 0.02, "intermediate_size": 64,
              "model_type": "qwen3_omni_moe_vision_encoder", "num_heads": 2, "num_position_embeddings": 64,
              "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2, "spatial_patch_size": 16,
              "temporal_patch_size": 2, "tokens_per_second": 2}
    audio = {"activation_dropout": 0.0, "activation_function": "gelu", "attention_dropout": 0.0,
             "conv_chunksize": 500, "d_model": 32, "downsample_hidden_size": 16, "dropout": 0.0,
             "encoder_attention_heads": 2, "encoder_ffn_dim": 64, "encoder_layers": 2, "initializer_range": 0.02,
             "max_source_positions": 1500, "model_type": "qwen3_omni_moe_audio_encoder", "n_window": 50,
             "n_window_infer": 800, "num_mel_bins": 128, "output_dim": 64, "scale_embedding": False}
    return {**_media_ids(), "audio_config": audio, "initializer_range": 0.02, "model_type": "qwen3_omni_moe_thinker",
            "position_id_per_seconds": 13, "seconds_per_chunk": 2, "text_config": text, "tie_word_embeddings": False,
            "user_token_id": ROLE_IDS["user"], "vision_config": vision,
            "vision_end_token_id": TOKEN_IDS["<|vision_end|>"]}


def _talker_config() -> dict[str, Any]:
    """Talker: 2-layer MoE decoder (width 32, 4 query heads of 16 over 2 KV heads, 4 experts top-2 plus a shared
    expert), a 1-layer code predictor, 4 codebooks of CODEBOOK codes; reads the thinker's layer-2 states."""
    text = _moe_text(CODEBOOK + 1024, 32, 4, 2, 16, 2, 64, 16, 32, [4, 2, 2], "qwen3_omni_moe_talker_text")
    text["rope_scaling"].pop("mrope_interleaved")
    predictor = {"attention_bias": False, "attention_dropout": 0.0, "head_dim": 16, "hidden_act": "silu",
                 "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 96,
                 "layer_types": ["full_attention"], "max_position_embeddings": 32768, "max_window_layers": 28,
                 "model_type": "qwen3_omni_moe_talker_code_predictor", "num_attention_heads": 4,
                 "num_code_groups": 4, "num_hidden_layers": 1, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
                 "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
                 "use_cache": True, "use_sliding_window": False, "vocab_size": CODEBOOK}
    codec = {"codec_pad_id": CODEC_IDS["pad"], "codec_bos_id": CODEC_IDS["bos"],
             "codec_eos_token_id": CODEC_IDS["eos"], "codec_nothink_id": CODEC_IDS["nothink"],
             "codec_think_bos_id": CODEC_IDS["think_bos"], "codec_think_eos_id": CODEC_IDS["think_eos"]}
    return {**_media_ids(), **codec, "accept_hidden_layer": 2, "code_predictor_config": predictor,
            "initializer_range": 0.02, "num_code_groups": 4, "output_router_logits": False,
            "position_id_per_seconds": 13, "seconds_per_chunk": 2, "spatial_merge_size": 2,
            "speaker_id": dict(SPEAKERS), "text_config": text, "thinker_hidden_size": 64}


def _code2wav_config() -> dict[str, Any]:
    """Code2wav: 2 sliding-window transformer layers (width 32), the published upsampling (8*5*4*3 after 2*2:
    1920 samples of 24 kHz audio per frame), decoder channels 64 -> 4."""
    return {"attention_bias": False, "attention_dropout": 0.0, "codebook_dim": 32, "codebook_size": CODEBOOK,
            "decoder_dim": 64, "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02,
            "intermediate_size": 96, "layer_scale_initial_scale": 0.01, "max_position_embeddings": 8000,
            "num_attention_heads": 2, "num_hidden_layers": 2, "num_key_value_heads": 2, "num_quantizers": 4,
            "num_semantic_quantizers": 1, "rms_norm_eps": 1e-05, "rope_theta": 10000,
            "semantic_codebook_size": 256, "sliding_window": 72, "upsample_rates": [8, 5, 4, 3],
            "upsampling_ratios": [2, 2], "vector_quantization_hidden_dimension": 32}


def tiny_config() -> dict[str, Any]:
    """The config.json of the default checkpoint (a fresh dict each call); the module docstrings give its sizes."""
    return {"architectures": [ARCHITECTURE], "assistant_token_id": ROLE_IDS["assistant"],
            "code2wav_config": _code2wav_config(), "dtype": "float32", "enable_audio_output": True,
            "im_end_token_id": TOKEN_IDS["<|im_end|>"], "im_start_token_id": TOKEN_IDS["<|im_start|>"],
            "model_type": MODEL_TYPE, "system_token_id": ROLE_IDS["system"], "talker_config": _talker_config(),
            "thinker_config": _thinker_config(), "tts_bos_token_id": TOKEN_IDS["<tts_text_bos>"],
            "tts_eos_token_id": TOKEN_IDS["<tts_text_eod>"], "tts_pad_token_id": TOKEN_IDS["<tts_pad>"],
            "user_token_id": ROLE_IDS["user"]}


TINY: dict[str, Any] = tiny_config()
"""The default checkpoint's config.json (a read-only reference: copy it, or call ``tiny_config()``). Sizes:
thinker text 3 layers, width 64, 4 heads of 32 / 2 KV heads, 4 experts of 32 top-2, vocab 1088, M-RoPE section
[6, 5, 5]; vision depth 3, width 32, 2 heads, patch 16, merge 2, temporal patch 2, 8x8 position grid, deepstack
[0, 1], out 64; audio 2 layers, width 32, 2 heads, 128 mels, conv channels 16, out 64; talker 2 layers, width 32,
4 heads of 16 / 2 KV heads, 4 experts of 16 top-2 + shared expert 32, vocab 1152, M-RoPE [4, 2, 2], reads thinker
layer 2; code predictor 1 layer, 4 code groups of 128; code2wav 2 layers, width 32, decoder 64."""

CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}\n"
    "{%- if message['content'] is string -%}\n"
    "{{- message['content'] -}}\n"
    "{%- elif message['content'] is not none -%}\n"
    "{%- for part in message['content'] -%}\n"
    "{%- set kind = part['type'] if part['type'] is defined else 'text' -%}\n"
    "{%- if kind in ('image', 'image_url') -%}\n"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}\n"
    "{%- elif kind in ('video', 'video_url') -%}\n"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}\n"
    "{%- elif kind in ('audio', 'input_audio', 'audio_url') -%}\n"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}\n"
    "{%- elif part['text'] is defined -%}\n"
    "{{- part['text'] -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}\n"
)
"""ChatML turns; a content list renders in order: text parts as their text, each image (``image``/``image_url``)
as ``<|vision_start|><|image_pad|><|vision_end|>``, each video as the same with ``<|video_pad|>``, each audio clip
(``audio``/``input_audio``/``audio_url``) as ``<|audio_start|><|audio_pad|><|audio_end|>``; the processor then
repeats each pad token once per encoder output position."""


def build_tokenizer() -> Tokenizer:
    """Qwen2's pipeline (NFC, its split pattern, byte-level) with a BPE of REGULAR_VOCAB trained on CORPUS, then
    ADDED_TOKENS at REGULAR_VOCAB + position."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=REGULAR_VOCAB, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    if tok.get_vocab_size() != REGULAR_VOCAB:  # CORPUS holds more merges than needed; a short vocab is a bug here
        raise RuntimeError(f"BPE training gave {tok.get_vocab_size()} tokens, expected {REGULAR_VOCAB}")
    for content, special in ADDED_TOKENS:  # one at a time: ids follow ADDED_TOKENS' order
        token = AddedToken(content, special=special, normalized=False)
        tok.add_special_tokens([token]) if special else tok.add_tokens([token])
    return tok


def tokenizer_config(config: Qwen3OmniConfig) -> dict[str, Any]:
    """tokenizer_config.json: Qwen2Tokenizer, the added tokens, the named media tokens the processor reads."""
    decoder = {str(TOKEN_IDS[c]): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": s} for c, s in ADDED_TOKENS}
    return {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": decoder,
            "additional_special_tokens": [c for c, s in ADDED_TOKENS[1:] if s],
            "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>", "audio_token": "<|audio_pad|>",
            "bos_token": None, "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>", "errors": "replace", "image_token": "<|image_pad|>",
            "model_max_length": config.thinker_text["max_position_embeddings"], "pad_token": "<|endoftext|>",
            "processor_class": "Qwen3OmniMoeProcessor", "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer", "unk_token": None, "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"}


def preprocessor_config(config: Qwen3OmniConfig) -> dict[str, Any]:
    """preprocessor_config.json: Whisper log-mel settings (16 kHz, 128 mels, hop 160, 300 s windows) and the
    Qwen2-VL image processor (mean/std 0.5, patch and merge sizes of the vision config; images resized to between
    4 and 64 merged 32x32 units, which keeps the tiny model's image token counts small)."""
    vision, audio = config.vision, config.audio
    unit = vision["patch_size"] * vision["spatial_merge_size"]
    return {"chunk_length": 300, "dither": 0.0, "feature_extractor_type": "WhisperFeatureExtractor",
            "feature_size": audio["num_mel_bins"], "hop_length": 160, "n_fft": 400, "n_samples": 4800000,
            "nb_max_frames": 30000, "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True,
            "sampling_rate": 16000, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
            "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessor",
            "image_std": [0.5, 0.5, 0.5], "max_pixels": unit * unit * 64, "merge_size": vision["spatial_merge_size"],
            "min_pixels": unit * unit * 4, "patch_size": vision["patch_size"], "resample": 3,
            "rescale_factor": 1 / 255, "temporal_patch_size": vision["temporal_patch_size"],
            "processor_class": "Qwen3OmniMoeProcessor"}


GENERATION_CONFIG = {"talker_max_new_tokens": 4096, "talker_repetition_penalty": 1.05, "talker_temperature": 0.9,
                     "talker_top_k": 50, "talker_top_p": 1.0}
"""generation_config.json as published: the talker's sampling defaults."""


CONV_GAIN = 0.7
"""Convolution kernels are N(0, (CONV_GAIN / sqrt(fan_in))^2): with 0.02 the code2wav decoder's ~20 stacked convs
give a waveform near 1e-7 (a parity test's absolute tolerance would pass anything), with gain 1 it saturates
at the final clamp; 0.7 gives an amplitude near 0.1."""


def init_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """The value of tensor `name` (module docstring's rules), from a generator seeded by `seed` and `name`."""
    if len(shape) == 1:
        zero = name.endswith((".bias", ".alpha", ".beta"))
        return (torch.zeros if zero else torch.ones)(shape, dtype=dtype)
    key = int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1
    gen = torch.Generator().manual_seed(key)
    std = 0.02 if len(shape) == 2 else CONV_GAIN / math.sqrt(math.prod(shape[1:]))
    return torch.randn(shape, generator=gen).mul_(std).to(dtype)


def _plan_shards(shapes: Shapes, itemsize: int, max_shard_bytes: int) -> list[Shapes]:
    """Consecutive tensors grouped into shards of at most `max_shard_bytes` (a bigger tensor gets its own)."""
    shards: list[Shapes] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def write_weights(out: Path, config: Qwen3OmniConfig, *, seed: int, max_shard_bytes: int) -> dict[str, Any]:
    """The shards and ``model.safetensors.index.json`` (``metadata.total_size`` in bytes, ``weight_map``)."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[config.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = _plan_shards(tensor_shapes(config), itemsize, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for k, shard in enumerate(shards, start=1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: init_tensor(name, shape, seed, dtype) for name, shape in shard}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = file
            total += t.numel() * itemsize
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)
    return index


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


DEFAULT_MAX_SHARD_BYTES = 400_000
"""Shard size of the tiny checkpoint: small enough that it has several shards, as the published one has 15."""


def make_qwen3omni_checkpoint(out: str | Path, *, seed: int = 0, dtype: str = "float32",
                              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                              config: dict[str, Any] | None = None) -> Qwen3OmniConfig:
    """Write the checkpoint into `out` (created; FileExistsError if it holds files) and return its config.

    `config` replaces TINY (a config.json dict of the same layout, e.g. a bigger model for a benchmark); its token
    ids must be the tiny tokenizer's. ValueError for a bad dtype, shard size or config (naming the key).
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    hf = copy.deepcopy(config) if config is not None else tiny_config()
    hf["dtype"] = dtype
    parsed = Qwen3OmniConfig.from_hf(hf)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "config.json", parsed.to_hf())
    _write_json(out / "tokenizer_config.json", tokenizer_config(parsed))
    _write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    _write_json(out / "preprocessor_config.json", preprocessor_config(parsed))
    _write_json(out / "generation_config.json", GENERATION_CONFIG)
    write_weights(out, parsed, seed=seed, max_shard_bytes=max_shard_bytes)
    write_marker(out, seed, "scripts/make_qwen3omni_checkpoint.py")
    return parsed


def write_default_checkpoint(out: str | Path = DEFAULT_QWEN3OMNI_DIR) -> Path:
    """The checkpoint serving prepares on first start (TINY, seed 0, float32), written once (``prepare_once``)."""
    return prepare_once(out, "model.safetensors.index.json", lambda tmp: make_qwen3omni_checkpoint(tmp, seed=0))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-shard-kb", type=int, default=DEFAULT_MAX_SHARD_BYTES // 1000)
    args = p.parse_args(argv)
    start = time.perf_counter()
    config = make_qwen3omni_checkpoint(args.out, seed=args.seed, dtype=args.dtype,
                                       max_shard_bytes=args.max_shard_kb * 1000)
    n_shards = len(list(args.out.glob("model-*.safetensors")))
    print(f"Qwen3-Omni checkpoint ({len(config.speakers)} voices, {n_shards} shards) written to {args.out} "
          f"in {time.perf_counter() - start:.1f} s")
