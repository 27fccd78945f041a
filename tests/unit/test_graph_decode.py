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

    assert context_buckets(2048) == [256, 512, 1024, 2048]
    assert context_buckets(3000) == [256, 512, 1024, 2048, 3000]
    assert context_buckets(256) == [256]
    assert context_buckets(100) == [100]
    cache = StaticKVCache(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, max_slots=9, max_seq_len=2048)
    graphs = DecodeGraphs(model=None, cache=cache, scratch_slot=8, max_batch=8)
    assert graphs.bucket_for(3, 40) == (4, 256)
    assert graphs.bucket_for(8, 255) == (8, 256)
    assert graphs.bucket_for(1, 256) == (1, 512)  # position 256 is the 257th: the next bucket
    assert graphs.bucket_for(2, 700) == (2, 1024)
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
    base, factor = cg.CTX_BASE, cg.CTX_FACTOR
    cg.CTX_BASE, cg.CTX_FACTOR = 16, 4
    try:
        graphs = cg.DecodeGraphs(model, c2, scratch_slot=c2.alloc(), max_batch=4)
    finally:
        cg.CTX_BASE, cg.CTX_FACTOR = base, factor
    assert graphs.contexts == [16, 64]
    graphs.capture()
    replayed = run(model, c2, [5, 12, 3], 20, lambda t, n, s: graphs.logits(t, n, s))  # positions 3 .. 31
    assert torch.allclose(eager, replayed, atol=1e-4), (eager - replayed).abs().max()


def test_graph_mode_prefill_writes_and_attends_like_eager_on_cpu():
    """bind_prefill_graph (what a captured prefill replays) against bind: right-padded rows give each row's own
    last-token logits, write its KV into its slot, and a padding row writing into the scratch slot changes nothing;
    decode steps after it match too."""
    from mstar_dist.engine.cuda_graphs import PrefillGraphs

    model, new = make("cpu")
    lengths = [5, 17, 9]
    eager_cache, graph_cache = new(), new()
    eager = run(model, eager_cache, lengths, 4, eager_step(model, eager_cache))
    slots = [graph_cache.alloc() for _ in lengths]
    scratch = graph_cache.alloc()
    graphs = PrefillGraphs(model, graph_cache, scratch_slot=scratch, max_rows=4, max_tokens=128)
    ids = torch.zeros((4, 32), dtype=torch.long)  # bucket (4, 32): three prompts and a padding row
    for row, p in enumerate(prompts(lengths)):
        ids[row, :len(p)] = torch.tensor(p)
    with torch.inference_mode():
        logits = graphs._forward(ids, torch.tensor([*slots, scratch]), torch.tensor([n - 1 for n in lengths] + [0]))
    toks = logits[:3, -1].argmax(-1)
    out, lens = [], list(lengths)
    with torch.inference_mode():
        for _ in range(4):
            step = eager_step(model, graph_cache)(toks, lens, slots)[:, -1].float()
            out.append(step)
            toks, lens = step.argmax(-1), [n + 1 for n in lens]
    assert torch.allclose(eager, torch.stack(out), atol=1e-5), (eager - torch.stack(out)).abs().max()
    for slot, n in zip(slots, lengths):  # the prompt's KV, as an eager prefill wrote it
        torch.testing.assert_close(graph_cache.kv[:, :, slot, :, :n], eager_cache.kv[:, :, slot, :, :n])


def test_prefill_buckets_hold_the_batch_within_the_token_budget():
    from mstar_dist.engine.cuda_graphs import PrefillGraphs

    cache = StaticKVCache(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, max_slots=9, max_seq_len=100)
    graphs = PrefillGraphs(model=None, cache=cache, scratch_slot=8, max_rows=6, max_tokens=256)
    # half steps between powers of two (a batch pads by at most a third); the last: the cache's length
    assert sorted({length for _, length in graphs.buckets}) == [16, 24, 32, 48, 64, 96, 100]
    assert sorted({rows for rows, _ in graphs.buckets}) == [1, 2, 4, 6]
    assert all(rows * length <= 256 for rows, length in graphs.buckets)
    assert graphs.bucket_for(1, 44) == (1, 48)
    assert graphs.bucket_for(5, 20) == (6, 24)
    assert graphs.bucket_for(3, 10) == (4, 16)
    assert graphs.bucket_for(2, 100) == (2, 100)
    assert graphs.bucket_for(5, 40) is None  # 6 x 48 padded tokens: past the budget, the batch runs eagerly
