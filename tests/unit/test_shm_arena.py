"""The shared-memory arena in one process (two transports standing for two ranks of one host) and the allocator
under it (docs/architecture.md §7, "shm").

A failure means two tensors could share arena bytes, a slot is never given back (occupancy grows until every send
waits), a consumer's tensor changes under it, a dead rank keeps memory lent to it, a full arena hangs or corrupts
instead of pushing back, or /dev/shm fills with segments of dead servers.
"""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

from mstar_dist.control import messages as m
from mstar_dist.transport.arena import ALIGN, FirstFit, LentSlots
from mstar_dist.transport.base import ArenaFull, PeerDeadError, TransferFailed
from mstar_dist.transport.shm import RING_ENTRIES, ShmTransport, sweep_orphans


def test_first_fit_never_overlaps_and_coalesces_back_to_one_block():
    rng = random.Random(0)
    arena = FirstFit(1 << 16)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            start = rng.choice(list(live))
            arena.free(start)
            del live[start]
            continue
        n = rng.randint(1, 3000)
        start = arena.alloc(n)
        if start is None:
            assert arena.largest_free < -(-n // ALIGN) * ALIGN
            continue
        assert start % ALIGN == 0 and start + n <= arena.size
        assert all(start + n <= s or s + ln <= start for s, ln in live.items()), "overlap"
        live[start] = n
    for start in list(live):
        arena.free(start)
    assert arena.used_bytes == 0 and arena.largest_free == arena.size and arena.blocks_used == 0
    with pytest.raises(KeyError):
        arena.free(64)


def test_slots_come_back_only_from_the_peer_they_were_lent_to():
    freed = []
    slots = LentSlots()
    a = slots.lend(1, 10, lambda: freed.append("a"))
    b = slots.lend(2, 10, lambda: freed.append("b"))
    assert slots.give_back(2, [a]) == 0 and freed == []  # not rank 2's to give back
    assert slots.give_back(1, [a, a]) == 1 and freed == ["a"]  # a duplicate ack is harmless
    assert slots.reclaim_peer(2) == 1 and freed == ["a", "b"] and len(slots) == 0


@pytest.fixture
def pair(tmp_path):
    launch = uuid.uuid4().hex[:8]
    a = ShmTransport(0, launch_id=launch, arena_bytes=1 << 20, directory=tmp_path)
    b = ShmTransport(1, launch_id=launch, arena_bytes=1 << 20, directory=tmp_path)
    yield a, b
    a.close()
    b.close()


def wire(t: torch.Tensor, loc) -> m.WireTensor:
    return m.WireTensor(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."), host=True, via="shm", at=loc)


def deliver_acks(src: ShmTransport, dst: ShmTransport) -> None:
    """What two workers' loops do: the consumer hands slots back (ring, or messages), the producer reads them."""
    for peer, ack in src.poll():
        assert peer == dst.global_rank
        dst.on_ack(src.global_rank, ack)
    for peer, ack in dst.poll():
        src.on_ack(dst.global_rank, ack)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_a_tensor_crosses_without_a_copy_and_its_slot_returns_when_let_go(pair, dtype):
    a, b = pair
    src = (torch.arange(5000) % 7).to(dtype).view(50, 100).t()  # non-contiguous too
    transfer, loc = a.post_send(src, 1)
    assert transfer.done() and a.bytes_used >= loc.nbytes == src.numel() * src.element_size()
    src.zero_()  # the arena holds its own copy: the producer may reuse its tensor at once
    got = b.post_recv(wire(src, loc), 0).tensor
    assert torch.equal(got, (torch.arange(5000) % 7).to(dtype).view(50, 100).t())
    view = got[3:]  # a view keeps the slot too
    del got
    gc.collect()
    deliver_acks(b, a)
    assert a.bytes_used > 0
    del view
    deliver_acks(b, a)
    assert a.bytes_used == 0 and a.stats()["slots_lent"] == 0


def test_offset_views_and_lazy_conjugates_cross_with_their_values(pair):
    # a small contiguous tensor is copied by address (one memmove): its storage offset must count, and a lazily
    # conjugated or negated view (whose raw bytes are not its values) must be resolved, not copied as bytes
    a, b = pair
    z = torch.complex(torch.arange(6.0), torch.arange(6.0) + 10)
    shorts = torch.arange(40, dtype=torch.int16)[3:].view(37, 1)
    for t in (torch.arange(1000.0)[7:107], z.conj(), z.conj().imag, shorts):
        _, loc = a.post_send(t, 1)
        got = b.post_recv(wire(t, loc), 0).tensor
        assert got.dtype == t.dtype and torch.equal(got, t.resolve_conj().resolve_neg())
        del got
        deliver_acks(b, a)
    assert a.bytes_used == 0


def test_a_descriptor_whose_shape_disagrees_with_its_bytes_fails_and_gives_the_slot_back(pair):
    a, b = pair
    t = torch.ones(10)
    _, loc = a.post_send(t, 1)
    bad = m.WireTensor(shape=[3, 4], dtype="float32", host=True, via="shm", at=loc)
    with pytest.raises(ValueError):
        b.post_recv(bad, 0)
    deliver_acks(b, a)
    assert a.bytes_used == 0 and b.stats()["leases"] == 0


def test_a_tensor_let_go_on_another_thread_comes_back_on_the_next_poll(pair):
    a, b = pair
    t = torch.arange(100.0)
    holder = [b.post_recv(wire(t, a.post_send(t, 1)[1]), 0).tensor]
    thread = threading.Thread(target=holder.clear)
    thread.start()
    thread.join()
    deliver_acks(b, a)
    assert a.bytes_used == 0 and b.stats()["leases"] == 0


def test_a_large_copy_split_over_threads_lands_every_byte_and_nothing_beside_it(monkeypatch):
    from mstar_dist.transport import arena

    monkeypatch.setattr(arena, "copy_threads", lambda: 3)
    n = arena.SPLIT_COPY_BYTES + 4099  # parts of unequal length, the last one short
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    dst = torch.full((n + 2 * ALIGN,), 7, dtype=torch.uint8)
    arena.copy_into(dst[ALIGN:ALIGN + n], src.view(torch.uint8))
    assert torch.equal(dst[ALIGN:ALIGN + n], src)
    assert int(dst[:ALIGN].ne(7).sum()) == 0 and int(dst[ALIGN + n:].ne(7).sum()) == 0
    halves = torch.randn(n // 8, dtype=torch.float64)  # another dtype, viewed as bytes
    out = torch.zeros(halves.numel() * 8, dtype=torch.uint8)
    arena.copy_into(out, halves)
    assert torch.equal(out.view(torch.float64), halves)


def test_empty_and_zero_d_tensors(pair):
    a, b = pair
    for t in (torch.empty(0, 4), torch.tensor(3.5), torch.tensor(True)):
        _, loc = a.post_send(t, 1)
        got = b.post_recv(wire(t, loc), 0).tensor
        assert got.shape == t.shape and got.dtype == t.dtype and torch.equal(got, t)


def test_a_full_arena_pushes_back_and_a_too_big_tensor_is_refused(pair):
    a, b = pair
    held = []
    with pytest.raises(ArenaFull, match="no free block"):
        for _ in range(100):
            t = torch.ones(64 << 10)  # 256 KiB
            held.append(b.post_recv(wire(t, a.post_send(t, 1)[1]), 0).tensor)
    assert len(held) == 4
    held.clear()
    deliver_acks(b, a)
    a.post_send(torch.ones(64 << 10), 1)  # room again
    with pytest.raises(ValueError, match="raise transport.arena_bytes"):
        a.post_send(torch.ones(1 << 20), 1)


def test_slots_come_back_through_the_release_ring_without_a_message(pair):
    a, b = pair
    t = torch.arange(1000.0)
    got = b.post_recv(wire(t, a.post_send(t, 1)[1]), 0).tensor
    del got
    assert b.poll() == []  # handed back in a's segment, nothing to send
    assert a.bytes_used > 0  # until the producer reads its rings
    assert a.poll() == [] and a.bytes_used == 0 and a.stats()["slots_lent"] == 0
    assert b.stats()["slots_back_by_ring"] == 1 and b.stats()["slots_back_by_message"] == 0


def test_a_full_ring_spills_into_acknowledgements_and_a_full_arena_reads_the_rings_first(pair):
    a, b = pair
    t = torch.ones(4)
    held = [b.post_recv(wire(t, a.post_send(t, 1)[1]), 0).tensor for _ in range(RING_ENTRIES + 10)]
    held.clear()
    acks = b.poll()  # the producer read nothing yet: the ring takes RING_ENTRIES, the rest go by message
    assert [(peer, len(ack.slots)) for peer, ack in acks] == [(0, 10)]
    a.on_ack(1, acks[0][1])
    assert a.stats()["slots_lent"] == RING_ENTRIES
    a.poll()
    assert a.bytes_used == 0
    big = torch.ones(200 << 10)  # 800 KiB of the 1 MiB arena
    got = b.post_recv(wire(big, a.post_send(big, 1)[1]), 0).tensor
    del got
    b.poll()  # into the ring; a does not poll
    a.post_send(big, 1)  # no room until a's send reads its rings: no ArenaFull


def test_a_release_ring_outside_the_producers_rings_is_refused(pair):
    a, b = pair
    t = torch.ones(4)
    loc = a.post_send(t, 1)[1]
    bogus = m.ShmLocation(loc.segment, loc.offset, loc.nbytes, loc.slot, ring=loc.offset)
    with pytest.raises(TransferFailed, match="release ring"):
        b.post_recv(wire(t, bogus), 0)


def test_a_dead_peer_gives_back_what_was_lent_to_it_and_is_refused(pair):
    a, b = pair
    a.post_send(torch.ones(1000), 1)
    assert a.bytes_used > 0
    a.abort_peer(1, "rank 1 was declared dead")
    assert a.bytes_used == 0 and a.is_dead(1)
    with pytest.raises(PeerDeadError, match="declared dead"):
        a.post_send(torch.ones(1000), 1)


def test_a_consumer_that_cannot_open_the_segment_names_it(pair, tmp_path):
    a, b = pair
    t = torch.ones(100)
    _, loc = a.post_send(t, 1)
    bogus = m.ShmLocation(loc.segment.replace(".r0.", ".r7."), loc.offset, loc.nbytes, loc.slot)
    with pytest.raises(RuntimeError, match="cannot open rank 0's shared-memory segment .*share /dev/shm"):
        b.post_recv(wire(t, bogus), 0)


def test_segments_are_unlinked_on_close_and_orphans_of_dead_processes_are_swept(tmp_path):
    live = ShmTransport(0, launch_id="live", arena_bytes=1 << 20, directory=tmp_path)
    code = (f"import os; from pathlib import Path; from mstar_dist.transport.shm import ShmTransport; "
            f"t = ShmTransport(3, launch_id='dead', arena_bytes=1 << 20, directory=Path({str(tmp_path)!r})); "
            f"print(t.segment, flush=True); os._exit(0)")  # dies without closing: its segment is orphaned
    dead = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])}).stdout.strip()
    assert dead.startswith("mstar_dist.dead.r3.p") and (tmp_path / dead).exists()
    assert sweep_orphans(tmp_path) == [dead]
    assert (tmp_path / live.segment).exists()  # its owner holds the lock: never swept
    live.close()
    assert not (tmp_path / live.segment).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_segment_that_does_not_fit_is_an_error_naming_the_space(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root and mount rights)")
    try:
        with pytest.raises(OSError, match="cannot reserve 8912896 bytes .*transport.arena_bytes 8388608 .* lower transport.arena_bytes"):
            ShmTransport(0, launch_id="big", arena_bytes=8 << 20, directory=small)
        assert list(small.iterdir()) == []  # nothing half-made is left
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


def test_a_segment_being_made_is_not_swept_by_a_rank_starting_beside_it(tmp_path):
    """A rank creates its segment under a temporary name and locks it only once it is open; a sweep by another rank
    starting on the host in that moment must leave it (it unlinked it once, and the creator's start failed), while a
    temporary one left long ago by a dead creator is still swept."""
    fresh = tmp_path / ".mstar_dist.tmp.0123abcd"
    stale = tmp_path / ".mstar_dist.tmp.4567ef01"
    fresh.write_bytes(b"")
    stale.write_bytes(b"")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    assert sweep_orphans(tmp_path) == [stale.name]
    assert fresh.exists() and not stale.exists()
