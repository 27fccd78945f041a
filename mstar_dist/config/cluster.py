"""Cluster spec (hosts, their devices, the static global-rank layout) and this process's rank identity.

Index spaces: ``node_rank`` is a host's position in the spec's ``hosts`` list; ``local_rank`` is a process's
position within its host (0..len(devices)-1); ``device_index`` is the GPU index ``devices[local_rank]``;
``global_rank`` is the *logical* rank from the spec: host k holds the global ranks that follow the devices of
hosts 0..k-1. torchrun's RANK equals ``global_rank`` under static rendezvous and may differ under c10d rendezvous;
the runtime uses ``global_rank`` everywhere (see `identify`).

Everything here is pure: it reads plain values and an env mapping, never the process group.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mstar_dist.config.schema import (
    ConfigError,
    check_keys,
    fail,
    join,
    read_int,
    read_list,
    read_mapping,
    read_str,
    read_unique_ints,
)

# torchrun's per-process variables, and the overrides that name the node rank explicitly.
ENV_RANK = "RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
ENV_GROUP_RANK = "GROUP_RANK"
ENV_GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
ENV_NODE_RANK_OVERRIDES = ("MSTAR_NODE_RANK", "SLURM_NODEID")
"""Checked in this order; the first one set names this process's node rank (spec host index)."""


@dataclass(frozen=True)
class HostSpec:
    """One machine of the cluster and the devices torchrun runs a process on."""

    name: str
    """Host name, unique in the spec; used in messages and matched against the machine's hostname."""
    addr: str
    """Address the host's ranks bind their control-plane sockets on (and that other hosts reach)."""
    devices: tuple[int, ...]
    """GPU indices, one process each, in local_rank order; YAML may give an int N meaning 0..N-1."""
    transfer_device: str | None = None
    """NIC for the data plane (e.g. ``mlx5_0``) where the transport needs one; None = transport default."""
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    """Environment variables set for this host's ranks (e.g. ``NCCL_SOCKET_IFNAME``)."""
    advertise_addr: str | None = None
    """The address other hosts reach this host's control sockets at, when it is not ``addr`` (a host behind NAT, or
    one that binds every interface: ``addr: 0.0.0.0``). None: ``addr``."""
    control_ports: tuple[int, int] | None = None
    """``[lo, hi]`` (inclusive): the ports this host's control sockets (its ranks', and the front end's on rank 0's
    host) bind, for a firewall that opens only those; None: ephemeral ports. It needs a port per process."""

    def __post_init__(self) -> None:
        read_str(self.name, "name")
        read_str(self.addr, "addr")
        if self.advertise_addr is not None:
            read_str(self.advertise_addr, "advertise_addr")
        object.__setattr__(self, "devices", read_unique_ints(self.devices, "devices", minimum=0))
        if self.control_ports is not None:
            object.__setattr__(self, "control_ports", _read_port_range(self.control_ports, len(self.devices)))
        if self.transfer_device is not None:
            read_str(self.transfer_device, "transfer_device")
        env = read_mapping(self.env, "env")
        for k, v in env.items():
            if not isinstance(v, str):
                raise fail(join("env", k), v, f"environment values must be strings (quote it), got {type(v).__name__}")
        object.__setattr__(self, "env", dict(env))

    def to_dict(self) -> dict[str, Any]:
        """The YAML form of this host (parses back to an equal `HostSpec`)."""
        out: dict[str, Any] = {"name": self.name, "addr": self.addr, "devices": list(self.devices)}
        if self.transfer_device is not None:
            out["transfer_device"] = self.transfer_device
        if self.env:
            out["env"] = dict(self.env)
        if self.advertise_addr is not None:
            out["advertise_addr"] = self.advertise_addr
        if self.control_ports is not None:
            out["control_ports"] = list(self.control_ports)
        return out

    @property
    def reached_at(self) -> str:
        """The address other hosts reach this host at (``advertise_addr``, else ``addr``)."""
        return self.advertise_addr or self.addr


def _read_port_range(value: Any, processes: int) -> tuple[int, int]:
    """``[lo, hi]`` with 1 <= lo <= hi <= 65535 and room for ``processes`` ranks plus a front end."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or len(value) != 2:
        raise fail("control_ports", value, "must be [lo, hi], two port numbers (inclusive)")
    lo = read_int(value[0], "control_ports[0]", minimum=1, maximum=65535)
    hi = read_int(value[1], "control_ports[1]", minimum=1, maximum=65535)
    if hi < lo:
        raise fail("control_ports", list(value), "the first port must not be above the second")
    if hi - lo + 1 < processes + 1:
        raise fail("control_ports", list(value), f"holds {hi - lo + 1} port(s); this host runs {processes} rank(s) "
                   f"and maybe the front end: give at least {processes + 1}")
    return (lo, hi)


@dataclass(frozen=True)
class RankInfo:
    """Where one process sits: its logical global rank, host and device."""

    global_rank: int
    """Logical global rank from the cluster spec (the index space placement uses)."""
    node_rank: int
    """Index of this rank's host in the spec's ``hosts``."""
    host_name: str
    """`HostSpec.name` of the host."""
    addr: str
    """`HostSpec.addr` of the host: where its control sockets bind."""
    local_rank: int
    """Index of this process within its host: 0..len(devices)-1. Not a global rank."""
    device_index: int
    """GPU index on the host: ``devices[local_rank]``."""


@dataclass(frozen=True)
class ClusterSpec:
    """The hosts of a deployment, in node-rank order; global ranks are laid out host after host."""

    hosts: tuple[HostSpec, ...]
    """Hosts in node-rank order; host k holds global ranks first_rank(k)..first_rank(k)+len(devices)-1."""

    def __post_init__(self) -> None:
        hosts = read_list(self.hosts, "hosts")
        for i, h in enumerate(hosts):
            if not isinstance(h, HostSpec):
                raise fail(join("hosts", i), h, f"must be a HostSpec, got {type(h).__name__}")
        object.__setattr__(self, "hosts", hosts)
        _check_distinct_hosts(hosts)

    @property
    def world_size(self) -> int:
        """Number of processes over all hosts (sum of their device counts)."""
        return sum(len(h.devices) for h in self.hosts)

    def first_rank(self, node_rank: int) -> int:
        """Global rank of local_rank 0 on host `node_rank`."""
        self._check_node_rank(node_rank)
        return sum(len(h.devices) for h in self.hosts[:node_rank])

    def ranks_on_host(self, node_rank: int) -> tuple[int, ...]:
        """Global ranks of host `node_rank`, in local_rank order."""
        first = self.first_rank(node_rank)
        return tuple(range(first, first + len(self.hosts[node_rank].devices)))

    def rank_info(self, global_rank: int) -> RankInfo:
        """Host, local rank and device of logical `global_rank`."""
        if not 0 <= global_rank < self.world_size:
            raise ValueError(
                f"global rank {global_rank} is outside the cluster: {len(self.hosts)} hosts list "
                f"{self.world_size} devices, global ranks 0..{self.world_size - 1}"
            )
        first = 0
        for node_rank, host in enumerate(self.hosts):
            if global_rank < first + len(host.devices):
                local_rank = global_rank - first
                return RankInfo(global_rank, node_rank, host.name, host.addr, local_rank, host.devices[local_rank])
            first += len(host.devices)
        raise AssertionError("unreachable: global_rank was range-checked")

    def rank_hosts(self) -> dict[int, str]:
        """Host name of every global rank."""
        return {r: self.hosts[k].name for k in range(len(self.hosts)) for r in self.ranks_on_host(k)}

    def to_dict(self) -> dict[str, Any]:
        """The YAML form (the ``cluster:`` section) of this spec."""
        return {"hosts": [h.to_dict() for h in self.hosts]}

    def _check_node_rank(self, node_rank: int) -> None:
        if not 0 <= node_rank < len(self.hosts):
            raise ValueError(
                f"node rank {node_rank} is past the cluster's hosts: it lists {len(self.hosts)} hosts "
                f"(node ranks 0..{len(self.hosts) - 1}: {_host_list(self.hosts)})"
            )


def _check_distinct_hosts(hosts: tuple[HostSpec, ...]) -> None:
    by_name: dict[str, int] = {}
    for j, h in enumerate(hosts):
        if h.name in by_name:
            raise fail(join(join("hosts", j), "name"), h.name, f"duplicates hosts[{by_name[h.name]}].name")
        by_name[h.name] = j
        for i, g in enumerate(hosts[:j]):
            shared = sorted(set(g.devices) & set(h.devices))
            if g.addr == h.addr and shared:
                raise fail(
                    join(join("hosts", j), "devices"), list(h.devices),
                    f"host {h.name!r} has addr {h.addr} like host {g.name!r} (hosts[{i}]) and lists the same "
                    f"device(s) {shared}: one machine's device can serve one rank only",
                )


def _host_list(hosts: Sequence[HostSpec]) -> str:
    return ", ".join(f"{h.name!r}" for h in hosts)


def parse_cluster(data: Any, source: str | None = None, key: str = "cluster") -> ClusterSpec:
    """The ``cluster:`` section of a deployment file as a `ClusterSpec`; `ConfigError` names key and file."""
    try:
        section = check_keys(data, "", required=("hosts",))
        hosts = tuple(_parse_host(h, join("hosts", i)) for i, h in enumerate(read_list(section["hosts"], "hosts")))
        return ClusterSpec(hosts)
    except ConfigError as e:
        raise e.under(key, source) from None


def _parse_host(data: Any, key: str) -> HostSpec:
    h = check_keys(data, key, required=("name", "addr", "devices"),
                   optional=("transfer_device", "env", "advertise_addr", "control_ports"))
    devices = h["devices"]
    if isinstance(devices, int) and not isinstance(devices, bool):
        devices = tuple(range(read_int(devices, join(key, "devices"), minimum=1)))
    try:
        return HostSpec(h["name"], h["addr"], devices, h.get("transfer_device"), h.get("env", {}),
                        h.get("advertise_addr"), h.get("control_ports"))
    except ConfigError as e:
        raise e.under(key) from None


def default_cluster(world_size: int, local_world_size: int | None = None) -> ClusterSpec:
    """The cluster for a config without ``cluster:``: one host ``localhost`` (127.0.0.1), devices 0..N-1.

    A missing ``cluster:`` section means one host (docs/architecture.md §3). If torchrun runs several nodes
    (``local_world_size != world_size``), that is a ValueError asking for a ``cluster:`` section.
    """
    read_int(world_size, "WORLD_SIZE", minimum=1)
    if local_world_size is not None and local_world_size != world_size:
        raise ValueError(
            f"the config has no cluster: section, which means one host, but torchrun runs WORLD_SIZE={world_size} "
            f"processes with LOCAL_WORLD_SIZE={local_world_size} on this node: add a cluster: section listing "
            f"every host and its devices"
        )
    return ClusterSpec((HostSpec("localhost", "127.0.0.1", tuple(range(world_size))),))


def machine_names() -> set[str]:
    """This machine's host names and addresses: what `identify` matches against the spec's hosts."""
    names = {socket.gethostname(), socket.getfqdn()}
    try:
        names.update(info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None))
    except OSError:
        pass
    return names


def device_for(rank_info: RankInfo, cuda_available: bool) -> str:
    """Torch device string for a rank: ``"cpu"`` without CUDA, else ``"cuda:{device_index}"``."""
    return f"cuda:{rank_info.device_index}" if cuda_available else "cpu"


def identify(spec: ClusterSpec, env: Mapping[str, str], hostnames: set[str] | None = None) -> RankInfo:
    """This process's logical rank, host and device, checked against torchrun's variables in `env`.

    Which spec host this process is on (its node rank k), first match wins:
      1. ``MSTAR_NODE_RANK``, then ``SLURM_NODEID``, if set: k is that value.
      2. `hostnames` (the caller passes ``socket.gethostname()`` and the machine's IP addresses): the spec
         hosts whose ``name`` or ``addr`` is among them (loopback names/addresses never count: every
         machine has them). If GROUP_RANK's host is among the matches, or nothing matches, go on to 3;
         if exactly one other host matches, k is that host; several other matches are a ValueError
         asking for ``MSTAR_NODE_RANK``.
      3. ``GROUP_RANK``: under static rendezvous (``--node-rank k``) node rank k is spec host k.
    With k from GROUP_RANK the torch RANK must equal the logical global rank (first rank of host k +
    LOCAL_RANK). With k from 1 or 2 (c10d rendezvous assigns GROUP_RANK in arbitrary order) RANK may
    differ: the process joins the process group with its logical global rank all the same (torchrun's agent store
    accepts any permutation), so no rank number of torchrun's is used past this point.

    Every mismatch is a ValueError naming the host, node rank and the numbers on both sides. Pure: reads
    `env` only.
    """
    torch_rank = _env_int(env, ENV_RANK)
    world_size = _env_int(env, ENV_WORLD_SIZE)
    local_rank = _env_int(env, ENV_LOCAL_RANK)
    local_world_size = _env_int(env, ENV_LOCAL_WORLD_SIZE)
    group_rank = _env_int(env, ENV_GROUP_RANK, required=False)
    n_hosts = len(spec.hosts)
    _check_world(spec, env, world_size)
    node_rank, how = _node_rank(spec, env, hostnames, group_rank)
    if not 0 <= node_rank < n_hosts:
        raise ValueError(
            f"node rank {node_rank} (from {how}) is past the cluster's hosts: the spec lists {n_hosts} hosts "
            f"(node ranks 0..{n_hosts - 1}: {_host_list(spec.hosts)})"
        )
    host = spec.hosts[node_rank]
    where = f"cluster host {host.name!r} (node rank {node_rank}, from {how})"
    if local_world_size != len(host.devices):
        raise ValueError(
            f"{where} lists {len(host.devices)} devices {list(host.devices)} but torchrun started "
            f"LOCAL_WORLD_SIZE={local_world_size} processes there"
        )
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"{where}: LOCAL_RANK={local_rank} is outside 0..{local_world_size - 1} (LOCAL_WORLD_SIZE)")
    info = spec.rank_info(spec.first_rank(node_rank) + local_rank)
    if how.startswith(ENV_GROUP_RANK) and torch_rank != info.global_rank:
        first, last = spec.ranks_on_host(node_rank)[0], spec.ranks_on_host(node_rank)[-1]
        raise ValueError(
            f"{where} holds global ranks {first}..{last} (after {first} devices on earlier hosts), so "
            f"LOCAL_RANK={local_rank} is global rank {info.global_rank}, but torchrun gave RANK={torch_rank}: "
            f"the hosts before it run other device counts than the spec lists"
        )
    return info


def _check_world(spec: ClusterSpec, env: Mapping[str, str], world_size: int) -> None:
    """torchrun's WORLD_SIZE (and GROUP_WORLD_SIZE, when set) against the spec's devices and hosts; ValueError naming
    both sides."""
    n_hosts = len(spec.hosts)
    if world_size != spec.world_size:
        raise ValueError(
            f"torchrun started WORLD_SIZE={world_size} processes but the cluster spec lists {spec.world_size} "
            f"devices over {n_hosts} hosts ({', '.join(f'{h.name!r}: {len(h.devices)}' for h in spec.hosts)})"
        )
    group_world_size = _env_int(env, ENV_GROUP_WORLD_SIZE, required=False)
    if group_world_size is not None and group_world_size != n_hosts:
        raise ValueError(
            f"torchrun runs GROUP_WORLD_SIZE={group_world_size} nodes but the cluster spec lists {n_hosts} hosts "
            f"({_host_list(spec.hosts)})"
        )


def _env_int(env: Mapping[str, str], name: str, required: bool = True) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        if required:
            raise ValueError(f"environment variable {name} is not set: start mstar_dist with torchrun")
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"environment variable {name}={value} is negative")
    return value


def _node_rank(
    spec: ClusterSpec, env: Mapping[str, str], hostnames: set[str] | None, group_rank: int | None
) -> tuple[int, str]:
    """(node rank, where it came from) per the order documented in `identify`."""
    for name in ENV_NODE_RANK_OVERRIDES:
        value = _env_int(env, name, required=False)
        if value is not None:
            return value, f"{name}={value}"
    matches = _matching_hosts(spec, hostnames or set())
    if matches and group_rank not in matches:
        if len(matches) == 1:
            (k,) = matches
            return k, f"host name/address match {matches[k]!r}"
        listed = ", ".join(f"{spec.hosts[k].name!r} (node rank {k})" for k in sorted(matches))
        raise ValueError(
            f"this machine's names/addresses match several cluster hosts, {listed}, and GROUP_RANK={group_rank} "
            f"is none of them: set MSTAR_NODE_RANK to this host's index in the spec"
        )
    if group_rank is None:
        raise ValueError(
            f"cannot tell which cluster host this is: GROUP_RANK, MSTAR_NODE_RANK and SLURM_NODEID are unset and "
            f"no host name/addr of the spec ({_host_list(spec.hosts)}) is among {sorted(hostnames or ())}"
        )
    return group_rank, f"{ENV_GROUP_RANK}={group_rank}"


def _matching_hosts(spec: ClusterSpec, hostnames: set[str]) -> dict[int, str]:
    """Node rank -> the matched token, for spec hosts named by a non-loopback entry of `hostnames`."""
    tokens = {t for t in hostnames if t and not _is_loopback(t)}
    tokens |= {t.split(".")[0] for t in tokens if not _is_ip(t)}  # short name of an FQDN
    found: dict[int, str] = {}
    for k, h in enumerate(spec.hosts):
        for token in (h.name, h.addr):
            if token in tokens and not _is_loopback(token):
                found.setdefault(k, token)
    return found


def _is_ip(token: str) -> bool:
    try:
        ipaddress.ip_address(token)
    except ValueError:
        return False
    return True


def _is_loopback(token: str) -> bool:
    if token in ("localhost", "ip6-localhost", "ip6-loopback"):
        return True
    return _is_ip(token) and ipaddress.ip_address(token).is_loopback
