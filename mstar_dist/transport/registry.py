"""The transport registry: every data-plane transport by name, and how a rank builds it (docs/architecture.md §7).

Adding a transport is one new file plus one entry here:

1. ``mstar_dist/transport/<name>.py`` holds a class implementing ``transport.base.DataPlane`` whose ``name`` is
   ``"<name>"`` (one that lends its own memory until the consumer acknowledges subclasses
   ``transport.arena.ArenaTransport``), and a module-level ``build(setup: TransportSetup) -> DataPlane`` that
   makes this rank's instance from what the rank knows (:class:`TransportSetup`).
2. ``TRANSPORTS`` below gains the line ``"<name>": "mstar_dist.transport.<name>:build"``.

Nothing else names transports. The config's ``transport.intra_host``/``inter_host`` checks and the serve CLI's
``--intra-host-tensor-protocol``/``--inter-host-tensor-protocol`` choices read ``names()``; a rank's startup
builds the transports its peers need with ``build_transports`` and hands them to the ``Router``, which picks one
per tensor by the consumer's host, meters every transfer and dispatches each receive by the descriptor's
``via``. Tests (and plugins) add one at run time with ``register``.

The descriptor's ``at`` is one of the ``m.Location`` structs of ``control/messages.py`` (or None, for a
transport whose sends and receives pair up in order, like p2p): a transport that needs a location of a new shape
adds its struct there too, since the wire types never import a transport.

This module imports neither torch nor any transport, so the config and the CLI read the names cheaply; a
transport's module is imported when a rank first builds it (Mooncake's engine is an optional package).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from mstar_dist.config.deployment import TransportConfig
    from mstar_dist.distributed.groups import PairGroup
    from mstar_dist.transport.base import DataPlane

__all__ = ["TRANSPORTS", "TransportFactory", "TransportSetup", "build", "build_transports", "names", "register",
           "unregister"]


@dataclass(frozen=True)
class TransportSetup:
    """What a transport's ``build`` gets: what this rank knows that some transport needs."""

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
    """This rank's directed pair groups (p2p): every rank creates them together, before any transport is built,
    whether or not it needs p2p itself."""


TransportFactory = Callable[[TransportSetup], "DataPlane"]
"""Builds this rank's instance of one transport."""

TRANSPORTS: dict[str, str | TransportFactory] = {
    "p2p": "mstar_dist.transport.p2p:build",
    "mooncake": "mstar_dist.transport.mooncake:build",
    "shm": "mstar_dist.transport.shm:build",
}
"""Transport name -> its factory: ``"module:function"`` (imported when first built) or the callable itself."""

_NAME = re.compile(r"[a-z][a-z0-9_]*")


def names() -> tuple[str, ...]:
    """Every transport name a config or the command line may choose, in registration order."""
    return tuple(TRANSPORTS)


def register(name: str, factory: str | TransportFactory) -> None:
    """Add transport ``name`` (lower-case letters, digits, ``_``) built by ``factory``. ValueError if the name is
    malformed or taken."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"transport name {name!r} must be lower-case letters, digits and '_', starting with a letter")
    if name in TRANSPORTS:
        raise ValueError(f"transport {name!r} is already registered")
    TRANSPORTS[name] = factory


def unregister(name: str) -> None:
    """Remove transport ``name`` (KeyError if it is not registered)."""
    del TRANSPORTS[name]


def build(name: str, setup: TransportSetup) -> DataPlane:
    """This rank's instance of transport ``name``. ValueError naming the registered ones for an unknown name;
    whatever the factory raises when the transport cannot start."""
    try:
        factory = TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; registered: {', '.join(TRANSPORTS)}") from None
    if isinstance(factory, str):
        module, _, function = factory.partition(":")
        factory = getattr(importlib.import_module(module), function)
    plane = factory(setup)
    if plane.name != name:
        plane.close()
        raise ValueError(f"transport {name!r} built a transport named {plane.name!r}: descriptors carry the name "
                         f"and the consumer dispatches on it, so the two must agree")
    return plane


def build_transports(wanted: Iterable[str], setup: TransportSetup) -> dict[str, DataPlane]:
    """The transports in ``wanted``, by name (in name order); if one fails, those already built are closed
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
