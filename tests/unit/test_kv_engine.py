"""KVCacheEngine's batched prefill on a tiny random Llama (engine/kv_engine.py).

A failure here means prompts that arrive together change each other's output when they share a prefill forward
(right padding leaks into a row's logits or its KV), the token budget is not honoured, a request without a free
slot is lost instead of retried, or one bad prompt fails the others in its batch.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from models.llama.config import LlamaConfig
from models.llama.model import Llama
from mstar_dist.engine.component import WalkContext
from mstar_dist.engine.kv_cache import StaticKVCache
from mstar_dist.engine.kv_engine import KVCacheEngine
from mstar_dist.engine.sampling import SamplingParams
from mstar_dist.graph.walk import NodeCall

CFG = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, n_layers=2, n_heads=4, n_kv_heads=2,
                  head_dim=16, rope_theta=10000.0, max_position_embeddings=128)


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    return Llama(CFG).eval().requires_grad_(False)


def engine(model: Llama, slots: int = 8, budget: int = 4096) -> KVCacheEngine:
    cache = StaticKVCache(n_layers=CFG.n_layers, n_kv_heads=CFG.n_kv_heads, head_dim=CFG.head_dim,
                          max_slots=slots, max_seq_len=64)
    return KVCacheEngine("LLM", model, cache, torch.device("cpu"), prefill_token_budget=budget)


def call(request_id: str, inputs: dict, *, seed: int = 0, temperature: float = 0.0,
         export: frozenset[str] = frozenset()) -> NodeCall:
    ctx = WalkContext(request_id=request_id, walk="w", walk_index=0, seed=seed,
                      sampling=SamplingParams(temperature=temperature, seed=seed), export=export)
    return NodeCall(run=SimpleNamespace(request_id=request_id, ctx=ctx), node="LLM", inputs=inputs, iteration=0)


def prompt(n: int, salt: int) -> torch.Tensor:
    return torch.randint(CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(salt))


def generate(eng: KVCacheEngine, calls: list[NodeCall], steps: int) -> dict[str, list[int]]:
    """Prefill ``calls`` in one run_batch, then decode them together ``steps`` times; every token per request."""
    out = {c.request_id: [int(r.outputs["token"])] for c, r in zip(calls, eng.run_batch(calls))}
    for _ in range(steps):
        step = [call(rid, {"token": torch.tensor([toks[-1]])}, seed=c.ctx.seed, temperature=c.ctx.sampling.temperature)
                for c, (rid, toks) in zip(calls, out.items())]
        for c, s in zip(calls, step):
            s.run.ctx.state.update(c.ctx.state)  # the request's generator carries over, as in a walk
        for (rid, toks), result in zip(out.items(), eng.run_batch(step)):
            toks.append(int(result.outputs["token"]))
    return out


def test_ragged_prompts_in_one_prefill_give_what_each_gives_alone(model: Llama) -> None:
    lengths = [5, 17, 9, 1, 30]
    knobs = [(0.0, 0), (0.9, 11), (0.0, 0), (1.0, 5), (0.7, 3)]

    def calls():
        return [call(f"r{i}", {"input_ids": prompt(n, i)}, temperature=t, seed=s)
                for i, (n, (t, s)) in enumerate(zip(lengths, knobs))]

    alone = {}
    for c in calls():
        alone.update(generate(engine(model), [c], steps=6))
    eng = engine(model)
    together = generate(eng, calls(), steps=6)
    assert together == alone
    assert eng.prefill_batches == 1 and eng.prefills == len(lengths)


def test_exported_kv_of_a_padded_row_equals_its_prefill_alone(model: Llama) -> None:
    export = frozenset({"kv"})
    alone = engine(model).run_batch([call("a", {"input_ids": prompt(7, 1)}, export=export)])[0]
    eng = engine(model)
    short, _ = eng.run_batch([call("a", {"input_ids": prompt(7, 1)}, export=export),
                              call("b", {"input_ids": prompt(20, 2)}, export=export)])
    assert short.outputs["kv"].shape == alone.outputs["kv"].shape == (CFG.n_layers, 2, CFG.n_kv_heads, 7, 16)
    torch.testing.assert_close(short.outputs["kv"], alone.outputs["kv"], atol=1e-5, rtol=1e-5)
    assert eng.cache.num_free == 8  # exported prefills give their slots back at once


def test_token_budget_cuts_the_batch_and_a_request_without_a_slot_waits(model: Llama) -> None:
    eng = engine(model, slots=3, budget=40)
    calls = [call(f"r{i}", {"input_ids": prompt(n, i)}) for i, n in enumerate([10, 10, 25, 4])]
    results = eng.run_batch(calls)
    # slots for three: [10, 10] share a forward (2 x 10 <= 40), 25 would pad them to 75 tokens: its own forward
    assert eng.prefill_batches == 2 and eng.prefills == 3
    assert all(r is not None for r in results[:3]) and results[3] is None  # retried once a slot frees
    eng.release("r0")
    assert eng.run_batch([calls[3]])[0] is not None


def test_a_bad_prompt_fails_alone(model: Llama) -> None:
    eng = engine(model)
    results = eng.run_batch([call("ok", {"input_ids": prompt(6, 1)}), call("empty", {"input_ids": torch.tensor([])}),
                             call("long", {"input_ids": prompt(64, 2)}), call("ok2", {"input_ids": prompt(3, 3)})])
    assert isinstance(results[1], ValueError) and "empty prompt" in str(results[1])
    assert isinstance(results[2], ValueError) and "context is 64" in str(results[2])
    assert int(results[0].outputs["token"].numel()) == 1 and int(results[3].outputs["token"].numel()) == 1
    assert eng.prefill_batches == 1 and eng.cache.num_free == 6


def test_models_with_stateful_padding_share_forwards_only_at_one_length(model: Llama) -> None:
    eng = engine(model)
    eng.ragged_prefill = False  # what a model without pads_are_inert (a stateful MoE router) gets
    eng.run_batch([call(f"r{i}", {"input_ids": prompt(n, i)}) for i, n in enumerate([5, 8, 5, 8, 3])])
    assert eng.prefill_batches == 3 and eng.prefills == 5
