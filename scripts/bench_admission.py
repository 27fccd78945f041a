"""Host cost of admitting a burst of requests, without the GPU: the conductor's ``submit`` and a rank taking the
``RunWalk``s, per request.

    python scripts/bench_admission.py --weights DIR [--burst 32] [--rounds 60] [--out FILE]

A burst of requests (the 32 of a benchmark wave) passes one process at a time through the conductor, which admits
each, picks its ranks and sends its prefill ``RunWalk``, and then through the rank that starts its walk. Both run one
request after another, so what one request costs them adds to how far apart the burst reaches the GPU
(docs/architecture.md §2). Measured here on the real code: the Llama chat family's front end (``DIR`` needs its
tokenizer files; the prompt comes already encoded, as an HTTP intake sends it), a ``Conductor`` over the single-rank
deployment with a channel that only encodes, and a ``Worker`` with the chat walks (scripts/bench_hostpath.py's).
Reports the median CPU time per request over ``--rounds`` bursts.

    python scripts/bench_admission.py --weights DIR --wire [--burst 32] [--rounds 60] [--pause-ms 20] [--out FILE]

``--wire`` measures the conductor as it runs in the front end instead: its own thread and loop (``Conductor.run``)
over real control channels, a child process playing an HTTP intake (it sends each burst's ``Submit``s back to back)
and the rank (it reads the ``RunWalk``s). Reports how long a burst takes from its first ``Submit`` sent to its last
``RunWalk`` read at the rank (median over bursts), the gap between consecutive ``RunWalk``s, and the conductor
process's CPU per request: what spreads a benchmark wave's arrivals at the GPU (an H200 trace had the conductor
dispatch a 32-request wave ~0.1 ms a request, over 4.9 ms, while the intakes had sent 24 of them within 1.6 ms).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import yaml

REPO = Path.cwd()
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_hostpath import TOKEN, make_worker  # noqa: E402
from models.llama.chat import LlamaChat  # noqa: E402
from mstar_dist.conductor.conductor import Conductor  # noqa: E402
from mstar_dist.config.deployment import parse_config  # noqa: E402
from mstar_dist.control import messages as m  # noqa: E402
from mstar_dist.graph.nodes import node_names  # noqa: E402
from mstar_dist.server.backend import GenerationParams  # noqa: E402
from mstar_dist.topology.placement import Placement  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a haiku about the sea, please, and explain it briefly."}]


class EncodingChannel:
    """Encodes what the conductor sends, as the real channel does, and keeps the payloads."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, peer: str, payload: bytes) -> None:
        self.sent.append(payload)

    def recv(self, timeout_ms: int = 0) -> list:
        return []


def make_conductor(weights: str, intakes: tuple[str, ...] = ()) -> tuple[Conductor, EncodingChannel, list[int]]:
    raw = yaml.safe_load((REPO / "launch/configs/smollm2_single.yaml").read_text())
    raw["weights"] = weights
    model = LlamaChat(weights)
    model.load_frontend()
    placement = Placement.build(parse_config(raw, "bench"),
                                {w: frozenset(node_names(s)) for w, s in model.graphs().items()}, 1)
    channel = EncodingChannel()
    conductor = Conductor(model=model, placement=placement, channel=channel, token=TOKEN, world_size=1,
                          max_concurrent=1 << 20, request_timeout_s=600.0, rank_hosts={0: "h"}, intakes=intakes)
    return conductor, channel, model.tokenizer.encode_prompt(None, MESSAGES)


def one_burst(conductor: Conductor, channel: EncodingChannel, ids: list[int], burst: int, start: int
              ) -> tuple[float, float]:
    """(conductor CPU s per request, rank CPU s per request) for one burst of ``burst`` requests."""
    conductor._active.clear()  # the burst before is done: no admission limit, no growing state
    conductor._by_wire.clear()
    channel.sent.clear()
    params = [GenerationParams(request_id=f"r{start + i}", prompt=None, messages=MESSAGES, max_tokens=256, stop=[],
                               seed=None, prompt_ids=list(ids)) for i in range(burst)]
    t0 = time.thread_time()
    for p in params:
        conductor.submit(p, lambda event: None, True)
    t1 = time.thread_time()
    worker, _, _ = make_worker(burst)
    payloads = list(channel.sent)
    t2 = time.thread_time()
    for payload in payloads:
        worker.handle("conductor", payload)
    t3 = time.thread_time()
    assert len(worker.runs.by_key) == burst, "every RunWalk started a walk"
    return (t1 - t0) / burst, (t3 - t2) / burst


def wire_child(conductor_endpoint: str, ids: list[int], burst: int, rounds: int, pause_s: float) -> None:
    """The ``--wire`` child: an intake channel and a rank channel in one process. Prints their endpoints, waits for
    the conductor's first word on both, then sends ``rounds`` bursts, ``pause_s`` apart, and prints one JSON line of
    what it measured."""
    from mstar_dist.control.channel import ControlChannel

    with ControlChannel("intake0", "127.0.0.1") as intake, ControlChannel("rank0", "127.0.0.1") as rank:
        print(json.dumps({"intake": intake.endpoint, "rank": rank.endpoint}), flush=True)
        intake.connect("conductor", conductor_endpoint)
        deadline = time.monotonic() + 30
        while not rank.recv(100):
            if time.monotonic() > deadline:
                raise TimeoutError("the conductor never sent the rank its first message (30 s)")
        spans, gaps = [], []
        for k in range(rounds):
            payloads = [m.encode(TOKEN, "intake0", m.Submit(params=GenerationParams(
                request_id=f"w{k}r{i}", prompt=None, messages=MESSAGES, max_tokens=256, stop=[], seed=None,
                prompt_ids=list(ids)), pinned_id=True)) for i in range(burst)]
            t0 = time.monotonic()
            for payload in payloads:
                intake.send("conductor", payload)
            seen: list[float] = []
            deadline = t0 + 30
            while len(seen) < burst:
                for _, payload in rank.recv(0):
                    if isinstance(m.decode(payload).body, m.RunWalk):
                        seen.append(time.monotonic())
                if time.monotonic() > deadline:
                    raise TimeoutError(f"burst {k}: {len(seen)} of {burst} RunWalks reached the rank in 30 s")
            spans.append(seen[-1] - t0)
            gaps.extend(b - a for a, b in zip(seen, seen[1:]))
            while intake.recv(0) or rank.recv(0):  # what the conductor sent back (Outputs, Health, heartbeats)
                pass
            time.sleep(pause_s)
        print(json.dumps({"span_s": spans, "gap_s_median": statistics.median(gaps)}), flush=True)


def wire(weights: str, burst: int, rounds: int, pause_s: float = 0.02) -> dict:
    """The ``--wire`` measurement (see the module docstring): the conductor's loop on a thread of this process, which
    does nothing else meanwhile (its CPU time is the conductor's)."""
    from mstar_dist.control.channel import ControlChannel

    conductor, _, ids = make_conductor(weights, intakes=("intake0",))
    with ControlChannel("conductor", "127.0.0.1") as channel:
        conductor.channel = channel
        conductor.serving = True
        child = subprocess.Popen([sys.executable, __file__, "--wire-child", channel.endpoint, "--burst", str(burst),
                                  "--rounds", str(rounds), "--pause-ms", str(pause_s * 1e3),
                                  "--ids", ",".join(map(str, ids))],
                                 stdout=subprocess.PIPE, text=True, cwd=REPO)
        thread = None
        try:
            endpoints = json.loads(child.stdout.readline() or "{}")
            if not endpoints:
                raise RuntimeError(f"the --wire child exited before it listened (status {child.wait(10)})")
            channel.connect("intake0", endpoints["intake"])
            channel.connect("rank0", endpoints["rank"])
            # The child starts on this heartbeat. It leaves before the conductor's thread starts: a channel is
            # one thread's (a send from here racing the thread's first RunWalk gave both one sequence number, and
            # the rank dropped the RunWalk as a repeat).
            conductor._send(0, m.Heartbeat(sent_at=time.monotonic()))
            thread = threading.Thread(target=conductor.run, name="conductor", daemon=True)
            cpu0 = time.process_time()
            thread.start()
            result = json.loads(child.stdout.readline() or "{}")
            cpu = time.process_time() - cpu0
            if child.wait(30) != 0 or not result:
                raise RuntimeError(f"the --wire child failed (status {child.returncode})")
        finally:
            quiet = logging.getLogger("mstar_dist.conductor.conductor")
            level = quiet.level
            quiet.setLevel(logging.CRITICAL)  # its 503s for the bursts' requests at the stop
            conductor.stopped.set()
            if child.poll() is None:
                child.kill()
                child.wait(10)
            if thread is not None:
                thread.join(10)
            quiet.setLevel(level)
    spans = sorted(result["span_s"])
    return {"burst": burst, "rounds": rounds, "pause_ms": pause_s * 1e3, "prompt_tokens": len(ids),
            "burst_span_ms_median": round(statistics.median(spans) * 1e3, 3),
            "runwalk_gap_us_median": round(result["gap_s_median"] * 1e6, 1),
            "conductor_process_cpu_us_per_request": round(cpu / (burst * rounds) * 1e6, 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--weights", default=None, help="a weights directory with tokenizer.json and tokenizer_config.json")
    p.add_argument("--burst", type=int, default=32)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--out", default=None)
    p.add_argument("--wire", action="store_true", help="the conductor's loop over real channels (module docstring)")
    p.add_argument("--pause-ms", type=float, default=20.0, help="--wire: idle time between bursts")
    p.add_argument("--wire-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ids", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.wire_child and not args.weights:
        p.error("--weights DIR is required (a weights directory with the tokenizer's files)")
    torch.set_num_threads(1)
    if args.wire_child:
        wire_child(args.wire_child, [int(i) for i in args.ids.split(",")], args.burst, args.rounds,
                   args.pause_ms / 1e3)
        return
    if args.wire:
        result = {"command": " ".join([sys.executable, *sys.argv]), "tree": str(REPO), **wire(args.weights, args.burst,
                                                                                             args.rounds, args.pause_ms / 1e3),
                  "machine": {"platform": platform.platform(), "python": platform.python_version(),
                              "cpus": os.cpu_count()}}
        print(f"a {args.burst}-request burst: {result['burst_span_ms_median']:.2f} ms from the first Submit to the last "
              f"RunWalk (median), {result['runwalk_gap_us_median']:.1f} us between RunWalks, conductor "
              f"{result['conductor_process_cpu_us_per_request']:.1f} us CPU per request")
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
        return
    conductor, channel, ids = make_conductor(args.weights)
    for k in range(5):
        one_burst(conductor, channel, ids, args.burst, -args.burst * (k + 1))
    runs = [one_burst(conductor, channel, ids, args.burst, k * args.burst) for k in range(args.rounds)]
    result = {"command": " ".join([sys.executable, *sys.argv]), "tree": str(REPO), "burst": args.burst,
              "prompt_tokens": len(ids), "rounds": args.rounds,
              "conductor_submit_cpu_us_median": round(statistics.median(c for c, _ in runs) * 1e6, 1),
              "rank_runwalk_cpu_us_median": round(statistics.median(r for _, r in runs) * 1e6, 1),
              "machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "torch": torch.__version__}}
    print(f"conductor submit: {result['conductor_submit_cpu_us_median']:.1f} us CPU per request; rank RunWalk: "
          f"{result['rank_runwalk_cpu_us_median']:.1f} us ({args.burst}-request bursts, {len(ids)}-token prompts)")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
