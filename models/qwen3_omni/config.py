"""Qwen3-Omni's ``config.json`` (the layout of the published ``Qwen3-Omni-30B-A3B-Instruct``), read into a typed top
level view: the token ids the prompt layout and the talker's input depend on, the codec ids and speakers of the
talker, and the sub-config dicts (``thinker_config`` with its ``text_config`` / ``vision_config`` /
``audio_config``, ``talker_config`` with its ``text_config`` / ``code_predictor_config``, ``code2wav_config``) handed
as they are to the module builders, which read their own sizes.

Pure Python (no torch): the front end reads it to check a voice or place a placeholder. A malformed config is a
ValueError naming the key (its path, e.g. ``thinker_config.text_config.vocab_size``) and the value found.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_TYPE = "qwen3_omni_moe"
"""``model_type`` of the top-level config (transformers' ``Qwen3OmniMoeConfig``)."""
ARCHITECTURE = "Qwen3OmniMoeForConditionalGeneration"
"""The class the published checkpoint names in ``architectures``."""


@dataclass(frozen=True)
class TextTokens:
    """Ids in the thinker's vocabulary that the prompt layout and the talker's input are built from."""

    im_start: int
    """``<|im_start|>`` (``im_start_token_id``): opens every chat turn."""
    im_end: int
    """``<|im_end|>`` (``im_end_token_id``): closes a turn; ends the thinker's answer."""
    system: int
    """The role word ``system`` after ``<|im_start|>`` (``system_token_id``, a plain BPE token)."""
    user: int
    """The role word ``user`` (``user_token_id``)."""
    assistant: int
    """The role word ``assistant`` (``assistant_token_id``)."""
    tts_pad: int
    """``<tts_pad>``: the talker's text-side filler while codec frames run ahead of the text."""
    tts_bos: int
    """``<tts_text_bos>``: the talker's text stream starts."""
    tts_eos: int
    """``<tts_text_eod>``: the talker's text stream ends."""
    image: int
    """``<|image_pad|>`` (``thinker_config.image_token_id``): one per merged image patch."""
    video: int
    """``<|video_pad|>`` (``thinker_config.video_token_id``): one per merged video patch."""
    audio: int
    """``<|audio_pad|>`` (``thinker_config.audio_token_id``): one per audio-encoder output frame."""
    vision_start: int
    """``<|vision_start|>``: before an image's or a video's placeholders."""
    vision_end: int
    """``<|vision_end|>``: after them."""
    audio_start: int
    """``<|audio_start|>``: before an audio clip's placeholders."""
    audio_end: int
    """``<|audio_end|>``: after them."""


@dataclass(frozen=True)
class CodecTokens:
    """Control ids in the talker's codec vocabulary (``talker_config``); codes of the first codebook are below them."""

    pad: int
    """``codec_pad_id``."""
    bos: int
    """``codec_bos_id``: the talker's first frame follows it."""
    eos: int
    """``codec_eos_token_id``: the talker's speech ends."""
    nothink: int
    """``codec_nothink_id``: first id of the talker's assistant prefix."""
    think_bos: int
    """``codec_think_bos_id``."""
    think_eos: int
    """``codec_think_eos_id``."""


_TOP_TOKENS = {"im_start": "im_start_token_id", "im_end": "im_end_token_id", "system": "system_token_id",
               "user": "user_token_id", "assistant": "assistant_token_id", "tts_pad": "tts_pad_token_id",
               "tts_bos": "tts_bos_token_id", "tts_eos": "tts_eos_token_id"}
_THINKER_TOKENS = {"image": "image_token_id", "video": "video_token_id", "audio": "audio_token_id",
                   "vision_start": "vision_start_token_id", "vision_end": "vision_end_token_id",
                   "audio_start": "audio_start_token_id", "audio_end": "audio_end_token_id"}
_CODEC_TOKENS = {"pad": "codec_pad_id", "bos": "codec_bos_id", "eos": "codec_eos_token_id",
                 "nothink": "codec_nothink_id", "think_bos": "codec_think_bos_id",
                 "think_eos": "codec_think_eos_id"}
_REQUIRED_SIZES = {
    "thinker_config.text_config": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "thinker_config.vision_config": ("depth", "hidden_size", "num_heads", "patch_size", "spatial_merge_size",
                                     "temporal_patch_size", "out_hidden_size"),
    "thinker_config.audio_config": ("d_model", "encoder_layers", "encoder_attention_heads", "num_mel_bins",
                                    "output_dim"),
    "talker_config.text_config": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"),
    "talker_config.code_predictor_config": ("vocab_size", "hidden_size", "num_hidden_layers", "num_code_groups"),
    "code2wav_config": ("codebook_size", "hidden_size", "num_hidden_layers", "num_quantizers"),
}


def _bad(path: str, value: Any, why: str) -> ValueError:
    return ValueError(f"config.json: {path}={value!r}: {why}")


def _sub(hf: Mapping[str, Any], path: str) -> dict[str, Any]:
    """A copy of the dict at dotted `path` of `hf`; ValueError naming the first key that is missing or not an
    object."""
    node: Any = hf
    walked = []
    for key in path.split("."):
        walked.append(key)
        node = node.get(key) if isinstance(node, Mapping) else None
        if not isinstance(node, Mapping):
            raise _bad(".".join(walked), node, "expected an object")
    return copy.deepcopy(dict(node))


def _int(node: Mapping[str, Any], path: str, key: str, *, below: int | None = None) -> int:
    """``node[key]`` as a non-negative int (below `below` when given); ValueError naming ``path.key``."""
    value = node.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _bad(f"{path}.{key}" if path else key, value, "expected a non-negative integer")
    if below is not None and value >= below:
        raise _bad(f"{path}.{key}" if path else key, value, f"must be below the vocabulary size {below}")
    return value


def rope_parameters(sub: Mapping[str, Any], path: str) -> dict[str, Any]:
    """One sub-config's rotary settings as transformers 5 spells them (``rope_type``, ``rope_theta`` and, for the
    multimodal ones, ``mrope_section`` / ``interleaved``), read from ``rope_parameters`` or from the older
    ``rope_scaling`` + ``rope_theta`` keys the published config.json uses. ValueError for another ``rope_type``."""
    params = sub.get("rope_parameters")
    if params is None:
        params = {**(sub.get("rope_scaling") or {}), "rope_theta": sub.get("rope_theta", 10000.0)}
    if not isinstance(params, Mapping):
        raise _bad(f"{path}.rope_parameters", params, "expected an object")
    out = {k: v for k, v in params.items() if k != "type"}
    out["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if out["rope_type"] != "default":
        raise _bad(f"{path}.rope_parameters.rope_type", out["rope_type"], "only 'default' rotary is supported")
    if not isinstance(out.get("rope_theta"), (int, float)) or out["rope_theta"] <= 0:
        raise _bad(f"{path}.rope_theta", out.get("rope_theta"), "expected a positive number")
    return out


@dataclass(frozen=True)
class Qwen3OmniConfig:
    """The top level of a Qwen3-Omni ``config.json``; ``from_hf`` validates, ``to_hf`` gives the dict back."""

    tokens: TextTokens
    """Thinker-vocabulary ids of the prompt layout."""
    codec: CodecTokens
    """Talker-vocabulary control ids."""
    speakers: Mapping[str, int]
    """Voice name (as published, lower case) -> its codec id (``talker_config.speaker_id``)."""
    thinker: Mapping[str, Any]
    """``thinker_config``, with ``text_config``, ``vision_config`` and ``audio_config`` inside."""
    talker: Mapping[str, Any]
    """``talker_config``, with ``text_config`` and ``code_predictor_config`` inside."""
    code2wav: Mapping[str, Any]
    """``code2wav_config``."""
    enable_audio_output: bool
    """Whether the checkpoint carries the talker and code2wav (``enable_audio_output``)."""
    dtype: str
    """The stored dtype's name (``dtype``, or the older ``torch_dtype``), e.g. ``"bfloat16"``."""
    hf: Mapping[str, Any]
    """The whole config.json as read (``to_hf`` returns a copy)."""

    @property
    def thinker_text(self) -> dict[str, Any]:
        """``thinker_config.text_config``: the MoE text decoder."""
        return dict(self.thinker["text_config"])

    @property
    def vision(self) -> dict[str, Any]:
        """``thinker_config.vision_config``: the vision encoder."""
        return dict(self.thinker["vision_config"])

    @property
    def audio(self) -> dict[str, Any]:
        """``thinker_config.audio_config``: the audio encoder."""
        return dict(self.thinker["audio_config"])

    @property
    def talker_text(self) -> dict[str, Any]:
        """``talker_config.text_config``: the talker's MoE decoder."""
        return dict(self.talker["text_config"])

    @property
    def code_predictor(self) -> dict[str, Any]:
        """``talker_config.code_predictor_config``: the residual-codebook predictor."""
        return dict(self.talker["code_predictor_config"])

    @property
    def num_code_groups(self) -> int:
        """Codebooks per codec frame (the talker's first plus the code predictor's residual ones)."""
        return int(self.talker["num_code_groups"])

    def speaker_id(self, voice: str) -> int:
        """The codec id of `voice` (case-insensitive); ValueError listing the checkpoint's voices."""
        sid = self.speakers.get(voice.strip().lower())
        if sid is None:
            raise ValueError(f"unknown voice {voice!r}: this checkpoint has {sorted(self.speakers)}")
        return sid

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "Qwen3OmniConfig":
        """Read and check a config.json dict; ValueError naming the first key that is missing or wrong."""
        if hf.get("model_type") != MODEL_TYPE:
            raise _bad("model_type", hf.get("model_type"), f"expected {MODEL_TYPE!r}")
        thinker = _sub(hf, "thinker_config")
        talker = _sub(hf, "talker_config")
        code2wav = _sub(hf, "code2wav_config")
        for path, keys in _REQUIRED_SIZES.items():
            node = _sub(hf, path)
            for key in keys:
                if _int(node, path, key) == 0:
                    raise _bad(f"{path}.{key}", 0, "must be positive")
        tokens = _text_tokens(hf, thinker, talker)
        codec, speakers = _codec_tokens(talker)
        _check_shapes_agree(thinker, talker, code2wav)
        dtype = hf.get("dtype", hf.get("torch_dtype", "bfloat16"))
        if dtype not in ("float32", "bfloat16", "float16"):
            raise _bad("dtype", dtype, "expected 'float32', 'bfloat16' or 'float16'")
        for path in ("thinker_config.text_config", "talker_config.text_config",
                     "talker_config.code_predictor_config", "code2wav_config"):
            rope_parameters(_sub(hf, path), path)
        return cls(tokens=tokens, codec=codec, speakers=speakers, thinker=thinker, talker=talker,
                   code2wav=code2wav, enable_audio_output=bool(hf.get("enable_audio_output", True)), dtype=dtype,
                   hf=copy.deepcopy(dict(hf)))

    def to_hf(self) -> dict[str, Any]:
        """The config.json dict (a deep copy of what ``from_hf`` read)."""
        return copy.deepcopy(dict(self.hf))


def _text_tokens(hf: Mapping[str, Any], thinker: Mapping[str, Any], talker: Mapping[str, Any]) -> TextTokens:
    """Top-level and thinker ids, each inside the thinker vocabulary; the talker's copies must agree."""
    vocab = int(thinker["text_config"]["vocab_size"])
    ids = {field: _int(hf, "", key, below=vocab) for field, key in _TOP_TOKENS.items()}
    ids.update({field: _int(thinker, "thinker_config", key, below=vocab) for field, key in _THINKER_TOKENS.items()})
    if "user_token_id" in thinker and thinker["user_token_id"] != ids["user"]:
        raise _bad("thinker_config.user_token_id", thinker["user_token_id"],
                   f"differs from user_token_id={ids['user']}")
    for field, key in _THINKER_TOKENS.items():
        if key in talker and talker[key] != ids[field]:
            raise _bad(f"talker_config.{key}", talker[key], f"differs from thinker_config.{key}={ids[field]}")
    return TextTokens(**ids)


def _codec_tokens(talker: Mapping[str, Any]) -> tuple[CodecTokens, dict[str, int]]:
    """Codec control ids and speakers, each inside the talker's vocabulary."""
    vocab = int(talker["text_config"]["vocab_size"])
    codec = CodecTokens(**{field: _int(talker, "talker_config", key, below=vocab)
                           for field, key in _CODEC_TOKENS.items()})
    raw = talker.get("speaker_id")
    if not isinstance(raw, Mapping) or not raw:
        raise _bad("talker_config.speaker_id", raw, "expected an object of voice name -> codec id")
    speakers = {}
    for name, _ in raw.items():
        if not isinstance(name, str) or not name.strip():
            raise _bad("talker_config.speaker_id", name, "voice names must be non-empty strings")
        speakers[name.strip().lower()] = _int(raw, "talker_config.speaker_id", name, below=vocab)
    return codec, speakers


def _check_shapes_agree(thinker: Mapping[str, Any], talker: Mapping[str, Any], code2wav: Mapping[str, Any]) -> None:
    """The sizes that join two modules: encoders' outputs and the talker's input match the thinker's width, the
    codebook counts and sizes of talker, code predictor and code2wav match."""
    hidden = thinker["text_config"]["hidden_size"]
    joins = [("thinker_config.vision_config.out_hidden_size", thinker["vision_config"]["out_hidden_size"], hidden),
             ("thinker_config.audio_config.output_dim", thinker["audio_config"]["output_dim"], hidden),
             ("talker_config.thinker_hidden_size", talker.get("thinker_hidden_size"), hidden),
             ("talker_config.num_code_groups", talker.get("num_code_groups"),
              talker["code_predictor_config"]["num_code_groups"]),
             ("code2wav_config.num_quantizers", code2wav["num_quantizers"], talker.get("num_code_groups")),
             ("code2wav_config.codebook_size", code2wav["codebook_size"],
              talker["code_predictor_config"]["vocab_size"]),
             ("talker_config.code_predictor_config.hidden_size", talker["code_predictor_config"]["hidden_size"],
              talker["text_config"]["hidden_size"])]
    for path, value, want in joins:
        if value != want:
            raise _bad(path, value, f"must equal {want} (the size of the module it joins)")
    layers = thinker["text_config"]["num_hidden_layers"]
    accept = _int(talker, "talker_config", "accept_hidden_layer")
    if accept > layers:
        raise _bad("talker_config.accept_hidden_layer", accept, f"the thinker has {layers} layers")


def read_config(weights_dir: str | Path) -> Qwen3OmniConfig:
    """``Qwen3OmniConfig`` of ``weights_dir/config.json``; FileNotFoundError naming the directory or file."""
    d = Path(weights_dir).expanduser()
    path = d / "config.json"
    if not d.is_dir():
        raise FileNotFoundError(f"weights directory {d} does not exist (write a small random one with "
                                f"scripts/make_qwen3omni_checkpoint.py)")
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {d} is not a Qwen3-Omni weights directory")
    return Qwen3OmniConfig.from_hf(json.loads(path.read_text()))
