"""CUDA graphs of the speech codec's regular chunk: the SNAC decode of B windows of the same frame count.

An eager decode of a few 4-frame windows is a few hundred small kernels (every Snake activation alone is six), so
on a GPU the host's launches, not the device, set its time, once per chunk of every stream. A graph per
power-of-two batch replays them in one launch. The noise is drawn before the replay (``frames.row_noise``, one launch
a row, from each row's own generator) into the graph's input buffer, so a row's audio is what the eager
``frames.decode_windows`` gives it (the same kernels at the bucket's batch, up to the summation order that any other
batch also changes: docs/architecture.md §5, "Speech").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.snac.frames import noise_views, row_noise, window_codes
from models.snac.model import SnacDecoder


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    codes: list[torch.Tensor]
    """The graph's code inputs (bucket, F), (bucket, 2F), (bucket, 4F)."""
    noise: torch.Tensor | None
    """The graph's noise input (bucket, sum of the noise blocks' lengths)."""
    audio: torch.Tensor
    """The graph's output (bucket, 1, F * frame_samples)."""


class WindowGraphs:
    """Decodes of windows of ``frames`` frames, replayed from one CUDA graph per batch bucket (1, 2, 4, ... up to
    ``max_rows``); a larger batch is decoded a bucket at a time."""

    def __init__(self, decoder: SnacDecoder, frames: int, max_rows: int):
        if frames < 1 or max_rows < 1:
            raise ValueError(f"WindowGraphs: frames and max_rows must be >= 1, got {frames} and {max_rows}")
        self.decoder, self.frames = decoder, frames
        self.buckets = [1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows]
        self.noise_lengths = decoder.noise_lengths(frames)
        self._captured: dict[int, _Captured] = {}

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (the smaller ones reuse its memory pool)."""
        param = next(self.decoder.parameters())
        device = param.device
        pool = None
        for bucket in sorted(self.buckets, reverse=True):
            strides = self.decoder.config.vq_strides
            codes = [torch.zeros((bucket, self.frames * strides[0] // s), dtype=torch.long, device=device)
                     for s in strides]
            noise = torch.zeros((bucket, sum(self.noise_lengths)), dtype=param.dtype, device=device) \
                if self.noise_lengths else None
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # kernels chosen and memory allocated before the capture
                for _ in range(2):
                    self.decoder(codes, self._given(noise))
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                audio = self.decoder(codes, self._given(noise))
            pool = graph.pool()
            graph.replay()  # a graph's first replay costs more than the rest
            self._captured[bucket] = _Captured(graph, codes, noise, audio)
        torch.cuda.synchronize(device)

    def _given(self, noise: torch.Tensor | None):
        return None if noise is None else noise_views(noise, self.noise_lengths)

    @torch.inference_mode()
    def decode(self, windows: torch.Tensor, n_new: int, generators: list[torch.Generator]) -> torch.Tensor:
        """``frames.decode_windows`` of windows (B, frames, 7) on the decoder's device, replayed on the current stream:
        float32 audio (B, n_new * frame_samples), the last ``n_new`` frames of each window."""
        B, n_frames, _ = windows.shape
        if n_frames != self.frames or not 1 <= n_new <= n_frames or len(generators) != B:
            raise ValueError(f"WindowGraphs.decode: {B} windows of {n_frames} frames (captured: {self.frames}), "
                             f"n_new={n_new}, {len(generators)} generators")
        keep = n_new * self.decoder.config.frame_samples
        out = []
        for start in range(0, B, self.max_rows):
            part = windows[start:start + self.max_rows]
            n = part.shape[0]
            cap = self._captured[next(b for b in self.buckets if b >= n)]
            for into, codes in zip(cap.codes, window_codes(self.decoder, part)):
                into[:n].copy_(codes)
            if cap.noise is not None:
                row_noise(self.decoder, n_frames, generators[start:start + n], out=cap.noise)
            cap.graph.replay()
            out.append(cap.audio[:n, 0, -keep:].clone())  # the output buffer is the next replay's
        return out[0] if len(out) == 1 else torch.cat(out)
