"""The stateless nodes of the Qwen3-Omni family (docs/architecture.md §8): ENCODE (the vision and audio encoders) and
CODE2WAV (codec frames -> 24 kHz PCM16). Each batches a turn's calls across requests as shapes allow; a request's
rows never depend on what they were batched with (the encoders pad each item as if alone, vision.py / audio.py).
"""

from __future__ import annotations

import torch

from models.qwen3_omni.audio import AudioEncoder
from models.qwen3_omni.code2wav import Code2Wav
from models.qwen3_omni.vision import VisionEncoder
from mstar_dist.engine.component import Component
from mstar_dist.graph.walk import NodeCall, NodeResult

IMAGE, AUDIO = 0, 1
"""Item kinds in ``mm_order``."""


class EncodeNode(Component):
    """ENCODE: one call holds a prompt's items, ``mm_order`` (n,) int64 (`IMAGE` or `AUDIO` per item, in prompt
    order); images as ``pixel_values`` (patches of every image, the image processor's) and ``image_grid`` (n_img, 3);
    clips as ``audio_features`` (mels, sum of frames) and ``audio_lengths`` (n_aud,). Outputs ``mm_embeds`` (N, Dt),
    every item's rows in prompt order (what the thinker places at its placeholders), and, with images,
    ``deepstack`` (k, Nv, Dt): the image rows' deepstack features; a prompt without items outputs nothing. Every
    image of a turn goes through one vision forward, every clip through one audio forward."""

    name = "ENCODE"

    def __init__(self, vision: VisionEncoder, audio: AudioEncoder, device: torch.device, dtype: torch.dtype) -> None:
        self.vision, self.audio, self.device, self.dtype = vision, audio, device, dtype
        self.items = 0

    @torch.inference_mode()
    def run_batch(self, calls: list[NodeCall]) -> list:
        if all(call.inputs["mm_order"].numel() == 0 for call in calls):
            return [NodeResult({}) for _ in calls]  # prompts without media: nothing to encode
        try:
            images, clips = self._items(calls)
            seen = self.vision.encode([item for per_call in images for item in per_call])
            heard = self.audio.encode([clip for per_call in clips for clip in per_call])
        except Exception as exc:  # a batch that fails fails its requests
            return [exc] * len(calls)
        out, vi, ai = [], iter(seen), iter(heard)
        for call, call_images, call_clips in zip(calls, images, clips):
            mine = [next(vi) for _ in call_images]
            sounds = [next(ai) for _ in call_clips]
            rows, imgs, auds = [], iter(mine), iter(sounds)
            for kind in call.inputs["mm_order"].reshape(-1).tolist():
                rows.append(next(imgs)[0] if kind == IMAGE else next(auds))
            outputs = {"mm_embeds": torch.cat(rows)} if rows else {}
            if mine:
                outputs["deepstack"] = torch.stack([torch.cat(layer) for layer in zip(*(d for _, d in mine))])
            out.append(NodeResult(outputs))
            self.items += len(rows)
        return out

    def _items(self, calls: list[NodeCall]) -> tuple[list[list], list[list]]:
        """Per call: its images as (patches, grid) and its clips as (mels, frames) features, on the device."""
        images, clips = [], []
        for call in calls:
            x = call.inputs
            mine, sounds = [], []
            if "image_grid" in x:
                grids = x["image_grid"].reshape(-1, 3).tolist()
                patches = x["pixel_values"].to(self.device, self.dtype).split([t * h * w for t, h, w in grids])
                mine = list(zip(patches, grids))
            if "audio_lengths" in x:
                lengths = x["audio_lengths"].reshape(-1).tolist()
                sounds = list(x["audio_features"].to(self.device, self.dtype).split(lengths, dim=1))
            images.append(mine)
            clips.append(sounds)
        return images, clips

    def stats(self) -> dict[str, int]:
        return {"encoded_items_total": self.items}


class Code2WavNode(Component):
    """CODE2WAV: one call is one chunk of a request's codec frames, ``codes`` (n_context + n, G) with
    ``codes_context`` (its first n_context frames an earlier chunk already decoded) and ``codes_final`` (the stream's
    last chunk: its stop ends the loop). Output ``audio``: the n new frames' samples, PCM16 (S,) at 24 kHz (an
    empty chunk outputs nothing). Chunks of one shape decode as one batch."""

    name = "CODE2WAV"

    def __init__(self, code2wav: Code2Wav, device: torch.device) -> None:
        self.code2wav, self.device = code2wav, device
        self.chunks = self.samples = 0

    @torch.inference_mode()
    def run_batch(self, calls: list[NodeCall]) -> list:
        out: list = [None] * len(calls)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, call in enumerate(calls):
            codes = call.inputs["codes"]
            n_context = int(call.inputs["codes_context"]) if "codes_context" in call.inputs else 0
            final = bool(call.inputs["codes_final"]) if "codes_final" in call.inputs else False
            if codes.dim() != 2 or codes.shape[0] <= n_context:
                out[i] = NodeResult({}, stop=final)
            else:
                groups.setdefault((codes.shape[0], n_context), []).append(i)
        for (_, n_context), rows in groups.items():
            try:
                codes = torch.stack([calls[i].inputs["codes"].t() for i in rows]).to(self.device).long()  # (B, G, T)
                pcm = to_pcm16(self.code2wav.decode_chunk(codes, n_context)[:, 0])  # (B, S)
            except Exception as exc:  # a broken batch fails exactly its requests
                for i in rows:
                    out[i] = exc
                continue
            for row, i in enumerate(rows):
                final = bool(calls[i].inputs["codes_final"]) if "codes_final" in calls[i].inputs else False
                out[i] = NodeResult({"audio": pcm[row].cpu()}, stop=final)
                self.samples += pcm.shape[1]
            self.chunks += len(rows)
        return out

    def stats(self) -> dict[str, int]:
        return {"code2wav_chunks_total": self.chunks, "code2wav_samples_total": self.samples}


def to_pcm16(wave: torch.Tensor) -> torch.Tensor:
    """A waveform in [-1, 1] -> int16 PCM: scaled by 32767 and rounded to nearest (clamped first)."""
    return (wave.float().clamp(-1.0, 1.0) * 32767).round().to(torch.int16)
