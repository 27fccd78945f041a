"""Streaming text-to-speech of the Orpheus shape: a Llama-family LLM writes audio-code tokens, a SNAC 24 kHz codec
decoder turns them into PCM while the LLM is still writing.

Two partitions of one request, joined by a streaming edge:

- ``speech`` (walks ``prefill`` then ``decode``, node ``LLM``): the prompt is Orpheus's
  ``[start_of_human] <|begin_of_text|> "{voice}: {text}" <|eot_id|> [end_of_human, start_of_ai, start_of_speech]``.
  The prefill runs it without its last token; the ``decode`` loop starts from that token, so every audio code
  comes from one walk. Each step's token is emitted (counted as a completion token, no text) and streamed to
  ``CODEC``. Sampling is restricted to the audio codes and ``end_of_speech`` (which stops the loop).
- ``audio`` (walk ``codec``, node ``CODEC``): a loop over chunks of the token stream with
  ``SlidingWindow(28, 7)``: the first chunk after 4 frames (28 codes), then one per frame (7 new codes), and
  exactly one final chunk when the LLM is done. Each chunk decodes the frames completed since the last one
  with up to 3 earlier frames as left context and emits their PCM16 samples (``frame_samples`` per frame:
  2048 at 24 kHz); a trailing incomplete frame is dropped. Total samples = complete frames x frame_samples.

Token -> code: ``(id - audio_offset) mod codebook_size`` (Orpheus writes frame position ``p`` in the range
``audio_offset + p * codebook_size``; the modulo also accepts a code written in another position's range).
Frame layout and decoding: :mod:`models.snac.model`.

Weights: ``weights`` is the LLM's HF directory (config.json, safetensors, tokenizer); the codec's directory is
``model_kwargs.codec_weights`` (default ``<weights>/snac``). The default path is prepared on first start with a
tiny random checkpoint of both layouts (``scripts/make_speech_checkpoint.py``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from mstar_dist.config.engine import EngineConfig
from mstar_dist.engine.component import Component
from mstar_dist.engine.sampling import seeded, to_device
from mstar_dist.events import MediaDelta
from mstar_dist.graph.model import RequestState, WalkStep
from mstar_dist.graph.nodes import EMIT_TO_CLIENT, Edge, GraphNode, Loop, Section
from mstar_dist.graph.partitions import Partition, StreamingEdge
from mstar_dist.graph.streaming import SlidingWindow
from mstar_dist.graph.walk import NodeCall, NodeResult
from mstar_dist.random_weights import mark_prepared
from models.llama.chat import DECODE_LOOP, LLM, MAX_DECODE_ITERS, LlamaChat

log = logging.getLogger(__name__)

CODEC = "CODEC"
VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
"""The speaker names Orpheus was fine-tuned with (its prompt starts with ``"{voice}: "``)."""
CODES_PER_FRAME = 7
WINDOW = 28
"""Codes per codec chunk: 4 frames."""
STRIDE = 7
"""New codes between chunks: one frame."""
CONTEXT_FRAMES = 3
"""Earlier frames decoded with the new ones (their samples are not emitted again)."""
CODEC_GRAPH_ROWS = 64
"""The most windows one codec graph replay decodes (on CUDA with ``engine.cuda_graphs``); a step of 256 streams
completes about 37 windows on average (a chunk every 7 codes), a larger batch replays more than once."""
DEFAULT_SPEECH_DIR = "~/.cache/mstar_dist/orpheus-tiny"
SAMPLING_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "repetition_penalty": 1.1}
"""The sampling of canopylabs/orpheus-3b-0.1-ft's model card (its inference example), for every knob a request
leaves out: the repetition penalty (over the prompt and the codes so far) keeps the speech stable (Orpheus-TTS's
README: at least 1.1), and greedy decoding falls into a loop of a few frames."""
MAX_TOKENS = 1200
"""The model card's ``max_new_tokens``: the most codes (about 14 s of audio) a request gets when it names no
budget of its own."""


class SpeechCodec(Component):
    """The ``CODEC`` node: chunks of code tokens -> PCM16 of the frames they complete (see the module docstring).

    Per request it keeps the codes seen so far and the frames already emitted; ``release`` forgets them."""

    name = CODEC

    def __init__(self, decoder: torch.nn.Module, *, audio_offset: int, codebook_size: int, device: torch.device,
                 graph_rows: int = 0):
        """``graph_rows`` > 0 (CUDA): the regular chunk's windows (``WINDOW`` codes) decode from CUDA graphs of up to
        that many windows a replay (models/snac/graphs.py), captured by ``warmup``."""
        from models.snac.frames import decode_windows, to_pcm16

        self.decoder, self.device = decoder, device
        self.audio_offset, self.codebook_size = audio_offset, codebook_size
        self._decode_windows, self._to_pcm16 = decode_windows, to_pcm16
        self.graphs = None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if graph_rows > 0 and device.type == "cuda":
            from models.snac.graphs import WindowGraphs

            self.graphs = WindowGraphs(decoder, WINDOW // CODES_PER_FRAME, graph_rows)
        self._codes: dict[str, list[int]] = {}
        self._frames_done: dict[str, int] = {}
        self.chunks = 0
        self.samples = 0

    @torch.inference_mode()
    def run_batch(self, calls: list[NodeCall]) -> list[NodeResult | BaseException | None]:
        """Chunks of every request at once: windows of the same length decode as one batch (each row with its
        own noise generator, so a request's audio does not depend on the batch)."""
        out: list[NodeResult | BaseException | None] = [None] * len(calls)
        groups: dict[tuple[int, int], list[tuple[int, torch.Tensor, torch.Generator, bool]]] = {}
        for i, call in enumerate(calls):
            try:
                work = self._take_chunk(call)
            except Exception as exc:  # one request's bad chunk fails that request only
                out[i] = exc
                continue
            if isinstance(work, NodeResult):
                out[i] = work
            else:
                window, n_new, gen, final = work
                groups.setdefault((window.shape[0], n_new), []).append((i, window, gen, final))
        for (_, n_new), rows in groups.items():
            try:
                pcm = self._decode(torch.stack([r[1] for r in rows]), n_new, [r[2] for r in rows])
            except Exception as exc:  # a broken batch fails exactly its requests
                for i, *_ in rows:
                    out[i] = exc
                continue
            for row, (i, _, _, final) in enumerate(rows):
                self.samples += pcm.shape[1]
                out[i] = NodeResult(outputs={"audio": pcm[row]}, stop=final)
        return out

    def _decode(self, windows: torch.Tensor, n_new: int, gens: list[torch.Generator]) -> torch.Tensor:
        """Windows (B, F, 7) on the host -> PCM16 (B, n_new * frame_samples) on the host. On CUDA the work runs on
        the codec's own stream, so that it neither waits for a decode step of the LLM queued on the same device nor
        makes the LLM's next step wait for it (the two share the GPU), and its copies go through pinned memory."""
        if self.stream is None:
            return self._to_pcm16(self._decode_windows(self.decoder, windows.to(self.device), n_new, gens))
        with torch.cuda.stream(self.stream):
            windows = to_device(windows, self.device)
            if self.graphs is not None and windows.shape[1] == self.graphs.frames:
                audio = self.graphs.decode(windows, n_new, gens)
            else:
                audio = self._decode_windows(self.decoder, windows, n_new, gens)
            pcm = self._to_pcm16(audio)
            host = torch.empty(pcm.shape, dtype=pcm.dtype, pin_memory=True)
            host.copy_(pcm, non_blocking=True)
            self.stream.synchronize()
        return host

    def _take_chunk(self, call: NodeCall):
        """Add a chunk's new codes to its request; a NodeResult when no frame completed, else what to decode:
        (window (F, 7) of up to CONTEXT_FRAMES earlier frames + the new ones, n_new, generator, final)."""
        rid = call.request_id
        tokens = call.inputs["token"].reshape(-1).tolist()
        n_context = int(call.inputs["token_context"]) if "token_context" in call.inputs else 0
        final = bool(call.inputs["token_final"]) if "token_final" in call.inputs else False
        codes = self._codes.setdefault(rid, [])
        span = CODES_PER_FRAME * self.codebook_size
        codes.extend((t - self.audio_offset) % self.codebook_size for t in tokens[n_context:]
                     if self.audio_offset <= t < self.audio_offset + span)
        frames, done = len(codes) // CODES_PER_FRAME, self._frames_done.get(rid, 0)
        self.chunks += 1
        if final:
            self.release(rid)
        else:
            self._frames_done[rid] = frames
        if frames == done:
            return NodeResult(outputs={}, stop=final)
        first = max(0, done - CONTEXT_FRAMES)
        window = torch.tensor(codes[first * CODES_PER_FRAME: frames * CODES_PER_FRAME], dtype=torch.long)
        # the decoder's noise blocks draw from a generator seeded by the walk and the frame: the same audio on
        # every placement for a pinned request
        gen = seeded((call.ctx.seed + done) & 0x7FFF_FFFF_FFFF_FFFF, self.device)
        return window.view(-1, CODES_PER_FRAME), frames - done, gen, final

    def warmup(self) -> None:
        if self.graphs is None:
            return
        try:
            with torch.cuda.stream(self.stream):
                self.graphs.capture()
        except Exception as exc:  # the eager decode gives the same audio, only slower: serve with it, and say why
            log.warning("CODEC: its CUDA graphs could not be captured (%s: %s); windows decode eagerly",
                        type(exc).__name__, exc)
            self.graphs = None

    def release(self, request_id: str) -> None:
        self._codes.pop(request_id, None)
        self._frames_done.pop(request_id, None)

    def stats(self) -> dict[str, int]:
        return {"codec_chunks_total": self.chunks, "codec_samples_total": self.samples}


class OrpheusSpeech(LlamaChat):
    """``model_kwargs``: those of :class:`LlamaChat` plus ``codec_weights`` (the SNAC directory). Request knob:
    ``voice`` (one of :data:`VOICES`, default ``tara``). Sampling knobs a request leaves out take
    :data:`SAMPLING_DEFAULTS`, and a request without ``max_tokens`` gets at most :data:`MAX_TOKENS` codes."""

    name = "orpheus"
    output_modality = "audio"

    def __init__(self, weights_dir: str | None, **model_kwargs: Any):
        codec = model_kwargs.pop("codec_weights", None)
        super().__init__(weights_dir or DEFAULT_SPEECH_DIR, **model_kwargs)
        self.weights_dir = str(Path(self.weights_dir).expanduser())
        self.codec_dir = str(Path(codec).expanduser()) if codec else str(Path(self.weights_dir) / "snac")
        self.tokens = None

    def graphs(self) -> dict[str, Section]:
        prefill = GraphNode(LLM, inputs=("input_ids",), outputs=(Edge("kv", persist=True),))
        decode = Loop(
            GraphNode(LLM, inputs=("token",), optional_inputs=("kv", "prompt_ids"), outputs=(
                Edge("token", LLM), Edge("token", EMIT_TO_CLIENT), Edge("token", CODEC, stream=True))),
            max_iters=MAX_DECODE_ITERS, name=DECODE_LOOP,
        )
        codec = Loop(GraphNode(CODEC, inputs=("token",), optional_inputs=("token_final", "token_context"),
                               outputs=(Edge("audio", EMIT_TO_CLIENT),)),
                     max_iters=MAX_DECODE_ITERS, name="codec")
        return {"prefill": prefill, "decode": decode, "codec": codec}

    def partitions(self) -> list[Partition]:
        return [Partition("speech", ("prefill", "decode")), Partition("audio", ("codec",))]

    def streaming_edges(self) -> list[StreamingEdge]:
        return [StreamingEdge("token", "speech", "audio", CODEC, SlidingWindow(WINDOW, STRIDE))]

    def weights_dirs(self) -> list[str]:
        return [self.weights_dir, self.codec_dir]

    def prepare_weights(self) -> None:
        if Path(self.weights_dir).is_dir():
            if Path(self.weights_dir) == Path(DEFAULT_SPEECH_DIR).expanduser():
                for directory in (self.weights_dir, self.codec_dir):
                    mark_prepared(directory, 0, "scripts/make_speech_checkpoint.py")
            return
        if Path(self.weights_dir) != Path(DEFAULT_SPEECH_DIR).expanduser():
            raise FileNotFoundError(f"weights: {self.weights_dir} does not exist (only the default "
                                    f"{DEFAULT_SPEECH_DIR} is prepared automatically)")
        from models.speech.checkpoint import write_tiny_speech_checkpoint

        write_tiny_speech_checkpoint(Path(self.weights_dir))

    # ---- rank side ----
    def build_component(self, node: str, *, device: str, walks: set[str], engine: EngineConfig | None = None
                        ) -> Component:
        tokens = self._speech_tokens()
        if node == CODEC:
            from models.snac import load_snac

            decoder = load_snac(self.codec_dir, device=device, dtype=torch.float32)
            config = (engine or self.engine).on(device, 1)
            return SpeechCodec(decoder, audio_offset=tokens.audio_offset, codebook_size=tokens.codebook_size,
                               device=torch.device(device),
                               graph_rows=CODEC_GRAPH_ROWS if config.cuda_graphs else 0)
        return super().build_component(node, device=device, walks=walks, engine=engine)

    def _logit_bias(self, model: torch.nn.Module) -> torch.Tensor:
        """Sampling restricted to the audio codes and ``end_of_speech``."""
        tokens = self._speech_tokens()
        bias = torch.full((model.embed.weight.shape[0],), float("-inf"))
        bias[tokens.audio_offset: tokens.audio_offset + CODES_PER_FRAME * tokens.codebook_size] = 0.0
        bias[tokens.end_of_speech] = 0.0
        return bias

    def _speech_tokens(self):
        if self.tokens is None:
            from models.llama.speech_tokens import SpeechTokens
            from models.snac import read_snac_config

            cfg = read_snac_config(self.codec_dir)
            self.tokens = SpeechTokens.from_tokenizer_dir(self.weights_dir, cfg.codebook_size)
            self.frame_samples, self.sample_rate = cfg.frame_samples, cfg.sampling_rate
        return self.tokens

    # ---- conductor side ----
    def load_frontend(self) -> None:
        super().load_frontend()
        self._speech_tokens()

    def stop_token_ids(self) -> list[int]:
        return [self.tokens.end_of_speech]

    def preprocess(self, state: RequestState, prompt: str | None, messages: list[dict] | None) -> None:
        knobs = dict(state.knobs)
        voice = knobs.pop("voice", "tara")
        if unknown := sorted(knobs):
            raise ValueError(f"model_kwargs: unknown knob(s) {unknown} for a speech model (known: voice)")
        if voice not in VOICES:
            raise ValueError(f"voice {voice!r} is not one of this model's voices: {', '.join(VOICES)}")
        state.sampling_defaults.update(SAMPLING_DEFAULTS)
        if not state.max_tokens_given:
            state.max_tokens = min(state.max_tokens, MAX_TOKENS)
        text = prompt if prompt is not None else "\n".join(m["content"] for m in messages or [] if m["role"] == "user")
        if not text.strip():
            raise ValueError("input is empty: send the text to speak")
        ids = self.tokens.prompt_ids(voice, text)
        if len(ids) + state.max_tokens > self._context:
            if state.max_tokens_given or len(ids) >= self._context:
                raise ValueError(f"the input is {len(ids)} tokens and max_tokens is {state.max_tokens}: together "
                                 f"they exceed the context of {self._context} tokens; shorten the input")
            state.max_tokens = self._context - len(ids)
        state.prompt_tokens = len(ids)
        state.data["input_ids"] = torch.tensor(ids, dtype=torch.long)

    def start(self, state: RequestState) -> list[WalkStep]:
        ids = state.data.pop("input_ids")
        state.data["last"] = ids[-1:].clone()
        if state.penalized:  # a decode rank that imports the KV needs what the prefill ran
            state.data["prompt_ids"] = ids[:-1]
        return [WalkStep("prefill", {"input_ids": ids[:-1]}), WalkStep("codec", {})]

    def after_walk(self, state: RequestState, walk: str, outputs: dict[str, Any]) -> WalkStep | None:
        if walk == "prefill":  # the decode loop starts from the prompt's last token (on another rank: with the KV)
            return WalkStep("decode", self.decode_inputs(state, state.data.pop("last"), outputs),
                            loop_limits={DECODE_LOOP: state.max_tokens})
        return None

    def postprocess(self, state: RequestState, signal: str, values: list[Any]) -> Any:
        if signal == "token":
            state.completion_tokens += sum(v.numel() for v in values)
            return ""
        pcm = torch.cat([v.reshape(-1) for v in values]).to(torch.int16)
        meta = {"sample_rate": self.sample_rate, "num_channels": 1, "tokens_so_far": state.completion_tokens}
        return MediaDelta("audio", pcm.numpy().tobytes(), meta)

    def finish_text(self, state: RequestState) -> str:
        return ""
