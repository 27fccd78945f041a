"""Qwen3-Omni as a composite model (docs/architecture.md §4): images and audio in, text and speech out.

Nodes: ``ENCODE`` (vision + audio encoders, nodes.py), ``THINKER`` (the KV engine over the thinker's decoder,
thinker_engine.py), ``TALKER`` (talker + code predictor, talker_engine.py), ``CODE2WAV`` (codec frames -> PCM16,
nodes.py). Three partitions of one request:

- ``thinker``: ``prefill`` (ENCODE -> THINKER: the encoders' rows placed at the prompt's placeholders, deepstack,
  M-RoPE positions; a walk across ranks when ENCODE sits elsewhere; for a prompt without media ENCODE answers at
  once with nothing), then the ``decode`` loop (the decode offset travels with the KV when decode runs on another
  rank). One prefill walk for every prompt: a streamed signal has one producing walk (its items' order on the
  consumer is that walk's).
- ``talk``: one loop of TALKER. Its first iteration is the talker's prefill from ``talker_in``, the rows the
  thinker's prefill streams (its prompt's user turns and assistant header); each later one takes the previous frame
  (fed back as ``talker_in``) and one entry of ``text``, the decode steps' token embeddings, streamed rank to rank:
  ``text`` is read until its stream ends (``GraphNode.until_end``): the talker waits for the thinker's next token,
  and once the thinker is done goes on with ``tts_eos`` then ``tts_pad``, as HF ``generate`` feeds it. Each frame
  streams to CODE2WAV.
- ``code2wav``: a loop of CODE2WAV over chunks of ``chunk`` frames (25) with up to ``left_context`` (25) frames of
  left context (`LeftContext`), exactly one final chunk at the end; each chunk's audio goes to the client.

A request whose ``output_modalities`` lack "audio" runs only the thinker partition (``start_done``): the thinker then
streams nothing. Conductor-side work (knobs, media, prompt, positions) is frontend.py's.

``model_kwargs``: ``dtype`` (float32 | bfloat16 | float16; default float32 on CPU, bfloat16 on CUDA), ``router`` (the
router of every MoE block of the thinker and the talker: models/moe/routers.py), ``chunk`` and ``left_context`` (the
code2wav chunk policy), ``talker_max_new_tokens`` (the frame budget of a request that sets none; default the
checkpoint's generation_config.json). Request knobs: frontend.read_knobs. The default weights (no ``weights:``) are
the tiny random checkpoint of the published layout, written on first start (checkpoint.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from models.moe.routers import parse_router_spec, resolve_router
from models.qwen3_omni.checkpoint import DEFAULT_QWEN3OMNI_DIR
from mstar_dist.config.engine import EngineConfig, check_model_kwargs
from mstar_dist.engine.component import Component
from mstar_dist.events import MediaDelta
from mstar_dist.graph.model import CompositeModel, RequestState, WalkStep
from mstar_dist.graph.nodes import EMIT_TO_CLIENT, Edge, GraphNode, Loop, Section, Sequential
from mstar_dist.graph.partitions import Partition, StreamingEdge
from mstar_dist.graph.streaming import Fixed, LeftContext
from mstar_dist.random_weights import mark_prepared

if TYPE_CHECKING:
    from mstar_dist.distributed.tp import TPGroup

ENCODE, THINKER, TALKER, CODE2WAV = "ENCODE", "THINKER", "TALKER", "CODE2WAV"
DECODE_LOOP, TALK_LOOP, CODE2WAV_LOOP = "decode", "talk", "code2wav"
MAX_ITERS = 1 << 20
MODEL_KWARGS = ("dtype", "router", "chunk", "left_context", "talker_max_new_tokens")
SAMPLE_RATE = 24000
"""The codec's output rate (code2wav.SAMPLE_RATE)."""
MEDIA_INPUTS = ("mm_order", "pixel_values", "image_grid", "audio_features", "audio_lengths")
"""What ENCODE reads of a request (nodes.EncodeNode)."""
TALK_INPUTS = ("talker_meta", "talker_sampling", "user_mm", "talker_positions")
"""What the conductor gives the talker's first iteration (talker_engine.py)."""


class Qwen3Omni(CompositeModel):
    """See the module docstring."""

    name = "qwen3_omni"
    output_modality = "text"
    output_modalities = frozenset({"text", "audio"})
    input_modalities = frozenset({"text", "image", "audio"})
    tp_nodes = frozenset({THINKER})
    default_weights_dir = DEFAULT_QWEN3OMNI_DIR

    def __init__(self, weights_dir: str | None, **model_kwargs: Any):
        check_model_kwargs(model_kwargs)
        if unknown := sorted(set(model_kwargs) - set(MODEL_KWARGS)):
            raise ValueError(f"model_kwargs: unknown keys {unknown} (allowed: {', '.join(MODEL_KWARGS)})")
        super().__init__(str(Path(weights_dir or DEFAULT_QWEN3OMNI_DIR).expanduser()), **model_kwargs)
        self.router = model_kwargs.get("router")
        if self.router is not None:
            resolve_router(parse_router_spec(self.router)[0])  # a bad spec is a config error now
        frames = model_kwargs.get("talker_max_new_tokens", 1)
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
            raise ValueError(f"model_kwargs.talker_max_new_tokens must be an int >= 1, got {frames!r}")
        try:
            self.policy = LeftContext(chunk=model_kwargs.get("chunk", 25),
                                      left_context=model_kwargs.get("left_context", 25))
        except ValueError as exc:
            raise ValueError(f"model_kwargs.chunk / left_context: {exc}") from None
        self.frontend = None

    # ---- the graph ----
    def graphs(self) -> dict[str, Section]:
        encode = GraphNode(ENCODE, inputs=("mm_order",), optional_inputs=MEDIA_INPUTS[1:],
                           outputs=(Edge("mm_embeds", THINKER), Edge("deepstack", THINKER)))
        prefill = Sequential(encode, GraphNode(
            THINKER, inputs=("input_ids",),
            optional_inputs=("position_ids", "position_offset", "talker_rows", "mm_embeds", "deepstack"),
            outputs=(Edge("token", EMIT_TO_CLIENT), Edge("token"), Edge("kv", persist=True),
                     Edge("talker_in", TALKER, stream=True))))
        decode = Loop(GraphNode(THINKER, inputs=("token",), optional_inputs=("kv", "position_offset", "speak"),
                                outputs=(Edge("token", THINKER), Edge("token", EMIT_TO_CLIENT),
                                         Edge("text", TALKER, stream=True))),
                      max_iters=MAX_ITERS, outputs=("token",), name=DECODE_LOOP)
        talk = Loop(GraphNode(TALKER, inputs=("talker_in",), optional_inputs=TALK_INPUTS, until_end=("text",),
                              outputs=(Edge("talker_in", TALKER), Edge("codes", CODE2WAV, stream=True))),
                    max_iters=MAX_ITERS, name=TALK_LOOP)
        code2wav = Loop(GraphNode(CODE2WAV, inputs=("codes",), optional_inputs=("codes_final", "codes_context"),
                                  outputs=(Edge("audio", EMIT_TO_CLIENT),)), max_iters=MAX_ITERS, name=CODE2WAV_LOOP)
        return {"prefill": prefill, "decode": decode, "talk": talk, "code2wav": code2wav}

    def partitions(self) -> list[Partition]:
        return [Partition("thinker", ("prefill", "decode")), Partition("talk", ("talk",)),
                Partition("code2wav", ("code2wav",))]

    def streaming_edges(self) -> list[StreamingEdge]:
        one = Fixed(1, continue_after_done=True)  # one item per talker run; nothing more once the thinker is done
        return [StreamingEdge("talker_in", "thinker", "talk", TALKER, one),
                StreamingEdge("text", "thinker", "talk", TALKER, one),
                StreamingEdge("codes", "talk", "code2wav", CODE2WAV, self.policy)]

    def prepare_weights(self) -> None:
        from models.qwen3_omni.checkpoint import write_default_checkpoint

        path = Path(self.weights_dir)
        if (path / "config.json").is_file():
            if path == Path(DEFAULT_QWEN3OMNI_DIR).expanduser():  # prepared before makers wrote the marker
                mark_prepared(path, 0, "scripts/make_qwen3omni_checkpoint.py")
            return
        if path != Path(DEFAULT_QWEN3OMNI_DIR).expanduser():
            raise FileNotFoundError(f"weights: {path} is not a Qwen3-Omni checkpoint directory (only the default "
                                    f"{DEFAULT_QWEN3OMNI_DIR} is prepared automatically)")
        write_default_checkpoint(path)

    # ---- rank side ----
    def build_component(self, node: str, *, device: str, walks: set[str], engine: EngineConfig | None = None,
                        tp: TPGroup | None = None) -> Component:
        from models.qwen3_omni import serving

        dtype = self._dtype(device)
        builders = {ENCODE: serving.encode_node, THINKER: serving.thinker_engine, TALKER: serving.talker_engine,
                    CODE2WAV: serving.code2wav_node}
        if node not in builders:
            raise ValueError(f"{self.name}: no component named {node!r} (nodes: {sorted(builders)})")
        kwargs = {"tp": tp} if node == THINKER else {}
        return builders[node](self.weights_dir, device=device, dtype=dtype, engine=engine or self.engine,
                              router=self.router, **kwargs)

    def _dtype(self, device: str) -> torch.dtype:
        name = self.model_kwargs.get("dtype") or ("bfloat16" if device.startswith("cuda") else "float32")
        dtype = getattr(torch, str(name), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"model_kwargs.dtype: {name!r} is not a floating dtype")
        return dtype

    # ---- conductor side ----
    def load_frontend(self) -> None:
        from models.qwen3_omni.config import read_config
        from models.qwen3_omni.frontend import Frontend

        config = read_config(self.weights_dir)
        self.frontend = Frontend(self.weights_dir, config)
        if "talker_max_new_tokens" in self.model_kwargs:  # the deployment's default budget
            self.frontend.talker_defaults["talker_max_new_tokens"] = self.model_kwargs["talker_max_new_tokens"]
        positions = int(config.thinker_text.get("max_position_embeddings", 1 << 30))
        self._context = min(self.engine.max_seq_len, positions)

    @property
    def max_context_tokens(self) -> int:
        return self._context

    def stop_token_ids(self) -> list[int]:
        return sorted(self.frontend.tokenizer.eos_token_ids)

    def prompt_encoder(self) -> tuple[str, dict[str, Any]] | None:
        return "models.llama.tokenizer:ChatTokenizer", {"weights_dir": str(self.weights_dir)}

    @property
    def id_signals(self) -> frozenset[str]:
        return frozenset({"token"})

    def start_done(self, state: RequestState) -> set[str]:
        return set() if state.data["talk"] is not None else {"talk", "code2wav"}

    def preprocess(self, state: RequestState, prompt: str | None, messages: list[dict] | None) -> None:
        from models.qwen3_omni.requests import plan_request

        plan_request(self.frontend, state, prompt, messages, context=self._context,
                     talker_positions=self.engine.max_seq_len)

    def start(self, state: RequestState) -> list[WalkStep]:
        walk, inputs = state.data.pop("first")
        steps = [WalkStep(walk, inputs)]
        talk = state.data["talk"]
        if talk is not None:
            talk_inputs, frames = talk
            steps += [WalkStep("talk", talk_inputs, loop_limits={TALK_LOOP: frames}), WalkStep("code2wav", {})]
        return steps

    def after_walk(self, state: RequestState, walk: str, outputs: dict[str, Any]) -> WalkStep | None:
        if walk != "prefill":
            return None
        token = outputs["token"]
        if int(token.reshape(-1)[0]) in self.frontend.tokenizer.eos_token_ids:
            state.finish_reason = "stop"
            return None
        if state.max_tokens <= 1:
            return None
        inputs = {"token": token, **state.data.pop("decode_inputs")}
        if "kv" in outputs:  # decode runs on another rank: the KV (and with it the offset) moves there
            inputs["kv"] = outputs["kv"]
        return WalkStep("decode", inputs, loop_limits={DECODE_LOOP: state.max_tokens - 1})

    def postprocess(self, state: RequestState, signal: str, values: list[Any]) -> Any:
        if signal == "audio":
            return [MediaDelta("audio", v.reshape(-1).to(torch.int16).numpy().tobytes(),
                               {"sample_rate": SAMPLE_RATE, "num_channels": 1}) for v in values]
        ids = values if not values or isinstance(values[0], int) else \
            [int(t) for v in values for t in v.reshape(-1).tolist()]
        state.completion_tokens += len(ids)
        eos, vocab = self.frontend.tokenizer.eos_token_ids, self.frontend.tokenizer.vocab_size
        # ids past the tokenizer's (the embedding table is padded to a multiple of 64) have no text
        return "".join(state.data["decoder"].push(i) for i in ids if i not in eos and i < vocab)

    def finish_text(self, state: RequestState) -> str:
        decoder = state.data.get("decoder")
        return decoder.flush() if decoder is not None else ""
