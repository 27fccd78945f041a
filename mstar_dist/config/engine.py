"""Engine policy: how a rank's KV-cache engine runs its model (docs/architecture.md §8), as the deployment's
``engine:`` key.

One frozen, checked `EngineConfig` per deployment, optionally overridden per node group (``node_groups[i].engine``,
e.g. a bigger prefill budget on the prefill ranks of a P/D split than on the decode ranks). Model families keep the
model's own knobs (dtype, router, voice...) in ``model_kwargs``; every knob below is read by the engine or by the
family only to build the engine (cache size, kernels). It lives beside the deployment's other keys and imports no
torch: the front end and the config checks read it, and the engine (engine/kv_engine.py) takes it from here.

Defaults are those of a single rank on CUDA; the rules that depend on the rank (its device, its TP group) are applied
once by `EngineConfig.on` when the engine is built, so a CPU rank or a TP member turns off what it cannot use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mstar_dist.config.schema import ConfigError, check_keys, fail, read_bool, read_choice, read_float, read_int

DECODE_ATTENTION = ("auto", "triton", "sdpa")
"""Values of ``decode_attention``."""
FUSED_POINTWISE = ("auto", "triton", "torch")
"""Values of ``fused_pointwise``."""


@dataclass(frozen=True)
class EngineConfig:
    """The ``engine:`` key of a deployment (every field optional)."""

    max_batch: int = 16
    """KV slots: the most requests one engine holds at once, and so its largest decode batch. With CUDA graphs the
    cache keeps one slot more, the padding rows' scratch slot."""
    max_seq_len: int = 2048
    """KV positions per request (prompt and generated tokens), capped at the model's ``max_position_embeddings``. The
    front end refuses a request whose prompt and ``max_tokens`` do not fit. One value per deployment (not per node
    group): a prefill rank's KV is imported whole by the decode rank, and the front end checks one context."""
    cuda_graphs: bool = True
    """Decode steps replay captured CUDA graphs, one per (rows, context) bucket: a step's launch costs one replay
    instead of a kernel launch per op; a speech codec's windows replay graphs of its own (models/snac/graphs.py).
    CUDA only."""
    prefill_token_budget: int = 4096
    """The most padded prompt tokens (rows x longest prompt) one batched prefill forward takes; prompts beyond it go
    in further forwards of the same turn."""
    prefill_graphs: bool = True
    """With ``cuda_graphs``: batched prefills within the budget replay captured graphs too, one per (rows, length)
    bucket; a prompt no bucket holds runs eagerly, alone. Off in TP groups (the graphs would capture the group's
    all-reduces for every bucket) and for models whose pads are not inert."""
    lookahead: bool = True
    """Launch each decode step before the host has read the previous one's tokens, so the host's work on step N
    overlaps the device's step N+1 (docs/architecture.md §8, "Decode lookahead"). CUDA only (on a CPU the host and
    the forward share the cores: only the dropped rows would cost). Off in TP groups (every member must take the same
    rows) and for models whose rows affect each other's forward (a batch-wide stateful MoE router)."""
    prefill_stream: bool = True
    """With lookahead: a prefill that finds a decode step in flight runs beside it on a second, higher-priority CUDA
    stream instead of queueing behind it (both are latency-bound and leave most of the device idle)."""
    prefill_in_flight: bool = True
    """The rank's loop goes on while a prefill is on the device, and the prompts that arrive meanwhile go as one batch
    the moment it ends (instead of the loop waiting on each prefill's first tokens). CUDA only; off in TP groups (a
    leader and its followers would see a batch end in different turns and launch different batches)."""
    prefill_gather_ms: float = 0.0
    """An engine with nothing else to run holds prompts back while more keep coming at most this many ms apart (and
    the oldest waited less than ten times that), so a burst goes as one forward. 0: off (a lone request would pay the
    wait, for a gain that only shows where a forward is long, as on a CPU)."""
    decode_yield_ms: float = 8.0
    """With ``prefill_in_flight``: no new decode step starts while a prefill is on the device, for up to this many ms
    in a row; then one step runs beside it and a new hold begins (docs/architecture.md §8, "Decode yields"). Two
    latency-bound graphs share the device rather than overlap, so holding the steps brings the first tokens sooner
    without stopping the decoding requests. 0: off."""
    decode_attention: str = "auto"
    """How CUDA-graph decode steps attend: ``triton`` (the in-place kernel of engine/decode_attention.py, which reads
    each row's own positions), ``sdpa`` (SDPA over copies of the rows' keys and values) or ``auto`` (the kernel
    wherever it can run: CUDA graphs on, Triton installed)."""
    fused_pointwise: str = "auto"
    """A block's pointwise work (each residual add with the norm after it, SwiGLU, the rotation of queries and keys)
    as the fused Triton kernels of models/common/fused.py (``triton``) or as torch ops (``torch``); ``auto`` takes
    the kernels on CUDA where Triton is installed and the model has them."""
    cpu_packed_linear: bool = True
    """fp32 on a CPU: every linear layer also keeps its weight reordered for oneDNN, which runs a decode batch of a
    few rows faster than the GEMM behind ``F.linear``, for twice the layers' memory (models/common/linear.py)."""

    def __post_init__(self) -> None:
        read_int(self.max_batch, "max_batch", minimum=1)
        read_int(self.max_seq_len, "max_seq_len", minimum=2)
        read_int(self.prefill_token_budget, "prefill_token_budget", minimum=1)
        for key in ("cuda_graphs", "prefill_graphs", "lookahead", "prefill_stream", "prefill_in_flight",
                    "cpu_packed_linear"):
            read_bool(getattr(self, key), key)
        for key in ("prefill_gather_ms", "decode_yield_ms"):
            object.__setattr__(self, key, read_float(getattr(self, key), key))
        read_choice(self.decode_attention, "decode_attention", DECODE_ATTENTION)
        read_choice(self.fused_pointwise, "fused_pointwise", FUSED_POINTWISE)

    def on(self, device: str, tp_size: int = 1) -> EngineConfig:
        """This config as a rank on ``device`` ("cpu", "cuda:0"...) in a TP group of ``tp_size`` runs it: what needs
        CUDA is off elsewhere, and what a TP group's members could not do in lockstep is off in one."""
        cuda, alone = device.startswith("cuda"), tp_size == 1
        graphs = cuda and self.cuda_graphs
        return dataclasses.replace(
            self, cuda_graphs=graphs, prefill_graphs=graphs and self.prefill_graphs and alone,
            lookahead=cuda and self.lookahead and alone, prefill_in_flight=cuda and self.prefill_in_flight and alone,
        )

    def with_overrides(self, overrides: Mapping[str, Any]) -> EngineConfig:
        """A copy with ``overrides`` (checked keys of a node group's ``engine:``) in place of these values."""
        return dataclasses.replace(self, **overrides) if overrides else self


ENGINE_KEYS = tuple(f.name for f in dataclasses.fields(EngineConfig))
"""Every key of ``engine:``."""

PER_DEPLOYMENT_KEYS = ("max_seq_len",)
"""Keys a node group may not override (see each field)."""


def check_model_kwargs(model_kwargs: Mapping[str, Any]) -> None:
    """A `ConfigError` for the first engine knob found among a model's ``model_kwargs`` (where these knobs used to
    live), naming where it goes now."""
    for key in model_kwargs:
        if key in ENGINE_KEYS:
            raise ConfigError(f"model_kwargs.{key}", f"is engine policy: set engine.{key}", repr(model_kwargs[key]))


def check_overrides(data: Any, key: str) -> dict[str, Any]:
    """A node group's ``engine:`` mapping, checked key by key against `EngineConfig` (errors name ``key``)."""
    allowed = tuple(k for k in ENGINE_KEYS if k not in PER_DEPLOYMENT_KEYS)
    for k in PER_DEPLOYMENT_KEYS:
        if isinstance(data, Mapping) and k in data:
            raise fail(f"{key}.{k}", data[k], "is one value per deployment: set it in the top-level engine: only")
    overrides = dict(check_keys(data, key, required=(), optional=allowed))
    try:
        EngineConfig(**overrides)
    except ConfigError as e:
        raise e.under(key) from None
    return overrides
