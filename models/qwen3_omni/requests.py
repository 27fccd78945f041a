"""One Qwen3-Omni request planned on the conductor (``Qwen3Omni.preprocess``): its knobs checked, its prompt built
(frontend.py), and the inputs of each walk it will run kept in ``state.data``:

- ``first``: (walk, inputs) of the thinker's first walk, ``prefill``: token ids, and with media M-RoPE
  ``position_ids`` and ``position_offset`` and ENCODE's patches / log-mel features in prompt order; with
  ``talker_rows`` when the answer is spoken;
- ``decode_inputs``: what the ``decode`` walk adds to its first token: the decode offset (it travels with the KV to a
  decode rank elsewhere) and ``speak`` (its steps then stream their token embeddings to the talker);
- ``talk``: (the ``talk`` walk's inputs, its frame budget), or None for a text-only answer;
- ``decoder``: the incremental detokenizer.

A raw ``prompt`` (not chat ``messages``) with a spoken answer asked for and no assistant turn of its own is taken as
the user's message of a one-turn chat: the talker starts from the chat's assistant turn (e.g. ``/v1/audio/speech``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from models.qwen3_omni.frontend import OmniPrompt, read_knobs
from mstar_dist.graph.model import RequestState
from mstar_dist.transport.inline import encode_ids

if TYPE_CHECKING:
    from models.qwen3_omni.frontend import Frontend


def plan_request(fe: Frontend, state: RequestState, prompt: str | None, messages: list[dict] | None, *,
                 context: int, talker_positions: int) -> None:
    """Fill ``state.data`` (module docstring); ValueError with a message for the client on a bad request.
    ``context``: the thinker's context in tokens; ``talker_positions``: the talker's KV positions per request
    (``engine.max_seq_len``: its prompt and its frames)."""
    speak = "audio" in (state.output_modalities or ("text",))
    knobs = read_knobs(state.knobs, fe.config, fe.talker_defaults)
    ids = state.data.pop("prompt_ids", None)  # encoded by an HTTP intake (prompt_encoder), text only
    if speak and messages is None and prompt is not None and not state.media:
        ids = ids if ids is not None else fe.tokenizer.encode_prompt(prompt, None)
        if not _opens_assistant_turn(ids, fe.config.tokens.im_start, fe.config.tokens.assistant):
            messages, prompt, ids = [{"role": "user", "content": prompt}], None, None
    p = fe.prompt(prompt, messages, state.media, state.media_limits, ids)
    _fit_context(state, len(p.ids), context)
    state.prompt_tokens = len(p.ids)
    inputs, decode_inputs = thinker_inputs(p)
    talk = None
    if speak:
        rows, talk_inputs = fe.talker_inputs(p, knobs)
        inputs["talker_rows"] = rows
        decode_inputs["speak"] = torch.tensor([1])
        room = talker_positions - fe.talker_prompt_length(p)
        if room < 1:
            raise ValueError(f"the talker's prompt of {fe.talker_prompt_length(p)} positions leaves no room for "
                             f"audio in engine.max_seq_len = {talker_positions}; shorten the prompt")
        talk = (talk_inputs, min(knobs.max_frames, room))
    state.data.update(first=("prefill", inputs), decode_inputs=decode_inputs,
                      talk=talk, decoder=fe.tokenizer.incremental_decoder())


def thinker_inputs(p: OmniPrompt) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the first walk's inputs, what the decode walk adds): ids, and for a prompt with media its positions, offset
    and items (ENCODE's inputs)."""
    inputs: dict[str, Any] = {"input_ids": encode_ids(p.ids)}  # as it goes on the wire: no tensor for a text prompt
    decode_inputs: dict[str, Any] = {}
    if p.positions is not None:
        inputs["position_ids"] = torch.from_numpy(p.positions)
    if p.delta:
        inputs["position_offset"] = decode_inputs["position_offset"] = torch.tensor([p.delta])
    inputs["mm_order"] = torch.tensor(p.order, dtype=torch.long)  # empty without media: ENCODE answers at once
    if p.images is not None:
        inputs["pixel_values"] = torch.from_numpy(p.images.pixel_values)
        inputs["image_grid"] = torch.from_numpy(p.images.grid_thw)
    if p.audio is not None:
        inputs["audio_features"] = torch.from_numpy(np.concatenate(p.audio.features, axis=1))
        inputs["audio_lengths"] = torch.from_numpy(p.audio.lengths)
    return inputs, decode_inputs


def _opens_assistant_turn(ids: list[int], im_start: int, assistant: int) -> bool:
    return any(a == im_start and b == assistant for a, b in zip(ids, ids[1:]))


def _fit_context(state: RequestState, n: int, context: int) -> None:
    """Lower a max_tokens the client left to the service to what the context leaves; ValueError when it cannot fit."""
    if n + state.max_tokens > context and not state.max_tokens_given and n < context:
        state.max_tokens = context - n
    if n + state.max_tokens > context:
        raise ValueError(f"the prompt is {n} tokens and max_tokens is {state.max_tokens}: together they exceed the "
                         f"context of {context} tokens; shorten the prompt or lower max_tokens")
