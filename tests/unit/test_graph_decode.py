"""The decode path that CUDA graphs capture (StaticKVCache.bind_graph + DecodeGraphs), checked against the eager
path. On CPU the graph-mode attention runs uncaptured; with CUDA the graphs are captured and replayed. A failure
means graph-replayed decode steps compute different logits than eager ones (wrong slot/position writes, masks,
or padding rows leaking into real slots)."""

from __future__ import annotations

import pytest
import torch

from models.llama.model import Llama
from mstar_dist.engine.kv_cache import StaticKVCache
from tests.unit.test_kv_cache import CFG, prompts


def run(model, cache: StaticKVCache, lengths, steps, step_fn):
    """Prefill rows of the given lengths eagerly, then decode `steps` greedy tokens with step_fn; all logits."""
    ids = prompts(lengths)
    slots = [cache.alloc() for _ in lengths]
    out, toks = [], []
    with torch.inference_mode():
        for slot, p in zip(slots, ids):
            cache.bind([slot], [0], len(p))
            dev = cache.device
            logits = model(torch.tensor([p], device=dev), torch.arange(len(p), device=dev)[None], cache,
                           last_only=True)[:, -1]
            toks.append(int(logits.argmax()))
        lengths = list(lengths)
        for _ in range(steps):
            tokens = torch.tensor(toks, device=cache.device)
            logits = step_fn(tokens, lengths, slots)[:, -1].float()
            out.append(logits.cpu())
            toks = logits.argmax(-1).tolist()
            lengths = [n + 1 for n in lengths]
    return torch.stack(out)


def eager_step(model, cache):
    def step(tokens, lengths, slots):
        cache.bind(slots, lengths, 1)
        pos = torch.tensor(lengths, device=cache.device)[:, None]
        return model(tokens[:, None], pos, cache, last_only=True)
    return step


def graph_mode_step(model, cache, ctx=None):
    def step(tokens, lengths, slots):
        dev = cache.device
        cache.bind_graph(torch.tensor(slots, device=dev), torch.tensor(lengths, device=dev), ctx)
        return model(tokens[:, None], torch.tensor(lengths, device=dev)[:, None], cache, last_only=True)
    return step


def make(device):
    torch.manual_seed(0)
    model = Llama(CFG).to(device).eval().requires_grad_(False)
    model.init_rope_tables()
    new = lambda: StaticKVCache(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, max_slots=6, max_seq_len=64,  # noqa
                                device=device)
    return model, new


def test_graph_mode_attention_matches_eager_on_cpu():
    model, new = make("cpu")
    c1, c2 = new(), new()
    eager = run(model, c1, [5, 9, 3], 6, eager_step(model, c1))
    graph = run(model, c2, [5, 9, 3], 6, graph_mode_step(model, c2))
    assert torch.allclose(eager, graph, atol=1e-5), (eager - graph).abs().max()


def test_graph_mode_attention_over_a_context_bucket_matches_eager_on_cpu():
    model, new = make("cpu")
    c1, c2 = new(), new()
    eager = run(model, c1, [5, 9, 3], 6, eager_step(model, c1))
    graph = run(model, c2, [5, 9, 3], 6, graph_mode_step(model, c2, ctx=16))  # positions up to 14 < 16
    assert torch.allclose(eager, graph, atol=1e-5), (eager - graph).abs().max()
    with pytest.raises(ValueError, match="ctx must be in"):
        c2.bind_graph(torch.tensor([0]), torch.tensor([3]), ctx=65)


def test_context_buckets_cover_the_cache_and_pick_the_smallest_that_holds_the_step():
    from mstar_dist.engine.cuda_graphs import DecodeGraphs, context_buckets

    assert context_buckets(2048) == [512, 2048]
    assert context_buckets(8192) == [512, 2048, 8192]
    assert context_buckets(3000) == [512, 2048, 3000]
    assert context_buckets(256) == [256]
    cache = StaticKVCache(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, max_slots=9, max_seq_len=2048)
    graphs = DecodeGraphs(model=None, cache=cache, scratch_slot=8, max_batch=8)
    assert graphs.bucket_for(3, 40) == (4, 512)
    assert graphs.bucket_for(8, 511) == (8, 512)
    assert graphs.bucket_for(1, 512) == (1, 2048)  # position 512 is the 513th: the next bucket
    assert graphs.bucket_for(5, 2047) == (8, 2048)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graphs_match_eager_on_cuda_with_padding_buckets():
    from mstar_dist.engine.cuda_graphs import DecodeGraphs

    model, new = make("cuda")
    c1, c2 = new(), new()
    eager = run(model, c1, [5, 9, 3], 8, eager_step(model, c1))
    graphs = DecodeGraphs(model, c2, scratch_slot=c2.alloc(), max_batch=4)
    graphs.capture()
    replayed = run(model, c2, [5, 9, 3], 8, lambda t, n, s: graphs.logits(t, n, s))  # 3 rows -> bucket 4
    assert torch.allclose(eager, replayed, atol=1e-4), (eager - replayed).abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graphs_cross_context_buckets_like_eager():
    """Rows that grow past the first context bucket (here 16 -> 64 positions) keep matching eager decode."""
    import mstar_dist.engine.cuda_graphs as cg

    model, new = make("cuda")
    c1, c2 = new(), new()
    eager = run(model, c1, [5, 12, 3], 20, eager_step(model, c1))
    base = cg.CTX_BASE
    cg.CTX_BASE = 16
    try:
        graphs = cg.DecodeGraphs(model, c2, scratch_slot=c2.alloc(), max_batch=4)
    finally:
        cg.CTX_BASE = base
    assert graphs.contexts == [16, 64]
    graphs.capture()
    replayed = run(model, c2, [5, 12, 3], 20, lambda t, n, s: graphs.logits(t, n, s))  # positions 3 .. 31
    assert torch.allclose(eager, replayed, atol=1e-4), (eager - replayed).abs().max()


def test_a_packed_prefill_writes_and_attends_like_eager_on_cpu():
    """PrefillGraphs.forward (what a captured prefill replays, run uncaptured) against eager prefills one prompt at a
    time: prompts packed back to back in one row, padded to the bucket, give each prompt's own last-token logits,
    write its KV into its slot at its positions (no prompt sees another's tokens, and the padding changes nothing),
    and decode steps after it match too."""
    from mstar_dist.engine.cuda_graphs import PrefillGraphs

    model, new = make("cpu")
    lengths = [5, 17, 9]
    eager_cache, packed_cache = new(), new()
    eager = run(model, eager_cache, lengths, 4, eager_step(model, eager_cache))
    slots = [packed_cache.alloc() for _ in lengths]
    scratch = packed_cache.alloc()
    graphs = PrefillGraphs(model, packed_cache, scratch_slot=scratch, max_rows=4, max_tokens=128)
    assert graphs.bucket_for(lengths) == 64  # 31 tokens: 33 of padding after them
    inputs = graphs._host_inputs([torch.tensor(p) for p in prompts(lengths)], slots, 64)
    assert inputs[4 * 64 + 4:].tolist() == [0, 5, 22, 64, 64]  # boundaries: the last prompt takes in the padding
    with torch.inference_mode():
        logits = graphs.forward(inputs, 64)
    assert logits.shape == (4, 1, CFG.vocab_size)  # a row per possible prompt: the 4th reads token 0
    toks = logits[:3, -1].argmax(-1)
    out, lens = [], list(lengths)
    with torch.inference_mode():
        for _ in range(4):
            step = eager_step(model, packed_cache)(toks, lens, slots)[:, -1].float()
            out.append(step)
            toks, lens = step.argmax(-1), [n + 1 for n in lens]
    assert torch.allclose(eager, torch.stack(out), atol=1e-5), (eager - torch.stack(out)).abs().max()
    for slot, n in zip(slots, lengths):  # the prompt's KV, as an eager prefill wrote it
        torch.testing.assert_close(packed_cache.kv[:, :, slot, :, :n], eager_cache.kv[:, :, slot, :, :n])


def test_packed_prefill_buckets_hold_a_batch_within_the_token_budget_and_the_batch_size():
    from mstar_dist.engine.cuda_graphs import PrefillGraphs, token_buckets

    assert token_buckets(4096) == [64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792,
                                   2048, 2560, 3072, 3584, 4096]
    assert token_buckets(600) == [64, 128, 192, 256, 320, 384, 448, 512, 600] and token_buckets(40) == [40]
    assert all(b / a <= 1.25 for a, b in zip(token_buckets(8192)[7:], token_buckets(8192)[8:]))  # padding < 25%
    cache = StaticKVCache(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, max_slots=9, max_seq_len=100)
    graphs = PrefillGraphs(model=None, cache=cache, scratch_slot=8, max_rows=6, max_tokens=256)
    assert graphs.buckets == [64, 128, 192, 256]
    assert graphs.bucket_for([44]) == 64
    assert graphs.bucket_for([44, 44, 44]) == 192  # 132 tokens: rows x longest bucket would have padded to 4 x 64
    assert graphs.bucket_for([99, 99, 50]) == 256
    assert graphs.bucket_for([99, 99, 99]) is None  # 297 tokens: past the budget, the batch is cut
    assert graphs.bucket_for([10, 10, 10, 10, 10, 10]) == 64
    assert graphs.bucket_for([1] * 7) is None  # more prompts than rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_attention_on_cuda_equals_each_prompt_attending_alone():
    """The variable-length kernel behind packed prefill graphs (bf16 on CUDA): each sequence of the packed row
    attends causally to its own tokens only, with GQA, exactly as SDPA over that sequence alone; the padding the last
    sequence takes in after its tokens changes none of them."""
    from mstar_dist.engine.kv_cache import _flash_varlen_causal

    torch.manual_seed(0)
    nh, nkv, hd, ends = 9, 3, 64, [5, 22, 31]
    q = torch.randn(64, nh, hd, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(64, nkv, hd, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(64, nkv, hd, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 5, 22, 64], dtype=torch.int32, device="cuda")  # the third's 9 tokens, then 33 of padding
    out = _flash_varlen_causal(q, k, v, cu, 64)
    for start, end in zip([0, *ends[:-1]], ends):
        alone = torch.nn.functional.scaled_dot_product_attention(
            q[start:end].transpose(0, 1)[None], k[start:end].transpose(0, 1)[None], v[start:end].transpose(0, 1)[None],
            is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(out[start:end], alone, atol=2e-2, rtol=2e-2)
