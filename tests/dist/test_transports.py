"""Every data-plane transport between two real processes (docs/architecture.md §7): p2p (gloo pairs), shm (the
shared-memory arena) and mooncake (the transfer engine over tcp), driven with the runtime's wire types.

A failure means a transport changes a tensor's bytes, dtype or shape (float32, bfloat16, int64, bool; empty, 0-d,
non-contiguous, 64 MiB), mixes up tensors when many are in flight in both directions, never gives its arena
back (occupancy stays above 0 after every consumer let go), or hangs instead of failing fast when the peer
process dies mid-transfer.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest
import torch

from mstar_dist.control import messages as m
from mstar_dist.transport.base import PeerDeadError
from tests.dist.launcher import run_ranks
from tests.dist.transport_rig import mooncake_available, post, setup, teardown, wait_all

NAMES = ("p2p", "shm", "mooncake")
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)
BIG = 64 << 20

needs_mooncake = pytest.mark.skipif(mooncake_available() is not None,
                                    reason=f"Mooncake transfer engine unavailable: {mooncake_available()}")


def pattern(src: int, case: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Deterministic bytes that differ per sender and case (bool: 0/1 only)."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * dtype.itemsize
    words = torch.arange(-(-nbytes // 8), dtype=torch.int64)
    words.mul_(-7046029254386353131).add_(src * 1_000_003 + case * 7919)  # wraps: a cheap hash of the index
    raw = words.view(torch.uint8)[:nbytes]
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).view(shape) if numel else torch.empty(shape, dtype=dtype)


def small_cases() -> list[tuple[torch.dtype, tuple[int, ...], bool]]:
    """(dtype, shape, transposed): every dtype empty, 0-d, odd-shaped and non-contiguous, then 40 more of 200 KB."""
    cases = []
    for dtype in DTYPES:
        cases += [(dtype, (0, 3), False), (dtype, (), False), (dtype, (3, 5, 7), False), (dtype, (6, 9), True)]
    cases += [(DTYPES[i % 4], (200_000 // DTYPES[i % 4].itemsize,), False) for i in range(40)]
    return cases


def make(src: int, case: int, dtype, shape, transposed: bool) -> torch.Tensor:
    t = pattern(src, case, dtype, shape)
    return t.t() if transposed else t


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.numel() == 0 or torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                                         b.contiguous().reshape(-1).view(torch.uint8))


def _exchange(rig, plane, cases, first_case: int) -> list[str]:
    """Both ranks send ``cases`` to each other at once; returns mismatches seen here."""
    sends, wires = [], []
    for i, spec in enumerate(cases):
        tr, wire = post(plane, make(rig.rank, first_case + i, *spec), rig.peer, rig)
        sends.append(tr)
        wires.append(wire)
    rig.send(m.StreamItems(request_id=plane.name, signal=str(first_case), values=wires))
    (msg,) = [b for b in rig.expect(1) if isinstance(b, m.StreamItems)]
    assert all(w.via == plane.name for w in msg.values)
    recvs = [plane.post_recv(w, rig.peer) for w in msg.values]
    wait_all(rig, recvs + sends)
    bad = []
    for i, (spec, tr) in enumerate(zip(cases, recvs)):
        expected = make(rig.peer, first_case + i, *spec)
        if not same_bytes(tr.tensor, expected):
            bad.append(f"{plane.name} case {first_case + i} {spec}")
    del recvs, tr
    return bad


def _drain(rig, plane, timeout_s: float = 30.0) -> int:
    """Wait until this rank's arena is back to 0 (every consumer acknowledged); returns what is left."""
    deadline = time.monotonic() + timeout_s
    while plane.stats().get("bytes_used", 0) and time.monotonic() < deadline:
        rig.stash += rig.pump(2)
    return plane.stats().get("bytes_used", 0)


def _all_rank(rank: int, names: tuple[str, ...], launch: str) -> dict:
    rig = setup(rank, names, arena_bytes=96 << 20, launch_id=launch)
    out = {}
    for name in names:
        plane = rig.planes[name]
        t0 = time.perf_counter()
        bad = _exchange(rig, plane, small_cases(), 0)
        for k, dtype in enumerate(DTYPES):  # one 64 MiB tensor of each dtype, both directions at once
            bad += _exchange(rig, plane, [(dtype, (BIG // dtype.itemsize,), False)], 1000 + k)
        left = _drain(rig, plane)
        rig.send(m.Heartbeat(sent_at=0.0))  # neither rank closes before the other has its acks
        rig.expect(1)
        out[name] = {"bad": bad, "left": left, "seconds": time.perf_counter() - t0, "stats": plane.stats()}
    teardown(rig)
    return out


@pytest.mark.parametrize("names", [("p2p", "shm"), pytest.param(("mooncake",), marks=needs_mooncake)],
                         ids=["p2p+shm", "mooncake"])
def test_every_transport_moves_every_dtype_both_ways_with_identical_bytes(names):
    results = run_ranks(_all_rank, 2, timeout_s=240, args=(names, uuid.uuid4().hex[:8]))
    for rank, res in enumerate(results):
        for name in names:
            r = res[name]
            assert r["bad"] == [], f"rank {rank} {name}: {r['bad']}"
            assert r["left"] == 0, f"rank {rank} {name}: {r['left']} arena bytes never acknowledged"
            n = len(small_cases()) + len(DTYPES)
            assert r["stats"]["sends"] == n and r["stats"]["recvs"] == n, r["stats"]
            assert r["stats"]["host_staging_copies"] == 0


def _producer_dies_rank(rank: int, name: str, launch: str) -> dict:
    rig = setup(rank, (name,), arena_bytes=80 << 20, launch_id=launch)
    plane = rig.planes[name]
    if rank == 0:  # post a 64 MiB send, describe it, and die (run_ranks ends the process once this returns)
        _, wire = post(plane, pattern(0, 0, torch.float32, (BIG // 4,)), 1)
        rig.send(m.StreamItems(request_id="x", signal="s", values=[wire]))
        time.sleep(0.05)  # let the descriptor leave
        return {}
    (msg,) = rig.expect(1)
    time.sleep(0.5)  # the producer is gone by now
    t0 = time.monotonic()
    error, ok = "", False
    try:
        tr = plane.post_recv(msg.values[0], 0)
        while not tr.done():
            assert time.monotonic() - t0 < 20, "a receive from a dead producer is still pending after 20 s"
            time.sleep(0.001)
        ok = same_bytes(tr.tensor, pattern(0, 0, torch.float32, (BIG // 4,)))
    except AssertionError:
        raise
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "ok": ok, "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("name", ["p2p", "shm", pytest.param("mooncake", marks=needs_mooncake)])
def test_a_receive_from_a_producer_that_died_mid_transfer_ends_fast(name):
    out = run_ranks(_producer_dies_rank, 2, timeout_s=60, args=(name, uuid.uuid4().hex[:8]))
    consumer = out[1]
    assert consumer["seconds"] < 10, consumer
    if name == "shm":  # the bytes were in /dev/shm before the producer died: the consumer still gets them
        assert consumer["ok"], consumer
    else:
        assert consumer["error"] and not consumer["ok"], consumer
    _swept(name)


def _swept(name: str) -> None:
    """The dead ranks could not unlink their segments: the next start's sweep does, and only theirs."""
    from mstar_dist.transport.shm import SHM_DIR, sweep_orphans

    removed = sweep_orphans()
    if name == "shm":
        assert removed, "the dead rank's segment should have been swept"
    assert not [p for p in SHM_DIR.iterdir() if p.name in removed]


def _consumer_dies_rank(rank: int, name: str, launch: str) -> dict:
    rig = setup(rank, (name,), arena_bytes=80 << 20, launch_id=launch)
    plane = rig.planes[name]
    if rank == 1:  # take the descriptor, start the receive, die (run_ranks ends the process once this returns)
        (msg,) = rig.expect(1)
        plane.post_recv(msg.values[0], 0)
        return {}
    tr, wire = post(plane, pattern(0, 0, torch.float32, (BIG // 4,)), 1)
    rig.send(m.StreamItems(request_id="x", signal="s", values=[wire]))
    t0 = time.monotonic()
    error = ""
    try:
        while not tr.done() or plane.stats().get("bytes_used", 0):
            if time.monotonic() - t0 > 1.0:  # what the conductor's RankDown makes the worker do
                plane.abort_peer(1, "rank 1 declared dead")
            assert time.monotonic() - t0 < 20, "a send to a dead consumer is still pending after 20 s"
            rig.pump(1)
    except AssertionError:
        raise
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    refused = ""
    try:
        post(plane, torch.ones(1 << 20), 1)
    except PeerDeadError as exc:
        refused = str(exc)
    return {"error": error, "seconds": time.monotonic() - t0, "left": plane.stats().get("bytes_used", 0),
            "refused": refused}


@pytest.mark.parametrize("name", ["p2p", "shm", pytest.param("mooncake", marks=needs_mooncake)])
def test_a_consumer_that_dies_mid_transfer_never_holds_the_producer(name):
    out = run_ranks(_consumer_dies_rank, 2, timeout_s=60, args=(name, uuid.uuid4().hex[:8]))
    producer = out[0]
    assert producer["seconds"] < 10, producer
    assert producer["left"] == 0, f"{producer['left']} arena bytes still lent to the dead consumer"
    assert "rank 1 declared dead" in producer["refused"], producer
    if name == "p2p":  # gloo's send to a receiver that died mid-receive never ends by itself: the abort ends it
        assert "rank 1 declared dead" in producer["error"], producer
    _swept(name)
