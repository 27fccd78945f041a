"""One torchrun rank, from its identity to its exit (docs/architecture.md §2). The steps and who they wait for:

1. the deployment (pure; identical on every rank: ``deployment.py``);
2. identify this process in the cluster spec against torchrun's variables (ValueError on any mismatch); the
   process group is joined with this *logical* global rank (under c10d rendezvous torchrun's RANK may differ; the
   agent's store accepts any permutation), so every rank number in the runtime is a logical one; rank 0 spawns its
   front end now (``frontend.py``), so that its imports overlap the distributed setup;
3. ``init_process_group`` (gloo on CPU, ``cuda:nccl,cpu:gloo`` on GPUs), the launch's secret, the walks check, the
   TP groups, then one pair group per directed edge pair, created on every rank in one order, and warmed — a
   collective step: blocks until all ranks join or ``--startup-timeout`` passes;
4. bind this rank's control socket, publish its endpoint in the torchrun store, read every peer's (bounded wait);
5. load only this rank's components (weights prepared once per host first) and report READY or LOAD_FAILED;
6. run the worker loop until SIGTERM or the conductor's ``Shutdown``.
A failure anywhere exits non-zero on every rank (the front end broadcasts ``Shutdown``) with a message naming the
rank, host and cause; SIGTERM stops cleanly with exit 0. Teardown is unconditional and bounded.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from mstar_dist.config.cluster import HostSpec, RankInfo, device_for, identify
from mstar_dist.config.deployment import DeploymentConfig
from mstar_dist.control import messages as m
from mstar_dist.control.channel import ControlChannel, default_store, lookup_endpoint, publish_endpoint, share_secret
from mstar_dist.control.envelope import CONDUCTOR, rank_name
from mstar_dist.distributed.groups import create_pair_groups, create_tp_groups, warm_pairs
from mstar_dist.distributed.init import backend_for_device, init_distributed, shutdown_distributed
from mstar_dist.distributed.tp import TPGroup
from mstar_dist.engine.component import Component
from mstar_dist.runtime.children import FrontendProcess
from mstar_dist.runtime.deployment import Deployment, check_same_walks, load_deployment, torchrun_sizes
from mstar_dist.runtime.lifecycle import SHUTDOWN_FLUSH_S, Lifecycle
from mstar_dist.topology.placement import Placement
from mstar_dist.transport.plane import TransportSetup, build_transports
from mstar_dist.transport.router import Router
from mstar_dist.transport.store import TensorStore
from mstar_dist.worker.tp import TPRole
from mstar_dist.worker.worker import Worker

log = logging.getLogger("mstar_dist.boot")  # the startup logger's name, as operators' log filters know it

TEARDOWN_TIMEOUT_S = 15.0
"""Bound on closing the components and destroying the process groups at exit (under torchrun's 30 s between
SIGTERM and SIGKILL)."""


def main(args: argparse.Namespace) -> int:
    """Serve as the rank torchrun started this process as; the exit status (0 after SIGTERM or a clean
    ``Shutdown``, 1 after any failure). ValueError / OSError before the rank is built: a mistake in the config, the
    cluster spec or the port, which the CLI reports in one line."""
    world_size, local_ws = torchrun_sizes(os.environ)
    dep = load_deployment(args, world_size, local_ws)
    info = identify(dep.cluster, os.environ, _hostnames())
    lc = Lifecycle(rank_name(info.global_rank), log_level=logging.getLogger().level, rank=info.global_rank,
                   host=info.host_name, log_format=args.log_format)
    apply_host_env(dep.cluster.hosts[info.node_rank])
    rank = Rank(args, dep, info, take_device(dep, info), lc)
    lc.catch_signals()
    return lc.run(rank.serve, rank.failed, rank.teardown)


class LoadError(RuntimeError):
    """This rank's components failed to load; the message names the rank, its host and the cause."""


class Rank:
    """One rank's parts, built in the steps of the module docstring, and their teardown. Parts not built yet are
    None (``components`` empty)."""

    def __init__(self, args: argparse.Namespace, dep: Deployment, info: RankInfo, device: str,
                 lc: Lifecycle) -> None:
        """Rank 0 spawns its front end here, first thing (step 2)."""
        self.args, self.dep, self.info, self.device, self.lc = args, dep, info, device, lc
        self.rank = info.global_rank
        self.world_size = dep.cluster.world_size
        self.where = f"rank {self.rank} on host {info.host_name}"
        self.timeout_s: float = args.startup_timeout
        self.frontend = spawn_frontend(args, dep, info) if dep.placement.is_conductor(self.rank) else None
        self.channel: ControlChannel | None = None
        self.data_plane: Router | None = None
        self.components: dict[str, Component] = {}
        self.endpoints: dict[str, str] = {}
        """Every rank's control endpoint by name (what rank 0 hands its front end)."""
        self.worker: Worker | None = None
        self.flush_s = 0.0
        """How long the channel's last messages may take to leave at close (set once this rank said it leaves)."""

    def serve(self) -> int:
        store, tp_groups = self.join()
        self.data_plane = build_data_plane(self.dep, self.info, self.device, self.timeout_s)
        self.connect(store)
        self.load(store, tp_groups)
        self.worker = self.make_worker()
        self.lc.ready()  # the model, torch and the graphs leave the collector's generations (heap.py)
        self.worker.run(should_stop=self.should_stop)
        self.check_exit()
        return 0

    def join(self) -> tuple[Any, dict[tuple[int, ...], TPGroup]]:
        """Step 3 up to the pairs: the process group, the launch's secret, the walks check and the TP groups
        (created before the pairs, in one order on every rank). Returns the torchrun store and this rank's TP
        groups."""
        init_distributed(global_rank=self.rank, world_size=self.world_size, device=self.device,
                         timeout_s=self.timeout_s)
        store = default_store()
        secret = share_secret(store, publisher=self.dep.placement.is_conductor(self.rank), timeout_s=self.timeout_s)
        self.dep = dataclasses.replace(self.dep, token=secret)
        check_same_walks(store, self.rank, self.world_size, self.dep.walks_digest(), self.timeout_s)
        tp_groups = create_tp_groups(self.dep.placement.tp_groups, global_rank=self.rank,
                                     backend=backend_for_device(self.device), timeout_s=self.timeout_s)
        return store, tp_groups

    def connect(self, store: Any) -> None:
        """Step 4: this rank's control socket, published; the conductor's (rank 0 publishes its front end's) and
        every rank's, looked up and connected."""
        me = rank_name(self.rank)
        self.channel = ControlChannel(me, self.info.addr)
        publish_endpoint(store, me, self.channel.endpoint)
        if self.frontend is not None:
            publish_endpoint(store, CONDUCTOR, self.frontend.endpoint(self.timeout_s))
        self.channel.connect(CONDUCTOR, lookup_endpoint(store, CONDUCTOR, self.timeout_s))
        for peer in map(rank_name, range(self.world_size)):
            self.endpoints[peer] = lookup_endpoint(store, peer, self.timeout_s)
            self.channel.connect(peer, self.endpoints[peer])

    def load(self, store: Any, tp_groups: dict[tuple[int, ...], TPGroup]) -> None:
        """Step 5: this rank's components, then READY to the conductor (LOAD_FAILED and a ``LoadError`` when they
        fail). Rank 0 hands its front end the secret and the endpoints now: the weights are on this host."""
        t0 = time.monotonic()
        try:
            self.components = load_components(self.dep, self.info, self.device, store, self.timeout_s, tp_groups)
        except Exception as exc:
            cause = f"{type(exc).__name__}: {exc}"
            if self.frontend is not None:
                self.frontend.configure(self.dep.token, self.endpoints, failed=f"{self.where} failed to load: {cause}")
            self.send(m.LoadFailed(rank=self.rank, host=self.info.host_name, error=cause))
            # said here too: torchrun ends the other ranks (and rank 0's front end with them) as soon as this
            # process exits, sometimes before the conductor has logged the LoadFailed it was sent
            raise LoadError(f"{self.where} failed to load: {cause}") from exc
        if self.frontend is not None:
            self.frontend.configure(self.dep.token, self.endpoints)
        self.send(m.Ready(rank=self.rank, host=self.info.host_name, load_seconds=time.monotonic() - t0))

    def make_worker(self) -> Worker:
        dep, device = self.dep, torch.device(self.device)
        transport = dep.config.transport
        return Worker(
            global_rank=self.rank, graphs=dep.model.graphs(), components=self.components, channel=self.channel,
            transport=self.data_plane, store=TensorStore(), token=dep.token, device=device,
            inline_max_bytes=transport.inline_max_bytes,
            backpressure_timeout_s=transport.backpressure_timeout_s,
            spin_s=transport.spin_s(device.type),
            streaming_edges=dep.model.streaming_edges(),
            conductor_timeout_s=dep.config.limits.rank_timeout_s,
            tp_roles=tp_roles_for(dep.placement, self.rank),
        )

    def should_stop(self) -> bool:
        return self.lc.stop.is_set() or self.frontend_gone()

    def frontend_gone(self) -> bool:
        return self.frontend is not None and not self.frontend.alive()

    def check_exit(self) -> None:
        """Why the worker loop ended: the front end died (an error), a signal (a rank without a front end tells the
        conductor it leaves), or the conductor's ``Shutdown`` (an error when it says the deployment failed)."""
        stopped, worker = self.lc.stop.is_set(), self.worker
        if self.frontend_gone() and not stopped and not worker.stopping:
            raise RuntimeError(self.frontend.describe_exit())
        if stopped and not worker.stopping and self.frontend is None:
            self.tell_leaving()
        if worker.stopping and worker.failed_reason:
            raise RuntimeError(worker.failed_reason)

    def tell_leaving(self) -> None:
        """A rank stopped by a signal tells the conductor at once (``Leaving``), so its requests fail fast; the
        message leaves before the channel closes (``flush_s``)."""
        try:
            self.send(m.Leaving(rank=self.rank, host=self.info.host_name, reason="stopped by a signal (SIGTERM)"))
            self.flush_s = SHUTDOWN_FLUSH_S
        except Exception:  # the conductor is gone too: nobody to tell
            pass

    def send(self, body: m.Message) -> None:
        self.channel.send(CONDUCTOR, m.encode(self.dep.token, rank_name(self.rank), body))

    def failed(self, exc: Exception) -> None:
        if isinstance(exc, LoadError):
            log.error("%s\n%s", exc, traceback.format_exc())
        else:
            log.error("%s failed: %s\n%s", self.where, exc, traceback.format_exc())

    def teardown(self, rc: int) -> bool:
        """Front end (rank 0: it fails in-flight requests with 503 while HTTP still delivers them and tells every
        rank to stop), control channel, data plane (unlinks the shm segment, drops registrations, stops gloo waiter
        threads), then the components and the process groups, bounded. True when it all finished in time."""
        if self.frontend is not None:
            self.frontend.stop()
        if self.channel is not None:
            self.channel.close(flush_s=self.flush_s)
        if self.data_plane is not None:
            self.data_plane.close()
        self.worker = None  # the worker holds the components too: nothing may keep their CUDA graphs alive
        finished = teardown(self.components, shutdown_distributed, TEARDOWN_TIMEOUT_S)
        log.info("%s exits with status %d", self.where, rc)
        return finished


def spawn_frontend(args: argparse.Namespace, dep: Deployment, info: RankInfo) -> FrontendProcess:
    """Rank 0: reserve the HTTP port (a clash is an error now, not after every rank loaded) and start the front end
    with this rank's own flags."""
    from mstar_dist.server.http_server import reserve_port

    http_sock = reserve_port(dep.config.server.host, dep.config.server.port)
    return FrontendProcess(getattr(args, "argv", sys.argv[1:]), host_name=info.host_name, addr=info.addr,
                           http_sock=http_sock)


def take_device(dep: Deployment, info: RankInfo) -> str:
    """This rank's device, made current (CUDA), or its share of the host's CPU threads."""
    device = device_for(info, torch.cuda.is_available())
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    else:
        threads = cpu_threads_for(dep.config, info.global_rank, len(dep.cluster.ranks_on_host(info.node_rank)),
                                  os.cpu_count() or 1)
        torch.set_num_threads(threads)
        log.info("rank %d uses %d CPU threads", info.global_rank, threads)
    return device


def _hostnames() -> set[str]:
    names = {socket.gethostname(), socket.getfqdn()}
    try:
        names.update(info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None))
    except OSError:
        pass
    return names


def cpu_threads_for(config: DeploymentConfig, global_rank: int, ranks_on_host: int, cores: int) -> int:
    """Intra-op threads of a CPU rank: the largest ``cpu_threads`` of its node groups, else an even share."""
    asked = [g.cpu_threads for g in config.node_groups if global_rank in g.ranks and g.cpu_threads is not None]
    return max(asked) if asked else max(1, cores // max(1, ranks_on_host))


def apply_host_env(host: HostSpec) -> None:
    """Before this rank initialises anything: the cluster spec's ``env`` of its host (e.g. GLOO_SOCKET_IFNAME,
    NCCL_SOCKET_IFNAME), and its ``transfer_device`` as the NIC NCCL uses (NCCL_IB_HCA) unless the env names one."""
    for key, value in host.env.items():
        os.environ[key] = value
    if host.transfer_device:
        os.environ.setdefault("NCCL_IB_HCA", host.transfer_device)
    if host.env or host.transfer_device:
        log.info("host %s: environment %s, transfer device %s", host.name, dict(host.env), host.transfer_device)


def tp_roles_for(placement: Placement, rank: int) -> dict[str, TPRole]:
    """Node -> this rank's role in the node's TP replica, for the nodes it holds with tp_size > 1."""
    roles = {}
    for node, walks in placement.components_on(rank).items():
        for rep_ in placement.replicas(next(iter(sorted(walks))), node):
            if rank in rep_.ranks and len(rep_.ranks) > 1:
                roles[node] = TPRole(node, rep_.ranks, rank)
    return roles


def load_components(dep: Deployment, info: RankInfo, device: str, store: Any, timeout_s: float,
                    tp_groups: dict[tuple[int, ...], TPGroup] | None = None) -> dict[str, Component]:
    """Prepare weights once per host (local rank 0; the others wait for its word), then build this rank's
    components; a node of a TP replica gets the replica's group and builds only this rank's shard."""
    key = f"mstar_dist/weights/{info.node_rank}"
    if info.local_rank == 0:
        try:
            dep.model.prepare_weights()
            store.set(key, "ok")
        except Exception as exc:
            store.set(key, f"error: {exc}")
            raise
    else:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
        status = store.get(key).decode()
        if status != "ok":
            raise RuntimeError(f"weights preparation on host {info.host_name} failed: {status}")
    components = {}
    roles = tp_roles_for(dep.placement, info.global_rank)
    for node, walks in sorted(dep.placement.components_on(info.global_rank).items()):
        t0 = time.monotonic()
        engine = dep.config.engine_for(info.global_rank, node)  # engine: with this node group's overrides
        if node in roles:  # the layers all-reduce on the replica's TP group
            tp = tp_groups[roles[node].ranks]
            components[node] = dep.model.build_component(node, device=device, walks=set(walks), engine=engine, tp=tp)
        else:
            components[node] = dep.model.build_component(node, device=device, walks=set(walks), engine=engine)
        components[node].warmup()
        log.info("loaded %s for walks %s on %s in %.1f s", node, sorted(walks), device, time.monotonic() - t0)
    return components


def build_data_plane(dep: Deployment, info: RankInfo, device: str, timeout_s: float) -> Router:
    """This rank's data plane (docs/architecture.md §7): the pair groups of every p2p edge pair (collective: every
    rank creates the same ones, in one order, and warms its own), the shm arena and the Mooncake engine when
    some peer of this rank uses them, behind the per-tensor router."""
    rank, cfg = info.global_rank, dep.config.transport
    pairs = create_pair_groups(dep.p2p_pairs, global_rank=rank, backend=backend_for_device(device),
                               timeout_s=timeout_s)
    warm_pairs(pairs, rank, device)
    setup = TransportSetup(global_rank=rank, device=torch.device(device), config=cfg, launch_id=dep.token[:16],
                           host_addr=info.addr, transfer_device=dep.cluster.hosts[info.node_rank].transfer_device,
                           pair_groups=pairs)
    transports = build_transports({dep.via(rank, peer) for peer in dep.placement.peers_of(rank)}, setup)
    log.info("rank %d data plane: %s to peers %s", rank, ", ".join(sorted(transports)) or "none",
             list(dep.placement.peers_of(rank)))
    return Router(global_rank=rank, rank_hosts=dep.cluster.rank_hosts(), transports=transports,
                  intra_host=cfg.intra_host, inter_host=cfg.inter_host, inline_max_bytes=cfg.inline_max_bytes,
                  device=torch.device(device))


def teardown(components: dict[str, Component], shutdown_distributed: Callable[[], None], timeout_s: float) -> bool:
    """Close every component (CUDA graphs first: graphs that captured NCCL collectives keep the communicator busy
    and ``destroy_process_group`` would never return), then destroy the process groups: in a helper thread, so
    that a backend stuck in its teardown costs at most ``timeout_s``. True when it all finished in time."""
    def run() -> None:
        for node, component in components.items():
            try:
                component.close()
            except Exception:  # noqa: BLE001 - teardown goes on; the process is leaving
                log.warning("closing component %s failed", node, exc_info=True)
        components.clear()
        gc.unfreeze()  # the startup heap was frozen (heap.py): its cycles are the collector's again
        gc.collect()  # graphs referenced from cycles go now, not at interpreter exit
        shutdown_distributed()

    thread = threading.Thread(target=run, name="teardown", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log.warning("closing the components and destroying the process groups did not finish within %g s; "
                    "leaving without waiting for it", timeout_s)
        return False
    return True
