"""The chaos matrix (docs/architecture.md §10): for each role and fault, a deployment started on this machine the way
users start it (torchrun, ``tests/e2e/server.py``) serves a steady load of streamed requests while one rank of that
role is hit; one JSON row per cell says how the service took it.

    python scripts/chaos.py [--roles prefill decode tp] [--faults kill9 sigstop sigterm] [--clients 6]
                            [--out bench/results/chaos_cpu.json] [--moe-weights DIR] [--rank-timeout S]

Roles (every one has a second replica, so a request that was not on the hit replica has somewhere to go):
- ``prefill``: SmolLM2, prefill on ranks 0 and 1, decode on ranks 2 and 3; rank 1 is hit;
- ``decode``: the same deployment; rank 3 is hit;
- ``tp``: Qwen3-MoE, prefill TP2 on ranks 0, 1, two decode TP2 replicas on ranks 2..5; rank 5 is hit (its partner,
  rank 4, restarts with it).
Faults: ``kill9`` (SIGKILL), ``sigstop`` (SIGSTOP past ``limits.rank_timeout_s``, then SIGCONT: the old process is
told to restart), ``sigterm`` (a requested stop: the rank leaves and is not restarted).

Per cell: ``in_flight_failed`` (requests that ended with an error naming the hit rank, or its TP partner: those
the hit replica had in flight), ``lost`` (any other failed request: must be 0), ``in_flight_end_s`` (from the fault
until the last of those ended), ``back_s`` (from the fault until the conductor logged the rank serving again; None
after SIGTERM), ``served_after_back`` (requests that completed after that), ``live_tensors_after`` (per rank, once
the load stopped: must be all 0). Not covered here: the link between two network namespaces going down, a full
``/dev/shm``, a codec or talker rank, rank 0's host (``tests/e2e/test_rank_death.py`` covers that one).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tests.e2e.server import REPO, Server, descendants, per_rank, wait_for  # noqa: E402

RANK_TIMEOUT_S = 10.0
"""``limits.rank_timeout_s`` of every cell (``--rank-timeout``): how long a stopped rank may stay silent. On a
machine with fewer cores than ranks a short one declares busy ranks dead too (a rank loading its model again starves
the others)."""
KNOWN_AFTER_S = 1.0
"""How long after a kill or a SIGTERM the conductor may not know of it yet (a stopped rank is found by its silence
only, after the rank timeout): a request admitted by then may have been routed to the hit replica, and counts as in
flight there."""
WARMUP_S = 5.0
"""Load before the fault."""
LOGS = Path("bench/raw/chaos")
"""Each cell's deployment log (git-ignored), for a row that needs explaining."""
AFTER_S = 10.0
"""Load after the rank is back (or after the fault, for SIGTERM)."""


@dataclass
class Role:
    config: str
    nproc: int
    groups: list[dict]
    rank: int
    partners: tuple[int, ...] = ()
    weights: str | None = None


def roles(moe_weights: str) -> dict[str, Role]:
    llm = [{"node_names": ["LLM"], "ranks": [0, 1], "graph_walks": ["prefill"], "cpu_threads": 1},
           {"node_names": ["LLM"], "ranks": [2, 3], "graph_walks": ["decode"], "cpu_threads": 1}]
    moe = [{"node_names": ["LLM"], "ranks": [0, 1], "tp_size": 2, "graph_walks": ["prefill"], "cpu_threads": 1},
           {"node_names": ["LLM"], "ranks": [2, 3, 4, 5], "tp_size": 2, "graph_walks": ["decode"], "cpu_threads": 1}]
    return {
        "prefill": Role("launch/configs/smollm2_dp.yaml", 4, llm, 1),
        "decode": Role("launch/configs/smollm2_dp.yaml", 4, llm, 3),
        "tp": Role("launch/configs/moe_pd_tp2.yaml", 6, moe, 5, partners=(4,), weights=moe_weights),
    }


@dataclass
class Record:
    start: float
    end: float = 0.0
    ok: bool = False
    error: str = ""


@dataclass
class Load:
    """``clients`` threads, each streaming one request after another until ``stop``."""

    url: str
    clients: int
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
                    "model_kwargs": {"max_tokens": 48, "temperature": 0.9, "seed": 1000 * i + n}}
            try:
                last = ""
                with httpx.stream("POST", f"{self.url}/generate", json=body, timeout=120) as r:
                    if r.status_code != 200:
                        rec.error = f"{r.status_code} {r.read().decode(errors='replace')[:300]}"
                    for line in r.iter_lines():
                        last = line or last
                if not rec.error:
                    out = json.loads(last) if last else {}
                    rec.error = out.get("metadata", {}).get("message", "") if out.get("modality") == "error" else ""
                    rec.ok = not rec.error and bool(last)
            except (httpx.HTTPError, ValueError) as exc:
                rec.error = f"{type(exc).__name__}: {exc}"
            rec.end = time.monotonic()


def rank_process(server: Server, rank: int) -> int:
    """The pid serving ``rank`` (the supervised child)."""
    for pid in descendants(server.proc.pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"MSTAR_RANK_CHILD=1" in environ:
            return pid
    raise RuntimeError(f"no process serving rank {rank}")


def hit(server: Server, role: Role, fault: str) -> float:
    """Apply ``fault`` to the role's rank; the time it struck."""
    pid = rank_process(server, role.rank)
    t = time.monotonic()
    if fault == "kill9":
        os.kill(pid, signal.SIGKILL)
    elif fault == "sigterm":
        os.kill(pid, signal.SIGTERM)
    else:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(RANK_TIMEOUT_S + 2)  # past the timeout: the conductor declared it dead
        os.kill(pid, signal.SIGCONT)
    return t


def cell(name: str, role: Role, fault: str, clients: int) -> dict:
    overrides = {"node_groups": role.groups, "restart": {"backoff_s": 0.5},
                 "limits": {"max_concurrent_requests": 32, "max_tokens": 256, "rank_timeout_s": RANK_TIMEOUT_S}}
    if role.weights:
        overrides["weights"] = role.weights
    server = Server(REPO / role.config, role.nproc, overrides=overrides)
    try:
        load = Load(server.base_url, clients)
        load.start()
        time.sleep(WARMUP_S)
        t_fault = hit(server, role, fault)
        back = None
        if fault != "sigterm":
            try:
                wait_for(lambda: f"rank {role.rank} on localhost serves again" in server.log(), 300, "the rank back",
                         interval=0.2)
                back = time.monotonic() - t_fault
            except AssertionError:
                pass  # it never came back: back_s stays None
        t_back = time.monotonic()
        time.sleep(AFTER_S)
        load.finish()
        try:
            wait_for(lambda: _all_zero(per_rank(server.base_url, "mstar_dist_live_tensors")), 30, "no live tensor")
            live = per_rank(server.base_url, "mstar_dist_live_tensors")
        except (AssertionError, httpx.HTTPError) as exc:  # the deployment ended: its log says why
            live = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        server.stop()
        LOGS.mkdir(parents=True, exist_ok=True)
        shutil.copy(server.log_path, LOGS / f"{name}_{fault}.log")
    return row(name, role, fault, load.records, t_fault, back, t_back, live)


def _all_zero(values: dict[str, int]) -> bool:
    return bool(values) and not any(values.values())


def row(name: str, role: Role, fault: str, records: list[Record], t_fault: float, back: float | None,
        t_back: float, live: dict) -> dict:
    hit_ranks = (role.rank, *role.partners)
    failed = [r for r in records if r.end and not r.ok]
    known = t_fault + KNOWN_AFTER_S + (RANK_TIMEOUT_S if fault == "sigstop" else 0.0)
    in_flight = [r for r in failed if r.start <= known and any(f"rank {k} " in r.error for k in hit_ranks)]
    lost = [r for r in failed if r not in in_flight]
    return {
        "role": name, "fault": fault, "rank": role.rank, "config": role.config, "nproc": role.nproc,
        "requests": sum(1 for r in records if r.end), "completed": sum(1 for r in records if r.ok),
        "in_flight_failed": len(in_flight), "lost": len(lost), "lost_errors": sorted({r.error for r in lost})[:5],
        "in_flight_end_s": round(max((r.end - t_fault for r in in_flight), default=0.0), 2),
        "back_s": None if back is None else round(back, 2),
        "served_after_back": sum(1 for r in records if r.ok and r.start >= t_back),
        "live_tensors_after": live,
    }


def main() -> None:
    global RANK_TIMEOUT_S
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--roles", nargs="+", default=["prefill", "decode", "tp"])
    p.add_argument("--faults", nargs="+", default=["kill9", "sigstop", "sigterm"])
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--moe-weights", default=os.path.expanduser("~/.cache/mstar_dist/qwen3-moe-tiny"))
    p.add_argument("--out", default="bench/results/chaos_cpu.json")
    p.add_argument("--rank-timeout", type=float, default=RANK_TIMEOUT_S, help="limits.rank_timeout_s of every cell")
    args = p.parse_args()
    RANK_TIMEOUT_S = args.rank_timeout
    table = roles(args.moe_weights)
    rows = []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for name in args.roles:
        for fault in args.faults:
            rows.append(cell(name, table[name], fault, args.clients))
            print(json.dumps(rows[-1]), flush=True)
            command = "python scripts/chaos.py " + " ".join(sys.argv[1:])
            Path(args.out).write_text(json.dumps({"command": command, "reproduce": command,
                                                  "rank_timeout_s": RANK_TIMEOUT_S, "clients": args.clients,
                                                  "known_after_s": KNOWN_AFTER_S, "cells": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
