"""The API key, the body size limit and the control-plane secret, without processes (fake backend, fake store).

A failure means a server started with ``--api-key`` answers (or runs generations for) clients without the key,
locks out load balancers' ``/health`` probes, shows a 401/413 in the wrong error format, buffers bodies of any
size, the SDK cannot talk to a protected server, or the control plane accepts messages from outside the launch.
"""

from __future__ import annotations

import re
import threading

import pytest
from starlette.testclient import TestClient

from mstar_dist.client import MStarClient
from mstar_dist.config.deployment import ServerConfig, parse_config
from mstar_dist.config.schema import ConfigError
from mstar_dist.control import messages as m
from mstar_dist.control.channel import share_secret
from mstar_dist.server.app import build_app
from mstar_dist.server.http_server import HttpServer
from tests.fakes import FakeBackend
from tests.unit.test_conductor import make

KEY = "s3cret-key"
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]
PROTECTED = [("GET", "/metrics", None), ("GET", "/v1/models", None), ("GET", "/openapi.json", None),
             ("POST", "/generate", {"prompt": "hi"}), ("POST", CHAT, {"messages": MSGS}),
             ("POST", "/v1/audio/speech", {"input": "hi"}), ("POST", "/v1/images/generations", {"prompt": "a"})]


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def client(fake):
    with TestClient(build_app(fake, api_key=KEY, max_body_bytes=1000), raise_server_exceptions=False) as c:
        yield c


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("method,path,body", PROTECTED)
def test_every_route_but_health_needs_the_key(client, fake, method, path, body):
    for headers in ({}, auth("wrong"), {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        resp = client.request(method, path, json=body, headers=headers)
        assert resp.status_code == 401, (headers, resp.text)
        assert resp.headers["www-authenticate"] == "Bearer"
        error = resp.json()["error"]
        if path.startswith("/v1/"):
            assert error["type"] == "authentication_error" and error["code"] == 401
        else:
            assert isinstance(error, str) and "API key" in error
    assert fake.calls == []  # nothing ran
    assert client.request(method, path, json=body, headers=auth()).status_code < 401


def test_health_stays_open_and_the_key_check_comes_before_the_body(client):
    assert client.get("/health").status_code == 200
    assert client.post("/generate", content=b"{not json").status_code == 401


def test_401s_are_counted_on_metrics(client):
    client.post("/generate", json={"prompt": "hi"})
    text = client.get("/metrics", headers=auth()).text
    lines = [line for line in text.splitlines() if line.startswith("mstar_http_requests_total{")]
    assert any('code="401"' in line and 'route="/generate"' in line and line.split()[-1] in ("1", "1.0")
               for line in lines), lines


def test_without_a_key_every_route_is_open(fake):
    with TestClient(build_app(fake), raise_server_exceptions=False) as client:
        assert client.post("/generate", json={"prompt": "hi"}).status_code == 200


@pytest.mark.parametrize("path", ["/generate", CHAT])
def test_a_body_over_the_limit_is_413_at_once(client, fake, path):
    body = b'{"prompt": "' + b"x" * 2000 + b'"}'
    resp = client.post(path, content=body, headers={**auth(), "content-type": "application/json"})
    assert resp.status_code == 413
    message = resp.json()["error"] if path == "/generate" else resp.json()["error"]["message"]
    assert f"{len(body)} bytes" in message and "at most 1000 bytes" in message and "max_body_bytes" in message
    assert fake.calls == []


def test_a_chunked_body_over_the_limit_is_413(client, fake):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(30):
            yield b"x" * 100
        yield b'"}'

    resp = client.post("/generate", content=chunks(), headers=auth())
    assert resp.status_code == 413 and "at most 1000 bytes" in resp.json()["error"]
    assert fake.calls == []


def test_a_body_within_the_limit_is_served(client):
    resp = client.post("/generate", json={"prompt": "x" * 900}, headers=auth())
    assert resp.status_code == 200


def test_max_body_bytes_is_a_checked_config_key_and_flag():
    assert ServerConfig().max_body_bytes == 8 << 20
    with pytest.raises(ConfigError, match="server.max_body_bytes = 0"):
        parse_config({"model": "m", "node_groups": [{"node_names": ["A"], "ranks": [0], "graph_walks": ["w"]}],
                      "server": {"max_body_bytes": 0}}, "d.yaml")
    cfg = parse_config({"model": "m", "node_groups": [{"node_names": ["A"], "ranks": [0], "graph_walks": ["w"]}]},
                       "d.yaml")
    assert cfg.with_overrides(max_body_bytes=5).server.max_body_bytes == 5


def test_http_processes_is_a_checked_config_key_and_flag():
    group = [{"node_names": ["A"], "ranks": [0], "graph_walks": ["w"]}]
    assert ServerConfig().http_processes == 1
    for bad in (0, 65, "4", True):
        with pytest.raises(ConfigError, match="server.http_processes"):
            parse_config({"model": "m", "node_groups": group, "server": {"http_processes": bad}}, "d.yaml")
    cfg = parse_config({"model": "m", "node_groups": group, "server": {"http_processes": 4}}, "d.yaml")
    assert cfg.server.http_processes == 4
    assert cfg.with_overrides(http_processes=2).server.http_processes == 2
    from mstar_dist.runtime.cli import parse_args

    assert parse_args(["c.yaml", "--http-processes", "3"]).http_processes == 3


def test_serve_flags_take_the_key_from_the_environment(monkeypatch):
    from mstar_dist.runtime.cli import parse_args

    monkeypatch.setenv("MSTAR_API_KEY", "from-env")
    assert parse_args(["c.yaml"]).api_key == "from-env"
    assert parse_args(["c.yaml", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("MSTAR_API_KEY")
    assert parse_args(["c.yaml"]).api_key is None


def test_the_sdk_sends_the_key(monkeypatch):
    server = HttpServer(build_app(FakeBackend(), api_key=KEY))
    server.start("127.0.0.1", 0, timeout_s=10)
    try:
        with MStarClient(server.url, timeout=10, api_key=KEY) as client:
            assert client.generate("hi").text
        monkeypatch.setenv("MSTAR_API_KEY", KEY)
        with MStarClient(server.url, timeout=10) as client:
            assert client.models()
        monkeypatch.delenv("MSTAR_API_KEY")
        with MStarClient(server.url, timeout=10) as client, pytest.raises(Exception, match="401"):
            client.generate("hi")
    finally:
        server.stop(timeout_s=2)


# ------------------------------------------------------------------------------------ control plane


class FakeStore:
    """The torchrun store's set / wait / get, shared by the 'ranks' of one launch (threads here)."""

    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()

    def set(self, key, value):
        with self.cond:
            self.data[key] = value.encode() if isinstance(value, str) else value
            self.cond.notify_all()

    def wait(self, keys, timeout):
        with self.cond:
            if not self.cond.wait_for(lambda: all(k in self.data for k in keys), timeout.total_seconds()):
                raise RuntimeError("Socket Timeout")

    def get(self, key):
        return self.data[key]


def test_the_secret_is_drawn_per_launch_and_read_by_every_rank():
    store = FakeStore()
    got: list[str] = []
    readers = [threading.Thread(target=lambda: got.append(share_secret(store, publisher=False, timeout_s=5)))
               for _ in range(3)]
    for t in readers:
        t.start()  # they wait for the publisher
    mine = share_secret(store, publisher=True, timeout_s=5)
    for t in readers:
        t.join()
    assert got == [mine] * 3 and re.fullmatch(r"[0-9a-f]{32}", mine)
    assert share_secret(FakeStore(), publisher=True, timeout_s=5) != mine  # another launch, another secret


def test_no_publisher_is_a_timeout_naming_the_secret():
    with pytest.raises(TimeoutError, match="deployment secret was not published within 0.1 s"):
        share_secret(FakeStore(), publisher=False, timeout_s=0.1)


def test_the_conductor_drops_and_counts_messages_without_the_secret():
    c, _ = make()
    stats = m.Stats(rank=1, live_tensors=0, live_bytes=0, edge_bytes_sent=0, edge_bytes_received=0,
                    host_staging_copies=0, rejected_messages=4)
    c.handle("rank1", m.encode("guessed", "rank1", m.Ready(rank=1, host="h", load_seconds=0.0)))
    c.handle("rank1", b"\x00garbage")
    c.handle("rank1", m.encode("tok", "rank2", m.Ready(rank=1, host="h", load_seconds=0.0)))  # spoofed sender
    assert c.ready_ranks == {} and c.metrics.rejected_messages == 3
    c.handle("rank1", m.encode("tok", "rank1", stats))
    text = c.metrics.render()
    assert re.search(r'^mstar_dist_control_messages_rejected_total\{receiver="conductor"\} 3(\.0)?$', text, re.M)
    assert re.search(r'^mstar_dist_control_messages_rejected_total\{receiver="rank1"\} 4(\.0)?$', text, re.M)
