"""The TALKER node: HF ``generate``'s talker loop (models/qwen3_omni/talker_io.py ``generate_codes``) as a component
that runs every request's step of a turn as one batch, with a KV slot per request (docs/architecture.md §8).

One call is one iteration of a request's ``talk`` loop, and makes one codec frame (1, G), output as ``talker_in`` (fed
back: the next call's input) and ``codes`` (streamed to CODE2WAV); codebook 0's EOS ends the loop with no frame.

- Iteration 0 (the request has no slot yet) is the prefill. ``talker_in`` is the thinker's rows (1, R, Dt): the user
  turns' U rows, then the A >= 3 rows of the assistant header (``<|im_start|>assistant\\n``...); ``text``, if the
  thinker's text has not ended without a word, is the first text row (the embedding of the first generated token).
  The first four of [header rows, text] close the prompt (talker_io ``prefill_embeds``), the rest go to the text
  feed. Conductor-made inputs: ``talker_meta`` int64 [U, A, speaker id, rope delta, top_k], ``talker_sampling``
  float64 [temperature, top_p, repetition_penalty, min_p, presence_penalty, frequency_penalty], ``user_mm`` (U,) bool, and for a prompt with media
  ``talker_positions`` (3, U + 9) (M-RoPE positions of the talker's prompt, rope.py).
- Later iterations: ``talker_in`` is the previous frame; ``text`` the next text row, or absent once the thinker's text
  has ended (the ``until_end`` input, mstar_dist/graph/nodes.py): the feed then gives ``tts_eos`` once and ``tts_pad``
  after (talker_io ``TextFeed``). The step's input is the frame's codec embeddings summed plus the feed's entry.

Each frame: codebook 0 from the logits after the request's `CodecLogitsProcessor` (repetition penalty over the codes
it made, frequency and presence penalties over them, special codes suppressed), drawn with the request's `TalkerSampling` (engine/sampling.py ``sample``: greedy or
seeded, one generator per request); the code predictor fills codebooks 1..G-1 for every row of the batch at once,
drawn with ``TalkerSampling.residual``. A request's codes depend only on its own inputs and seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.qwen3_omni.talker import Talker
from models.qwen3_omni.talker_io import (
    CodecLogitsProcessor, TalkerSampling, TextFeed, TtsEmbeds, prefill_embeds, step_embeds,
)
from mstar_dist.engine.component import Component
from mstar_dist.engine.kv_cache import StaticKVCache
from mstar_dist.engine.sampling import SamplingParams, sample, seeded
from mstar_dist.engine.scheduler import NO_FREE_SLOT
from mstar_dist.graph.walk import NodeCall, NodeResult

HEADER_ROWS = 4
"""Thinker rows that close the talker's prompt (talker_io ``ASSISTANT_PREFIX``: three header tokens and the first
text token)."""


@dataclass
class Speaker:
    """One request's talker state on this rank."""

    slot: int
    length: int
    """Positions written in its KV slot."""
    delta: int
    """Its M-RoPE decode offset (a step at cache position p rotates by p + delta)."""
    feed: TextFeed
    seen: torch.Tensor
    """(1, V) float: how often it has made each codebook-0 code (the penalties' history)."""
    sampling: TalkerSampling
    processor: CodecLogitsProcessor
    generator: torch.Generator


class TalkerEngine(Component):
    """See the module docstring. ``tts``: the projected tts embeddings (talker_io ``tts_embeds``)."""

    name = "TALKER"

    def __init__(self, talker: Talker, cache: StaticKVCache, device: torch.device, tts: TtsEmbeds) -> None:
        self.talker, self.cache, self.device, self.tts = talker, cache, device, tts
        self.config = talker.config
        self._speakers: dict[str, Speaker] = {}
        self.prefills = self.steps = self.frames = 0

    @torch.inference_mode()
    def run_batch(self, calls: list[NodeCall]) -> list:
        results: list = [None] * len(calls)
        steps = []
        for i, call in enumerate(calls):
            if call.request_id in self._speakers:
                steps.append(i)
                continue
            try:
                results[i] = self._prefill(call)
            except Exception as exc:  # one request's bad prompt fails that request only
                self.release(call.request_id)
                results[i] = exc
        if steps:
            try:
                for i, result in zip(steps, self._step([calls[i] for i in steps])):
                    results[i] = result
            except Exception as exc:  # a broken batch fails exactly its requests
                for i in steps:
                    results[i] = exc
        return results

    # ---- iteration 0 ----
    def _prefill(self, call: NodeCall):
        inputs = call.inputs
        U, A, speaker_id, delta, top_k = (int(x) for x in inputs["talker_meta"].reshape(-1).tolist())
        temperature, top_p, penalty, min_p, presence, frequency = \
            (float(x) for x in inputs["talker_sampling"].reshape(-1).tolist())
        rows = inputs["talker_in"].reshape(-1, self.config.thinker_hidden_size).to(self.device)  # (U + A, Dt)
        text = inputs.get("text")
        head = torch.cat([rows[U:U + A]] + ([text.reshape(1, -1).to(rows)] if text is not None else []))
        if head.shape[0] < HEADER_ROWS:  # the thinker's text ended before its first word: nothing to say
            return NodeResult({}, stop=True)
        if self.cache.num_free == 0:
            return NO_FREE_SLOT
        sampling = TalkerSampling(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=penalty,
                                  min_p=min_p, presence_penalty=presence, frequency_penalty=frequency)
        feed = TextFeed(self.tts)
        if head.shape[0] > HEADER_ROWS:
            feed.push(self.talker.text_projection(head[HEADER_ROWS:]))
        if text is None:
            feed.finish()
        user = rows[:U]
        prompt = prefill_embeds(self.talker, user_embeds=user, user_hidden=user,
                                user_multimodal=inputs["user_mm"].reshape(-1).bool().to(self.device),
                                assistant_embeds=head[:HEADER_ROWS], speaker_id=speaker_id, tts=self.tts)
        T = prompt.shape[0]
        given = inputs.get("talker_positions")
        positions = torch.arange(T, device=self.device)[None] if given is None else \
            given.to(self.device).long().reshape(3, 1, T)
        slot = self.cache.alloc()
        V = self.config.text.vocab_size
        speaker = self._speakers[call.request_id] = Speaker(
            slot=slot, length=T, delta=delta, feed=feed, seen=torch.zeros((1, V), device=self.device),
            sampling=sampling, processor=sampling.processor(V, self.config.suppress_tokens),
            generator=seeded(call.ctx.seed, "cpu"))
        self.cache.bind([slot], [0], T)
        logits, hidden = self.talker(prompt[None].to(self.talker.codec_head.weight.dtype), positions, self.cache,
                                     last_only=True, return_hidden=True)
        self.prefills += 1
        return self._frames([speaker], logits[:, -1], hidden[:, -1])[0]

    # ---- later iterations ----
    def _step(self, calls: list[NodeCall]) -> list[NodeResult]:
        speakers = [self._speakers[c.request_id] for c in calls]
        texts = [c.inputs.get("text") for c in calls]
        given = [t.reshape(1, -1) for t in texts if t is not None]
        projected = iter(self.talker.text_projection(torch.cat(given).to(self.device)).unbind(0)) if given else None
        entries = []
        for speaker, text in zip(speakers, texts):
            if text is not None:
                speaker.feed.push(next(projected)[None])
            elif not speaker.feed.finished:
                speaker.feed.finish()
            entry = speaker.feed.take()
            if entry is None:
                raise RuntimeError("the talker ran ahead of the thinker's text (no entry for its step)")
            entries.append(entry)
        frames = torch.cat([c.inputs["talker_in"].reshape(1, -1) for c in calls]).to(self.device).long()
        x = step_embeds(self.talker, frames, torch.stack(entries))  # (B, 1, H)
        slots, lengths = [s.slot for s in speakers], [s.length for s in speakers]
        positions = torch.tensor([[n + s.delta] for n, s in zip(lengths, speakers)], device=self.device)
        self.cache.bind(slots, lengths, 1)
        logits, hidden = self.talker(x, positions, self.cache, return_hidden=True)
        for s in speakers:
            s.length += 1
        self.steps += 1
        return self._frames(speakers, logits[:, -1], hidden[:, -1])

    def _frames(self, speakers: list[Speaker], logits: torch.Tensor, hidden: torch.Tensor) -> list[NodeResult]:
        """Each row's frame from its logits (B, V) and last hidden state (B, H): codebook 0, then the residual
        codebooks of the rows that did not end (one code predictor pass for all of them)."""
        processed = torch.cat([s.processor(logits[i:i + 1].float(), s.seen) for i, s in enumerate(speakers)])
        params = [s.sampling.params(None) for s in speakers]
        code0 = sample(processed, params, _generators(speakers, params))  # (B,)
        eos = self.config.codec.eos
        live = [i for i, code in enumerate(code0.tolist()) if code != eos]
        out = [NodeResult({}, stop=True) for _ in speakers]
        if not live:
            return out
        chosen = code0[live]
        residual_params = [speakers[i].sampling.residual(None) for i in live]
        residual_gens = _generators([speakers[i] for i in live], residual_params)

        def pick(group_logits: torch.Tensor, group: int) -> torch.Tensor:
            return sample(group_logits, residual_params, residual_gens)

        residual = self.talker.code_predictor.residual_codes(
            hidden[live], self.talker.model.codec_embedding(chosen), pick)  # (n, G - 1)
        frames = torch.cat((chosen[:, None], residual), dim=1).cpu()
        for k, i in enumerate(live):
            CodecLogitsProcessor.record(speakers[i].seen, chosen[k:k + 1])
            frame = frames[k:k + 1]
            out[i] = NodeResult({"talker_in": frame, "codes": frame})
        self.frames += len(live)
        return out

    def release(self, request_id: str) -> None:
        speaker = self._speakers.pop(request_id, None)
        if speaker is not None:
            self.cache.free(speaker.slot)

    def stats(self) -> dict[str, int]:
        return {"talker_requests": len(self._speakers), "talker_prefills_total": self.prefills,
                "talker_steps_total": self.steps, "talker_frames_total": self.frames}


def _generators(speakers: list[Speaker], params: list[SamplingParams]) -> list[torch.Generator | None]:
    """The rows' generators where they draw (a greedy row draws nothing)."""
    return [None if p.greedy else s.generator for s, p in zip(speakers, params)]
