"""The deployment: config + cluster + model + placement, built alike by every rank and the front end
(docs/architecture.md §2 step 1), and the startup checks that need the model (weights, TP, walks).

Pure: a function of the files, the command line's overrides and torchrun's world size; the launch's secret is
filled in once the ranks have shared it (``dataclasses.replace(dep, token=...)``).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mstar_dist.config.cluster import ClusterSpec
from mstar_dist.config.deployment import DeploymentConfig, load_config
from mstar_dist.config.schema import ConfigError
from mstar_dist.graph.model import CompositeModel, Layout
from mstar_dist.graph.nodes import iter_nodes, node_names
from mstar_dist.random_weights import weights_label
from mstar_dist.runtime.registry import model_class
from mstar_dist.topology.cuts import cut_signals, describe_cross_host, describe_cuts, flows
from mstar_dist.topology.placement import Placement


@dataclass(frozen=True)
class Deployment:
    """Config + cluster + model + placement: a pure function of the files and torchrun's world size."""

    config: DeploymentConfig
    """The parsed YAML with the command line's overrides."""
    cluster: ClusterSpec
    """The hosts and their devices (the config's ``cluster:``, or one host of torchrun's size)."""
    model: CompositeModel
    """The model family, configured with the deployment's layout (its walks are built)."""
    placement: Placement
    """Replicas per (walk, node), TP groups and the data plane's edge pairs."""
    token: str = ""
    """The control-plane secret of this launch (``share_secret``); empty until the ranks have shared it."""

    @classmethod
    def build(cls, config: DeploymentConfig, world_size: int, local_world_size: int | None) -> Deployment:
        """Resolve the cluster, make and configure the family, place its walks; ValueError (or ``ConfigError``)
        naming the key for every mistake the config can hold."""
        cluster = config.resolve_cluster(world_size, local_world_size)
        model = model_class(config.model)(config.weights, **dict(config.model_kwargs))
        check_weights(config, model)
        model.configure(Layout.from_node_groups(config.node_groups), config.engine)
        walks = {walk: node_names(section) for walk, section in model.graphs().items()}
        placement = Placement.build(config, walks, cluster.world_size,
                                    flows(model.graphs(), model.partitions(), model.streaming_edges()))
        check_tp(config, model, walks)
        check_one_producer_per_stream(model)
        return cls(config=config, cluster=cluster, model=model, placement=placement)

    def describe(self) -> str:
        """The dry run and startup report: rank map, placement per walk (replicas), TP groups, the data plane's
        transports and the pair groups it creates, cross-host rank pairs with their transport, every cut edge, and
        every graph edge that crosses hosts."""
        cuts = cut_signals(self.model.graphs(), self.model.streaming_edges(), self.placement, self.model.partitions())
        return "\n".join([
            f"deployment: model {self.config.model}, {self.config.source}",
            self.placement.describe_ranks(self.cluster),
            self.placement.describe(self.cluster, self.config.transport),
            self.placement.describe_groups(self.p2p_pairs, self.config.transport),
            describe_cuts(cuts),
            describe_cross_host(cuts, self.cluster.rank_hosts(), self.config.transport.inter_host),
        ])

    def via(self, src: int, dst: int) -> str:
        """The transport of tensors from global rank ``src`` to ``dst`` (their hosts decide)."""
        hosts = self.cluster.rank_hosts()
        return self.config.transport.via(hosts[src] == hosts[dst])

    @property
    def p2p_pairs(self) -> tuple[tuple[int, int], ...]:
        """The edge pairs that travel on p2p: the pair groups every rank creates, in this order."""
        return tuple(p for p in self.placement.edge_pairs if self.via(*p) == "p2p")

    def walks_digest(self) -> str:
        """A digest of the model's walks: ranks compare it at startup (a family must build the same walks
        everywhere)."""
        graphs = self.model.graphs()
        return hashlib.sha256(repr(sorted(graphs.items(), key=lambda kv: kv[0])).encode()).hexdigest()[:16]


def load_deployment(args: argparse.Namespace, world_size: int | None, local_ws: int | None) -> Deployment:
    """The deployment of ``args.config`` with the command line's overrides (every rank and the front end build
    the same one). ``world_size`` None: torchrun's is unknown (a dry run sizes the world from the config)."""
    config = load_config(args.config).with_overrides(
        host=args.host, port=args.port, max_concurrent_requests=args.max_concurrent_requests,
        request_timeout_s=args.request_timeout, max_body_bytes=args.max_body_bytes,
        http_processes=args.http_processes, intra_host=args.intra_host_tensor_protocol,
        inter_host=args.inter_host_tensor_protocol,
        allowed_media_domains=args.allowed_media_domains,
        max_restarts=getattr(args, "max_rank_restarts", None),
    )
    if world_size is None:
        world_size = _world_from_config(config) if args.dry_run else 1
    return Deployment.build(config, world_size, local_ws)


def torchrun_sizes(env: Mapping[str, str]) -> tuple[int | None, int | None]:
    """(WORLD_SIZE, LOCAL_WORLD_SIZE) torchrun gave this process; None for each it did not set."""
    world = int(env.get("WORLD_SIZE", "0")) or None
    return world, int(env["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in env else None


def _world_from_config(config: DeploymentConfig) -> int:
    """The world a dry run checks without torchrun: the cluster spec's, else the highest placed rank + 1."""
    if config.cluster is not None:
        return config.cluster.world_size
    return 1 + max(r for g in config.node_groups for r in g.ranks)


def check_weights(config: DeploymentConfig, model: CompositeModel) -> None:
    """``weights:`` must exist unless the family prepares that path itself: its ``default_weights_dir``, or any
    path of a family that decides in ``prepare_weights`` (checked there, at load). A family that prepares its default
    path would fill any existing directory too: one other than the default must already hold a checkpoint (its
    ``config.json``), so a wrong folder is named instead of receiving a conversion. ConfigError naming the key."""
    path = config.weights
    if path is None:
        return
    default = type(model).default_weights_dir
    is_default = default is not None and os.path.realpath(path) == os.path.realpath(os.path.expanduser(default))
    if os.path.exists(path):
        if default is not None and not is_default and not os.path.exists(os.path.join(path, "config.json")):
            raise ConfigError("weights", f"is not a checkpoint (no config.json in it; only the default {default} is "
                              "prepared automatically)", repr(path), config.source)
        return
    if is_default:
        return
    if default is None and type(model).prepare_weights is not CompositeModel.prepare_weights:
        return
    also = f" (only the default {default} is prepared automatically)" if default else ""
    raise ConfigError("weights", f"no such directory{also}", repr(path), config.source)


def check_tp(config: DeploymentConfig, model: CompositeModel, walks: dict[str, frozenset[str]]) -> None:
    """tp_size > 1 only for nodes whose family shards them, and one tp_size per node across walks (P/D with TP
    moves each TP rank's KV shard to its counterpart, so both sides must shard alike)."""
    sizes: dict[str, tuple[int, int]] = {}
    for i, group in enumerate(config.node_groups):
        for node in group.node_names:
            if group.tp_size > 1 and node not in model.tp_nodes:
                raise ValueError(f"node_groups[{i}].tp_size = {group.tp_size}: node {node!r} of model {model.name!r} "
                                 f"does not support tensor parallelism (nodes that do: {sorted(model.tp_nodes)})")
            seen = sizes.setdefault(node, (i, group.tp_size))
            if seen[1] != group.tp_size:
                raise ValueError(f"node_groups[{i}].tp_size = {group.tp_size}: node {node!r} has tp_size {seen[1]} in "
                                 f"node_groups[{seen[0]}]; a node is sharded alike in every walk")


def check_one_producer_per_stream(model: CompositeModel) -> None:
    """Every streaming signal is produced by one walk: items from two ranks have no common order on the consumer."""
    graphs = model.graphs()
    for edge in model.streaming_edges():
        producers = [w for w, sec in graphs.items()
                     if any(e.stream and e.signal == edge.signal for n in iter_nodes(sec) for e in n.outputs)]
        if len(producers) > 1:
            raise ValueError(f"streaming edge {edge.signal!r} is produced by walks {producers}: this runtime "
                             f"needs one producing walk per streaming signal")


def check_same_walks(store: Any, rank: int, world_size: int, digest: str, timeout_s: float) -> None:
    """Publish this rank's walks digest and compare it with every other rank's (rank 0 reads all, the others read
    rank 0's); a ``RuntimeError`` names both ranks when they differ. Blocks up to ``timeout_s`` per key."""
    store.set(f"mstar_dist/walks/{rank}", digest)
    peers = range(world_size) if rank == 0 else [0]
    for peer in peers:
        key = f"mstar_dist/walks/{peer}"
        store.wait([key], datetime.timedelta(seconds=timeout_s))
        theirs = store.get(key).decode()
        if theirs != digest:
            raise RuntimeError(f"rank {rank} and rank {peer} derive different walks from the same config "
                               f"(digests {digest} and {theirs}): a model family must build its walks from the "
                               f"config alone (model_kwargs, layout); check both hosts run the same code")


def served(dep: Deployment) -> dict[str, Any]:
    """What the HTTP app tells clients about the model and its limits (the backend's attributes); ``weights``:
    "random-test" for a checkpoint with the random-weights marker, else "checkpoint" (read once the weights exist)."""
    return {"model_name": dep.config.model, "max_context_tokens": dep.model.max_context_tokens,
            "weights": weights_label(dep.model.weights_dirs()),
            "max_tokens_limit": min(dep.config.limits.max_tokens, dep.model.max_context_tokens - 1),
            "output_modality": dep.model.output_modality,
            "output_modalities": sorted(dep.model.output_modalities or {dep.model.output_modality}),
            "input_modalities": sorted(dep.model.input_modalities)}
