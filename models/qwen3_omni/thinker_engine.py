"""The THINKER node: the thinker's text decoder run by the KV engine (engine/kv_engine.py), plus what the talker reads
of it (docs/architecture.md §8, multimodal inputs).

`OmniThinkerLM` is the model the engine runs. A prefill may carry the encoders' output (``mm_embeds`` (N, Dt), the
image and audio rows in prompt order, placed at the prompt's placeholder tokens; ``deepstack`` (k, Nv, Dt), added
after the first k layers at the image tokens), M-RoPE ``position_ids`` (3, T) and the decode ``position_offset``;
and, for a request that speaks, ``talker_rows`` (2, R): prompt positions (row 0) and whether each takes the
accept-layer hidden state (1, a placeholder of the user turns) or the input embedding (0). Its forward then also
returns ``talker_in`` (1, R, Dt), those rows: one item on the streaming edge into the talker (the talker's prompt,
HF ``generate``'s user part and assistant header).

`ThinkerEngine` adds the per-token half: for a request whose decode walk was started with ``speak``, every decode
step also outputs ``text`` (1, Dt), the input embedding of the token it read (HF's ``hidden_states[0]`` of that
step); the first is the talker prompt's first text row, each later one feeds one talker step. Other requests cost a
set lookup per turn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from models.qwen3_omni.thinker import Qwen3OmniThinker
from mstar_dist.engine.kv_engine import KVCacheEngine
from mstar_dist.graph.walk import NodeCall, NodeResult


class OmniThinkerLM(nn.Module):
    """`Qwen3OmniThinker` with the serving inputs above: ``forward(input_ids, positions, cache, last_only,
    last_index, *, mm_embeds, deepstack, talker_rows)``, what the KV engine calls (extra inputs on a prefill only)."""

    prefill_inputs = ("mm_embeds", "deepstack", "talker_rows")
    """Prefill call inputs the engine hands ``forward`` (a prompt with any of them is a forward of its own)."""
    position_offsets = True
    """Decode positions are the cache position plus the request's ``rope_delta`` (rope.py)."""

    def __init__(self, thinker: Qwen3OmniThinker, *, image_token: int, placeholders: Sequence[int],
                 accept_layer: int) -> None:
        super().__init__()
        self.thinker = thinker
        self.local_kv_heads = thinker.local_kv_heads
        self.pads_are_inert = thinker.pads_are_inert
        self.image_token, self.accept_layer = image_token, accept_layer
        device = thinker.embed.weight.device
        self.register_buffer("placeholders", torch.tensor(list(placeholders), device=device), persistent=False)

    @property
    def embed(self) -> nn.Embedding:
        return self.thinker.embed

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, last_only: bool = False,
                last_index: torch.Tensor | None = None, *, mm_embeds: torch.Tensor | None = None,
                deepstack: torch.Tensor | None = None, talker_rows: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """fp32 logits (the thinker's); with ``talker_rows`` (one prompt, B = 1) also ``{"talker_in": (1, R, Dt)}``."""
        embeds = layers = visual = None
        if mm_embeds is not None:
            embeds = self.thinker.embed_input(input_ids, mm_embeds, torch.isin(input_ids, self.placeholders))
        if deepstack is not None:
            layers, visual = list(deepstack.unbind(0)), input_ids == self.image_token
        kwargs = dict(inputs_embeds=embeds, deepstack=layers, visual_mask=visual)
        if talker_rows is None:
            return self.thinker(input_ids, positions, cache, last_only, last_index, **kwargs)
        capture = sorted({0, self.accept_layer})
        logits, captured = self.thinker(input_ids, positions, cache, last_only, last_index, capture=capture,
                                        **kwargs)
        embedded, hidden = captured[0][0], captured[capture.index(self.accept_layer)][0]  # (T, Dt) each
        rows = talker_rows.to(input_ids.device).long()
        take, use_hidden = rows[0], rows[1].bool()
        picked = torch.where(use_hidden[:, None], hidden[take], embedded[take])  # (R, Dt)
        return logits, {"talker_in": picked[None]}


class ThinkerEngine(KVCacheEngine):
    """The KV engine of `OmniThinkerLM`, whose decode steps also output ``text`` for requests that speak (a decode
    call with the ``speak`` input marks its request; ``release`` forgets it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._speaking: set[str] = set()

    def run_batch(self, calls: list[NodeCall]) -> list:
        for call in calls:
            if "speak" in call.inputs:
                self._speaking.add(call.request_id)
        results = super().run_batch(calls)
        if self._speaking:
            self._add_text(calls, results)
        return results

    @torch.inference_mode()
    def _add_text(self, calls: list[NodeCall], results: list) -> None:
        """Each finished decode step of a speaking request: the input embedding of the token it read, (1, Dt)."""
        rows = [i for i, (call, result) in enumerate(zip(calls, results))
                if isinstance(result, NodeResult) and call.request_id in self._speaking and "token" in call.inputs]
        if not rows:
            return
        tokens = torch.cat([calls[i].inputs["token"].reshape(1).to(self.device) for i in rows]).long()
        embedded = self.model.embed(tokens)  # (n, Dt)
        for k, i in enumerate(rows):
            results[i].outputs["text"] = embedded[k:k + 1]

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self._speaking.discard(request_id)
