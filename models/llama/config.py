"""Llama-family hyperparameters, read from (and written as) an HF `config.json`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
        if hf.get("rope_scaling"):
            raise ValueError(f"config.json: rope_scaling={hf['rope_scaling']!r} is not supported")
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
            rope_theta=float(hf.get("rope_theta", 10000.0)),
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
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        }
