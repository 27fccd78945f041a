"""An in-process deployment for tests: a conductor and N workers wired by an in-memory control bus, no processes.

Messages still go through the real msgpack encoding; tensors that would use the p2p transport are handed over
directly. ``InProcDeployment.generate(params)`` runs the loop until the request's events end.
"""

from __future__ import annotations

import collections

import torch

from mstar_dist.conductor.conductor import Conductor
from mstar_dist.config.deployment import parse_config
from mstar_dist.graph.nodes import node_names
from mstar_dist.server.backend import BackendError, Finished
from mstar_dist.topology.placement import Placement
from mstar_dist.transport.store import TensorStore
from mstar_dist.worker.worker import Worker

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

    def recv(self, timeout_ms: int = 0) -> list[tuple[str, bytes]]:
        box = self.bus.inboxes[self.name]
        out = list(box)
        box.clear()
        return out


class Direct:
    """Transfers complete at once; a receive takes the sender's tensor from the shared table by order."""

    def __init__(self, rank: int, wires: dict):
        self.rank, self.wires = rank, wires

    def send(self, tensor, dst):
        self.wires.setdefault((self.rank, dst), collections.deque()).append(tensor.clone())
        return _Done(tensor)

    def recv(self, shape, dtype, src, device=None):
        return _Done(self.wires[(src, self.rank)].popleft())

    def stats(self):
        return {}


class _Done:
    def __init__(self, tensor):
        self.tensor = tensor

    def done(self):
        return True


class InProcDeployment:
    def __init__(self, model, config: dict, world_size: int, max_concurrent: int = 16):
        cfg = parse_config(config, "inproc")
        graphs = model.graphs()
        placement = Placement.build(cfg, {w: node_names(s) for w, s in graphs.items()}, world_size)
        self.bus, wires = Bus(), {}
        self.workers = []
        for rank in range(world_size):
            components = {node: model.build_component(node, device="cpu", walks=set(walks))
                          for node, walks in placement.components_on(rank).items()}
            self.workers.append(Worker(
                global_rank=rank, graphs=graphs, components=components, channel=self.bus.channel(f"rank{rank}"),
                transport=Direct(rank, wires), store=TensorStore(), token=TOKEN, device=torch.device("cpu"),
                inline_max_bytes=cfg.transport.inline_max_bytes, streaming_edges=model.streaming_edges()))
        self.conductor = Conductor(model=model, placement=placement, channel=self.bus.channel("conductor"),
                                   token=TOKEN, world_size=world_size, max_concurrent=max_concurrent,
                                   request_timeout_s=60, rank_hosts={r: "h" for r in range(world_size)})

    def turn(self) -> None:
        for worker in self.workers:
            for sender, payload in worker.channel.recv():
                worker._handle(sender, payload)
            worker._poll_transfers()
            worker._feed_streams()
            worker._step()
        for sender, payload in self.conductor.channel.recv():
            self.conductor._handle(sender, payload)

    def run(self, params_list, max_turns: int = 10_000) -> list[list]:
        """Submit every request, turn until each has finished or failed; returns each request's events."""
        events = [[] for _ in params_list]
        for p, ev in zip(params_list, events):
            self.conductor._submit(p, ev.append, True)
        for _ in range(max_turns):
            if all(ev and isinstance(ev[-1], (Finished, BackendError)) for ev in events):
                return events
            self.turn()
        raise AssertionError(f"requests did not finish in {max_turns} turns: {events}")
