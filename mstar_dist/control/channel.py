"""Control channel: one ROUTER socket per process for receiving, one DEALER per peer for sending, and beside them a
local link to every peer on the same machine (docs/architecture.md §6).

Topology: every participant ("rank0", "rank3", "conductor", ...) binds one ROUTER on its host address with an
ephemeral port and publishes the endpoint in the torchrun store; to talk to a peer it connects a DEALER whose
ZMQ identity is its own name, so the receiver learns the sender's name from the ROUTER envelope. One TCP
connection per sender->receiver direction keeps that direction FIFO.

Local link: each channel also listens on a Unix seqpacket socket in the abstract namespace under a random name
(the endpoint carries it: ``tcp://host:port local:<name>``). ``connect`` tries it: it only succeeds from the same
machine and network namespace, and only a process of the same user is accepted (``SO_PEERCRED``). A message of
at most ``LOCAL_MAX_BYTES`` then goes over it with one ``sendmsg``, straight into the peer's receive queue (no
hop through ZMQ's I/O threads); a bigger one, or one the local socket cannot take without blocking, goes over ZMQ. Each
message carries the sender's session (random per channel) and a sequence number per receiver, and the receiver
hands messages over strictly in that order, whichever way they came, so a direction stays FIFO.

Bytes only: serialisation is the caller's (msgspec msgpack; never pickle on a socket).

Bounds (no silent hang): each DEALER queues at most `sndhwm` messages not yet taken by the peer; each ROUTER
queues at most `rcvhwm` messages per sender. `send` never blocks: when the peer is slow or gone and the bound is
reached it raises `ChannelFullError` naming the peer. Messages queued before the peer's socket is up are
delivered once it connects (ZMQ_IMMEDIATE stays off).

Shutdown: ``close()`` drops what ZMQ has not sent yet; ``close(flush_s=...)`` first lets it leave (ZMQ's linger,
bounded by ``flush_s``: a peer that is gone keeps its messages queued). A local link needs no flush: ``sendmsg`` has
put the message in the peer's queue by the time it returns.

This module is also the one place that touches torch.distributed's private default-store accessor.

Not thread-safe (ZMQ sockets are not): use a channel from one thread (``wake`` excepted).
"""

from __future__ import annotations

import datetime
import os
import secrets
import socket
import struct
import time

import zmq

__all__ = [
    "ChannelFullError",
    "ControlChannel",
    "default_store",
    "lookup_endpoint",
    "publish_endpoint",
]

_ENDPOINT_KEY = "mstar_dist/endpoint/{name}"

LOCAL_MAX_BYTES = 192 << 10
"""Largest payload sent over a local link (an inline tensor of ``transport.inline_max_bytes`` with its envelope
fits); bigger ones take ZMQ, in order all the same."""

_HEADER = struct.Struct("<QQ")  # sender's session, sequence number to this receiver
_HELLO = b"H"  # a local link's first packet: b"H" + the sender's name
_LOCAL_SNDBUF = 1 << 20


class ChannelFullError(RuntimeError):
    """A peer's send queue is at its high-water mark: the peer is not reading (slow, hung, or dead)."""


class ControlChannel:
    """One process's control socket set. `name` is this participant's name, e.g. "rank0" or "conductor"."""

    def __init__(
        self,
        name: str,
        bind_addr: str,
        ctx: zmq.Context | None = None,
        *,
        sndhwm: int = 100_000,
        rcvhwm: int = 100_000,
        local: bool = True,
        advertise_addr: str | None = None,
        port_range: tuple[int, int] | None = None,
    ) -> None:
        """Bind a ROUTER on `tcp://{bind_addr}:<port>` (e.g. bind_addr "127.0.0.1" or "10.0.0.1") and, with `local`,
        listen for local links.

        `advertise_addr`: the address peers connect to when it is not `bind_addr` (a host behind NAT, or one bound on
        every interface: then `bind_addr` may be a wildcard); `port_range` (lo, hi), inclusive: bind a port in it
        (a firewall opens only those), else an ephemeral port. OSError naming the range when none is free.
        `ctx`: a zmq Context to share; when None the channel owns one and terminates it on `close`.
        """
        if not name:
            raise ValueError("channel name must be a non-empty string")
        if bind_addr.strip("[]") in ("0.0.0.0", "*", "::", "") and not advertise_addr:
            raise ValueError(
                f"bind_addr {bind_addr!r} is a wildcard; bind on the host's own address so the published "
                f"endpoint is one peers can connect to, or give the address they reach (advertise_addr)"
            )
        self.name = name
        self._own_ctx = ctx is None
        self._ctx = zmq.Context() if ctx is None else ctx
        self._sndhwm = sndhwm
        self._router = self._open_router(bind_addr, advertise_addr, port_range, rcvhwm)
        self._dealers: dict[str, zmq.Socket] = {}
        self._peer_eps: dict[str, str] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        # wake(): another thread of this process ends a recv() wait at once (a pipe the poller also watches)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._session = int.from_bytes(secrets.token_bytes(8), "little")
        self._next_seq: dict[str, int] = {}  # per receiver
        self._inbound: dict[str, _Inbound] = {}  # per sender: session, next sequence number, early arrivals
        self._links: dict[str, socket.socket] = {}  # peer -> our local link to it
        self._accepted: dict[int, list] = {}  # fd -> [socket, sender name or None before its hello]
        self._listener = self._listen_local() if local else None
        self._listener_fd = -1 if self._listener is None else self._listener.fileno()
        if self._listener is not None:
            self.endpoint += f" local:{self._listener.getsockname()[1:].decode()}"
        self.sent_local = self.sent_zmq = 0
        self._closed = False

    def _open_router(self, bind_addr: str, advertise_addr: str | None, port_range: tuple[int, int] | None,
                     rcvhwm: int) -> zmq.Socket:
        """The ROUTER every peer sends to, bound (in `port_range` when given), and `endpoint` naming it."""
        router = self._router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.RCVHWM, rcvhwm)
        # A restarted peer reconnects under the same name; take the name over instead of silently dropping it.
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        host, seen = _tcp_host(bind_addr), _tcp_host(advertise_addr or bind_addr)
        if "[" in host or "[" in seen:  # IPv6 literal
            router.setsockopt(zmq.IPV6, 1)
        port = self._bind(host if host.strip("[]") not in ("0.0.0.0", "") else "*", port_range)
        self.endpoint = f"tcp://{seen}:{port}"
        """Address peers connect to: `tcp://host:port`, then ` local:<name>` when the channel has a local link."""
        return router

    def connect(self, peer_name: str, endpoint: str) -> None:
        """Open the sending direction to `peer_name` at `endpoint`. Returns at once (ZMQ connects in the
        background). ValueError if a different endpoint is already connected under that name."""
        self._check_open()
        if peer_name in self._dealers:
            known = self._peer_eps[peer_name]
            if known != endpoint:
                raise ValueError(f"{self.name}: peer {peer_name!r} already connected at {known}, not {endpoint}")
            return
        tcp, _, local = endpoint.partition(" local:")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self._sndhwm)
        sock.setsockopt(zmq.IDENTITY, self.name.encode())
        if "[" in tcp:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(tcp)
        self._dealers[peer_name] = sock
        self._peer_eps[peer_name] = endpoint
        self._next_seq.setdefault(peer_name, 0)
        if local and self._listener is not None:
            link = _connect_local(local)
            if link is not None:
                try:
                    link.send(_HELLO + self.name.encode())
                except OSError:
                    link.close()
                else:
                    self._links[peer_name] = link

    def reconnect(self, peer_name: str, endpoint: str) -> None:
        """`peer_name` restarted under its name with a new `endpoint` (docs/architecture.md §10): drop the old
        connection and what it still queued for the dead process, and connect anew (sequence numbers start over:
        the new process has seen none)."""
        self._check_open()
        old = self._dealers.pop(peer_name, None)
        if old is not None:
            old.close(linger=0)
        link = self._links.pop(peer_name, None)
        if link is not None:
            link.close()
        self._peer_eps.pop(peer_name, None)
        self._next_seq[peer_name] = 0
        self.connect(peer_name, endpoint)

    def _bind(self, host: str, port_range: tuple[int, int] | None) -> int:
        if port_range is None:
            return self._router.bind_to_random_port(f"tcp://{host}")
        lo, hi = port_range
        try:
            return self._router.bind_to_random_port(f"tcp://{host}", min_port=lo, max_port=hi + 1,
                                                    max_tries=4 * (hi - lo + 1))
        except zmq.ZMQBindError:
            self._router.close(linger=0)
            raise OSError(f"{self.name}: no free port for the control plane in {lo}-{hi} on {host} "
                          f"(cluster.hosts[].control_ports): widen the range") from None

    @property
    def peers(self) -> list[str]:
        """Names this channel can send to."""
        return sorted(self._dealers)

    def send(self, peer_name: str, payload: bytes) -> None:
        """Queue `payload` for `peer_name`; never blocks.

        KeyError if `peer_name` was never connected; ChannelFullError if `sndhwm` messages are already queued
        for it (the peer is not reading).
        """
        if self._closed:
            self._check_open()
        try:
            sock = self._dealers[peer_name]
        except KeyError:
            raise KeyError(
                f"{self.name}: no connection to peer {peer_name!r}; connected peers: {self.peers}"
            ) from None
        seq = self._next_seq[peer_name]
        header = _HEADER.pack(self._session, seq)
        link = self._links.get(peer_name)
        if link is not None and len(payload) <= LOCAL_MAX_BYTES:
            try:
                link.sendmsg([header, payload], (), socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                pass  # the peer has not caught up: this one goes by ZMQ, still in order
            except OSError:  # the peer is gone or closed the link: ZMQ only from now on
                self._links.pop(peer_name).close()
            else:
                self._next_seq[peer_name] = seq + 1
                self.sent_local += 1
                return
        try:
            sock.send_multipart([header, payload], zmq.NOBLOCK, copy=len(payload) < 65536)
        except zmq.Again:
            raise ChannelFullError(
                f"{self.name} -> {peer_name}: {self._sndhwm} messages queued and not taken by the peer "
                f"at {self._peer_eps[peer_name]}; it is slow, hung or dead"
            ) from None
        self._next_seq[peer_name] = seq + 1
        self.sent_zmq += 1

    def recv(self, timeout_ms: int = 0, max_messages: int = 10_000, spin_s: float = 0.0) -> list[tuple[str, bytes]]:
        """Return the messages ready now as (sender name, payload), waiting up to `timeout_ms` for the first.

        Blocks at most `timeout_ms` (0: poll only; -1: until something arrives). Per-sender order is the
        send order. At most `max_messages` are returned so one busy sender cannot starve the caller's loop.
        `spin_s`: before blocking, poll without blocking for up to this long. A message that comes meanwhile is
        taken at once instead of after the kernel wakes a sleeping process, at the price of a busy core while it
        spins.
        """
        if self._closed:
            self._check_open()
        out: list[tuple[str, bytes]] = []
        ready = None
        if spin_s > 0 and timeout_ms != 0:
            until = time.perf_counter() + spin_s
            while not (ready := self._poller.poll(0)) and time.perf_counter() < until:
                pass
        if not ready:
            ready = self._poller.poll(timeout_ms)
        if not ready:
            return out
        router = False
        for fd, _ in ready:  # usually one: the local link a message came on
            if fd in self._accepted:
                self._read_link(fd, out, max_messages)
            elif fd is self._router:
                router = True
            elif fd == self._wake_r:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            elif fd == self._listener_fd:
                self._accept_links()
        while router and len(out) < max_messages:  # (a ZMQ socket with nothing raises Again: slow)
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            sender = frames[0].decode(errors="replace")
            if len(frames) == 3 and len(frames[1]) == _HEADER.size:
                self._arrived(sender, frames[1], frames[2], out)
            else:  # not one of ours: handed up as it is, so the envelope check rejects and counts it
                out.append((sender, frames[-1]))
        return out

    # -- in order, whichever way a message came -----------------------------------------------------------
    def _arrived(self, sender: str, header: bytes, payload: bytes, out: list[tuple[str, bytes]]) -> None:
        session, seq = _HEADER.unpack(header)
        box = self._inbound.get(sender)
        if box is None or box.session != session:  # first contact, or the peer restarted under its name
            box = self._inbound[sender] = _Inbound(session)
        if seq != box.next:
            if seq > box.next:
                box.early[seq] = payload  # its predecessor is still on the other way
            return
        out.append((sender, payload))
        box.next += 1
        while box.early:
            follow = box.early.pop(box.next, None)
            if follow is None:
                break
            out.append((sender, follow))
            box.next += 1

    # -- local links --------------------------------------------------------------------------------------
    def _listen_local(self) -> socket.socket | None:
        if not hasattr(socket, "SO_PEERCRED"):
            return None  # not Linux: ZMQ only
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.bind(b"\0mstar_dist.ctl." + secrets.token_hex(12).encode())
            sock.listen(256)
        except OSError:
            sock.close()
            return None
        sock.setblocking(False)
        self._poller.register(sock.fileno(), zmq.POLLIN)
        return sock

    def _accept_links(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            if uid != os.getuid():  # another user's process: it gets nothing (ZMQ still checks the token)
                conn.close()
                continue
            conn.setblocking(False)
            self._accepted[conn.fileno()] = [conn, None]
            self._poller.register(conn.fileno(), zmq.POLLIN)

    def _read_link(self, fd: int, out: list[tuple[str, bytes]], max_messages: int) -> None:
        entry = self._accepted[fd]
        conn = entry[0]
        while len(out) < max_messages:
            try:
                packet = conn.recv(LOCAL_MAX_BYTES + _HEADER.size)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                packet = b""
            if not packet:  # the sender closed its end (it stopped, or fell back to ZMQ for good)
                self._poller.unregister(fd)
                del self._accepted[fd]
                conn.close()
                return
            if entry[1] is None:
                if packet[:1] == _HELLO:
                    entry[1] = packet[1:].decode(errors="replace")
                continue
            if len(packet) >= _HEADER.size:
                self._arrived(entry[1], packet[:_HEADER.size], packet[_HEADER.size:], out)

    def fds(self) -> set[int]:
        """The file descriptors whose readiness means ``recv(0)`` may have something: for a caller that waits in an
        event loop instead of in ``recv`` (``loop.add_reader``). The set changes as local links are accepted (ask
        again after each ``recv``); ZMQ's own descriptor is edge-triggered, so on its readiness drain with ``recv(0)``
        until it returns nothing."""
        if self._closed:
            self._check_open()
        out = {self._router.getsockopt(zmq.FD), self._wake_r, *self._accepted}
        if self._listener_fd >= 0:
            out.add(self._listener_fd)
        return out

    def wake(self) -> None:
        """End the wait of a ``recv`` running on another thread now (it returns what it has, maybe nothing).
        Thread-safe; for a thread that handed the receiving thread work outside the channel."""
        if self._closed:
            return
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake-up is pending anyway) or the channel is closing

    def close(self, flush_s: float = 0.0) -> None:
        """Close every socket. ``flush_s`` 0: at once, unsent messages are dropped. ``flush_s`` > 0: first let what
        ZMQ still queues leave (ZMQ's linger), returning as soon as it has, or after ``flush_s`` when a peer does not
        take it (gone, or never connected); with a context of the caller's, that wait is in the caller's
        ``Context.term``. Messages sent over a local link are in the peer's queue already. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        linger_ms = max(0, int(flush_s * 1000))
        for sock in self._dealers.values():
            sock.close(linger=linger_ms)
        self._dealers.clear()
        for link in [*self._links.values(), *(entry[0] for entry in self._accepted.values())]:
            link.close()
        self._links.clear()
        self._accepted.clear()
        if self._listener is not None:
            self._listener.close()
        self._router.close(linger=0)
        if self._own_ctx:
            self._ctx.term()  # returns once every dealer's queue is empty or its linger has passed

    def __enter__(self) -> ControlChannel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"control channel {self.name!r} is closed")


def _tcp_host(addr: str) -> str:
    """An address as a ZMQ tcp endpoint writes it (an IPv6 literal in brackets)."""
    return f"[{addr.strip('[]')}]" if ":" in addr else addr


class _Inbound:
    """What a receiver keeps per sender: its session, the next sequence number, messages that came early."""

    __slots__ = ("session", "next", "early")

    def __init__(self, session: int) -> None:
        self.session = session
        self.next = 0
        self.early: dict[int, bytes] = {}


def _connect_local(name: str) -> socket.socket | None:
    """A local link to the channel listening under ``name``, or None when it is not on this machine (or in this
    network namespace)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(1.0)
    try:
        sock.connect(b"\0" + name.encode())
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _LOCAL_SNDBUF)
    except OSError:
        sock.close()
        return None
    sock.setblocking(False)
    return sock


# -- endpoint discovery through the torchrun store ------------------------------------------------------------
def default_store():
    """The key-value store of the default process group (torchrun's TCPStore behind a prefix).

    Wraps torch.distributed's private `_get_default_store`; this is the only module that may call it.
    ValueError if the default process group is not initialised.
    """
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def publish_endpoint(store, name: str, endpoint: str) -> None:
    """Write `name`'s control endpoint into `store` (a torch.distributed Store). Does not block."""
    store.set(_ENDPOINT_KEY.format(name=name), endpoint)


def lookup_endpoint(store, name: str, timeout_s: float) -> str:
    """Read `name`'s control endpoint from `store`, blocking until it is published or `timeout_s` passes.

    TimeoutError naming the participant when it never publishes (it failed to start or is on a dead host).
    """
    key = _ENDPOINT_KEY.format(name=name)
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # the store raises DistStoreError / RuntimeError subclasses on timeout
        raise TimeoutError(
            f"control endpoint of {name!r} was not published within {timeout_s:g} s ({exc})"
        ) from exc
    return store.get(key).decode()


_SECRET_KEY = "mstar_dist/secret"


def share_secret(store, *, publisher: bool, timeout_s: float) -> str:
    """The deployment token that every control envelope carries (docs/architecture.md §6): a secret drawn per launch.

    The ``publisher`` (the conductor's rank; exactly one) draws 16 random bytes and writes them into `store` (the
    torchrun store of this launch) before reading; every rank, the publisher included, reads the value back,
    blocking until it is there or `timeout_s` passes (TimeoutError). Nothing outside this launch's store can
    derive it: unlike a hash of the config and rendezvous address, a process that knows both learns nothing.
    """
    if publisher:
        store.set(_SECRET_KEY, secrets.token_hex(16))
    try:
        store.wait([_SECRET_KEY], datetime.timedelta(seconds=timeout_s))
    except Exception as exc:
        raise TimeoutError(f"the deployment secret was not published within {timeout_s:g} s: the conductor's "
                           f"rank did not start ({type(exc).__name__}: {exc})") from exc
    return store.get(_SECRET_KEY).decode()
