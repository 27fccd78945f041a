"""The launch's key-value store: torchrun's agent store, as every process of one launch reaches it
(docs/architecture.md §2, §10).

Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) the agent of node 0 hosts a TCPStore on
``MASTER_ADDR:MASTER_PORT`` for the whole launch. Any process with that environment can be its client, before,
without and after ``init_process_group``: a rank still starting, a rank restarted in place (which never joins the
world group again), its supervisor, the front end. So this store, not the default process group's, carries what a
process must find without the world group: the launch's secret, the control endpoints, the startup failure board
(``distributed/guard.py``), the supervisors' death records, and the prefixes under which a rejoining rank and its
peers form fresh pair and TP groups (``distributed/repair.py``).

Keys live under ``mstar_dist/a<attempt>/``, ``attempt`` being torchrun's ``TORCHELASTIC_RESTART_COUNT``: when
torchrun's own ``--max-restarts`` restarts the workers, nothing of the previous attempt (a failure, a secret) is read
as this one's. Outside torchrun's agent store (a test harness that starts ranks itself) :func:`launch_store` is None
and callers use the default process group's store once it exists.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["KEYS", "StoreAddress", "key", "launch_store", "read_json", "scoped", "write_json"]

KEYS = {
    "secret": "secret",
    "endpoint": "endpoint/{name}",
    "walks": "walks/{rank}",
    "weights": "weights/{node_rank}",
    "rendezvous": "rendezvous/{rank}",
    "ready": "ready/{rank}",
    "failures": "failures",
    "failed": "failed/{rank}",
    "deaths": "deaths",
    "death": "death/{n}",
    "starts": "starts/{rank}",
    "over": "over",
}
"""Every key of the launch store this runtime writes (relative to the launch's prefix): what each holds is said where
it is written (``guard.py``, ``supervisor.py``, ``channel.py``, ``rank.py``)."""


class StoreAddress:
    """Where the launch's store is, read from torchrun's environment."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.host = env.get("MASTER_ADDR", "")
        self.port = int(env.get("MASTER_PORT", "0") or 0)
        self.attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self.agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        """Whether torchrun's agent hosts the store (clients can come and go); else the default group's rank 0 does,
        from ``init_process_group`` on."""

    @property
    def usable(self) -> bool:
        return self.agent and bool(self.host) and self.port > 0

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def scoped(store: Any, attempt: int) -> Any:
    """``store`` with this launch attempt's prefix (``mstar_dist/a<attempt>/``)."""
    from torch.distributed import PrefixStore

    return PrefixStore(f"mstar_dist/a{attempt}", store)


def launch_store(env: Mapping[str, str] | None = None, timeout_s: float = 60.0) -> Any | None:
    """A new client of the launch's store under this attempt's prefix, or None outside torchrun's agent store.
    ``timeout_s`` bounds connecting and is the default of every blocking call on it. Raises (naming the address) when
    the store cannot be reached within ``timeout_s``."""
    address = StoreAddress(os.environ if env is None else env)
    if not address.usable:
        return None
    from torch.distributed import TCPStore

    try:
        store = TCPStore(address.host, address.port, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # DistStoreError / RuntimeError: never raw to the user
        raise ConnectionError(f"cannot reach the launch's store (torchrun's agent on node 0) at {address} within "
                              f"{timeout_s:g} s: {type(exc).__name__}: {exc}") from None
    return scoped(store, address.attempt)


def key(name: str, **fields: Any) -> str:
    """The store key ``name`` of :data:`KEYS` with its fields filled in."""
    return KEYS[name].format(**fields)


def read_json(store: Any, name: str, **fields: Any) -> dict[str, Any] | None:
    """The JSON record at key ``name`` (None when it is not there); never waits."""
    k = key(name, **fields)
    if not store.check([k]):
        return None
    return json.loads(store.get(k).decode())


def write_json(store: Any, record: dict[str, Any], name: str, **fields: Any) -> None:
    """Write ``record`` as JSON at key ``name``."""
    store.set(key(name, **fields), json.dumps(record))
