"""A rank's parts, built by ``rank.py`` (docs/architecture.md §2): its device, its host's environment, its
components, its data plane, and the bounded teardown of what it built. Each is a function of the ``Deployment`` and
this rank's identity, the same for a rank's first start and for a restart in place (``rank.py`` says which steps a
restart skips)."""

from __future__ import annotations

import argparse
import datetime
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from mstar_dist.config.cluster import HostSpec, RankInfo, device_for
from mstar_dist.config.deployment import DeploymentConfig
from mstar_dist.distributed.groups import PairGroup, create_pair_groups, warm_pairs
from mstar_dist.distributed.init import backend_for_device
from mstar_dist.distributed.tp import TPGroup
from mstar_dist.engine.component import Component
from mstar_dist.runtime.children import FrontendProcess
from mstar_dist.runtime.deployment import Deployment
from mstar_dist.topology.placement import Placement
from mstar_dist.transport.plane import TransportSetup, build_transports
from mstar_dist.transport.router import Router
from mstar_dist.worker.tp import TPRole

log = logging.getLogger("mstar_dist.boot")  # the startup logger's name, as operators' log filters know it


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


def build_data_plane(dep: Deployment, info: RankInfo, device: str, timeout_s: float,
                     pairs: Mapping[tuple[int, int], PairGroup] | None = None) -> Router:
    """This rank's data plane (docs/architecture.md §7): the pair groups of every p2p edge pair (collective: every
    rank creates the same ones, in one order, and warms its own), the shm arena and the Mooncake engine when
    some peer of this rank uses them, behind the per-tensor router. ``pairs`` given (a rank restarted in place,
    which forms its pairs later, one peer at a time: ``distributed/repair.py``): those instead of creating any."""
    rank, cfg = info.global_rank, dep.config.transport
    if pairs is None:
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
