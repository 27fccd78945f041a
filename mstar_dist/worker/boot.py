"""Startup and teardown of one rank (docs/architecture.md §2): parse, identify, init, control plane, load, serve.

Every rank runs :func:`serve`. The steps and who they wait for:
1. parse the YAML into the immutable deployment (pure; identical on every rank);
2. identify this process in the cluster spec against torchrun's variables (ValueError on any mismatch); the
   process group is joined with this *logical* global rank (under c10d rendezvous torchrun's RANK may differ; the
   agent's store accepts any permutation), so every rank number in the runtime is a logical one;
3. ``init_process_group`` (gloo on CPU, ``cuda:nccl,cpu:gloo`` on GPUs), then one pair group per directed edge
   pair, created on every rank in one order, and warmed — a collective step: blocks until all ranks join or
   ``--startup-timeout`` passes;
4. bind this rank's control socket, publish its endpoint in the torchrun store, read every peer's (bounded wait);
5. load only this rank's components (weights prepared once per host first) and report READY or LOAD_FAILED;
6. rank 0 waits for every READY, prints the placement, starts the conductor and binds HTTP.
A failure anywhere exits non-zero on every rank (rank 0 broadcasts ``Shutdown``) with a message naming the rank,
host and cause; SIGTERM stops cleanly with exit 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mstar_dist import trace
from mstar_dist.config.cluster import ClusterSpec, HostSpec, RankInfo, device_for, identify
from mstar_dist.config.deployment import DeploymentConfig, load_config
from mstar_dist.config.schema import ConfigError
from mstar_dist.control import messages as m
from mstar_dist.control.channel import (
    ControlChannel, default_store, lookup_endpoint, publish_endpoint, share_secret,
)
from mstar_dist.graph.model import CompositeModel, Layout
from mstar_dist.heap import freeze_startup_heap
from mstar_dist.logs import announce, configure_logging
from mstar_dist.graph.nodes import iter_nodes, node_names
from mstar_dist.telemetry import MeteredTransport
from mstar_dist.topology.cuts import flows
from mstar_dist.topology.placement import Placement
from mstar_dist.worker.worker import CONDUCTOR, Worker, rank_name

if TYPE_CHECKING:
    from mstar_dist.worker.tp import TPRole

log = logging.getLogger("mstar_dist.boot")


@dataclass(frozen=True)
class Deployment:
    """Config + cluster + model + placement: a pure function of the files and torchrun's world size."""

    config: DeploymentConfig
    cluster: ClusterSpec
    model: CompositeModel
    placement: Placement
    token: str = ""
    """The control-plane secret of this launch (``share_secret``); empty until the ranks have shared it."""

    @classmethod
    def build(cls, config: DeploymentConfig, world_size: int, local_world_size: int | None) -> "Deployment":
        from models import get_model_class

        cluster = config.resolve_cluster(world_size, local_world_size)
        model = get_model_class(config.model)(config.weights, **dict(config.model_kwargs))
        check_weights(config, model)
        model.configure(Layout.from_node_groups(config.node_groups), config.engine)
        walks = {walk: node_names(section) for walk, section in model.graphs().items()}
        placement = Placement.build(config, walks, cluster.world_size,
                                    flows(model.graphs(), model.partitions(), model.streaming_edges()))
        _check_tp(config, model, walks)
        graphs = model.graphs()
        for edge in model.streaming_edges():
            producers = [w for w, sec in graphs.items()
                         if any(e.stream and e.signal == edge.signal for n in iter_nodes(sec) for e in n.outputs)]
            if len(producers) > 1:  # items from two ranks have no common order on the consumer
                raise ValueError(f"streaming edge {edge.signal!r} is produced by walks {producers}: this runtime "
                                 f"needs one producing walk per streaming signal")
        return cls(config=config, cluster=cluster, model=model, placement=placement)


    def describe(self) -> str:
        """The dry run and startup report: rank map, placement per walk (replicas), TP groups, the data plane's
        transports and the pair groups it creates, cross-host rank pairs with their transport, every cut edge."""
        from mstar_dist.topology.cuts import cut_signals, describe_cuts

        cuts = cut_signals(self.model.graphs(), self.model.streaming_edges(), self.placement)
        return "\n".join([
            f"deployment: model {self.config.model}, {self.config.source}",
            self.placement.describe_ranks(self.cluster),
            self.placement.describe(self.cluster, self.config.transport),
            self.placement.describe_groups(self.p2p_pairs, self.config.transport),
            describe_cuts(cuts),
        ])

    def via(self, src: int, dst: int) -> str:
        """The transport of tensors from global rank ``src`` to ``dst`` (their hosts decide)."""
        hosts = self.cluster.rank_hosts()
        return self.config.transport.via(hosts[src] == hosts[dst])

    @property
    def p2p_pairs(self) -> tuple[tuple[int, int], ...]:
        """The edge pairs that travel on p2p: the pair groups every rank creates, in this order."""
        return tuple(p for p in self.placement.edge_pairs if self.via(*p) == "p2p")

    def walks_digest(self) -> str:
        """A digest of the model's walks: ranks compare it at startup (a family must build the same walks
        everywhere)."""
        graphs = self.model.graphs()
        return hashlib.sha256(repr(sorted(graphs.items(), key=lambda kv: kv[0])).encode()).hexdigest()[:16]


def _check_tp(config: DeploymentConfig, model: CompositeModel, walks: dict[str, frozenset[str]]) -> None:
    """tp_size > 1 only for nodes whose family shards them, and one tp_size per node across walks (P/D with TP
    moves each TP rank's KV shard to its counterpart, so both sides must shard alike)."""
    sizes: dict[str, tuple[int, int]] = {}
    for i, group in enumerate(config.node_groups):
        for node in group.node_names:
            if group.tp_size > 1 and node not in model.tp_nodes:
                raise ValueError(f"node_groups[{i}].tp_size = {group.tp_size}: node {node!r} of model {model.name!r} "
                                 f"does not support tensor parallelism (nodes that do: {sorted(model.tp_nodes)})")
            seen = sizes.setdefault(node, (i, group.tp_size))
            if seen[1] != group.tp_size:
                raise ValueError(f"node_groups[{i}].tp_size = {group.tp_size}: node {node!r} has tp_size {seen[1]} in "
                                 f"node_groups[{seen[0]}]; a node is sharded alike in every walk")


def tp_roles_for(placement: Placement, rank: int) -> dict[str, "TPRole"]:
    """Node -> this rank's role in the node's TP replica, for the nodes it holds with tp_size > 1."""
    from mstar_dist.worker.tp import TPRole

    roles = {}
    for node, walks in placement.components_on(rank).items():
        for rep_ in placement.replicas(next(iter(sorted(walks))), node):
            if rank in rep_.ranks and len(rep_.ranks) > 1:
                roles[node] = TPRole(node, rep_.ranks, rank)
    return roles


def check_weights(config: DeploymentConfig, model: CompositeModel) -> None:
    """``weights:`` must exist unless the family prepares that path itself: its ``default_weights_dir``, or any
    path of a family that decides in ``prepare_weights`` (checked there, at load). ConfigError naming the key."""
    path = config.weights
    if path is None or os.path.exists(path):
        return
    default = type(model).default_weights_dir
    if default is not None and os.path.realpath(path) == os.path.realpath(os.path.expanduser(default)):
        return
    if default is None and type(model).prepare_weights is not CompositeModel.prepare_weights:
        return
    also = f" (only the default {default} is prepared automatically)" if default else ""
    raise ConfigError("weights", f"no such directory{also}", repr(path), config.source)


def _world_from_config(config: DeploymentConfig) -> int:
    """The world a dry run checks without torchrun: the cluster spec's, else the highest placed rank + 1."""
    if config.cluster is not None:
        return config.cluster.world_size
    return 1 + max(r for g in config.node_groups for r in g.ranks)


def check_same_walks(store: Any, rank: int, world_size: int, digest: str, timeout_s: float) -> None:
    """Publish this rank's walks digest and compare it with every other rank's (rank 0 reads all, the others read
    rank 0's); a ``RuntimeError`` names both ranks when they differ. Blocks up to ``timeout_s`` per key."""
    import datetime

    store.set(f"mstar_dist/walks/{rank}", digest)
    peers = range(world_size) if rank == 0 else [0]
    for peer in peers:
        key = f"mstar_dist/walks/{peer}"
        store.wait([key], datetime.timedelta(seconds=timeout_s))
        theirs = store.get(key).decode()
        if theirs != digest:
            raise RuntimeError(f"rank {rank} and rank {peer} derive different walks from the same config "
                               f"(digests {digest} and {theirs}): a model family must build its walks from the "
                               f"config alone (model_kwargs, layout); check both hosts run the same code")


def _hostnames() -> set[str]:
    names = {socket.gethostname(), socket.getfqdn()}
    try:
        names.update(info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None))
    except OSError:
        pass
    return names


def _load_components(dep: Deployment, info: RankInfo, device: str, store: Any, timeout_s: float,
                     tp_groups: dict | None = None) -> dict:
    """Prepare weights once per host (local rank 0), then build this rank's components."""
    key = f"mstar_dist/weights/{info.node_rank}"
    if info.local_rank == 0:
        try:
            dep.model.prepare_weights()
            store.set(key, "ok")
        except Exception as exc:
            store.set(key, f"error: {exc}")
            raise
    else:
        import datetime

        store.wait([key], datetime.timedelta(seconds=timeout_s))
        status = store.get(key).decode()
        if status != "ok":
            raise RuntimeError(f"weights preparation on host {info.host_name} failed: {status}")
    components = {}
    roles = tp_roles_for(dep.placement, info.global_rank)
    for node, walks in sorted(dep.placement.components_on(info.global_rank).items()):
        t0 = time.monotonic()
        engine = dep.config.engine_for(info.global_rank, node)  # engine: with this node group's overrides
        if node in roles:  # this rank builds only its shard; the layers all-reduce on the replica's TP group
            from models.common.tp import TPGroup

            group = tp_groups[roles[node].ranks]
            tp = TPGroup(group=group.group, rank=group.rank_in_group, size=len(group.ranks))
            components[node] = dep.model.build_component(node, device=device, walks=set(walks), tp=tp, engine=engine)
        else:
            components[node] = dep.model.build_component(node, device=device, walks=set(walks), engine=engine)
        components[node].warmup()
        log.info("loaded %s for walks %s on %s in %.1f s", node, sorted(walks), device, time.monotonic() - t0)
    return components


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


def build_data_plane(dep: Deployment, info: RankInfo, device: str, timeout_s: float):
    """This rank's data plane (docs/architecture.md §7): the pair groups of every p2p edge pair (collective: every
    rank creates the same ones, in one order, and warms its own), the shm arena and the Mooncake engine when
    some peer of this rank uses them, behind the per-tensor router."""
    from mstar_dist.distributed.groups import create_pair_groups, warm_pairs
    from mstar_dist.distributed.init import backend_for_device
    from mstar_dist.transport.p2p import P2PTransport
    from mstar_dist.transport.router import Router

    rank, cfg = info.global_rank, dep.config.transport
    needed = {dep.via(rank, peer) for peer in dep.placement.peers_of(rank)}
    transports: dict[str, Any] = {}
    pairs = create_pair_groups(dep.p2p_pairs, global_rank=rank, backend=backend_for_device(device),
                               timeout_s=timeout_s)
    warm_pairs(pairs, rank, device)
    if "p2p" in needed:
        transports["p2p"] = MeteredTransport(P2PTransport(rank, pairs, torch.device(device)), "p2p")
    if "shm" in needed:
        from mstar_dist.transport.shm import ShmTransport, sweep_orphans

        sweep_orphans()
        transports["shm"] = MeteredTransport(ShmTransport(rank, launch_id=dep.token[:16], arena_bytes=cfg.arena_bytes,
                                                          device=device), "shm")
    if "mooncake" in needed:
        from mstar_dist.transport.mooncake import MooncakeTransport

        host = dep.cluster.hosts[info.node_rank]
        transports["mooncake"] = MeteredTransport(MooncakeTransport(
            rank, host_addr=info.addr, protocol=cfg.mooncake_protocol, device_name=host.transfer_device,
            arena_bytes=cfg.arena_bytes, device=device), "mooncake")
    log.info("rank %d data plane: %s to peers %s", rank, ", ".join(sorted(transports)) or "none",
             list(dep.placement.peers_of(rank)))
    return Router(global_rank=rank, rank_hosts=dep.cluster.rank_hosts(), transports=transports,
                  intra_host=cfg.intra_host, inter_host=cfg.inter_host, inline_max_bytes=cfg.inline_max_bytes,
                  device=torch.device(device))


def load_deployment(args: argparse.Namespace, world_size: int | None, local_ws: int | None) -> Deployment:
    """The deployment of ``args.config`` with the command line's overrides (every rank and the front end build
    the same one). ``world_size`` None: torchrun's is unknown (a dry run sizes the world from the config)."""
    config = load_config(args.config).with_overrides(
        host=args.host, port=args.port, max_concurrent_requests=args.max_concurrent_requests,
        request_timeout_s=args.request_timeout, max_body_bytes=args.max_body_bytes,
        http_processes=args.http_processes, intra_host=args.intra_host_tensor_protocol,
        inter_host=args.inter_host_tensor_protocol,
    )
    if world_size is None:
        world_size = _world_from_config(config) if args.dry_run else 1
    return Deployment.build(config, world_size, local_ws)


def serve(args: argparse.Namespace) -> int:
    from mstar_dist.distributed.groups import create_tp_groups
    from mstar_dist.distributed.init import backend_for_device, init_distributed, shutdown_distributed
    from mstar_dist.server.http_server import reserve_port
    from mstar_dist.transport.store import TensorStore

    env = os.environ
    torchrun_world = int(env.get("WORLD_SIZE", "0")) or None
    local_ws = int(env["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in env else None
    dep = load_deployment(args, torchrun_world, local_ws)
    world_size = torchrun_world or (dep.cluster.world_size if args.dry_run else 1)
    config = dep.config
    if args.dry_run:
        print(dep.describe())
        return 0
    info = identify(dep.cluster, env, _hostnames())
    rank = info.global_rank
    trace.set_process(rank_name(rank))
    where = f"rank {rank} on host {info.host_name}"
    configure_logging(logging.getLogger().level, rank=rank, host=info.host_name, fmt=args.log_format)
    apply_host_env(dep.cluster.hosts[info.node_rank])
    device = device_for(info, torch.cuda.is_available())
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    else:
        threads = cpu_threads_for(config, rank, len(dep.cluster.ranks_on_host(info.node_rank)), os.cpu_count() or 1)
        torch.set_num_threads(threads)
        log.info("rank %d uses %d CPU threads", rank, threads)
    frontend = None
    if dep.placement.is_conductor(rank):  # first thing: its imports overlap the distributed setup (§2)
        from mstar_dist.conductor.process import FrontendProcess

        http_sock = reserve_port(config.server.host, config.server.port)
        frontend = FrontendProcess(getattr(args, "argv", sys.argv[1:]), host_name=info.host_name, addr=info.addr,
                                   http_sock=http_sock)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    channel = data_plane = None
    components: dict = {}
    endpoints: dict[str, str] = {}
    rc = 0
    try:
        init_distributed(global_rank=rank, world_size=world_size, device=device, timeout_s=args.startup_timeout)
        store = default_store()
        secret = share_secret(store, publisher=dep.placement.is_conductor(rank), timeout_s=args.startup_timeout)
        dep = dataclasses.replace(dep, token=secret)
        check_same_walks(store, rank, world_size, dep.walks_digest(), args.startup_timeout)
        tp_groups = create_tp_groups(dep.placement.tp_groups, global_rank=rank, backend=backend_for_device(device),
                                     timeout_s=args.startup_timeout)  # TP groups first, then pairs (§2)
        data_plane = build_data_plane(dep, info, device, args.startup_timeout)

        channel = ControlChannel(rank_name(rank), info.addr)
        publish_endpoint(store, rank_name(rank), channel.endpoint)
        if frontend is not None:
            publish_endpoint(store, CONDUCTOR, frontend.endpoint(args.startup_timeout))
        channel.connect(CONDUCTOR, lookup_endpoint(store, CONDUCTOR, args.startup_timeout))
        for peer in range(world_size):
            endpoints[rank_name(peer)] = lookup_endpoint(store, rank_name(peer), args.startup_timeout)
            channel.connect(rank_name(peer), endpoints[rank_name(peer)])

        t0 = time.monotonic()
        try:
            components = _load_components(dep, info, device, store, args.startup_timeout, tp_groups)
        except Exception as exc:
            cause = f"{type(exc).__name__}: {exc}"
            if frontend is not None:
                frontend.configure(dep.token, endpoints, failed=f"{where} failed to load: {cause}")
            channel.send(CONDUCTOR, m.encode(dep.token, rank_name(rank),
                                             m.LoadFailed(rank=rank, host=info.host_name, error=cause)))
            # said here too: torchrun ends the other ranks (and rank 0's front end with them) as soon as this
            # process exits, sometimes before the conductor has logged the LoadFailed it was sent
            raise _LoadError(f"{where} failed to load: {cause}") from exc
        if frontend is not None:
            frontend.configure(dep.token, endpoints)
        channel.send(CONDUCTOR, m.encode(dep.token, rank_name(rank),
                                         m.Ready(rank=rank, host=info.host_name, load_seconds=time.monotonic() - t0)))
        worker = Worker(
            global_rank=rank, graphs=dep.model.graphs(), components=components, channel=channel,
            transport=data_plane, store=TensorStore(), token=dep.token, device=torch.device(device),
            inline_max_bytes=dep.config.transport.inline_max_bytes,
            backpressure_timeout_s=dep.config.transport.backpressure_timeout_s,
            spin_s=dep.config.transport.spin_s(torch.device(device).type),
            streaming_edges=dep.model.streaming_edges(),
            conductor_timeout_s=dep.config.limits.rank_timeout_s,
            tp_roles=tp_roles_for(dep.placement, rank),
        )
        frontend_gone = (lambda: False) if frontend is None else (lambda: not frontend.alive())
        freeze_startup_heap()  # the model, torch and the graphs leave the collector's generations (heap.py)
        worker.run(should_stop=lambda: stop.is_set() or frontend_gone())
        if frontend_gone() and not stop.is_set() and not worker.stopping:
            raise RuntimeError(frontend.describe_exit())
        if stop.is_set() and not worker.stopping and frontend is None:
            _tell_leaving(dep, channel, rank, info.host_name)
        if worker.stopping and worker.failed_reason:
            raise RuntimeError(worker.failed_reason)
    except _LoadError as exc:
        log.error("%s\n%s", exc, traceback.format_exc())
        rc = 1
    except Exception as exc:
        log.error("%s failed: %s\n%s", where, exc, traceback.format_exc())
        rc = 1
    finally:
        if frontend is not None:
            # it fails in-flight requests with 503 while HTTP still delivers them and tells every rank to stop
            frontend.stop()
        if channel is not None:
            channel.close()
        if data_plane is not None:
            data_plane.close()  # unlinks the shm segment, drops registrations, stops gloo waiter threads
        worker = None  # the worker holds the components too: nothing may keep their CUDA graphs alive
        finished = _teardown(components, shutdown_distributed, TEARDOWN_TIMEOUT_S)
    log.info("%s exits with status %d", where, rc)
    if trace.ON:
        trace.flush()  # here too: os._exit below skips atexit
    if not finished:  # a thread is stuck in the backend: interpreter shutdown could block on it too
        logging.shutdown()
        os._exit(rc)
    return rc


TEARDOWN_TIMEOUT_S = 15.0
"""Bound on closing the components and destroying the process groups at exit (under torchrun's 30 s between
SIGTERM and SIGKILL)."""


def _teardown(components: dict, shutdown_distributed, timeout_s: float) -> bool:
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


class _LoadError(RuntimeError):
    """This rank's components failed to load; the message names the rank, its host and the cause."""


def _tell_leaving(dep: Deployment, channel: ControlChannel, rank: int, host: str) -> None:
    """A rank stopped by a signal tells the conductor at once (``Leaving``), so its requests fail fast."""
    try:
        channel.send(CONDUCTOR, m.encode(dep.token, rank_name(rank),
                                         m.Leaving(rank=rank, host=host, reason="stopped by a signal (SIGTERM)")))
        time.sleep(0.2)  # let it leave before the socket closes (LINGER 0)
    except Exception:  # the conductor is gone too: nobody to tell
        pass


def _broadcast_shutdown(dep: Deployment, channel: ControlChannel, world_size: int, reason: str,
                        error: bool = True) -> None:
    for peer in range(world_size):
        try:
            channel.send(rank_name(peer), m.encode(dep.token, CONDUCTOR, m.Shutdown(reason=reason, error=error)))
        except Exception:  # a peer that is gone cannot be told
            pass


def _start_conductor(dep: Deployment, channel: ControlChannel, timeout_s: float, log_stats_s: float | None,
                     intakes: tuple[str, ...] = ()):
    """Rank 0: wait for every READY, then start the conductor thread (docs/architecture.md §2 step 6)."""
    from mstar_dist.conductor.conductor import Conductor

    cfg = dep.config
    dep.model.load_frontend()
    conductor = Conductor(
        model=dep.model, placement=dep.placement, channel=channel, token=dep.token,
        world_size=dep.cluster.world_size, max_concurrent=cfg.limits.max_concurrent_requests,
        max_queued=cfg.limits.max_queued_requests,
        request_timeout_s=cfg.limits.request_timeout_s, rank_hosts=dep.cluster.rank_hosts(),
        rank_timeout_s=cfg.limits.rank_timeout_s, log_stats_s=log_stats_s, intakes=intakes,
    )
    conductor.wait_ready(timeout_s)
    announce(dep.describe())
    conductor.start()
    return conductor


def _start_http(dep: Deployment, conductor, *, api_key: str | None, sock):
    """Rank 0: bind HTTP only now that every rank serves (docs/architecture.md §2 step 6)."""
    from mstar_dist.conductor.backend import ConductorBackend
    from mstar_dist.server.app import build_app
    from mstar_dist.server.http_server import HttpServer

    cfg = dep.config
    backend = ConductorBackend(conductor, **served(dep))
    http = HttpServer(build_app(backend, api_key=api_key, max_body_bytes=cfg.server.max_body_bytes))
    http.start(cfg.server.host, cfg.server.port, timeout_s=30, sock=sock)
    announce(f"mstar_dist: serving {cfg.model} on http://{cfg.server.host}:{cfg.server.port}")
    return http


def served(dep: Deployment) -> dict[str, Any]:
    """What the HTTP app tells clients about the model and its limits (the backend's attributes)."""
    return {"model_name": dep.config.model, "max_context_tokens": dep.model.max_context_tokens,
            "max_tokens_limit": min(dep.config.limits.max_tokens, dep.model.max_context_tokens - 1),
            "output_modality": dep.model.output_modality}
