"""Tensor-parallel Llama and Qwen3-MoE on real processes over gloo: one TP shard per rank == the unsharded model.

One world of 3 ranks runs everything: a TP group of 2 (ranks 1, 2; rank 0 is outside it and computes the
unsharded references, so a layer that used the world group instead of its own would hang or mis-sum) and a TP
group of 3 (all ranks) for SmolLM2-shaped heads (9 query / 3 KV heads). Each rank builds only its shard from the
checkpoint (load_llama / load_moe with its TPGroup) and drives a StaticKVCache sized by `model.local_kv_heads`
through a prefill and decode steps.

A failure points to: the shard loaders (which rows / columns of fused q/k/v, gate/up, per-expert tensors a rank
reads) or the head split if TP logits differ from TP1; a missing or doubled all-reduce if the count per forward is
not two per layer (MoE: ONE per MoE block, shared expert included); a non-replicated router or residual stream if
ranks of one group route differently or disagree on logits; the no-TP path if TP1 differs from HF transformers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from models.llama.config import LlamaConfig
from tests.dist.launcher import run_ranks

LLAMA = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4, n_kv_heads=2,
                    head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
SMOL = LlamaConfig(vocab_size=128, hidden_size=144, intermediate_size=192, n_layers=2, n_heads=9, n_kv_heads=3,
                   head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)
"""SmolLM2-135M's head counts (9 / 3) at a tiny width: needs TP 3."""
MOE_CASES = {  # name -> (make_moe_checkpoint overrides, router spec)
    "qwen3": ({}, None),
    "shared_dense": ({"shared_expert_intermediate_size": 48, "n_layers": 3, "mlp_only_layers": (1,),
                      "norm_topk_prob": False}, None),
    "load_biased": ({}, {"name": "load_biased", "strength": 2.0}),
}
PROMPT_LEN, DECODE_STEPS = 7, 3
ATOL = 2e-5


def _write_llama(out: Path, config: LlamaConfig, seed: int) -> Path:
    """HF-layout Llama checkpoint, N(0, 0.05) weights, random norms (so a misplaced norm shard would show)."""
    gen = torch.Generator().manual_seed(seed)
    d, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, d), "model.norm.weight": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (config.n_heads * hd, d),
                       p + "self_attn.k_proj.weight": (config.n_kv_heads * hd, d),
                       p + "self_attn.v_proj.weight": (config.n_kv_heads * hd, d),
                       p + "self_attn.o_proj.weight": (d, config.n_heads * hd),
                       p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
                       p + "mlp.down_proj.weight": (d, inter)})
    tensors = {n: (1 + 0.1 * torch.randn(s, generator=gen)) if len(s) == 1 else 0.05 * torch.randn(s, generator=gen)
               for n, s in shapes.items()}
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config.to_hf()))
    return out


# ---- inside a rank ---------------------------------------------------------------------------------------------

def _drive(model, n_kv_heads: int, head_dim: int, n_layers: int, tokens: torch.Tensor) -> torch.Tensor:
    """Prefill tokens[:PROMPT_LEN], then decode the rest one by one -> last-position logits per call (steps+1, V)."""
    from mstar_dist.engine.kv_cache import StaticKVCache

    cache = StaticKVCache(n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim, max_slots=1, max_seq_len=32)
    slot = cache.alloc()
    out = []
    with torch.inference_mode():
        cache.bind([slot], [0], PROMPT_LEN)
        out.append(model(tokens[None, :PROMPT_LEN], torch.arange(PROMPT_LEN)[None], cache, last_only=True)[0, -1])
        for pos in range(PROMPT_LEN, PROMPT_LEN + DECODE_STEPS):
            cache.bind([slot], [pos], 1)
            out.append(model(tokens[None, pos:pos + 1], torch.tensor([[pos]]), cache, last_only=True)[0, -1])
    return torch.stack(out)


def _record_routing(model) -> list[list[torch.Tensor]]:
    """Per MoE layer, the selected experts of every router call (forward hooks)."""
    calls: list[list[torch.Tensor]] = []
    for layer in model.layers:
        if layer.sparse:
            calls.append([])
            layer.mlp.router.register_forward_hook(lambda m, a, out, rec=calls[-1]: rec.append(out[1].clone()))
    return calls


def _count_all_reduces() -> list[int]:
    """Count dist.all_reduce calls in this rank process from now on (only this test's child process is patched)."""
    import torch.distributed as dist

    counter = [0]
    real = dist.all_reduce

    def counting(*args, **kwargs):
        counter[0] += 1
        return real(*args, **kwargs)

    dist.all_reduce = counting
    return counter


def _to_numpy(x):
    if isinstance(x, torch.Tensor):
        return x.numpy()
    if isinstance(x, dict):
        return {k: _to_numpy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_to_numpy(v) for v in x]
    return x


def _to_torch(x):
    if hasattr(x, "__array__") and not isinstance(x, (int, float)):
        return torch.from_numpy(x)
    if isinstance(x, dict):
        return {k: _to_torch(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_to_torch(v) for v in x]
    return x


def _rank(rank: int, llama_dir: str, smol_dir: str, moe_dirs: dict[str, str], tokens: torch.Tensor) -> dict:
    from mstar_dist.distributed.groups import create_tp_groups
    from mstar_dist.distributed.init import init_distributed, shutdown_distributed
    from mstar_dist.distributed.tp import TPGroup
    from models.llama.weights import load_llama
    from models.moe.weights import load_moe

    torch.set_num_threads(1)
    init_distributed(global_rank=rank, world_size=int(os.environ["WORLD_SIZE"]), device="cpu", timeout_s=30)
    try:
        groups = create_tp_groups([[1, 2], [0, 1, 2]], global_rank=rank, backend="gloo", timeout_s=30)
        tp3 = TPGroup.from_process_group(groups[(0, 1, 2)].group)
        counter = _count_all_reduces()
        res: dict = {"tp3_rank": tp3.rank}
        model, cfg = load_llama(smol_dir, tp=tp3)
        counter[0] = 0
        res["smol"] = _drive(model, model.local_kv_heads, cfg.head_dim, cfg.n_layers, tokens)
        res["smol_reduces"] = counter[0]
        res["smol_kv_heads"] = model.local_kv_heads
        if rank == 0:  # outside the TP-2 group: the unsharded references
            model, cfg = load_llama(llama_dir)
            res["llama"] = _drive(model, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers, tokens)
            model, cfg = load_llama(smol_dir)
            res["smol_ref"] = _drive(model, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers, tokens)
            tp = TPGroup.single()
        else:
            tp = TPGroup.from_process_group(groups[(1, 2)].group)
            model, cfg = load_llama(llama_dir, tp=tp)
            counter[0] = 0
            res["llama"] = _drive(model, model.local_kv_heads, cfg.head_dim, cfg.n_layers, tokens)
            res["llama_reduces"] = counter[0]
        for name, (_, router) in MOE_CASES.items():
            model, cfg = load_moe(moe_dirs[name], tp=tp, router=router)
            routing = _record_routing(model)
            counter[0] = 0
            res[name] = _drive(model, model.local_kv_heads, cfg.head_dim, cfg.n_layers, tokens)
            res[name + "_reduces"] = counter[0]
            res[name + "_routing"] = routing
        res["tp_rank"] = tp.rank
        return _to_numpy(res)  # torch tensors would travel as shared-memory handles that die with the rank
    finally:
        shutdown_distributed()


# ---- the test --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[list[dict], dict[str, str]]:
    from models.moe.checkpoint import make_moe_checkpoint

    root = tmp_path_factory.mktemp("tp")
    dirs = {"llama": str(_write_llama(root / "llama", LLAMA, 0)), "smol": str(_write_llama(root / "smol", SMOL, 1))}
    moe_dirs = {}
    for name, (overrides, _) in MOE_CASES.items():
        make_moe_checkpoint(root / name, seed=2, writer="plain", **overrides)
        moe_dirs[name] = str(root / name)
    tokens = torch.randint(100, (PROMPT_LEN + DECODE_STEPS,), generator=torch.Generator().manual_seed(3))
    out = run_ranks(_rank, 3, timeout_s=90, args=(dirs["llama"], dirs["smol"], moe_dirs, tokens))
    return [_to_torch(r) for r in out], {**dirs, "tokens": tokens}


def test_llama_tp2_equals_tp1(results) -> None:
    out, _ = results
    ref = out[0]["llama"]
    assert [r["tp_rank"] for r in out[1:]] == [0, 1]
    for r in out[1:]:
        torch.testing.assert_close(r["llama"], ref, atol=ATOL, rtol=0)
        assert r["llama_reduces"] == 2 * LLAMA.n_layers * (1 + DECODE_STEPS)  # wo + down per layer per forward
    assert torch.equal(out[1]["llama"], out[2]["llama"])  # the group's ranks agree exactly


def test_smollm2_heads_tp3_equals_tp1(results) -> None:
    out, _ = results
    assert sorted(r["tp3_rank"] for r in out) == [0, 1, 2]
    assert all(r["smol_kv_heads"] == 1 for r in out)  # 3 KV heads over 3 ranks: one per rank's cache
    for r in out:
        torch.testing.assert_close(r["smol"], out[0]["smol_ref"], atol=ATOL, rtol=0)
        assert r["smol_reduces"] == 2 * SMOL.n_layers * (1 + DECODE_STEPS)
        assert torch.equal(r["smol"], out[0]["smol"])


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_tp2_equals_tp1_with_identical_routing(results, case: str) -> None:
    out, _ = results
    overrides, _ = MOE_CASES[case]
    n_layers = overrides.get("n_layers", 2)
    ref = out[0]
    for r in out[1:]:
        torch.testing.assert_close(r[case], ref[case], atol=ATOL, rtol=0)
        # one all-reduce for attention + ONE per MLP / MoE block (the shared expert's partial sum rides along)
        assert r[case + "_reduces"] == 2 * n_layers * (1 + DECODE_STEPS)
    assert torch.equal(out[1][case], out[2][case])
    routing = [r[case + "_routing"] for r in out]
    assert len(routing[0]) == n_layers - len(overrides.get("mlp_only_layers", ()))
    for layer in range(len(routing[0])):
        assert len(routing[0][layer]) == 1 + DECODE_STEPS  # the router ran once per block forward
        for call in range(1 + DECODE_STEPS):
            assert torch.equal(routing[1][layer][call], routing[2][layer][call])  # identical on every TP rank
            assert torch.equal(routing[1][layer][call], routing[0][layer][call])  # and as without TP


def test_no_tp_llama_matches_hf(results) -> None:
    """TP1 (the no-TP path, `Linear` layers, no collective) against HF transformers from the same checkpoint."""
    transformers = pytest.importorskip("transformers")
    out, dirs = results
    hf = transformers.LlamaForCausalLM.from_pretrained(dirs["llama"], dtype=torch.float32).eval()
    tokens = dirs["tokens"]
    with torch.inference_mode():
        logits = hf(tokens[None]).logits[0, PROMPT_LEN - 1:]
    torch.testing.assert_close(out[0]["llama"], logits, atol=ATOL, rtol=0)
