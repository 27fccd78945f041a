"""Where a request's time to first token goes: the phase trace (``mstar_dist/trace.py``) of a served deployment at
one or more concurrencies, phase to phase along the TTFT path.

    python scripts/ttft_trace.py [--config launch/configs/smollm2_single.yaml:1] [--model llama]
                                 [--streams 1 32] [--requests-per-stream 2] [--max-tokens 256]
                                 [--device cpu|cuda] [--client async|threads] [--out FILE.json]
                                 [--events-out FILE.jsonl]

Starts the deployment with ``MSTAR_DIST_TRACE_DIR`` set (``tests/e2e/server.py``'s ``Server``, as
``bench_serving.py`` does), warms it with every prompt once (untraced by window: a prompt length's first prefill on
a GPU pays for new kernel shapes), then for each ``--streams`` value runs that many concurrent streaming clients
(``bench_serving``'s asyncio client, or ``--client threads``; above 8 streams in several client processes), each doing
``--requests-per-stream`` requests one after another. It stops the server with SIGTERM (every process writes its
trace file then), merges the files and reports, per ``--streams`` value, over the requests that arrived in that
run's time window (every process of the host reads one CLOCK_MONOTONIC, so their events line up):

- ``segments``: each step of the TTFT path, median / p90 / mean ms and the number of requests that had both ends:
  http_arrived (route handler) -> http_prepared (params built) -> http_submitted (handed to the conductor's
  command queue) -> cond_received (conductor thread took it) -> cond_preprocessed (tokenised) -> cond_admitted ->
  cond_dispatch (prefill RunWalk handed to the socket) -> rank_runwalk (the rank's loop handled it: a RunWalk that
  lands during a forward waits for it) -> eng_prefill_start -> eng_prefill_end (the first token on the host) ->
  rank_emits_sent (the turn's Emits handed to the socket: after every forward of that turn of the rank's loop, so
  on a rank that also decodes, after the decode step that follows the prefill) -> cond_first_emit (conductor
  handled the Emit, detokenised) -> cond_first_delta (handed to the HTTP loop) -> http_first_event (the response's
  generator has it) -> http_first_chunk (written to the socket), framed by the client's own stamps: client_sent
  (the request about to be written, before http_arrived: the way in, and any wait before an intake's handler runs)
  and client_first_line (its first line with tokens read, after http_first_chunk); plus the totals ``client_sent ->
  client_first_line`` (the client's TTFT), ``http_arrived -> http_first_chunk`` (the server's TTFT),
  ``cond_admitted -> cond_first_emit`` (what ``mstar_dist_time_to_first_token_seconds`` measures) and a few longer
  stretches;
- ``prefill``: prefill forwards run in the window, rows (and prompt tokens) per forward, mean forward ms, and the
  rows of the forward each request's prefill ran in;
- ``decode``: decode steps in the window, mean step ms and rows;
- ``waiting_behind_decode``: per request, the decode steps that ran on the rank of its prefill between its
  ``rank_runwalk`` and its ``eng_prefill_start`` (mostly 0: the worker handles messages only between turns of its
  loop, so a RunWalk that lands during a step waits in the socket), and between its ``cond_dispatch``
  and ``eng_prefill_start`` (a step in progress when the RunWalk was sent counts), with the ms of decode inside
  that second window, and the other requests' prefill forwards (count, ms) in it: what the rank was busy with
  while the request's prefill waited; and the decode steps (count, ms) between its prefill's end and its first
  Emits leaving the rank;
- ``client_ttft_ms``: the clients' own TTFT (first streamed line with tokens), median and p90.
Writes the JSON to ``--out`` (default ``bench/raw/ttft_trace_<device>.json``) and prints a compact table.
``--events-out`` keeps every merged event (JSON lines) for a closer look. On a GPU machine: ``bash
scripts/gpu_run.sh trace`` (the single rank with 4 intakes; carry ``.whl``, ``.ckpt``).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.bench_serving import (  # noqa: E402
    CLIENT_STREAMS_PER_PROCESS, CLIENTS, PROMPTS, client_processes, run_streams,
)
from tests.e2e.server import WEIGHTS, Server  # noqa: E402

TRACE_ENV = "MSTAR_DIST_TRACE_DIR"  # mstar_dist.trace.ENV (not imported: this process must not trace itself)

PATH = ["client_sent", "http_arrived", "http_prepared", "http_submitted", "cond_received", "cond_preprocessed",
        "cond_admitted", "cond_dispatch", "rank_runwalk", "eng_prefill_start", "eng_prefill_end", "rank_emits_sent",
        "cond_first_emit", "cond_first_delta", "http_first_event", "http_first_chunk", "client_first_line"]
WAVE_PHASES = ["http_arrived", "http_submitted", "cond_received", "cond_dispatch", "rank_runwalk", "eng_prefill_start",
               "rank_emits_sent", "http_first_chunk"]
"""Where ``waves`` measures how far apart a burst's requests are: a burst that reaches the intakes over several ms
cannot get its first tokens together however the rank batches it."""
WAVE_GAP_S = 0.03
"""Arrivals further apart than this start a new wave (a 32-stream phase's waves are ~0.5 s apart)."""
TOTALS = [("client_sent", "client_first_line"), ("http_arrived", "http_first_chunk"),
          ("cond_admitted", "cond_first_emit"), ("cond_dispatch", "eng_prefill_start"),
          ("http_arrived", "cond_dispatch"), ("eng_prefill_end", "http_first_chunk"),
          # with intake processes: the submit's wait for the intake's link thread, then the way to the conductor
          ("http_submitted", "intake_sent"), ("intake_sent", "cond_received")]


# ------------------------------------------------------------------------------------------------ clients


def run_clients(base_url: str, streams: int, per_stream: int, max_tokens: int,
                pool: cf.ProcessPoolExecutor | None, client: str) -> tuple[list[tuple], float, float]:
    """``streams`` concurrent streaming clients, ``per_stream`` requests each one after another: (per-request
    ``bench_serving._Tally.result``, monotonic start, monotonic end)."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(streams * per_stream)]
    t0 = time.monotonic()  # the servers' clock: the window selects their trace events
    results = run_streams(base_url, prompts, streams, max_tokens, pool, client)[0]
    return results, t0, time.monotonic()


def client_events(results: list[tuple]) -> list[dict]:
    """The clients' side of each request as trace events (``bench_serving._Tally``: one host, one CLOCK_MONOTONIC):
    ``client_sent`` (the request about to be written) and ``client_first_line`` (its first line with tokens read),
    under its ``X-Request-Id``, the id the server's HTTP events carry."""
    out = []
    for ttft, _total, _tokens, rid, sent in results:
        out.append({"t": sent, "phase": "client_sent", "rid": rid, "proc": "client", "extra": {}})
        if ttft:
            out.append({"t": sent + ttft, "phase": "client_first_line", "rid": rid, "proc": "client", "extra": {}})
    return out


def warm(base_url: str) -> None:
    """Every prompt once, one at a time, 8 tokens (kernel shapes of every prompt length; not analysed)."""
    run_streams(base_url, PROMPTS, 1, 8, None)


# ------------------------------------------------------------------------------------------------ analysis


def load(trace_dir: Path) -> list[dict]:
    """Every event of every trace file, sorted by time (``trace_end`` lines left out)."""
    events = []
    for path in sorted(trace_dir.glob("trace.*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                e = json.loads(line)
                if e["phase"] != "trace_end":
                    events.append(e)
    events.sort(key=lambda e: e["t"])
    return events


def _q(values: list[float], q: float) -> float:
    """The ``q`` quantile (linear interpolation between closest ranks)."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: list[float], scale: float = 1e3, digits: int = 3) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": round(_q(values, 0.5) * scale, digits),
            "p90": round(_q(values, 0.9) * scale, digits), "mean": round(statistics.fmean(values) * scale, digits)}


def requests_of(events: list[dict]) -> dict[str, dict]:
    """Wire id -> {phase: first time, "_proc": {phase: process}, "_prefill": extra of its prefill forward}.
    HTTP events (client ids) are joined through ``cond_admitted``'s ``client``."""
    wire_of: dict[str, str] = {}
    for e in events:
        if e["phase"] == "cond_admitted":
            wire_of[e["extra"]["client"]] = e["rid"]
    reqs: dict[str, dict] = collections.defaultdict(lambda: {"_proc": {}})

    def put(wire: str, e: dict) -> None:
        r = reqs[wire]
        if e["phase"] not in r:
            r[e["phase"]] = e["t"]
            r["_proc"][e["phase"]] = e["proc"]

    for e in events:
        phase, rid = e["phase"], e["rid"]
        if phase in ("eng_prefill_start", "eng_prefill_end"):
            for wire in e["extra"].get("ids", []):
                if phase == "eng_prefill_start" and phase not in reqs[wire]:
                    reqs[wire]["_prefill"] = e["extra"]
                put(wire, e)
        elif phase.startswith("eng_decode"):
            continue
        elif rid:
            wire = wire_of.get(rid, rid) if phase.startswith(("http_", "client_")) or phase in (
                "cond_received", "cond_preprocessed") else rid
            put(wire, e)
    return reqs


def _first_rank_runwalk(events: list[dict], wire: str, proc: str) -> float | None:
    return next((e["t"] for e in events if e["phase"] == "rank_runwalk" and e["rid"] == wire and e["proc"] == proc),
                None)


def spans(events: list[dict], start: str, end: str) -> dict[str, list[tuple[float, float, dict]]]:
    """Process -> [(start t, end t, start extra)] of the forwards/steps ``start`` .. ``end`` (one engine thread
    per process: they pair up in order)."""
    out: dict[str, list] = collections.defaultdict(list)
    open_: dict[tuple[str, str], tuple[float, dict]] = {}
    for e in events:
        key = (e["proc"], e["extra"].get("engine", ""))
        if e["phase"] == start:
            open_[key] = (e["t"], e["extra"])
        elif e["phase"] == end and key in open_:
            t0, extra = open_.pop(key)
            out[e["proc"]].append((t0, e["t"], extra))
    return out


def _overlap(spans_: list[tuple[float, float, dict]], a: float, b: float) -> list[float]:
    """How long each of ``spans_`` that overlaps [a, b] lies inside it."""
    return [max(0.0, min(e, b) - max(s, a)) for s, e, _ in spans_ if e > a and s < b]


def analyse(events: list[dict], t0: float, t1: float) -> dict:
    """The report of one run: the requests that arrived in [t0, t1] and the engine work in that window."""
    reqs = requests_of(events)
    arrived = lambda r: r.get("http_arrived", r.get("cond_received", r.get("cond_admitted")))  # noqa: E731
    mine = {w: r for w, r in reqs.items() if arrived(r) is not None and t0 <= arrived(r) <= t1}
    segments = {}
    for a, b in zip(PATH, PATH[1:]):
        segments[f"{a} -> {b}"] = summary([r[b] - r[a] for r in mine.values() if a in r and b in r])
    totals = {f"{a} -> {b}": summary([r[b] - r[a] for r in mine.values() if a in r and b in r]) for a, b in TOTALS}

    prefills = spans(events, "eng_prefill_start", "eng_prefill_end")
    decodes = spans(events, "eng_decode_start", "eng_decode_end")
    in_window = lambda xs: [x for x in xs if t0 <= x[0] <= t1]  # noqa: E731
    pf = [x for proc in prefills.values() for x in in_window(proc)]
    dc = [x for proc in decodes.values() for x in in_window(proc)]
    prefill = {
        "forwards": len(pf),
        "rows_per_forward": summary([x[2]["rows"] for x in pf], scale=1, digits=2),
        "tokens_per_forward": summary([x[2]["tokens"] for x in pf], scale=1, digits=1),
        "forward_ms": summary([x[1] - x[0] for x in pf]),
        "rows_of_a_requests_forward": summary([r["_prefill"]["rows"] for r in mine.values() if "_prefill" in r],
                                              scale=1, digits=2),
        "rows_histogram": dict(sorted(collections.Counter(x[2]["rows"] for x in pf).items())),
    }
    decode = {"steps": len(dc), "step_ms": summary([x[1] - x[0] for x in dc]),
              "rows_per_step": summary([x[2]["rows"] for x in dc], scale=1, digits=2)}

    behind_runwalk, behind_dispatch, behind_ms, before_pf, before_pf_ms, window_ms = [], [], [], [], [], []
    after_steps, after_ms = [], []
    for wire, r in mine.items():
        proc = r["_proc"].get("eng_prefill_start")
        if proc is None:
            continue
        start = r["eng_prefill_start"]
        steps = decodes.get(proc, [])
        got = _first_rank_runwalk(events, wire, proc)
        if got is not None:
            behind_runwalk.append(sum(1 for s, _, _ in steps if got <= s < start))
        if "cond_dispatch" in r:
            d = r["cond_dispatch"]
            window_ms.append(start - d)
            behind_dispatch.append(len(_overlap(steps, d, start)))
            behind_ms.append(sum(_overlap(steps, d, start)))
            others = _overlap(prefills.get(proc, []), d, start)  # other requests' prefill forwards
            before_pf.append(len(others))
            before_pf_ms.append(sum(others))
        if "eng_prefill_end" in r and "rank_emits_sent" in r and r["_proc"].get("rank_emits_sent") == proc:
            after = _overlap(steps, r["eng_prefill_end"], r["rank_emits_sent"])
            after_steps.append(len(after))
            after_ms.append(sum(after))
    waiting = {
        "decode_steps_between_rank_runwalk_and_prefill": summary(behind_runwalk, scale=1, digits=2),
        "decode_steps_between_cond_dispatch_and_prefill": summary(behind_dispatch, scale=1, digits=2),
        "decode_ms_between_cond_dispatch_and_prefill": summary(behind_ms),
        "prefill_forwards_between_cond_dispatch_and_prefill": summary(before_pf, scale=1, digits=2),
        "prefill_ms_between_cond_dispatch_and_prefill": summary(before_pf_ms),
        "cond_dispatch_to_prefill_ms": summary(window_ms),
        "decode_steps_between_prefill_end_and_emits": summary(after_steps, scale=1, digits=2),
        "decode_ms_between_prefill_end_and_emits": summary(after_ms),
    }
    complete = sum(1 for r in mine.values() if "http_first_chunk" in r)
    return {"requests": len(mine), "requests_with_first_chunk": complete, "segments_ms": segments,
            "totals_ms": totals, "prefill": prefill, "decode": decode, "waiting_behind_decode": waiting,
            "gc_pauses": gc_pauses(events, t0, t1), "requests_per_intake": requests_per_intake(events, t0, t1),
            "waves": waves(mine, arrived)}


def waves(mine: dict[str, dict], arrived) -> dict:
    """The requests cut into waves (arrivals ``WAVE_GAP_S`` apart start a new one; waves of one request left out) and,
    per phase of ``WAVE_PHASES``, the time from a wave's first request reaching it to its last (ms, over waves): how
    the closed-loop benchmark's bursts spread on their way to the GPU and back."""
    order = sorted((arrived(r), r) for r in mine.values())
    cut: list[list[dict]] = []
    last = None
    for t, r in order:
        if last is None or t - last > WAVE_GAP_S:
            cut.append([])
        cut[-1].append(r)
        last = t
    cut = [w for w in cut if len(w) > 1]
    spread = {}
    for phase in WAVE_PHASES:
        widths = []
        for wave in cut:
            ts = [r[phase] for r in wave if phase in r]
            if len(ts) > 1:
                widths.append(max(ts) - min(ts))
        spread[phase] = summary(widths)
    prefills = [len({tuple(r["_prefill"]["ids"]) for r in wave if "_prefill" in r}) for wave in cut]
    return {"waves": len(cut), "requests_per_wave": summary([len(w) for w in cut], scale=1, digits=1),
            "prefill_forwards_per_wave": summary(prefills, scale=1, digits=1), "spread_ms": spread}


def requests_per_intake(events: list[dict], t0: float, t1: float) -> dict[str, int]:
    """How many of the requests that arrived in [t0, t1] each HTTP process of the trace parsed (0 for one that had
    none then): an intake takes its connections' requests one after another, so an uneven spread delays a burst's
    last arrivals."""
    out = {e["proc"]: 0 for e in events if e["phase"] == "http_arrived"}  # every HTTP process of the trace
    for e in events:
        if e["phase"] == "http_arrived" and t0 <= e["t"] <= t1:
            out[e["proc"]] += 1
    return dict(sorted(out.items()))


def gc_pauses(events: list[dict], t0: float, t1: float) -> dict[str, dict]:
    """Per process kind (``frontend``, ``intake``, ``rank``): the garbage collections that began in [t0, t1], their
    count per generation, total and longest pause (ms). Every thread of a process stands still during one."""
    out: dict[str, dict] = {}
    for e in events:
        if e["phase"] != "gc" or not t0 <= e["t"] <= t1:
            continue
        kind = e["proc"].rstrip("0123456789")
        row = out.setdefault(kind, {"collections": 0, "by_generation": {}, "ms_total": 0.0, "ms_max": 0.0})
        row["collections"] += 1
        gen = str(e["extra"].get("generation"))
        row["by_generation"][gen] = row["by_generation"].get(gen, 0) + 1
        row["ms_total"] = round(row["ms_total"] + e["extra"]["ms"], 3)
        row["ms_max"] = max(row["ms_max"], e["extra"]["ms"])
    return out


# ------------------------------------------------------------------------------------------------ report


def table(runs: dict[str, dict]) -> str:
    keys = list(runs)
    lines = [f"{'segment (ms: median/p90)':58s}" + "".join(f"{'streams ' + k:>22s}" for k in keys)]

    def row(name: str, cells: list[dict]) -> str:
        fmt = lambda s: f"{s['median']:9.2f} /{s['p90']:9.2f}" if s.get("n") else f"{'-':>20s}"  # noqa: E731
        return f"{name[:58]:58s}" + "".join(f"{fmt(c):>22s}" for c in cells)

    for seg in runs[keys[0]]["segments_ms"]:
        lines.append(row(seg, [runs[k]["segments_ms"][seg] for k in keys]))
    lines.append("-" * (58 + 22 * len(keys)))
    for seg in runs[keys[0]]["totals_ms"]:
        lines.append(row("total " + seg, [runs[k]["totals_ms"][seg] for k in keys]))
    lines.append(row("client TTFT", [runs[k]["client_ttft_ms"] for k in keys]))
    lines.append(row("prefill forward", [runs[k]["prefill"]["forward_ms"] for k in keys]))
    lines.append(row("decode step", [runs[k]["decode"]["step_ms"] for k in keys]))
    lines.append(row("decode ms between cond_dispatch and prefill",
                     [runs[k]["waiting_behind_decode"]["decode_ms_between_cond_dispatch_and_prefill"] for k in keys]))
    lines.append(row("other prefills' ms between cond_dispatch and prefill",
                     [runs[k]["waiting_behind_decode"]["prefill_ms_between_cond_dispatch_and_prefill"]
                      for k in keys]))
    lines.append(row("decode steps between cond_dispatch and prefill (count)",
                     [runs[k]["waiting_behind_decode"]["decode_steps_between_cond_dispatch_and_prefill"]
                      for k in keys]))
    lines.append(row("decode steps between rank_runwalk and prefill (count)",
                     [runs[k]["waiting_behind_decode"]["decode_steps_between_rank_runwalk_and_prefill"]
                      for k in keys]))
    lines.append(row("decode ms between prefill end and the first Emits",
                     [runs[k]["waiting_behind_decode"]["decode_ms_between_prefill_end_and_emits"] for k in keys]))
    lines.append(row("rows per prefill forward (count)", [runs[k]["prefill"]["rows_per_forward"] for k in keys]))
    lines.append(row("prefill forwards per wave (count)",
                     [runs[k]["waves"]["prefill_forwards_per_wave"] for k in keys]))
    for phase in WAVE_PHASES:
        lines.append(row(f"a wave's spread at {phase}", [runs[k]["waves"]["spread_ms"][phase] for k in keys]))
    per_intake = [runs[k]["requests_per_intake"] for k in keys]
    lines.append(f"{'requests per HTTP process (fewest / most)':58s}" + "".join(
        f"{min(c.values()):>11d} /{max(c.values()):9d}" if c else f"{'-':>21s}" for c in per_intake))
    for kind in sorted({k for r in runs.values() for k in r["gc_pauses"]}):
        cells = [runs[k]["gc_pauses"].get(kind) for k in keys]
        lines.append(f"{'gc pauses of ' + kind + ' (count / longest ms)':58s}" + "".join(
            f"{c['collections']:>11d} /{c['ms_max']:9.2f}" if c else f"{'-':>21s}" for c in cells))
    lines.append(f"{'prefill forwards / decode steps / requests':58s}" + "".join(
        f"{runs[k]['prefill']['forwards']:>8d} /{runs[k]['decode']['steps']:>6d} /{runs[k]['requests']:>4d}"
        for k in keys))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "launch/configs/smollm2_single.yaml") + ":1", metavar="PATH:NPROC")
    p.add_argument("--model", default=None, help="registry key override for the served config (e.g. llama)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--device", default="cpu", help="cpu | cuda (recorded; the server picks CUDA by itself)")
    p.add_argument("--out", default=None)
    p.add_argument("--events-out", default=None, help="also write every merged trace event here (JSON lines)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--client", choices=sorted(CLIENTS), default="async", help="bench_serving's clients")
    args = p.parse_args()
    path, nproc = args.config.rsplit(":", 1)
    top = max(args.streams)
    own = (yaml.safe_load(Path(path).read_text()) or {}).get("engine") or {}
    overrides = {"engine": {**own, "max_batch": max(16, top)},
                 "limits": {"max_concurrent_requests": max(64, 2 * top), "max_tokens": 4096}}
    if args.model:
        overrides["model"] = args.model
    trace_dir = Path(tempfile.mkdtemp(prefix="mstar-ttft-trace-"))
    os.environ[TRACE_ENV] = str(trace_dir)  # for the server's processes only
    try:
        server = Server(path, nproc=int(nproc), overrides=overrides)
    finally:
        del os.environ[TRACE_ENV]
    print(f"server up in {server.ready_seconds:.1f} s; traces in {trace_dir}", flush=True)
    pool = None
    windows: dict[int, tuple[list, float, float]] = {}
    try:
        if not args.no_warmup:
            warm(server.base_url)
        if top > CLIENT_STREAMS_PER_PROCESS:
            pool = client_processes(top)
        for n in args.streams:
            time.sleep(0.5)  # the previous run's last requests are released everywhere
            windows[n] = run_clients(server.base_url, n, args.requests_per_stream, args.max_tokens, pool, args.client)
            print(f"{n} streams: {len(windows[n][0])} requests in {windows[n][2] - windows[n][1]:.1f} s", flush=True)
    finally:
        if pool is not None:
            pool.shutdown()
        rc = server.stop()
        log = server.log_path.read_text(errors="replace")
    clean = log.count("exits with status 0")
    files = sorted(x.name for x in trace_dir.glob("trace.*.jsonl"))
    if not any(".frontend." in f for f in files) or not any(".rank" in f for f in files):
        sys.exit(f"ttft_trace: missing trace files in {trace_dir} (got {files}); server log tail:\n{log[-4000:]}")
    events = sorted(load(trace_dir) + [e for results, _, _ in windows.values() for e in client_events(results)],
                    key=lambda e: e["t"])
    runs = {}
    for n, (results, t0, t1) in windows.items():
        report = analyse(events, t0, t1)
        report["client_ttft_ms"] = summary([r[0] for r in results])
        report["client_tokens"] = sum(r[2] for r in results)
        report["seconds"] = round(t1 - t0, 3)
        runs[str(n)] = report
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "config": args.config, "model": args.model, "weights": WEIGHTS, "max_tokens": args.max_tokens,
        "requests_per_stream": args.requests_per_stream, "streams": args.streams, "client": args.client,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "device": args.device,
                    "loadavg_1m": os.getloadavg()[0]},
        "server": {"ready_seconds": round(server.ready_seconds, 2), "exit_status": rc,
                   "ranks_exited_cleanly": clean, "trace_files": files, "events": len(events)},
        "path": PATH,
        "runs": runs,
    }
    if args.device.startswith("cuda"):
        try:
            import torch

            result["machine"]["gpu"] = torch.cuda.get_device_name(0)
        except Exception:  # noqa: BLE001
            pass
    out = Path(args.out or REPO / f"bench/raw/ttft_trace_{args.device.split(':')[0]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if args.events_out:
        with open(args.events_out, "w") as f:
            for e in events:
                f.write(json.dumps(e) + "\n")
    shutil.rmtree(trace_dir, ignore_errors=True)
    print(table(runs))
    print(f"wrote {out}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
