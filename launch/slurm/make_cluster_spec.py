#!/usr/bin/env python3
"""Write a deployment file whose ``cluster:`` section is the SLURM allocation (used by launch/slurm/serve.sbatch).

    make_cluster_spec.py CONFIG --gpus-per-node G --out JOB.yaml [--nodelist LIST] [--host-env KEY=VALUE ...]
    make_cluster_spec.py JOB.yaml --head-addr        # prints the first host's address (the rendezvous)

One host per node of ``SLURM_JOB_NODELIST`` (or ``--nodelist``), in allocation order, so host k is the node with
``SLURM_NODEID=k``: its name is the node's name, its address what that name resolves to, its devices 0..G-1 (on
CPU, G is the number of ranks per node). ``--host-env`` entries go into every host's ``env`` (applied before a rank
initialises, e.g. ``GLOO_SOCKET_IFNAME=ib0``). The result is checked like any deployment file (every placed rank
must exist: nodes x G ranks); errors name the node or key and exit 2.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mstar_dist.config.deployment import parse_config  # noqa: E402


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list as names: ``"gpu[01-03,7],login-a"`` -> gpu01 gpu02 gpu03 gpu7 login-a.
    Several bracket groups in one name expand as a product (``r[1-2]n[1-2]``). ValueError for a malformed list."""
    names: list[str] = []
    for item in _split_top(nodelist):
        names.extend(_expand_one(item))
    if not names:
        raise ValueError(f"empty node list {nodelist!r}")
    return names


def _split_top(text: str) -> list[str]:
    items, depth, cur = [], 0, ""
    for ch in text.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in node list {text!r}")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced '[' in node list {text!r}")
    return [i for i in items + [cur] if i]


def _expand_one(item: str) -> list[str]:
    match = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", item)
    if not match:
        return [item]
    prefix, ranges, rest = match.groups()
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"bad range {part!r} in node list entry {item!r}")
        width = len(lo)
        for n in range(int(lo), int(hi or lo) + 1):
            out.extend(prefix + str(n).zfill(width) + tail for tail in _expand_one(rest))
    return out


def cluster_section(nodes: list[str], gpus_per_node: int, host_env: dict[str, str]) -> dict:
    """Hosts for the nodes, in order. Nodes whose names resolve to one address are one machine (test clusters
    run several node daemons on one): they get consecutive device indices there instead of the same ones."""
    hosts, used = [], {}
    for name in nodes:
        try:
            addr = socket.gethostbyname(name)
        except OSError as exc:
            raise ValueError(f"node {name!r} of the allocation does not resolve to an address: {exc}") from None
        first = used.get(addr, 0)
        used[addr] = first + gpus_per_node
        host = {"name": name, "addr": addr, "devices": list(range(first, first + gpus_per_node))}
        if host_env:
            host["env"] = dict(host_env)
        hosts.append(host)
    return {"hosts": hosts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", help="deployment YAML (its cluster: section, if any, is replaced)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="ranks per node (GPUs; on CPU, processes)")
    p.add_argument("--nodelist", default=os.environ.get("SLURM_JOB_NODELIST"),
                   help="SLURM host list (default: $SLURM_JOB_NODELIST)")
    p.add_argument("--host-env", action="append", default=[], metavar="KEY=VALUE", help="env of every host")
    p.add_argument("--out", help="where to write the deployment file")
    p.add_argument("--head-addr", action="store_true", help="print the first host's address of CONFIG and exit")
    args = p.parse_args(argv)
    data = yaml.safe_load(Path(args.config).read_text())
    try:
        if args.head_addr:
            print(data["cluster"]["hosts"][0]["addr"])
            return 0
        if not args.nodelist or args.gpus_per_node is None or not args.out:
            raise ValueError("need --nodelist (or SLURM_JOB_NODELIST), --gpus-per-node and --out")
        if args.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
        env = dict(kv.split("=", 1) for kv in args.host_env if "=" in kv)
        if len(env) != len(args.host_env):
            raise ValueError(f"--host-env takes KEY=VALUE, got {args.host_env}")
        data["cluster"] = cluster_section(expand_nodelist(args.nodelist), args.gpus_per_node, env)
        parse_config(data, f"{args.config} on {args.nodelist}")  # the same checks as at startup
    except (ValueError, KeyError) as exc:
        print(f"make_cluster_spec: error: {exc}", file=sys.stderr)
        return 2
    Path(args.out).write_text(yaml.safe_dump(data, sort_keys=False))
    hosts = ", ".join(f"{h['name']}={h['addr']}" for h in data["cluster"]["hosts"])
    print(f"make_cluster_spec: {len(data['cluster']['hosts'])} host(s) x {args.gpus_per_node}: {hosts} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
