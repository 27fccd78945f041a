"""The phase trace (mstar_dist/trace.py) through the real launcher: with ``MSTAR_DIST_TRACE_DIR`` set, a normal
SIGTERM shutdown leaves one trace file per process (the front end and every rank) holding a request's phases.

A failure here means a process leaves without writing its trace (a shutdown path that skips ``atexit`` or the
explicit flush), or a call site no longer records its phase.
"""

from __future__ import annotations

import json

import httpx

from tests.e2e.server import REPO, Server


def test_sigterm_shutdown_writes_every_process_trace(tmp_path, monkeypatch):
    monkeypatch.setenv("MSTAR_DIST_TRACE_DIR", str(tmp_path))
    server = Server(REPO / "tests/toy_deploy.yaml", nproc=2)
    try:
        r = httpx.post(f"{server.base_url}/generate", timeout=60, headers={"X-Request-Id": "traced-1"},
                       json={"prompt": "start=0", "stream": True, "model_kwargs": {"max_tokens": 4}})
        assert r.status_code == 200, r.text
    finally:
        assert server.stop_clean(2), server.log()
    files = {p.name.split(".")[1]: p for p in tmp_path.glob("trace.*.jsonl")}
    assert set(files) == {"frontend", "rank0", "rank1"}, sorted(tmp_path.iterdir())
    events = {name: [json.loads(line) for line in path.read_text().splitlines()] for name, path in files.items()}
    for name, lines in events.items():
        assert lines[-1]["phase"] == "trace_end" and lines[-1]["extra"]["dropped"] == 0, name
    front = [(e["phase"], e["rid"]) for e in events["frontend"]]
    wire = next(e["rid"] for e in events["frontend"] if e["phase"] == "cond_admitted"
                and e["extra"]["client"] == "traced-1")
    for phase in ("http_arrived", "http_prepared", "http_submitted", "cond_received", "http_first_event",
                  "http_first_chunk"):
        assert (phase, "traced-1") in front, phase
    for phase in ("cond_dispatch", "cond_first_emit", "cond_first_delta"):
        assert (phase, wire) in front, phase
    ranks = [(e["phase"], e["rid"]) for name in ("rank0", "rank1") for e in events[name]]
    assert ("rank_runwalk", wire) in ranks and ("rank_emits_sent", wire) in ranks
