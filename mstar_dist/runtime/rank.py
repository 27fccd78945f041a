"""One torchrun rank, from its identity to its exit (docs/architecture.md §2). The steps and who they wait for:

1. the deployment (pure; identical on every rank: ``deployment.py``);
2. identify this process in the cluster spec against torchrun's variables (ValueError on any mismatch); the
   process group is joined with this *logical* global rank (under c10d rendezvous torchrun's RANK may differ; the
   agent's store accepts any permutation), so every rank number in the runtime is a logical one; rank 0 spawns its
   front end now (``frontend.py``), so that its imports overlap the distributed setup; the guard thread starts
   (``distributed/guard.py``): another rank's failure, the startup deadline or a signal ends this rank at once;
3. ``init_process_group`` (gloo on CPU, ``cuda:nccl,cpu:gloo`` on GPUs), the launch's secret, the walks check, the
   TP groups, then one pair group per directed edge pair, created on every rank in one order, and warmed — a
   collective step: blocks until all ranks join or ``--startup-timeout`` passes;
4. bind this rank's control socket, publish its endpoint in the launch's store, read every peer's (bounded wait);
5. load only this rank's components (weights prepared once per host first) and report READY or LOAD_FAILED;
6. run the worker loop until a signal or the conductor's ``Shutdown``.
A failure anywhere exits non-zero on every rank with a message naming the rank, host and cause (during startup
through the launch store's failure board, then through the front end's ``Shutdown``); SIGTERM or SIGINT stops
cleanly with exit 0. Teardown is unconditional and bounded.

**Restarted** (incarnation > 0, counted by its supervisor: ``supervisor.py``; in place, or on a host whose
torchrun was started again into the running deployment) a rank skips the world group:
step 3 becomes reading the secret and re-forming its TP group with its replica's members (each restarted too), its
data plane starts without pairs, and instead of READY it sends ``Rejoin``; the conductor then has every live rank
form fresh pairs with it (``Repair``, ``distributed/repair.py``) and re-admits it (docs/architecture.md §10).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from mstar_dist.config.cluster import RankInfo, identify, machine_names
from mstar_dist.control import messages as m
from mstar_dist.control.channel import ControlChannel, default_store, lookup_endpoint, publish_endpoint, share_secret
from mstar_dist.control.envelope import CONDUCTOR, rank_name
from mstar_dist.distributed.groups import create_tp_groups
from mstar_dist.distributed.guard import Guard, publish_failure, startup_timeout_message
from mstar_dist.distributed.init import backend_for_device, init_distributed, shutdown_distributed
from mstar_dist.distributed.repair import form_pairs, form_tp_group
from mstar_dist.distributed.store import key, launch_store
from mstar_dist.distributed.tp import TPGroup
from mstar_dist.engine.component import Component
from mstar_dist.runtime.deployment import Deployment, check_same_walks, load_deployment, torchrun_sizes
from mstar_dist.runtime.lifecycle import SHUTDOWN_FLUSH_S, Lifecycle
from mstar_dist.runtime.parts import (
    apply_host_env, build_data_plane, cpu_threads_for, load_components, spawn_frontend, take_device,
    teardown, tp_roles_for,
)
from mstar_dist.runtime.supervisor import INCARNATION_ENV, SupervisorPipe
from mstar_dist.transport.router import Router
from mstar_dist.transport.store import TensorStore
from mstar_dist.worker.worker import Worker

__all__ = ["LoadError", "Rank", "apply_host_env", "cpu_threads_for", "main", "teardown", "tp_roles_for"]

log = logging.getLogger("mstar_dist.boot")  # the startup logger's name, as operators' log filters know it

TEARDOWN_TIMEOUT_S = 4.0
"""Bound on closing the components and destroying the process groups at exit: a stop ends within 5 s."""
REPAIR_TIMEOUT_S = 30.0
"""Bound on forming one fresh pair group with a rejoining peer (both sides form it at once when told)."""


def main(args: argparse.Namespace) -> int:
    """Serve as the rank torchrun (or this rank's supervisor) started this process as; the exit status (0 after a
    signal or a clean ``Shutdown``, 1 after any failure). ValueError / OSError before the rank is built: a mistake
    in the config, the cluster spec or the port, which the CLI reports in one line."""
    world_size, local_ws = torchrun_sizes(os.environ)
    dep = load_deployment(args, world_size, local_ws)
    info = identify(dep.cluster, os.environ, machine_names())
    lc = Lifecycle(rank_name(info.global_rank), log_level=logging.getLogger().level, rank=info.global_rank,
                   host=info.host_name, log_format=args.log_format)
    lc.catch_signals(wakeup=True)  # a stop while starting: the guard sees it even inside a C call
    apply_host_env(dep.cluster.hosts[info.node_rank])
    supervisor = SupervisorPipe.from_env()
    guard = start_guard(dep, info, args.startup_timeout, lc, supervisor)
    rank = Rank(args, dep, info, take_device(dep, info), lc, guard=guard, supervisor=supervisor,
                incarnation=int(os.environ.get(INCARNATION_ENV, "0")))
    return lc.run(rank.serve, rank.failed, rank.teardown)


def start_guard(dep: Deployment, info: RankInfo, timeout_s: float, lc: Lifecycle,
                supervisor: SupervisorPipe) -> Guard:
    """This rank's guard thread, with its own client of the launch's store (none outside torchrun's agent store:
    then it watches signals and the deadline only)."""
    guard = Guard(rank=info.global_rank, host=info.host_name, world_size=dep.cluster.world_size,
                  rank_hosts=dep.cluster.rank_hosts(), timeout_s=timeout_s, signal_fd=lc.signal_fd,
                  watch_store=not dep.placement.is_conductor(info.global_rank))
    guard.on_fatal = lambda message, over: supervisor.over(message) if over else supervisor.leaving(message)
    try:
        store = launch_store(timeout_s=min(timeout_s, 10.0))
    except ConnectionError as exc:
        log.warning("the guard runs without the launch's store: %s", exc)
        store = None
    guard.start(store)
    return guard


class LoadError(RuntimeError):
    """This rank's components failed to load; the message names the rank, its host and the cause."""


class StartupError(RuntimeError):
    """A startup step timed out or broke; the message names who held it up (no raw DistStoreError)."""


class StoppedByConductor(RuntimeError):
    """The conductor stopped this rank with an error (the deployment failed, or this rank is to restart): its
    message says why, and the conductor's log has the rest."""


class Rank:
    """One rank's parts, built in the steps of the module docstring, and their teardown. Parts not built yet are
    None (``components`` empty)."""

    def __init__(self, args: argparse.Namespace, dep: Deployment, info: RankInfo, device: str, lc: Lifecycle, *,
                 guard: Guard, supervisor: SupervisorPipe, incarnation: int = 0) -> None:
        """Rank 0 spawns its front end here, first thing (step 2)."""
        self.args, self.dep, self.info, self.device, self.lc = args, dep, info, device, lc
        self.guard, self.supervisor, self.incarnation = guard, supervisor, incarnation
        self.rank = info.global_rank
        self.world_size = dep.cluster.world_size
        self.where = f"rank {self.rank} on host {info.host_name}"
        self.timeout_s: float = args.startup_timeout
        self.frontend = spawn_frontend(args, dep, info) if dep.placement.is_conductor(self.rank) else None
        self.store: Any | None = None
        """The launch's store (``distributed/store.py``); the default group's when torchrun's agent has none."""
        self.channel: ControlChannel | None = None
        self.data_plane: Router | None = None
        self.components: dict[str, Component] = {}
        self.endpoints: dict[str, str] = {}
        """Every rank's control endpoint by name (what rank 0 hands its front end)."""
        self.worker: Worker | None = None
        self.flush_s = 0.0
        """How long the channel's last messages may take to leave at close (set once this rank said it leaves)."""

    def serve(self) -> int:
        try:
            self.store = launch_store(timeout_s=self.timeout_s)
            tp_groups = self.join() if self.incarnation == 0 else self.rejoin()
            try:
                self.data_plane = build_data_plane(self.dep, self.info, self.device, self.timeout_s,
                                                   pairs=None if self.incarnation == 0 else {})
            except OSError as exc:  # no room for the shm arena, a transport's port: the message says what to change
                raise StartupError(f"{self.where}: {exc.strerror or exc}") from exc
            self.guard.cleanups.append(self.data_plane.close)  # a fatal exit still unlinks the shm segment
            self.connect()
            self.load(tp_groups)
        except dist.DistError as exc:
            raise StartupError(self.startup_failure(exc)) from None
        self.worker = self.make_worker()
        self.guard.serving = True
        self.supervisor.serving()
        self.lc.ready()  # the model, torch and the graphs leave the collector's generations (heap.py)
        self.worker.run(should_stop=self.should_stop)
        self.check_exit()
        return 0

    def startup_failure(self, exc: BaseException) -> str:
        """What a startup step's torch.distributed error means for the operator: who held the startup up."""
        log.debug("startup failed: %s: %s", type(exc).__name__, exc)
        if self.store is None:
            return f"{self.where}: the startup failed or timed out ({type(exc).__name__}: {exc})"
        return f"{self.where}: " + startup_timeout_message(self.store, self.world_size, self.dep.cluster.rank_hosts(),
                                                            self.timeout_s)

    def join(self) -> dict[tuple[int, ...], TPGroup]:
        """Step 3 up to the pairs (a first start): the process group, the launch's secret, the walks check and the
        TP groups (created before the pairs, in one order on every rank). Returns this rank's TP groups."""
        if self.store is not None:
            self.store.set(key("rendezvous", rank=self.rank), self.info.host_name)
        init_distributed(global_rank=self.rank, world_size=self.world_size, device=self.device,
                         timeout_s=self.timeout_s)
        if self.store is None:  # not under torchrun's agent store: the default group's
            self.store = default_store()
        self.share_secret()
        return create_tp_groups(self.dep.placement.tp_groups, global_rank=self.rank,
                                backend=backend_for_device(self.device), timeout_s=self.timeout_s)

    def rejoin(self) -> dict[tuple[int, ...], TPGroup]:
        """Step 3 of a rank restarted in place or on a host started again: no world group; the secret, the walks
        check, and its TP groups formed anew with their members (every member of a replica restarts together)."""
        if self.store is None:
            raise RuntimeError(f"{self.where} cannot rejoin: it needs torchrun's agent store "
                               f"(TORCHELASTIC_USE_AGENT_STORE), which this launch does not have")
        log.info("%s starts again (incarnation %d) and rejoins the running deployment", self.where,
                 self.incarnation)
        self.share_secret()
        backend = backend_for_device(self.device)
        return {ranks: form_tp_group(self.store, ranks, self.rank, backend, self.timeout_s)
                for ranks in self.dep.placement.tp_groups if self.rank in ranks}

    def share_secret(self) -> None:
        secret = share_secret(self.store, publisher=self.dep.placement.is_conductor(self.rank) and not self.incarnation,
                              timeout_s=self.timeout_s)
        self.dep = dataclasses.replace(self.dep, token=secret)
        check_same_walks(self.store, self.rank, self.world_size, self.dep.walks_digest(), self.timeout_s)

    def connect(self) -> None:
        """Step 4: this rank's control socket (its host's bind address, advertised address and port range),
        published; the conductor's (rank 0 publishes its front end's) and every rank's, looked up and connected."""
        me, store = rank_name(self.rank), self.store
        host = self.dep.cluster.hosts[self.info.node_rank]
        self.channel = ControlChannel(me, self.info.addr, advertise_addr=host.advertise_addr,
                                      port_range=host.control_ports)
        publish_endpoint(store, me, self.channel.endpoint)
        if self.frontend is not None:
            publish_endpoint(store, CONDUCTOR, self.frontend.endpoint(self.timeout_s))
        self.channel.connect(CONDUCTOR, lookup_endpoint(store, CONDUCTOR, self.timeout_s))
        for peer in map(rank_name, range(self.world_size)):
            self.endpoints[peer] = lookup_endpoint(store, peer, self.timeout_s)
            self.channel.connect(peer, self.endpoints[peer])

    def load(self, tp_groups: dict[tuple[int, ...], TPGroup]) -> None:
        """Step 5: this rank's components, then READY (``Rejoin`` when restarted) to the conductor; LOAD_FAILED, the
        failure on the board and a ``LoadError`` when they fail. Rank 0 hands its front end the secret and the
        endpoints now: the weights are on this host."""
        t0 = time.monotonic()
        try:
            self.components = load_components(self.dep, self.info, self.device, self.store, self.timeout_s, tp_groups)
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
        self.store.set(key("ready", rank=self.rank), self.info.host_name)
        seconds = time.monotonic() - t0
        if self.incarnation:
            self.send(m.Rejoin(rank=self.rank, host=self.info.host_name, incarnation=self.incarnation,
                               endpoint=self.channel.endpoint, load_seconds=seconds))
        else:
            self.send(m.Ready(rank=self.rank, host=self.info.host_name, load_seconds=seconds))

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
            form_pairs=functools.partial(form_pairs, self.store, me=self.rank,
                                         backend=backend_for_device(self.device), timeout_s=REPAIR_TIMEOUT_S),
            incarnation=self.incarnation,
            rank0_up=self.rank0_host_up,
        )

    def should_stop(self) -> bool:
        return self.lc.stop.is_set() or self.frontend_gone()

    def frontend_gone(self) -> bool:
        return self.frontend is not None and not self.frontend.alive()

    def check_exit(self) -> None:
        """Why the worker loop ended: the front end died (an error), a signal (a rank without a front end tells the
        conductor it leaves), or the conductor's ``Shutdown`` (an error when it says the deployment failed; not the
        end of the deployment when it asks this rank alone to restart)."""
        stopped, worker = self.lc.stop.is_set(), self.worker
        if self.frontend_gone() and not stopped and not worker.stopping:
            raise RuntimeError(self.frontend.describe_exit())
        if stopped and not worker.stopping and self.frontend is None:
            self.tell_leaving()
        if worker.stopping:
            reason = worker.failed_reason or "the deployment stopped"
            restart = worker.restart_asked
            if worker.conductor_silent:
                restart = not worker.rank0_gone and self.rank0_host_up()
                reason += ("; rank 0's host is up, so the conductor declared this rank dead (stopped, starved or cut "
                           "off): it restarts and rejoins" if restart else "; rank 0's host is gone")
            (self.supervisor.leaving if restart else self.supervisor.over)(reason)
            if worker.failed_reason:
                raise StoppedByConductor(reason)

    def rank0_host_up(self, patience_s: float | None = None) -> bool:
        """Whether the launch's store (on rank 0's host) answers, and the deployment is not over. A refused or reset
        connection is a no at once (the store's host process is gone); a store that does not answer is waited for up to
        ``patience_s`` (default ``limits.rank_timeout_s``): a link down and a host that froze look alike from here,
        and both may come back."""
        patience_s = self.dep.config.limits.rank_timeout_s if patience_s is None else patience_s
        answer: list[bool] = []

        def ask() -> None:
            try:
                answer.append(self.store is not None and not self.store.check([key("over")]))
            except Exception:  # noqa: BLE001 - the store's host is gone
                answer.append(False)

        asking = threading.Thread(target=ask, name="store-check", daemon=True)
        asking.start()
        asking.join(patience_s)
        return bool(answer and answer[0])

    def tell_leaving(self) -> None:
        """A rank stopped by a signal tells the conductor at once (``Leaving``), so its requests fail fast; the
        message leaves before the channel closes (``flush_s``)."""
        reason = f"stopped by a signal ({self.lc.stopped_by or 'SIGTERM'})"
        self.supervisor.leaving(reason)
        try:
            self.send(m.Leaving(rank=self.rank, host=self.info.host_name, reason=reason))
            self.flush_s = SHUTDOWN_FLUSH_S
        except Exception:  # the conductor is gone too: nobody to tell
            pass

    def send(self, body: m.Message) -> None:
        self.channel.send(CONDUCTOR, m.encode(self.dep.token, rank_name(self.rank), body))

    def failed(self, exc: Exception) -> None:
        if not self.guard.serving:  # the other ranks wait in the startup: the board tells them at once
            publish_failure(self.store, self.rank, self.info.host_name, _cause(exc, self.where))
        if isinstance(exc, (LoadError, StartupError, StoppedByConductor)):
            log.error("%s", exc)
            log.debug("%s", traceback.format_exc())
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
        self.guard.close()
        why = f" ({self.lc.stopped_by})" if self.lc.stopped_by and rc == 0 else ""
        log.info("%s exits with status %d%s", self.where, rc, why)
        return finished


def _cause(exc: BaseException, where: str) -> str:
    """A failure's cause in one line, without the rank and host the board names anyway."""
    if isinstance(exc, (LoadError, StartupError)):
        return str(exc).removeprefix(where).lstrip(": ")
    return f"{type(exc).__name__}: {exc}"

