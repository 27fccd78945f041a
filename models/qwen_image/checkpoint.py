"""Write a small random Qwen-Image checkpoint in the published diffusers layout (``Qwen/Qwen-Image``).

    python scripts/make_qwen_image_checkpoint.py --out DIR [--seed 0]

DIR gets ``model_index.json``; ``transformer/`` (QwenImageTransformer2DModel config, two safetensors shards and
their index), ``text_encoder/`` (a Qwen2.5-VL config with a small vision tower, sharded weights of the language
model, vision tower and LM head), ``vae/`` (AutoencoderKLQwenImage, encoder and decoder), ``scheduler/`` (the
published FlowMatchEulerDiscreteScheduler settings: dynamic exponential shifting, shift_terminal 0.02) and
``tokenizer/`` (a byte-level BPE trained on CORPUS with Qwen2's pre-tokenizer and Qwen2.5-VL's 22 added tokens;
the published template's prefix is DROP_IDX = 34 tokens in it, as in Qwen's vocabulary). diffusers'
``QwenImagePipeline.from_pretrained`` and transformers load it with no missing keys (a test checks it).

Values come from a generator seeded by (seed, tensor name): matrices and convolution kernels N(0, 1 / fan_in)
(variance-preserving, so the prompt visibly steers even this tiny model's noise), biases 0, norm scales 1. The directory also holds ``RANDOM_MARKER``
(``{"weights": "random-test", "seed": ..., "made_by": ...}``): its images are noise by design, and the server
says so. Nothing here imports diffusers or transformers: serving writes the default checkpoint on first start.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from mstar_dist.random_weights import MARKER, write_marker
from models.common.checkpoint import prepare_once
from models.qwen_image.transformer import QwenImageTransformer, TransformerConfig
from models.qwen_image.vae import CausalConv3d, ChannelRMSNorm, MidBlock, ResidualBlock, VaeConfig, VaeDecoder

DEFAULT_QWEN_IMAGE_DIR = "~/.cache/mstar_dist/qwen-image-tiny"
"""Where serving prepares the default checkpoint (seed 0) on first start."""
RANDOM_MARKER = MARKER
"""The file that marks a checkpoint made by scripts/ (random weights): ``mstar_dist/random_weights.py``."""
MADE_BY = "scripts/make_qwen_image_checkpoint.py"

CORPUS = ("Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships "
          "of the objects and background:\n") * 8 + """\
system
user
assistant
a red fox in the snow
a cat sitting on a wooden table next to a cup of coffee
a watercolor painting of mountains at sunrise
a city street at night with neon signs and rain
a bowl of fruit: apples, pears and grapes
a small boat on a calm lake, morning fog
a portrait of an old man with a white beard
a poster that says hello world in bold letters
two dogs playing in a green park
a castle on a hill under a starry sky
"""
"""Training text of the tiny BPE: the template's system sentence often enough that each of its words is one
token (with its leading space), as in Qwen's vocabulary, and a few image prompts."""

REGULAR_VOCAB = 1024
"""BPE tokens before the added ones (256 bytes + merges of CORPUS, fewer if CORPUS runs out of pairs)."""
TEXT_VOCAB = 1088
"""Rows of the text encoder's embedding (the tokenizer's ids padded to a multiple of 64, as Qwen pads)."""

TRANSFORMER = {"_class_name": "QwenImageTransformer2DModel", "_diffusers_version": "0.35.0.dev0",
               "attention_head_dim": 16, "axes_dims_rope": [4, 6, 6], "guidance_embeds": False, "in_channels": 64,
               "joint_attention_dim": 32, "num_attention_heads": 2, "num_layers": 2, "out_channels": 16,
               "patch_size": 2}
VAE = {"_class_name": "AutoencoderKLQwenImage", "_diffusers_version": "0.35.0.dev0", "attn_scales": [],
       "base_dim": 8, "dim_mult": [1, 2, 2], "dropout": 0.0, "num_res_blocks": 1,
       "temperal_downsample": [False, True], "z_dim": 16,
       "latents_mean": [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715,
                        0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
       "latents_std": [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652,
                       1.5579, 1.6382, 1.1253, 2.8251, 1.916]}
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.35.0.dev0",
             "base_image_seq_len": 256, "base_shift": 0.5, "invert_sigmas": False, "max_image_seq_len": 8192,
             "max_shift": 0.9, "num_train_timesteps": 1000, "shift": 1.0, "shift_terminal": 0.02,
             "stochastic_sampling": False, "time_shift_type": "exponential", "use_beta_sigmas": False,
             "use_dynamic_shifting": True, "use_exponential_sigmas": False, "use_karras_sigmas": False}
"""The published scheduler_config.json."""
MODEL_INDEX = {"_class_name": "QwenImagePipeline", "_diffusers_version": "0.35.0.dev0",
               "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
               "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
               "tokenizer": ["transformers", "Qwen2Tokenizer"],
               "transformer": ["diffusers", "QwenImageTransformer2DModel"],
               "vae": ["diffusers", "AutoencoderKLQwenImage"]}
TEXT = {"vocab_size": TEXT_VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048}
VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
          "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
          "fullatt_block_indexes": [0], "window_size": 56, "hidden_act": "silu", "tokens_per_second": 2}


TRANSFORMER_FULL = {**TRANSFORMER, "attention_head_dim": 128, "axes_dims_rope": [16, 56, 56],
                    "joint_attention_dim": 3584, "num_attention_heads": 24, "num_layers": 60}
"""Qwen/Qwen-Image's transformer/config.json: the published denoiser (about 20B parameters)."""
VAE_FULL = {**VAE, "base_dim": 96, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
            "temperal_downsample": [False, True, True]}
"""Qwen/Qwen-Image's vae/config.json."""
TEXT_FULL = {**TEXT, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 1, "num_attention_heads": 28,
             "num_key_value_heads": 4}
"""Qwen2.5-VL-7B's widths with one layer: the denoiser's conditioning is as wide as the published one's, at a fraction
of the encoder's time (the benchmarks time the denoising loop, which runs once per step)."""
LAYOUTS = {"tiny": {"transformer": TRANSFORMER, "vae": VAE, "text": TEXT, "vision": VISION, "dtype": torch.float32},
           "full": {"transformer": TRANSFORMER_FULL, "vae": VAE_FULL, "text": TEXT_FULL,
                    "vision": {**VISION, "out_hidden_size": TEXT_FULL["hidden_size"]}, "dtype": torch.bfloat16}}
"""``make_qwen_image_checkpoint``'s sizes: ``tiny`` (what serving prepares, float32) and ``full`` (the published
denoiser and VAE with a one-layer text encoder of the published width, bfloat16, about 41 GB)."""


def added_tokens() -> tuple[tuple[str, bool], ...]:
    """Qwen2.5-VL's added tokens (content, special) in id order: Qwen3-Omni's first 22."""
    from models.qwen3_omni.checkpoint import ADDED_TOKENS

    return ADDED_TOKENS[:22]


def build_tokenizer():
    """Qwen2's tokenizer pipeline with a BPE trained on CORPUS, then the added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    from models.qwen3_omni.checkpoint import PRETOKENIZE_REGEX

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
    for content, special in added_tokens():
        token = AddedToken(content, special=special, normalized=False)
        tok.add_special_tokens([token]) if special else tok.add_tokens([token])
    return tok


def tokenizer_config(tok) -> dict[str, Any]:
    decoder = {str(tok.token_to_id(c)): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                         "single_word": False, "special": s} for c, s in added_tokens()}
    return {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": decoder,
            "additional_special_tokens": [c for c, s in added_tokens()[1:] if s], "bos_token": None,
            "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
            "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}


def text_encoder_config(tok, layout: dict = LAYOUTS["tiny"]) -> dict[str, Any]:
    """A Qwen2.5-VL config.json (transformers' layout) for the layout's text and vision widths with the tokenizer's
    ids."""
    text, vision = layout["text"], layout["vision"]
    ids = {name: tok.token_to_id(c) for name, c in (
        ("bos_token_id", "<|endoftext|>"), ("eos_token_id", "<|im_end|>"), ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"))}
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    section = [head_dim // 8, head_dim // 8, head_dim // 2 - 2 * (head_dim // 8)]
    text = {**text, "model_type": "qwen2_5_vl_text", "hidden_act": "silu", "attention_dropout": 0.0,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": text["num_hidden_layers"],
            "rope_parameters": {"rope_type": "default", "type": "mrope", "mrope_section": section,
                                "rope_theta": 1000000.0},
            "bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"], "tie_word_embeddings": False}
    return {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "dtype": "float32",
            "tie_word_embeddings": False, "text_config": text, "vision_config": {**vision,
                                                                                 "model_type": "qwen2_5_vl_vision"},
            **{k: v for k, v in ids.items() if k not in ("bos_token_id", "eos_token_id")}}


def text_encoder_shapes(layout: dict = LAYOUTS["tiny"]) -> dict[str, tuple[int, ...]]:
    """Every tensor of Qwen2_5_VLForConditionalGeneration as transformers saves it (``model.*``, ``visual.*``,
    ``lm_head``)."""
    text, vision = layout["text"], layout["vision"]
    d, inter, kv = text["hidden_size"], text["intermediate_size"], text["num_key_value_heads"]
    kv_dim = kv * d // text["num_attention_heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (TEXT_VOCAB, d), "model.norm.weight": (d,),
                                          "lm_head.weight": (TEXT_VOCAB, d)}
    for i in range(text["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (d, d), p + "self_attn.q_proj.bias": (d,),
                       p + "self_attn.k_proj.weight": (kv_dim, d), p + "self_attn.k_proj.bias": (kv_dim,),
                       p + "self_attn.v_proj.weight": (kv_dim, d), p + "self_attn.v_proj.bias": (kv_dim,),
                       p + "self_attn.o_proj.weight": (d, d), p + "mlp.gate_proj.weight": (inter, d),
                       p + "mlp.up_proj.weight": (inter, d), p + "mlp.down_proj.weight": (d, inter)})
    v, vi, ps = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    merged = v * vision["spatial_merge_size"] ** 2
    shapes["visual.patch_embed.proj.weight"] = (v, vision["in_channels"], vision["temporal_patch_size"], ps, ps)
    for i in range(vision["depth"]):
        p = f"visual.blocks.{i}."
        shapes.update({p + "norm1.weight": (v,), p + "norm2.weight": (v,), p + "attn.qkv.weight": (3 * v, v),
                       p + "attn.qkv.bias": (3 * v,), p + "attn.proj.weight": (v, v), p + "attn.proj.bias": (v,),
                       p + "mlp.gate_proj.weight": (vi, v), p + "mlp.gate_proj.bias": (vi,),
                       p + "mlp.up_proj.weight": (vi, v), p + "mlp.up_proj.bias": (vi,),
                       p + "mlp.down_proj.weight": (v, vi), p + "mlp.down_proj.bias": (v,)})
    shapes.update({"visual.merger.ln_q.weight": (v,), "visual.merger.mlp.0.weight": (merged, merged),
                   "visual.merger.mlp.0.bias": (merged,), "visual.merger.mlp.2.weight": (vision["out_hidden_size"],
                                                                                          merged),
                   "visual.merger.mlp.2.bias": (vision["out_hidden_size"],)})
    return shapes


class _VaeEncoderLayout(nn.Module):
    """The names and shapes of the published VAE's encoder half + quant_conv (built on meta, never run)."""

    def __init__(self, c: VaeConfig) -> None:
        super().__init__()
        dims = [c.base_dim * u for u in (1, *c.dim_mult)]
        enc = nn.Module()
        enc.conv_in = CausalConv3d(3, dims[0], (3, 3, 3))
        enc.down_blocks = nn.ModuleList()
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(c.num_res_blocks):
                enc.down_blocks.append(ResidualBlock(cin, cout))
                cin = cout
            if i != len(c.dim_mult) - 1:
                down = nn.Module()
                down.resample = nn.Sequential(nn.Identity(), nn.Conv2d(cout, cout, 3, stride=2))
                if c.temperal_downsample[i]:
                    down.time_conv = CausalConv3d(cout, cout, (3, 1, 1))
                enc.down_blocks.append(down)
        enc.mid_block = MidBlock(dims[-1])
        enc.norm_out = ChannelRMSNorm(dims[-1])
        enc.conv_out = CausalConv3d(dims[-1], 2 * c.z_dim, (3, 3, 3))
        self.encoder = enc
        self.quant_conv = CausalConv3d(2 * c.z_dim, 2 * c.z_dim, (1, 1, 1))


def init_tensor(name: str, shape: tuple[int, ...], seed: int, device: str = "cpu") -> torch.Tensor:
    """The value of tensor ``name`` (module docstring's rules), from a generator seeded by ``seed`` and ``name``, drawn
    on ``device`` (another device draws other values; the full size's billions are drawn on a GPU)."""
    import hashlib

    if len(shape) == 1 or name.endswith(".gamma"):
        return (torch.zeros if name.endswith(".bias") else torch.ones)(shape)
    key = int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1
    gen = torch.Generator(device).manual_seed(key)
    std = 1.0 / math.sqrt(math.prod(shape[1:]))
    return torch.randn(shape, generator=gen, device=device).mul_(std)


def write_tensors(out: Path, shapes: dict[str, tuple[int, ...]], seed: int, stem: str, shards: int,
                  dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
    """``shapes`` as ``shards`` safetensors files (``{stem}.safetensors`` when 1, else ``{stem}-0000K-of-0000N``
    plus ``{stem}.safetensors.index.json``), in ``dtype``, drawn on ``device``."""
    names = sorted(shapes)
    per = math.ceil(len(names) / shards)
    weight_map: dict[str, str] = {}
    total = 0
    for k in range(shards):
        file = f"{stem}.safetensors" if shards == 1 else f"{stem}-{k + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {n: init_tensor(n, shapes[n], seed, device).to(dtype).cpu() for n in names[k * per:(k + 1) * per]}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if shards > 1:
        _write_json(out / f"{stem}.safetensors.index.json",
                    {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _module_shapes(*modules: nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for m in modules for n, t in m.state_dict().items()}


def make_qwen_image_checkpoint(out: str | Path, *, seed: int = 0, size: str = "tiny", device: str = "cpu") -> Path:
    """Write the checkpoint of ``size`` (``LAYOUTS``) into ``out`` (created; FileExistsError if it holds files), its
    values drawn on ``device``; returns ``out``."""
    if size not in LAYOUTS:
        raise ValueError(f"size must be one of {sorted(LAYOUTS)}, got {size!r}")
    layout = LAYOUTS[size]
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    for sub in ("transformer", "text_encoder", "vae", "scheduler", "tokenizer"):
        (out / sub).mkdir()
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer" / "tokenizer.json"))
    _write_json(out / "tokenizer" / "tokenizer_config.json", tokenizer_config(tok))
    _write_json(out / "text_encoder" / "config.json", text_encoder_config(tok, layout))
    write = functools.partial(write_tensors, seed=seed, dtype=layout["dtype"], device=device)
    write(out / "text_encoder", text_encoder_shapes(layout), stem="model", shards=2)
    vae_config = VaeConfig.from_dict(layout["vae"])
    with torch.device("meta"):
        transformer = QwenImageTransformer(TransformerConfig.from_dict(layout["transformer"]))
        vae = (VaeDecoder(vae_config), _VaeEncoderLayout(vae_config))
    shapes = _module_shapes(transformer)
    _write_json(out / "transformer" / "config.json", layout["transformer"])
    # shards of about 2 GB (the published layout has 9 of about 5 GB): one is held in memory while it is written
    write(out / "transformer", shapes, stem="diffusion_pytorch_model",
          shards=max(2, sum(math.prod(v) for v in shapes.values()) * 2 // (2 << 30)))
    _write_json(out / "vae" / "config.json", layout["vae"])
    write(out / "vae", _module_shapes(*vae), stem="diffusion_pytorch_model", shards=1)
    _write_json(out / "scheduler" / "scheduler_config.json", SCHEDULER)
    _write_json(out / "model_index.json", MODEL_INDEX)
    write_marker(out, seed, MADE_BY)
    return out


def write_default_checkpoint(out: str | Path = DEFAULT_QWEN_IMAGE_DIR) -> Path:
    """The checkpoint serving prepares on first start (seed 0), written once (``prepare_once``)."""
    return prepare_once(out, "model_index.json", lambda tmp: make_qwen_image_checkpoint(tmp, seed=0))
