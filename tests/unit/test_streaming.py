"""Streaming-edge chunk policies (docs/architecture.md §4). A failure here means a consumer (e.g. an audio codec fed by an LLM)
gets items twice, misses items, gets the wrong overlap, never sees its final iteration or sees it twice: audible
glitches, truncated or hung streams."""

import pytest
import torch

from mstar_dist.graph.streaming import Chunk, Fixed, LeftContext, SlidingWindow, StreamBuffer


def run(policy, n_items, pushes=None):
    """Push 0..n_items-1 (one at a time, or in the given group sizes), popping after every push; then finish.
    Returns chunks as (items, n_context, is_final, index)."""
    buf = StreamBuffer(policy)
    chunks = []
    sizes = pushes or [1] * n_items
    assert sum(sizes) == n_items
    pos = 0
    for size in sizes:
        buf.push(torch.arange(pos, pos + size))
        pos += size
        chunks += buf.pop_ready()
    buf.producer_done()
    chunks += buf.pop_ready()
    assert buf.done and buf.pop_ready() == []
    return [(c.data.tolist(), c.n_context, c.is_final, c.index) for c in chunks]


# ---- exact boundaries, written out by hand ----

def test_sliding_window_chunks_overlap_by_window_minus_stride():
    assert run(SlidingWindow(window=3, stride=2), 7) == [
        ([0, 1, 2], 0, False, 0),
        ([2, 3, 4], 1, False, 1),
        ([4, 5, 6], 1, False, 2),
        ([], 0, True, 3),  # nothing left over: empty final chunk
    ]


def test_sliding_window_final_chunk_is_the_last_window_items():
    assert run(SlidingWindow(window=3, stride=2), 8) == [
        ([0, 1, 2], 0, False, 0),
        ([2, 3, 4], 1, False, 1),
        ([4, 5, 6], 1, False, 2),
        ([5, 6, 7], 2, True, 3),  # only 7 is new
    ]


def test_sliding_window_stride_one():
    assert run(SlidingWindow(window=4, stride=1), 6) == [
        ([0, 1, 2, 3], 0, False, 0),
        ([1, 2, 3, 4], 3, False, 1),
        ([2, 3, 4, 5], 3, False, 2),
        ([], 0, True, 3),
    ]


def test_sliding_window_shorter_stream_than_window_is_one_final_chunk():
    assert run(SlidingWindow(window=3, stride=1), 2) == [([0, 1], 0, True, 0)]


def test_left_context_prefixes_up_to_left_context_previous_items():
    assert run(LeftContext(chunk=2, left_context=3), 7) == [
        ([0, 1], 0, False, 0),
        ([0, 1, 2, 3], 2, False, 1),
        ([1, 2, 3, 4, 5], 3, False, 2),
        ([3, 4, 5, 6], 3, True, 3),  # remainder [6] with 3 items of context
    ]


def test_left_context_nothing_left_gives_empty_final_chunk():
    assert run(LeftContext(chunk=2, left_context=1), 4) == [
        ([0, 1], 0, False, 0),
        ([1, 2, 3], 1, False, 1),
        ([], 0, True, 2),
    ]


def test_fixed_remainder_is_the_final_chunk():
    assert run(Fixed(chunk=3), 8) == [
        ([0, 1, 2], 0, False, 0),
        ([3, 4, 5], 0, False, 1),
        ([6, 7], 0, True, 2),
    ]


def test_fixed_exact_multiple_gives_empty_final_chunk():
    assert run(Fixed(chunk=3), 6) == [
        ([0, 1, 2], 0, False, 0),
        ([3, 4, 5], 0, False, 1),
        ([], 0, True, 2),
    ]


@pytest.mark.parametrize("policy", [SlidingWindow(3, 2), LeftContext(2, 1), Fixed(3)])
def test_empty_stream_gets_exactly_one_empty_final_chunk(policy):
    buf = StreamBuffer(policy)
    buf.producer_done()
    assert buf.has_ready and not buf.done
    (chunk,) = buf.pop_ready()
    assert chunk.is_final and chunk.index == 0 and chunk.n_context == 0 and chunk.data.numel() == 0
    assert buf.done and not buf.has_ready and buf.pop_ready() == []


# ---- continue_after_done ----

def test_continue_after_done_remainder_is_a_short_non_final_chunk():
    assert run(Fixed(chunk=3, continue_after_done=True), 8) == [
        ([0, 1, 2], 0, False, 0),
        ([3, 4, 5], 0, False, 1),
        ([6, 7], 0, False, 2),
    ]


def test_continue_after_done_without_remainder_emits_nothing_and_is_done_at_once():
    buf = StreamBuffer(Fixed(chunk=2, continue_after_done=True))
    buf.push(torch.arange(4))
    assert [c.data.tolist() for c in buf.pop_ready()] == [[0, 1], [2, 3]]
    buf.producer_done()
    assert buf.done and not buf.has_ready
    assert buf.pop_ready() == []


# ---- shared rules ----

@pytest.mark.parametrize("policy", [SlidingWindow(3, 2), SlidingWindow(4, 1), LeftContext(2, 3), Fixed(3),
                                    Fixed(3, continue_after_done=True)])
@pytest.mark.parametrize("n_items", [0, 1, 5, 6, 9])
def test_chunks_do_not_depend_on_how_items_are_pushed(policy, n_items):
    one_by_one = run(policy, n_items)
    assert run(policy, n_items, pushes=[n_items] if n_items else []) == one_by_one
    if n_items >= 5:
        assert run(policy, n_items, pushes=[2, 3, n_items - 5]) == one_by_one
    # popping only once at the end gives the same chunks too
    buf = StreamBuffer(policy)
    for i in range(n_items):
        buf.push_one(torch.tensor(i))
    buf.producer_done()
    assert [(c.data.tolist(), c.n_context, c.is_final, c.index) for c in buf.pop_ready()] == one_by_one


@pytest.mark.parametrize("policy", [SlidingWindow(3, 2), SlidingWindow(4, 1), LeftContext(2, 3), Fixed(3)])
@pytest.mark.parametrize("n_items", [0, 2, 7, 12])
def test_exactly_one_final_chunk_last_and_new_items_are_the_stream(policy, n_items):
    chunks = run(policy, n_items)
    assert [c[2] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert [c[3] for c in chunks] == list(range(len(chunks)))
    assert [x for items, n_context, _, _ in chunks for x in items[n_context:]] == list(range(n_items))


def test_push_after_producer_done_raises():
    buf = StreamBuffer(Fixed(2))
    buf.push(torch.arange(3))
    buf.producer_done()
    with pytest.raises(RuntimeError, match="after producer_done"):
        buf.push(torch.arange(1))
    with pytest.raises(RuntimeError, match="twice"):
        buf.producer_done()


def test_tensors_with_extra_dims_concatenate_along_dim_0():
    items = torch.arange(5 * 2 * 3, dtype=torch.float16).reshape(5, 2, 3)
    buf = StreamBuffer(LeftContext(chunk=2, left_context=1))
    buf.push(items[:1])
    buf.push_one(items[1])  # one item of shape (2, 3)
    buf.push(items[2:])
    buf.producer_done()
    chunks = buf.pop_ready()
    assert [(c.n_context, c.is_final) for c in chunks] == [(0, False), (1, False), (1, True)]
    assert torch.equal(chunks[0].data, items[0:2])
    assert torch.equal(chunks[1].data, items[1:4])
    assert torch.equal(chunks[2].data, items[3:5]) and torch.equal(chunks[2].new, items[4:5])
    assert all(c.data.dtype == torch.float16 for c in chunks)


def test_empty_final_chunk_keeps_item_shape_and_dtype():
    buf = StreamBuffer(Fixed(2))
    buf.push(torch.zeros(2, 4, dtype=torch.int64))
    buf.producer_done()
    final = buf.pop_ready()[-1]
    assert final.is_final and final.data.shape == (0, 4) and final.data.dtype == torch.int64


def test_chunk_data_does_not_alias_pushed_tensors_or_other_chunks():
    buf = StreamBuffer(SlidingWindow(window=2, stride=1))
    pushed = torch.arange(3)
    buf.push(pushed)
    first, second = buf.pop_ready()
    first.data.fill_(-1)
    assert second.data.tolist() == [1, 2] and pushed.tolist() == [0, 1, 2]


def test_mismatched_pushes_raise():
    buf = StreamBuffer(Fixed(2))
    buf.push(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="shape"):
        buf.push(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="dtype"):
        buf.push(torch.zeros(1, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="push_one"):
        buf.push(torch.tensor(1.0))


def test_has_ready_tracks_pop_ready():
    buf = StreamBuffer(Fixed(2))
    buf.push_one(torch.tensor(0))
    assert not buf.has_ready and buf.pop_ready() == []
    buf.push_one(torch.tensor(1))
    assert buf.has_ready and len(buf.pop_ready()) == 1 and not buf.has_ready


def test_long_stream_keeps_only_what_later_chunks_need():
    buf = StreamBuffer(SlidingWindow(window=4, stride=1))
    n_chunks = 0
    for i in range(5000):
        buf.push_one(torch.tensor(i))
        for chunk in buf.pop_ready():
            assert chunk.data.tolist() == list(range(i - 3, i + 1))
            n_chunks += 1
        assert len(buf._segments) <= 4  # memory stays bounded by the window, not the stream
    assert n_chunks == 4997


@pytest.mark.parametrize("make, field", [
    (lambda: SlidingWindow(window=0, stride=1), "window"),
    (lambda: SlidingWindow(window=2, stride=0), "stride"),
    (lambda: SlidingWindow(window=2, stride=3), "stride"),
    (lambda: LeftContext(chunk=0, left_context=1), "chunk"),
    (lambda: LeftContext(chunk=2, left_context=-1), "left_context"),
    (lambda: Fixed(chunk=0), "chunk"),
    (lambda: Fixed(chunk=2.5), "chunk"),
])
def test_policy_validation_names_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_chunk_new_is_data_after_context():
    chunk = Chunk(data=torch.arange(5), n_context=2, is_final=False, index=0)
    assert chunk.new.tolist() == [2, 3, 4]
