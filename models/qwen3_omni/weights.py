"""Load the published Qwen3-Omni layout (``model.safetensors.index.json`` -> shards) into modules built on meta.

A rank loads one part of the checkpoint at a time, named by a prefix of the published tensor names:
``thinker.model.`` (the text decoder), ``thinker.lm_head.``, ``thinker.visual.``, ``thinker.audio_tower.``,
``talker.``, ``code2wav.``. Only the shards holding the wanted tensors are opened (the index says which), and a
tensor is read through a safetensors slice, so a TP rank reads only its rows or columns.

Module keys: by default a module's ``state_dict()`` key ``k`` is the checkpoint tensor ``prefix + k`` (our modules
keep the published names). A module that fuses tensors (e.g. experts stacked for grouped matmuls) passes
``sources``: its key -> the checkpoint tensors that make it, in the order they concatenate along dim 0. TP slicing
belongs to the module (docs/architecture.md §4b): a submodule with ``weight_loader(attr, parts)``
(models/common/tp.py's parallel linears, models/moe's experts) gets the parts as lazy slices and returns its shard;
any other tensor is read whole (models/common/checkpoint.py). Non-persistent buffers (rotary tables, fixed position
encodings) are not in the checkpoint: they stay on meta for the module to fill.

``tensor_shapes(config)`` lists the layout: every published tensor name with its shape. The names are the
checkpoint's as Qwen publishes them (transformers' ``Qwen3OmniMoeForConditionalGeneration`` renames some in memory,
e.g. ``thinker.model.`` -> ``thinker.model.language_model.``, and fuses the experts on load: ``qwen2_moe`` in its
``conversion_mapping.py``); at the published sizes it gives the published 28,010 tensors and 35,259,818,545
parameters.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from models.common.checkpoint import load_sharded_state
from models.qwen3_omni.config import Qwen3OmniConfig

INDEX_FILE = "model.safetensors.index.json"
"""The shard index of the published layout: ``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``."""


def _header_names(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return list(f.keys())


def read_weight_map(weights_dir: str | Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index; a directory without one (a single
    ``model.safetensors``, or shards without an index) is mapped by reading each file's header. Shards are not
    checked here: a rank may hold only the shards of its modules. FileNotFoundError naming the directory when it
    has neither; ValueError for an index without a ``weight_map`` object."""
    d = Path(weights_dir).expanduser()
    if not d.is_dir():
        raise FileNotFoundError(f"weights directory {d} does not exist")
    index = d / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: expected a non-empty 'weight_map' object")
        return dict(weight_map)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no {INDEX_FILE} and no *.safetensors files in {d}")
    return {name: f.name for f in files for name in _header_names(f)}


class ShardedCheckpoint:
    """A weights directory's tensors by published name; a shard is opened the first time one of its tensors is
    read, and stays open until ``close`` (or the end of the ``with`` block)."""

    def __init__(self, weights_dir: str | Path) -> None:
        self.weights_dir = Path(weights_dir).expanduser()
        self.weight_map = read_weight_map(self.weights_dir)
        """Tensor name -> shard file name."""
        self._stack = ExitStack()
        self._open: dict[str, Any] = {}

    def __enter__(self) -> "ShardedCheckpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    @property
    def opened_files(self) -> list[str]:
        """The shard files read so far, in the order they were opened."""
        return list(self._open)

    def names(self, prefix: str = "", exclude: Sequence[str] = ()) -> list[str]:
        """Sorted names starting with `prefix` and with none of `exclude` (from the index: no shard is opened)."""
        return sorted(n for n in self.weight_map if n.startswith(prefix) and not n.startswith(tuple(exclude)))

    def slice(self, name: str) -> Any:
        """A lazy view of tensor `name` (a safetensors slice: indexing it reads only the indexed part);
        KeyError naming the tensor when the checkpoint lacks it, FileNotFoundError naming its absent shard."""
        file = self.weight_map.get(name)
        if file is None:
            raise KeyError(f"{self.weights_dir}: no tensor {name!r}")
        handle = self._open.get(file)
        if handle is None:
            if not (self.weights_dir / file).is_file():
                raise FileNotFoundError(f"{self.weights_dir / file} is missing (it holds {name})")
            handle = self._stack.enter_context(safe_open(str(self.weights_dir / file), framework="pt", device="cpu"))
            self._open[file] = handle
        return handle.get_slice(name)

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name`, read whole."""
        return self.slice(name)[:]


class _Scope:
    """The view of a checkpoint that models/common/checkpoint.py's ``load_sharded_state`` checks against: only the
    names under one prefix count (the rest belong to other modules)."""

    def __init__(self, ckpt: ShardedCheckpoint, names: Iterable[str]) -> None:
        self._ckpt = ckpt
        self._names = set(names)

    def names(self) -> set[str]:
        return set(self._names)

    def slice(self, name: str) -> Any:
        return self._ckpt.slice(name)


def read_tensors(weights_dir: str | Path, prefix: str, *, exclude: Sequence[str] = (),
                 dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` (and none under `exclude`), keyed without the prefix, read whole from only the
    shards that hold them. ValueError when nothing in the checkpoint starts with `prefix`."""
    with ShardedCheckpoint(weights_dir) as ckpt:
        names = ckpt.names(prefix, exclude)
        if not names:
            raise ValueError(f"{ckpt.weights_dir}: no tensor starts with {prefix!r}")
        return {n[len(prefix):]: ckpt.tensor(n).to(device=device, dtype=dtype) for n in names}


def load_weights(module: nn.Module, weights_dir: str | Path, prefix: str, *, exclude: Sequence[str] = (),
                 sources: Mapping[str, Sequence[str]] | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu") -> nn.Module:
    """Assign the checkpoint's tensors under `prefix` to `module` (built on meta; its TP shard when it has
    ``weight_loader``s) and return it.

    `exclude`: prefixes under `prefix` that other modules load (e.g. ``("thinker.visual.",
    "thinker.audio_tower.")`` for a text decoder loaded with ``prefix="thinker."``). `sources`: module key ->
    full checkpoint names (module docstring); by default ``prefix + key`` for every key of ``module.state_dict()``.
    `dtype` None keeps the stored dtype. Strict: ValueError naming the module keys the checkpoint cannot fill,
    the checkpoint tensors under `prefix` that no key takes, and any shape that differs (after TP slicing).
    """
    keys = list(module.state_dict())
    plan = {k: (prefix + k,) for k in keys} if sources is None else {k: tuple(v) for k, v in sources.items()}
    unplanned = sorted(set(keys) - set(plan))
    if unplanned:
        raise ValueError(f"module keys {unplanned[:8]} have no checkpoint source (of {len(unplanned)})")
    with ShardedCheckpoint(weights_dir) as ckpt:
        used = {n for parts in plan.values() for n in parts}
        scope = set(ckpt.names(prefix, exclude)) | (used & set(ckpt.weight_map))
        missing = sorted(used - set(ckpt.weight_map))
        if missing:
            raise ValueError(f"{ckpt.weights_dir}: checkpoint lacks {len(missing)} tensors the module needs, "
                             f"e.g. {missing[:8]}")
        state = load_sharded_state(module, plan, _Scope(ckpt, scope), device=device, dtype=dtype,
                                   source=ckpt.weights_dir)
    extra = sorted(set(state) - set(keys))
    if extra:
        raise ValueError(f"sources name keys the module lacks: {extra[:8]}")
    module.load_state_dict(state, strict=True, assign=True)
    return module


# The published layout: every tensor's name and shape, from the config.
Shapes = list[tuple[str, tuple[int, ...]]]
"""(published tensor name, shape) pairs."""


def _attention(p: str, hidden: int, sub: dict[str, Any], qk_norm: bool) -> Shapes:
    """q/k/v/o projections of one decoder attention (no bias), with per-head q/k RMSNorms when `qk_norm`."""
    heads, kv = sub["num_attention_heads"], sub.get("num_key_value_heads") or sub["num_attention_heads"]
    hd = sub.get("head_dim") or hidden // heads
    out = [(p + "q_proj.weight", (heads * hd, hidden)), (p + "k_proj.weight", (kv * hd, hidden)),
           (p + "v_proj.weight", (kv * hd, hidden)), (p + "o_proj.weight", (hidden, heads * hd))]
    return out + ([(p + "q_norm.weight", (hd,)), (p + "k_norm.weight", (hd,))] if qk_norm else [])


def _swiglu(p: str, hidden: int, inter: int) -> Shapes:
    return [(p + "gate_proj.weight", (inter, hidden)), (p + "up_proj.weight", (inter, hidden)),
            (p + "down_proj.weight", (hidden, inter))]


def _moe_decoder(p: str, sub: dict[str, Any], *, shared_expert: bool) -> Shapes:
    """``{p}layers.N.*`` of a Qwen3-MoE decoder (experts per expert; the talker's blocks add a gated shared
    expert and are all sparse), then ``{p}norm.weight``."""
    d, n_exp = sub["hidden_size"], sub["num_experts"]
    out: Shapes = []
    for i in range(sub["num_hidden_layers"]):
        q = f"{p}layers.{i}."
        out += [(q + "input_layernorm.weight", (d,)), *_attention(q + "self_attn.", d, sub, qk_norm=True),
                (q + "post_attention_layernorm.weight", (d,))]
        sparse = shared_expert or (i not in sub.get("mlp_only_layers", []) and n_exp > 0
                                   and (i + 1) % sub.get("decoder_sparse_step", 1) == 0)
        if not sparse:
            out += _swiglu(q + "mlp.", d, sub["intermediate_size"])
            continue
        out.append((q + "mlp.gate.weight", (n_exp, d)))
        for e in range(n_exp):
            out += _swiglu(f"{q}mlp.experts.{e}.", d, sub["moe_intermediate_size"])
        if shared_expert:
            out += _swiglu(q + "mlp.shared_expert.", d, sub["shared_expert_intermediate_size"])
            out.append((q + "mlp.shared_expert_gate.weight", (1, d)))
    return out + [(p + "norm.weight", (d,))]


def _linear(p: str, n_in: int, n_out: int, bias: bool = True) -> Shapes:
    return [(p + "weight", (n_out, n_in))] + ([(p + "bias", (n_out,))] if bias else [])


def _audio_shapes(a: dict[str, Any]) -> Shapes:
    """``thinker.audio_tower.*``: three stride-2 3x3 convs over (mel, time), the linear into the model width, the
    encoder layers (Whisper-style, biased), the final norm and the two-layer projection to the thinker width."""
    p, d, ch = "thinker.audio_tower.", a["d_model"], a["downsample_hidden_size"]
    freq = (((a["num_mel_bins"] + 1) // 2 + 1) // 2 + 1) // 2
    out = [(p + "conv2d1.weight", (ch, 1, 3, 3)), (p + "conv2d1.bias", (ch,))]
    for conv in ("conv2d2", "conv2d3"):
        out += [(f"{p}{conv}.weight", (ch, ch, 3, 3)), (f"{p}{conv}.bias", (ch,))]
    out += _linear(p + "conv_out.", ch * freq, d, bias=False)
    for i in range(a["encoder_layers"]):
        q = f"{p}layers.{i}."
        for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
            out += _linear(f"{q}self_attn.{proj}.", d, d)
        out += [(q + "self_attn_layer_norm.weight", (d,)), (q + "self_attn_layer_norm.bias", (d,))]
        out += _linear(q + "fc1.", d, a["encoder_ffn_dim"]) + _linear(q + "fc2.", a["encoder_ffn_dim"], d)
        out += [(q + "final_layer_norm.weight", (d,)), (q + "final_layer_norm.bias", (d,))]
    out += [(p + "ln_post.weight", (d,)), (p + "ln_post.bias", (d,))]
    return out + _linear(p + "proj1.", d, d) + _linear(p + "proj2.", d, a["output_dim"])


def _merger(p: str, v: dict[str, Any], norm_width: int) -> Shapes:
    merged = v["hidden_size"] * v["spatial_merge_size"] ** 2
    return ([(p + "ln_q.weight", (norm_width,)), (p + "ln_q.bias", (norm_width,))]
            + _linear(p + "mlp.0.", merged, merged) + _linear(p + "mlp.2.", merged, v["out_hidden_size"]))


def _vision_shapes(v: dict[str, Any]) -> Shapes:
    """``thinker.visual.*``: the 3-D patch embedding, the learned position grid, the blocks, the final merger
    (norm before the 2x2 merge) and one deepstack merger per deepstack index (norm after the merge)."""
    p, d = "thinker.visual.", v["hidden_size"]
    kernel = (v["temporal_patch_size"], v["patch_size"], v["patch_size"])
    out = [(p + "patch_embed.proj.weight", (d, v["in_channels"], *kernel)), (p + "patch_embed.proj.bias", (d,)),
           (p + "pos_embed.weight", (v["num_position_embeddings"], d))]
    for i in range(v["depth"]):
        q = f"{p}blocks.{i}."
        out += [(q + "norm1.weight", (d,)), (q + "norm1.bias", (d,)), (q + "norm2.weight", (d,)),
                (q + "norm2.bias", (d,))]
        out += _linear(q + "attn.qkv.", d, 3 * d) + _linear(q + "attn.proj.", d, d)
        out += _linear(q + "mlp.linear_fc1.", d, v["intermediate_size"])
        out += _linear(q + "mlp.linear_fc2.", v["intermediate_size"], d)
    out += _merger(p + "merger.", v, d)
    for j in range(len(v["deepstack_visual_indexes"])):
        out += _merger(f"{p}merger_list.{j}.", v, d * v["spatial_merge_size"] ** 2)
    return out


def _talker_shapes(config: Qwen3OmniConfig) -> Shapes:
    """``talker.*``: codec embedding and decoder, the two resize MLPs from the thinker's width, the codec head and
    the code predictor (one embedding and one head per residual codebook)."""
    t, cp = config.talker_text, config.code_predictor
    d, thinker_d, inter = t["hidden_size"], config.talker["thinker_hidden_size"], t["intermediate_size"]
    out = [("talker.model.codec_embedding.weight", (t["vocab_size"], d))]
    out += _moe_decoder("talker.model.", t, shared_expert=True)
    for proj in ("text_projection", "hidden_projection"):
        out += _linear(f"talker.{proj}.linear_fc1.", thinker_d, inter) + _linear(f"talker.{proj}.linear_fc2.", inter, d)
    out.append(("talker.codec_head.weight", (t["vocab_size"], d)))
    p, dc = "talker.code_predictor.", cp["hidden_size"]
    for i in range(cp["num_hidden_layers"]):
        q = f"{p}model.layers.{i}."
        out += [(q + "input_layernorm.weight", (dc,)), *_attention(q + "self_attn.", dc, cp, qk_norm=True),
                (q + "post_attention_layernorm.weight", (dc,)), *_swiglu(q + "mlp.", dc, cp["intermediate_size"])]
    out.append((p + "model.norm.weight", (dc,)))
    residual = range(cp["num_code_groups"] - 1)
    out += [(f"{p}model.codec_embedding.{j}.weight", (cp["vocab_size"], dc)) for j in residual]
    return out + [(f"{p}lm_head.{j}.weight", (cp["vocab_size"], dc)) for j in residual]


def _code2wav_shapes(c: dict[str, Any]) -> Shapes:
    """``code2wav.*``: the summed per-quantizer code embedding, the transformer with layer scales, the 2x
    upsamplers (transposed conv + ConvNeXt block) and the SnakeBeta/conv decoder down to one channel."""
    d, p = c["hidden_size"], "code2wav."
    out = [(p + "code_embedding.weight", (c["codebook_size"] * c["num_quantizers"], d))]
    for i in range(c["num_hidden_layers"]):
        q = f"{p}pre_transformer.layers.{i}."
        out += [(q + "input_layernorm.weight", (d,)), *_attention(q + "self_attn.", d, c, qk_norm=False),
                *_swiglu(q + "mlp.", d, c["intermediate_size"]), (q + "post_attention_layernorm.weight", (d,)),
                (q + "self_attn_layer_scale.scale", (d,)), (q + "mlp_layer_scale.scale", (d,))]
    out.append((p + "pre_transformer.norm.weight", (d,)))
    for j, factor in enumerate(c["upsampling_ratios"]):
        q = f"{p}upsample.{j}."
        out += [(q + "0.conv.weight", (d, d, factor)), (q + "0.conv.bias", (d,)),
                (q + "1.dwconv.conv.weight", (d, 1, 7)), (q + "1.dwconv.conv.bias", (d,)), (q + "1.gamma", (d,)),
                (q + "1.norm.weight", (d,)), (q + "1.norm.bias", (d,))]
        out += _linear(q + "1.pwconv1.", d, 4 * d) + _linear(q + "1.pwconv2.", 4 * d, d)
    dim = c["decoder_dim"]
    out += [(p + "decoder.0.conv.weight", (dim, d, 7)), (p + "decoder.0.conv.bias", (dim,))]
    for i, rate in enumerate(c["upsample_rates"]):
        q, half = f"{p}decoder.{i + 1}.block.", dim // 2
        out += [(q + "0.alpha", (dim,)), (q + "0.beta", (dim,)), (q + "1.conv.weight", (dim, half, 2 * rate)),
                (q + "1.conv.bias", (half,))]
        for unit in (2, 3, 4):
            r = f"{q}{unit}."
            out += [(r + "act1.alpha", (half,)), (r + "act1.beta", (half,)), (r + "conv1.conv.weight", (half, half, 7)),
                    (r + "conv1.conv.bias", (half,)), (r + "act2.alpha", (half,)), (r + "act2.beta", (half,)),
                    (r + "conv2.conv.weight", (half, half, 1)), (r + "conv2.conv.bias", (half,))]
        dim = half
    n = len(c["upsample_rates"]) + 1
    return out + [(f"{p}decoder.{n}.alpha", (dim,)), (f"{p}decoder.{n}.beta", (dim,)),
                  (f"{p}decoder.{n + 1}.conv.weight", (1, dim, 7)), (f"{p}decoder.{n + 1}.conv.bias", (1,))]


def tensor_shapes(config: Qwen3OmniConfig) -> Shapes:
    """Every tensor of the published layout for `config`, in the order the shards hold them (encoders, thinker
    decoder and head, talker, code2wav)."""
    text = config.thinker_text
    out = _audio_shapes(config.audio) + _vision_shapes(config.vision)
    out.append(("thinker.model.embed_tokens.weight", (text["vocab_size"], text["hidden_size"])))
    out += _moe_decoder("thinker.model.", text, shared_expert=False)
    out.append(("thinker.lm_head.weight", (text["vocab_size"], text["hidden_size"])))
    if config.enable_audio_output:
        out += _talker_shapes(config) + _code2wav_shapes(config.code2wav)
    return out
