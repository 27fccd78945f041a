"""Per-rank setup for the data-plane transport tests: every transport between two ranks on loopback (gloo pairs,
a shared-memory arena, a Mooncake engine over tcp) and a control channel carrying the real wire types."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from mstar_dist.config.deployment import TransportConfig
from mstar_dist.control import messages as m
from mstar_dist.control.channel import ControlChannel, default_store, lookup_endpoint, publish_endpoint
from mstar_dist.distributed.groups import create_pair_groups, warm_pairs
from mstar_dist.distributed.init import init_distributed, shutdown_distributed
from mstar_dist.transport.base import ArenaFull, DataPlane, Transfer
from mstar_dist.transport.inline import dtype_to_str
from mstar_dist.transport.plane import TransportSetup, build_transports

TOKEN = "transport-test"


def mooncake_available() -> str | None:
    """None when the Mooncake engine imports, else why not."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as exc:  # ImportError, or a missing system library
        return f"{type(exc).__name__}: {exc}"
    return None


@dataclass
class Rig:
    rank: int
    peer: int
    channel: ControlChannel
    planes: dict[str, DataPlane]
    stash: list = field(default_factory=list)

    def send(self, body: m.Message) -> None:
        """Send ``body`` to the peer, then issue the sends whose descriptors it carried (as the worker does)."""
        self.channel.send(f"rank{self.peer}", m.encode(TOKEN, f"rank{self.rank}", body))
        for plane in self.planes.values():
            plane.flush()

    def pump(self, timeout_ms: int = 1) -> list[m.Message]:
        """Deliver acks to the transports, send the acks we owe, return the other messages."""
        for plane in self.planes.values():
            for peer, ack in plane.poll():
                self.channel.send(f"rank{peer}", m.encode(TOKEN, f"rank{self.rank}", ack))
        out = []
        for _, payload in self.channel.recv(timeout_ms):
            body = m.decode(payload).body
            if isinstance(body, m.TransferAck):
                self.planes[body.via].on_ack(self.peer, body)
            else:
                out.append(body)
        return out

    def expect(self, n: int, timeout_s: float = 60.0) -> list[m.Message]:
        got, self.stash = self.stash, []
        deadline = time.monotonic() + timeout_s
        while len(got) < n:
            assert time.monotonic() < deadline, f"rank {self.rank}: only {len(got)} of {n} messages arrived"
            got += self.pump(5)
        got, self.stash = got[:n], got[n:]
        return got


def setup(rank: int, names: tuple[str, ...], *, arena_bytes: int = 64 << 20, launch_id: str = "test") -> Rig:
    """init gloo, and build the transports in ``names`` between ranks 0 and 1 through the registry, as a rank
    does (p2p groups only if asked)."""
    world = int(os.environ["WORLD_SIZE"])
    init_distributed(global_rank=rank, world_size=world, device="cpu", timeout_s=30)
    groups = {}
    if "p2p" in names:
        groups = create_pair_groups([(0, 1), (1, 0)], global_rank=rank, backend="gloo", timeout_s=30)
        warm_pairs(groups, rank, "cpu", timeout_s=30)
    planes = build_transports(names, TransportSetup(
        global_rank=rank, device=torch.device("cpu"), config=TransportConfig(arena_bytes=arena_bytes),
        launch_id=launch_id, host_addr="127.0.0.1", pair_groups=groups))
    channel = ControlChannel(f"rank{rank}", "127.0.0.1")
    store = default_store()
    publish_endpoint(store, f"rank{rank}", channel.endpoint)
    peer = 1 - rank
    channel.connect(f"rank{peer}", lookup_endpoint(store, f"rank{peer}", 30))
    return Rig(rank, peer, channel, planes)


def teardown(rig: Rig) -> None:
    for plane in rig.planes.values():
        plane.close()
    rig.channel.close()
    shutdown_distributed()


def post(plane: DataPlane, tensor: torch.Tensor, dst: int, rig: Rig | None = None,
         timeout_s: float = 30.0) -> tuple[Transfer, m.WireTensor]:
    """What the router does above the inline threshold: post, then describe. With ``rig``, a full arena lets
    acknowledgements in and retries (the worker's backpressure)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            transfer, at = plane.post_send(tensor, dst)
            break
        except ArenaFull:
            if rig is None or time.monotonic() > deadline:
                raise
            rig.stash += rig.pump(1)
    return transfer, m.WireTensor(shape=list(tensor.shape), dtype=dtype_to_str(tensor.dtype),
                                  host=tensor.device.type == "cpu", via=plane.name, at=at)


def wait_all(rig: Rig, transfers: list[Transfer], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(t.done() for t in transfers):
        assert time.monotonic() < deadline, f"rank {rig.rank}: transfers still pending after {timeout_s} s"
        rig.stash += rig.pump(1)
