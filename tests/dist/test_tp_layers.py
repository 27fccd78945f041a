"""Tensor-parallel layers and shard loading as pure logic (no processes): which slice of each weight a TP rank holds.

Loading never communicates, so a TPGroup with a stand-in group object is enough to build and load rank r's shard
and compare it with slices of the full checkpoint tensors. A failure points to the shard arithmetic of
models/common/tp.py (a fused q/k/v or gate/up weight cut across part boundaries, rows and columns swapped), to the
loaders (models/llama/weights.py, models/moe/weights.py: the wrong HF tensor or expert order), or to the eager
checks (a TP size that does not divide heads or widths must fail at build with every number in the message).
The multi-process equality TP == no TP is tests/dist/test_tp_models.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.common.linear import Linear
from models.common.tp import ColumnParallelLinear, RowParallelLinear, shard_cols, shard_rows
from mstar_dist.distributed.tp import TPGroup
from models.llama.config import LlamaConfig
from models.llama.model import Llama
from models.llama.weights import load_llama
from models.moe.checkpoint import make_moe_checkpoint
from models.moe.model import Qwen3Moe
from models.moe.weights import load_moe


def rank_of(r: int, size: int) -> TPGroup:
    return TPGroup(group=object(), rank=r, size=size)  # type: ignore[arg-type] - loading never touches the group


def test_tp_group_checks_itself() -> None:
    assert TPGroup.single() == TPGroup(None, 0, 1) and TPGroup.single().rank_in_group == 0
    with pytest.raises(ValueError, match=r"rank_in_group \(2\) must be in \[0, size=2\)"):
        TPGroup(object(), 2, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="size 2 needs a process group"):
        TPGroup(None, 0, 2)


def test_shards_of_tensors_and_safetensors_slices(tmp_path) -> None:
    full = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        for r in range(2):
            tp = rank_of(r, 2)
            assert torch.equal(shard_rows(full, tp), full[3 * r:3 * r + 3])
            assert torch.equal(shard_cols(full, tp), full[:, 2 * r:2 * r + 2])
            assert torch.equal(shard_rows(f.get_slice("w"), tp), full[3 * r:3 * r + 3])  # only those rows read
            assert torch.equal(shard_cols(f.get_slice("w"), tp), full[:, 2 * r:2 * r + 2])
    with pytest.raises(ValueError, match=r"dim 0 of a tensor of shape \[6, 4\] \(6\) is not divisible by tp_size \(4\)"):
        shard_rows(full, rank_of(0, 4))


def test_parallel_linears_split_their_features_and_refuse_uneven_splits() -> None:
    col = ColumnParallelLinear(8, 12, rank_of(1, 2), parts=(8, 2, 2))
    assert col.weight.shape == (6, 8) and col.local_parts == (4, 1, 1)
    q, k, v = torch.randn(8, 8), torch.randn(2, 8), torch.randn(2, 8)
    assert torch.equal(col.weight_loader("weight", [q, k, v]), torch.cat((q[4:], k[1:], v[1:])))  # [q_r; k_r; v_r]
    row = RowParallelLinear(12, 8, rank_of(1, 3))
    assert row.weight.shape == (8, 4)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: out_features \(10\) is not divisible by tp_size \(4\)"):
        ColumnParallelLinear(8, 10, rank_of(0, 4))
    with pytest.raises(ValueError, match=r"RowParallelLinear: in_features \(10\) is not divisible by tp_size \(3\)"):
        RowParallelLinear(10, 8, rank_of(0, 3))
    single = ColumnParallelLinear(8, 12, TPGroup.single())
    assert isinstance(single, Linear) and single.weight.shape == (12, 8)  # no TP: the plain Linear


LLAMA = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=48, n_layers=1, n_heads=4, n_kv_heads=2,
                    head_dim=8, max_position_embeddings=64)


def test_llama_head_split_is_checked_with_every_number() -> None:
    with torch.device("meta"):
        with pytest.raises(ValueError, match=r"tp_size \(4\) must divide both n_heads \(4\) and n_kv_heads \(2\)"):
            Llama(LLAMA, tp=rank_of(0, 4))
        model = Llama(LLAMA, tp=rank_of(1, 2))
    assert (model.local_heads, model.local_kv_heads) == (2, 1)


def test_llama_rank_loads_its_slices(tmp_path) -> None:
    gen = torch.Generator().manual_seed(0)
    p = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (32, 32), "model.norm.weight": (32,), "lm_head.weight": (32, 32),
              p + "input_layernorm.weight": (32,), p + "post_attention_layernorm.weight": (32,),
              p + "self_attn.q_proj.weight": (32, 32), p + "self_attn.k_proj.weight": (16, 32),
              p + "self_attn.v_proj.weight": (16, 32), p + "self_attn.o_proj.weight": (32, 32),
              p + "mlp.gate_proj.weight": (48, 32), p + "mlp.up_proj.weight": (48, 32),
              p + "mlp.down_proj.weight": (32, 48)}
    full = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    save_file(full, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA.to_hf()))
    model, _ = load_llama(tmp_path, tp=rank_of(1, 2))
    layer = model.layers[0]
    want_qkv = torch.cat((full[p + "self_attn.q_proj.weight"][16:], full[p + "self_attn.k_proj.weight"][8:],
                          full[p + "self_attn.v_proj.weight"][8:]))
    assert torch.equal(layer.attn.wqkv.weight, want_qkv)
    assert torch.equal(layer.attn.wo.weight, full[p + "self_attn.o_proj.weight"][:, 16:])
    assert torch.equal(layer.mlp.w_gate_up.weight, torch.cat((full[p + "mlp.gate_proj.weight"][24:],
                                                              full[p + "mlp.up_proj.weight"][24:])))
    assert torch.equal(layer.mlp.w_down.weight, full[p + "mlp.down_proj.weight"][:, 24:])
    assert torch.equal(model.lm_head.weight, full["lm_head.weight"])  # replicated
    assert torch.equal(model.embed.weight, full["model.embed_tokens.weight"])


def test_moe_rank_loads_every_experts_slice(tmp_path) -> None:
    config = make_moe_checkpoint(tmp_path, seed=0, writer="plain", shared_expert_intermediate_size=24)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        full = {n: f.get_tensor(n) for n in f.keys()}
    model, _ = load_moe(tmp_path, tp=rank_of(1, 2))
    mlp = model.layers[1].mlp
    p, half = "model.layers.1.mlp.", config.moe_intermediate_size // 2
    for e in range(config.num_experts):
        gate, up, down = (full[f"{p}experts.{e}.{x}_proj.weight"] for x in ("gate", "up", "down"))
        assert torch.equal(mlp.experts.w_gate_up[e], torch.cat((gate[half:], up[half:])))
        assert torch.equal(mlp.experts.w_down[e], down[:, half:])
    assert torch.equal(mlp.router.weight, full[p + "gate.weight"])  # replicated: identical routing on every rank
    assert torch.equal(mlp.shared_expert.w_down.weight, full[p + "shared_expert.down_proj.weight"][:, 12:])
    assert torch.equal(mlp.shared_expert_gate.weight, full[p + "shared_expert_gate.weight"])
    assert model.local_kv_heads == config.n_kv_heads // 2
    with torch.device("meta"), pytest.raises(ValueError, match=r"moe_intermediate_size \(32\) is not divisible by "
                                                               r"tp_size \(3\)"):
        Qwen3Moe(config.__class__(**{**config.__dict__, "n_heads": 6, "n_kv_heads": 3}), tp=rank_of(0, 3))
