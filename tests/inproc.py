"""An in-process deployment for tests: a conductor and N workers wired by an in-memory control bus, no processes.

Messages still go through the real msgpack encoding; tensors that would use the data plane are handed over
directly (``Direct``, behind the real ``Router``). ``InProcDeployment.generate(params)`` runs the loop until the
request's events end.
"""

from __future__ import annotations

import collections

import torch

from mstar_dist.conductor.conductor import Conductor
from mstar_dist.config.deployment import parse_config
from mstar_dist.graph.nodes import node_names
from mstar_dist.server.backend import BackendError, Finished
from mstar_dist.topology.cuts import flows
from mstar_dist.topology.placement import Placement
from mstar_dist.transport.base import Done
from mstar_dist.transport.router import Router
from mstar_dist.transport.store import TensorStore
from mstar_dist.worker.worker import Worker
from tests.fakes import IdlePlane

TOKEN = "inproc"


class Bus:
    def __init__(self):
        self.inboxes: dict[str, collections.deque] = collections.defaultdict(collections.deque)

    def channel(self, name: str) -> "BusChannel":
        return BusChannel(self, name)


class BusChannel:
    endpoint = "inproc://bus"

    def __init__(self, bus: Bus, name: str):
        self.bus, self.name = bus, name

    def send(self, peer: str, payload: bytes) -> None:
        self.bus.inboxes[peer].append((self.name, payload))

    def recv(self, timeout_ms: int = 0, max_messages: int = 10_000, spin_s: float = 0.0) -> list[tuple[str, bytes]]:
        box = self.bus.inboxes[self.name]
        out = list(box)
        box.clear()
        return out


class Direct(IdlePlane):
    """A data plane (``transport.base.DataPlane``) whose transfers complete at once: a receive takes the sender's
    tensor from the shared table, in order (like a p2p pair)."""

    name = "p2p"

    def __init__(self, rank: int, wires: dict, pairs: frozenset = frozenset()):
        self.rank, self.wires, self.pairs = rank, wires, pairs
        self.dead: set[int] = set()

    def post_send(self, tensor, dst):
        assert (self.rank, dst) in self.pairs, (
            f"rank {self.rank} sends to rank {dst}, a pair the placement creates no group for: {sorted(self.pairs)}")
        self.wires.setdefault((self.rank, dst), collections.deque()).append(tensor.clone())
        return Done(tensor), None

    def post_recv(self, wire, src, device=None):
        return Done(self.wires[(src, self.rank)].popleft())

    def abort_peer(self, peer, reason):
        self.dead.add(peer)

    def is_dead(self, peer):
        return peer in self.dead


def direct_router(rank: int, wires: dict, world_size: int, inline_max_bytes: int, pairs=frozenset()) -> Router:
    """The worker's data plane over `Direct`, every rank on one host; sends only on `pairs` (src, dst)."""
    return Router(global_rank=rank, rank_hosts={r: "h" for r in range(world_size)},
                  transports={"p2p": Direct(rank, wires, frozenset(pairs))}, intra_host="p2p", inter_host="p2p",
                  inline_max_bytes=inline_max_bytes, device=torch.device("cpu"))


class InProcDeployment:
    def __init__(self, model, config: dict, world_size: int, max_concurrent: int = 16):
        cfg = parse_config(config, "inproc")
        graphs = model.graphs()
        placement = Placement.build(cfg, {w: node_names(s) for w, s in graphs.items()}, world_size,
                                    flows(graphs, model.partitions(), model.streaming_edges()))
        self.bus, wires = Bus(), {}
        self.workers = []
        for rank in range(world_size):
            components = {node: model.build_component(node, device="cpu", walks=set(walks),
                                                      engine=cfg.engine_for(rank, node))
                          for node, walks in placement.components_on(rank).items()}
            self.workers.append(Worker(
                global_rank=rank, graphs=graphs, components=components, channel=self.bus.channel(f"rank{rank}"),
                transport=direct_router(rank, wires, world_size, cfg.transport.inline_max_bytes, placement.edge_pairs),
                store=TensorStore(), token=TOKEN, device=torch.device("cpu"),
                inline_max_bytes=cfg.transport.inline_max_bytes, streaming_edges=model.streaming_edges()))
        self.conductor = Conductor(model=model, placement=placement, channel=self.bus.channel("conductor"),
                                   token=TOKEN, world_size=world_size, max_concurrent=max_concurrent,
                                   request_timeout_s=60, rank_hosts={r: "h" for r in range(world_size)})

    def turn(self) -> None:
        for worker in self.workers:
            worker.poll_once()
        for sender, payload in self.conductor.channel.recv():
            self.conductor.handle(sender, payload)

    def run(self, params_list, max_turns: int = 10_000) -> list[list]:
        """Submit every request, turn until each has finished or failed; returns each request's events."""
        events = [[] for _ in params_list]
        for p, ev in zip(params_list, events):
            self.conductor.submit(p, ev.append, True)
        for _ in range(max_turns):
            if all(ev and isinstance(ev[-1], (Finished, BackendError)) for ev in events):
                return events
            self.turn()
        raise AssertionError(f"requests did not finish in {max_turns} turns: {events}")
