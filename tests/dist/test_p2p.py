"""P2P transport over gloo with real processes (docs/architecture.md §7). A failure means tensors on graph edges between
ranks arrive wrong (values, dtype, shape), out of order on a pair, or that a dead pair hangs instead of raising.

Every test follows the runtime's protocol: the descriptor goes over the ControlChannel first, the consumer
posts its receive on the descriptor, in descriptor order.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from mstar_dist.control.channel import ControlChannel
from mstar_dist.transport.inline import dtype_to_str, str_to_dtype
from mstar_dist.transport.p2p import PairDeadError
from tests.dist.launcher import run_ranks
from tests.dist.rank_setup import Desc, setup_rank, teardown_rank

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Desc)


def _expect(channel: ControlChannel, n: int, timeout_s: float = 10.0) -> list[tuple[str, Desc]]:
    out: list[tuple[str, Desc]] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n:
        assert time.monotonic() < deadline, f"only {len(out)} of {n} descriptors arrived"
        out += [(s, _dec.decode(p)) for s, p in channel.recv(timeout_ms=20)]
    return out


def _cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    return [
        base,
        base.to(torch.float16),
        base.to(torch.bfloat16),
        (base * 1e6).to(torch.int64),
        torch.randint(-128, 127, (33,), dtype=torch.int8, generator=g),
        base > 0,  # bool
        torch.arange(7, dtype=torch.int64).to(torch.uint16),  # not native to gloo/NCCL: raw bytes
        torch.empty(0, 5),  # empty: no wire op
        torch.tensor(2.5),  # 0-d: one element on the wire
        base.t(),  # non-contiguous: made contiguous
        torch.randn(4 << 20, generator=g),  # 16 MiB
    ]


def _dtypes_rank(rank: int) -> dict:
    r = setup_rank(rank)
    cases = _cases()
    if rank == 0:
        sends = []
        for seq, t in enumerate(cases):
            r.channel.send("rank1", _enc.encode(Desc(seq, list(t.shape), dtype_to_str(t.dtype))))
            sends.append(r.transport.send(t, dst=1))
            if seq % 2:
                sends[-1].done()  # polled once: its wait then goes through the pair's waiter thread
        for tr in sends:
            tr.wait(10)
        assert r.transport.inflight == 0
    else:
        for seq, (sender, d) in enumerate(_expect(r.channel, len(cases))):
            assert (sender, d.seq) == ("rank0", seq)
            got = r.transport.recv(d.shape, str_to_dtype(d.dtype), src=0).wait(10)
            want = cases[seq]
            assert got.dtype == want.dtype and got.shape == want.shape, (seq, got.dtype, got.shape)
            assert torch.equal(got, want), f"case {seq} ({want.dtype}) differs"
    stats = r.transport.stats()
    teardown_rank(r)
    return stats


def test_dtypes_shapes_and_a_16mb_tensor():
    s0, s1 = run_ranks(_dtypes_rank, 2, timeout_s=50)
    n = len(_cases())
    nbytes = sum(t.numel() * t.element_size() for t in _cases())
    assert s0["pairs"]["0->1"]["sends"] == n and s0["pairs"]["0->1"]["send_bytes"] == nbytes
    assert s1["pairs"]["0->1"]["recvs"] == n and s1["pairs"]["0->1"]["recv_bytes"] == nbytes
    assert (s0["bytes_sent"], s1["bytes_received"], s0["bytes_received"]) == (nbytes, nbytes, 0)
    assert s0["host_staging_copies"] == s1["host_staging_copies"] == 0
    assert s0["contiguous_copies"] == 1  # the transposed case


def _payload(src: int, dst: int, seq: int) -> torch.Tensor:
    """Identifies its pair and sequence number by value, and by size (so a mix-up also fails the shape)."""
    n = 1 + (seq * 7919) % 20000
    return torch.full((n,), src * 10**9 + dst * 10**6 + seq, dtype=torch.int64)


def _many_rank(rank: int, per_peer: int) -> dict:
    r = setup_rank(rank)
    peers = [p for p in range(r.world) if p != rank]
    # Post every send at once, round-robin over peers (descriptor first, then isend), before receiving.
    sends = []
    for seq in range(per_peer):
        for dst in peers:
            t = _payload(rank, dst, seq)
            r.channel.send(f"rank{dst}", _enc.encode(Desc(seq, list(t.shape), "int64")))
            sends.append(r.transport.send(t, dst))
    # Consume descriptors as they come (interleaved across senders), posting each recv at once.
    recvs: list[tuple[int, int, object]] = []
    next_seq = {p: 0 for p in peers}
    deadline = time.monotonic() + 30
    while len(recvs) < per_peer * len(peers) or r.transport.inflight:
        assert time.monotonic() < deadline, f"stuck: {len(recvs)} recvs posted, {r.transport.inflight} in flight"
        for sender, payload in r.channel.recv(timeout_ms=1):
            src, d = int(sender.removeprefix("rank")), _dec.decode(payload)
            assert d.seq == next_seq[src], f"descriptor order from rank {src}: got {d.seq}"
            next_seq[src] += 1
            recvs.append((src, d.seq, r.transport.recv(d.shape, torch.int64, src)))
        r.transport.progress()
    for src, seq, tr in recvs:
        assert torch.equal(tr.tensor, _payload(src, rank, seq)), f"pair {src}->{rank} seq {seq} got wrong data"
    assert all(tr.done() for tr in sends)
    stats = r.transport.stats()
    teardown_rank(r)
    return stats


def test_many_concurrent_transfers_keep_per_pair_order():
    per_peer = 40
    stats = run_ranks(_many_rank, 3, timeout_s=50, args=(per_peer,))
    for rank, st in enumerate(stats):
        for pair, c in st["pairs"].items():
            src, dst = map(int, pair.split("->"))
            assert c["sends" if src == rank else "recvs"] == per_peer, (rank, pair, c)
        assert st["inflight"] == 0 and st["dead_pairs"] == []


def _abort_rank(rank: int) -> list[str]:
    r = setup_rank(rank)
    errors = []
    if rank == 1:
        pending = r.transport.recv([4], torch.float32, src=0)  # rank 0 never sends it
        r.transport.abort_pair(0, 1, reason="test abort")
        for op in (pending.done, lambda: r.transport.recv([4], torch.float32, src=0)):
            with pytest.raises(PairDeadError) as exc:
                op()
            errors.append(str(exc.value))
        r.transport.send(torch.ones(3), dst=0).wait(10)  # the other direction still works
        # a receive that times out kills its pair for good, names it, and leaves the others alive
        late = r.transport.recv([2, 2], torch.float32, src=2)
        with pytest.raises(TimeoutError) as exc:
            late.wait(0.3)
        errors.append(str(exc.value))
        assert r.transport.is_pair_dead(2, 1)
        r.channel.send("rank2", b"go")
        r.transport.send(torch.arange(5), dst=2).wait(10)  # the same peer, other direction, still works
    elif rank == 0:
        r.transport.abort_pair(0, 1, reason="test abort")
        with pytest.raises(PairDeadError) as exc:
            r.transport.send(torch.ones(4), dst=1)
        errors.append(str(exc.value))
        assert torch.equal(r.transport.recv([3], torch.float32, src=1).wait(10), torch.ones(3))
    else:
        while not r.channel.recv(timeout_ms=100):  # wait until rank 1 has timed out its receive
            pass
        assert torch.equal(r.transport.recv([5], torch.int64, src=1).wait(10), torch.arange(5))
    assert r.transport.stats()["host_staging_copies"] == 0
    teardown_rank(r)
    return errors


def test_aborted_or_timed_out_pair_raises_and_others_keep_working():
    e0, e1, _ = run_ranks(_abort_rank, 3, timeout_s=50)
    assert "0->1" in e0[0] and "test abort" in e0[0]
    assert all("0->1" in e for e in e1[:2])
    assert "2->1" in e1[2] and "[2, 2]" in e1[2] and "16 bytes" in e1[2]


def _deferred_rank(rank: int) -> list:
    r = setup_rank(rank)
    got = []
    if rank == 0:
        dropped = r.transport.send(torch.full((4,), -1.0), dst=1)  # its descriptor never goes out
        assert r.transport.withdraw(dropped) and dropped.done()
        kept = r.transport.send(torch.arange(4.0), dst=1)
        r.channel.send("rank1", _enc.encode(Desc(0, [4], "float32")))
        r.transport.flush()  # issued only now, after its descriptor
        assert not r.transport.withdraw(kept)  # issued: too late to take back
        kept.wait(10)
        assert r.transport.stats()["pairs"]["0->1"]["sends"] == 1 and r.transport.inflight == 0
    else:
        (_, d), = _expect(r.channel, 1)
        got = r.transport.recv(d.shape, str_to_dtype(d.dtype), src=0).wait(10).tolist()
    teardown_rank(r)
    return got


def test_a_deferred_send_is_issued_after_its_descriptor_and_a_withdrawn_one_never_reaches_the_peer():
    _, got = run_ranks(_deferred_rank, 2, timeout_s=40)
    assert got == [0.0, 1.0, 2.0, 3.0]  # not the withdrawn -1s: the pair stayed in step
