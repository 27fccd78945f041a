"""Conductor-side metrics in Prometheus text format (docs/architecture.md §7: per-rank live tensors are the leak
canary; ``mstar_dist_shm_bytes_used`` / ``mstar_dist_mooncake_bytes_used`` the arenas' occupancy, 0 at idle;
``mstar_dist_edge_*`` the per-edge transfer statistics)."""

from __future__ import annotations

import bisect
import collections
from typing import Any


class Histogram:
    BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

    def __init__(self) -> None:
        self.counts = [0] * (len(self.BUCKETS) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.BUCKETS, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for bound, count in zip(self.BUCKETS, self.counts):
            cum += count
            out.append(f'{name}_bucket{{le="{bound}"}} {cum}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out.append(f"{name}_sum {self.total:.6f}")
        out.append(f"{name}_count {self.n}")
        return out


class Metrics:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.rank_stats: dict[int, Any] = {}
        self.dead_ranks: dict[int, str] = {}
        self.requests_received = 0
        self.finished: collections.Counter[str] = collections.Counter()
        self.tokens_generated = 0
        self.latency = Histogram()
        self.ttft = Histogram()

    def observe_done(self, reason: str, seconds: float, tokens: int) -> None:
        self.finished[reason] += 1
        if reason not in ("abort", "error"):
            self.latency.observe(seconds)

    def edges(self) -> list:
        """Every rank's incoming data-plane edges (``m.EdgeStat``), as last reported."""
        return [e for _, st in sorted(self.rank_stats.items()) for e in st.edges]

    def render(self, *, active: int, queued: int) -> str:
        lines = [
            "# TYPE mstar_dist_requests_received_total counter",
            f"mstar_dist_requests_received_total {self.requests_received}",
            "# TYPE mstar_dist_requests_finished_total counter",
        ]
        for reason in ("stop", "length", "abort", "error"):
            lines.append(f'mstar_dist_requests_finished_total{{reason="{reason}"}} {self.finished[reason]}')
        lines += [
            "# TYPE mstar_dist_requests_running gauge",
            f"mstar_dist_requests_running {active}",
            "# TYPE mstar_dist_requests_queued gauge",
            f"mstar_dist_requests_queued {queued}",
            "# TYPE mstar_dist_generated_tokens_total counter",
            f"mstar_dist_generated_tokens_total {self.tokens_generated}",
            "# TYPE mstar_dist_request_latency_seconds histogram",
            *self.latency.lines("mstar_dist_request_latency_seconds"),
            "# TYPE mstar_dist_time_to_first_token_seconds histogram",
            *self.ttft.lines("mstar_dist_time_to_first_token_seconds"),
        ]
        lines.append("# TYPE mstar_dist_rank_up gauge")
        for rank in range(self.world_size):
            lines.append(f'mstar_dist_rank_up{{rank="{rank}"}} {0 if rank in self.dead_ranks else 1}')
        gauges = [
            ("live_tensors", "gauge", "live_tensors"),
            ("live_tensor_bytes", "gauge", "live_bytes"),
            ("edge_bytes_sent_total", "counter", "edge_bytes_sent"),
            ("edge_bytes_received_total", "counter", "edge_bytes_received"),
            ("host_staging_copies_total", "counter", "host_staging_copies"),
        ]
        for name, kind, attr in gauges:
            lines.append(f"# TYPE mstar_dist_{name} {kind}")
            for rank in range(self.world_size):
                st = self.rank_stats.get(rank)
                value = getattr(st, attr) if st is not None else 0
                lines.append(f'mstar_dist_{name}{{rank="{rank}"}} {value}')
        for via in sorted({v for st in self.rank_stats.values() for v in st.arena_bytes_used}):
            lines.append(f"# TYPE mstar_dist_{via}_bytes_used gauge")
            for rank in sorted(self.rank_stats):
                used = self.rank_stats[rank].arena_bytes_used
                if via in used:
                    lines.append(f'mstar_dist_{via}_bytes_used{{rank="{rank}"}} {used[via]}')
        edges = self.edges()
        for name, kind in (("edge_transfers_total", "counter"), ("edge_transfer_bytes_total", "counter"),
                           ("edge_transfer_seconds", "summary")):
            lines.append(f"# TYPE mstar_dist_{name} {kind}")
        for e in edges:
            labels = (f'walk="{e.walk}",src="{e.src}",dst="{e.dst}",signal="{e.signal}",transport="{e.via}"')
            lines.append(f"mstar_dist_edge_transfers_total{{{labels}}} {e.count}")
            lines.append(f"mstar_dist_edge_transfer_bytes_total{{{labels}}} {e.nbytes}")
            lines.append(f'mstar_dist_edge_transfer_seconds{{{labels},quantile="0.5"}} {e.p50_s:.6f}')
            lines.append(f'mstar_dist_edge_transfer_seconds{{{labels},quantile="0.99"}} {e.p99_s:.6f}')
        names = sorted({k for st in self.rank_stats.values() for k in st.engine})
        for key in names:
            kind = "counter" if key.endswith("_total") else "gauge"
            lines.append(f"# TYPE mstar_dist_engine_{key} {kind}")
            for rank in sorted(self.rank_stats):
                lines.append(f'mstar_dist_engine_{key}{{rank="{rank}"}} {self.rank_stats[rank].engine.get(key, 0)}')
        return "\n".join(lines) + "\n"
