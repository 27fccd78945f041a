"""Qwen3-MoE hyperparameters, read from (and written as) an HF `Qwen3MoeForCausalLM` config.json.

One extension: `shared_expert_intermediate_size` > 0 adds Qwen2-MoE's sigmoid-gated shared expert to every
sparse block (the key and its meaning are Qwen2-MoE's; Qwen3-MoE checkpoints do not carry it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from models.llama.config import Llama3RopeScaling, rope_from_hf  # the same RoPE keys and checks as Llama


@dataclass(frozen=True)
class MoEConfig:
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Model width d."""
    intermediate_size: int
    """Width of the dense SwiGLU MLP of the layers that are not sparse (mlp_only_layers, decoder_sparse_step)."""
    moe_intermediate_size: int
    """Width of one expert's SwiGLU MLP."""
    n_layers: int
    """Decoder blocks."""
    n_heads: int
    """Query heads per layer."""
    n_kv_heads: int
    """Key/value heads per layer (GQA)."""
    head_dim: int
    """Width of one head (Qwen3 sets it explicitly: not always hidden_size // n_heads)."""
    num_experts: int
    """Routed experts per sparse block."""
    num_experts_per_tok: int
    """Experts each token is routed to (k)."""
    norm_topk_prob: bool = False
    """Renormalise the k selected routing probabilities to sum to 1."""
    decoder_sparse_step: int = 1
    """Layer i is sparse when (i + 1) % decoder_sparse_step == 0 (and i is not in mlp_only_layers)."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers that use the dense MLP whatever decoder_sparse_step says."""
    shared_expert_intermediate_size: int = 0
    """Width of the sigmoid-gated shared expert of every sparse block (Qwen2-MoE); 0 = none (Qwen3-MoE)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: Llama3RopeScaling | None = None
    """Llama 3.1-style frequency adjustment; None for plain RoPE (Qwen3-MoE's)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm, including the per-head q/k norms."""
    tie_word_embeddings: bool = False
    """The LM head reuses the embedding matrix."""
    max_position_embeddings: int = 2048
    """Longest sequence the RoPE tables are built for."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token, if the model has one."""
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end generation (HF `eos_token_id`, an int or a list)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "n_layers",
                     "n_heads", "n_kv_heads", "head_dim", "num_experts", "num_experts_per_tok",
                     "decoder_sparse_step", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"MoEConfig: num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                             f"num_experts ({self.num_experts})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"MoEConfig.n_heads ({self.n_heads}) must be a multiple of "
                             f"n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"MoEConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(f"MoEConfig.shared_expert_intermediate_size must be >= 0, "
                             f"got {self.shared_expert_intermediate_size}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ValueError(f"MoEConfig.mlp_only_layers {bad} are not layers of a {self.n_layers}-layer model")

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has an MoE block (else the dense MLP); HF's Qwen3MoeDecoderLayer rule."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "MoEConfig":
        """Read an HF `Qwen3MoeForCausalLM` config.json dict; ValueError for what this model cannot run.

        Accepts `num_experts` (Qwen's checkpoints) or `num_local_experts` (what transformers 5 writes).
        """
        for key in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                    "num_hidden_layers", "num_attention_heads", "num_experts_per_tok"):
            if key not in hf:
                raise ValueError(f"config.json: missing key {key!r}")
        num_experts = hf.get("num_experts", hf.get("num_local_experts"))
        if num_experts is None:
            raise ValueError("config.json: missing key 'num_experts' (or 'num_local_experts')")
        for key in ("attention_bias", "qkv_bias", "mlp_bias", "use_sliding_window"):
            if hf.get(key):
                raise ValueError(f"config.json: {key}={hf[key]!r} is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act={hf['hidden_act']!r} is not supported (silu only)")
        rope_theta, rope_scaling = rope_from_hf(hf)
        n_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], moe_intermediate_size=hf["moe_intermediate_size"],
            n_layers=hf["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            num_experts=num_experts, num_experts_per_tok=hf["num_experts_per_tok"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=hf.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or 0,
            rope_theta=rope_theta, rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF config.json dict that `from_hf` reads back to this config (and Qwen3MoeConfig accepts)."""
        eos: int | list[int] | None = list(self.eos_token_ids) if len(self.eos_token_ids) != 1 \
            else self.eos_token_ids[0]
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**self.rope_scaling.to_hf(), "rope_theta": self.rope_theta}
        hf = {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.n_layers, "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim,
            "num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "norm_topk_prob": self.norm_topk_prob, "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers), "hidden_act": "silu", "rope_parameters": rope,
            "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings, "attention_bias": False,
            "use_sliding_window": False, "bos_token_id": self.bos_token_id, "eos_token_id": eos,
        }
        if self.shared_expert_intermediate_size:
            hf["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return hf
