"""Several HTTP intake processes on one port (``server.http_processes``), through the real launcher with the toy
model family (tests/toy_model.py, 2 ranks; docs/architecture.md §2, "Intake processes").

A failure here means a request parsed by an intake other than the front end is lost, answered wrongly or left
running after its client left, that ``/metrics`` counts only the intake that happened to answer the scrape,
that connections are not spread evenly over the intakes, or that an intake that dies leaves a server that looks healthy
but answers only some of its connections.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import threading
import time

import httpx
import pytest

from mstar_dist.server.intake_backend import COUNTS_EVERY_S
from tests.e2e.server import REPO, Server, descendants, metric, wait_for

INTAKES = 3


@pytest.fixture(scope="module")
def toy():
    server = Server(REPO / "tests/toy_deploy.yaml", nproc=2, overrides={"server": {"http_processes": INTAKES}})
    yield server
    server.stop()


def gen(base_url: str, prompt: str, max_tokens: int = 8, *, stream: bool = False, timeout: float = 60,
        client: httpx.Client | None = None) -> httpx.Response:
    post = client.post if client is not None else httpx.post
    return post(f"{base_url}/generate", timeout=timeout,
                json={"prompt": prompt, "stream": stream, "model_kwargs": {"max_tokens": max_tokens}})


def intake_pids(server: Server) -> dict[int, int]:
    """Intake index -> pid, from the processes under the server's torchrun agent."""
    pids = {}
    for pid in descendants(server.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"mstar_dist.runtime.intake" in argv:
            pids[int(argv[argv.index(b"--index") + 1])] = pid
    return pids


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def established_on(pid: int, port: int) -> int:
    """Connections of ``pid`` accepted on local ``port`` (its socket fds matched against /proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    n = 0
    with open(f"/proc/{pid}/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            local_port, state, inode = int(fields[1].split(":")[1], 16), fields[3], fields[9]
            if local_port == port and state == "01" and inode in inodes:  # 01: ESTABLISHED
                n += 1
    return n


def test_requests_on_many_connections_are_spread_over_the_intakes_and_all_answered(toy):
    assert len(intake_pids(toy)) == INTAKES
    # the warm-up requests each intake makes before it listens are not counted
    assert settled(toy.base_url, r'mstar_http_requests_total\{code="200",route="/generate"\}') == 0
    assert metric(toy.base_url, r'mstar_http_requests_total\{code="200",route="/v1/chat/completions"\}') == 0
    clients = [httpx.Client() for _ in range(12)]  # keep-alive: each holds its connection open
    try:
        with cf.ThreadPoolExecutor(len(clients)) as pool:
            rs = list(pool.map(lambda i: gen(toy.base_url, f"start={i * 50}", 6, stream=i % 2 == 1,
                                             client=clients[i]), range(len(clients))))
        for i, r in enumerate(rs):
            assert r.status_code == 200, r.text
            lines = [json.loads(line) for line in r.text.splitlines() if line.strip()]
            text = r.json()["text"] if i % 2 == 0 else "".join(
                line["data"] for line in lines if line.get("modality") == "text")  # text is sent as itself
            assert text == "".join(f"{i * 50 + k} " for k in range(1, 7)), (i, r.text)
        per_intake = [established_on(pid, toy.port) for pid in intake_pids(toy).values()]
        # the front end passes each connection to the intake with the fewest: 12 open at once over 3 intakes
        assert per_intake == [len(clients) // INTAKES] * INTAKES, per_intake
    finally:
        for c in clients:
            c.close()


def settled(base_url: str, series: str) -> float:
    """``series`` of ``/metrics`` once two reads a report period apart agree (every intake has reported)."""
    value = metric(base_url, series)
    for _ in range(10):
        time.sleep(COUNTS_EVERY_S + 0.3)
        value, before = metric(base_url, series), value
        if value == before:
            return value
    raise AssertionError(f"{series} did not settle: {before} then {value}")


def test_openai_routes_answer_through_the_intakes(toy):
    models = httpx.get(f"{toy.base_url}/v1/models", timeout=10).json()
    assert [card["id"] for card in models["data"]] == ["tests.toy_model:ToyModel"]
    body = {"messages": [{"role": "user", "content": "start=7"}], "max_tokens": 4}
    with httpx.stream("POST", f"{toy.base_url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=30) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    whole = httpx.post(f"{toy.base_url}/v1/chat/completions", json=body, timeout=30).json()
    assert text == whole["choices"][0]["message"]["content"] != ""
    assert whole["usage"]["completion_tokens"] == 4


def test_failures_and_metrics_cover_every_intake(toy):
    before = settled(toy.base_url, r'mstar_http_requests_total\{code="200",route="/generate"\}')
    with cf.ThreadPoolExecutor(8) as pool:
        rs = list(pool.map(lambda p: gen(toy.base_url, p), ["start=1", "fail-forward"] * 4))
    assert [r.status_code for r in rs] == [200, 500] * 4
    assert all("rank 1" in r.text for r in rs[1::2])  # the client still learns which rank failed
    # each intake reports its counts within a second; /metrics shows their sum, whichever intake answers it
    wait_for(lambda: metric(toy.base_url, r'mstar_http_requests_total\{code="200",route="/generate"\}')
             == before + 4, 5, "the 200s of every intake in /metrics")
    wait_for(lambda: metric(toy.base_url, r'mstar_http_requests_total\{code="500",route="/generate"\}') >= 4, 5,
             "the 500s of every intake in /metrics")
    assert metric(toy.base_url, r'mstar_dist_requests_finished_total\{reason="stop"\}') + \
        metric(toy.base_url, r'mstar_dist_requests_finished_total\{reason="length"\}') >= 4


def test_a_client_that_leaves_aborts_its_request(toy):
    before = metric(toy.base_url, r'mstar_dist_requests_finished_total\{reason="abort"\}')
    with pytest.raises(httpx.ReadTimeout):
        gen(toy.base_url, "start=0", 250, timeout=0.5)
    wait_for(lambda: metric(toy.base_url, r'mstar_dist_requests_finished_total\{reason="abort"\}') > before, 10,
             "the abandoned request's abort")
    wait_for(lambda: metric(toy.base_url, r"mstar_dist_requests_running") == 0, 2.0,
             "mstar_dist_requests_running back at 0 after the abort")


def test_a_stop_ends_what_the_intakes_stream_and_every_process_exits_cleanly():
    server = Server(REPO / "tests/toy_deploy.yaml", nproc=2, overrides={"server": {"http_processes": 2}})
    everyone = [server.proc.pid, *descendants(server.proc.pid)]
    lines: list[str] = []
    first = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{server.base_url}/generate", timeout=60,
                          json={"prompt": "start=0", "stream": True, "model_kwargs": {"max_tokens": 250}}) as r:
            for line in r.iter_lines():
                lines.append(line)
                first.set()

    client = threading.Thread(target=stream)
    client.start()
    try:
        assert first.wait(30), server.log()
        assert server.stop_clean(2), server.log()  # both ranks exit with status 0
    finally:
        client.join(30)
    assert not client.is_alive(), "the client's stream did not end"
    last = json.loads(lines[-1])  # the client is told, not cut off
    assert last["modality"] == "error" and last["metadata"]["status"] == 503, lines[-3:]
    wait_for(lambda: not any(alive(pid) for pid in everyone), 30, "every process of the server gone")


def test_an_intake_that_dies_stops_the_server_naming_it(toy):
    pids = intake_pids(toy)
    everyone = [toy.proc.pid, *descendants(toy.proc.pid)]
    os.kill(pids[1], signal.SIGKILL)
    try:
        toy.proc.wait(60)
    except Exception:
        pytest.fail(f"the server kept running after intake 1 (pid {pids[1]}) died:\n{toy.log()}")
    log = toy.log()
    assert f"HTTP intake 1 (pid {pids[1]}) exited" in log, log
    wait_for(lambda: not any(alive(pid) for pid in everyone), 30, "every process of the server gone")
