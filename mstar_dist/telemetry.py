"""What every rank measures about its own process for ``/metrics``: RSS, CPU seconds and open file descriptors.
Ranks send them in their ``Stats`` message; the conductor exports them per rank
(``mstar_dist/conductor/metrics.py``). The data plane's transfer sizes and times are the router's
(``mstar_dist/transport/metering.py``).
"""

from __future__ import annotations

from prometheus_client import ProcessCollector

_process = ProcessCollector(registry=None)


def process_sample() -> dict[str, float]:
    """This process's ``rss_bytes``, ``cpu_seconds`` (user + system) and ``open_fds``, read from /proc by
    prometheus_client (zeros where /proc is missing). Cheap enough for every ``Stats`` a rank sends."""
    values = {s.name: s.value for family in _process.collect() for s in family.samples}
    return {"rss_bytes": values.get("process_resident_memory_bytes", 0.0),
            "cpu_seconds": values.get("process_cpu_seconds_total", 0.0),
            "open_fds": values.get("process_open_fds", 0.0)}
