"""How long a stop takes, as the user sees it (docs/architecture.md §10, "Stops"): each deployment is started with
``launch/serve.sh`` in its own session, like a terminal's job, and once it answers ``/health`` the whole process
group gets Ctrl-C (SIGINT) or SIGTERM; the clock runs until the command has exited. A port already in use is timed
from the command's start to its exit. One JSON file, medians of ``--repeats`` runs:

    python scripts/stop_times.py [--configs smollm2_pd smollm2_dp speech_split moe_pd_tp2] [--repeats 3]
                                 [--out bench/results/stops_cpu.json]

Per config and signal: ``stop_s`` (median, min, max), ``status`` (every run's exit status: 0 for a requested stop),
``ranks_clean`` (runs in which every rank logged ``exits with status 0 (SIGNAL)``), ``last_line`` (the command's last
line), ``tracebacks`` (runs with a traceback in the output) and ``left_behind`` (processes of the job alive after it
exited). Uses the running interpreter's environment as it is (``MSTAR_NO_INSTALL``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tests.e2e.server import REPO, descendants, signal_all, wait_for  # noqa: E402
from tests.helpers import free_port  # noqa: E402

SERVE = REPO / "launch/serve.sh"
NPROC = {"smollm2_pd": 2, "smollm2_dp": 3, "speech_split": 2, "moe_pd_tp2": 4, "image_cfg_parallel": 3}


def env() -> dict[str, str]:
    return {**os.environ, "MSTAR_VENV": sys.prefix, "MSTAR_NO_INSTALL": "1", "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1",
            "MASTER_PORT": str(free_port())}


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def stop_once(config: str, signum: int, log_dir: Path) -> dict:
    port = free_port()
    log_path = log_dir / f"{config}_{signal.Signals(signum).name}_{time.time_ns()}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["bash", str(SERVE), str(REPO / f"launch/configs/{config}.yaml"), "--port", str(port)],
                                cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    family: list[int] = []
    try:
        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"{config} exited with {proc.returncode} before /health:\n"
                                   f"{log_path.read_text()[-3000:]}")
            return _healthy(f"http://127.0.0.1:{port}")

        wait_for(up, 300, f"{config} answering /health", interval=0.25)
        family = descendants(proc.pid)
        t0 = time.monotonic()
        os.killpg(proc.pid, signum)
        try:
            status = proc.wait(60)
        except subprocess.TimeoutExpired:
            status = None
        took = time.monotonic() - t0
        time.sleep(0.5)
        left = [pid for pid in family if _alive(pid)]
    finally:
        signal_all([proc.pid, *family])
    text = log_path.read_text(errors="replace")
    name = signal.Signals(signum).name
    return {"stop_s": took, "status": status, "ranks_clean": text.count(f"exits with status 0 ({name})") == NPROC[config],
            "last_line": text.rstrip().splitlines()[-1] if text.strip() else "", "traceback": "Traceback" in text,
            "left_behind": len(left)}


def port_in_use(config: str) -> dict:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        out = subprocess.run(["bash", str(SERVE), str(REPO / f"launch/configs/{config}.yaml"), "--port", str(port)],
                             cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
    lines = (out.stdout + out.stderr).strip().splitlines()
    return {"config": config, "exit_s": round(took, 2), "status": out.returncode, "lines": len(lines),
            "line": lines[-1] if lines else ""}


def _alive(pid: int) -> bool:
    try:
        return b"zombie" not in Path(f"/proc/{pid}/status").read_bytes().lower()
    except OSError:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["smollm2_pd", "smollm2_dp", "speech_split", "moe_pd_tp2"],
                   choices=sorted(NPROC))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results/stops_cpu.json")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for config in args.configs:
            for signum in (signal.SIGINT, signal.SIGTERM):
                runs = [stop_once(config, signum, Path(logs)) for _ in range(args.repeats)]
                times = [r["stop_s"] for r in runs]
                rows.append({
                    "config": f"launch/configs/{config}.yaml", "ranks": NPROC[config],
                    "signal": signal.Signals(signum).name,
                    "stop_s": {"median": round(statistics.median(times), 2), "min": round(min(times), 2),
                               "max": round(max(times), 2)},
                    "status": [r["status"] for r in runs], "ranks_clean": sum(r["ranks_clean"] for r in runs),
                    "last_line": runs[-1]["last_line"], "tracebacks": sum(r["traceback"] for r in runs),
                    "left_behind": sum(r["left_behind"] for r in runs), "runs": len(runs),
                })
                print(json.dumps(rows[-1]), flush=True)
        busy = port_in_use(args.configs[0])
        print(json.dumps(busy), flush=True)
    command = "python scripts/stop_times.py " + " ".join(sys.argv[1:])
    Path(args.out).write_text(json.dumps({"command": command, "machine": "2-core CPU VM", "stops": rows,
                                          "port_in_use": busy}, indent=1) + "\n")


if __name__ == "__main__":
    main()
