"""The opt-in phase trace (mstar_dist/trace.py): off it records and writes nothing; on it writes every event of a
process at exit, bounded; the runtime's call sites record a request's phases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mstar_dist import trace

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import sys
from mstar_dist import trace
trace.set_process("tester")
print(trace.ON, trace.path() is not None)
if trace.ON:
    trace.event("a", "r1", x=1)
    trace.event_at(0.5, "b", "r1")
    trace.first("c", ["r1", "r2"], n=2)
    trace.first("c", ["r1"], n=1)
    trace.event("d")
"""


def _run(tmp_path: Path, env_dir: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != trace.ENV}
    env["PYTHONPATH"] = str(REPO)
    if env_dir is not None:
        env[trace.ENV] = env_dir
    out = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    return out.stdout.strip()


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_off_records_nothing_and_writes_nothing(tmp_path):
    assert _run(tmp_path, None) == "False False"
    assert list(tmp_path.rglob("*")) == []


def test_on_writes_every_event_at_exit(tmp_path):
    out_dir = tmp_path / "traces"
    assert _run(tmp_path, str(out_dir)) == "True True"
    files = list(out_dir.glob("trace.tester.*.jsonl"))
    assert len(files) == 1, list(out_dir.iterdir())
    everything = _lines(files[0])
    lines = [x for x in everything if x["phase"] != "gc"]  # a collection may run in the script: recorded too
    got = [(x["phase"], x["rid"]) for x in lines]
    assert got == [("a", "r1"), ("b", "r1"), ("c", "r1"), ("c", "r2"), ("d", ""), ("trace_end", "")]
    assert lines[0]["extra"] == {"x": 1} and lines[1]["t"] == 0.5 and lines[2]["extra"] == {"n": 2}
    assert all(x["proc"] == "tester" for x in lines)
    assert lines[-1]["extra"] == {"events": len(everything) - 1, "dropped": 0}


@pytest.fixture
def traced(tmp_path, monkeypatch):
    """The trace on in this process, into ``tmp_path``; off and empty again afterwards."""
    was = trace.DIR
    trace.reset()
    trace.enable(str(tmp_path))
    try:
        yield tmp_path
    finally:
        trace.enable(was)
        trace.reset()


def test_bounded(traced, monkeypatch):
    monkeypatch.setattr(trace, "MAX_EVENTS", 3)
    for i in range(5):
        trace.event("e", str(i))
    trace.first("f", ["x"])
    assert [e[2] for e in trace.events()] == ["0", "1", "2"]
    lines = _lines(Path(trace.flush()))
    assert len(lines) == 4 and lines[-1]["extra"] == {"events": 3, "dropped": 3}


def test_a_garbage_collection_is_an_event_with_its_generation_and_pause(traced):
    """A collection stops every thread of the process: the trace shows when, which generation and for how long."""
    import gc

    before = time.monotonic()
    gc.collect(1)
    pauses = [e for e in trace.events() if e[1] == "gc"]
    assert pauses and pauses[-1][0] >= before and pauses[-1][2] == ""
    assert pauses[-1][3]["generation"] == 1 and pauses[-1][3]["ms"] >= 0 and "collected" in pauses[-1][3]
    trace.enable(None)
    n = len(trace.events())
    gc.collect(0)
    assert len(trace.events()) == n  # off: the hook records nothing


def test_flush_replaces_the_file_with_everything_so_far(traced):
    trace.event("one")
    path = Path(trace.flush())
    trace.event("two")
    assert trace.flush() == str(path)
    assert [x["phase"] for x in _lines(path)] == ["one", "two", "trace_end"]


def test_runtime_records_a_requests_phases(traced, tmp_path_factory):
    """Conductor and worker in one process (tests/inproc.py) on a tiny speech checkpoint (its LLM is the KV
    engine): the conductor's, the rank's and the engine's phases of one request, joined by its wire id."""
    import torch

    from mstar_dist.config.deployment import parse_config
    from mstar_dist.events import Finished, GenerationParams
    from mstar_dist.graph.model import Layout
    from models.speech.checkpoint import write_tiny_speech_checkpoint
    from models.speech.orpheus import OrpheusSpeech
    from tests.inproc import InProcDeployment

    weights = str(write_tiny_speech_checkpoint(tmp_path_factory.mktemp("speech") / "orpheus"))
    cfg = {"model": "x", "weights": weights, "transport": {"inline_max_bytes": 1024},
           "node_groups": [{"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill", "decode"]},
                           {"node_names": ["CODEC"], "ranks": [0], "graph_walks": ["codec"]}]}
    model = OrpheusSpeech(weights)
    model.configure(Layout.from_node_groups(parse_config(cfg, "test").node_groups))
    model.load_frontend()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dep = InProcDeployment(model, cfg, 1)
        params = GenerationParams(request_id="req", prompt="Hello", messages=None, max_tokens=8, seed=1,
                                  temperature=0.8, model_kwargs={"voice": "leo"})
        [events] = dep.run([params], max_turns=100_000)
    finally:
        torch.set_num_threads(threads)
    assert isinstance(events[-1], Finished)
    recorded = trace.events()
    admitted = next(e for e in recorded if e[1] == "cond_admitted")
    wire = admitted[2]
    assert admitted[3]["client"] == "req" and wire.startswith("req#")
    phases = [e[1] for e in recorded if e[2] == wire]
    for phase in ("cond_preprocessed", "cond_dispatch", "rank_runwalk", "rank_emits_sent", "cond_first_emit"):
        assert phase in [e[1] for e in recorded if e[2] in (wire, "req")], phase
    assert phases.index("cond_dispatch") < phases.index("rank_runwalk") < phases.index("rank_emits_sent") \
        < phases.index("cond_first_emit")
    prefill = [e for e in recorded if e[1] == "eng_prefill_start" and wire in e[3]["ids"]]
    assert prefill and prefill[0][3]["rows"] == 1 and prefill[0][3]["tokens"] > 0
    assert any(e[1] == "eng_prefill_end" and wire in e[3]["ids"] for e in recorded)
    starts = [e for e in recorded if e[1] == "eng_decode_start"]
    assert starts and len(starts) == sum(e[1] == "eng_decode_end" for e in recorded)
    assert [e[1] for e in recorded].count("rank_emits_sent") == len({e[2] for e in recorded
                                                                     if e[1] == "rank_emits_sent"})
    times = [e[0] for e in recorded]
    assert times == sorted(times)
