"""The HTTP app over a fake backend (docs/architecture.md §9, §10), no processes, no sockets.

A failure here means clients see the wrong wire format (NDJSON/SSE framing, UTF-8 text, usage), a bad
request turns into a 500 or poisons /health, a model failure leaks beyond its request, or a client that goes
away leaves its generation running in the backend.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.testclient import TestClient

from mstar_dist.server.app import build_app
from mstar_dist.server.backend import BackendError
from mstar_dist.conductor.stop_strings import StopTrimmer
from tests.fakes import UNICODE_DELTAS, UNICODE_TEXT, FakeBackend

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "say hi"}]


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def client(fake: FakeBackend):
    with TestClient(build_app(fake), raise_server_exceptions=False) as c:
        yield c


def sse_events(body: str) -> list[str]:
    assert body.endswith("\n\n"), body[-50:]
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


def ndjson(body: bytes) -> list[dict]:
    assert body.endswith(b"\n")
    return [json.loads(line) for line in body.split(b"\n") if line]


# ------------------------------------------------------------------------------------------ plain routes


def test_health_is_200_only_while_serving(client, fake):
    assert client.get("/health").json() == {"status": "ok"}
    fake.serving = False
    resp = client.get("/health")
    assert resp.status_code == 503
    assert resp.json()["reason"] == "rank 1 is not ready"


def test_metrics_has_backend_and_http_counters(client):
    client.post("/generate", json={"prompt": "hi"})
    client.post("/generate", json={"prompt": "hi", "stream": True})
    client.post("/generate", json={})
    resp = client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    assert "fake_requests_total 2" in resp.text
    assert 'mstar_http_requests_total{code="200",route="/generate"} 2.0' in resp.text
    assert 'mstar_http_requests_total{code="400",route="/generate"} 1.0' in resp.text
    assert "mstar_http_client_disconnects_total 0.0" in resp.text


def test_models_lists_the_served_model(client):
    data = client.get("/v1/models").json()
    assert data["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in data["data"]] == [("fake-model", "model", 64)]


# ---------------------------------------------------------------------------------------------- OpenAI


def test_chat_completion_returns_text_usage_and_passes_params(client, fake):
    body = {
        "model": "fake-model",
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "say "}, {"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 20, "temperature": 0.5, "top_p": 0.9, "top_k": 4, "seed": 7,
    }
    resp = client.post(CHAT, json=body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert data["choices"][0]["message"] == {"role": "assistant", "content": UNICODE_TEXT}
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
    (params,) = fake.calls
    assert params.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hi"}]
    assert (params.prompt, params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (
        None, 20, 0.5, 0.9, 4, 7)
    assert resp.headers["x-request-id"] == params.request_id
    assert fake.closed.is_set() and not fake.aborted.is_set()


def test_chat_defaults_max_tokens_to_the_limit(client, fake):
    assert client.post(CHAT, json={"messages": MSGS}).status_code == 200
    assert fake.calls[0].max_tokens == FakeBackend.max_tokens_limit


def test_chat_null_fields_mean_not_set(client, fake):
    nulls = dict.fromkeys(["model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream_options"])
    assert client.post(CHAT, json={"messages": MSGS, **nulls}).status_code == 200
    assert (fake.calls[0].temperature, fake.calls[0].top_p, fake.calls[0].stop) == (1.0, 1.0, [])


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_is_sse_ending_with_done(client, fake, include_usage):
    body = {"messages": MSGS, "stream": True, "stream_options": {"include_usage": include_usage}}
    resp = client.post(CHAT, json=body)
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
    assert "".join(content) == UNICODE_TEXT
    assert len([x for x in content if x]) == len(UNICODE_DELTAS)  # streamed, not one blob
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f["choices"][0]["finish_reason"] for f in finals] == ["stop"]
    if include_usage:
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
        assert all(c["usage"] is None for c in chunks[:-1])
    else:
        assert all("usage" not in c for c in chunks)


def test_chat_passes_stop_strings_and_relays_the_cut_text(fake, client):
    # The backend (the conductor; here the fake, with the same StopTrimmer) cuts the text; the app relays it.
    fake.deltas = ["Hello ", "wor", "ld ST", "OP and more", " never"]
    data = client.post(CHAT, json={"messages": MSGS, "stop": "STOP"}).json()
    assert data["choices"][0]["message"]["content"] == "Hello world "
    assert data["choices"][0]["finish_reason"] == "stop"
    assert fake.calls[0].stop == ["STOP"]
    events = sse_events(client.post(CHAT, json={"messages": MSGS, "stop": ["STOP"], "stream": True}).text)
    content = [json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]]
    assert "".join(content) == "Hello world "
    assert not any("ST" in c for c in content)


# StopTrimmer is the conductor's (stop strings are applied once, there); its unit tests stay here until the
# conductor's test module takes them.
@pytest.mark.parametrize("stops,deltas,shown,stopped", [
    (["STOP"], ["aST", "OPb"], ["a", ""], True),          # split across deltas: "ST" is held, never shown
    (["STOP"], ["aST", "x"], ["a", "STx"], False),        # held text released once it cannot be a stop
    (["ab", "b"], ["xab"], ["x"], True),                  # earliest match wins
    (["</s>"], ["<", "/", "s", ">", "z"], ["", "", "", "", ""], True),
])
def test_stop_trimmer(stops, deltas, shown, stopped):
    trimmer = StopTrimmer(stops)
    assert [trimmer.feed(d) for d in deltas] == shown
    assert (trimmer.stopped, trimmer.flush()) == (stopped, "")


def test_stop_trimmer_flushes_held_text_at_the_end():
    trimmer = StopTrimmer(["STOP"])
    assert (trimmer.feed("abcST"), trimmer.flush(), trimmer.stopped) == ("abc", "ST", False)


# ---------------------------------------------------------------------------------------------- native


def test_generate_returns_text_outputs_and_pinned_request_id(client, fake):
    body = {"prompt": "the capital of", "request_id": "req-42", "model_kwargs": {"max_tokens": 8, "seed": 3}}
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["request_id"] == "req-42" == fake.calls[0].request_id
    assert data["text"] == UNICODE_TEXT and data["finish_reason"] == "stop"
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    (out,) = data["outputs"]
    assert out["modality"] == "text" and out["data"] == UNICODE_TEXT and out["metadata"]["encoding"] == "utf-8"
    assert (fake.calls[0].prompt, fake.calls[0].max_tokens, fake.calls[0].seed) == ("the capital of", 8, 3)


def test_generate_with_messages_and_length_finish(client, fake):
    data = client.post("/generate", json={"messages": MSGS, "model_kwargs": {"max_tokens": 2}}).json()
    assert data["text"] == "".join(UNICODE_DELTAS[:2]) and data["finish_reason"] == "length"
    assert fake.calls[0].messages == MSGS and fake.calls[0].prompt is None


def test_generate_stream_is_ndjson_with_utf8_text_and_final_usage(client):
    resp = client.post("/generate", json={"prompt": "hi", "stream": True, "request_id": "s1"})
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/x-ndjson; charset=utf-8"
    lines = ndjson(resp.content)
    *deltas, final = lines
    assert [d["data"] for d in deltas] == UNICODE_DELTAS  # readable as it is: text is not base64
    assert all(d["modality"] == "text" and d["metadata"]["request_id"] == "s1" for d in deltas)
    assert all(d["metadata"]["encoding"] == "utf-8" for d in deltas)
    assert "東".encode() in resp.content and "🚀".encode() in resp.content
    assert final["modality"] == "text" and final["data"] == ""
    assert final["metadata"]["finish_reason"] == "stop"
    assert final["metadata"]["usage"] == {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}


def test_generate_stream_honours_stop(client, fake):
    fake.deltas = ["a", "b<", "/s", "> c", "d"]
    resp = client.post("/generate", json={"prompt": "x", "stream": True, "model_kwargs": {"stop": ["</s>"]}})
    *deltas, final = ndjson(resp.content)
    assert "".join(d["data"] for d in deltas) == "ab"
    assert final["metadata"]["finish_reason"] == "stop"


# ------------------------------------------------------------------------------------------ bad input

LONG = " ".join(["w"] * 65)  # 65 "tokens" > max_context_tokens 64

CHAT_BAD = [
    (b"{not json", "not valid JSON"),
    (b"", "body is empty"),
    (b"[1, 2]", "must be a JSON object"),
    ({}, "messages: field required"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content: field required"),
    ({"messages": [{"role": "user", "content": 5}]}, "content must be a string or a list of text parts"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
    ({"messages": MSGS, "max_tokens": 0}, "max_tokens: Input should be greater than 0"),
    ({"messages": MSGS, "max_tokens": -3}, "max_tokens"),
    ({"messages": MSGS, "max_tokens": 33}, "limit of 32"),
    ({"messages": MSGS, "max_completion_tokens": 1000}, "max_completion_tokens is 1000"),
    ({"messages": MSGS, "max_tokens": "5"}, "max_tokens: Input should be a valid integer"),
    ({"messages": MSGS, "temperature": 2.5}, "temperature"),
    ({"messages": MSGS, "top_p": 0}, "top_p"),
    ({"messages": MSGS, "n": 17}, "n: Input should be less than or equal to 16"),
    ({"messages": MSGS, "n": 0}, "n: Input should be greater than or equal to 1"),
    ({"messages": MSGS, "stream": "yes"}, "stream"),
    ({"messages": MSGS, "stop": [""]}, "stop strings must be non-empty"),
    ({"messages": MSGS, "stop": 3}, "stop must be a string or a list of strings"),
]

NATIVE_BAD = [
    (b"{\"prompt\": ", 400, "not valid JSON"),
    (b"\"hi\"", 400, "must be a JSON object"),
    ({"prompt": "a", "messages": MSGS}, 400, "exactly one of 'prompt'"),
    ({"stream": True}, 400, "exactly one of 'prompt'"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt: Input should be a valid string"),
    ({"messages": []}, 400, "messages"),
    ({"prompt": "a", "model_kwargs": {"max_tokens": 0}}, 400, "model_kwargs.max_tokens"),
    ({"prompt": "a", "model_kwargs": {"max_tokens": 99}}, 400, "model_kwargs.max_tokens is 99"),
    ({"prompt": "a", "model_kwargs": {"temperature": -1}}, 400, "model_kwargs.temperature"),
    ({"prompt": "a", "model_kwargs": {"seed": "7"}}, 400, "model_kwargs.seed"),
    ({"prompt": "a", "model_kwargs": []}, 400, "model_kwargs"),
    ({"prompt": "a", "stream": True, "modelkwargs": {}}, 400, "unknown field 'modelkwargs' (did you mean "
                                                             "'model_kwargs'?)"),
    ({"prompt": "a", "request_id": "has space"}, 400, "request_id"),
]


def _post(client, path, body):
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"content-type": "application/json"})
    return client.post(path, json=body)


@pytest.mark.parametrize("body,needle", CHAT_BAD)
def test_bad_chat_request_is_400_openai_error_and_server_stays_healthy(client, fake, body, needle):
    resp = _post(client, CHAT, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert needle in err["message"], err
    assert err["type"] == "invalid_request_error"
    assert fake.calls == []
    assert client.get("/health").status_code == 200
    assert client.post(CHAT, json={"messages": MSGS}).status_code == 200


@pytest.mark.parametrize("body,status,needle", NATIVE_BAD)
def test_bad_generate_request_is_4xx_with_message(client, fake, body, status, needle):
    resp = _post(client, "/generate", body)
    assert resp.status_code == status, resp.text
    assert needle in resp.json()["error"], resp.json()
    assert fake.calls == []
    assert client.get("/health").status_code == 200


def test_generate_passes_family_knobs_through_model_kwargs(client, fake):
    fake.__init__(output_modality="audio")
    body = {"prompt": "hi", "model_kwargs": {"voice": "bob", "max_tokens": 3, "temperature": 0, "top_k": None}}
    assert client.post("/generate", json=body).status_code == 200
    (params,) = fake.calls
    assert params.model_kwargs == {"voice": "bob"}  # sampling fields stay typed; null means "not set"
    assert (params.max_tokens, params.temperature, params.top_k) == (3, 0.0, 0)


@pytest.mark.parametrize("knobs,needle", [
    ({"max_token": 3}, "unknown field 'max_token' (did you mean 'max_tokens'?)"),
    ({"voise": "bob"}, "unknown field 'voise' (did you mean 'voice'?)"),
    ({"voice": "carol"}, "voice 'carol' is not one of this model's voices: alice, bob"),
])
def test_generate_knob_the_family_rejects_is_400_naming_it(client, fake, knobs, needle):
    fake.__init__(output_modality="audio")
    for stream in (False, True):
        resp = client.post("/generate", json={"prompt": "a", "stream": stream, "model_kwargs": knobs})
        assert resp.status_code == 400 and needle in resp.json()["error"], resp.text
    assert client.get("/health").status_code == 200


def test_chat_on_a_non_text_model_is_400_naming_the_right_route(client, fake):
    fake.__init__(output_modality="audio")
    resp = client.post(CHAT, json={"messages": MSGS})
    assert resp.status_code == 400 and fake.calls == []
    err = resp.json()["error"]
    assert "'fake-model' produces audio: use POST /v1/audio/speech or POST /generate" in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_empty_text_deltas_tokens_ride_on_the_next_delta(client, fake):
    fake.deltas = ["a", "", "", "b"]  # e.g. a multi-byte character still incomplete
    *deltas, final = ndjson(client.post("/generate", json={"prompt": "x", "stream": True}).content)
    assert [(d["data"], d["metadata"]["n_tokens"]) for d in deltas] == [("a", 1), ("b", 3)]
    assert final["metadata"]["usage"]["completion_tokens"] == 4


def test_bad_request_id_header_is_400(client):
    resp = client.post("/generate", json={"prompt": "a"}, headers={"X-Request-Id": "a b"})
    assert resp.status_code == 400 and "X-Request-Id" in resp.json()["error"]


def test_request_id_header_is_used_when_body_has_none(client, fake):
    resp = client.post("/generate", json={"prompt": "a"}, headers={"X-Request-Id": "from-header"})
    assert resp.json()["request_id"] == "from-header" == fake.calls[0].request_id


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_too_long_is_400_even_when_streaming(client, stream):
    resp = client.post("/generate", json={"prompt": LONG, "stream": stream})
    assert resp.status_code == 400
    assert resp.json() == {"error": "prompt is 65 tokens, context is 64"}
    resp = client.post(CHAT, json={"messages": [{"role": "user", "content": LONG}], "stream": stream})
    assert resp.status_code == 400 and "prompt is 65 tokens" in resp.json()["error"]["message"]


def test_not_serving_is_503(client, fake):
    fake.serving = False
    resp = client.post(CHAT, json={"messages": MSGS, "stream": True})
    assert resp.status_code == 503
    assert resp.json()["error"]["type"] == "server_error"


def test_unknown_route_uses_the_route_family_error_format(client):
    assert "error" in client.get("/v1/nothing").json()
    assert client.get("/v1/nothing").status_code == 404
    assert client.get("/generate").status_code == 405


def test_generation_routes_skip_fastapis_router_and_the_rest_still_use_it(fake):
    """The POST generation routes are served directly (server/direct.py: an intake's per-request cost); a change
    that sent them back through the router would go unnoticed by every other test."""
    app = build_app(fake)
    routed: list[str] = []
    inner = app.router.middleware_stack

    async def counting(scope, receive, send):
        if scope["type"] == "http":
            routed.append(f"{scope['method']} {scope['path']}")
        await inner(scope, receive, send)

    app.router.middleware_stack = counting
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.post("/generate", json={"prompt": "a"}).json()["text"] == UNICODE_TEXT
        assert c.post(CHAT, json={"messages": MSGS, "stream": True}).text.endswith("data: [DONE]\n\n")
        assert c.post("/generate", content=b"{not json").status_code == 400
        assert c.get("/generate").status_code == 405
        assert c.get("/health").status_code == 200
    assert routed == ["GET /generate", "GET /health"]


def test_a_handler_that_raises_gives_the_route_familys_500(fake):
    """An unexpected exception in a directly served handler is rendered by the app's own handler (a JSON error in
    the route family's format naming it), not Starlette's plain-text one."""
    class Broken(FakeBackend):
        @property
        def model_name(self):
            raise RuntimeError("no model card")

    with TestClient(build_app(Broken()), raise_server_exceptions=False) as c:
        native = c.post("/generate", json={"prompt": "a", "model": "x"})
        chat = c.post(CHAT, json={"messages": MSGS, "model": "x"})
    assert native.status_code == 500 and "RuntimeError: no model card" in native.json()["error"]
    assert chat.status_code == 500 and "RuntimeError: no model card" in chat.json()["error"]["message"]


# ------------------------------------------------------------------------------------- backend failures


def test_backend_exception_is_500_for_that_request_only(client, fake):
    fake.fail_at = 2
    resp = client.post("/generate", json={"prompt": "a"})
    assert resp.status_code == 500
    assert "boom in the fake model" in resp.json()["error"]
    resp = client.post(CHAT, json={"messages": MSGS})
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error"
    assert fake.n_closed == 2
    fake.fail_at = None
    assert client.get("/health").status_code == 200
    assert client.post("/generate", json={"prompt": "a"}).json()["text"] == UNICODE_TEXT


def test_backend_error_status_is_kept(client, fake):
    fake.fail_at, fake.error = 0, BackendError(504, "rank 3 timed out")
    resp = client.post("/generate", json={"prompt": "a"})
    assert (resp.status_code, resp.json()) == (504, {"error": "rank 3 timed out"})


def test_failure_mid_stream_ends_with_an_error_line(client, fake):
    fake.fail_at = 2
    resp = client.post("/generate", json={"prompt": "a", "stream": True})
    assert resp.status_code == 200
    *deltas, last = ndjson(resp.content)
    assert len(deltas) == 2
    assert last["modality"] == "error" and last["metadata"]["status"] == 500
    assert "boom" in last["metadata"]["message"]
    events = sse_events(client.post(CHAT, json={"messages": MSGS, "stream": True}).text)
    assert events[-1] == "[DONE]" and "boom" in json.loads(events[-2])["error"]["message"]
    assert fake.n_closed == 2 and client.get("/health").status_code == 200


# -------------------------------------------------------------------------------------- disconnects


def _post_scope(path: str, spec_version: str) -> dict:
    """The ASGI scope of a JSON POST to ``path`` from a server speaking ``spec_version``."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}


async def _drive(app, path: str, body: dict, *, disconnect_after, spec_version: str = "2.3", send_fails=False):
    """Runs one request through the ASGI app; the client disconnects once ``disconnect_after(sent)`` is true
    (spec 2.3: ``receive`` returns http.disconnect; ``send_fails``: spec 2.4, ``send`` raises OSError)."""
    sent: list[dict] = []
    gone = asyncio.Event()
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if gone.is_set() and send_fails:
            raise OSError("connection reset")
        sent.append(message)
        if disconnect_after(sent):
            gone.set()

    task = asyncio.create_task(app(_post_scope(path, spec_version), receive, send))
    for _ in range(500):
        if gone.is_set() or disconnect_after(sent):
            break
        await asyncio.sleep(0.005)
    else:
        raise AssertionError(f"disconnect condition never met; sent={sent}")
    gone.set()
    try:
        await asyncio.wait_for(task, 5)
    except TimeoutError:  # (an OSError too) the response would end only by this cancellation, not the disconnect
        raise AssertionError("the response did not end within 5 s of the client going away") from None
    except OSError:
        pass  # spec 2.4: the app may re-raise the failed send as ClientDisconnect
    return sent


def _bodies(sent):
    return [m for m in sent if m["type"] == "http.response.body" and m.get("body")]


@pytest.mark.parametrize("path,body", [("/generate", {"prompt": "a", "stream": True}),
                                       (CHAT, {"messages": MSGS, "stream": True})])
def test_disconnect_during_stream_aborts_the_backend(path, body):
    fake = FakeBackend(hang_at=2)
    app = build_app(fake)
    sent = asyncio.run(_drive(app, path, body,
                              disconnect_after=lambda s: fake.hanging.is_set() and len(_bodies(s)) >= 2))
    assert fake.aborted.is_set() and fake.n_closed == 1
    assert not any(b"finish_reason\":\"stop" in m["body"] for m in _bodies(sent))
    assert "mstar_http_client_disconnects_total 1.0" in TestClient(app).get("/metrics").text


def test_failed_send_closes_the_backend_generator():
    fake = FakeBackend(deltas=[f"t{i}" for i in range(20)])
    asyncio.run(_drive(build_app(fake), "/generate", {"prompt": "a", "stream": True}, spec_version="2.4",
                       send_fails=True, disconnect_after=lambda s: len(_bodies(s)) >= 1))
    assert fake.closed.is_set() and fake.aborted.is_set()


@pytest.mark.parametrize("path,body", [("/generate", {"prompt": "a"}), (CHAT, {"messages": MSGS})])
def test_disconnect_while_waiting_for_a_whole_response_aborts_the_backend(path, body):
    fake = FakeBackend(hang_at=1)
    app = build_app(fake)
    sent = asyncio.run(_drive(app, path, body, disconnect_after=lambda s: fake.hanging.is_set()))
    assert fake.aborted.is_set() and fake.n_closed == 1
    assert not _bodies(sent)
    assert "mstar_http_client_disconnects_total 1.0" in TestClient(app).get("/metrics").text


# ------------------------------------------------------------------------------- one error format each


@pytest.mark.parametrize("extra,needle", [
    ({"max_token": 5}, "unknown field 'max_token' (did you mean 'max_tokens'?)"),
    ({"temprature": 0.5, "foo": 1}, "unknown fields 'temprature' (did you mean 'temperature'?), 'foo'"),
])
def test_chat_rejects_misspelled_fields_naming_them(client, fake, extra, needle):
    resp = client.post(CHAT, json={"messages": MSGS, **extra})
    assert resp.status_code == 400 and needle in resp.json()["error"]["message"]
    assert resp.json()["error"]["type"] == "invalid_request_error" and fake.calls == []


def test_chat_accepts_openais_own_fields_it_ignores(client):
    body = {"messages": MSGS, "user": "u1", "frequency_penalty": 0, "logprobs": False, "metadata": {"a": "b"},
            "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto", "store": False,
            "presence_penalty": 0.0, "logit_bias": {}, "service_tier": "auto", "parallel_tool_calls": True}
    assert client.post(CHAT, json=body).status_code == 200


@pytest.mark.parametrize("body", [{}, {"prompt": 5}, {"prompt": "a", "extra": 1}])
def test_native_client_errors_are_all_400_with_a_string_error(client, body):
    resp = client.post("/generate", json=body)
    assert resp.status_code == 400 and isinstance(resp.json()["error"], str)


def test_a_wrong_model_is_404_model_not_found_on_every_route(client, fake):
    for path, body in ((CHAT, {"messages": MSGS}), ("/v1/completions", {"prompt": "a"})):
        resp = client.post(path, json={**body, "model": "gpt-9"})
        assert resp.status_code == 404, resp.text
        assert resp.json()["error"] == {"message": "The model 'gpt-9' does not exist: this server serves 'fake-model' "
                                                   "(see GET /v1/models)", "type": "invalid_request_error",
                                        "param": "model", "code": "model_not_found"}
    for path, body in (("/generate", {"prompt": "a"}), ("/tokenize", {"prompt": "a"}),
                       ("/detokenize", {"tokens": [97]})):
        resp = client.post(path, json={**body, "model": "gpt-9"})
        assert resp.status_code == 404 and "'gpt-9' does not exist" in resp.json()["error"], resp.text
    assert fake.calls == []


def test_streamed_lines_survive_clients_that_split_on_unicode_line_breaks(client, fake):
    """httpx's iter_lines (str.splitlines) also ends lines at U+0085, U+2028 and U+2029; a model can generate them."""
    fake.deltas = ["a\u2028b", "\x85", "c\u2029", "\x1c\x0b"]
    resp = client.post(CHAT, json={"messages": MSGS, "stream": True})
    lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]  # every line whole
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == \
        "".join(fake.deltas)


@pytest.mark.parametrize("text", ["hé", 'a "quote" and a \\ backslash', "line\u2028sep\u2029x\u0085", "\x01\n\t", "🚀", ""])
def test_streamed_text_events_are_the_bytes_the_response_models_give(text):
    """The per-token SSE and NDJSON events are written without pydantic; they must stay byte for byte what the
    response models serialise to (JSON escapes, the line breakers clients split on, null fields)."""
    from mstar_dist.events import Finished, TextDelta
    from mstar_dist.server.chat import ChatReply
    from mstar_dist.server.framing import json_bytes, ndjson_line
    from mstar_dist.server.native import delta_line, ndjson_body
    from mstar_dist.server.protocol import ChunkChoice, ChunkDelta

    reply = ChatReply('chatcmpl-a"b\u2028', 1700000000, "org/model")
    for include_usage in (False, True):
        head, tail = reply.content_framing(include_usage)
        slow = reply.typed_chunk([ChunkChoice(delta=ChunkDelta(content=text))], None, include_usage)
        assert head + json_bytes(text) + tail == slow

    async def body(request_id: str) -> list[bytes]:
        async def rest():
            yield Finished(finish_reason="stop", prompt_tokens=1, completion_tokens=3)
        return [line async for line in ndjson_body(rest(), TextDelta(text=text, n_tokens=3), request_id)]

    for request_id in ("r1", 'q"u\u2028ote'):
        lines = asyncio.run(body(request_id))
        assert lines[0] == ndjson_line(delta_line(TextDelta(text=text, n_tokens=3), request_id))
        assert json.loads(lines[-1])["metadata"]["finish_reason"] == "stop"


def test_streamed_chat_events_built_from_templates_are_the_bytes_pydantic_writes():
    """The role, content and finish events of a streamed chat completion come from per-model templates with the
    response's id and time filled in; a client must get exactly what the models would write, whatever the id holds
    (a client's X-Request-Id can carry quotes, backslashes, line separators)."""
    from mstar_dist.server.chat import ChatReply, chunk_template
    from mstar_dist.server.framing import json_bytes
    from mstar_dist.server.protocol import ChunkChoice, ChunkDelta

    reply = ChatReply('chatcmpl-a"b\\c\u2028d', 1764629000, "fake/model")
    for usage in (False, True):
        role = reply.typed_chunk([ChunkChoice(delta=ChunkDelta(role="assistant", content=""))], None, usage)
        assert reply.fill(chunk_template(reply.model, usage, "role")) == role
        for reason in ("stop", "length"):
            finish = reply.typed_chunk([ChunkChoice(delta=ChunkDelta(), finish_reason=reason)], None, usage)
            assert reply.fill(chunk_template(reply.model, usage, "finish", reason)) == finish
        head, tail = reply.content_framing(usage)
        assert head + json_bytes("h\u00e9\n") + tail == reply.typed_chunk(
            [ChunkChoice(delta=ChunkDelta(content="h\u00e9\n"))], None, usage)
    other = ChatReply("chatcmpl-x", 5, "fake/model")
    assert b'"id":"chatcmpl-x"' in other.fill(chunk_template(other.model, False, "role"))  # no id carried over


def test_a_stream_cancelled_by_the_server_stays_cancelled_and_aborts_the_backend():
    """A streamed response on an ASGI 2.3 server (uvicorn) whose task the server cancels (it is stopping) while the
    client is still there: the cancellation is not taken for the client going away and swallowed, and the backend
    request is aborted all the same."""
    fake = FakeBackend(hang_at=2)
    app = build_app(fake)

    async def main():
        body_sent = False

        async def receive():
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": json.dumps({"messages": MSGS, "stream": True}).encode(),
                        "more_body": False}
            await asyncio.Event().wait()  # the client never leaves

        async def send(message):
            pass

        task = asyncio.create_task(app(_post_scope(CHAT, "2.3"), receive, send))
        while not fake.hanging.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert fake.aborted.is_set() and fake.n_closed == 1
