"""The chaos matrix (docs/architecture.md §10): for each role and fault, a deployment started the way users start it
(torchrun on each host, ``tests/e2e/server.py``) on two "hosts" (network namespaces joined by a veth pair, each with
a /dev/shm of its own, ``tests/e2e/netns.py``) serves a steady load of streamed requests while one rank of that
role, or the front end's host, is hit; one JSON row per cell says how the service took it.

    python scripts/chaos.py [--roles prefill decode tp codec frontend] [--faults kill9 sigstop sigterm link shm]
                            [--clients 3] [--out bench/results/chaos_cpu.json] [--rank-timeout S]

Needs root (``ip netns``, mounts). The load comes from inside host a's namespace, where the front end listens.

Roles (host a runs rank 0 and the front end; the hit rank is on host b and has a twin, so a request that was not on
the hit replica has somewhere to go; the conductor keeps a request on one host where it can, so the twin is on the
hit rank's host when the first stage has one replica only, and each row says how much the hit ranks served before):
- ``prefill`` / ``decode``: SmolLM2, prefill on ranks 0 (a) and 2 (b), decode on ranks 1 (a) and 3 (b); rank 2,
  resp. rank 3 is hit;
- ``tp``: Qwen3-MoE, prefill TP2 on ranks 0, 1 (host a), two decode TP2 replicas on 2, 3 and 4, 5 (host b); rank 5
  is hit (its partner, rank 4, restarts with it);
- ``codec``: Orpheus speech, the LLM on rank 0 (host a), SNAC codec replicas on ranks 1 and 2 (host b); rank 2 is
  hit;
- ``frontend``: the SmolLM2 layout, and the fault strikes host a as a whole (rank 0, its front end, rank 1 and
  torchrun's agent, which holds the launch's store).
Faults: ``kill9`` (SIGKILL), ``sigstop`` (SIGSTOP past ``limits.rank_timeout_s``, then SIGCONT), ``sigterm`` (a
requested stop: the rank leaves and is not restarted; on the front end's host, the operator stopping host a), ``link``
(the veth link between the hosts down past ``limits.rank_timeout_s``, then up: every rank of host b is cut off),
``shm`` (the hit host's /dev/shm filled to the last byte for ``SHM_HOLD_S`` while it serves over shared memory).

Per cell: ``in_flight_failed`` (requests that ended with an error naming a hit rank and began before the fault was
over, plus ``KNOWN_AFTER_S``: those the hit replica had in flight or was handed before the conductor knew), ``lost``
(any other failed request: must be 0), ``refused_while_down`` (requests refused at once with a 503 while no
replica of some stage was live: where the link fault cuts off every replica of a stage), ``in_flight_end_s`` (from the fault until the last of those ended),
``back_s`` (from the fault until the conductor logged every hit rank serving again after a kill, a stop or a link
down; for the other faults and the front end's host, until the first answer to a request sent after the fault
ended; None after a SIGTERM, which restarts nothing), ``served_after_back``, ``live_tensors_after`` (per rank, once
the load stopped: must be all 0). When host a is killed or stopped with SIGTERM the deployment ends (rank 0 is not
restarted in place: its scheduler starts the launch again), and the row has instead ``others_exit_s`` (until torchrun
on host b exited), ``statuses`` (each host's torchrun status), ``rank0_named`` (the log names rank 0's host) and
``orphans`` (processes of either host left behind).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tests.e2e.netns import NetnsPair  # noqa: E402
from tests.e2e.server import REPO, Server, descendants, per_rank, signal_all, wait_for  # noqa: E402

RANK_TIMEOUT_S = 10.0
"""``limits.rank_timeout_s`` of every cell (``--rank-timeout``): how long a stopped or cut-off rank may stay silent.
On a machine with fewer cores than ranks a short one declares busy ranks dead too (a rank loading its model again
starves the others)."""
KNOWN_AFTER_S = 1.0
"""How long after a kill or a SIGTERM the conductor may not know of it yet (a stopped or cut-off rank is found by its
silence only, after the rank timeout): a request admitted by then may have been routed to the hit replica, and counts
as in flight there."""
WARMUP_S = 5.0
"""Load before the fault."""
AFTER_S = 10.0
"""Load after the hit ranks are back (or after the fault, when nothing has to come back)."""
SHM_MB = 128
"""Each host's /dev/shm (a container's is 64 MB by default): room for the shared-memory arenas of its ranks."""
ARENA_BYTES = 16 << 20
"""``transport.arena_bytes`` of every rank (four of them fit a host's /dev/shm)."""
SHM_HOLD_S = 10.0
"""How long the ``shm`` fault keeps the hit host's /dev/shm full."""
LOGS = Path("bench/raw/chaos")
"""Each cell's deployment log (git-ignored), for a row that needs explaining."""
FAULTS = ("kill9", "sigstop", "sigterm", "link", "shm")


@dataclass
class Role:
    config: str
    nodes: list[int]
    groups: list[dict]
    hit: tuple[int, ...]
    """The rank the fault strikes first, then the ranks that fail with it (its TP partners)."""
    body: dict = field(default_factory=dict)
    """What each request of the load asks (``model_kwargs`` of ``/generate``)."""
    overrides: dict = field(default_factory=dict)

    def host_b(self) -> tuple[int, ...]:
        return tuple(range(self.nodes[0], sum(self.nodes)))


LLM_BODY = {"max_tokens": 48, "temperature": 0.9}


def roles() -> dict[str, Role]:
    llm = [{"node_names": ["LLM"], "ranks": [0, 2], "graph_walks": ["prefill"], "cpu_threads": 1},
           {"node_names": ["LLM"], "ranks": [1, 3], "graph_walks": ["decode"], "cpu_threads": 1}]
    moe = [{"node_names": ["LLM"], "ranks": [0, 1], "tp_size": 2, "graph_walks": ["prefill"], "cpu_threads": 1},
           {"node_names": ["LLM"], "ranks": [2, 3, 4, 5], "tp_size": 2, "graph_walks": ["decode"], "cpu_threads": 1}]
    speech = [{"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill", "decode"], "cpu_threads": 1},
              {"node_names": ["CODEC"], "ranks": [1, 2], "graph_walks": ["codec"], "cpu_threads": 1}]
    moe_weights = {"weights": os.path.expanduser("~/.cache/mstar_dist/qwen3-moe-tiny")}
    speech_weights = {"weights": os.path.expanduser("~/.cache/mstar_dist/orpheus-tiny")}
    speech_body = {"voice": "tara", "max_tokens": 120, "temperature": 0.8}
    return {
        "prefill": Role("launch/configs/smollm2_dp.yaml", [2, 2], llm, (2,), LLM_BODY),
        "decode": Role("launch/configs/smollm2_dp.yaml", [2, 2], llm, (3,), LLM_BODY),
        "tp": Role("launch/configs/moe_pd_tp2.yaml", [2, 4], moe, (5, 4), LLM_BODY, moe_weights),
        "codec": Role("launch/configs/speech_split.yaml", [1, 2], speech, (2,), speech_body, speech_weights),
        "frontend": Role("launch/configs/smollm2_dp.yaml", [2, 2], llm, (0, 1), LLM_BODY),
    }


@dataclass
class Record:
    start: float
    end: float = 0.0
    ok: bool = False
    error: str = ""
    audio: int = 0
    """Audio chunks streamed (the codec role: proof that the codec served)."""


@dataclass
class Load:
    """``clients`` threads, each streaming one request after another until ``stop``."""

    url: str
    clients: int
    body: dict
    records: list[Record] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.clients)]
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _client(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            rec = Record(time.monotonic())
            self.records.append(rec)
            body = {"prompt": f"Tell me a story {i}.{n}", "stream": True,
                    "model_kwargs": {**self.body, "seed": 1000 * i + n}}
            try:
                last = ""
                with httpx.stream("POST", f"{self.url}/generate", json=body, timeout=120) as r:
                    if r.status_code != 200:
                        rec.error = f"{r.status_code} {r.read().decode(errors='replace')[:300]}"
                        time.sleep(0.2)  # refused at once: a client would not ask again in the same millisecond
                    for line in r.iter_lines():
                        last = line or last
                        rec.audio += '"modality":"audio"' in line.replace(" ", "")
                if not rec.error:
                    out = json.loads(last) if last else {}
                    rec.error = out.get("metadata", {}).get("message", "") if out.get("modality") == "error" else ""
                    rec.ok = not rec.error and bool(last)
            except (httpx.HTTPError, ValueError) as exc:
                rec.error = f"{type(exc).__name__}: {exc}"
                time.sleep(0.2)  # a front end that is gone refuses at once: do not spin
            rec.end = time.monotonic()


def shm_fill(server: Server, node: int) -> Path:
    """Fill host ``node``'s /dev/shm to the last byte (from inside its mount namespace); returns the file to remove."""
    holder = server.procs[node].pid  # torchrun's agent of that host: it lives in the host's mount namespace
    path = Path("/dev/shm/chaos-fill")
    enter = ["nsenter", "-t", str(holder), "-m", "--"]
    free = int(subprocess.run([*enter, "stat", "-f", "-c", "%a*%S", "/dev/shm"], capture_output=True, text=True,
                              check=True).stdout.strip().replace("*", " ").split()[0]) * \
        int(subprocess.run([*enter, "stat", "-f", "-c", "%S", "/dev/shm"], capture_output=True, text=True,
                           check=True).stdout.strip())
    subprocess.run([*enter, "fallocate", "-l", str(free), str(path)], check=True, capture_output=True)
    left = subprocess.run([*enter, "stat", "-f", "-c", "%a", "/dev/shm"], capture_output=True, text=True).stdout
    assert left.strip() == "0", f"/dev/shm of host {node} not full: {left} blocks left"
    return path


def shm_clear(server: Server, node: int, path: Path) -> None:
    subprocess.run(["nsenter", "-t", str(server.procs[node].pid), "-m", "--", "rm", "-f", str(path)], check=True)


def host_pids(server: Server, node: int) -> list[int]:
    return [server.procs[node].pid, *descendants(server.procs[node].pid)]


def strike(server: Server, rig: NetnsPair, role: Role, name: str, fault: str) -> tuple[float, float]:
    """Apply ``fault``; when it struck and when it ended (SIGCONT, the link up, /dev/shm emptied; the same for a kill
    or a SIGTERM)."""
    t = time.monotonic()
    if fault == "link":
        rig.set_link(False)
        time.sleep(RANK_TIMEOUT_S + 2)  # past the timeout: the conductor declared host b's ranks dead
        rig.set_link(True)
    elif fault == "shm":
        node = 0 if name == "frontend" else 1
        path = shm_fill(server, node)
        time.sleep(SHM_HOLD_S)
        shm_clear(server, node, path)
    elif name == "frontend":
        pids = host_pids(server, 0)
        if fault == "kill9":
            server.kill_node(0)
        elif fault == "sigterm":
            os.kill(server.procs[0].pid, signal.SIGTERM)  # the operator stops host a's torchrun
        else:
            signal_all(pids, signal.SIGSTOP)
            time.sleep(RANK_TIMEOUT_S + 2)
            signal_all(pids, signal.SIGCONT)
    else:
        pid = server.rank_pid(role.hit[0])
        if fault == "kill9":
            os.kill(pid, signal.SIGKILL)
        elif fault == "sigterm":
            os.kill(pid, signal.SIGTERM)
        else:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(RANK_TIMEOUT_S + 2)
            os.kill(pid, signal.SIGCONT)
    return t, time.monotonic()


def hit_ranks(role: Role, name: str, fault: str) -> tuple[int, ...]:
    """The ranks whose requests a fault may fail: a link down cuts every rank of host b off; stopping the front end's
    host holds every request up."""
    if fault == "shm":
        return ()  # the arenas are reserved at start: nothing should fail
    if name == "frontend" and fault == "sigstop":
        return tuple(range(sum(role.nodes)))
    if fault == "link":
        return role.host_b()
    return role.hit


def config(rig: NetnsPair, role: Role) -> dict:
    hosts = [{"name": name, "addr": addr, "devices": list(range(n)), "env": {"GLOO_SOCKET_IFNAME": ifname}}
             for name, addr, n, ifname in zip(("host-a", "host-b"), rig.addrs, role.nodes, rig.ifnames)]
    return {"node_groups": role.groups, "restart": {"backoff_s": 0.5}, "cluster": {"hosts": hosts},
            "transport": {"intra_host": "shm", "inter_host": "p2p", "arena_bytes": ARENA_BYTES},
            "limits": {"max_concurrent_requests": 32, "max_tokens": 256, "rank_timeout_s": RANK_TIMEOUT_S},
            **role.overrides}


def cell(rig: NetnsPair, name: str, role: Role, fault: str, clients: int) -> dict:
    server = Server(REPO / role.config, 0, nodes=role.nodes, overrides=config(rig, role), netns=rig)
    hit = hit_ranks(role, name, fault)
    # ranks that must be seen serving again (a restart and rejoin); otherwise back_s is the first answer after the end
    rejoin = hit if fault in ("kill9", "sigstop", "link") and name != "frontend" else ()
    try:
        load = Load(server.base_url, clients, role.body)
        load.start()
        time.sleep(WARMUP_S)
        before = {node: host_pids(server, node) for node in (0, 1)}
        served_before = hit_traffic(server.base_url, role.hit if name != "frontend" else ())
        t_fault, t_end = strike(server, rig, role, name, fault)
        if name == "frontend" and fault in ("kill9", "sigterm"):
            return frontend_row(server, role, fault, load, t_fault, before)
        back = None
        if rejoin:
            try:
                wait_for(lambda: all(f"rank {r} on host-{'ab'[r >= role.nodes[0]]} serves again" in server.log()
                                     for r in rejoin), 300, "the hit ranks back", interval=0.2)
                back = time.monotonic() - t_fault
            except AssertionError:
                pass  # it never came back: back_s stays None
        t_back = time.monotonic()
        time.sleep(AFTER_S)
        load.finish()
        if not rejoin and fault != "sigterm":
            answers = [r.end for r in load.records if r.ok and r.start >= t_end]
            back = min(answers) - t_fault if answers else None
        try:
            wait_for(lambda: _all_zero(per_rank(server.base_url, "mstar_dist_live_tensors")), 30, "no live tensor")
            live = per_rank(server.base_url, "mstar_dist_live_tensors")
        except (AssertionError, httpx.HTTPError) as exc:  # the deployment ended: its log says why
            live = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        server.stop()
        LOGS.mkdir(parents=True, exist_ok=True)
        shutil.copy(server.log_path, LOGS / f"{name}_{fault}.log")
    return {**row(name, role, fault, hit, load.records, t_fault, t_end, back, t_back, live),
            "hit_traffic_before": served_before}


def hit_traffic(base_url: str, ranks: tuple[int, ...]) -> dict[str, int]:
    """What the hit ranks did before the fault (proof that the load reached them): data-plane transfers into or out
    of them, and decode rows they ran."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    transfers = sum(float(m.group(3)) for m in re.finditer(
        r'^mstar_dist_edge_transfers_total\{[^}]*src="(\d+)",dst="(\d+)"[^}]*\} (\S+)$', text, re.M)
        if int(m.group(1)) in ranks or int(m.group(2)) in ranks)
    rows = sum(v for r, v in per_rank(base_url, "mstar_dist_engine_decode_rows_total").items() if int(r) in ranks)
    return {"transfers": int(transfers), "decode_rows": int(rows)}


def frontend_row(server: Server, role: Role, fault: str, load: Load, t_fault: float,
                 before: dict[int, list[int]]) -> dict:
    """Host a (rank 0, the front end, the launch's store) killed or stopped: host b must end, non-zero after a kill,
    naming rank 0's host, leaving no process behind."""
    statuses: list[int | None] = [None, None]
    try:
        statuses[1] = server.procs[1].wait(timeout=60)
        others_exit = time.monotonic() - t_fault
    except subprocess.TimeoutExpired:
        others_exit = None
    try:
        statuses[0] = server.procs[0].wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    load.finish()
    time.sleep(1.0)
    orphans = [pid for pids in before.values() for pid in pids if _alive(pid)]
    log = server.log_path.read_text(errors="replace")
    records = [r for r in load.records if r.end]
    failed = [r for r in records if not r.ok and r.start <= t_fault + KNOWN_AFTER_S]
    return {
        "role": "frontend", "fault": fault, "rank": 0, "config": role.config, "nodes": role.nodes,
        "requests": len(records), "completed": sum(1 for r in records if r.ok),
        "in_flight_failed": len(failed),
        "in_flight_end_s": round(max((r.end - t_fault for r in failed), default=0.0), 2),
        "others_exit_s": None if others_exit is None else round(others_exit, 2),
        "statuses": statuses, "rank0_named": "rank 0's host (host-a)" in log or "rank 0 on host host-a" in log,
        "orphans": len(orphans), "live_tensors_after": "the deployment ended",
    }


def _alive(pid: int) -> bool:
    try:
        return b"zombie" not in Path(f"/proc/{pid}/status").read_bytes().lower()
    except OSError:
        return False


def _all_zero(values: dict[str, int]) -> bool:
    return bool(values) and not any(values.values())


def row(name: str, role: Role, fault: str, hit: tuple[int, ...], records: list[Record], t_fault: float,
        t_end: float, back: float | None, t_back: float, live: dict) -> dict:
    failed = [r for r in records if r.end and not r.ok]
    silent = fault in ("sigstop", "link")
    known = (t_end if silent else t_fault) + KNOWN_AFTER_S
    # a walk with no live replica left (a link down that cuts off every replica of a stage): refused at once, 503
    refused = [r for r in failed if r.start >= t_fault and "no live replica" in r.error]
    in_flight = [r for r in failed if r not in refused and r.start <= known and any(f"rank {k} " in r.error
                                                                                     for k in hit)]
    lost = [r for r in failed if r not in in_flight and r not in refused]
    return {
        "role": name, "fault": fault, "rank": hit[0] if hit else role.hit[0], "hit_ranks": list(hit),
        "config": role.config, "nodes": role.nodes,
        "requests": sum(1 for r in records if r.end), "completed": sum(1 for r in records if r.ok),
        "in_flight_failed": len(in_flight), "refused_while_down": len(refused), "lost": len(lost),
        "lost_errors": sorted({r.error for r in lost})[:5],
        "in_flight_end_s": round(max((r.end - t_fault for r in in_flight), default=0.0), 2),
        "back_s": None if back is None else round(back, 2),
        "served_after_back": sum(1 for r in records if r.ok and r.start >= t_back),
        "audio_chunks": sum(r.audio for r in records),
        "live_tensors_after": live,
    }


def main() -> None:
    global RANK_TIMEOUT_S
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--roles", nargs="+", default=list(roles()), choices=list(roles()))
    p.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--out", default="bench/results/chaos_cpu.json")
    p.add_argument("--rank-timeout", type=float, default=RANK_TIMEOUT_S, help="limits.rank_timeout_s of every cell")
    args = p.parse_args()
    RANK_TIMEOUT_S = args.rank_timeout
    why = NetnsPair.unavailable()
    if why is not None:
        sys.exit(f"chaos.py needs two network namespaces: {why}")
    table = roles()
    out = Path(args.out)
    rig_words = f"two network namespaces (veth), own /dev/shm of {SHM_MB} MB each"
    earlier = json.loads(out.read_text()) if out.exists() else {}
    rows = earlier.get("cells", []) if earlier.get("rig") == rig_words else []  # cells of other runs of this rig
    out.parent.mkdir(parents=True, exist_ok=True)
    with NetnsPair(own_shm_mb=SHM_MB) as rig:
        rig.enter(0)  # the load and the /metrics reads come from host a, where the front end listens
        for name in args.roles:
            for fault in args.faults:
                result = cell(rig, name, table[name], fault, args.clients)
                print(json.dumps(result), flush=True)
                rows = [r for r in rows if (r["role"], r["fault"]) != (name, fault)] + [result]
                command = "python scripts/chaos.py " + " ".join(sys.argv[1:])
                out.write_text(json.dumps({"command": command, "rig": rig_words, "rank_timeout_s": RANK_TIMEOUT_S,
                                           "clients": args.clients, "known_after_s": KNOWN_AFTER_S,
                                           "cells": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
