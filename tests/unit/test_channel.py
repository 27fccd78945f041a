"""ZMQ control channel in one process. A failure means control messages are lost, reordered per sender,
attributed to the wrong sender, or that a send to a slow/unknown peer hangs instead of raising."""

import time

import pytest
import zmq

from mstar_dist.control.channel import ChannelFullError, ControlChannel, lookup_endpoint, publish_endpoint


def _drain(ch: ControlChannel, n: int, timeout_s: float = 5.0) -> list[tuple[str, bytes]]:
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += ch.recv(timeout_ms=50)
    return got


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def test_fifo_per_sender_and_sender_names(ctx):
    with ControlChannel("rank0", "127.0.0.1", ctx) as a, ControlChannel("rank1", "127.0.0.1", ctx) as b, \
            ControlChannel("conductor", "127.0.0.1", ctx) as c:
        assert a.endpoint.startswith("tcp://127.0.0.1:")
        b.connect("rank0", a.endpoint)
        c.connect("rank0", a.endpoint)
        for i in range(500):
            b.send("rank0", b"b%d" % i)
            c.send("rank0", b"c%d" % i)
        got = _drain(a, 1000)
        assert len(got) == 1000
        assert [p for s, p in got if s == "rank1"] == [b"b%d" % i for i in range(500)]
        assert [p for s, p in got if s == "conductor"] == [b"c%d" % i for i in range(500)]


def test_send_right_after_connect_is_delivered(ctx):
    with ControlChannel("rank0", "127.0.0.1", ctx) as a:
        endpoint = a.endpoint
        with ControlChannel("rank1", "127.0.0.1", ctx) as b:
            b.connect("rank0", endpoint)
            b.send("rank0", b"early")
            assert _drain(a, 1) == [("rank1", b"early")]


def test_self_send_and_large_payload(ctx):
    with ControlChannel("rank0", "127.0.0.1", ctx) as a:
        a.connect("rank0", a.endpoint)
        big = bytes(range(256)) * 4096  # 1 MiB: the zero-copy path
        a.send("rank0", big)
        assert _drain(a, 1) == [("rank0", big)]


def test_unknown_peer_names_known_peers(ctx):
    with ControlChannel("rank0", "127.0.0.1", ctx) as a:
        a.connect("rank1", "tcp://127.0.0.1:1")
        with pytest.raises(KeyError, match=r"'rank7'.*\['rank1'\]"):
            a.send("rank7", b"x")
        with pytest.raises(ValueError, match="already connected"):
            a.connect("rank1", "tcp://127.0.0.1:2")


def test_full_queue_raises_instead_of_hanging(ctx):
    with ControlChannel("rank0", "127.0.0.1", ctx, sndhwm=10) as a:
        a.connect("ghost", "tcp://127.0.0.1:1")  # nobody listens there
        t0 = time.monotonic()
        with pytest.raises(ChannelFullError, match="ghost"):
            for _ in range(1000):
                a.send("ghost", b"x")
        assert time.monotonic() - t0 < 1.0


def test_recv_timeout_and_closed_channel(ctx):
    a = ControlChannel("rank0", "127.0.0.1", ctx)
    t0 = time.monotonic()
    assert a.recv(timeout_ms=100) == []
    assert 0.08 < time.monotonic() - t0 < 1.0
    a.close()
    a.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        a.recv()


def test_endpoint_discovery_through_a_store():
    import torch.distributed as dist

    store = dist.HashStore()
    publish_endpoint(store, "rank3", "tcp://10.0.0.2:5555")
    assert lookup_endpoint(store, "rank3", timeout_s=1) == "tcp://10.0.0.2:5555"
    with pytest.raises(TimeoutError, match="rank9"):
        lookup_endpoint(store, "rank9", timeout_s=0.2)


def test_wildcard_bind_is_rejected(ctx):
    with pytest.raises(ValueError, match="wildcard"):
        ControlChannel("rank0", "0.0.0.0", ctx)


def test_restarted_peer_takes_its_name_over(ctx):
    with ControlChannel("rank0", "127.0.0.1", ctx) as a:
        with ControlChannel("rank1", "127.0.0.1", ctx) as old:
            old.connect("rank0", a.endpoint)
            old.send("rank0", b"before")
            assert _drain(a, 1) == [("rank1", b"before")]
        with ControlChannel("rank1", "127.0.0.1", ctx) as new:
            new.connect("rank0", a.endpoint)
            new.send("rank0", b"after")
            assert _drain(a, 1) == [("rank1", b"after")]


def test_wake_ends_a_waiting_recv_from_another_thread(ctx):
    """The conductor waits for rank messages; a request submitted by the HTTP thread must not wait out that poll."""
    import threading

    ch = ControlChannel("conductor", "127.0.0.1", ctx)
    try:
        done = threading.Event()
        got: list = []

        def wait() -> None:
            got.append(ch.recv(30_000))
            done.set()

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.2)
        ch.wake()
        assert done.wait(10), "recv(30 s) was not ended by wake()"
        thread.join()
        assert got == [[]]  # woken with nothing received
        ch.connect("me", ch.endpoint)
        ch.wake()
        ch.send("me", b"x")  # a wake-up left pending does not hide a message
        deadline = time.monotonic() + 5
        seen = []
        while not seen and time.monotonic() < deadline:
            seen = ch.recv(1000)
        assert seen == [("conductor", b"x")]
    finally:
        ch.close()
    ch.wake()  # after close: a no-op, not an error


def test_peers_on_one_machine_talk_over_the_local_link_and_big_messages_keep_their_place(ctx):
    with ControlChannel("rank0", "127.0.0.1", ctx) as a, ControlChannel("rank1", "127.0.0.1", ctx) as b:
        assert " local:" in a.endpoint
        b.connect("rank0", a.endpoint)
        big = bytes(range(256)) * 1024  # 256 KiB: over LOCAL_MAX_BYTES, so it goes by ZMQ
        sent = []
        for i in range(300):
            payload = big + b"%d" % i if i % 7 == 3 else b"small%d" % i
            b.send("rank0", payload)
            sent.append(payload)
        assert b.sent_local == 300 - 43 and b.sent_zmq == 43  # the small ones did not wait for TCP
        got = _drain(a, 300)
        assert [p for _, p in got] == sent and {s for s, _ in got} == {"rank1"}


def test_a_peer_that_does_not_read_fills_its_local_link_and_the_rest_goes_by_zmq_in_order(ctx):
    with ControlChannel("rank0", "127.0.0.1", ctx) as a, ControlChannel("rank1", "127.0.0.1", ctx) as b:
        b.connect("rank0", a.endpoint)
        chunk = b"x" * 60_000
        for i in range(200):  # about 12 MB, far more than the local socket buffers: never blocks
            b.send("rank0", chunk + b"%d" % i)
        assert b.sent_local > 0 and b.sent_zmq > 0
        got = _drain(a, 200, timeout_s=20)
        assert [p for _, p in got] == [chunk + b"%d" % i for i in range(200)]


def test_a_peer_without_a_local_link_is_reached_by_zmq(ctx):
    with ControlChannel("rank0", "127.0.0.1", ctx, local=False) as a, ControlChannel("rank1", "127.0.0.1", ctx) as b:
        assert " local:" not in a.endpoint
        b.connect("rank0", a.endpoint)
        a.connect("rank1", b.endpoint.split(" local:")[0] + " local:mstar_dist.ctl.nobody-listens-here")
        b.send("rank0", b"to a")
        a.send("rank1", b"to b")
        assert _drain(a, 1) == [("rank1", b"to a")] and _drain(b, 1) == [("rank0", b"to b")]
        assert b.sent_zmq == 1 and a.sent_zmq == 1 and a.sent_local == b.sent_local == 0


def test_a_frame_without_our_header_is_handed_up_for_the_envelope_check(ctx):
    with ControlChannel("rank0", "127.0.0.1", ctx) as a:
        stranger = ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.IDENTITY, b"rank1")
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(a.endpoint.split(" local:")[0])
        stranger.send(b"not an envelope")
        try:
            assert _drain(a, 1) == [("rank1", b"not an envelope")]
        finally:
            stranger.close()


def test_a_spinning_recv_takes_a_message_that_comes_while_it_spins_and_then_blocks_as_asked(ctx):
    import threading

    with ControlChannel("rank0", "127.0.0.1", ctx) as a, ControlChannel("rank1", "127.0.0.1", ctx) as b:
        b.connect("rank0", a.endpoint)
        b.send("rank0", b"hello")  # the link is set up on the first message
        assert _drain(a, 1) == [("rank1", b"hello")]
        timer = threading.Timer(0.05, lambda: b.send("rank0", b"during the spin"))
        timer.start()
        t0 = time.perf_counter()
        got = a.recv(timeout_ms=0, spin_s=2.0)  # timeout 0: poll only, no spin
        assert got == []
        got = a.recv(timeout_ms=5000, spin_s=2.0)
        timer.join()
        assert got == [("rank1", b"during the spin")]
        assert time.perf_counter() - t0 < 1.5  # taken when it came, not after the spin
        t0 = time.perf_counter()
        assert a.recv(timeout_ms=200, spin_s=0.1) == []  # nothing comes: spins, then blocks for the timeout
        assert time.perf_counter() - t0 >= 0.29


def test_an_event_loop_watching_the_channels_descriptors_gets_every_message_in_order(ctx):
    """An intake receives on its HTTP loop (``ControlChannel.fds`` with ``add_reader``, draining ``recv(0)``): small
    messages on the local link (accepted after the loop started watching), big ones through ZMQ, from two senders,
    must all arrive in each sender's order without a blocking ``recv``."""
    import asyncio

    from mstar_dist.control.channel import LOCAL_MAX_BYTES

    async def main(a, b, c) -> list[tuple[str, bytes]]:
        loop = asyncio.get_running_loop()
        got: list[tuple[str, bytes]] = []
        watched: set[int] = set()
        done = loop.create_future()

        def readable() -> None:
            nonlocal watched
            while batch := a.recv(0):
                got.extend(batch)
            fds = a.fds()
            for fd in watched - fds:
                loop.remove_reader(fd)
            for fd in fds - watched:
                loop.add_reader(fd, readable)
            watched = fds
            if len(got) >= 402 and not done.done():
                done.set_result(None)

        readable()
        big = b"x" * (LOCAL_MAX_BYTES + 1)
        for i in range(200):
            b.send("intake0", b"b%d" % i)
            c.send("intake0", b"c%d" % i)
            if i == 100:
                b.send("intake0", big)
                c.send("intake0", big)
            if i % 50 == 0:
                await asyncio.sleep(0)
        try:
            await asyncio.wait_for(done, 10)
        finally:
            for fd in watched:
                loop.remove_reader(fd)
        return got

    with ControlChannel("intake0", "127.0.0.1", ctx) as a, ControlChannel("conductor", "127.0.0.1", ctx) as b, \
            ControlChannel("rank0", "127.0.0.1", ctx) as c:
        b.connect("intake0", a.endpoint)
        c.connect("intake0", a.endpoint)
        got = asyncio.run(main(a, b, c))
        assert b.sent_local > 0 and b.sent_zmq > 0  # both ways were taken
        for sender, tag in (("conductor", b"b"), ("rank0", b"c")):
            mine = [p for s, p in got if s == sender]
            small = [tag + b"%d" % i for i in range(200)]
            assert mine == small[:101] + [b"x" * (LOCAL_MAX_BYTES + 1)] + small[101:]


@pytest.mark.parametrize("local", [False, True], ids=["zmq", "local link"])
def test_a_message_sent_right_before_a_flushing_close_reaches_its_peer(local):
    """A process's last word (``Shutdown`` to every rank, a rank's ``Leaving``) is sent just before its socket
    closes: ``close(flush_s)`` lets it leave first, over ZMQ (whose connection may not even be up yet) as over a
    local link. Without the flush ZMQ drops what it still queues."""
    with ControlChannel("rank0", "127.0.0.1") as receiver:
        for i in range(20):
            sender = ControlChannel("conductor", "127.0.0.1", local=local)  # its own context: close terminates it
            sender.connect("rank0", receiver.endpoint)
            sender.send("rank0", b"shutdown %d" % i)
            sender.close(flush_s=5.0)
            assert _drain(receiver, 1) == [("conductor", b"shutdown %d" % i)]


def test_a_flushing_close_is_bounded_when_the_peer_is_gone():
    gone = ControlChannel("rank0", "127.0.0.1")
    endpoint = gone.endpoint
    gone.close()
    sender = ControlChannel("conductor", "127.0.0.1")
    sender.connect("rank0", endpoint)
    sender.send("rank0", b"nobody reads this")
    t0 = time.monotonic()
    sender.close(flush_s=0.3)
    assert time.monotonic() - t0 < 3
