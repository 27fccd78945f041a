"""The command line of ``python -m mstar_dist.serve CFG.yaml [flags]`` (the ``mstar-dist`` script; docs/architecture.md
§2): flags, the dry run, and the exit status of a rank.

Exit status: 0 after a clean shutdown (SIGTERM, SIGINT) or a dry run, 1 after a failure of a running rank (its log
says which, naming the rank, host and cause), 2 for a mistake in the config, the cluster spec or the command line
(one line on stderr, once per host, no traceback; under torchrun also on the launch store's failure board, where the
ranks of every other host read it and stop at once naming it). The front end parses the same flags
(``frontend.py``). Under torchrun a rank other than 0 runs as the supervisor of its own rank process
(``supervisor.py``), which restarts it in place when it dies (``restart:``).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import TYPE_CHECKING

from mstar_dist.config.deployment import load_config
from mstar_dist.logs import configure_logging
from mstar_dist.transport import registry

if TYPE_CHECKING:
    from mstar_dist.runtime.supervisor import Supervisor


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
    p.add_argument("--max-rank-restarts", type=int, default=None, metavar="N",
                   help="overrides restart.max_restarts: restarts of one rank (other than 0) within restart.window_s "
                        "before it stays down (0: never restart). Not torchrun's --max-restarts, which restarts every "
                        "worker of a host once the deployment exited")
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
    p.add_argument("--check-port", action="store_true",
                   help="with --dry-run: also bind the HTTP address once, as rank 0 will, so a port in use is one "
                        "line before torchrun starts any rank (launch/serve.sh does this)")
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
        if args.dry_run:
            return dry_run(args)
        supervisor = supervisor_for(args, os.environ)
        return supervisor.run() if supervisor is not None else serve_rank(args)
    except (ValueError, OSError) as exc:  # config / cluster / placement mistakes, port in use: no traceback
        # every rank finds the same mistake: say it once per host (local rank 0), not once per rank
        if os.environ.get("LOCAL_RANK", "0") == "0":
            where = f" (rank {rank})" if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
            print(f"mstar-dist: error{where}: {_message(exc)}", file=sys.stderr, flush=True)
        if rank is not None and not args.dry_run:  # the other hosts' ranks wait in the startup: name it to them
            from mstar_dist.distributed.guard import publish_failure

            who, host = _who(args, os.environ)
            publish_failure(None, who if who is not None else int(rank), host, _message(exc))
        return 2


def dry_run(args: argparse.Namespace) -> int:
    """Validate the config and print the placement (no torchrun, no weights, no process group)."""
    from mstar_dist.runtime.deployment import load_deployment, torchrun_sizes

    dep = load_deployment(args, *torchrun_sizes(os.environ))
    print(dep.describe())
    if args.check_port:  # OSError naming the address: one line, exit 2 (main)
        from mstar_dist.server.http_server import reserve_port

        reserve_port(dep.config.server.host, dep.config.server.port).close()
    return 0


def serve_rank(args: argparse.Namespace) -> int:
    from mstar_dist.runtime.rank import main as rank_main

    return rank_main(args)


def supervisor_for(args: argparse.Namespace, env) -> Supervisor | None:
    """The supervisor this torchrun worker runs as (rank other than 0, under torchrun's agent store, not the
    supervised child itself), or None: serve the rank here. Needs only the YAML (no torch, no model)."""
    from mstar_dist.distributed.store import StoreAddress
    from mstar_dist.runtime.supervisor import CHILD_ENV, Supervisor

    if env.get(CHILD_ENV) or "RANK" not in env or not StoreAddress(env).usable:
        return None
    who, host = _who(args, env)
    if not who:  # rank 0 (the front end lives beside it), or a config the rank itself will report
        return None
    config = load_config(args.config).with_overrides(max_restarts=args.max_rank_restarts)
    configure_logging(args.log_level, rank=who, host=host, fmt=args.log_format, progress=args.progress)
    return Supervisor(list(args.argv), rank=who, host=host, policy=config.restart)


def _who(args: argparse.Namespace, env) -> tuple[int | None, str]:
    """(logical global rank, host name) of this process from the cluster spec, as far as the config allows
    (None and this machine's name when it does not)."""
    try:
        from mstar_dist.config.cluster import identify, machine_names

        config = load_config(args.config)
        world = int(env.get("WORLD_SIZE", "0") or 0)
        local = int(env["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in env else None
        info = identify(config.resolve_cluster(world, local), env, machine_names())
        return info.global_rank, info.host_name
    except Exception:  # noqa: BLE001 - the caller reports the config's own mistake
        return None, socket.gethostname()


def _message(exc: BaseException) -> str:
    """One line: a missing file by its name, everything else as it says."""
    if isinstance(exc, FileNotFoundError) and exc.filename:
        return f"{exc.filename}: no such file (give the path of a deployment YAML, e.g. launch/configs/smollm2_pd.yaml)"
    return str(exc)
