"""Preflight join: every host of the cluster spec checks in before torchrun starts, so a host that never joins is
named (docs/architecture.md §2).

torchrun's static rendezvous starts no worker until every agent has joined, and waits silently; our ranks never
run, so they cannot say who is missing. The launch scripts (``launch/serve_node.sh``, ``launch/slurm/serve.sbatch``)
therefore run, on every node, before torchrun:

    python -m mstar_dist.distributed.join CONFIG --node-rank K --master-addr HEAD --port PORT --timeout T

Node 0 hosts a TCPStore on HEAD:PORT (the launch scripts use torchrun's master port + 1); each node writes its
node rank and host name; node 0 waits up to T seconds for all of them and publishes the verdict. On a missing host
node 0 exits 1 with ``host 'node-b' (node rank 1 of 2, global ranks 1..1) never joined within 60 s`` and the
others, once they read that verdict, exit 1 too (a node that cannot reach node 0 at all exits 1 after T seconds
plus a few, naming node 0). Exit 0: every host is there, go on to torchrun. The whole check is bounded
(``bound_s``): a store client whose connection some other service on that port accepted waits for an answer until
that service closes the connection (seen: a join of 9 s that took 39), so past the bound the node exits 1 saying
so.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import threading
import time

from mstar_dist.config.cluster import ClusterSpec
from mstar_dist.config.deployment import load_config

GRACE_S = 5.0
"""How long past the timeout other nodes wait for node 0's verdict, and node 0 for them to read it."""


def bound_s(timeout_s: float) -> float:
    """The longest a join may take: a node other than 0 waits up to ``timeout_s + GRACE_S`` for node 0's store and
    as long again for its verdict; then one more grace."""
    return 2 * (timeout_s + GRACE_S) + GRACE_S


def missing_hosts(spec: ClusterSpec, joined: set[int], timeout_s: float) -> str:
    """The error naming every host (name, node rank, its global ranks) that is not in ``joined``."""
    lines = []
    for k, host in enumerate(spec.hosts):
        if k not in joined:
            ranks = spec.ranks_on_host(k)
            lines.append(f"host {host.name!r} (node rank {k} of {len(spec.hosts)}, addr {host.addr}, global ranks "
                         f"{ranks[0]}..{ranks[-1]}) never joined within {timeout_s:g} s")
    return "; ".join(lines)


def join(spec: ClusterSpec, node_rank: int, master_addr: str, port: int, timeout_s: float) -> str | None:
    """Check in as host ``node_rank``; node 0 waits for every host. None when all joined, else the error."""
    from torch.distributed import TCPStore

    n = len(spec.hosts)
    if not 0 <= node_rank < n:
        return f"node rank {node_rank} is not a host of the cluster spec (node ranks 0..{n - 1})"
    wait = datetime.timedelta(seconds=timeout_s + GRACE_S)
    head = spec.hosts[0]
    if node_rank != 0 and not _wait_for_listener(master_addr, port, time.monotonic() + timeout_s + GRACE_S):
        # polled ourselves: the store client's own retries back off to seconds
        return f"cannot reach host {head.name!r} (node rank 0) at {master_addr}:{port} within {timeout_s + GRACE_S:g} s"
    try:
        store = TCPStore(master_addr, port, is_master=node_rank == 0, timeout=wait, wait_for_workers=False)
    except Exception as exc:  # node 0 never came up: name it
        return (f"cannot reach host {head.name!r} (node rank 0) at {master_addr}:{port} within "
                f"{timeout_s + GRACE_S:g} s: {exc}")
    store.set(f"mstar_dist/joined/{node_rank}", socket.gethostname())
    if node_rank != 0:
        try:
            store.wait(["mstar_dist/verdict"], wait)
        except Exception as exc:
            return f"host {spec.hosts[0].name!r} (node rank 0) gave no verdict within {timeout_s + GRACE_S:g} s: {exc}"
        verdict = store.get("mstar_dist/verdict").decode()
        store.set(f"mstar_dist/read/{node_rank}", "1")
        return None if verdict == "go" else verdict
    deadline = time.monotonic() + timeout_s
    joined: set[int] = set()
    while time.monotonic() < deadline and len(joined) < n:
        joined |= {k for k in range(n) if k not in joined and store.check([f"mstar_dist/joined/{k}"])}
        time.sleep(0.05)
    error = None if len(joined) == n else missing_hosts(spec, joined, timeout_s)
    store.set("mstar_dist/verdict", error or "go")
    readers = [k for k in joined if k != 0]
    deadline = time.monotonic() + GRACE_S  # keep the store up until the others have read the verdict
    while readers and time.monotonic() < deadline:
        readers = [k for k in readers if not store.check([f"mstar_dist/read/{k}"])]
        time.sleep(0.05)
    return error


def _wait_for_listener(addr: str, port: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        try:
            socket.create_connection((addr, port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mstar_dist.distributed.join", description=__doc__.split("\n")[0])
    p.add_argument("config", help="deployment YAML with a cluster: section")
    p.add_argument("--node-rank", type=int, required=True, help="this host's index in the cluster spec")
    p.add_argument("--master-addr", required=True, help="address of node 0 (the rendezvous host)")
    p.add_argument("--port", type=int, required=True, help="port for the join store on node 0")
    p.add_argument("--timeout", type=float, required=True, help="seconds to wait for every host")
    args = p.parse_args(argv)
    config = load_config(args.config)
    if config.cluster is None:
        return 0  # one host: nothing to wait for
    t0 = time.monotonic()
    outcome: list[str | None] = []
    checking = threading.Thread(target=lambda: outcome.append(join(config.cluster, args.node_rank, args.master_addr,
                                                                   args.port, args.timeout)),
                                name="join", daemon=True)
    checking.start()
    checking.join(bound_s(args.timeout))
    me = config.cluster.hosts[args.node_rank].name if 0 <= args.node_rank < len(config.cluster.hosts) else "?"
    if not outcome:  # the store client still waits, maybe for a service that is not the join store: do not wait on
        print(f"mstar-dist: host {me!r} (node rank {args.node_rank}): the join check with "
              f"{config.cluster.hosts[0].name!r} (node rank 0) at {args.master_addr}:{args.port} did not finish within "
              f"{bound_s(args.timeout):g} s; if another service listens on that port (the launch scripts use "
              "MASTER_PORT + 1), choose another MASTER_PORT", file=sys.stderr, flush=True)
        os._exit(1)  # the stuck client thread would hold up the interpreter's exit
    error = outcome[0]
    if error:
        print(f"mstar-dist: host {me!r} (node rank {args.node_rank}): {error}", file=sys.stderr, flush=True)
        return 1
    print(f"mstar-dist: all {len(config.cluster.hosts)} hosts joined ({time.monotonic() - t0:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
