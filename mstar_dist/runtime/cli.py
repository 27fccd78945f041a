"""The command line of ``python -m mstar_dist.serve CFG.yaml [flags]`` (the ``mstar-dist`` script; docs/architecture.md
§2): flags, the dry run, and the exit status of a rank.

Exit status: 0 after a clean shutdown (SIGTERM) or a dry run, 1 after a failure of a running rank (its log says
which, naming the rank, host and cause), 2 for a mistake in the config, the cluster spec or the command line (one
line on stderr, once per host, no traceback). The front end parses the same flags (``frontend.py``).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from mstar_dist.logs import configure_logging
from mstar_dist.transport import registry


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mstar-dist", description="Serve a composite model across torchrun ranks.")
    p.add_argument("config", help="deployment YAML (see launch/configs/)")
    p.add_argument("--host", default=None, help="HTTP bind address (overrides server.host; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (overrides server.port)")
    p.add_argument("--max-concurrent-requests", type=int, default=None, help="overrides limits.max_concurrent_requests")
    p.add_argument("--request-timeout", type=float, default=None, help="seconds; overrides limits.request_timeout_s")
    p.add_argument("--api-key", default=os.environ.get("MSTAR_API_KEY") or None,
                   help="every route but /health needs 'Authorization: Bearer KEY' (default: $MSTAR_API_KEY; "
                        "unset: no authentication)")
    p.add_argument("--max-body-bytes", type=int, default=None, help="overrides server.max_body_bytes (413 above)")
    p.add_argument("--http-processes", type=int, default=None,
                   help="overrides server.http_processes (processes parsing HTTP on the port; default 1)")
    p.add_argument("--allowed-media-domains", type=_domains, action="extend", default=None, metavar="HOST[,HOST...]",
                   help="hosts whose http(s) image URLs requests may name (exact names; repeat the flag or separate "
                        "them with commas; overrides media.allowed_domains). Default: image URLs are refused")
    p.add_argument("--intra-host-tensor-protocol", choices=registry.names(), default=None,
                   help="transport for tensors whose consumer is on the same host (overrides transport.intra_host)")
    p.add_argument("--inter-host-tensor-protocol", choices=registry.names(), default=None,
                   help="transport for tensors whose consumer is on another host (overrides transport.inter_host)")
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds every rank has to join, load and report READY (default 300)")
    p.add_argument("--log-level", default=os.environ.get("MSTAR_LOG_LEVEL", "INFO"),
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--log-format", default=os.environ.get("MSTAR_LOG_FORMAT", "text"), choices=["text", "json"],
                   help="text (default), or json: one JSON object a line (time, level, rank, host, logger, message)")
    p.add_argument("--progress", default=os.environ.get("MSTAR_PROGRESS", "auto"), choices=["auto", "on", "off"],
                   help="progress bars of weight preparation and loading on stderr: auto (default: only when stderr "
                        "is a terminal), on (also into a log file), off")
    p.add_argument("--log-stats", nargs="?", type=float, const=10.0, default=None, metavar="SECONDS",
                   help="rank 0 logs throughput, queue, per-rank live tensors and every data-plane edge (bytes, "
                        "count, p50/p99 transfer time) every SECONDS (default 10)")
    p.add_argument("--dry-run", action="store_true", help="validate the config and print the placement, then exit")
    return p.parse_args(argv)


def _domains(value: str) -> list[str]:
    """``--allowed-media-domains a.example,b.example`` -> the host names (checked with the config's rules later)."""
    return [host.strip().lower() for host in value.split(",") if host.strip()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # rank 0's front end parses the same flags
    rank = os.environ.get("RANK")
    # torchrun's RANK until the rank knows its logical one and relabels the lines
    configure_logging(args.log_level, rank=rank, host=socket.gethostname(), fmt=args.log_format,
                      progress=args.progress)
    try:
        return dry_run(args) if args.dry_run else serve_rank(args)
    except (ValueError, OSError) as exc:  # config / cluster / placement mistakes, port in use: no traceback
        # every rank finds the same mistake: say it once per host (local rank 0), not once per rank
        if os.environ.get("LOCAL_RANK", "0") == "0":
            where = f" (rank {rank})" if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
            print(f"mstar-dist: error{where}: {_message(exc)}", file=sys.stderr, flush=True)
        return 2


def dry_run(args: argparse.Namespace) -> int:
    """Validate the config and print the placement (no torchrun, no weights, no process group)."""
    from mstar_dist.runtime.deployment import load_deployment, torchrun_sizes

    print(load_deployment(args, *torchrun_sizes(os.environ)).describe())
    return 0


def serve_rank(args: argparse.Namespace) -> int:
    from mstar_dist.runtime.rank import main as rank_main

    return rank_main(args)


def _message(exc: BaseException) -> str:
    """One line: a missing file by its name, everything else as it says."""
    if isinstance(exc, FileNotFoundError) and exc.filename:
        return f"{exc.filename}: no such file (give the path of a deployment YAML, e.g. launch/configs/smollm2_pd.yaml)"
    return str(exc)
