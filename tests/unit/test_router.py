"""Choice of transport per tensor (docs/architecture.md §7) with recording fake transports, no processes.

A failure means a small tensor stops riding inline, a tensor to another host goes over the intra-host transport
(or the reverse), a receive goes to a transport other than the one the descriptor names, a send that cannot
leave keeps its arena slot, or the per-edge statistics (--log-stats, /metrics) label an edge wrongly.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mstar_dist.control import messages as m
from mstar_dist.transport.base import Done, PeerDeadError
from mstar_dist.transport.router import Router

HOSTS = {0: "a", 1: "a", 2: "b"}


class Recording:
    def __init__(self, name: str):
        self.name = name
        self.sent, self.received, self.acked, self.aborted = [], [], [], []

    def post_send(self, tensor, dst):
        self.sent.append(dst)
        at = None if self.name == "p2p" else m.ShmLocation("seg", 0, tensor.numel() * 4, len(self.sent))
        return Done(tensor), at

    def post_recv(self, wire, src, device=None):
        self.received.append((src, wire.via))
        return Done(torch.zeros(wire.shape))

    def poll(self):
        return []

    def flush(self):
        self.flushed = getattr(self, "flushed", 0) + 1

    def device_inflight(self):
        return False

    def withdraw(self, transfer):
        return self.name == "p2p" and getattr(transfer, "deferred", False)

    def on_ack(self, src, ack):
        self.acked.append((src, ack.slots))

    def abort_peer(self, peer, reason):
        self.aborted.append(peer)

    def is_dead(self, peer):
        return peer in self.aborted

    def stats(self):
        return {"sends": len(self.sent), "bytes_used": 0} if self.name != "p2p" else {"sends": len(self.sent)}

    def close(self):
        pass


def router(intra="shm", inter="p2p"):
    planes = {"shm": Recording("shm"), "p2p": Recording("p2p")}
    return Router(global_rank=0, rank_hosts=HOSTS, transports=planes, intra_host=intra, inter_host=inter,
                  inline_max_bytes=64, device=torch.device("cpu")), planes


def test_small_goes_inline_same_host_intra_other_host_inter():
    r, planes = router()
    _, value = r.post_send(torch.ones(16), 1)  # 64 bytes: inline
    assert isinstance(value, m.InlineTensor) and planes["shm"].sent == planes["p2p"].sent == []
    _, value = r.post_send(torch.ones(100), 1)
    assert value.via == "shm" and value.at.segment == "seg" and planes["shm"].sent == [1]
    _, value = r.post_send(torch.ones(100), 2)
    assert value.via == "p2p" and value.at is None and planes["p2p"].sent == [2]
    assert (r.via(1), r.via(2)) == ("shm", "p2p")


def test_receive_goes_where_the_descriptor_says_and_counts_the_edge():
    r, planes = router()
    r.post_recv(m.WireTensor(shape=[100], dtype="float32", via="p2p"), 1, walk="decode", signal="kv").done()
    r.post_recv(m.WireTensor(shape=[100], dtype="float32", via="shm", at=m.ShmLocation("s", 0, 400, 1)), 1,
                walk="decode", signal="kv").done()
    tensor = r.post_recv(r.post_send(torch.ones(4), 1)[1], 1, walk="prefill", signal="tok").tensor
    assert torch.equal(tensor, torch.ones(4))
    assert planes["p2p"].received == [(1, "p2p")] and planes["shm"].received == [(1, "shm")]
    edges = {(e.walk, e.src, e.dst, e.signal, e.via): (e.count, e.nbytes) for e in r.edges.snapshot()}
    assert edges == {("decode", 1, 0, "kv", "p2p"): (1, 400), ("decode", 1, 0, "kv", "shm"): (1, 400),
                     ("prefill", 1, 0, "tok", "inline"): (1, 16)}
    with pytest.raises(PeerDeadError, match="'mooncake', which rank 0 does not run"):
        r.post_recv(m.WireTensor(shape=[100], dtype="float32", via="mooncake"), 2)


def test_cancel_gives_an_arena_slot_back_withdraws_a_deferred_p2p_send_and_aborts_an_issued_one():
    r, planes = router()
    shm_transfer, shm_value = r.post_send(torch.ones(100), 1)
    issued, p2p_value = r.post_send(torch.ones(100), 2)
    r.cancel(1, shm_transfer, shm_value, "the message never left")
    r.cancel(2, SimpleNamespace(deferred=True), p2p_value, "the message never left")  # not issued yet
    assert planes["shm"].acked == [(1, [shm_value.at.slot])] and planes["p2p"].aborted == []
    r.cancel(2, issued, p2p_value, "the message never left")
    assert planes["p2p"].aborted == [2]
    assert r.is_dead(2) and not r.is_dead(1)
    assert r.arena_bytes_used() == {"shm": 0}
    r.flush()
    assert planes["p2p"].flushed == planes["shm"].flushed == 1


def test_values_to_this_rank_itself_go_inline_at_any_size_even_with_no_transport():
    from mstar_dist.transport.router import Router

    r = Router(global_rank=0, rank_hosts={0: "h"}, transports={}, intra_host="p2p", inter_host="p2p",
               inline_max_bytes=64, device=torch.device("cpu"))  # a one-rank deployment: no transport at all
    assert not r.is_dead(0)
    big = torch.arange(1000, dtype=torch.float32)
    transfer, value = r.post_send(big, 0)
    assert transfer.done() and isinstance(value, m.InlineTensor)
    assert torch.equal(r.post_recv(value, 0, walk="speech", signal="codes").tensor, big)
    assert r.is_dead(1)  # another rank with no transport to it is unreachable


def test_a_dtype_the_wire_cannot_name_is_refused_before_any_transport_is_posted():
    r, planes = router()
    with pytest.raises(ValueError, match="cannot be put on the wire"):
        r.post_send(torch.ones(100).to(torch.float8_e4m3fnuz), 1)  # above inline_max_bytes: would take a slot
    assert planes["shm"].sent == []  # nothing lent that no descriptor would ever name


def test_cancel_hands_the_transport_the_deferred_send_it_made_not_the_routers_metered_one():
    """The router wraps each send to time it; withdrawing must see the transport's own transfer, else a p2p send
    that was still deferred is taken for an issued one and its pair aborted for nothing."""
    r, planes = router()
    p2p = planes["p2p"]
    p2p.post_send = lambda tensor, dst: (SimpleNamespace(deferred=True, tensor=tensor, done=lambda: False), None)
    transfer, value = r.post_send(torch.ones(100), 2)
    assert not transfer.done()
    r.cancel(2, transfer, value, "the message never left")
    assert p2p.aborted == [] and not r.is_dead(2)
