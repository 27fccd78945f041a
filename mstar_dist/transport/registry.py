"""The transport registry: every data-plane transport by name, and where its factory is (docs/architecture.md §7).

Adding a transport is one new file plus one entry here:

1. ``mstar_dist/transport/<name>.py`` holds a class implementing ``transport.base.DataPlane`` whose ``name`` is
   ``"<name>"`` (one that lends its own memory until the consumer acknowledges subclasses
   ``transport.arena.ArenaTransport``), and a module-level ``build(setup: TransportSetup) -> DataPlane`` that
   makes this rank's instance from what the rank knows (``transport.plane.TransportSetup``).
2. ``TRANSPORTS`` below gains the line ``"<name>": "mstar_dist.transport.<name>:build"``.

Nothing else names transports. The config's ``transport.intra_host``/``inter_host`` checks and the serve CLI's
``--intra-host-tensor-protocol``/``--inter-host-tensor-protocol`` choices read ``names()``; a rank's startup
builds the transports its peers need (``transport.plane.build_transports``) and hands them to the ``Router``,
which picks one per tensor by the consumer's host, meters every transfer and dispatches each receive by the
descriptor's ``via``. Tests (and plugins) add one at run time with ``register``.

The descriptor's ``at`` says where the bytes wait: None for a transport whose sends and receives pair up in order
(p2p), or the transport's own location type encoded into ``m.EncodedLocation`` (the wire types never import a
transport, so a new one needs no struct in ``control/messages.py``; shm and mooncake have theirs there because
they came first).

This module imports neither torch, nor the config, nor any transport: the config and the CLI read the names
without an import circle or a heavy import, and a transport's module is imported only when a rank first builds
it (Mooncake's engine is an optional package).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mstar_dist.transport.base import DataPlane

__all__ = ["TRANSPORTS", "TransportFactory", "factory", "names", "register", "unregister"]

TransportFactory = Callable[..., "DataPlane"]
"""Builds this rank's instance of one transport from a ``transport.plane.TransportSetup`` (its one argument)."""

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


def factory(name: str) -> TransportFactory:
    """The factory of transport ``name`` (its module imported now if it was not yet). ValueError naming the
    registered ones for an unknown name."""
    try:
        found = TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; registered: {', '.join(TRANSPORTS)}") from None
    if isinstance(found, str):
        module, _, function = found.partition(":")
        found = getattr(importlib.import_module(module), function)
    return found
