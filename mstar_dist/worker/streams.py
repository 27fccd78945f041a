"""Streaming edges on a rank (docs/architecture.md §7): values a walk of one partition streams into a node of another.

Producer side: a walk's streamed values (``WalkRun.on_stream``) are collected per request during a step and sent at
its end to the consuming rank, one ``StreamItems`` per signal (small values inline, large ones on the pair right
after it). Consumer side: received items (tensors, or transfers still in flight) wait in order, go through the
edge's chunk policy (``graph/streaming.py``) and are delivered to the consuming walk as chunks, at most what its
loop can queue; items may arrive before that walk starts. A ``StreamEnd`` makes the buffer emit its final chunk;
the rank that produced the stream forwards it to the consumer after its own items; for a consumer that reads the
stream until it ends (``GraphNode.until_end``) the end reaches its walk (``WalkRun.end_input``) once every chunk before
it has been delivered. Runs on the worker's loop.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Container

import torch

from mstar_dist.control import messages as m
from mstar_dist.control.envelope import parse_rank, rank_name
from mstar_dist.graph.nodes import Section, iter_nodes, node_names
from mstar_dist.graph.partitions import StreamingEdge
from mstar_dist.graph.streaming import StreamBuffer
from mstar_dist.graph.walk import GraphError, WalkRun
from mstar_dist.worker.runs import Runs
from mstar_dist.worker.spans import receive
from mstar_dist.worker.transfers import Transfers, transfer_state

log = logging.getLogger(__name__)


class Streams:
    """Both ends of the streaming edges of this rank's requests (see the module docstring)."""

    def __init__(self, *, edges: list[StreamingEdge], graphs: dict[str, Section], name: str, runs: Runs,
                 transfers: Transfers, send: Callable[[str, m.Message], None], removed: Container[str],
                 fail_request: Callable[[str, str], None], flush_emits: Callable[[], None]) -> None:
        """``fail_request(request_id, error)`` fails a request's walks here; ``flush_emits()`` sends the step's
        emits and ended walks (a forwarded ``StreamEnd`` goes after them)."""
        self.edges = {e.signal: e for e in edges}
        self.graphs, self.name, self.runs, self.transfers = graphs, name, runs, transfers
        self._send, self._removed = send, removed
        self._fail_request, self._flush_emits = fail_request, flush_emits
        self._inputs_of: dict[str, frozenset[str]] = {}  # walk -> inputs that arrive on streaming edges
        self.routes: dict[str, dict[str, int]] = {}
        """Request -> streamed signal it produces here -> the consumer's global rank."""
        self.out: dict[str, list[tuple[str, torch.Tensor]]] = collections.defaultdict(list)
        """Request -> (signal, value) streamed in this step, sent at its end (:meth:`flush`)."""
        self._buffers: dict[tuple[str, str], StreamBuffer] = {}  # (request, signal) -> consumer-side buffer
        self._chunks: dict[tuple[str, str], collections.deque] = collections.defaultdict(collections.deque)
        self._received: dict[tuple[str, str], collections.deque] = collections.defaultdict(collections.deque)
        """(request, signal) -> received stream items (tensors or transfers in flight) and ends (None), in order."""
        read_until_end = {(n.name, signal) for section in graphs.values() for n in iter_nodes(section)
                          for signal in n.until_end}
        self._until_end = frozenset(e.signal for e in edges if (e.dst_node, e.signal) in read_until_end)
        """Streamed signals whose consumer reads them until their stream ends."""
        self._ending: set[tuple[str, str]] = set()
        """(request, signal) of such streams that have ended: their consumer is told once its chunks are in."""

    def streamed_inputs(self, walk: str) -> frozenset[str]:
        """The inputs of ``walk`` that arrive on streaming edges (a node missing only these waits for them)."""
        found = self._inputs_of.get(walk)
        if found is None:
            names = node_names(self.graphs[walk])
            found = self._inputs_of[walk] = frozenset(e.signal for e in self.edges.values() if e.dst_node in names)
        return found

    def requests(self) -> set[str]:
        """Requests with items or chunks waiting on the consumer side."""
        return {rid for rid, _ in (*self._buffers, *self._chunks, *self._received, *self._ending)}

    def busy(self) -> bool:
        """Items wait for their transfers or for their consumer (the loop must come back soon)."""
        return bool(self._chunks or self._received or self._ending)

    # ---- consumer side ----
    def on_message(self, msg: m.StreamItems | m.StreamEnd, sender: str) -> None:
        """A producer's items or a stream's end; a malformed or out-of-order stream fails its request, not the
        rank."""
        try:
            self._take_message(msg, sender)
        except Exception as exc:
            self._fail_request(msg.request_id, f"stream {msg.signal!r}: {type(exc).__name__}: {exc}")

    def _take_message(self, msg: m.StreamItems | m.StreamEnd, sender: str) -> None:
        if msg.request_id in self._removed:
            return
        if isinstance(msg, m.StreamEnd) and msg.forward_to >= 0:  # we produced it: end it after our items
            self._flush_emits()
            self._send(rank_name(msg.forward_to), m.StreamEnd(request_id=msg.request_id, signal=msg.signal))
            return
        edge = self.edges.get(msg.signal)
        if edge is None:
            log.warning("%s: stream %r for %s is not a streaming edge of this model", self.name, msg.signal,
                        msg.request_id)
            return
        key = (msg.request_id, msg.signal)
        if key not in self._buffers:  # items may arrive before the consuming walk: buffered until it starts
            self._buffers[key] = StreamBuffer(edge.policy)
        if isinstance(msg, m.StreamEnd):
            self._received[key].append(None)
        else:  # post the receives now, in message order: the producer is already sending
            src = parse_rank(sender)
            walk = f"{edge.src_partition}->{edge.dst_partition}"  # the edge crosses partitions: label it by both
            self._received[key].extend(receive(v, src=src, plane=self.transfers.transport, walk=walk,
                                               signal=msg.signal) for v in msg.values)
        self._take_items(key)

    def _take_items(self, key: tuple[str, str]) -> None:
        """Move received items (in order; a transfer still in flight holds back the ones after it) into the
        stream's buffer, and its ready chunks into the consumer's queue."""
        pending, buffer = self._received[key], self._buffers[key]
        while pending:
            head = pending[0]
            if head is None:
                buffer.producer_done()
                if key[1] in self._until_end:
                    self._ending.add(key)
            elif isinstance(head, torch.Tensor):
                buffer.push(head)
            else:
                state = transfer_state(head)
                if state == "pending":
                    break
                if state != "done":
                    raise RuntimeError(f"a streamed item did not arrive: {state}")
                buffer.push(head.tensor)
            pending.popleft()
        if not pending:
            del self._received[key]
        self._chunks[key].extend(buffer.pop_ready())

    def feed(self) -> None:
        """Deliver buffered chunks to consuming walks, oldest first; a walk takes at most what its loop can queue."""
        for key in list(self._received):
            try:
                self._take_items(key)
            except Exception as exc:
                self.drop(key[0])
                self._fail_request(key[0], f"stream {key[1]!r}: {type(exc).__name__}: {exc}")
        for key in [k for k, q in self._chunks.items() if q]:
            request_id, signal = key
            edge = self.edges[signal]
            run = self._consumer(request_id, edge)
            if run is None:
                continue
            queue = self._chunks[key]
            while queue:
                chunk = queue[0]
                values = {signal: chunk.data}
                optional = _optional_inputs(run, edge.dst_node)
                if f"{signal}_final" in optional:
                    values[f"{signal}_final"] = torch.tensor([chunk.is_final])
                if f"{signal}_context" in optional:
                    values[f"{signal}_context"] = torch.tensor([chunk.n_context])
                try:
                    run.deliver_many(edge.dst_node, values)
                except GraphError:
                    break  # the consumer's input queue is full: retry on a later turn
                queue.popleft()
        for key in [k for k, q in self._chunks.items() if not q]:
            del self._chunks[key]
        if self._ending:
            self._end_inputs()

    def _consumer(self, request_id: str, edge: StreamingEdge) -> WalkRun | None:
        """The request's walk on this rank that holds the edge's consumer node (None before it starts)."""
        return next((r for r in self.runs.of(request_id) if edge.dst_node in node_names(r.section)), None)

    def _end_inputs(self) -> None:
        """Tell consumers that read a stream until it ends that it has, once every chunk before the end is in."""
        for key in [k for k in self._ending if not self._chunks.get(k) and not self._received.get(k)]:
            edge = self.edges[key[1]]
            run = self._consumer(key[0], edge)
            if run is None:
                continue  # its walk has not started: told when it has
            self._ending.discard(key)
            try:
                run.end_input(edge.dst_node, key[1])
            except GraphError as exc:
                self._fail_request(key[0], f"stream {key[1]!r}: {exc}")

    def drop(self, request_id: str, consumer: WalkRun | None = None) -> None:
        """Forget a request's consumer-side buffers (only those feeding ``consumer`` when given; with none, its
        producer side too). Receives still in flight are drained."""
        for key in [k for k in self._buffers if k[0] == request_id]:
            if consumer is None or self.edges[key[1]].dst_node in node_names(consumer.section):
                del self._buffers[key]
                self._ending.discard(key)
                self._chunks.pop(key, None)
                self.transfers.drain(t for t in self._received.pop(key, ()) if t is not None
                                     and not isinstance(t, torch.Tensor))
        if consumer is None:
            self.routes.pop(request_id, None)
            self.out.pop(request_id, None)

    # ---- producer side ----
    def flush(self) -> list[tuple[str, str]]:
        """Send this step's streamed values to their consumers' ranks; the (request, error) of those that cannot
        travel (the caller fails those requests once its own message is out)."""
        failed = []
        for request_id, items in list(self.out.items()):
            if items:
                try:
                    self._send_items(request_id, items)
                except Exception as exc:  # a streamed value that cannot travel fails its request
                    failed.append((request_id, f"streamed value: {type(exc).__name__}: {exc}"))
                items.clear()
        return failed

    def _send_items(self, request_id: str, items: list[tuple[str, torch.Tensor]]) -> None:
        """One message per signal, small values inline, large ones on the pair right after it (device to device on
        GPUs)."""
        routes = self.routes.get(request_id, {})
        by_signal: dict[str, list] = collections.defaultdict(list)
        for signal, value in items:
            by_signal[signal].append(value)
        for signal, values in by_signal.items():
            if signal not in routes:
                log.error("%s: request %s streamed %r with no consumer route", self.name, request_id, signal)
                continue
            dst = routes[signal]
            carried, transfers = self.transfers.post_values([(signal, v) for v in values], dst, "streamed")
            self._send(rank_name(dst), m.StreamItems(request_id=request_id, signal=signal, values=carried))
            self.transfers.outgoing.extend(transfers)


def _optional_inputs(run: WalkRun, node: str) -> tuple[str, ...]:
    return next(n.optional_inputs for n in iter_nodes(run.section) if n.name == node)
