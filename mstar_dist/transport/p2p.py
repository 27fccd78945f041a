"""Point-to-point transport: tensors over the directed pair groups (docs/architecture.md §7, "p2p").

Protocol (the caller's side of it):
1. The producer calls `send` (or `post_send`): the op is *deferred*, nothing is issued yet. It puts the
   descriptor (shape, dtype, ...) on the control plane, THEN calls `flush`, which issues every deferred op in
   order. So the descriptor travels ahead of the bytes and the consumer posts its receive while the producer is
   still issuing the send (the host cost of one NCCL call is off the transfer's critical path), and a send whose
   descriptor never went out can be withdrawn (`withdraw`) instead of leaving the pair out of step.
2. The consumer, on each descriptor from a producer, calls `recv` in descriptor order (issued at once).
3. Both poll `Transfer.done()` from their loop (or block in `Transfer.wait`). Polling a deferred send flushes.
Each directed pair is FIFO: the k-th `recv` on (src, dst) receives the k-th `send` on it. A pair group carries
CUDA tensors on NCCL and host tensors on gloo (see distributed/groups.py); each backend is FIFO on its own and
both sides issue ops in descriptor order, so mixing the two kinds on a pair stays correct.

Wire format: the tensor's elements, contiguous, nothing else. Empty tensors never touch the wire (done at
once); 0-d tensors travel as 1 element; non-contiguous ones are made contiguous (a device copy, counted in
`contiguous_copies`); dtypes outside the set both gloo and NCCL carry natively travel as their raw bytes
(uint8 view). gloo accepts float32/16, bfloat16, bool, int8/64 natively (torch 2.11 and 2.13; tested in
tests/dist/test_p2p.py).

Issuing an op is one call into the pair's `ProcessGroup` (`send`/`recv` on the C++ object: the checks of
`dist.isend` are made once, when the pair is set up). CUDA: ProcessGroupNCCL runs a p2p op on its own stream,
which it first makes wait for the caller's current stream, so the transfer starts only after the producing
kernels (and, for a receive, after the buffer's allocation) and never blocks the compute stream. The source
tensor is referenced by the `Transfer` (and by the transport until the transfer is seen complete), so the
caching allocator cannot reuse its memory mid-send. A received tensor is allocated on the caller's current
stream; it is ready once `done()` is true or `wait()` returned, or for GPU-side consumption without a host sync,
after `ready_on(stream)`. No host staging: CUDA tensors go device to device (`stats()["host_staging_copies"]`
stays 0; any host copy this module made would be counted there).

Failure (docs/architecture.md §7): a pair that timed out or broke is dead for good. `Transfer.wait` timing out aborts the pair;
`abort_pair` does it explicitly. Later sends/recvs on a dead pair raise `PairDeadError` naming the pair; a
deferred send whose pair died before `flush` fails (its `done()` raises).

Threads: every op is issued from the calling thread (the rank's worker thread); nothing here is thread-safe.
One kind of helper thread exists, and it issues nothing: gloo's send/recv `Work` cannot be polled
(`is_completed()` only turns true inside `wait()`, and a `wait` with a short timeout breaks the whole group), so
for each pair that carries host tensors one daemon thread blocks in `Work.wait()` on that pair's works, in
the order they were first polled, and flips a flag that `done()` reads. A gloo transfer nobody polled before
its `wait()` is waited on by the calling thread itself (no hand-off). A Work is waited on exactly once: a
second gloo `wait()` would wait for a completion that never comes. NCCL works are polled from the calling
thread (`is_completed()` queries the op's CUDA event).
"""

from __future__ import annotations

import datetime
import logging
import math
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mstar_dist.distributed.groups import PairGroup
from mstar_dist.transport.base import PeerDeadError
from mstar_dist.transport.inline import str_to_dtype
from mstar_dist.transport.plane import TransportSetup

__all__ = ["P2PTransport", "PairDeadError", "Transfer", "build"]

log = logging.getLogger(__name__)

# dtypes that both gloo and NCCL carry as themselves; others go as raw bytes.
_NATIVE_DTYPES = frozenset(
    {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
     torch.uint8, torch.bool}
)


def build(setup: TransportSetup) -> P2PTransport:
    """This rank's p2p transport (the registry's factory) over the pair groups every rank created beforehand."""
    return P2PTransport(setup.global_rank, dict(setup.pair_groups), setup.device)


class PairDeadError(PeerDeadError):
    """An op was attempted (or pending) on a directed pair that was aborted or timed out."""


@dataclass
class _PairStats:
    sends: int = 0
    send_bytes: int = 0
    recvs: int = 0
    recv_bytes: int = 0


class Transfer:
    """One posted send or receive on a directed pair. Poll `done()` or block in `wait()`."""

    def __init__(
        self,
        transport: P2PTransport,
        kind: str,
        pair: tuple[int, int],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        wire: torch.Tensor | None,
        work: dist.Work | None,
        result: torch.Tensor,
    ) -> None:
        self._transport = transport
        self.kind = kind
        """"send" or "recv"."""
        self.pair = pair
        """(src, dst) in global ranks."""
        self.shape = shape
        self.dtype = dtype
        self.nbytes = math.prod(shape) * result.element_size()
        self._wire = wire
        self._work = work
        self._result = result
        self._complete = wire is None  # an empty tensor: nothing goes on the wire
        self._gloo = wire is not None and wire.device.type != "cuda"
        self._signal = threading.Event() if self._gloo else None  # set by the pair's gloo waiter thread
        self._error: BaseException | None = None
        self._handed_off = False  # gloo: the waiter thread owns the (single) Work.wait() call
        self._stream: torch.cuda.Stream | None = None  # a deferred CUDA send: the stream it was posted under

    @property
    def tensor(self) -> torch.Tensor:
        """send: the source tensor. recv: the destination tensor, valid after done()/wait()/ready_on()."""
        return self._result

    @property
    def on_cuda(self) -> bool:
        return self._result.device.type == "cuda"

    def done(self) -> bool:
        """True once the transfer has completed; never blocks. PairDeadError if its pair was aborted first;
        the backend's error (peer process gone, ...) if it failed; either way the pair is then dead."""
        if self._complete:
            return True
        self._check_alive()
        if self._work is None:  # a deferred send: issue it (and every one deferred before it) now
            self._transport.flush()
            if self._work is None:
                self._finish()  # flush recorded why it could not issue this one: raise it
        if self._gloo and not self._handed_off:
            self._transport._hand_off(self)
            return False
        if not (self._signal.is_set() if self._gloo else self._work.is_completed()):
            return False
        self._finish()
        return True

    def wait(self, timeout_s: float) -> torch.Tensor:
        """Block the host until the transfer completes; return `tensor`.

        TimeoutError (naming pair, shape, dtype and bytes) after `timeout_s`: the pair is then aborted for
        good (docs/architecture.md §7). After a CUDA recv returns, the tensor is ready on every stream.
        """
        if self._complete:
            return self._result
        self._check_alive()
        if self._work is None:  # a deferred send
            self._transport.flush()
            if self._work is None:
                self._finish()
        if self._gloo and not self._handed_off:
            # Nobody has polled it yet: wait here, saving two thread wake-ups. A timed-out gloo wait breaks
            # the pair's group, which is what a timeout means for us anyway (the pair is aborted below).
            self._handed_off = True
            try:
                self._work.wait(datetime.timedelta(seconds=timeout_s))
            except RuntimeError as exc:
                self._error = exc
            if self._error is not None and "timed out" in str(self._error).lower():
                self._fail(self._error, timed_out=True, timeout_s=timeout_s)
        elif self._gloo:
            if not self._signal.wait(timeout_s):
                self._fail(None, timed_out=True, timeout_s=timeout_s)
        else:
            self._wait_cuda(timeout_s)
        self._finish()
        return self._result

    def ready_on(self, stream: torch.cuda.Stream) -> torch.Tensor:
        """CUDA recv: make `stream` wait for the data without blocking the host; return `tensor`.

        Also records the tensor on `stream` for the caching allocator. No-op for host tensors (use wait).
        """
        if self.on_cuda and not self._complete:
            self._check_alive()
            with torch.cuda.stream(stream):
                self._work.wait()  # NCCL: the current stream waits on the op's end event; host not blocked
            self._result.record_stream(stream)
        return self._result

    def __repr__(self) -> str:
        state = "done" if self._complete else "pending"
        return (f"Transfer({self.kind} {self.pair[0]}->{self.pair[1]} {list(self.shape)} "
                f"{self.dtype} {self.nbytes} B {state})")

    # -- internals ------------------------------------------------------------------------------------------
    def _describe(self) -> str:
        return (f"{self.kind} on pair {self.pair[0]}->{self.pair[1]} "
                f"(shape {list(self.shape)}, {self.dtype}, {self.nbytes} bytes)")

    def _check_alive(self) -> None:
        reason = self._transport._dead.get(self.pair)
        if reason is not None:
            raise PairDeadError(f"{self._describe()} cannot complete: pair is dead ({reason})")

    def _wait_cuda(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        spin_until = time.monotonic() + 2e-3  # spin briefly: a small transfer ends before a sleep would
        while not self._work.is_completed():
            now = time.monotonic()
            if now > deadline:
                self._fail(None, timed_out=True, timeout_s=timeout_s)
            if now > spin_until:
                time.sleep(5e-5)

    def _fail(self, exc: BaseException | None, *, timed_out: bool, timeout_s: float | None = None) -> None:
        what = f"timed out after {timeout_s:g} s" if timeout_s is not None else ("timed out" if timed_out else "failed")
        reason = f"{self._describe()} {what}" + (f": {exc}" if exc is not None else "")
        self._transport.abort_pair(*self.pair, reason=reason)
        if timed_out:
            raise TimeoutError(reason) from exc
        raise PairDeadError(reason) from exc

    def _finish(self) -> None:
        if self._work is None:  # a deferred send that could not be issued (flush recorded why)
            self._fail(self._error, timed_out=False)
        if self._gloo:
            if self._error is not None:  # the waiter thread's wait() raised: peer gone, or the group timeout
                self._fail(self._error, timed_out="timed out" in str(self._error).lower())
        else:
            self._work.wait()  # NCCL: the caller's current stream waits on the (completed) end event; no host block
        self._complete = True
        self._wire = None  # drop our hold on the wire buffer; `_result` still references the data
        self._transport._completed(self)


class P2PTransport:
    """Sends and receives tensors on this rank's directed pair groups. One per rank, used from one thread.
    Implements ``transport.base.DataPlane`` (``post_send`` / ``post_recv`` / ``abort_peer`` ...)."""

    name = "p2p"

    def __init__(self, global_rank: int, pair_groups: dict[tuple[int, int], PairGroup],
                 device: str | torch.device) -> None:
        """`pair_groups`: this rank's pairs from `create_pair_groups`; `device`: the rank's compute device,
        the default for received tensors ("cpu" or "cuda:N")."""
        self.global_rank = global_rank
        self.device = torch.device(device)
        self._groups = dict(pair_groups)
        for (src, dst) in self._groups:
            assert global_rank in (src, dst), f"pair {src}->{dst} does not include rank {global_rank}"
        self._dead: dict[tuple[int, int], str] = {}
        self._stats: dict[tuple[int, int], _PairStats] = {pair: _PairStats() for pair in self._groups}
        self._inflight: dict[int, Transfer] = {}
        self._deferred: list[Transfer] = []  # sends whose descriptor is not out yet, in posting order
        self._waiters: dict[tuple[int, int], _GlooWaiter] = {}
        self._host_staging_copies = 0  # must stay 0: nothing in this module copies device tensors to host
        self._contiguous_copies = 0

    # -- public ops -----------------------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int) -> Transfer:
        """Queue a send of `tensor` to global rank `dst` on pair (self, dst); return at once.

        Deferred: the op is issued by the next `flush` (or the first poll of the transfer), which the caller makes
        right after the descriptor went out on the control plane. Never blocks. PairDeadError if the pair is dead,
        KeyError if there is no pair (self, dst).
        """
        pair = (self.global_rank, dst)
        self._pair(pair)
        stats = self._stats[pair]
        stats.sends += 1
        stats.send_bytes += tensor.numel() * tensor.element_size()
        if tensor.numel() == 0:
            return Transfer(self, "send", pair, tuple(tensor.shape), tensor.dtype, None, None, tensor)
        wire = self._to_wire(tensor)
        tr = Transfer(self, "send", pair, tuple(tensor.shape), tensor.dtype, wire, None, tensor)
        if wire.is_cuda:  # the stream the bytes are produced on: the op is ordered after it, wherever flushed
            tr._stream = torch.cuda.current_stream(wire.device)
        self._deferred.append(tr)
        return self._track(tr)

    def flush(self) -> None:
        """Issue every deferred send, in the order they were queued. Never blocks, never raises: a send that
        cannot be issued (its pair died meanwhile) keeps the error, which its `done()` raises."""
        deferred, self._deferred = self._deferred, []
        for tr in deferred:
            try:
                pg = self._pair(tr.pair)
                if tr._stream is None or tr._stream == torch.cuda.current_stream(tr._wire.device):
                    tr._work = self._post(True, tr._wire, pg)
                else:  # posted under another stream than the current one: order after that one
                    with torch.cuda.stream(tr._stream):
                        tr._work = self._post(True, tr._wire, pg)
            except Exception as exc:  # noqa: BLE001 - handed to the caller through done()
                tr._error = exc

    def withdraw(self, tr: Transfer) -> bool:
        """Drop a send that is still deferred (its descriptor will never go out): True if it was, and then the
        pair stays in step with nothing to undo. False if it was already issued."""
        if tr not in self._deferred:
            return False
        self._deferred.remove(tr)
        self._inflight.pop(id(tr), None)
        stats = self._stats[tr.pair]
        stats.sends -= 1
        stats.send_bytes -= tr.nbytes
        tr._complete = True
        return True

    def recv(
        self, shape: Sequence[int], dtype: torch.dtype, src: int, device: str | torch.device | None = None
    ) -> Transfer:
        """Allocate a tensor and post an irecv from global rank `src` on pair (src, self); return at once.

        Call in the order the descriptors from `src` arrived. `device` defaults to this rank's device; pass
        "cpu" for a host tensor (travels on the pair's gloo half). PairDeadError / KeyError as for `send`.
        """
        pair = (src, self.global_rank)
        pg = self._pair(pair)
        dev = self.device if device is None else torch.device(device)
        shape = tuple(int(s) for s in shape)
        result = torch.empty(shape, dtype=dtype, device=dev)
        stats = self._stats[pair]
        stats.recvs += 1
        stats.recv_bytes += result.numel() * result.element_size()
        if result.numel() == 0:
            return Transfer(self, "recv", pair, shape, dtype, None, None, result)
        wire = _wire_view(result)
        work = self._post(False, wire, pg)
        return self._track(Transfer(self, "recv", pair, shape, dtype, wire, work, result))

    def abort_pair(self, src: int, dst: int, *, reason: str = "aborted") -> None:
        """Mark pair (src, dst) dead for good and abort its process group on this rank. Idempotent.

        Pending and later transfers on it raise PairDeadError naming the pair and `reason`. The peer is not
        told here: the caller reports the failure on the control plane. Other pairs are unaffected.
        """
        pair = (src, dst)
        if pair not in self._groups:
            raise KeyError(f"rank {self.global_rank} has no pair {src}->{dst}")
        if pair in self._dead:
            return
        self._dead[pair] = reason
        log.warning("rank %d: pair %d->%d is dead: %s", self.global_rank, src, dst, reason)
        try:
            self._groups[pair].group.abort()
        except Exception:  # noqa: BLE001 - best effort; the pair stays marked dead either way
            log.debug("abort of pair %d->%d's group raised", src, dst, exc_info=True)
        for key, tr in list(self._inflight.items()):
            if tr.pair == pair:
                del self._inflight[key]
        self._deferred = [tr for tr in self._deferred if tr.pair != pair]  # their done() raises PairDeadError

    def close(self) -> None:
        """Stop the gloo waiter threads once their current wait ends (they are daemons: a wait stuck on a dead
        pair does not hold up exit). Call before `shutdown_distributed`."""
        for waiter in self._waiters.values():
            waiter.stop()
        self._waiters.clear()

    def is_pair_dead(self, src: int, dst: int) -> bool:
        return (src, dst) in self._dead

    # -- the DataPlane seam (transport/base.py) ---------------------------------------------------------------
    def post_send(self, tensor: torch.Tensor, dst: int) -> tuple[Transfer, None]:
        """`send` (deferred until `flush`); p2p descriptors carry no location (the pair's FIFO order pairs sends
        with receives)."""
        return self.send(tensor, dst), None

    def post_recv(self, wire, src: int, device: torch.device | None = None) -> Transfer:
        """`recv` for a `WireTensor` descriptor from global rank `src` (host tensors into host memory)."""
        return self.recv(wire.shape, str_to_dtype(wire.dtype), src, device="cpu" if wire.host else device)

    def poll(self) -> list:
        """Nothing to acknowledge: a pair's transfers complete on both sides."""
        return []

    def on_ack(self, src: int, ack) -> None:
        log.warning("rank %d: ignoring a %s acknowledgement from rank %d: p2p needs none", self.global_rank,
                    ack.via, src)

    def abort_peer(self, peer: int, reason: str) -> None:
        """`abort_pair` both directions with global rank `peer` (the pairs that exist)."""
        for pair in ((self.global_rank, peer), (peer, self.global_rank)):
            if pair in self._groups:
                self.abort_pair(*pair, reason=reason)

    def revive_peer(self, peer: int, pair_groups) -> None:
        """Global rank `peer` restarted and rejoined: its pairs with this rank run on the fresh groups
        `pair_groups` (``distributed/repair.py``) from now on; the dead pairs' groups are dropped (their waiter
        threads stop once their last wait ends)."""
        for pair, pg in pair_groups.items():
            if self.global_rank not in pair or peer not in pair:
                continue
            waiter = self._waiters.pop(pair, None)
            if waiter is not None:
                waiter.stop()
            self._groups[pair] = pg
            self._dead.pop(pair, None)
            self._stats.setdefault(pair, _PairStats())

    def is_dead(self, peer: int) -> bool:
        """Whether a pair with global rank `peer` is dead (either direction)."""
        return (self.global_rank, peer) in self._dead or (peer, self.global_rank) in self._dead

    def progress(self) -> list[Transfer]:
        """Poll every in-flight transfer once; return those that completed now. Never blocks.
        Raises like `Transfer.done` if one failed (its pair is then dead)."""
        finished = []
        for tr in list(self._inflight.values()):
            if tr.done():
                finished.append(tr)
        return finished

    def device_inflight(self) -> bool:
        """Whether a CUDA (NCCL) transfer is posted and not yet seen complete."""
        return any(tr.on_cuda for tr in self._inflight.values())

    @property
    def inflight(self) -> int:
        """Transfers posted and not yet seen complete."""
        return len(self._inflight)

    def stats(self) -> dict:
        """Counters for /metrics and benchmarks: totals, per pair "src->dst" sends/recvs and bytes, copies made
        (host staging must stay 0), in-flight count, dead pairs."""
        per = self._stats.values()
        return {
            "sends": sum(st.sends for st in per),
            "recvs": sum(st.recvs for st in per),
            "bytes_sent": sum(st.send_bytes for st in per),
            "bytes_received": sum(st.recv_bytes for st in per),
            "pairs": {f"{s}->{d}": vars(st).copy() for (s, d), st in sorted(self._stats.items())},
            "host_staging_copies": self._host_staging_copies,
            "contiguous_copies": self._contiguous_copies,
            "inflight": len(self._inflight),
            "dead_pairs": [f"{s}->{d}" for (s, d) in sorted(self._dead)],
        }

    # -- internals ------------------------------------------------------------------------------------------
    def _pair(self, pair: tuple[int, int]) -> PairGroup:
        reason = self._dead.get(pair)
        if reason is not None:
            raise PairDeadError(f"pair {pair[0]}->{pair[1]} is dead: {reason}")
        try:
            return self._groups[pair]
        except KeyError:
            raise KeyError(
                f"rank {self.global_rank} has no pair group {pair[0]}->{pair[1]}; "
                f"its pairs: {[f'{s}->{d}' for s, d in sorted(self._groups)]}"
            ) from None

    def _to_wire(self, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_contiguous():
            self._contiguous_copies += 1
            tensor = tensor.contiguous()
        return _wire_view(tensor)

    def _post(self, sending: bool, wire: torch.Tensor, pg: PairGroup) -> dist.Work:
        # One call into the C++ ProcessGroup, which routes by the tensor's device (NCCL or gloo). For CUDA,
        # ProcessGroupNCCL orders its p2p stream after the caller's current stream: no stream juggling here.
        if sending:
            return pg.group.send([wire], pg.peer_rank_in_group, 0)
        return pg.group.recv([wire], pg.peer_rank_in_group, 0)

    def _track(self, tr: Transfer) -> Transfer:
        self._inflight[id(tr)] = tr
        return tr

    def _hand_off(self, tr: Transfer) -> None:
        """Give a gloo transfer's Work.wait() to its pair's waiter thread (on the first poll)."""
        tr._handed_off = True
        waiter = self._waiters.get(tr.pair)
        if waiter is None:
            waiter = self._waiters[tr.pair] = _GlooWaiter(tr.pair, self.global_rank)
        waiter.submit(tr)

    def _completed(self, tr: Transfer) -> None:
        self._inflight.pop(id(tr), None)


class _GlooWaiter:
    """Blocks in `Work.wait()` for one pair's gloo transfers, in posting order; issues no ops (module doc)."""

    def __init__(self, pair: tuple[int, int], global_rank: int) -> None:
        self._queue: queue.SimpleQueue[Transfer | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name=f"rank{global_rank}-gloo-wait-{pair[0]}->{pair[1]}", daemon=True
        )
        self._thread.start()

    def submit(self, tr: Transfer) -> None:
        self._queue.put(tr)

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (tr := self._queue.get()) is not None:
            try:
                tr._work.wait()  # releases the GIL; bounded by the pair group's timeout
            except BaseException as exc:  # noqa: BLE001 - handed to the worker thread via done()/wait()
                tr._error = exc
            tr._signal.set()


def _wire_view(t: torch.Tensor) -> torch.Tensor:
    """The contiguous 1-D (0-d -> 1 element) view that goes on the wire; raw bytes for non-native dtypes."""
    flat = t.view(-1) if t.dim() != 1 else t
    return flat if t.dtype in _NATIVE_DTYPES else flat.view(torch.uint8)
