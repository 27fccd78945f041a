"""Qwen3-MoE (models/moe) against HF transformers on small random checkpoints: logits and routing.

Checkpoints come from models/moe/checkpoint.py: the transformers writer (Qwen3MoeForCausalLM's own init, loaded
back by HF with from_pretrained, so the per-expert layout round-trips) and the plain writer for the shared-expert
variant. That variant is compared against HF's Qwen3-MoE with each sparse block swapped for HF's
Qwen2MoeSparseMoeBlock (same routing, plus `shared_expert` scaled by sigmoid(`shared_expert_gate`)): Qwen2-MoE's
own model differs in attention (qkv bias, no q/k norm), so the hybrid is the reference with matching semantics.

A failure points to: the loader (names, expert fusion, q/k/v fusion) if prefill logits or the first layer's
routing differ; the router (fp32 softmax, top-k order, norm_topk_prob) if selected experts or weights differ; the
expert compute (grouped for prefill, gathered for decode) if routing matches but logits do not; q/k norm, RoPE or
the StaticKVCache walk if prefill matches and decode steps drift; the shared expert or its gate for that variant.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mstar_dist.distributed.tp import TPGroup
from models.moe.checkpoint import make_moe_checkpoint
from models.moe.model import Experts
from models.moe.weights import load_moe
from mstar_dist.engine.kv_cache import StaticKVCache

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_intraop_thread")

CASES = {
    "tiny": {},  # 2 layers, every layer sparse, norm_topk_prob
    "dense_layer_tied": {"n_layers": 3, "mlp_only_layers": (1,), "norm_topk_prob": False,
                         "tie_word_embeddings": True, "num_experts": 6, "num_experts_per_tok": 3},
}
PROMPTS = [[5, 17, 33, 2, 90, 41, 7, 64, 12], [8, 3, 250, 77]]
STEPS = 4
ATOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    dirs = {name: root / name for name in CASES}
    for name, overrides in CASES.items():
        make_moe_checkpoint(dirs[name], seed=0, writer="transformers", **overrides)
    dirs["shared"] = root / "shared"
    make_moe_checkpoint(dirs["shared"], seed=1, writer="plain", shared_expert_intermediate_size=48,
                        decoder_sparse_step=2, n_layers=4)
    return dirs


def hf_shared_reference(weights_dir: Path):
    """HF Qwen3-MoE whose sparse blocks are HF Qwen2MoeSparseMoeBlocks, loaded from our per-expert checkpoint."""
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = Qwen3MoeConfig.from_pretrained(weights_dir)
    model = Qwen3MoeForCausalLM(config)
    block_config = Qwen2MoeConfig(hidden_size=config.hidden_size, moe_intermediate_size=config.moe_intermediate_size,
                                  shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                                  num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                                  norm_topk_prob=config.norm_topk_prob)
    tensors = load_file(str(weights_dir / "model.safetensors"))
    for i, layer in enumerate(model.model.layers):
        if f"model.layers.{i}.mlp.gate.weight" in tensors:
            layer.mlp = Qwen2MoeSparseMoeBlock(block_config)
            p = f"model.layers.{i}.mlp.experts."
            experts = range(config.num_experts)
            tensors[p + "gate_up_proj"] = torch.stack([torch.cat((tensors.pop(f"{p}{e}.gate_proj.weight"),
                                                                  tensors.pop(f"{p}{e}.up_proj.weight")))
                                                       for e in experts])
            tensors[p + "down_proj"] = torch.stack([tensors.pop(f"{p}{e}.down_proj.weight") for e in experts])
    model.load_state_dict(tensors, strict=True)
    return model.eval()


def hf_run(model, ids: list[int], tokens: list[int]) -> tuple[list[torch.Tensor], list[list[tuple]]]:
    """HF prefill of ids, then decode `tokens` one at a time with its own cache. Returns the last-position logits
    of each call and, per sparse layer, (selected experts, weights) of each call."""
    routing = [[] for _ in model.model.layers]
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out, rec=routing[i]: rec.append((out[2], out[1])))
             for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    logits = []
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values -> cache rename in transformers 5
        out = model(torch.tensor([ids]), use_cache=True)
        logits.append(out.logits[0, -1])
        for t in tokens:
            out = model(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[0, -1])
    for h in hooks:
        h.remove()
    return logits, [r for r in routing if r]


def our_run(model, config, ids: list[int], tokens: list[int]) -> tuple[list[torch.Tensor], list[list[tuple]]]:
    """The same walk through our StaticKVCache."""
    routing = [[] for _ in model.layers]
    hooks = [layer.mlp.router.register_forward_hook(lambda m, a, out, rec=routing[i]: rec.append((out[1], out[0])))
             for i, layer in enumerate(model.layers) if layer.sparse]
    cache = StaticKVCache(n_layers=config.n_layers, n_kv_heads=model.local_kv_heads, head_dim=config.head_dim,
                          max_slots=1, max_seq_len=64)
    slot = cache.alloc()
    logits = []
    with torch.inference_mode():
        cache.bind([slot], [0], len(ids))
        logits.append(model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, last_only=True)[0, -1])
        for pos, t in enumerate(tokens, start=len(ids)):
            cache.bind([slot], [pos], 1)
            logits.append(model(torch.tensor([[t]]), torch.tensor([[pos]]), cache, last_only=True)[0, -1])
    for h in hooks:
        h.remove()
    return logits, [r for r in routing if r]


def assert_same(ours_run, hf_run_) -> None:
    (ours, our_routing), (ref, hf_routing) = ours_run, hf_run_
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=lambda m: f"call {step}: {m}")
    assert len(our_routing) == len(hf_routing) > 0
    for layer, (calls, ref_calls) in enumerate(zip(our_routing, hf_routing)):
        for call, ((sel, w), (ref_sel, ref_w)) in enumerate(zip(calls, ref_calls, strict=True)):
            assert torch.equal(sel, ref_sel), (layer, call, sel, ref_sel)
            torch.testing.assert_close(w, ref_w.float(), atol=1e-6, rtol=0)


def decode_inputs(seed: int, n: int, vocab: int) -> list[int]:
    """Fixed decode inputs (not the model's argmax, so a near-tie cannot make the two runs diverge)."""
    return torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_routing_match_hf(checkpoints, case: str) -> None:
    model, config = load_moe(checkpoints[case])
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(checkpoints[case], dtype=torch.float32).eval()
    for ids in PROMPTS:
        tokens = decode_inputs(len(ids), STEPS, config.vocab_size)
        assert_same(our_run(model, config, ids, tokens), hf_run(hf, ids, tokens))


def test_shared_expert_variant_matches_hf_qwen2_moe_blocks(checkpoints) -> None:
    model, config = load_moe(checkpoints["shared"])
    assert config.shared_expert_intermediate_size == 48
    assert [layer.sparse for layer in model.layers] == [False, True, False, True]
    hf = hf_shared_reference(checkpoints["shared"])
    ids = PROMPTS[0]
    tokens = decode_inputs(1, STEPS, config.vocab_size)
    assert_same(our_run(model, config, ids, tokens), hf_run(hf, ids, tokens))


def test_batched_ragged_decode_equals_one_prompt_at_a_time(checkpoints) -> None:
    """Two prompts of different lengths decode together (the gathered expert path over 2 rows) as they do alone."""
    model, config = load_moe(checkpoints["tiny"])
    tokens = [decode_inputs(i, STEPS, config.vocab_size) for i in range(2)]
    alone = [our_run(model, config, ids, t)[0] for ids, t in zip(PROMPTS, tokens)]
    cache = StaticKVCache(n_layers=config.n_layers, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
                          max_slots=2, max_seq_len=64)
    slots = [cache.alloc(), cache.alloc()]
    with torch.inference_mode():
        for slot, ids in zip(slots, PROMPTS):
            cache.bind([slot], [0], len(ids))
            model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, last_only=True)
        lengths = [len(p) for p in PROMPTS]
        for step in range(STEPS):
            cache.bind(slots, lengths, 1)
            step_ids = torch.tensor([[tokens[0][step]], [tokens[1][step]]])
            logits = model(step_ids, torch.tensor(lengths)[:, None], cache, last_only=True)[:, -1]
            for row in range(2):
                torch.testing.assert_close(logits[row], alone[row][step + 1], atol=ATOL, rtol=0)
            lengths = [n + 1 for n in lengths]


def test_grouped_and_gathered_expert_paths_agree() -> None:
    torch.manual_seed(0)
    experts = Experts(num_experts=5, hidden=24, inter=16, tp=TPGroup.single())
    x = torch.randn(7, 24)
    selected = torch.stack([torch.randperm(5)[:2] for _ in range(7)])  # (7, 2)
    weights = torch.rand(7, 2)
    with torch.no_grad():
        torch.testing.assert_close(experts._grouped(x, selected, weights), experts._gathered(x, selected, weights),
                                   atol=1e-6, rtol=0)
