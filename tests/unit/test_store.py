"""TensorStore lifetime rules (docs/architecture.md §7). A failure here means tensors leak (live_* not back to 0 at idle) or
are freed while a consumer or the conductor still counts on them."""

import pytest
import torch

from mstar_dist.transport.store import TensorStore


def test_put_get_release_frees_at_zero():
    s = TensorStore()
    t = torch.arange(10, dtype=torch.float32)
    u = s.put(t, refs=2)
    assert s.get(u) is t
    assert (s.live_tensors, s.live_bytes) == (1, 40)
    assert s.release(u) is False
    assert s.release(u) is True
    assert (s.live_tensors, s.live_bytes) == (0, 0)
    with pytest.raises(KeyError, match="not in this rank's store"):
        s.get(u)


def test_incref_and_over_release():
    s = TensorStore()
    u = s.put(torch.zeros(2))
    s.incref(u, 2)
    assert s.refcount(u) == 3
    with pytest.raises(ValueError, match="refcount is 3"):
        s.release(u, 4)
    assert s.release(u, 3) is True


def test_persist_outlives_refs_until_unpersisted_with_count():
    s = TensorStore()
    u = s.put(torch.zeros(4), refs=1, persist=True)
    assert s.release(u) is False  # persisted: survives its last consumer
    assert u in s
    s.persist(u, 2)  # conductor dispatched two more walks that read it
    assert s.unpersist(u, 2) is False
    assert s.unpersist(u) is True
    assert s.live_tensors == 0
    with pytest.raises(KeyError):
        s.unpersist(u)


def test_unpersist_more_than_persisted_is_an_error():
    s = TensorStore()
    u = s.put(torch.zeros(1), refs=0, persist=True)
    with pytest.raises(ValueError, match="persisted 1 time"):
        s.unpersist(u, 2)


def test_drop_tag_frees_a_request_whatever_its_counts():
    s = TensorStore()
    a = s.put(torch.zeros(3), refs=5, tag="req-1")
    b = s.put(torch.zeros(3), refs=0, persist=True, tag="req-1")
    c = s.put(torch.zeros(3), tag="req-2")
    assert s.drop_tag("req-1") == 2
    assert a not in s and b not in s and c in s
    assert s.drop_tag("req-1") == 0
    s.release(c)
    assert (s.live_tensors, s.live_bytes) == (0, 0)
    assert s.drop_tag("req-2") == 0  # freed normally: no stale tag entry left


def test_born_dead_put_is_rejected():
    s = TensorStore()
    with pytest.raises(ValueError):
        s.put(torch.zeros(1), refs=0)
    with pytest.raises(ValueError):
        s.put(torch.zeros(1), refs=-1)
    assert s.live_tensors == 0


def test_unknown_uuid_message_names_it():
    s = TensorStore()
    with pytest.raises(KeyError, match="deadbeef"):
        s.release("deadbeef")
