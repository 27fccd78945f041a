"""Llama-family hyperparameters, read from (and written as) an HF `config.json`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", *_LLAMA3_KEYS})  # all that `rope_from_hf` reads


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency adjustment (HF `rope_scaling` with rope_type "llama3").

    A frequency whose wavelength (2*pi / inv_freq, in positions) is shorter than
    original_max_position_embeddings / high_freq_factor is kept; one longer than
    original_max_position_embeddings / low_freq_factor is divided by `factor`; in between, the two are
    interpolated (models/llama/model.py `llama3_inv_freq`).
    """

    factor: float
    """Divisor of the low frequencies (8 for Llama 3.1, 32 for Llama 3.2)."""
    low_freq_factor: float
    """original_max_position_embeddings / low_freq_factor is the wavelength above which `factor` applies fully."""
    high_freq_factor: float
    """original_max_position_embeddings / high_freq_factor is the wavelength below which nothing changes."""
    original_max_position_embeddings: int
    """Context length of pretraining, before the extension (8192 for Llama 3.x)."""

    def __post_init__(self) -> None:
        if not isinstance(self.original_max_position_embeddings, int) \
                or self.original_max_position_embeddings <= 0:
            raise ValueError(f"rope_scaling.original_max_position_embeddings must be a positive int, "
                             f"got {self.original_max_position_embeddings!r}")
        if not self.factor >= 1.0:
            raise ValueError(f"rope_scaling.factor must be >= 1, got {self.factor!r}")
        if not 0.0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                             f"low_freq_factor={self.low_freq_factor!r}, high_freq_factor={self.high_freq_factor!r}")

    def to_hf(self) -> dict[str, Any]:
        return {"rope_type": "llama3", "factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, scaling) from a config.json dict; ValueError for a RoPE variant we do not run.

    Reads transformers 4's layout (top-level `rope_theta`, `rope_scaling` with `rope_type` or the older
    `type`) and transformers 5's (`rope_parameters`, which holds rope_theta too). No dict, or rope_type
    "default", means plain RoPE.
    """
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"config.json: rope_scaling must be a dict, got {rope!r}")
    theta = float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type"))
    unknown = sorted(set(rope) - _ROPE_KEYS)
    if unknown:
        raise ValueError(f"config.json: rope_scaling keys {unknown} are not supported")
    if rope_type == "default" or (rope_type is None and set(rope) <= {"rope_theta"}):
        if set(rope) & set(_LLAMA3_KEYS):
            raise ValueError(f"config.json: rope_scaling={rope!r} has scaling keys but rope_type 'default'")
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"config.json: rope_scaling.rope_type={rope_type!r} is not supported "
                         f"(only 'llama3', or 'default' for plain RoPE)")
    missing = [k for k in _LLAMA3_KEYS if k not in rope]
    if missing:
        raise ValueError(f"config.json: rope_scaling of type 'llama3' lacks {missing}")
    return theta, Llama3RopeScaling(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                                    high_freq_factor=float(rope["high_freq_factor"]),
                                    original_max_position_embeddings=rope["original_max_position_embeddings"])


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Model width d."""
    intermediate_size: int
    """Width of the SwiGLU MLP's hidden layer."""
    n_layers: int
    """Decoder blocks."""
    n_heads: int
    """Query heads per layer."""
    n_kv_heads: int
    """Key/value heads per layer (GQA: n_heads is a multiple of it)."""
    head_dim: int
    """Width of one head (usually hidden_size // n_heads)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: Llama3RopeScaling | None = None
    """Llama 3.1-style frequency adjustment; None for plain RoPE."""
    rms_norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    tie_word_embeddings: bool = False
    """The LM head reuses the embedding matrix."""
    max_position_embeddings: int = 2048
    """Longest sequence the RoPE tables are built for."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token, if the model has one."""
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end generation (HF `eos_token_id`, an int or a list)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "n_layers",
                     "n_heads", "n_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig.n_heads ({self.n_heads}) must be a multiple of "
                             f"n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def n_rep(self) -> int:
        """Query heads that share one key/value head."""
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "LlamaConfig":
        """Read an HF `LlamaForCausalLM` config.json dict; ValueError for what this model cannot run."""
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in hf:
                raise ValueError(f"config.json: missing key {key!r}")
        rope_theta, rope_scaling = rope_from_hf(hf)
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key):
                raise ValueError(f"config.json: {key}={hf[key]!r} is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act={hf['hidden_act']!r} is not supported (silu only)")
        n_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF config.json dict that `from_hf` reads back to this config."""
        eos: int | list[int] | None = list(self.eos_token_ids) if len(self.eos_token_ids) != 1 \
            else self.eos_token_ids[0]
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf(),
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        }
