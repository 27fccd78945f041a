"""TensorStore lifetime rules (docs/architecture.md §7). A failure means tensors leak (live_* not back to 0 at idle) or
are let go while a consumer or the conductor still counts on them."""

import pytest
import torch

from mstar_dist.transport.store import TensorStore


def test_put_get_unpersist_lets_go_once():
    s = TensorStore()
    t = torch.arange(10, dtype=torch.float32)
    u = s.put(t)
    assert s.get(u) is t and u in s
    assert (s.live_tensors, s.live_bytes) == (1, 40)
    s.unpersist(u)
    assert (s.live_tensors, s.live_bytes) == (0, 0) and u not in s
    with pytest.raises(KeyError, match="not in this rank's store"):
        s.get(u)
    with pytest.raises(KeyError):  # a second release is a bug to surface
        s.unpersist(u)


def test_drop_tag_lets_go_of_a_request_at_once():
    s = TensorStore()
    a = s.put(torch.zeros(3), tag="req-1")
    b = s.put(torch.zeros(3), tag="req-1")
    c = s.put(torch.zeros(3), tag="req-2")
    assert s.drop_tag("req-1") == 2
    assert a not in s and b not in s and c in s
    assert s.drop_tag("req-1") == 0
    s.unpersist(c)
    assert (s.live_tensors, s.live_bytes) == (0, 0)
    assert s.drop_tag("req-2") == 0  # let go normally: no stale tag entry left


def test_unknown_uuid_message_names_it():
    s = TensorStore()
    with pytest.raises(KeyError, match="deadbeef"):
        s.unpersist("deadbeef")
