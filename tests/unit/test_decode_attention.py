"""The in-place decode attention kernel (engine/decode_attention.py) against the SDPA path it replaces, and the choice
of it in ``StaticKVCache`` and ``LlamaChat``. The kernel runs on CUDA, or on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1`` with Triton installed); without either its cases skip, and the validation cases still run. A
failure means decode steps with the kernel attend over other positions than SDPA does (a row reading another row's
slot, a position past its own, the new token counted twice or not at all) or write the cache elsewhere."""

from __future__ import annotations

import pytest
import torch

from mstar_dist.engine import decode_attention
from mstar_dist.engine.kv_cache import StaticKVCache
from tests.unit.test_graph_decode import eager_step, graph_mode_step, make, run

DEVICES = [d for d in ("cpu", "cuda") if (d == "cpu" or torch.cuda.is_available()) and decode_attention.available(d)]
needs_kernel = pytest.mark.skipif(not DEVICES, reason="needs Triton on CUDA (or its interpreter on the CPU)")


def pair(device: str, n_kv: int = 3, group: int = 3, hd: int = 64, slots: int = 6, length: int = 200,
         dtype=torch.float32):
    """Two caches with the same random contents, the second with the kernel."""
    a = StaticKVCache(2, n_kv, hd, slots, length, dtype=dtype, device=device)
    a.kv.normal_()
    b = StaticKVCache(2, n_kv, hd, slots, length, dtype=dtype, device=device, decode_kernel=True)
    b.kv.copy_(a.kv)
    return a, b


def qkv(rows: int, n_kv: int, group: int, hd: int, device: str, dtype=torch.float32):
    """q, k, v laid out as the model's attention hands them over: transposed views of one projection."""
    nh = n_kv * group
    x = torch.randn(rows, 1, nh + 2 * n_kv, hd, device=device, dtype=dtype)
    return (x[:, :, :nh].transpose(1, 2), x[:, :, nh:nh + n_kv].transpose(1, 2),
            x[:, :, nh + n_kv:].transpose(1, 2))


@needs_kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 2, 8])
def test_kernel_attends_and_writes_like_sdpa_over_copies(device, splits):
    """Rows in no slot order, one past several blocks of cached positions, one at a block's edge, one new (position
    0), and two padding rows into the scratch slot: the real rows' outputs and every cache position match SDPA's,
    with each row's positions in one program or split over several (some of which then hold none)."""
    torch.manual_seed(0)
    a, b = pair(device, length=600)
    slots = torch.tensor([3, 0, 4, 1, 5, 5], device=device)
    positions = torch.tensor([590, 7, 0, decode_attention.BLOCK, 0, 0], device=device)
    q, k, v = qkv(6, 3, 3, 64, device)
    k[5], v[5] = k[4], v[4]  # padding rows write the same thing (bind_graph's contract)
    a.bind_graph(slots, positions, 600)
    want = a.attend(1, q, k, v)
    got = decode_attention.decode_attend(q, k, v, b.kv[1, 0], b.kv[1, 1], slots, positions, splits=splits)
    assert got.shape == want.shape == (6, 9, 1, 64)
    assert torch.allclose(got[:4], want[:4], atol=1e-5), (got[:4] - want[:4]).abs().max()
    assert torch.equal(a.kv, b.kv)  # the step's K/V went to the same places, nothing else moved


@needs_kernel
@pytest.mark.parametrize("device", DEVICES)
def test_a_graph_bound_prefill_stores_its_prompt_as_the_indexed_writes_do(device):
    """``bind_prefill_graph`` with the kernels writes each row's keys and values in one launch (``store_prompt``):
    every cache position ends as with the two indexed assignments, from K/V laid out as the model hands them over
    (transposed views of one projection), two padding rows into one scratch slot; the attention is the same."""
    torch.manual_seed(0)
    a, b = pair(device, length=64)
    slots = torch.tensor([4, 1, 5, 5], device=device)
    x = torch.randn(4, 10, 15, 64, device=device)
    q, k, v = x[:, :, :9].transpose(1, 2), x[:, :, 9:12].transpose(1, 2), x[:, :, 12:].transpose(1, 2)
    x[3] = x[2]  # padding rows write the same thing
    for cache in (a, b):
        cache.bind_prefill_graph(slots, 10)
    want, got = a.attend(1, q, k, v), b.attend(1, q, k, v)
    assert torch.equal(a.kv, b.kv)
    assert torch.allclose(got, want)


@needs_kernel
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_decode_with_the_kernel_matches_eager(device):
    """A model decoding three rows of different lengths greedily: the same logits with the kernel as eagerly."""
    model, new = make(device)
    eager_cache = new()
    kernel_cache = StaticKVCache(eager_cache.n_layers, eager_cache.n_kv_heads, eager_cache.head_dim, max_slots=6,
                                 max_seq_len=64, device=device, decode_kernel=True)
    eager = run(model, eager_cache, [5, 9, 3], 6, eager_step(model, eager_cache))
    kernel = run(model, kernel_cache, [5, 9, 3], 6, graph_mode_step(model, kernel_cache))
    assert torch.allclose(eager, kernel, atol=1e-4), (eager - kernel).abs().max()


@needs_kernel
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_decode_over_split_contexts_matches_eager(device):
    """Rows past 512 positions in a 1024 bucket, where a small batch splits each row's positions over programs (one
    row short enough to leave most of its splits empty): the same logits as eager decode."""
    from models.llama.config import LlamaConfig
    from models.llama.model import Llama
    from tests.unit.test_kv_cache import CFG

    config = LlamaConfig(**{**CFG.__dict__, "max_position_embeddings": 1024})
    torch.manual_seed(0)
    model = Llama(config).to(device).eval().requires_grad_(False)
    model.init_rope_tables()
    shape = (config.n_layers, config.n_kv_heads, config.head_dim)
    eager_cache = StaticKVCache(*shape, max_slots=4, max_seq_len=1024, device=device)
    kernel_cache = StaticKVCache(*shape, max_slots=4, max_seq_len=1024, device=device, decode_kernel=True)
    assert decode_attention.splits_for(3, config.n_kv_heads, 1024) > 1
    eager = run(model, eager_cache, [600, 530, 3], 4, eager_step(model, eager_cache))
    kernel = run(model, kernel_cache, [600, 530, 3], 4, graph_mode_step(model, kernel_cache, ctx=1024))
    assert torch.allclose(eager, kernel, atol=1e-4), (eager - kernel).abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not decode_attention.available("cuda"),
                    reason="needs Triton on CUDA")
def test_captured_kernel_graphs_match_eager_and_need_one_context():
    from mstar_dist.engine.cuda_graphs import DecodeGraphs

    model, new = make("cuda")
    eager_cache = new()
    cache = StaticKVCache(eager_cache.n_layers, eager_cache.n_kv_heads, eager_cache.head_dim, max_slots=6,
                          max_seq_len=64, device="cuda", decode_kernel=True)
    eager = run(model, eager_cache, [5, 30, 3], 20, eager_step(model, eager_cache))
    graphs = DecodeGraphs(model, cache, scratch_slot=cache.alloc(), max_batch=4)
    assert graphs.contexts == [64]  # the kernel reads each row's own length: one graph per batch bucket here
    graphs.capture()
    replayed = run(model, cache, [5, 30, 3], 20, lambda t, n, s: graphs.logits(t, n, s))
    assert torch.allclose(eager, replayed, atol=1e-4), (eager - replayed).abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not decode_attention.available("cuda"),
                    reason="needs Triton on CUDA")
def test_kernel_in_bfloat16_stays_close_to_sdpa():
    torch.manual_seed(1)
    a, b = pair("cuda", dtype=torch.bfloat16, length=2048)
    slots = torch.tensor([2, 0, 1], device="cuda")
    positions = torch.tensor([1500, 300, 1], device="cuda")
    q, k, v = qkv(3, 3, 3, 64, "cuda", dtype=torch.bfloat16)
    a.bind_graph(slots, positions, 2048)
    b.bind_graph(slots, positions, 2048)
    want, got = a.attend(0, q, k, v).float(), b.attend(0, q, k, v).float()
    assert (got - want).abs().max() < 2e-2, (got - want).abs().max()


def test_small_batches_split_long_contexts_and_graphs_keep_two_buckets():
    from mstar_dist.engine.decode_attention import kernel_contexts, splits_for

    assert kernel_contexts(2048) == [512, 2048] and kernel_contexts(512) == [512] and kernel_contexts(64) == [64]
    assert [splits_for(rows, 3, 2048) for rows in (1, 2, 4, 8, 16, 32, 64)] == [8, 8, 8, 4, 2, 1, 1]
    assert splits_for(1, 3, 512) == 1  # short contexts: no combine step


def test_decode_kernel_where_it_cannot_run_is_refused_with_the_reason():
    if decode_attention.available("cpu"):
        pytest.skip("Triton's interpreter runs the kernel on the CPU here")
    with pytest.raises(ValueError, match="decode_kernel needs Triton"):
        StaticKVCache(1, 1, 16, 2, 8, decode_kernel=True)


def test_the_engine_config_checks_decode_attention():
    from mstar_dist.config.engine import EngineConfig

    with pytest.raises(ValueError, match=r"decode_attention = 'flash': must be one of auto \| triton \| sdpa"):
        EngineConfig(decode_attention="flash")
    with pytest.raises(ValueError, match="engine.decode_attention: triton attends in CUDA-graph decode steps, and "
                                         "cuda_graphs is off"):
        decode_attention.wanted("triton", "cpu", graphs=False)
    assert decode_attention.wanted("auto", "cpu", graphs=False) is False  # auto: SDPA off the graphs
    assert decode_attention.wanted("sdpa", "cuda", graphs=True) is False
