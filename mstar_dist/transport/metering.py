"""What the router measures about the transfers it routes (docs/architecture.md §7), for ``--log-stats`` and
/metrics:

- per edge (walk, producer -> consumer, signal, transport): count, bytes and recent transfer times
  (:class:`EdgeStats`, quantiles in the rank's ``Stats.edges``);
- per transport and direction: histograms of transfer sizes and times (:class:`TransferMeter`, in the rank's
  ``Stats.edge_histograms``).

A transfer's time runs from its post to the rank's loop first seeing it complete (``done()``), so it includes up
to one loop turn of polling delay. Every transport is metered the same way because the router does it: a
transport never measures itself. Used from the rank's worker thread only.
"""

from __future__ import annotations

import bisect
import collections
import time

import torch

from mstar_dist.control import messages as m
from mstar_dist.transport.base import Transfer

__all__ = ["BYTE_BOUNDS", "SECOND_BOUNDS", "Buckets", "EdgeStats", "Metered", "MeteredSend", "TimedRecv", "TransferMeter"]

BYTE_BOUNDS = tuple(float(4**k) for k in range(4, 16))
"""Transfer size buckets: 256 B, 1 KiB, 4 KiB ... 1 GiB."""
SECOND_BOUNDS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Transfer time buckets, 100 µs to 30 s."""


class Buckets:
    """A histogram being filled: per-bucket counts over fixed upper ``bounds`` plus one overflow bucket."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self, transport: str, direction: str, unit: str) -> m.EdgeHistogram:
        return m.EdgeHistogram(transport=transport, direction=direction, unit=unit, bounds=list(self.bounds),
                               counts=list(self.counts), total=self.total)


class TransferMeter:
    """Sizes and times of one transport's sends and receives."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.bytes = {d: Buckets(BYTE_BOUNDS) for d in ("send", "recv")}
        self.seconds = {d: Buckets(SECOND_BOUNDS) for d in ("send", "recv")}

    def snapshot(self) -> list[m.EdgeHistogram]:
        """Bytes then seconds, each send then recv."""
        return [*(b.snapshot(self.name, d, "bytes") for d, b in self.bytes.items()),
                *(b.snapshot(self.name, d, "seconds") for d, b in self.seconds.items())]


class EdgeStats:
    """Count, bytes and recent transfer times per (walk, src, dst, signal, transport)."""

    WINDOW = 1024
    """Quantiles are over the last this-many transfers of each edge."""

    def __init__(self) -> None:
        self._edges: dict[tuple[str, int, int, str, str], list] = {}

    def record(self, walk: str, src: int, dst: int, signal: str, via: str, nbytes: int, seconds: float) -> None:
        entry = self._edges.get((walk, src, dst, signal, via))
        if entry is None:
            entry = self._edges[(walk, src, dst, signal, via)] = [0, 0, collections.deque(maxlen=self.WINDOW)]
        entry[0] += 1
        entry[1] += nbytes
        entry[2].append(seconds)

    def snapshot(self) -> list[m.EdgeStat]:
        out = []
        for (walk, src, dst, signal, via), (count, nbytes, times) in sorted(self._edges.items()):
            ordered = sorted(times)
            out.append(m.EdgeStat(walk=walk, src=src, dst=dst, signal=signal, via=via, count=count, nbytes=nbytes,
                                  p50_s=_quantile(ordered, 0.5), p99_s=_quantile(ordered, 0.99)))
        return out


def _quantile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Metered:
    """A posted transfer the Router times; ``inner`` is the transport's own transfer (what ``withdraw``
    recognises)."""

    __slots__ = ("inner", "_seconds", "_t0")

    def __init__(self, inner: Transfer, seconds: Buckets) -> None:
        self.inner, self._seconds = inner, seconds
        self._t0: float | None = time.perf_counter()

    @property
    def tensor(self) -> torch.Tensor:
        return self.inner.tensor


class MeteredSend(Metered):
    """A posted send that records its time in ``seconds`` the first time it is seen complete."""

    __slots__ = ()

    def done(self) -> bool:
        finished = self.inner.done()
        if finished and self._t0 is not None:
            self._seconds.observe(time.perf_counter() - self._t0)
            self._t0 = None
        return finished


class TimedRecv(Metered):
    """A posted receive that records its edge statistics and its transport's time histogram the first time it is
    seen complete."""

    __slots__ = ("_edges", "_key", "_nbytes")

    def __init__(self, inner: Transfer, edges: EdgeStats, key: tuple[str, int, int, str, str], nbytes: int,
                 seconds: Buckets) -> None:
        super().__init__(inner, seconds)
        self._edges, self._key, self._nbytes = edges, key, nbytes

    def done(self) -> bool:
        finished = self.inner.done()
        if finished and self._t0 is not None:
            elapsed = time.perf_counter() - self._t0
            self._t0 = None
            self._edges.record(*self._key, self._nbytes, elapsed)
            self._seconds.observe(elapsed)
        return finished
