"""The transport registry (mstar_dist/transport/registry.py, built by transport/plane.py): a new transport is one
file plus one registry entry.

A failure means adding a transport takes more than that (the command line or the rank's startup still names the
transports itself), or a mistake in a registration (an unknown name, a factory building another transport than
its name says) is not caught with a message naming it.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from mstar_dist.config.deployment import TransportConfig
from mstar_dist.control import messages as m
from mstar_dist.transport import registry
from mstar_dist.transport.base import Done
from mstar_dist.transport.plane import TransportSetup, build, build_transports
from mstar_dist.transport.registry import names, register, unregister
from mstar_dist.transport.router import Router

_WIRE: dict[int, torch.Tensor] = {}
"""What the loopback transports of this module have sent and not yet received, by key."""


class LoopSlot(msgspec.Struct, frozen=True):
    """The loop transport's own location: which rank sent the tensor and where it waits."""

    owner: int
    key: int


class LoopTransport:
    """The smallest transport: the bytes wait in one in-process table under a key of its own, which the descriptor
    carries as the transport's own location type (``LoopSlot``, encoded: no struct of it in control/messages.py)."""

    name = "loop"

    def __init__(self, global_rank: int) -> None:
        self.global_rank = global_rank
        self.sent: list[int] = []
        self.closed = False

    def post_send(self, tensor, dst):
        self.sent.append(dst)
        slot = LoopSlot(owner=self.global_rank, key=len(_WIRE))
        _WIRE[slot.key] = tensor.clone()
        return Done(tensor), m.EncodedLocation(data=msgspec.msgpack.encode(slot))

    def post_recv(self, wire, src, device=None):
        slot = msgspec.msgpack.decode(wire.at.data, type=LoopSlot)
        assert slot.owner == src
        return Done(_WIRE.pop(slot.key))

    def flush(self):
        pass

    def device_inflight(self):
        return False

    def withdraw(self, transfer):
        return False

    def poll(self):
        return []

    def on_ack(self, src, ack):
        pass

    def abort_peer(self, peer, reason):
        pass

    def is_dead(self, peer):
        return False

    def stats(self):
        return {"sends": len(self.sent)}

    def close(self):
        self.closed = True


def build_loop(setup: TransportSetup) -> LoopTransport:
    """The registry's factory for ``loop`` (what a transport's file defines next to its class)."""
    return LoopTransport(setup.global_rank)


@pytest.fixture
def loop_registered():
    register("loop", f"{__name__}:build_loop")  # the one registry entry, as "module:function"
    yield
    unregister("loop")


def setup_of(rank: int) -> TransportSetup:
    return TransportSetup(global_rank=rank, device=torch.device("cpu"), config=TransportConfig(), launch_id="t",
                          host_addr="127.0.0.1")


def test_the_builtin_transports_are_registered_in_the_order_the_command_line_lists_them():
    assert names()[:3] == ("p2p", "mooncake", "shm")


def test_a_registered_transport_is_built_and_chosen_by_the_router_for_a_pair_on_one_host(loop_registered):
    hosts = {0: "a", 1: "a", 2: "b"}
    planes = [build_transports({"loop"}, setup_of(rank)) for rank in (0, 1)]
    producer, consumer = (Router(global_rank=rank, rank_hosts=hosts, transports=planes[rank], intra_host="loop",
                                 inter_host="p2p", inline_max_bytes=0, device=torch.device("cpu"))
                          for rank in (0, 1))
    tensor = torch.arange(12, dtype=torch.float32).view(3, 4)
    _, wire = producer.post_send(tensor, 1)
    assert isinstance(wire, m.WireTensor) and wire.via == "loop" and planes[0]["loop"].sent == [1]
    done = m.NodeDone(request_id="r", walk="w", node="n", seq=0, signals=["x"], values={"x": wire})
    wire = m.decode(m.encode("t", "rank0", done)).body.values["x"]  # as the consumer gets it off the wire
    got = consumer.post_recv(wire, 0, walk="w", signal="x")
    assert got.done() and torch.equal(got.tensor, tensor)
    assert [(e.via, e.count) for e in consumer.edges.snapshot()] == [("loop", 1)]
    assert {h.transport for h in producer.stats()["histograms"]} == {"loop"}  # the router meters it too


def test_the_command_line_offers_a_registered_transport(loop_registered):
    from mstar_dist.runtime.cli import parse_args

    args = parse_args(["x.yaml", "--intra-host-tensor-protocol", "loop", "--inter-host-tensor-protocol", "loop"])
    assert args.intra_host_tensor_protocol == args.inter_host_tensor_protocol == "loop"


def test_the_config_accepts_a_registered_transport(loop_registered):
    assert TransportConfig(intra_host="loop", inter_host="loop").intra_host == "loop"


def test_an_unknown_name_is_refused_naming_the_registered_ones():
    with pytest.raises(ValueError, match="unknown transport 'carrier_pigeon'; registered: p2p, mooncake, shm"):
        build("carrier_pigeon", setup_of(0))


def test_a_factory_that_builds_a_transport_of_another_name_is_refused_and_what_it_built_closed():
    built = []

    def wrong(setup):
        built.append(LoopTransport(setup.global_rank))
        return built[-1]

    register("other", wrong)
    try:
        with pytest.raises(ValueError, match="transport 'other' built a transport named 'loop'"):
            build("other", setup_of(0))
    finally:
        unregister("other")
    assert built[0].closed


def test_when_one_transport_fails_to_start_those_already_built_are_closed():
    built = []

    class Recorded(LoopTransport):
        name = "a_loop"

    def broken(setup):
        raise RuntimeError("no such device")

    register("a_loop", lambda setup: built.append(Recorded(setup.global_rank)) or built[-1])
    register("zz_broken", broken)  # names are built in order: "a_loop" first
    try:
        with pytest.raises(RuntimeError, match="no such device"):
            build_transports(["zz_broken", "a_loop"], setup_of(0))
    finally:
        unregister("a_loop")
        unregister("zz_broken")
    assert len(built) == 1 and built[0].closed


def test_a_name_is_registered_once_and_must_be_lower_case():
    with pytest.raises(ValueError, match="already registered"):
        register("p2p", build_loop)
    with pytest.raises(ValueError, match="lower-case"):
        register("Loop", build_loop)
    assert "Loop" not in registry.TRANSPORTS
