"""Two "hosts" on one machine: P/D across them must equal P/D on one host, with the inter-host KV edge on NCCL
(transport p2p) and on Mooncake (tcp); the KV edge's bandwidth from /metrics and the raw edge bandwidth of both.

    python3 scripts/gpu_two_host.py --device cuda [--out $OUT/two_host_h200x2.json]   # the H200 pair
    .venv/bin/python scripts/gpu_two_host.py --device cpu                              # the same flow on CPU

What it runs (every process in its own session, stopped by process group and PID even on failure; every phase
bounded by a timeout; a phase that fails is recorded and the next one still runs):
1. ``single``: the P/D deployment (``launch/configs/smollm2_pd.yaml``, prefill rank 0, decode rank 1) on ONE host:
   one ``torchrun --standalone --nproc-per-node 2`` (no ``cluster:`` section: one host with devices 0..1, so rank r
   runs on ``cuda:r``); the greedy text of ``--prompts`` pinned chat prompts (``--max-tokens`` tokens each, one at
   a time so every run batches alike), then ``--long`` long prompts (KV of ~``--long-tokens`` tokens each) for the
   KV edge's bandwidth.
2. the same deployment over two hosts ``node-a`` (127.0.0.1) and ``node-b`` (127.0.0.2), one device each: two
   ``torchrun --nnodes 2 --node-rank K --nproc-per-node 1`` with static rendezvous on 127.0.0.1, host K seeing
   only GPU K (``CUDA_VISIBLE_DEVICES=K``, so both ranks run on their ``cuda:0``), the node groups of step 1
   unchanged (same ``cpu_threads`` too: on CPU thread counts change float sums), once per ``--variants``:
   - ``p2p``: the inter-host edge on NCCL pair groups as NCCL picks on one machine (``NCCL_DEBUG=INFO``: the
     ``via`` lines of the log, e.g. P2P/CUMEM or SHM, are recorded); gloo on CPU;
   - ``p2p_net`` (CUDA only): the same with ``NCCL_HOSTID`` set per host, so NCCL treats the two processes as two
     machines and connects them through its network transport (sockets on ``lo``, ``NCCL_IB_DISABLE=1``): what
     an inter-host NCCL edge does without RDMA;
   - ``mooncake``: ``--inter-host-tensor-protocol mooncake`` (``transport.mooncake_protocol: tcp``; our
     transport stages CUDA tensors through its registered host pool: ``host_staging_copies`` counts them).
   Checks the pinned texts equal step 1's and that the KV flow (walk decode, rank 0 -> 1, signal kv) was counted
   under the variant's transport; the edge statistics of /metrics (flow count, bytes, p50/p99 seconds; the
   transfer-time histograms of rank 1's receives) give the KV edge's bandwidth: bytes / summed transfer seconds,
   for the pinned and the long prompts separately (the long ones are the bandwidth figure: ~1 MiB vs ~35 MiB).
3. ``scripts/bench_edges.py`` as two torchrun invocations of one process each (the same two hosts): raw
   ``dist.send/recv`` (NCCL or gloo) next to our p2p and Mooncake edge paths at 4 KiB .. ``--edge-max-bytes``;
   on CUDA once more with NCCL treating the processes as two machines (``p2p_net``).
Everything goes into one JSON with every command line (environment included), the NCCL transports seen, the
Mooncake set-up, and ``checks``.

Mooncake on the GPU image: the carried CPU build (``mooncake-transfer-engine-non-cuda``, scripts/gpu_prepare.sh)
links libibverbs, libnuma and libcurl from the system. When ``import mooncake.engine`` fails for a missing library,
the libraries ``ldd`` reports missing are linked from ``--syslibs`` (a tarball of the dev machine's copies that
gpu_prepare.sh writes) into a folder on ``LD_LIBRARY_PATH`` of the Mooncake runs only; the JSON names them.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.server import WEIGHTS, descendants, free_port  # noqa: E402

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast stays off on the shared H200 hosts, in every process this script starts."""
PD = REPO / "launch/configs/smollm2_pd.yaml"
HOSTS = [{"name": "node-a", "addr": "127.0.0.1", "devices": [0]},
         {"name": "node-b", "addr": "127.0.0.2", "devices": [0]}]
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain how a steam engine works.",
    "List three colours of the rainbow.",
    "Give me a recipe for pancakes.",
    "Count from one to ten in words.",
]
LONG_TEXT = ("The history of the lighthouse is long: fires on hills, towers of stone, lenses and lamps, and keepers "
             "who lived beside them through storms and calm nights alike. ")
KV_FLOW = {"walk": "decode", "src": "0", "dst": "1", "signal": "kv"}
LIVE: list[subprocess.Popen] = []
"""Every process this script started (each leads a session of its own); kill_all() ends what is left of them."""


# ------------------------------------------------------------------------------------------------ processes


def kill_tree(proc: subprocess.Popen, also: tuple[int, ...] = ()) -> None:
    """SIGKILL ``proc`` (one this script started) and its descendants, by PID, if it still runs, plus ``also``
    (descendants noted earlier, which may have been orphaned since); reap it."""
    if proc.poll() is not None and not also:
        return
    for pid in [proc.pid, *also, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def kill_all() -> None:
    """SIGKILL every process this script started that still runs, with its descendants (by PID)."""
    for proc in LIVE:
        kill_tree(proc)


def _env_str(extra: dict) -> str:
    return " ".join(f"{k}={shlex.quote(str(v))}" for k, v in extra.items())


class Deployment:
    """One deployment: one ``torchrun`` per host, each in its own session, output into one log file per host."""

    def __init__(self, name: str, config: dict, nodes: list[dict], workdir: Path, base_env: dict, serve_args: list,
                 startup_timeout: float) -> None:
        """``nodes``: one dict per host: ``nproc`` and ``env`` (added to ``base_env``). One node: --standalone;
        several: static rendezvous on 127.0.0.1, node rank = index."""
        self.name = name
        self.dir = workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.dir / "deployment.yaml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        master_port = free_port()
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.commands: list[str] = []
        self._files = []
        self.nranks = sum(n["nproc"] for n in nodes)
        for k, node in enumerate(nodes):
            if len(nodes) == 1:
                flags = ["--standalone", f"--master-port={master_port}"]
            else:
                flags = [f"--nnodes={len(nodes)}", f"--node-rank={k}", "--master-addr=127.0.0.1",
                         f"--master-port={master_port}"]
            cmd = [sys.executable, "-m", "torch.distributed.run", *flags, f"--nproc-per-node={node['nproc']}",
                   "-m", "mstar_dist.serve", str(self.config_path), "--port", str(self.port),
                   "--startup-timeout", str(startup_timeout), *serve_args]
            log = self.dir / f"node{k}.log"
            f = open(log, "wb")
            self._files.append(f)
            self.logs.append(log)
            self.commands.append(f"{_env_str(node['env'])} {shlex.join(cmd)}".strip())
            self.procs.append(subprocess.Popen(cmd, cwd=REPO, env={**base_env, **node["env"]}, stdout=f,
                                               stderr=subprocess.STDOUT, start_new_session=True))
            LIVE.append(self.procs[-1])
        self.started = time.monotonic()
        self.ready_s: float | None = None

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for k, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    raise RuntimeError(f"{self.name}: torchrun of host {k} exited with {proc.returncode} before "
                                       f"/health was 200:\n{self.tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    self.ready_s = round(time.monotonic() - self.started, 1)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{self.name}: /health not 200 within {timeout:.0f} s:\n{self.tail()}")

    def text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs if p.exists())

    def tail(self, n: int = 6000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-n:]}" for p in self.logs if p.exists())

    def stop(self, timeout: float = 30.0) -> bool:
        """SIGTERM every torchrun's process group, then SIGKILL what is left of each agent and its ranks (they
        run in sessions of their own). True when every rank logged a clean exit (status 0)."""
        family = {p.pid: descendants(p.pid) for p in self.procs}
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            kill_tree(p, also=tuple(family[p.pid]))
        for f in self._files:
            f.close()
        return self.text().count("exits with status 0") == self.nranks


def run_pair(cmds: list[tuple[list[str], dict]], log_dir: Path, name: str, timeout: float) -> tuple[list, str]:
    """Start several commands (own sessions), wait for all within ``timeout``, kill what is left; returns
    (return codes, the logs' tails)."""
    procs, files = [], []
    try:
        for k, (cmd, env) in enumerate(cmds):
            f = open(log_dir / f"{name}.node{k}.log", "wb")
            files.append(f)
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
            LIVE.append(procs[-1])
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:
            kill_tree(p)
        for f in files:
            f.close()
    codes = [p.returncode for p in procs]
    text = "\n".join(f"--- node {k}\n{(log_dir / f'{name}.node{k}.log').read_text(errors='replace')[-4000:]}"
                     for k in range(len(cmds)))
    return codes, text


# ------------------------------------------------------------------------------------------------ requests


def pinned_texts(base_url: str, n: int, max_tokens: int) -> list[dict]:
    out = []
    for i in range(n):
        r = httpx.post(f"{base_url}/generate", timeout=300, json={
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "request_id": f"two-host-pin-{i}",
            "model_kwargs": {"max_tokens": max_tokens, "temperature": 0}})
        if r.status_code != 200:
            raise RuntimeError(f"pinned request {i}: HTTP {r.status_code}: {r.text[:500]}")
        body = r.json()
        out.append({"text": body["text"], "finish_reason": body.get("finish_reason"), "usage": body.get("usage")})
    return out


def long_requests(base_url: str, n: int, tokens: int) -> list[dict]:
    """``n`` raw prompts of roughly ``tokens`` tokens (2 generated): their KV is the big transfer of the edge."""
    repeat = max(1, tokens // 30)  # LONG_TEXT is ~30 tokens
    out = []
    for i in range(n):
        r = httpx.post(f"{base_url}/generate", timeout=300, json={
            "prompt": f"Story {i}. " + LONG_TEXT * repeat, "request_id": f"two-host-long-{i}",
            "model_kwargs": {"max_tokens": 2, "temperature": 0}})
        if r.status_code != 200:
            raise RuntimeError(f"long request {i}: HTTP {r.status_code}: {r.text[:500]}")
        body = r.json()
        out.append({"text": body["text"], "usage": body.get("usage")})
    return out


# ------------------------------------------------------------------------------------------------ /metrics

_SAMPLE = re.compile(r'^(\w+)\{([^}]*)\} (\S+)$', re.M)


def samples(text: str, name: str) -> list[tuple[dict, float]]:
    out = []
    for m in _SAMPLE.finditer(text):
        if m.group(1) == name:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out.append((labels, float(m.group(3))))
    return out


def edge_snapshot(text: str) -> dict:
    """The data-plane numbers of one /metrics text: per flow (count, bytes, p50/p99 s), per (rank, transport,
    direction) the transfer histograms' count, byte and second sums, host staging copies per rank."""
    flows: dict[str, dict] = {}
    for series, key in (("mstar_dist_edge_transfers_total", "count"), ("mstar_dist_edge_flow_bytes_total", "bytes")):
        for labels, value in samples(text, series):
            flow = f"{labels['walk']} {labels['src']}->{labels['dst']} {labels['signal']} via {labels['transport']}"
            flows.setdefault(flow, dict(labels))[key] = value
    for labels, value in samples(text, "mstar_dist_edge_flow_seconds"):
        if "quantile" in labels:
            flow = f"{labels['walk']} {labels['src']}->{labels['dst']} {labels['signal']} via {labels['transport']}"
            flows.setdefault(flow, {k: v for k, v in labels.items() if k != "quantile"})[
                f"p{round(float(labels['quantile']) * 100)}_s"] = value
    hist: dict[str, dict] = {}
    for unit in ("bytes", "seconds"):
        for part in ("sum", "count"):
            for labels, value in samples(text, f"mstar_dist_edge_transfer_{unit}_{part}"):
                key = f"rank {labels['rank']} {labels['transport']} {labels['direction']}"
                hist.setdefault(key, {})[f"{unit}_{part}"] = value
    staged = {labels["rank"]: value for labels, value in samples(text, "mstar_dist_host_staging_copies_total")}
    live = {labels["rank"]: value for labels, value in samples(text, "mstar_dist_live_tensors")}
    return {"flows": flows, "histograms": hist, "host_staging_copies": staged, "live_tensors": live}


def kv_flow(snap: dict, transport: str) -> dict:
    return next((f for f in snap["flows"].values() if all(f.get(k) == v for k, v in KV_FLOW.items())
                 and f.get("transport") == transport), {})


def wait_kv_count(base_url: str, transport: str, at_least: float, timeout: float = 15.0) -> dict:
    """/metrics once the KV flow on ``transport`` counts ``at_least`` transfers (rank stats come every ~0.5 s)
    and the live tensors are 0, or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        snap = edge_snapshot(httpx.get(f"{base_url}/metrics", timeout=10).text)
        done = kv_flow(snap, transport).get("count", 0) >= at_least and not any(snap["live_tensors"].values())
        if done or time.monotonic() > deadline:
            snap["settled"] = done
            return snap
        time.sleep(0.3)


def bandwidth(before: dict, after: dict, transport: str) -> dict:
    """Rank 1's receives on ``transport`` between two snapshots: transfers, bytes, summed seconds and their ratio
    (bytes / seconds: the edge's bandwidth as the rank loop sees it, polling delay included)."""
    key = f"rank 1 {transport} recv"
    a, b = before["histograms"].get(key, {}), after["histograms"].get(key, {})
    n = b.get("bytes_count", 0) - a.get("bytes_count", 0)
    nbytes = b.get("bytes_sum", 0) - a.get("bytes_sum", 0)
    secs = b.get("seconds_sum", 0) - a.get("seconds_sum", 0)
    return {"transfers": n, "bytes": nbytes, "seconds": round(secs, 6),
            "mean_bytes": round(nbytes / n) if n else None, "mean_ms": round(secs / n * 1e3, 3) if n else None,
            "gbps": round(nbytes / secs / 1e9, 3) if secs > 0 else None}


def nccl_via(text: str) -> list[str]:
    """NCCL's connection lines (NCCL_DEBUG=INFO): the transports it picked, e.g. 'P2P/CUMEM/read', 'NET/Socket/0'."""
    return sorted({m.group(1) for m in re.finditer(r"Channel \d+/\d+ : .* via (\S+)", text)})


# ------------------------------------------------------------------------------------------------ Mooncake


def mooncake_setup(env: dict, syslibs: Path | None, workdir: Path) -> dict:
    """Can the ranks import ``mooncake.engine``? If a system library is missing, link the missing ones from the
    ``syslibs`` tarball into a folder put on ``env['LD_LIBRARY_PATH']`` (only libraries ``ldd`` reports
    missing, so nothing the image has is shadowed). Returns what it found and did."""
    probe = [sys.executable, "-c", "import mooncake.engine"]
    first = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=120)
    info: dict = {"import_ok": first.returncode == 0}
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        info["package"] = str(Path(list(spec.submodule_search_locations)[0]))
    if first.returncode == 0:
        return info
    info["import_error"] = first.stderr.strip().splitlines()[-1:] if first.stderr.strip() else [str(first.returncode)]
    if "package" not in info:
        info["error"] = "the mooncake package is not installed (mooncake-transfer-engine-non-cuda wheel in .whl/?)"
        return info
    engine = Path(info["package"]) / "engine.so"

    def missing(e: dict) -> list[str]:
        try:
            out = subprocess.run(["ldd", str(engine)], env=e, capture_output=True, text=True, timeout=60).stdout
        except OSError:  # no ldd on the image: the import errors below name the libraries one at a time
            return []
        return sorted(set(re.findall(r"^\s*(\S+) => not found", out, re.M)))

    info["missing_libraries"] = missing(env)
    if syslibs is None or not syslibs.exists():
        info["error"] = f"no system-library tarball ({syslibs}) to supply {info['missing_libraries']}"
        return info
    alldir, use = workdir / "syslibs_all", workdir / "syslibs"
    alldir.mkdir(parents=True, exist_ok=True)
    use.mkdir(parents=True, exist_ok=True)
    with tarfile.open(syslibs) as tar:
        tar.extractall(alldir, filter="data") if sys.version_info >= (3, 12) else tar.extractall(alldir)
    found = {p.name: p for p in alldir.rglob("*") if p.is_file() or p.is_symlink()}
    trial = {**env, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(use), env.get("LD_LIBRARY_PATH")]))}
    linked: list[str] = []
    for _ in range(10):  # a linked library may itself need ones the image lacks
        new = [n for n in missing(trial) if n in found and n not in linked]
        if not new:
            break
        for n in new:
            (use / n).unlink(missing_ok=True)
            (use / n).symlink_to(found[n].resolve())
            linked.append(n)
    for _ in range(40):  # what ldd did not say (or no ldd): the library each failed import names
        second = subprocess.run(probe, env=trial, capture_output=True, text=True, timeout=120)
        named = re.findall(r"(\S+\.so[.\d]*): cannot open shared object file", second.stderr)
        if second.returncode == 0 or not named or named[-1] not in found or named[-1] in linked:
            break
        (use / named[-1]).unlink(missing_ok=True)
        (use / named[-1]).symlink_to(found[named[-1]].resolve())
        linked.append(named[-1])
    info["linked_from_syslibs"] = sorted(linked)
    info["still_missing"] = missing(trial)
    info["import_ok_with_syslibs"] = second.returncode == 0
    if second.returncode == 0:
        info["ld_library_path"] = trial["LD_LIBRARY_PATH"]
    else:
        info["error"] = second.stderr.strip().splitlines()[-1:] if second.stderr.strip() else second.returncode
    return info


# ------------------------------------------------------------------------------------------------ the phases


def serve_phase(name: str, args, base_env: dict, workdir: Path, base_config: dict, two_hosts: bool,
                nodes_env: list[dict], serve_args: list[str], transport: str, budget: float) -> dict:
    config = json.loads(json.dumps(base_config))
    if two_hosts:
        config["cluster"] = {"hosts": HOSTS}
    nodes = [{"nproc": 1, "env": e} for e in nodes_env] if two_hosts else [{"nproc": 2, "env": nodes_env[0]}]
    rec: dict = {"transport": transport, "hosts": 2 if two_hosts else 1}
    t0 = time.monotonic()
    dep = Deployment(name, config, nodes, workdir, base_env, serve_args, args.startup_timeout)
    rec["commands"] = dep.commands
    rec["config"] = config
    try:
        dep.wait_healthy(max(10.0, min(args.startup_timeout + 30, budget - 30)))
        rec["cold_start_to_health_s"] = dep.ready_s
        before = edge_snapshot(httpx.get(f"{dep.base_url}/metrics", timeout=10).text)
        t1 = time.monotonic()
        rec["pinned"] = pinned_texts(dep.base_url, args.prompts, args.max_tokens)
        rec["pinned_s"] = round(time.monotonic() - t1, 2)
        mid = wait_kv_count(dep.base_url, transport, kv_flow(before, transport).get("count", 0) + args.prompts)
        t1 = time.monotonic()
        rec["long"] = long_requests(dep.base_url, args.long, args.long_tokens)
        rec["long_s"] = round(time.monotonic() - t1, 2)
        after = wait_kv_count(dep.base_url, transport, kv_flow(mid, transport).get("count", 0) + args.long)
        rec["kv_flow"] = kv_flow(after, transport)
        rec["kv_bandwidth_pinned"] = bandwidth(before, mid, transport)
        rec["kv_bandwidth_long"] = bandwidth(mid, after, transport)
        rec["edges_after"] = after
    except Exception as exc:  # recorded; the next phase still runs
        rec["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        rec["traceback"] = traceback.format_exc()[-3000:]
    finally:
        rec["ranks_exited_cleanly"] = dep.stop()
        log = dep.text()
        rec["nccl_via"] = nccl_via(log)
        rec["log_tail"] = dep.tail(3000) if "error" in rec or not rec["ranks_exited_cleanly"] else None
        rec["watchdog_or_nccl_error_lines"] = [ln[:300] for ln in log.splitlines()
                                               if re.search(r"watchdog|nccl (warn|error)|ncclSystemError|"
                                                            r"ncclInternalError|ncclRemoteError", ln, re.I)][:20]
        rec["wall_s"] = round(time.monotonic() - t0, 1)
    print(f"[{name}] {rec.get('error') or 'ok'} in {rec['wall_s']} s; kv long: {rec.get('kv_bandwidth_long')}",
          flush=True)
    return rec


def edges_phase(name: str, args, env: dict, nodes_env: list[dict], transports: str, workdir: Path,
                budget: float) -> dict:
    master_port = free_port()
    out = workdir / f"{name}.json"
    cmds, lines = [], []
    for k in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={k}",
               "--master-addr=127.0.0.1", f"--master-port={master_port}", "--nproc-per-node=1",
               "scripts/bench_edges.py", "--device", args.device, "--transports", transports,
               "--max-bytes", str(args.edge_max_bytes), "--iters", str(args.edge_iters),
               "--bind-addr", HOSTS[k]["addr"], "--out", str(out)]
        cmds.append((cmd, {**env, **nodes_env[k]}))
        lines.append(f"{_env_str(nodes_env[k])} {shlex.join(cmd)}".strip())
    t0 = time.monotonic()
    codes, logs = run_pair(cmds, workdir, name, max(10.0, min(args.edge_timeout, budget - 15)))
    rec: dict = {"transports": transports.split(","), "commands": lines, "return_codes": codes,
                 "wall_s": round(time.monotonic() - t0, 1), "nccl_via": nccl_via(logs)}
    if codes != [0, 0] or not out.exists():
        rec["error"] = f"bench_edges exited with {codes}"
        rec["log_tail"] = logs
    else:
        doc = json.loads(out.read_text())
        rec["table"] = [{"size": r["size"], **{p: {"median_us": round(r[p]["median_us"], 1),
                                                     "gbps": round(r[p]["gbps"], 3)} for p in r["paths"]},
                         **{k: round(v, 3) for k, v in r.items() if k.startswith("ratio_")}} for r in doc["results"]]
        rec["bench_edges"] = doc
    print(f"[{name}] {rec.get('error') or 'ok'} in {rec['wall_s']} s", flush=True)
    for row in rec.get("table", []):
        print("   " + row["size"].rjust(8) + "  " + "  ".join(
            f"{p} {v['gbps']:.2f} GB/s" for p, v in row.items() if isinstance(v, dict)), flush=True)
    return rec


T0 = time.monotonic()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], required=True)
    p.add_argument("--out", default=None, help="JSON path (default $OUT or bench/results, two_host_<h200x2|cpu>.json)")
    p.add_argument("--variants", default=None,
                   help="two-host serving runs, comma-separated: p2p, p2p_net (CUDA), mooncake (default: all that "
                        "apply to the device)")
    p.add_argument("--prompts", type=int, default=6, help="pinned chat prompts (greedy)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--long", type=int, default=4, help="long prompts per run (the KV edge's bandwidth)")
    p.add_argument("--long-tokens", type=int, default=None, help="their length (default 1500 on cuda, 300 on cpu)")
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--no-serving", action="store_true")
    p.add_argument("--no-edges", action="store_true")
    p.add_argument("--edge-max-bytes", type=int, default=64 << 20, help="bench_edges sizes 4 KiB .. this")
    p.add_argument("--edge-iters", type=int, default=None, help="bench_edges --iters (default 20 cuda, 8 cpu)")
    p.add_argument("--edge-timeout", type=float, default=240.0)
    p.add_argument("--budget", type=float, default=540.0,
                   help="seconds for the whole run: a phase that would start with less than its share left is "
                        "skipped (recorded), so the JSON is written in time")
    p.add_argument("--syslibs", default=str(REPO / ".whl/mooncake_syslibs.tar.gz"),
                   help="system libraries for the Mooncake engine, linked only where the image lacks them")
    p.add_argument("--workdir", default=None, help="logs and configs (default: a fresh folder under /tmp)")
    args = p.parse_args()

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)  # a phase in progress stops its processes on the way out
    cuda = args.device == "cuda"
    args.long_tokens = args.long_tokens or (1500 if cuda else 300)
    args.edge_iters = args.edge_iters or (20 if cuda else 8)
    variants = (args.variants or ("p2p,p2p_net,mooncake" if cuda else "p2p,mooncake")).split(",")
    if not cuda and "p2p_net" in variants:
        p.error("p2p_net (NCCL as two machines) needs --device cuda")
    default_name = "two_host_h200x2.json" if cuda else "two_host_cpu.json"
    out = Path(args.out) if args.out else Path(os.environ.get("OUT") or REPO / "bench/results") / default_name
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="two_host_"))
    workdir.mkdir(parents=True, exist_ok=True)

    import torch

    if cuda and torch.cuda.device_count() < 2:
        raise SystemExit(f"--device cuda needs 2 GPUs, torch sees {torch.cuda.device_count()}")
    if not cuda and torch.cuda.is_available():
        print("note: CUDA is present but --device cpu: the ranks are kept off it (CUDA_VISIBLE_DEVICES='')")
    base_env = {**os.environ, **SAFE_ENV, "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
                "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if cuda:
        base_env["NCCL_DEBUG"] = os.environ.get("NCCL_DEBUG", "INFO")  # the 'via' lines: which NCCL transport
    one_host_env = {"CUDA_VISIBLE_DEVICES": "0,1" if cuda else ""}
    per_host = [{"CUDA_VISIBLE_DEVICES": str(k) if cuda else ""} for k in range(2)]
    net_hosts = [{**e, "NCCL_HOSTID": f"mstar-two-host-{HOSTS[k]['name']}", "NCCL_SOCKET_IFNAME": "lo",
                  "NCCL_IB_DISABLE": "1"} for k, e in enumerate(per_host)]

    base_config = yaml.safe_load(PD.read_text())
    base_config["weights"] = WEIGHTS
    base_config["model"] = "llama"  # the plain HF Llama loader: no GGUF preparation on the GPU host
    base_config.setdefault("model_kwargs", {})
    base_config["limits"] = {**base_config.get("limits", {}), "max_tokens": 4096}

    doc: dict = {
        "benchmark": "two_host", "device": args.device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([os.path.relpath(sys.executable) if sys.executable.startswith(str(REPO))
                               else "python3", *sys.argv]),
        "machine": {"hostname": socket.gethostname(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "torch": torch.__version__, "python": platform.python_version(),
                    "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
                    "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None},
        "environment": {k: base_env.get(k) for k in (*SAFE_ENV, "NCCL_DEBUG", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")},
        "weights": WEIGHTS, "base_config": str(PD.relative_to(REPO)), "hosts": HOSTS,
        "rank_to_device": {"one host": "no cluster: section = one host with devices 0..1; rank r on cuda:r "
                                        "(CUDA_VISIBLE_DEVICES=0,1)" if cuda else "one host, 2 ranks on CPU",
                           "two hosts": "host k's devices: [0]; torchrun of host k runs with CUDA_VISIBLE_DEVICES=k, "
                                        "so rank k runs on physical GPU k as cuda:0" if cuda else
                                        "two torchruns, one rank each, on CPU"},
        "prompts": PROMPTS[:args.prompts], "max_tokens": args.max_tokens, "long_prompts": args.long,
        "long_prompt_tokens_asked": args.long_tokens, "workdir": str(workdir),
    }
    mooncake_env = dict(base_env)
    if "mooncake" in variants or not args.no_edges:
        doc["mooncake"] = mooncake_setup(mooncake_env, Path(args.syslibs), workdir)
        if doc["mooncake"].get("ld_library_path"):
            mooncake_env["LD_LIBRARY_PATH"] = doc["mooncake"]["ld_library_path"]
        print(f"mooncake: {json.dumps(doc['mooncake'])}", flush=True)
    mc = doc.get("mooncake", {})
    mooncake_ok = bool(mc.get("import_ok") or mc.get("import_ok_with_syslibs"))

    # phases in order of importance; each is skipped when less than its share of --budget is left, and SIGTERM
    # (timeout) ends the current one through its cleanup, then the JSON is written with what was measured
    phases: list[tuple[str, float, object]] = []
    serving: dict = {}
    edges: dict = {}

    def serving_run(v: str):
        def run():
            if v == "mooncake" and not mooncake_ok:
                return {"error": "skipped: the Mooncake engine does not import (see 'mooncake')"}
            flags = ["--inter-host-tensor-protocol", "mooncake" if v == "mooncake" else "p2p"]
            return serve_phase(f"two_host_{v}", args, mooncake_env if v == "mooncake" else base_env, workdir,
                               base_config, True, net_hosts if v == "p2p_net" else per_host, flags,
                               "mooncake" if v == "mooncake" else "p2p", budget_left())
        return run

    def edges_run():
        rec = edges_phase("edges_two_host", args, mooncake_env, per_host, "p2p,mooncake" if mooncake_ok else "p2p",
                          workdir, budget_left())
        if not mooncake_ok:
            rec["mooncake_skipped"] = "the Mooncake engine does not import (see 'mooncake')"
        return rec

    if not args.no_serving:
        phases.append(("serving single", 60, lambda: serve_phase(
            "single", args, base_env, workdir, base_config, False, [one_host_env], [], "p2p", budget_left())))
        phases += [(f"serving {v}", 60, serving_run(v)) for v in variants if v != "p2p_net"]
    if not args.no_edges:
        phases.append(("edges two_host", 40, edges_run))
    if not args.no_serving and "p2p_net" in variants:
        phases.append(("serving p2p_net", 60, serving_run("p2p_net")))
    if not args.no_edges and cuda:
        phases.append(("edges two_host_p2p_net", 40, lambda: edges_phase(
            "edges_two_host_p2p_net", args, base_env, net_hosts, "p2p", workdir, budget_left())))

    def budget_left() -> float:
        return args.budget - (time.monotonic() - T0)

    skipped, interrupted = [], None
    for name, need, run in phases:
        if interrupted or budget_left() < need:
            skipped.append(name)
            continue
        try:
            rec = run()
        except KeyboardInterrupt as exc:  # the phase stopped its processes on the way out
            interrupted = f"{exc} during {name}"
            print(f"interrupted: {interrupted}", flush=True)
            continue
        kind, key = name.split(" ", 1)
        (serving if kind == "serving" else edges)[key] = rec
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # write the JSON whatever comes now (timeout -k kills later)
    doc["skipped_phases"], doc["interrupted"] = skipped, interrupted
    if "single" in serving:
        reference = [r["text"] for r in serving["single"].get("pinned", [])]
        for v in variants:
            if v in serving:
                texts = [r["text"] for r in serving[v].get("pinned", [])]
                serving[v]["same_text_as_single"] = bool(reference) and texts == reference
                serving[v]["differing_prompts"] = [i for i, (a, b) in enumerate(zip(texts, reference)) if a != b]
    doc["serving"], doc["edges"] = serving, edges

    checks: dict[str, bool] = {}
    if not args.no_serving:
        single = serving.get("single", {})
        checks["single host served the pinned prompts"] = bool(single.get("pinned")) \
            and all(r["text"] for r in single["pinned"])
        checks["single: ranks exited cleanly"] = single.get("ranks_exited_cleanly", False)
        for v in variants:
            rec = serving.get(v, {})
            transport = "mooncake" if v == "mooncake" else "p2p"
            checks[f"{v}: same pinned text as one host"] = rec.get("same_text_as_single", False)
            checks[f"{v}: KV crossed hosts via {transport}"] = rec.get("kv_flow", {}).get("count", 0) >= \
                args.prompts + args.long
            checks[f"{v}: 0 live tensors after"] = bool(rec.get("edges_after", {}).get("live_tensors")) and \
                not any(rec["edges_after"]["live_tensors"].values())
            checks[f"{v}: ranks exited cleanly"] = rec.get("ranks_exited_cleanly", False)
    if not args.no_edges:
        for name in ["two_host", *(["two_host_p2p_net"] if cuda else [])]:
            checks[f"edges {name} ran"] = "table" in edges.get(name, {})
    doc["checks"] = checks
    doc["summary"] = summary(doc)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({"summary": doc["summary"], "checks": checks}, indent=1))
    print(f"wrote {out}")
    if not args.workdir and all(checks.values()):
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if checks and all(checks.values()) else 1


def summary(doc: dict) -> dict:
    """The headline numbers: KV edge bandwidth per serving run, raw edges per size and path."""
    out: dict = {}
    for name, rec in doc["serving"].items():
        out[f"serving {name}"] = {
            "same_text_as_single": rec.get("same_text_as_single"), "error": rec.get("error"),
            "kv_long_gbps": rec.get("kv_bandwidth_long", {}).get("gbps"),
            "kv_long_mean_mib": round(rec["kv_bandwidth_long"]["mean_bytes"] / 2**20, 2)
            if rec.get("kv_bandwidth_long", {}).get("mean_bytes") else None,
            "kv_long_mean_ms": rec.get("kv_bandwidth_long", {}).get("mean_ms"),
            "kv_pinned_gbps": rec.get("kv_bandwidth_pinned", {}).get("gbps"),
            "kv_flow_p50_ms": round(rec["kv_flow"]["p50_s"] * 1e3, 3) if rec.get("kv_flow", {}).get("p50_s")
            is not None else None,
            "host_staging_copies": rec.get("edges_after", {}).get("host_staging_copies"),
            "nccl_via": rec.get("nccl_via")}
    for name, rec in doc["edges"].items():
        out[f"edges {name}"] = {row["size"]: {p: v["gbps"] for p, v in row.items() if isinstance(v, dict)}
                                for row in rec.get("table", [])} or rec.get("error")
        if rec.get("nccl_via"):
            out[f"edges {name}"]["nccl_via"] = rec["nccl_via"]
    return out


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        kill_all()
