"""Where a serving step's time goes: py-spy samples of rank 0's worker and of the front end under load.

    python scripts/profile_serving.py [--config launch/configs/smollm2_single.yaml:1] [--streams 32]
                                      [--max-tokens 256] [--seconds 8] [--out FILE.json]

Starts the deployment, runs ``--streams`` concurrent streaming requests and, while they decode, samples rank 0
(the process feeding the GPU) and the front end (conductor + HTTP) with ``py-spy record`` for ``--seconds``.
The JSON holds, per process, the share of samples by thread and the functions with the largest inclusive and
self shares (idle waits included: a thread blocked in ``select`` is waiting, not working). Needs ``py-spy``.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.bench_serving import CLIENT_STREAMS_PER_PROCESS, PROMPTS, client_processes, run_streams  # noqa: E402
from tests.e2e.server import Server, descendants  # noqa: E402


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


RATE_HZ = 250


def summarize(raw: Path, seconds: float, top: int = 40) -> dict:
    """py-spy's raw (collapsed) stacks -> shares by thread, inclusive and self by function, and how busy each
    thread was (samples over ``RATE_HZ * seconds``: py-spy records a thread only while it is not idle)."""
    threads, incl, own = collections.Counter(), collections.Counter(), collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        frames, n = stack.split(";"), int(n)
        total += n
        threads[frames[0]] += n
        own[frames[-1]] += n
        for frame in set(frames[1:]):
            incl[frame] += n
    share = lambda c: [[round(v / max(total, 1), 4), k] for k, v in c.most_common(top)]  # noqa: E731
    busy = {k: round(v / (RATE_HZ * seconds), 3) for k, v in threads.most_common()}
    return {"samples": total, "busy": busy, "threads": share(threads), "inclusive": share(incl), "self": share(own)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=str(REPO / "launch/configs/smollm2_single.yaml") + ":1", metavar="PATH:NPROC")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seconds", type=int, default=8)
    p.add_argument("--waves", type=int, default=12,
                   help="requests per stream: enough that the load outlasts --seconds (a 256-token wave of 32 streams "
                        "takes about 1 s on an H200)")
    p.add_argument("--model", default=None, help="registry key override (e.g. llama)")
    p.add_argument("--http-processes", type=int, default=None,
                   help="serve with this many HTTP intake processes (server.http_processes); each is profiled too")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    spy = shutil.which("py-spy")
    if spy is None:
        sys.exit("profile_serving: py-spy is not installed (pip install py-spy)")
    path, nproc = args.config.rsplit(":", 1)
    overrides = {"model_kwargs": {"max_batch": max(16, args.streams)},
                 "limits": {"max_concurrent_requests": max(64, 2 * args.streams), "max_tokens": 4096}}
    if args.model:
        overrides["model"] = args.model
    if args.http_processes:
        overrides["server"] = {"http_processes": args.http_processes}
    server = Server(path, nproc=int(nproc), overrides=overrides)
    tmp = Path(tempfile.mkdtemp(prefix="mstar-profile-"))
    result: dict = {"command": " ".join([sys.executable, *sys.argv]), "streams": args.streams}
    targets: dict[str, int] = {}
    try:
        procs = {p: _cmdline(p) for p in descendants(server.proc.pid)}
        targets |= {
            "rank0": min(p for p, c in procs.items() if b"mstar_dist.serve" in c and b"torch.distributed" not in c),
            "frontend": next(p for p, c in procs.items() if b"mstar_dist.runtime.frontend" in c),
        }
        intakes = sorted((c.split(b"\0")[c.split(b"\0").index(b"--index") + 1].decode(), p)
                         for p, c in procs.items() if b"mstar_dist.runtime.intake" in c)
        targets.update({f"intake{k}": p for k, p in intakes})
        run_streams(server.base_url, ["hi"], 1, 8, None)  # warm-up, untimed
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.waves * args.streams)]
        clients = client_processes(args.streams) if args.streams > CLIENT_STREAMS_PER_PROCESS else None
        with cf.ThreadPoolExecutor(1) as pool:
            load = pool.submit(run_streams, server.base_url, prompts, args.streams, args.max_tokens, clients)
            time.sleep(1.0)  # let the batch fill
            spies = {name: subprocess.Popen([spy, "record", "-p", str(pid), "-d", str(args.seconds), "-r", str(RATE_HZ),
                                             "-f", "raw", "-o", str(tmp / f"{name}.txt"), "--threads",
                                             "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                     for name, pid in targets.items()}
            for name, proc in spies.items():
                proc.wait(timeout=args.seconds + 60)
            results, start, end = load.result()
            result["tok_s"] = sum(r[2] for r in results) / (end - start)
            result["seconds_of_load"] = end - start
        if clients is not None:
            clients.shutdown()
        for name in targets:
            raw = tmp / f"{name}.txt"
            result[name] = summarize(raw, args.seconds) if raw.exists() else {"error": spies[name].stderr.read().decode()[-2000:]}
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    for name in targets:
        print(f"== {name}: busy share of each thread {result.get(name, {}).get('busy')}")
        for share, frame in result.get(name, {}).get("inclusive", [])[:25]:
            print(f"{share:6.1%} {frame[:140]}")
    print(f"tok/s during the profile run: {result.get('tok_s', 0):.0f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
