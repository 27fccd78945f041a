"""What every rank measures about itself for ``/metrics``: its process (RSS, CPU seconds, open fds) and its edge
transfers (bytes and time per transport and direction). Ranks send both in their ``Stats`` message; the
conductor exports them per rank (``mstar_dist/conductor/metrics.py``).

Transfer time is measured from posting a send or receive to the rank loop first seeing it complete (``done()``),
so it includes up to one loop turn (about 1 ms while transfers are in flight) of polling delay.
"""

from __future__ import annotations

import bisect
import math
import time
from typing import Any

from prometheus_client import ProcessCollector

from mstar_dist.control.messages import EdgeHistogram

BYTE_BOUNDS = tuple(float(4**k) for k in range(4, 16))
"""Transfer size buckets: 256 B, 1 KiB, 4 KiB ... 1 GiB."""
SECOND_BOUNDS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Transfer time buckets, 100 µs to 30 s."""

_process = ProcessCollector(registry=None)


def process_sample() -> dict[str, float]:
    """This process's ``rss_bytes``, ``cpu_seconds`` (user + system) and ``open_fds``, read from /proc by
    prometheus_client (zeros where /proc is missing). Takes well under a millisecond."""
    values = {s.name: s.value for family in _process.collect() for s in family.samples}
    return {"rss_bytes": values.get("process_resident_memory_bytes", 0.0),
            "cpu_seconds": values.get("process_cpu_seconds_total", 0.0),
            "open_fds": values.get("process_open_fds", 0.0)}


class Buckets:
    """A histogram being filled: per-bucket counts over fixed upper ``bounds`` plus one overflow bucket."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self, transport: str, direction: str, unit: str) -> EdgeHistogram:
        return EdgeHistogram(transport=transport, direction=direction, unit=unit, bounds=list(self.bounds),
                             counts=list(self.counts), total=self.total)


class MeteredTransport:
    """Wraps one data-plane transport (``post_send``/``post_recv``, mstar_dist/transport/base.py) and records the
    size and the time of every transfer; everything else passes through. ``stats()["histograms"]`` is the snapshot
    list a rank puts in its ``Stats`` (the router gathers every transport's). Used on the rank's main thread only
    (like the transport itself)."""

    def __init__(self, inner: Any, name: str) -> None:
        self.inner = inner
        self.name = name
        self._bytes = {d: Buckets(BYTE_BOUNDS) for d in ("send", "recv")}
        self._seconds = {d: Buckets(SECOND_BOUNDS) for d in ("send", "recv")}

    def post_send(self, tensor, dst: int):
        transfer, location = self.inner.post_send(tensor, dst)
        return self._meter(transfer, "send", tensor.numel() * tensor.element_size()), location

    def post_recv(self, wire, src: int, device=None):
        from mstar_dist.transport.inline import str_to_dtype

        nbytes = math.prod(int(s) for s in wire.shape) * str_to_dtype(wire.dtype).itemsize
        return self._meter(self.inner.post_recv(wire, src, device=device), "recv", nbytes)

    def _meter(self, transfer: Any, direction: str, nbytes: int) -> _MeteredTransfer:
        self._bytes[direction].observe(nbytes)
        return _MeteredTransfer(transfer, self._seconds[direction])

    def stats(self) -> dict:
        out = dict(self.inner.stats())
        out["histograms"] = [
            *(b.snapshot(self.name, d, "bytes") for d, b in self._bytes.items()),
            *(b.snapshot(self.name, d, "seconds") for d, b in self._seconds.items()),
        ]
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _MeteredTransfer:
    """A transfer that records its time into ``seconds`` the first time ``done()`` is true."""

    def __init__(self, inner: Any, seconds: Buckets) -> None:
        self.inner, self._seconds = inner, seconds
        self._posted: float | None = time.monotonic()

    def done(self) -> bool:
        finished = self.inner.done()
        if finished and self._posted is not None:
            self._seconds.observe(time.monotonic() - self._posted)
            self._posted = None
        return finished

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
