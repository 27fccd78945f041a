"""StaticKVCache on a tiny random Llama.

A failure here means continuous batching is wrong (a request's tokens change when it shares a decode step
with requests at other lengths), the prefill -> decode KV hand-off (export/import_) loses information,
chunked prefill masks the wrong keys, or slot accounting is broken.
"""

from __future__ import annotations

import pytest
import torch

from models.llama.config import LlamaConfig
from models.llama.model import Llama
from mstar_dist.engine.kv_cache import KVCacheFullError, StaticKVCache

CFG = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, n_layers=2, n_heads=4, n_kv_heads=2,
                  head_dim=16, rope_theta=10000.0, max_position_embeddings=128)
ATOL = 1e-5


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    return Llama(CFG).eval().requires_grad_(False)


def new_cache(max_slots: int = 4, max_seq_len: int = 64) -> StaticKVCache:
    return StaticKVCache(n_layers=CFG.n_layers, n_kv_heads=CFG.n_kv_heads, head_dim=CFG.head_dim,
                         max_slots=max_slots, max_seq_len=max_seq_len)


@torch.inference_mode()
def forward(model: Llama, cache: StaticKVCache, slots: list[int], starts: list[int],
            ids: list[list[int]]) -> torch.Tensor:
    """One bound forward; rows write len(ids[0]) tokens each. Returns last-position logits (B, V)."""
    n_new = len(ids[0])
    cache.bind(slots, starts, n_new)
    positions = torch.tensor([[s + i for i in range(n_new)] for s in starts])
    return model(torch.tensor(ids), positions, cache, last_only=True)[:, -1]


def prompts(lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(CFG.vocab_size, (n,), generator=g).tolist() for n in lengths]


def decode_alone(model: Llama, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """Reference: the request alone in its cache, one token per step. Logits of prefill and every step."""
    cache = new_cache()
    slot = cache.alloc()
    logits = [forward(model, cache, [slot], [0], [prompt])[0]]
    for step in range(steps):
        token = int(logits[-1].argmax())
        logits.append(forward(model, cache, [slot], [len(prompt) + step], [[token]])[0])
    return logits


@pytest.mark.parametrize("layout", ["contiguous", "scattered", "shuffled"])
def test_ragged_batched_decode_equals_per_row(model: Llama, layout: str) -> None:
    lengths, steps = [3, 12, 7], 6
    refs = [decode_alone(model, p, steps) for p in prompts(lengths)]
    cache = new_cache(max_slots=6)
    if layout == "scattered":  # slots [0, 2, 4]: exercises the gather (index_select / index_put) path
        taken = [cache.alloc() for _ in range(5)]
        for s in (1, 3):
            cache.free(s)
        slots = [taken[0], taken[2], taken[4]]
    else:
        slots = [cache.alloc() for _ in lengths]
        if layout == "shuffled":  # slots [2, 0, 1]: rows out of slot order
            slots = [slots[2], slots[0], slots[1]]
    last = [forward(model, cache, [s], [0], [p])[0] for s, p in zip(slots, prompts(lengths))]
    pos = list(lengths)
    for step in range(steps):
        tokens = [[int(x.argmax())] for x in last]
        batch = forward(model, cache, slots, pos, tokens)  # rows at three different lengths
        for row, ref in enumerate(refs):
            torch.testing.assert_close(batch[row], ref[step + 1], atol=ATOL, rtol=0)
        last, pos = list(batch), [n + 1 for n in pos]


def test_uniform_batch_equals_per_row(model: Llama) -> None:
    ps = prompts([9, 9, 9])
    refs = [decode_alone(model, p, 3) for p in ps]
    cache = new_cache()
    slots = [cache.alloc() for _ in ps]
    last = list(forward(model, cache, slots, [0, 0, 0], ps))  # batched prefill, is_causal path
    for step in range(3):
        for row, ref in enumerate(refs):
            torch.testing.assert_close(last[row], ref[step], atol=ATOL, rtol=0)
        last = list(forward(model, cache, slots, [9 + step] * 3, [[int(x.argmax())] for x in last]))


def test_chunked_prefill_equals_one_prefill(model: Llama) -> None:
    (p,) = prompts([20])
    cache = new_cache()
    a, b = cache.alloc(), cache.alloc()
    whole = forward(model, cache, [a], [0], [p])
    forward(model, cache, [b], [0], [p[:8]])
    chunked = forward(model, cache, [b], [8], [p[8:]])  # 12 new tokens after an 8-token prefix
    torch.testing.assert_close(chunked, whole, atol=ATOL, rtol=0)


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1]], ids=["in-slot-order", "shuffled"])
def test_attend_matches_naive_gqa_attention(order: list[int]) -> None:
    torch.manual_seed(2)
    cache = StaticKVCache(n_layers=1, n_kv_heads=2, head_dim=8, max_slots=3, max_seq_len=16)
    taken = [cache.alloc() for _ in range(3)]
    slots = [taken[i] for i in order]
    starts, n_new = [0, 5, 2], 3
    k_hist, v_hist = torch.randn(2, 3, 2, 16, 8).unbind(0)  # earlier tokens, (B, nkv, L, hd)
    for row, slot in enumerate(slots):
        cache.kv[0, 0, slot], cache.kv[0, 1, slot] = k_hist[row], v_hist[row]
    q, k, v = torch.randn(3, 4, n_new, 8), torch.randn(3, 2, n_new, 8), torch.randn(3, 2, n_new, 8)
    cache.bind(slots, starts, n_new)
    out = cache.attend(0, q, k, v)
    for row, start in enumerate(starts):
        keys = torch.cat([k_hist[row, :, :start], k[row]], dim=1).repeat_interleave(2, dim=0)  # (nh, ctx, hd)
        vals = torch.cat([v_hist[row, :, :start], v[row]], dim=1).repeat_interleave(2, dim=0)
        scores = q[row] @ keys.transpose(1, 2) / 8 ** 0.5  # (nh, T, ctx)
        causal = torch.arange(start + n_new)[None, :] <= (start + torch.arange(n_new))[:, None]
        ref = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ vals
        torch.testing.assert_close(out[row], ref, atol=ATOL, rtol=0)


def test_export_import_roundtrip_gives_identical_logits(model: Llama) -> None:
    (p,) = prompts([11])
    prefill_rank, decode_rank = new_cache(), new_cache(max_slots=3)
    src = prefill_rank.alloc()
    first = forward(model, prefill_rank, [src], [0], [p])
    kv = prefill_rank.export(src, len(p))
    assert kv.shape == (CFG.n_layers, 2, CFG.n_kv_heads, len(p), CFG.head_dim) and kv.is_contiguous()
    decode_rank.alloc()
    dst = decode_rank.alloc()  # a different slot number on the receiving side
    decode_rank.import_(dst, kv.clone())
    token = [[int(first.argmax())]]
    expected = forward(model, prefill_rank, [src], [len(p)], token)
    got = forward(model, decode_rank, [dst], [len(p)], token)
    assert torch.equal(got, expected)
    kv.zero_()  # export is a copy, not a view of the cache
    assert prefill_rank.kv[:, :, src, :, : len(p)].abs().sum() > 0


def test_import_rejects_wrong_shape() -> None:
    cache = new_cache()
    slot = cache.alloc()
    with pytest.raises(ValueError, match="import_"):
        cache.import_(slot, torch.zeros(CFG.n_layers, 2, CFG.n_kv_heads + 1, 4, CFG.head_dim))


def test_full_cache_raises_and_free_recycles() -> None:
    cache = new_cache(max_slots=2)
    assert [cache.alloc(), cache.alloc()] == [0, 1] and cache.num_free == 0
    with pytest.raises(KVCacheFullError, match="all 2 slots"):
        cache.alloc()
    cache.free(0)
    assert cache.num_free == 1 and cache.alloc() == 0
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(5)


def test_alloc_keeps_clear_of_slots_to_avoid_while_others_are_free() -> None:
    """A prefill beside a decode step in flight must not take a slot that step still writes (kv_engine)."""
    cache = StaticKVCache(n_layers=1, n_kv_heads=1, head_dim=4, max_slots=5, max_seq_len=8)
    assert [cache.alloc() for _ in range(2)] == [0, 1]
    cache.free(0)
    assert cache.alloc(avoid={0, 2}) == 3  # the lowest free slot outside avoid
    assert cache.alloc() == 0  # the free list stays a heap: the lowest free slot next
    assert cache.alloc(avoid={2, 4}) == 2  # none outside avoid: the lowest anyway
    assert cache.alloc() == 4 and cache.num_free == 0


def test_bind_rejects_bad_rows() -> None:
    cache = new_cache(max_seq_len=16)
    slot = cache.alloc()
    with pytest.raises(ValueError, match="not allocated"):
        cache.bind([slot + 1], [0], 1)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        cache.bind([slot], [10], 7)
    with pytest.raises(ValueError, match="one start_pos per slot"):
        cache.bind([slot], [0, 1], 1)
