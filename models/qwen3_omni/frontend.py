"""The conductor's half of the Qwen3-Omni family: a request's knobs, media and prompt -> what its walks take.

- **Knobs** (`read_knobs`): ``voice`` (a speaker of the checkpoint; an unknown one is a ValueError listing them) and
  the talker's own sampling, ``talker_temperature``, ``talker_top_k``, ``talker_top_p``, ``talker_min_p``,
  ``talker_repetition_penalty``, ``talker_presence_penalty``, ``talker_frequency_penalty``, ``talker_max_new_tokens``
  (defaults: the checkpoint's generation_config.json, else HF ``generate``'s). The thinker samples with the
  request's own knobs (every route's temperature, top_p, top_k, min_p and penalties, through its KV engine).
- **Media** (`decode_media`): each image or clip decoded by mstar_dist.media within the request's limits, in prompt
  order; a bad item or a breached limit is a ValueError naming the item (``messages[0].content[1]``) and, for a
  limit, its config key and value (``media.max_image_pixels = 16777216``).
- **Prompt** (`Frontend.prompt`): messages (with their media as content parts, where the client put them) through
  the checkpoint's chat template, tokenized; placeholders expanded and images / log-mel made by processor.py; the
  thinker's M-RoPE positions and decode offset by rope.py.
- **The talker's inputs** (`Frontend.talker_inputs`): which thinker rows it reads (the user turns' positions, hidden
  state at a placeholder, embedding elsewhere; then the assistant header) and its own prompt's positions.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.llama.chat_template import compile_chat_template, render_chat_template
from models.llama.tokenizer import ChatTokenizer
from models.qwen3_omni import processor as proc
from models.qwen3_omni.config import Qwen3OmniConfig
from models.qwen3_omni.nodes import AUDIO, IMAGE
from models.qwen3_omni.rope import RopeTokens, rope_index
from models.qwen3_omni.talker import TalkerConfig
from models.qwen3_omni.talker_io import (
    ASSISTANT_PREFIX, TalkerSampling, assistant_start, multimodal_mask, prompt_ids, user_positions,
)
from mstar_dist.events import MediaItem, MediaLimits
from mstar_dist.media.audio import decode_audio
from mstar_dist.media.errors import MediaError
from mstar_dist.media.image import decode_image
from mstar_dist.media.sniff import describe, sniff

LIMIT_KEYS = {"max_pixels": "media.max_image_pixels", "max_seconds": "media.max_audio_seconds",
              "max_bytes": "media.max_item_bytes"}
"""A decoder's limit parameter -> the deployment key that sets it."""
IMAGE_TYPES = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg", "image/webp": "webp"}
"""Declared image MIME types the model reads -> the container they name."""
TALKER_DEFAULTS = {"talker_temperature": 0.9, "talker_top_k": 50, "talker_top_p": 1.0,
                   "talker_repetition_penalty": 1.05, "talker_max_new_tokens": 4096, "talker_min_p": 0.0,
                   "talker_presence_penalty": 0.0, "talker_frequency_penalty": 0.0}
"""HF ``generate``'s talker defaults, for a checkpoint whose generation_config.json leaves one out (HF's talker has
no min-p, presence or frequency penalty: off)."""
DEFAULT_VOICE = "ethan"
"""HF ``generate``'s default speaker (when the checkpoint has it; else its first voice)."""


@dataclass(frozen=True)
class SpeechKnobs:
    """How one request's answer is spoken."""

    speaker_id: int
    """The voice's codec id (``talker_config.speaker_id``)."""
    sampling: TalkerSampling
    """How the talker draws codebook 0 (and, from it, the residual codebooks)."""
    max_frames: int
    """Most codec frames (``talker_max_new_tokens``): 12.5 a second of audio."""


def read_knobs(knobs: dict[str, Any], config: Qwen3OmniConfig, defaults: dict[str, Any]) -> SpeechKnobs:
    """The request's family knobs (``model_kwargs`` beyond sampling; chat's ``audio.voice``); ValueError naming an
    unknown knob, a bad value or an unknown voice."""
    if unknown := sorted(set(knobs) - {"voice", *TALKER_DEFAULTS}):
        raise ValueError(f"model_kwargs: unknown knob(s) {unknown} for Qwen3-Omni (known: voice, "
                         f"{', '.join(TALKER_DEFAULTS)})")
    voice = knobs.get("voice")
    voice = voice if voice is not None else DEFAULT_VOICE if DEFAULT_VOICE in config.speakers \
        else sorted(config.speakers)[0]
    if not isinstance(voice, str):
        raise ValueError(f"voice must be a string, one of {sorted(config.speakers)}; got {voice!r}")
    value = {**defaults, **{k: v for k, v in knobs.items() if k != "voice" and v is not None}}
    frames = value["talker_max_new_tokens"]
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
        raise ValueError(f"talker_max_new_tokens must be an int >= 1, got {frames!r}")
    top_k = value["talker_top_k"]
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"talker_top_k must be an int >= 0, got {top_k!r}")
    try:
        sampling = TalkerSampling(temperature=value["talker_temperature"], top_k=top_k,
                                  top_p=value["talker_top_p"], repetition_penalty=value["talker_repetition_penalty"],
                                  min_p=value["talker_min_p"], presence_penalty=value["talker_presence_penalty"],
                                  frequency_penalty=value["talker_frequency_penalty"])
    except ValueError as exc:  # "talker sampling: SamplingParams.temperature must be ..."
        raise ValueError(f"{exc} (knobs talker_temperature, talker_top_k, talker_top_p, talker_min_p, "
                         f"talker_repetition_penalty, talker_presence_penalty, talker_frequency_penalty)") from None
    return SpeechKnobs(speaker_id=config.speaker_id(voice), sampling=sampling, max_frames=frames)


# ---- media ------------------------------------------------------------------------------------------------------

def in_prompt_order(media: list[MediaItem]) -> list[MediaItem]:
    """The items in the order their placeholders take in the prompt: by message, then place in it, then as sent."""
    return sorted(media, key=lambda item: (item.message, item.offset))


def decode_media(media: list[MediaItem], limits: MediaLimits, config: proc.PreprocessorConfig
                 ) -> list[np.ndarray]:
    """Each item (in the given order) decoded: an image to uint8 RGB (H, W, 3), a clip to mono float32 at the
    feature extractor's rate. ValueError naming the item, and the limit key and value it breaches."""
    out = []
    for item in media:
        try:
            out.append(_decode(item, limits, config))
        except MediaError as exc:
            message = str(exc)
            if exc.limit in LIMIT_KEYS:
                message = message.replace(f"{exc.limit} = ", f"{LIMIT_KEYS[exc.limit]} = ")
            raise ValueError(f"{item.source}: {message}") from None
    return out


def _decode(item: MediaItem, limits: MediaLimits, config: proc.PreprocessorConfig) -> np.ndarray:
    if item.kind == "audio":
        clip = decode_audio(item.data, format=item.format or None, target_rate=config.audio.sampling_rate,
                            max_bytes=limits.max_item_bytes, max_seconds=limits.max_audio_seconds)
        if clip.shape[0] < config.audio.min_samples:
            raise MediaError(f"the audio clip is {clip.shape[0] / config.audio.sampling_rate * 1000:.1f} ms long, "
                             f"shorter than the {config.audio.min_samples / config.audio.sampling_rate * 1000:.1f} "
                             f"ms the model's features need")
        return clip
    if item.kind != "image":
        raise MediaError(f"a {item.kind!r} item cannot be read by this model (images and audio only)")
    declared = item.format.strip().lower()
    if declared:
        if declared not in IMAGE_TYPES:
            raise MediaError(f"unsupported image type {item.format!r}; send {', '.join(sorted(IMAGE_TYPES))}")
        found = sniff(item.data)
        if found is not None and found != IMAGE_TYPES[declared]:
            raise MediaError(f"the image's type is given as {item.format!r} but the data is {describe(found)}; "
                             f"declare its real type or send {IMAGE_TYPES[declared].upper()} data")
    image = decode_image(item.data, max_bytes=limits.max_item_bytes, max_pixels=limits.max_image_pixels)
    proc.image_grid(image.shape[0], image.shape[1], config.image)  # an aspect ratio the model cannot take
    return image


def chat_with_media(messages: list[dict[str, str]], media: list[MediaItem]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them: a message that held media becomes a list of content parts,
    its text cut where each item stood (``MediaItem.offset``), each item a part of its kind."""
    placed: dict[int, list[MediaItem]] = {}
    for item in in_prompt_order(media):
        if not 0 <= item.message < len(messages):
            raise ValueError(f"{item.source}: refers to message {item.message}, but there are {len(messages)}")
        placed.setdefault(item.message, []).append(item)
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        items = placed.get(i)
        if not items:
            out.append(message)
            continue
        text, parts, at = message["content"], [], 0
        for item in items:
            if item.offset > at:
                parts.append({"type": "text", "text": text[at:item.offset]})
                at = item.offset
            parts.append({"type": item.kind})
        if at < len(text):
            parts.append({"type": "text", "text": text[at:]})
        out.append({"role": message["role"], "content": parts})
    return out


# ---- the prompt -------------------------------------------------------------------------------------------------

@dataclass
class OmniPrompt:
    """A request's prompt, ready for the encoders, the thinker and the talker's inputs."""

    ids: list[int]
    """Token ids, placeholders expanded."""
    images: proc.ImageInputs | None
    audio: proc.AudioInputs | None
    order: list[int]
    """The items' kinds in prompt order (`IMAGE`, `AUDIO`)."""
    positions: np.ndarray | None
    """(3, S) M-RoPE positions; None for a prompt without media (0..S-1 on every axis)."""
    delta: int
    """The thinker's decode offset (``rope_delta``)."""

    @property
    def grids(self) -> list[list[int]]:
        return self.images.grid_thw.tolist() if self.images is not None else []

    @property
    def audio_lengths(self) -> list[int]:
        return self.audio.lengths.tolist() if self.audio is not None else []


class Frontend:
    """What the conductor loads of a checkpoint to turn requests into walk inputs (see the module docstring)."""

    def __init__(self, weights_dir: str | Path, config: Qwen3OmniConfig) -> None:
        d = Path(weights_dir)
        self.config = config
        self.tokenizer = ChatTokenizer(d)
        self.tokenizer.incremental_decoder()  # the id -> bytes table now, not in the first request
        source = json.loads((d / "tokenizer_config.json").read_text()).get("chat_template")
        if source is None:
            raise ValueError(f"{d / 'tokenizer_config.json'}: no chat_template (Qwen3-Omni's chat needs one)")
        self.template = compile_chat_template(source)
        self.preprocessor = proc.PreprocessorConfig.load(d / "preprocessor_config.json")
        self.rope = RopeTokens.from_hf(dict(config.thinker))
        talker = dict(config.talker)
        self.talker_rope = dataclasses.replace(
            self.rope, spatial_merge_size=int(talker.get("spatial_merge_size", self.rope.spatial_merge_size)),
            position_id_per_seconds=int(talker.get("position_id_per_seconds", self.rope.position_id_per_seconds)))
        self.talker = TalkerConfig.from_hf(config.to_hf())
        generation = d / "generation_config.json"
        given = json.loads(generation.read_text()) if generation.is_file() else {}
        self.talker_defaults = {k: given.get(k, v) for k, v in TALKER_DEFAULTS.items()}

    def prompt(self, prompt: str | None, messages: list[dict] | None, media: list[MediaItem],
               limits: MediaLimits | None, ids: list[int] | None = None) -> OmniPrompt:
        """The request's prompt (``ids``: its tokens as an intake encoded them, for a prompt without media)."""
        if media and messages is None:
            raise ValueError("images and audio go in messages (content parts), not with a raw prompt")
        if not media:
            ids = ids if ids is not None else self.tokenizer.encode_prompt(prompt, messages)
            if not ids:
                raise ValueError("the prompt is empty after tokenization: send some text")
            return OmniPrompt(ids=list(ids), images=None, audio=None, order=[], positions=None, delta=0)
        if limits is None:
            raise ValueError("media limits are missing for a request with media")
        media = in_prompt_order(media)
        decoded = decode_media(media, limits, self.preprocessor)
        text = render_chat_template(self.template, chat_with_media(messages, media), add_generation_prompt=True,
                                    special_tokens=self.tokenizer.special_tokens)
        t = self.config.tokens
        prepared = proc.prepare_prompt(
            self.tokenizer.encode(text), config=self.preprocessor, image_token_id=t.image, audio_token_id=t.audio,
            images=[x for x, m in zip(decoded, media) if m.kind == "image"],
            clips=[x for x, m in zip(decoded, media) if m.kind == "audio"])
        out = OmniPrompt(ids=prepared.ids, images=prepared.images, audio=prepared.audio, positions=None, delta=0,
                         order=[IMAGE if m.kind == "image" else AUDIO for m in media])
        out.positions, out.delta = rope_index(out.ids, self.rope, out.grids, out.audio_lengths)
        return out

    def talker_inputs(self, p: OmniPrompt, knobs: SpeechKnobs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(``talker_rows`` (2, U + A) for the thinker's prefill, the ``talk`` walk's inputs); ValueError for a
        prompt the talker cannot start from (no assistant turn, or a header shorter than its three tokens)."""
        tokens = self.talker.tokens
        ids = torch.tensor(p.ids, dtype=torch.long)
        S = ids.numel()
        start = assistant_start(ids, tokens)
        A = S - start
        if A < 3:
            raise ValueError("the prompt must end with the assistant turn's header '<|im_start|>assistant\\n' for "
                             "a spoken answer")
        user = user_positions(ids, tokens)
        user_mm = multimodal_mask(ids, tokens)[user]
        rows = torch.stack((torch.cat((user, torch.arange(start, S))),
                            torch.cat((user_mm.long(), torch.zeros(A, dtype=torch.long)))))
        inputs = {"user_mm": user_mm}
        delta = 0
        if p.positions is not None:
            talker_ids = prompt_ids(ids[user], tokens).tolist()
            try:
                positions, delta = rope_index(talker_ids, self.talker_rope, p.grids, p.audio_lengths)
            except ValueError:
                raise ValueError("for a spoken answer every image and audio clip must be in a user message") from None
            inputs["talker_positions"] = torch.from_numpy(positions)
        s = knobs.sampling
        inputs["talker_meta"] = torch.tensor([user.numel(), A, knobs.speaker_id, delta, s.top_k])
        inputs["talker_sampling"] = torch.tensor([s.temperature, s.top_p, s.repetition_penalty, s.min_p,
                                                  s.presence_penalty, s.frequency_penalty], dtype=torch.float64)
        return rows, inputs

    def talker_prompt_length(self, p: OmniPrompt) -> int:
        """Positions of the talker's prompt: the user turns' tokens plus its 9 assistant positions."""
        return int(user_positions(torch.tensor(p.ids), self.talker.tokens).numel()) + ASSISTANT_PREFIX
