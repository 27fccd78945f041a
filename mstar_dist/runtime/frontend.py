"""The front end (conductor + HTTP server) in its own process on rank 0's host (docs/architecture.md §2).

Detokenisation, stop strings, admission and HTTP framing run here, not under the GIL of the process that feeds
rank 0's GPU. Rank 0 starts it first thing (so its imports overlap the distributed setup) and owns its life:

1. rank 0 spawns ``python -m mstar_dist.runtime.frontend <the rank's own serve flags>`` with the reserved HTTP
   socket and a pipe inherited (``children.HTTP_FD_ENV``, ``children.OUT_FD_ENV``);
2. the front end binds the ``conductor`` control socket and writes ``{"endpoint": ...}`` on the pipe; rank 0
   publishes it in the torchrun store, where every rank looks it up;
3. once rank 0 has loaded its components (the weights are on this host then), it writes one JSON line on the
   front end's stdin: the launch's secret and every rank's control endpoint (``failed`` instead when rank 0
   could not load: the front end tells every rank to stop and exits);
4. the front end loads the model's front half (tokenizer), waits for every READY, announces the placement,
   starts the conductor thread and HTTP (or, with ``server.http_processes`` > 1, its intakes and the acceptor
   that passes them the connections), and serves until SIGTERM or until its stdin closes (rank 0 is gone: then
   every rank is told to stop with an error naming rank 0); on the way out it fails in-flight requests with 503,
   tells every rank to shut down and marks the launch over in its store (a supervisor whose rank has no restart
   left waits for that).

While serving, a watcher thread reads the supervisors' death records from the launch's store
(``runtime/supervisor.py``) and hands each to the conductor (``RankDied``): a killed rank's requests fail at once,
naming the cause. When the conductor finds a walk that can never be served again it fails, and the front end stops
the deployment, non-zero (docs/architecture.md §10).

Rank 0 stops with an error when the front end exits on its own; the front end exits when rank 0 does. Nothing
here is pickled: the handshake is JSON over a pipe and stdin.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
import threading
from typing import Any

import torch

from mstar_dist.conductor.backend import ConductorBackend
from mstar_dist.conductor.commands import RankDied
from mstar_dist.conductor.conductor import Conductor
from mstar_dist.control import messages as m
from mstar_dist.control.channel import ControlChannel
from mstar_dist.control.envelope import CONDUCTOR, rank_name
from mstar_dist.distributed.store import key, launch_store, read_json
from mstar_dist.logs import announce
from mstar_dist.random_weights import announcement
from mstar_dist.runtime.children import (
    HTTP_FD_ENV, ParentGone, ParentPipe, quick_hand_offs, start_watching_parent, stop_all, where_from_env,
)
from mstar_dist.runtime.cli import parse_args
from mstar_dist.runtime.deployment import Deployment, load_deployment, served, torchrun_sizes
from mstar_dist.runtime.intake import IntakeProcess
from mstar_dist.runtime.lifecycle import SHUTDOWN_FLUSH_S, Lifecycle
from mstar_dist.runtime.registry import load_prompt_encoder
from mstar_dist.server.app import build_app
from mstar_dist.server.handoff import Acceptor
from mstar_dist.server.http_server import HttpServer

log = logging.getLogger(__name__)

CONDUCTOR_STOP_S = 2.0
"""How long the conductor thread gets to fail in-flight requests with 503 on the way out (it needs one turn of its
loop: the whole stop of a deployment stays within 5 s)."""
DEATH_POLL_S = 0.2
"""How often the front end looks for new death records in the launch's store."""
INTAKE_WAIT_S = 60.0
"""How long an intake may take to report its endpoint, and then that it listens."""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    host_name, addr = where_from_env()
    lc = Lifecycle("frontend", log_level=args.log_level, rank=0, host=host_name, log_format=args.log_format,
                   progress="off")
    torch.set_num_threads(1)
    quick_hand_offs()  # the HTTP and conductor threads hand each request over
    front = Frontend(args, lc, host_name, addr)
    lc.catch_signals()
    return lc.run(front.serve, front.failed, front.teardown)


class Frontend:
    """The front end's parts, built step by step (module docstring), and their teardown. Parts not built yet are
    None."""

    def __init__(self, args: argparse.Namespace, lc: Lifecycle, host_name: str, addr: str) -> None:
        self.args, self.lc, self.host_name, self.addr = args, lc, host_name, addr
        self.parent = ParentPipe()
        self.http_sock: socket.socket | None = socket.socket(fileno=int(os.environ[HTTP_FD_ENV]))
        """Rank 0's reserved port, until the HTTP server or the acceptor owns it."""
        self.world_size = 0
        self.dep: Deployment | None = None
        self.channel: ControlChannel | None = None
        self.intakes: list[IntakeProcess] = []
        self.conductor: Conductor | None = None
        self.http: HttpServer | None = None
        self.acceptor: Acceptor | None = None
        self.store: Any | None = None
        """The front end's client of the launch's store (None outside torchrun's agent store)."""
        self.watcher: threading.Thread | None = None
        """Hands the conductor the supervisors' death records (``watch_deaths``)."""
        self.rank0_gone = threading.Event()
        self.reason = "rank 0 is stopping"
        """What every rank is told on the way out."""

    def serve(self) -> int:
        handover = self.prepare()
        if handover.get("failed"):
            broadcast_shutdown(self.dep, self.channel, self.world_size, handover["failed"])
            return 1
        start_watching_parent(self.lc.stop, "rank 0", self.rank0_gone)
        for intake in self.intakes:
            self.channel.connect(intake.name, intake.read(INTAKE_WAIT_S, "its control endpoint")["endpoint"])
        self.conductor = start_conductor(self.dep, self.channel, self.args.startup_timeout,
                                         log_stats_s=self.args.log_stats,
                                         intakes=tuple(intake.name for intake in self.intakes))
        if self.store is not None:
            self.watcher = threading.Thread(target=watch_deaths, args=(self.store, self.conductor, self.lc.stop),
                                            name="deaths", daemon=True)
            self.watcher.start()
        if self.intakes:  # the acceptor owns the port from here
            self.acceptor = start_intakes(self.dep, self.intakes, self.http_sock,
                                          conductor_endpoint=self.channel.endpoint, api_key=self.args.api_key)
        else:
            self.http = start_http(self.dep, self.conductor, api_key=self.args.api_key, sock=self.http_sock)
        self.http_sock = None
        # tokenizer, model family, app and what uvicorn imported as it started leave the collector (heap.py)
        self.lc.ready()
        self.lc.wait(self.check)
        if self.rank0_gone.is_set():
            raise RuntimeError(f"rank 0 (the conductor's rank) on host {self.host_name} is gone")
        if self.lc.stopped_by:
            self.reason = f"the deployment was stopped ({self.lc.stopped_by})"
        return 0

    def prepare(self) -> dict[str, Any]:
        """Steps 2-3: the deployment, the ``conductor`` socket (its endpoint to rank 0), the intakes (spawned now:
        their imports overlap the ranks' loading), then rank 0's handover, connected. Returns the handover."""
        world_size, local_ws = torchrun_sizes(os.environ)
        self.world_size = world_size or 1
        self.dep = load_deployment(self.args, self.world_size, local_ws)
        host = next((h for h in self.dep.cluster.hosts if h.name == self.host_name), None)
        self.channel = ControlChannel(CONDUCTOR, self.addr, advertise_addr=host and host.advertise_addr,
                                      port_range=host and host.control_ports)
        self.parent.report({"endpoint": self.channel.endpoint})
        server = self.dep.config.server
        if server.http_processes > 1:
            self.intakes = [IntakeProcess(k, host_name=self.host_name, addr=self.addr, log_level=self.args.log_level,
                                          log_format=self.args.log_format) for k in range(server.http_processes)]
        handover = self.parent.read(self.args.startup_timeout + 30)
        if handover is None:
            raise RuntimeError(f"rank 0 did not hand over the ranks' endpoints within {self.args.startup_timeout:g} s "
                               f"(--startup-timeout)")
        self.dep = dataclasses.replace(self.dep, token=handover["token"])
        try:  # rank 0 joined the launch: its store is up
            self.store = launch_store(timeout_s=10.0)
        except ConnectionError as exc:
            log.warning("no client of the launch's store: rank deaths are found by silence only (%s)", exc)
        for name, endpoint in sorted(handover["endpoints"].items()):
            self.channel.connect(name, endpoint)
        return handover

    def check(self) -> None:
        if not self.conductor.alive:
            raise RuntimeError("the conductor thread died")
        if self.conductor.failed:
            raise RuntimeError(self.conductor.failed)
        for intake in self.intakes:
            if not intake.alive():
                raise RuntimeError(intake.describe_exit())

    def failed(self, exc: Exception) -> None:
        if isinstance(exc, ParentGone):  # rank 0 went while starting: its own exit says why
            log.info("the front end stops: rank 0 is gone")
            return
        self.reason = str(exc)
        log.error("the front end failed: %s", exc,
                  exc_info=not isinstance(exc, (TimeoutError, ValueError)) and not self.rank0_gone.is_set()
                  and not (self.conductor is not None and self.conductor.failed))
        if self.conductor is None and self.channel is not None and self.dep is not None and self.dep.token:
            broadcast_shutdown(self.dep, self.channel, self.world_size, f"the front end on rank 0's host failed: {exc}")

    def teardown(self, rc: int) -> bool:
        """No new connections; in-flight requests get their 503 while HTTP still delivers them; the intakes stop
        after the conductor's last word has reached them; every rank is told to stop; the channel closes once those
        messages have left."""
        if self.acceptor is not None:
            self.acceptor.stop()
        if self.conductor is not None:
            # only after the join may this thread use the conductor's socket (ZMQ sockets are single-threaded)
            self.conductor.stop(timeout_s=CONDUCTOR_STOP_S)
        stop_all(self.intakes)
        if self.conductor is not None:
            broadcast_shutdown(self.dep, self.channel, self.world_size, self.reason, error=rc != 0)
        if self.store is not None:
            if self.watcher is not None:  # a thread left inside a store call would abort the exit
                self.lc.stop.set()
                self.watcher.join(1.0)
            try:  # a supervisor whose rank stays down waits for this
                self.store.set(key("over"), self.reason)
            except Exception:  # noqa: BLE001 - the store's host is this one: it is going anyway
                pass
        if self.http is not None:
            self.http.stop()
        if self.http_sock is not None:
            self.http_sock.close()
        if self.channel is not None:
            self.channel.close(flush_s=SHUTDOWN_FLUSH_S)
        return True


def broadcast_shutdown(dep: Deployment, channel: ControlChannel, world_size: int, reason: str,
                       error: bool = True) -> None:
    """``Shutdown`` to every rank (a rank that is gone cannot be told); they leave the channel when it closes
    with a flush."""
    for peer in range(world_size):
        try:
            channel.send(rank_name(peer), m.encode(dep.token, CONDUCTOR, m.Shutdown(reason=reason, error=error)))
        except Exception:
            pass


def start_conductor(dep: Deployment, channel: ControlChannel, timeout_s: float, log_stats_s: float | None,
                    intakes: tuple[str, ...] = ()) -> Conductor:
    """Load the model's front half, wait for every READY, announce the placement, then start the conductor thread
    (docs/architecture.md §2 step 6)."""
    cfg = dep.config
    dep.model.load_frontend()
    conductor = Conductor(
        model=dep.model, placement=dep.placement, channel=channel, token=dep.token,
        world_size=dep.cluster.world_size, max_concurrent=cfg.limits.max_concurrent_requests,
        max_queued=cfg.limits.max_queued_requests,
        request_timeout_s=cfg.limits.request_timeout_s, rank_hosts=dep.cluster.rank_hosts(),
        rank_timeout_s=cfg.limits.rank_timeout_s, log_stats_s=log_stats_s, intakes=intakes,
        p2p_pairs=dep.p2p_pairs, restarts=cfg.restart.max_restarts > 0, retry_in_flight=cfg.restart.retry_in_flight,
        rejoin_timeout_s=timeout_s + cfg.limits.rank_timeout_s + 60.0,
    )
    conductor.wait_ready(timeout_s)
    announce(dep.describe())
    if line := announcement(cfg.model, dep.model.weights_dirs()):  # every rank has prepared its weights by now
        log.warning(line)
    conductor.start()
    return conductor


def watch_deaths(store: Any, conductor: Conductor, stop: threading.Event) -> None:
    """Hand the conductor each new death record of the launch's store (``supervisor.py`` writes them) until
    ``stop``; a store that stops answering ends the watch (rank 0's own host holds it: we are going too)."""
    try:
        seen = store.add(key("deaths"), 0)  # records of an earlier life of this launch are not news
        while not stop.wait(DEATH_POLL_S):
            count = store.add(key("deaths"), 0)
            while seen < count:
                record = read_json(store, "death", n=seen + 1)
                if record is None:
                    break  # counted, not written yet: next time
                conductor.command(RankDied(rank=record["rank"], host=record["host"], incarnation=record["incarnation"],
                                           cause=record["cause"], restarting=record["restarting"]))
                seen += 1
    except Exception as exc:  # noqa: BLE001 - the watch is an accelerator: silence still finds a dead rank
        if not stop.is_set():
            log.warning("watching the launch's store for rank deaths stopped: %s", exc)


def start_http(dep: Deployment, conductor: Conductor, *, api_key: str | None, sock: socket.socket) -> HttpServer:
    """Bind HTTP only now that every rank serves (docs/architecture.md §2 step 6)."""
    cfg = dep.config
    backend = ConductorBackend(conductor, tokenizer=load_prompt_encoder(dep.model.prompt_encoder()), **served(dep))
    http = HttpServer(build_app(backend, api_key=api_key, max_body_bytes=cfg.server.max_body_bytes, media=cfg.media,
                                tool_call_parser=cfg.server.tool_call_parser))
    http.start(cfg.server.host, cfg.server.port, timeout_s=30, sock=sock)
    announce(f"mstar_dist: serving {cfg.model} on http://{cfg.server.host}:{cfg.server.port}")
    return http


def start_intakes(dep: Deployment, intakes: list[IntakeProcess], sock: socket.socket, *, conductor_endpoint: str,
                  api_key: str | None) -> Acceptor:
    """Hand every intake what it serves, wait until each serves, then accept on ``sock`` (the reserved port) and pass
    the connections to them (docs/architecture.md §2): the running ``Acceptor``."""
    server = dep.config.server
    port = sock.getsockname()[1]
    for intake in intakes:
        intake.write({"token": dep.token, "conductor": conductor_endpoint, "host": server.host, "port": port,
                      "api_key": api_key, "max_body_bytes": server.max_body_bytes, "media": dep.config.media.to_dict(),
                      "tool_call_parser": server.tool_call_parser,
                      "prompt_encoder": dep.model.prompt_encoder(), **served(dep)})
    for intake in intakes:
        intake.read(INTAKE_WAIT_S, "that it listens on the port")
    acceptor = Acceptor(sock, [intake.link for intake in intakes])
    acceptor.start()
    announce(f"mstar_dist: serving {dep.config.model} on http://{server.host}:{port} "
             f"({len(intakes)} HTTP intake processes)")
    return acceptor


if __name__ == "__main__":
    sys.exit(main())
