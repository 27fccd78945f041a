"""Building a rank's transports (docs/architecture.md §7): what a transport's factory gets (:class:`TransportSetup`)
and ``build``/``build_transports``, which look each name up in ``registry.py``.

The rank's startup creates the p2p pair groups first (every rank together, whether or not it uses p2p itself),
then builds the transports its peers need and hands them to the ``Router``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mstar_dist.transport import registry

if TYPE_CHECKING:
    import torch

    from mstar_dist.config.deployment import TransportConfig
    from mstar_dist.distributed.groups import PairGroup
    from mstar_dist.transport.base import DataPlane

__all__ = ["TransportSetup", "build", "build_transports"]


@dataclass(frozen=True)
class TransportSetup:
    """What a transport's factory gets: what this rank knows that some transport needs."""

    global_rank: int
    """This rank (global numbering)."""
    device: torch.device
    """The rank's compute device: where received tensors go unless the receive says otherwise."""
    config: TransportConfig
    """The deployment's ``transport`` section (arena size, Mooncake protocol, ...)."""
    launch_id: str
    """Unique per server instance (letters, digits, ``-``, ``_``): names what a transport leaves on the host
    (shm segments), so two servers on one host never share one."""
    host_addr: str
    """This rank's host address in the cluster spec: where a peer on another host reaches this rank."""
    transfer_device: str | None = None
    """The host's RDMA device (``cluster.hosts[k].transfer_device``); None: the transport picks."""
    pair_groups: Mapping[tuple[int, int], PairGroup] = field(default_factory=dict)
    """This rank's directed pair groups (p2p), created by every rank together before any transport is built."""


def build(name: str, setup: TransportSetup) -> DataPlane:
    """This rank's instance of transport ``name``. ValueError for a name the registry does not know, or a
    factory that built a transport of another name; whatever the factory raises when the transport cannot
    start."""
    plane = registry.factory(name)(setup)
    if plane.name != name:
        plane.close()
        raise ValueError(f"transport {name!r} built a transport named {plane.name!r}: descriptors carry the name "
                         f"and the consumer dispatches on it, so the two must agree")
    return plane


def build_transports(wanted: Iterable[str], setup: TransportSetup) -> dict[str, DataPlane]:
    """The transports in ``wanted``, by name (built in name order); if one fails, those already built are closed
    before the error goes up."""
    built: dict[str, DataPlane] = {}
    try:
        for name in sorted(set(wanted)):
            built[name] = build(name, setup)
    except BaseException:
        for plane in built.values():
            plane.close()
        raise
    return built
