"""The KV engine's hook for multimodal decoders (engine/kv_engine.py, engine/prefill.py): a prefill's model inputs
(the model's ``prefill_inputs`` and ``position_ids``) and a request's decode ``position_offset``.

A failure here means a prefill's extra inputs did not reach the model's forward (or reached it batched with other
prompts, whose rows they do not describe), ``position_ids`` did not replace the prompt's positions, a decode step
rotated a request by its cache position instead of cache position + offset (or shifted a request that has none),
the offset was lost on a KV import (P/D) or outlived its request's slot, or a text model's path changed.
"""

from __future__ import annotations

import pytest
import torch

from models.llama.model import Llama
from mstar_dist.engine.kv_cache import StaticKVCache
from mstar_dist.engine.kv_engine import KVCacheEngine
from tests.unit.test_kv_engine import CFG, call, config, generate, prompt


class Recording(Llama):
    """A Llama that takes one extra prefill input (``bias``, added to the logits) and position offsets, and records
    the positions and inputs of every forward. Positions of several axes must agree (it rotates by axis 0)."""

    prefill_inputs = ("bias",)
    position_offsets = True

    def __init__(self) -> None:
        super().__init__(CFG)
        self.seen: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def forward(self, input_ids, positions, cache, last_only=False, last_index=None, *, bias=None):
        self.seen.append((positions.clone(), bias))
        logits = super().forward(input_ids, positions if positions.dim() == 2 else positions[0], cache, last_only,
                                 last_index)
        return logits if bias is None else logits + bias


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return Llama(CFG).state_dict()


def recording(weights) -> Recording:
    model = Recording().eval().requires_grad_(False)
    model.load_state_dict(weights)
    return model


def engine_of(model: torch.nn.Module, slots: int = 8) -> KVCacheEngine:
    cache = StaticKVCache(n_layers=CFG.n_layers, n_kv_heads=CFG.n_kv_heads, head_dim=CFG.head_dim, max_slots=slots,
                          max_seq_len=64)
    return KVCacheEngine(model, cache, torch.device("cpu"), config())


def forced(token: int) -> torch.Tensor:
    """A bias that makes ``token`` the greedy choice."""
    bias = torch.zeros(CFG.vocab_size)
    bias[token] = 1e4
    return bias


def test_a_prompt_with_model_inputs_is_a_forward_of_its_own_and_the_model_gets_them(weights) -> None:
    model = recording(weights)
    eng = engine_of(model)
    prompts = [prompt(5, 1), prompt(9, 2), prompt(7, 3)]
    alone = [generate(engine_of(recording(weights)), [call(f"r{i}", {"input_ids": p})], steps=2)[f"r{i}"]
             for i, p in enumerate(prompts)]
    calls = [call("r0", {"input_ids": prompts[0]}), call("r1", {"input_ids": prompts[1], "bias": forced(42)}),
             call("r2", {"input_ids": prompts[2]})]
    out = generate(eng, calls, steps=2)
    assert out["r1"][0] == 42 and out["r0"] == alone[0] and out["r2"] == alone[2]
    assert eng.prefill_batches == 2  # r0 and r2 together, r1 alone
    prefills = [(p, b) for p, b in model.seen if p.shape[-1] > 1]
    assert sorted(p.shape[0] for p, _ in prefills) == [1, 2]
    assert [b for p, b in prefills if p.shape[0] == 1][0] is not None  # the bias rode with r1's row only
    assert all(b is None for p, b in prefills if p.shape[0] == 2)


def test_position_ids_replace_the_prompts_positions_with_a_batch_dimension(weights) -> None:
    model = recording(weights)
    ids = prompt(6, 4)
    axes = torch.stack([torch.arange(6), torch.arange(6) // 2, torch.arange(6) % 2])  # (3, T)
    (result,) = engine_of(model).run_batch([call("m", {"input_ids": ids, "position_ids": axes})])
    positions, _ = model.seen[-1]
    assert positions.shape == (3, 1, 6) and torch.equal(positions[:, 0], axes)
    cache = StaticKVCache(n_layers=CFG.n_layers, n_kv_heads=CFG.n_kv_heads, head_dim=CFG.head_dim, max_slots=1,
                          max_seq_len=64)
    cache.bind([cache.alloc()], [0], 6)
    with torch.inference_mode():  # axis 0 rotates: the token is the plain model's with those positions
        expect = Llama.forward(model, ids[None], axes[0][None], cache, last_only=True)[0, -1].argmax()
    assert int(result.outputs["token"]) == int(expect)


def decode_positions(model: Recording) -> list[list[int]]:
    """The positions of every recorded decode forward (one token per row)."""
    return [p[:, 0].tolist() for p, _ in model.seen if p.dim() == 2 and p.shape[1] == 1]


def test_decode_steps_rotate_by_cache_position_plus_the_requests_offset_and_others_not(weights) -> None:
    model = recording(weights)
    eng = engine_of(model)
    calls = [call("mm", {"input_ids": prompt(8, 5), "position_offset": torch.tensor([-3])}),
             call("txt", {"input_ids": prompt(4, 6)})]
    generate(eng, calls, steps=3)
    assert decode_positions(model) == [[8 - 3, 4], [9 - 3, 5], [10 - 3, 6]]
    eng.release("mm")
    eng.release("txt")
    model.seen.clear()
    generate(eng, [call("next", {"input_ids": prompt(8, 7)})], steps=1)  # may take mm's slot: no offset left there
    assert decode_positions(model) == [[8]]


def test_the_offset_travels_with_an_imported_kv(weights) -> None:
    prefiller, decoder = recording(weights), recording(weights)
    (first,) = engine_of(prefiller).run_batch([call("pd", {"input_ids": prompt(8, 8)}, export=frozenset({"kv"}))])
    eng = engine_of(decoder)
    eng.run_batch([call("pd", {"token": first.outputs["token"], "kv": first.outputs["kv"], "position_offset": 5})])
    assert decode_positions(decoder) == [[8 + 5]]


def test_a_model_without_position_offsets_fails_a_prompt_that_brings_one_alone(weights) -> None:
    plain = Llama(CFG).eval().requires_grad_(False)
    plain.load_state_dict(weights)
    eng = engine_of(plain)
    bad, good = eng.run_batch([call("bad", {"input_ids": prompt(5, 9), "position_offset": 2}),
                               call("good", {"input_ids": prompt(5, 10)})])
    assert isinstance(bad, ValueError) and "position_offset" in str(bad)
    assert int(good.outputs["token"]) >= 0


def test_a_text_model_ignores_model_inputs_and_batches_as_before(weights) -> None:
    plain = Llama(CFG).eval().requires_grad_(False)
    plain.load_state_dict(weights)
    eng = engine_of(plain)
    out = generate(eng, [call("a", {"input_ids": prompt(5, 11), "position_ids": torch.zeros(3, 5)}),
                         call("b", {"input_ids": prompt(7, 12)})], steps=1)
    assert eng.prefill_batches == 1
    assert out["a"] == generate(engine_of(plain), [call("a", {"input_ids": prompt(5, 11)})], steps=1)["a"]


def test_position_ids_of_another_length_fail_that_prompt(weights) -> None:
    (result,) = engine_of(recording(weights)).run_batch(
        [call("x", {"input_ids": prompt(6, 13), "position_ids": torch.zeros(3, 5, dtype=torch.long)})])
    assert isinstance(result, ValueError) and "position_ids" in str(result)


class Offsets(Llama):
    """A Llama whose decode steps may take position offsets (nothing else differs)."""

    position_offsets = True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_graphs_rotate_by_the_offset_as_eager_steps_do(weights) -> None:
    gpu = Offsets(CFG).to("cuda").eval().requires_grad_(False)
    gpu.load_state_dict(weights)
    gpu.init_rope_tables()

    def tokens(graphs: bool, lookahead: bool, offset: int) -> dict[str, list[int]]:
        cache = StaticKVCache(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, max_slots=5, max_seq_len=64, device="cuda")
        eng = KVCacheEngine(gpu, cache, torch.device("cuda"), config(cuda_graphs=graphs, lookahead=lookahead))
        eng.warmup()
        calls = [call("mm", {"input_ids": prompt(9, 14), "position_offset": offset}),
                 call("txt", {"input_ids": prompt(6, 15)})]
        return generate(eng, calls, steps=8)

    eager = tokens(graphs=False, lookahead=False, offset=-5)
    assert tokens(graphs=True, lookahead=False, offset=-5) == eager
    ahead = tokens(graphs=True, lookahead=True, offset=-5)  # lookahead launches the same steps one ahead
    assert all(ahead[rid] == eager[rid][:len(ahead[rid])] for rid in eager), (ahead, eager)
    unshifted = tokens(graphs=True, lookahead=False, offset=0)
    assert unshifted["txt"] == eager["txt"] and unshifted["mm"] != eager["mm"]
