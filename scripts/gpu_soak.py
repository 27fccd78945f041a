"""The mixed soak's two halves (scripts/gpu_soak.sh runs them): one deployment under scripts/soak.py's traffic for a
given time, and the combined verdict of all of them.

    python scripts/gpu_soak.py one --name pd --config launch/configs/smollm2_pd.yaml --seconds 600 \\
        --concurrency 16 --dir /tmp/soak/pd [--override '{"model": "llama"}']
    python scripts/gpu_soak.py combine --dir /tmp/soak --seconds 600 --out /tmp/soak/result.json

``one`` starts the deployment the way soak.py does (``tests.e2e.server.Server``: torchrun in its own session,
weights ``$MSTAR_TEST_WEIGHTS`` unless ``--override`` names others), drives it with soak.py's plan (native and
OpenAI requests, streamed or not, one in ten streamed and abandoned after its first chunk, i.e. a client abort
mid-stream) until ``--seconds`` have passed (``--requests`` is only a ceiling), then soak.py's own checks (0 live
tensors, 0 KV slots, no failed request, RSS growth) and stops it with SIGTERM (every rank must exit 0). Then it
keeps the server log (``DIR/server.log``) and greps it for NCCL watchdog / timeout / error lines, separately
for the run and for the shutdown, and looks for flight-recorder dumps (``DIR/nccl_trace_rank_*``, written when the
watchdog fires). soak.py's OpenAI requests name the model "smollm2": here they name the served model (from
``/v1/models``), so a Qwen3-MoE deployment takes them too. SIGTERM ends the run and still stops the server.

``combine`` reads every ``DIR/*/soak.json`` and writes the verdict: per deployment and overall, the issue's
criteria (no hang, no NCCL watchdog timeout, 0 live tensors afterwards, no crash) plus soak.py's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

WATCHDOG = re.compile(r"watchdog caught|watchdog got stuck|heartbeat monitor timed out|collective operation timeout|"
                      r"operations have failed or timed out|timeout at nccl work|checkTimeout|"
                      r"milliseconds before timing out", re.I)
"""ProcessGroupNCCL's watchdog and timeout lines ("Watchdog caught collective operation timeout", "Heartbeat
monitor timed out", "Some NCCL operations have failed or timed out", ...), not its start-up options."""
ANY_WATCHDOG = re.compile(r"watchdog|heartbeat", re.I)
NCCL_ERROR = re.compile(r"NCCL WARN|ncclSystemError|ncclInternalError|ncclRemoteError|ncclUnhandledCudaError|"
                        r"ncclInvalidUsage|NCCL error", re.I)
RUNTIME_ALARM = re.compile(r"declared dead|AbortPair|aborting the pair|pending for \d+|Traceback", re.I)


def _grep(text: str, pattern: re.Pattern, limit: int = 20) -> dict:
    lines = [ln[:400] for ln in text.splitlines() if pattern.search(ln)]
    return {"count": len(lines), "lines": lines[:limit]}


def one(args) -> int:
    import httpx
    import yaml

    import soak
    from tests.e2e.server import WEIGHTS, Server

    out_dir = Path(args.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = str(out_dir / "nccl_trace_rank_")
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                       "TORCH_FR_DUMP_TEMP_FILE": trace, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": trace})

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    config = Path(args.config)
    overrides = json.loads(args.override) if args.override else {}
    nproc = args.nproc or 1 + max(r for g in (overrides.get("node_groups")
                                              or yaml.safe_load(config.read_text())["node_groups"]) for r in g["ranks"])
    t_start = time.time()
    doc: dict = {
        "name": args.name, "command": " ".join(["python", *sys.argv]), "config": str(config), "overrides": overrides,
        "weights": overrides.get("weights", WEIGHTS), "nproc": nproc, "seconds": args.seconds,
        "concurrency": args.concurrency,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "loadavg_1m_before": round(os.getloadavg()[0], 2)},
    }
    server = None
    stop_offset = 0
    try:
        server = Server(config, nproc=nproc, overrides=overrides, startup_timeout=args.startup_timeout)
        (out_dir / "server.pid").write_text(str(server.proc.pid))
        doc["cold_start_to_health_s"] = round(server.ready_seconds, 1)
        served = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        doc["served_model"] = served
        original = soak._request

        def request(p):  # soak.py names "smollm2" in its OpenAI bodies: name the served model instead
            path, body = original(p)
            if "model" in body:
                body = {**body, "model": served}
            return path, body

        soak._request = request
        print(f"[{args.name}] serving {served} on {server.base_url} after {doc['cold_start_to_health_s']} s; "
              f"traffic for {args.seconds:.0f} s at concurrency {args.concurrency}", flush=True)
        report = soak.run_soak(server.base_url, soak.plan(args.requests, args.seed), concurrency=args.concurrency,
                               max_seconds=args.seconds, baseline_after=args.baseline_after, sample_s=args.sample_s,
                               rss_tolerance=args.rss_tolerance, idle_timeout=args.idle_timeout,
                               log=lambda line: print(f"[{args.name}] {line}", flush=True))
        doc.update(report)
        doc["checks"] = soak.checks(doc)
        # the plan is a ceiling: a timed soak leaves part of it unsent on purpose
        doc["checks"].pop("every planned request sent", None)
        doc["checks"]["not stopped early (no rank lost)"] = doc.get("stopped_early") is None
        doc["checks"]["idle after the traffic"] = bool(doc["after"].get("idle"))
        doc["checks"][f"traffic ran >= 90% of {args.seconds:.0f} s"] = doc["wall_s"] >= 0.9 * args.seconds \
            or not doc["truncated"]
    except KeyboardInterrupt as exc:
        doc["error"] = f"interrupted ({exc})"
    except Exception as exc:  # recorded, the server still stops
        doc["error"] = f"{type(exc).__name__}: {exc}"[:4000]
    finally:
        if server is not None:
            stop_offset = server.log_path.stat().st_size if server.log_path.exists() else 0
            clean = server.stop_clean(nproc)
            doc["ranks_exited_cleanly"] = clean
            shutil.copy(server.log_path, out_dir / "server.log")
    text = (out_dir / "server.log").read_text(errors="replace") if (out_dir / "server.log").exists() else ""
    run, shutdown = text[:stop_offset], text[stop_offset:]
    doc["log_scan"] = {
        "watchdog_or_nccl_timeout_during_run": _grep(run, WATCHDOG),
        "watchdog_or_nccl_timeout_at_shutdown": _grep(shutdown, WATCHDOG),
        "nccl_errors_during_run": _grep(run, NCCL_ERROR),
        "nccl_errors_at_shutdown": _grep(shutdown, NCCL_ERROR),
        "runtime_alarms_during_run": _grep(run, RUNTIME_ALARM),
        "any_watchdog_or_heartbeat_mention (informative)": _grep(text, ANY_WATCHDOG),
        "flight_recorder_dumps": sorted(p.name for p in out_dir.glob("nccl_trace_rank_*")),
        "rank_exit_lines": [ln[:200] for ln in text.splitlines() if "exits with status" in ln],
    }
    scan = doc["log_scan"]
    checks = doc.setdefault("checks", {})
    checks["no NCCL watchdog / timeout line in the rank logs"] = \
        scan["watchdog_or_nccl_timeout_during_run"]["count"] == 0 and \
        scan["watchdog_or_nccl_timeout_at_shutdown"]["count"] == 0
    checks["no flight-recorder dump"] = not scan["flight_recorder_dumps"]
    checks["ranks exited cleanly (status 0 after SIGTERM)"] = bool(doc.get("ranks_exited_cleanly"))
    checks["no error in the driver"] = "error" not in doc
    doc["total_s"] = round(time.time() - t_start, 1)
    doc["passed"] = all(checks.values())
    (out_dir / "soak.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"[{args.name}] {'PASSED' if doc['passed'] else 'FAILED'}: "
          + json.dumps({k: v for k, v in checks.items() if not v} or doc.get("counts")), flush=True)
    return 0 if doc["passed"] else 1


# the criteria, named after the checks above
CRITERIA = {
    "no hang": ["no failed requests", "idle after the traffic", "no error in the driver"],
    "no NCCL watchdog timeout": ["no NCCL watchdog / timeout line in the rank logs", "no flight-recorder dump"],
    "0 live tensors afterwards": ["0 live tensors on every rank"],
    "no crash": ["not stopped early (no rank lost)", "ranks exited cleanly (status 0 after SIGTERM)"],
}


def combine(args) -> int:
    root = Path(args.dir)
    runs = {p.parent.name: json.loads(p.read_text()) for p in sorted(root.glob("*/soak.json"))}
    rcs = dict(zip(args.names.split(","), args.rcs.split(","))) if args.rcs else {}
    doc: dict = {
        "benchmark": "soak_mixed", "seconds": args.seconds, "device": args.device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commands": {"start": f"bash scripts/gpu_soak.sh start {args.seconds:.0f}",
                     **{name: run.get("command") for name, run in runs.items()}},
        "driver_exit_codes": rcs,
        "what": "both deployments served at the same time on the same devices, each driven by scripts/soak.py's "
                "mixed plan (native + OpenAI, streamed or not, stop strings, seeded/sampled/greedy; one request in "
                "ten abandoned mid-stream) until the time was up",
    }
    try:
        import torch

        doc["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        doc["torch"] = torch.__version__
    except Exception:  # the verdict does not need torch
        pass
    missing = [n for n in args.names.split(",") if n not in runs]
    per: dict = {}
    for name, run in runs.items():
        checks = run.get("checks", {})
        per[name] = {
            "config": run.get("config"), "served_model": run.get("served_model"), "nproc": run.get("nproc"),
            "traffic_s": run.get("wall_s"), "requests_sent": run.get("requests_sent"), "counts": run.get("counts"),
            "completion_tokens": run.get("completion_tokens"), "latency_s": run.get("latency_s"),
            "after": run.get("after"), "rss_growth": run.get("rss", {}).get("growth"),
            "criteria": {c: all(checks.get(k, False) for k in keys) for c, keys in CRITERIA.items()},
            "checks": checks, "passed": run.get("passed", False), "error": run.get("error"),
        }
    doc["deployments"] = per
    doc["missing_deployments"] = missing
    doc["criteria"] = {c: bool(per) and not missing and all(p["criteria"][c] for p in per.values()) for c in CRITERIA}
    doc["passed"] = bool(per) and not missing and all(p["passed"] for p in per.values()) \
        and all(rc == "0" for rc in rcs.values())
    doc["runs"] = runs
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({"passed": doc["passed"], "criteria": doc["criteria"], "missing": missing,
                      **{n: {"counts": p["counts"], "traffic_s": p["traffic_s"], "after": p["after"],
                             "failed_checks": [k for k, v in p["checks"].items() if not v], "error": p["error"]}
                         for n, p in per.items()}}, indent=1))
    return 0 if doc["passed"] else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("one", help="one deployment under traffic for --seconds")
    o.add_argument("--name", required=True)
    o.add_argument("--config", required=True)
    o.add_argument("--override", default=None, help="JSON merged over the config's top-level keys")
    o.add_argument("--nproc", type=int, default=None)
    o.add_argument("--seconds", type=float, default=600.0, help="no new request after this many seconds")
    o.add_argument("--requests", type=int, default=None, help="the plan's length, a ceiling (default 200/s)")
    o.add_argument("--concurrency", type=int, default=8)
    o.add_argument("--baseline-after", type=int, default=100)
    o.add_argument("--sample-s", type=float, default=2.0)
    o.add_argument("--rss-tolerance", type=float, default=0.05)
    o.add_argument("--idle-timeout", type=float, default=90.0)
    o.add_argument("--startup-timeout", type=float, default=240.0)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--dir", required=True)
    c = sub.add_parser("combine", help="the verdict over DIR/*/soak.json")
    c.add_argument("--dir", required=True)
    c.add_argument("--names", default="pd,tp2")
    c.add_argument("--rcs", default=None, help="the drivers' exit codes, in --names order")
    c.add_argument("--seconds", type=float, required=True)
    c.add_argument("--device", default=None)
    c.add_argument("--out", required=True)
    args = p.parse_args()
    if args.cmd == "one":
        args.requests = args.requests or max(1000, int(args.seconds * 200))
        return one(args)
    return combine(args)


if __name__ == "__main__":
    sys.exit(main())
