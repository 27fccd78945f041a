"""Deployment config: the YAML file (docs/architecture.md §3) as one immutable, checked `DeploymentConfig`.

Every rank parses the same file into an equal object. Mistakes are `ConfigError` (a ValueError) naming the
full key path (``node_groups[1].tp_size``), the value and the file. Placement against the model's walks is
checked later, in `mstar_dist.topology.placement`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from mstar_dist.config.cluster import ClusterSpec, default_cluster, parse_cluster
from mstar_dist.config.engine import EngineConfig, check_model_kwargs, check_overrides
from mstar_dist.config.schema import (
    ConfigError,
    check_keys,
    fail,
    join,
    read_choice,
    read_int,
    read_list,
    read_mapping,
    read_positive_float,
    read_str,
    read_unique_ints,
    read_unique_strs,
)
from mstar_dist.transport import registry

MOONCAKE_PROTOCOLS = ("tcp", "rdma")
"""Values of ``transport.mooncake_protocol``."""
TOOL_CALL_PARSER_SETTINGS = ("auto", "none", "hermes", "llama3_json")
"""Values of ``server.tool_call_parser`` (the formats are server/tool_calls.py's)."""


@dataclass(frozen=True)
class NodeGroup:
    """Graph nodes placed on a set of ranks for some walks."""

    node_names: tuple[str, ...]
    """Graph node names (components) placed here; each must be a node of every walk in graph_walks."""
    ranks: tuple[int, ...]
    """Global ranks hosting these nodes: len(ranks) = replicas x tp_size; each consecutive chunk of tp_size
    ranks is one replica, and ranks[i] is TP shard i % tp_size."""
    graph_walks: tuple[str, ...]
    """Walks these nodes serve on these ranks; the same node name in several walks is one component."""
    tp_size: int = 1
    """Tensor-parallel degree of each replica. 1 means no TP."""
    cpu_threads: int | None = None
    """Intra-op CPU threads of each of these ranks (torch.set_num_threads). None: the host's cores split evenly
    over its ranks. Ranks that idle most of the time (a prefill rank under light load) need fewer than a decode
    rank; over-subscribing the cores stalls every rank's thread pool."""
    engine: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """Keys of the deployment's ``engine:`` that these ranks' engines of these nodes run with instead (any but
    ``max_seq_len``), e.g. a larger ``prefill_token_budget`` on the prefill ranks of a P/D split."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "node_names", read_unique_strs(self.node_names, "node_names"))
        object.__setattr__(self, "ranks", read_unique_ints(self.ranks, "ranks", minimum=0))
        object.__setattr__(self, "graph_walks", read_unique_strs(self.graph_walks, "graph_walks"))
        read_int(self.tp_size, "tp_size", minimum=1)
        if self.cpu_threads is not None:
            read_int(self.cpu_threads, "cpu_threads", minimum=1)
        object.__setattr__(self, "engine", check_overrides(self.engine, "engine"))
        if len(self.ranks) % self.tp_size:
            raise fail(
                "tp_size", self.tp_size,
                f"len(ranks)={len(self.ranks)} (ranks {list(self.ranks)}) is not a multiple of tp_size={self.tp_size}",
            )

    @property
    def replica_count(self) -> int:
        """Number of data-parallel replicas: len(ranks) / tp_size."""
        return len(self.ranks) // self.tp_size

    def to_dict(self) -> dict[str, Any]:
        """The YAML form of this group."""
        return {
            "node_names": list(self.node_names),
            "ranks": list(self.ranks),
            "graph_walks": list(self.graph_walks),
            "tp_size": self.tp_size,
            **({"cpu_threads": self.cpu_threads} if self.cpu_threads is not None else {}),
            **({"engine": dict(self.engine)} if self.engine else {}),
        }


@dataclass(frozen=True)
class TransportConfig:
    """How tensors move between ranks (docs/architecture.md §7)."""

    intra_host: str = "p2p"
    """Transport when every consumer is on the producer's host: p2p | mooncake | shm (p2p = NCCL for CUDA
    tensors, gloo for host tensors; shm = a shared-memory arena, host tensors)."""
    inter_host: str = "p2p"
    """Transport when any consumer is on another host: p2p | mooncake | shm (shm only where the "hosts" share
    /dev/shm, e.g. the one-machine rigs; a consumer that cannot open the segment fails the transfer, naming it)."""
    inline_max_bytes: int = 65536
    """Tensors of at most this many bytes ride inside the control message. 0 turns inlining off (the one
    zero this config accepts: it is a meaningful setting, not a mistake)."""
    arena_bytes: int = 268435456
    """Per rank: the shared-memory segment (shm) or registered pool (mooncake) that holds tensors until their
    consumers let go of them. A tensor bigger than this cannot use those transports."""
    backpressure_timeout_s: float = 10.0
    """How long a send waits for room in a full arena before its request fails with an error naming the arena."""
    mooncake_protocol: str = "tcp"
    """Mooncake's transport: tcp (MC_FORCE_TCP is set) | rdma (the host's ``transfer_device`` names the NIC)."""
    spin_us: int | None = None
    """Before a rank's loop sleeps in its control socket's wait, it polls without blocking for this many
    microseconds, so a descriptor or message that comes meanwhile is taken without a wake-up (tens of
    microseconds). Default: 200 on GPU ranks (cores to spare), 0 on CPU ranks (the forward needs every core)."""

    def __post_init__(self) -> None:
        read_choice(self.intra_host, "intra_host", registry.names())
        read_choice(self.inter_host, "inter_host", registry.names())
        read_int(self.inline_max_bytes, "inline_max_bytes", minimum=0)
        read_int(self.arena_bytes, "arena_bytes", minimum=1 << 20)
        object.__setattr__(self, "backpressure_timeout_s",
                           read_positive_float(self.backpressure_timeout_s, "backpressure_timeout_s"))
        read_choice(self.mooncake_protocol, "mooncake_protocol", MOONCAKE_PROTOCOLS)
        if self.spin_us is not None:
            read_int(self.spin_us, "spin_us", minimum=0, maximum=100_000)

    def spin_s(self, device_type: str) -> float:
        """``spin_us`` in seconds for a rank whose device is of ``device_type`` ("cuda" or "cpu")."""
        us = self.spin_us if self.spin_us is not None else (200 if device_type == "cuda" else 0)
        return us / 1e6

    def via(self, same_host: bool) -> str:
        """The transport for a tensor whose consumer is (``same_host``) or is not on the producer's host."""
        return self.intra_host if same_host else self.inter_host


@dataclass(frozen=True)
class Limits:
    """Admission and per-request limits enforced by the conductor."""

    max_concurrent_requests: int = 64
    """Requests in flight at once; more wait in the admission queue."""
    request_timeout_s: float = 600.0
    """Seconds a request may take, from arrival (queued time included), before it fails with a 504 and is
    aborted everywhere (its tensors and KV freed)."""
    max_tokens: int = 2048
    """The most tokens one request may ask for (a larger ask is a 4xx)."""
    rank_timeout_s: float = 30.0
    """Seconds without any message from a rank (each sends its gauges every 0.5 s) before the conductor declares
    it dead: its in-flight requests fail with a 5xx naming it and new requests avoid it. Longer than the slowest
    step (a long prefill on CPU)."""
    max_queued_requests: int = 256
    """Requests that may wait in the admission queue; beyond it a request is refused at once with a 429 and a
    ``Retry-After`` header (admitted requests keep being served). 0: no waiting at all."""

    def __post_init__(self) -> None:
        read_int(self.max_concurrent_requests, "max_concurrent_requests", minimum=1)
        read_int(self.max_queued_requests, "max_queued_requests", minimum=0)
        object.__setattr__(self, "rank_timeout_s", read_positive_float(self.rank_timeout_s, "rank_timeout_s"))
        object.__setattr__(self, "request_timeout_s", read_positive_float(self.request_timeout_s, "request_timeout_s"))
        read_int(self.max_tokens, "max_tokens", minimum=1)


@dataclass(frozen=True)
class ServerConfig:
    """Where rank 0 binds the HTTP front end."""

    host: str = "127.0.0.1"
    """Interface address for HTTP (0.0.0.0 for all)."""
    port: int = 8000
    """TCP port for HTTP, 1..65535."""
    max_body_bytes: int = 8 << 20
    """Largest HTTP request body accepted (bytes, default 8 MiB); a larger one is refused with a 413."""
    http_processes: int = 1
    """Processes that parse HTTP and frame responses, 1..64. 1: the front end's own HTTP thread does it; N > 1:
    N intake processes, each given its share of the port's connections by the front end, talk to the conductor over
    its control socket (docs/architecture.md §2, "Intake processes"), so a burst of arrivals is parsed in parallel."""
    tool_call_parser: str = "auto"
    """The format the model writes tool calls in, as vLLM's ``--tool-call-parser`` names it: ``hermes``
    (``<tool_call>{...}</tool_call>``: Qwen, Hermes), ``llama3_json`` (Llama 3.1+), ``auto`` (the one the chat
    template teaches; none found: tools are refused) or ``none`` (tools are refused). See server/tool_calls.py."""

    def __post_init__(self) -> None:
        read_str(self.host, "host")
        read_choice(self.tool_call_parser, "tool_call_parser", TOOL_CALL_PARSER_SETTINGS)
        read_int(self.port, "port", minimum=1, maximum=65535)
        read_int(self.max_body_bytes, "max_body_bytes", minimum=1)
        read_int(self.http_processes, "http_processes", minimum=1, maximum=64)


@dataclass(frozen=True)
class RestartConfig:
    """What happens when a rank dies while serving (docs/architecture.md §10): it is restarted in place, on its
    host, and rejoins the running deployment; the conductor's rank (rank 0: the front end lives beside it) is not,
    its loss ends the deployment. torchrun's own ``--max-restarts`` is another thing: it restarts every worker of a
    host (on one host, the whole world) once the deployment has exited non-zero."""

    max_restarts: int = 3
    """Restarts of one rank within ``window_s``; one more death and the rank stays down (0: never restart). A
    deployment with a walk no live rank can serve and no restart left exits non-zero."""
    backoff_s: float = 1.0
    """Seconds before the first restart within the window; each further one waits twice as long."""
    window_s: float = 300.0
    """The window over which ``max_restarts`` is counted (deaths longer ago are forgiven)."""
    retry_in_flight: bool = False
    """A request the failed replica had in flight that has streamed nothing yet runs again on another replica
    instead of failing with a 503 (a streaming client would otherwise see the start of one answer twice)."""

    def __post_init__(self) -> None:
        read_int(self.max_restarts, "max_restarts", minimum=0, maximum=1000)
        if isinstance(self.backoff_s, bool) or not isinstance(self.backoff_s, (int, float)) or \
                not 0 <= self.backoff_s <= 3600:
            raise fail("backoff_s", self.backoff_s, "must be a number of seconds in 0..3600")
        object.__setattr__(self, "backoff_s", float(self.backoff_s))
        object.__setattr__(self, "window_s", read_positive_float(self.window_s, "window_s"))
        if not isinstance(self.retry_in_flight, bool):
            raise fail("retry_in_flight", self.retry_in_flight, "must be true or false")


_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
MEDIA_DOMAIN = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*$")
"""A host name as ``media.allowed_domains`` lists it: lower-case labels of letters, digits and hyphens (no scheme,
port, path or wildcard)."""


@dataclass(frozen=True)
class MediaConfig:
    """Images and audio clips that requests carry (chat ``image_url`` / ``input_audio`` parts, ``/generate``
    files): how much of them the server accepts and where it may fetch them. A breach is a 400 naming the key and
    its value; the byte, count and URL limits are checked by the HTTP server, the pixel and duration limits by the
    model family's decoders (they travel with each request: ``mstar_dist.events.MediaLimits``)."""

    max_item_bytes: int = 10 << 20
    """Largest image or audio clip, in bytes as sent (after base64 decoding; for a URL, as downloaded)."""
    max_items: int = 16
    """Most images and audio clips together in one request."""
    max_image_pixels: int = 4096 * 4096
    """Largest decoded image, width x height (checked before the pixels are decoded: a small file can declare a
    huge image)."""
    max_audio_seconds: float = 300.0
    """Longest audio clip, in seconds of decoded audio."""
    allowed_domains: tuple[str, ...] = ()
    """Hosts whose ``http(s)`` image URLs the server fetches (exact names, e.g. ``images.example.com``). Empty (the
    default): image URLs are refused and images must come inline (``data:`` URLs, files). The CLI's
    ``--allowed-media-domains`` replaces this list. A redirect is followed only to the same host."""
    fetch_timeout_s: float = 10.0
    """Seconds one image URL may take to answer and download, redirects included."""

    def __post_init__(self) -> None:
        read_int(self.max_item_bytes, "max_item_bytes", minimum=1)
        read_int(self.max_items, "max_items", minimum=1, maximum=1024)
        read_int(self.max_image_pixels, "max_image_pixels", minimum=1)
        object.__setattr__(self, "max_audio_seconds", read_positive_float(self.max_audio_seconds, "max_audio_seconds"))
        object.__setattr__(self, "fetch_timeout_s", read_positive_float(self.fetch_timeout_s, "fetch_timeout_s"))
        domains = self.allowed_domains
        if isinstance(domains, str) or not isinstance(domains, (list, tuple)):
            raise fail("allowed_domains", domains, f"must be a list of host names, got {type(domains).__name__}")
        for i, host in enumerate(domains):
            if not (isinstance(host, str) and MEDIA_DOMAIN.match(host)):
                raise fail(join("allowed_domains", i), host, "must be a lower-case host name such as "
                           "'images.example.com' (no scheme, port, path or wildcard)")
        twice = sorted({host for host in domains if domains.count(host) > 1})
        if twice:
            raise fail("allowed_domains", list(domains), f"{twice[0]!r} is listed twice")
        object.__setattr__(self, "allowed_domains", tuple(domains))

    def to_dict(self) -> dict[str, Any]:
        """The YAML form (also how the front end hands it to its intake processes)."""
        return {**dataclasses.asdict(self), "allowed_domains": list(self.allowed_domains)}


@dataclass(frozen=True, kw_only=True)
class DeploymentConfig:
    """A whole deployment file, checked: model, weights, placement, cluster, engine, transport, limits, server,
    media."""

    model: str
    """Registry key of the model family in ``models/``."""
    model_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """Keyword arguments for the model constructor: the model's own knobs (dtype, router, voice...); the engine's
    are under ``engine``."""
    weights: str | None = None
    """Weights directory (``~`` expanded); None lets the model decide (e.g. random init for tests)."""
    node_groups: tuple[NodeGroup, ...]
    """Component placement per walk; checked against the model's walks by `Placement.build`."""
    cluster: ClusterSpec | None = None
    """Hosts and devices; None = one host with WORLD_SIZE local devices (see `resolve_cluster`)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Engine policy of every rank's KV-cache engine (mstar_dist/config/engine.py), unless a node group overrides
    some of it (``NodeGroup.engine``)."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """Transport choice and inline threshold."""
    limits: Limits = field(default_factory=Limits)
    """Admission and per-request limits."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """HTTP bind address of rank 0."""
    media: MediaConfig = field(default_factory=MediaConfig)
    """Limits on the images and audio clips requests carry, and the hosts image URLs may name."""
    restart: RestartConfig = field(default_factory=RestartConfig)
    """Restarting a rank that dies while serving, and what becomes of its requests."""
    source: str = field(default="<config>", compare=False)
    """Where the config came from (file path), named in error messages; not part of equality."""

    def __post_init__(self) -> None:
        try:
            self._check()
        except ConfigError as e:
            raise e.under("", self.source) from None

    def _check(self) -> None:
        read_str(self.model, "model")
        object.__setattr__(self, "model_kwargs", dict(read_mapping(self.model_kwargs, "model_kwargs")))
        check_model_kwargs(self.model_kwargs)
        if self.weights is not None:
            object.__setattr__(self, "weights", os.path.expanduser(read_str(self.weights, "weights")))
        groups = read_list(self.node_groups, "node_groups")
        for i, g in enumerate(groups):
            if not isinstance(g, NodeGroup):
                raise fail(join("node_groups", i), g, f"must be a NodeGroup, got {type(g).__name__}")
        object.__setattr__(self, "node_groups", groups)
        for key, value, cls in (
            ("cluster", self.cluster, ClusterSpec), ("engine", self.engine, EngineConfig),
            ("transport", self.transport, TransportConfig),
            ("limits", self.limits, Limits), ("server", self.server, ServerConfig),
            ("media", self.media, MediaConfig), ("restart", self.restart, RestartConfig),
        ):
            if not (isinstance(value, cls) or (key == "cluster" and value is None)):
                raise fail(key, value, f"must be a {cls.__name__}, got {type(value).__name__}")
        if self.cluster is not None:
            ws = self.cluster.world_size
            for i, g in enumerate(groups):
                outside = [r for r in g.ranks if r >= ws]
                if outside:
                    raise fail(
                        join(join("node_groups", i), "ranks"), list(g.ranks),
                        f"rank {outside[0]} is outside the cluster: its {len(self.cluster.hosts)} hosts list "
                        f"{ws} devices, global ranks 0..{ws - 1}",
                    )
        self._check_engine_overrides()

    def _check_engine_overrides(self) -> None:
        """Two node groups that place one node on one rank must not give its engine two values of a key."""
        seen: dict[tuple[int, str, str], tuple[int, Any]] = {}
        for i, g in enumerate(self.node_groups):
            for key, value in g.engine.items():
                for rank in g.ranks:
                    for node in g.node_names:
                        first = seen.setdefault((rank, node, key), (i, value))
                        if first[1] != value:
                            raise fail(f"node_groups[{i}].engine.{key}", value,
                                       f"node_groups[{first[0]}] gives {node} on rank {rank} {first[1]!r}")

    def engine_for(self, global_rank: int, node: str) -> EngineConfig:
        """The engine config of ``node`` on ``global_rank``: ``engine`` with the overrides of the groups placing it."""
        overrides: dict[str, Any] = {}
        for g in self.node_groups:
            if g.engine and global_rank in g.ranks and node in g.node_names:
                overrides.update(g.engine)
        return self.engine.with_overrides(overrides)

    def resolve_cluster(self, world_size: int, local_world_size: int | None = None) -> ClusterSpec:
        """The ``cluster:`` spec, or the one-host default for torchrun's WORLD_SIZE/LOCAL_WORLD_SIZE."""
        return self.cluster if self.cluster is not None else default_cluster(world_size, local_world_size)

    def with_overrides(
        self,
        host: str | None = None,
        port: int | None = None,
        max_concurrent_requests: int | None = None,
        request_timeout_s: float | None = None,
        max_body_bytes: int | None = None,
        http_processes: int | None = None,
        intra_host: str | None = None,
        inter_host: str | None = None,
        allowed_media_domains: list[str] | None = None,
        max_restarts: int | None = None,
    ) -> DeploymentConfig:
        """A copy with CLI flag values in place of the file's; None keeps the file's value."""
        server = {k: v for k, v in (("host", host), ("port", port), ("max_body_bytes", max_body_bytes),
                                    ("http_processes", http_processes)) if v is not None}
        transport = {k: v for k, v in (("intra_host", intra_host), ("inter_host", inter_host)) if v is not None}
        limits = {
            k: v
            for k, v in (("max_concurrent_requests", max_concurrent_requests), ("request_timeout_s", request_timeout_s))
            if v is not None
        }
        try:
            new_server = dataclasses.replace(self.server, **server)
        except ConfigError as e:
            raise e.under("server", "command line") from None
        try:
            new_limits = dataclasses.replace(self.limits, **limits)
        except ConfigError as e:
            raise e.under("limits", "command line") from None
        try:
            new_transport = dataclasses.replace(self.transport, **transport)
        except ConfigError as e:
            raise e.under("transport", "command line") from None
        try:
            new_media = (self.media if allowed_media_domains is None
                         else dataclasses.replace(self.media, allowed_domains=tuple(allowed_media_domains)))
        except ConfigError as e:
            raise e.under("media", "command line (--allowed-media-domains)") from None
        try:
            new_restart = (self.restart if max_restarts is None
                           else dataclasses.replace(self.restart, max_restarts=max_restarts))
        except ConfigError as e:
            raise e.under("restart", "command line (--max-rank-restarts)") from None
        return dataclasses.replace(self, server=new_server, limits=new_limits, transport=new_transport,
                                   media=new_media, restart=new_restart)

    def to_dict(self) -> dict[str, Any]:
        """The YAML form; ``parse_config(cfg.to_dict(), ...) == cfg``."""
        out: dict[str, Any] = {
            "model": self.model,
            "model_kwargs": dict(self.model_kwargs),
            "weights": self.weights,
            "node_groups": [g.to_dict() for g in self.node_groups],
        }
        if self.cluster is not None:
            out["cluster"] = self.cluster.to_dict()
        out["engine"] = dataclasses.asdict(self.engine)
        out["transport"] = dataclasses.asdict(self.transport)
        out["limits"] = dataclasses.asdict(self.limits)
        out["server"] = dataclasses.asdict(self.server)
        out["media"] = self.media.to_dict()
        out["restart"] = dataclasses.asdict(self.restart)
        return out


_SECTIONS: dict[str, type] = {"engine": EngineConfig, "transport": TransportConfig, "limits": Limits,
                              "server": ServerConfig, "media": MediaConfig, "restart": RestartConfig}


def parse_config(data: Any, source: str) -> DeploymentConfig:
    """A `DeploymentConfig` from a loaded YAML mapping; `source` (the file name) is named in every error."""
    try:
        top = check_keys(
            data, "", required=("model", "node_groups"),
            optional=("model_kwargs", "weights", "cluster", *_SECTIONS),
        )
        raw_groups = read_list(top["node_groups"], "node_groups")
        groups = tuple(_parse_node_group(g, join("node_groups", i)) for i, g in enumerate(raw_groups))
        sections = {key: _parse_section(cls, _or_empty(top.get(key)), key) for key, cls in _SECTIONS.items()}
    except ConfigError as e:
        raise e.under("", source) from None
    cluster = parse_cluster(top["cluster"], source) if top.get("cluster") is not None else None
    return DeploymentConfig(
        model=top["model"], model_kwargs=_or_empty(top.get("model_kwargs")), weights=top.get("weights"),
        node_groups=groups, cluster=cluster, source=source, **sections,
    )


def _or_empty(value: Any) -> Any:
    """An absent or empty (``key:`` with nothing under it) section reads as an empty mapping."""
    return {} if value is None else value


def _parse_node_group(data: Any, key: str) -> NodeGroup:
    g = check_keys(data, key, required=("node_names", "ranks", "graph_walks"),
                   optional=("tp_size", "cpu_threads", "engine"))
    try:
        return NodeGroup(g["node_names"], g["ranks"], g["graph_walks"], g.get("tp_size", 1), g.get("cpu_threads"),
                         _or_empty(g.get("engine")))
    except ConfigError as e:
        raise e.under(key) from None


def _parse_section(cls: type, data: Any, key: str) -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    section = check_keys(data, key, required=(), optional=names)
    try:
        return cls(**section)
    except ConfigError as e:
        raise e.under(key) from None


def load_config(path: str | os.PathLike[str]) -> DeploymentConfig:
    """Read and check a deployment YAML file; errors name the file, the key path and the value."""
    source = os.fspath(path)
    with open(source, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ConfigError("", f"not valid YAML: {e}", source=source) from None
    if data is None:
        raise ConfigError("", "the file is empty", source=source)
    return parse_config(data, source)
