"""Images and audio in, spoken answers out, through the real app over the fake backend (no processes).

A failure here means an image or audio clip a client sends in OpenAI's shapes (chat ``image_url`` / ``input_audio``
parts, native ``messages`` parts, ``/generate`` multipart files, an allowed URL) does not reach the model family as
the exact bytes with its declared format and place in the conversation; a bad item (not base64, not an image, a wrong
format, a URL without the option, too many, too big) is not a 4xx saying what to fix, or it hurts the server; a model
that reads no media or cannot speak is not refused clearly; or a spoken answer (``message.audio``, ``delta.audio``,
native audio lines) does not hold the model's audio.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest
from starlette.testclient import TestClient

from mstar_dist.config.deployment import MediaConfig
from mstar_dist.control import messages as m
from mstar_dist.events import GenerationParams, MediaItem, MediaLimits
from mstar_dist.server.app import build_app
try:  # loaded at collection, before any test: pytest rewrites schemathesis' modules as they load, and CPython 3.11's
    # parser can fail that ("AST constructor recursion depth mismatch", gh-106905) once an earlier test hit a deep stack
    import schemathesis
    import schemathesis.specs.openapi.schemas  # noqa: F401 -- what from_asgi loads lazily
except ImportError:
    schemathesis = None
from tests.fakes import (
    SAMPLE_RATE, UNICODE_DELTAS, UNICODE_TEXT, FakeBackend, parse_wav, pcm_chunk, speech_for, tiny_png,
)

CHAT = "/v1/chat/completions"
PNG = tiny_png(4, 3, seed=1)
WAV = b"RIFF" + bytes(range(40)) + b"data"  # bytes only: the server does not decode, the family does
MP3 = b"ID3" + bytes(17)
SPEECH_PCM = b"".join(speech_for(i).data for i in range(len(UNICODE_DELTAS)))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def image(data: bytes = PNG, mime: str = "image/png", **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64(data)}", **extra}}


def audio(data: bytes = WAV, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def omni(**kw) -> FakeBackend:
    """A fake that reads images and audio and can speak."""
    return FakeBackend(input_modalities=("text", "image", "audio"), output_modalities=("text", "audio"), **kw)


@pytest.fixture
def fake() -> FakeBackend:
    return omni()


@pytest.fixture
def media() -> MediaConfig:
    return MediaConfig(max_items=5, max_item_bytes=4096)


@pytest.fixture
def client(fake, media):
    with TestClient(build_app(fake, media=media, max_body_bytes=64 << 10), raise_server_exceptions=False) as c:
        yield c


def error(resp, status: int, *needles: str) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    message = err["message"] if isinstance(err, dict) else err
    for needle in needles:
        assert needle in message, message
    return message


# ------------------------------------------------------------------------------------------------ media in


def test_chat_parts_reach_the_family_as_raw_bytes_with_their_place(client, fake):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "look: "}, image(detail="low"),
                                             {"type": "text", "text": "and listen"}, audio(MP3, "mp3")]}]
    resp = client.post(CHAT, json={"messages": messages})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == f"images=[{len(PNG)}] audio=[{len(MP3)}] " + UNICODE_TEXT
    (params,) = fake.calls
    assert params.messages == [{"role": "system", "content": "be brief"},
                               {"role": "user", "content": "look: and listen"}]
    assert params.media == [
        MediaItem("image", PNG, "image/png", 1, len("look: "), "messages[1].content[1]", "low"),
        MediaItem("audio", MP3, "mp3", 1, len("look: and listen"), "messages[1].content[3]"),
    ]
    assert params.media_limits == MediaLimits(4096, MediaConfig().max_image_pixels, MediaConfig().max_audio_seconds)
    assert params.output_modalities == ["text"]


def test_a_text_request_carries_no_media_and_no_limits(client, fake):
    assert client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    assert client.post("/generate", json={"prompt": "hi"}).status_code == 200
    assert [(p.media, p.media_limits) for p in fake.calls] == [([], None)] * 2
    assert fake.calls[1].output_modalities is None  # native: the family's default


def test_generate_takes_the_same_parts_in_messages(client, fake):
    resp = client.post("/generate", json={"messages": user(audio(), {"type": "text", "text": "what is it?"}, image()),
                                          "model_kwargs": {"max_tokens": 2}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["text"] == f"images=[{len(PNG)}] audio=[{len(WAV)}] " + UNICODE_DELTAS[0]
    assert [(i.kind, i.data, i.offset) for i in fake.calls[0].media] == [("audio", WAV, 0), ("image", PNG, 11)]


def test_generate_multipart_files_join_the_last_user_message(client, fake):
    body = {"messages": [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": [image(), {"type": "text", "text": "and these"}]}],
            "stream": True}
    files = [("image", ("cat.png", PNG, "image/png")), ("audio", ("hi.flac", b"fLaC" + bytes(8), "audio/flac")),
             ("image", ("dog.webp", b"RIFF\x00\x00\x00\x00WEBPVP8 ", "application/octet-stream")),
             ("audio", ("clip.ogg", b"OggS" + bytes(4), ""))]
    resp = client.post("/generate", data={"request": json.dumps(body)}, files=files)
    assert resp.status_code == 200, resp.text
    lines = [json.loads(line) for line in resp.content.splitlines()]
    echo = lines[0]["data"]
    assert echo == f"images={[len(PNG), len(PNG), 16]} audio=[12, 8] "
    items = fake.calls[0].media
    assert [(i.kind, i.format, i.message, i.offset) for i in items] == [
        ("image", "image/png", 2, 0), ("image", "image/png", 2, 9), ("audio", "flac", 2, 9),
        ("image", "image/webp", 2, 9), ("audio", "ogg", 2, 9)]
    assert [i.source for i in items[1:]] == ["files[0] ('cat.png')", "files[1] ('hi.flac')", "files[2] ('dog.webp')",
                                             "files[3] ('clip.ogg')"]


@pytest.mark.parametrize("data,files,status,needles", [
    ({}, [("image", ("a.png", PNG, "image/png"))], 400, ["exactly one 'request' field"]),
    ({"request": "{not json"}, [("image", ("a.png", PNG, "image/png"))], 400,
     ["the 'request' field is not valid JSON"]),
    ({"request": json.dumps({"prompt": "hi"})}, [("image", ("a.png", PNG, "image/png"))], 400,
     ["send 'messages' with a user message"]),
    ({"request": json.dumps({"messages": user()}), "extra": "1"}, [("image", ("a.png", PNG, "image/png"))], 400,
     ["['extra'] are not taken"]),
    ({"request": json.dumps({"messages": user()})}, [("image", ("a.txt", b"hello", "text/plain"))], 400,
     ["files[0] ('a.txt')", "not an image type"]),
    ({"request": json.dumps({"messages": user()})}, [("audio", ("a.aac", b"xx", "audio/aac"))], 400,
     ["files[0] ('a.aac')", "not an audio format", "wav, mp3, flac, ogg"]),
    ({"request": json.dumps({"messages": user()})}, [("image", ("a.png", PNG, "image/png"))] * 6, 400,
     ["media.max_items = 5"]),
    ({"request": json.dumps({"messages": user()})}, [("image", ("a.png", bytes(5000), "image/png"))], 400,
     ["files[0] ('a.png')", "5000 bytes, above media.max_item_bytes = 4096"]),
])
def test_bad_multipart_bodies_are_400_naming_the_fix(client, fake, data, files, status, needles):
    error(client.post("/generate", data=data, files=files), status, *needles)
    assert not fake.calls and client.get("/health").status_code == 200


def part_with(kind: str, **body) -> dict:
    return {"type": kind, kind: body}


BAD_PARTS = [
    (user(part_with("image_url", url="data:image/png;base64,@@@notb64")),
     ["messages[0].content[0].image_url.url: not valid base64"]),
    (user(part_with("image_url", url=f"data:text/html;base64,{b64(b'<p>')}")),
     ["type 'text/html' is not an image type"]),
    (user(part_with("image_url", url="data:image/png,rawbytes")), ["must carry base64"]),
    (user(part_with("image_url", url="data:image/png;base64")), ["a comma before its data"]),
    (user(part_with("input_audio", data=b64(WAV), format="aac")),
     ["input_audio.format 'aac' is not supported; use one of wav, mp3, flac, ogg"]),
    (user(part_with("input_audio", data="not base64!", format="wav")),
     ["content[0].input_audio.data: not valid base64"]),
    (user(part_with("image_url", url="https://example.com/cat.png")),
     ["image URLs are off on this server", "--allowed-media-domains example.com", "media.allowed_domains"]),
    (user(part_with("image_url", url="file:///etc/passwd")), ["neither a data: URL nor an http(s)"]),
    (user(image(), image(), audio(), audio(), image(), audio()),
     ["6 images and audio clips, above media.max_items = 5"]),
    (user(audio(bytes(5000))), ["content[0].input_audio.data: the audio clip is 5000 bytes, above "
                                "media.max_item_bytes = 4096"]),
    (user(image(bytes(6000))), ["content[0].image_url.url: the image is 6000 bytes, above media.max_item_bytes"]),
    (user(part_with("image_url", url="data:image/png;base64,")), ["the image is empty"]),
    (user(part_with("image_url", url=f"data:image/png;base64,{b64(PNG)}", detail="ultra")),
     ["detail 'ultra' is not one of"]),
    (user({"type": "video_url", "video_url": {}}), ['must be {"type": "text"']),
]


@pytest.mark.parametrize("messages,needles", BAD_PARTS)
@pytest.mark.parametrize("route", [CHAT, "/generate"])
def test_bad_media_parts_are_400_naming_the_fix_and_the_server_stays_healthy(client, fake, route, messages, needles):
    error(client.post(route, json={"messages": messages}), 400, *needles)
    assert not fake.calls
    assert client.get("/health").status_code == 200
    assert client.post(route, json={"messages": user(image())}).status_code == 200


def test_a_body_over_the_limit_is_413_as_before(client, fake):
    error(client.post(CHAT, json={"messages": user(image(bytes(70000)))}), 413, "server.max_body_bytes")
    files = [("image", ("a.png", bytes(70000), "image/png"))]
    error(client.post("/generate", data={"request": json.dumps({"messages": user()})}, files=files), 413)
    assert not fake.calls and client.get("/health").status_code == 200


@pytest.mark.parametrize("inputs,part,needle", [
    (("text",), image(), "'fake-model' takes only text parts (it reads no images)"),
    (("text",), audio(), "'fake-model' takes only text parts (it reads no audio)"),
    (("text", "image"), audio(), "takes only text and image_url parts (it reads no audio)"),
    (("text", "audio"), image(), "takes only text and input_audio parts (it reads no images)"),
])
def test_a_model_that_reads_no_such_media_refuses_it(inputs, part, needle):
    fake = FakeBackend(input_modalities=inputs)
    with TestClient(build_app(fake), raise_server_exceptions=False) as client:
        for route in (CHAT, "/generate"):
            error(client.post(route, json={"messages": user(part)}), 400, needle)
        files = [("image", ("x.png", PNG, "image/png"))] if part["type"] == "image_url" else [
            ("audio", ("x.wav", WAV, "audio/wav"))]
        error(client.post("/generate", data={"request": json.dumps({"messages": user()})}, files=files), 400,
              "takes no")
    assert not fake.calls


def test_params_with_media_cross_the_wire_to_the_conductor_unchanged():
    """An intake sends GenerationParams in ``Submit`` (msgpack, never pickle): the bytes arrive as bytes."""
    params = GenerationParams("r1", None, [{"role": "user", "content": "hi"}], 4, output_modalities=["text", "audio"],
                              media=[MediaItem("image", PNG, "image/png", 0, 2, "messages[0].content[1]", "high"),
                                     MediaItem("audio", bytes(range(256)), "wav", 0, 2, "files[0]")],
                              media_limits=MediaLimits(10, 20, 1.5))
    wire = m.encode("secret", "intake0", m.Submit(params=params, pinned_id=True))
    assert m.decode(wire).body.params == params
    assert msgspec.msgpack.decode(wire, type=m.Envelope).body.params.media[1].data == bytes(range(256))


def test_an_intake_leaves_the_tokenizing_of_a_media_request_to_the_family_and_sends_its_bytes():
    """An intake's prompt encoder knows nothing of media placeholders: a request with media goes without ids (the
    family's preprocess places them), with the bytes in its Submit."""
    import asyncio

    from mstar_dist.server.intake_backend import IntakeBackend

    class Link:
        health = (True, "ok")

        def __init__(self):
            self.sent = []

        def send(self, body):
            self.sent.append(m.decode(m.encode("s", "intake0", body)).body)  # as the conductor receives it

    class Encoder:
        def encode_prompt(self, prompt, messages):
            return [1, 2, 3]

    link = Link()
    backend = IntakeBackend(link, None, model_name="omni", max_context_tokens=64, max_tokens_limit=8,
                            output_modality="text", encoder=Encoder(), output_modalities=["text", "audio"],
                            input_modalities=["text", "image"])
    assert (backend.input_modalities, backend.output_modalities) == (("text", "image"), ("text", "audio"))
    item = MediaItem("image", PNG, "image/png", 0, 0, "messages[0].content[0]")

    async def start(params):
        stream = backend.generate(params)
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)  # the Submit is out; nothing comes back here
        task.cancel()

    async def both():
        await start(GenerationParams("plain", None, [{"role": "user", "content": "hi"}], 4))
        await start(GenerationParams("media", None, [{"role": "user", "content": ""}], 4, media=[item],
                                     media_limits=MediaLimits(1, 2, 3.0)))

    asyncio.run(both())
    plain, media = [body.params for body in link.sent if isinstance(body, m.Submit)]
    assert plain.prompt_ids == [1, 2, 3] and (media.prompt_ids, media.media) == (None, [item])


def test_the_family_sees_media_and_output_modalities_on_its_request_state():
    from mstar_dist.conductor.request import request_state

    items = [MediaItem("audio", WAV, "wav", 0, 0, "messages[0].content[0]")]
    params = GenerationParams("r2", None, [{"role": "user", "content": ""}], 4, media=items,
                              media_limits=MediaLimits(1, 2, 3.0), output_modalities=["text", "audio"])
    state = request_state(params, pinned_id=True)
    assert (state.media, state.media_limits, state.output_modalities) == (items, MediaLimits(1, 2, 3.0),
                                                                          ["text", "audio"])


# ---------------------------------------------------------------------------------------------- image URLs


class _Images(BaseHTTPRequestHandler):
    """A loopback image host: /cat.png, a same-host and an other-host redirect, a slow, a big, an HTML page."""

    def do_GET(self):  # noqa: N802 -- http.server's name
        port = self.server.server_address[1]
        routes = {
            "/cat.png": (200, {"Content-Type": "image/png"}, PNG),
            "/same": (302, {"Location": "/cat.png"}, b""),
            "/away": (302, {"Location": f"http://localhost:{port}/cat.png"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
            "/page": (200, {"Content-Type": "text/html"}, b"<html></html>"),
            "/big": (200, {"Content-Type": "image/png"}, bytes(5000)),
            "/missing": (404, {}, b"no"),
        }
        if self.path == "/slow":
            time.sleep(3.5)
        if self.path == "/chunked":  # no Content-Length: the size shows only while reading
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(5):
                self.wfile.write(b"400\r\n" + bytes(1024) + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
            return
        status, headers, body = routes.get(self.path, (200, {"Content-Type": "image/png"}, PNG))
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def fetching(fake):
    media = MediaConfig(allowed_domains=("127.0.0.1",), max_item_bytes=4096, fetch_timeout_s=1.5)
    with TestClient(build_app(fake, media=media), raise_server_exceptions=False) as c:
        yield c


def url_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize("path", ["/cat.png", "/same"])
def test_an_allowed_image_url_is_fetched_and_reaches_the_family(fetching, fake, image_host, path):
    resp = fetching.post(CHAT, json={"messages": user(url_part(image_host + path), image())})
    assert resp.status_code == 200, resp.text
    assert [(i.data, i.format) for i in fake.calls[0].media] == [(PNG, "image/png"), (PNG, "image/png")]


@pytest.mark.parametrize("path,needles", [
    ("/away", ["redirects to another host ('localhost')"]),
    ("/loop", ["redirected more than 3 times"]),
    ("/page", ["is 'text/html', not an image"]),
    ("/big", ["5000 bytes, above media.max_item_bytes = 4096"]),
    ("/chunked", ["above media.max_item_bytes = 4096"]),
    ("/missing", ["answered HTTP 404"]),
    ("/slow", ["within media.fetch_timeout_s = 1.5 s"]),
])
def test_a_bad_image_url_is_400_naming_the_url_and_the_server_stays_healthy(fetching, fake, image_host, path,
                                                                            needles):
    resp = fetching.post(CHAT, json={"messages": user(image(), url_part(image_host + path))})
    error(resp, 400, "messages[0].content[1]", *needles)
    assert resp.json()["error"]["param"] == "messages[0].content[1].image_url.url"
    assert not fake.calls and fetching.get("/health").status_code == 200


def test_a_host_not_in_the_list_is_refused_without_a_fetch(fetching, image_host):
    other = image_host.replace("127.0.0.1", "localhost")
    error(fetching.post(CHAT, json={"messages": user(url_part(other + "/cat.png"))}), 400,
          "host 'localhost' is not in media.allowed_domains (127.0.0.1)")


# ----------------------------------------------------------------------------------------------- audio out


def test_chat_with_audio_returns_a_wav_and_its_transcript(client, fake):
    body = {"messages": user(image()), "modalities": ["text", "audio"], "audio": {"voice": "bob", "format": "wav"}}
    resp = client.post(CHAT, json=body, headers={"X-Request-Id": "spk-1"})
    assert resp.status_code == 200, resp.text
    message = resp.json()["choices"][0]["message"]
    spoken = message["audio"]
    assert spoken["id"] == "audio-spk-1" and spoken["transcript"] == message["content"]
    assert message["content"] == f"images=[{len(PNG)}] audio=[] " + UNICODE_TEXT
    assert parse_wav(base64.b64decode(spoken["data"])) == (SAMPLE_RATE, 1, SPEECH_PCM)
    assert abs(spoken["expires_at"] - time.time()) < 60
    (params,) = fake.calls
    assert (params.output_modalities, params.model_kwargs) == (["text", "audio"], {"voice": "bob"})


def test_chat_with_pcm16_returns_raw_samples_and_a_text_answer_has_no_audio_key(client, fake):
    resp = client.post(CHAT, json={"messages": user(), "modalities": ["text", "audio"], "audio": {"format": "pcm16"}})
    assert base64.b64decode(resp.json()["choices"][0]["message"]["audio"]["data"]) == SPEECH_PCM
    assert fake.calls[0].model_kwargs == {}  # no voice given: the family's default
    plain = client.post(CHAT, json={"messages": user(), "modalities": ["text"]}).json()["choices"][0]["message"]
    assert plain == {"role": "assistant", "content": UNICODE_TEXT}


def sse(resp) -> list[dict]:
    events = [e.removeprefix("data: ") for e in resp.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streamed_chat_sends_audio_deltas_beside_the_text_as_they_are_made(client, fake):
    body = {"messages": user(), "stream": True, "modalities": ["text", "audio"], "audio": {"voice": "alice"},
            "stream_options": {"include_usage": True}}
    events = sse(client.post(CHAT, json=body, headers={"X-Request-Id": "spk-2"}))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    spoken = [d["audio"] for d in deltas if "audio" in d]
    assert all(a["id"] == "audio-spk-2" for a in spoken)
    order = [("text" if "transcript" in a else "audio" if "data" in a else "end") for a in spoken]
    assert order == ["text", "audio"] * len(UNICODE_DELTAS) + ["end"]  # interleaved, in the order made
    assert "".join(d.get("content") or "" for d in deltas) == UNICODE_TEXT
    assert "".join(a.get("transcript", "") for a in spoken) == UNICODE_TEXT
    assert b"".join(base64.b64decode(a["data"]) for a in spoken if "data" in a) == SPEECH_PCM
    assert [a for a in spoken if "expires_at" in a][0].keys() == {"id", "expires_at"}
    assert events[-1]["usage"]["completion_tokens"] == 2 * len(UNICODE_DELTAS)
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "stop"


@pytest.mark.parametrize("backend,body,needles", [
    (FakeBackend(), {"modalities": ["text", "audio"]}, ["'fake-model' has no audio output", "modalities"]),
    (omni(), {"modalities": ["text", "audio"], "audio": {"voice": "nova"}}, ["voice 'nova'", "alice, bob"]),
    (omni(), {"modalities": ["audio"]}, ['use ["text"] or ["text", "audio"]']),
    (omni(), {"modalities": ["text", "audio"], "audio": {"format": "mp3"}}, ["audio.format"]),
    (omni(), {"modalities": ["text", "audio"], "audio": {"format": "wav"}, "stream": True}, ['use "pcm16"']),
])
def test_bad_audio_requests_are_400(backend, body, needles):
    with TestClient(build_app(backend), raise_server_exceptions=False) as client:
        error(client.post(CHAT, json={"messages": user(), **body}), 400, *needles)
        assert client.get("/health").status_code == 200


def test_generate_streams_text_and_audio_lines_and_returns_both_whole(client, fake):
    body = {"messages": user(), "modalities": ["text", "audio"], "model_kwargs": {"voice": "bob"}}
    lines = [json.loads(x) for x in client.post("/generate", json={**body, "stream": True}).content.splitlines()]
    kinds = [line["modality"] for line in lines]
    assert kinds == ["text", "audio"] * len(UNICODE_DELTAS) + ["text"]
    assert [x["data"] for x in lines[:-1:2]] == UNICODE_DELTAS
    assert b"".join(base64.b64decode(x["data"]) for x in lines[1::2]) == SPEECH_PCM
    assert lines[1]["metadata"]["sample_rate"] == SAMPLE_RATE and lines[-1]["metadata"]["finish_reason"] == "stop"
    whole = client.post("/generate", json=body).json()
    assert [o["modality"] for o in whole["outputs"]] == ["text", "audio"] and whole["text"] == UNICODE_TEXT
    assert base64.b64decode(whole["outputs"][1]["data"]) == SPEECH_PCM
    assert fake.calls[0].output_modalities == ["text", "audio"]
    error(client.post("/generate", json={**body, "modalities": ["text", "image"]}), 400, "has no image output")


def test_speech_route_serves_a_model_that_speaks_besides_text():
    fake = omni()
    with TestClient(build_app(fake), raise_server_exceptions=False) as client:
        resp = client.post("/v1/audio/speech", json={"input": "say it", "voice": "alice"})
        assert resp.status_code == 200, resp.text
        assert parse_wav(resp.content) == (SAMPLE_RATE, 1, SPEECH_PCM)
    assert fake.calls[0].output_modalities == ["audio"]


# ------------------------------------------------------------------------------------------------- OpenAPI


def test_openapi_describes_the_parts_and_outputs_this_model_takes():
    doc = TestClient(build_app(omni(), media=MediaConfig(allowed_domains=("img.example",)))).get("/openapi.json")
    doc = doc.json()
    schemas = doc["components"]["schemas"]
    items = schemas["ChatMessage"]["properties"]["content"]["anyOf"][1]["items"]
    assert sorted(items["discriminator"]["mapping"]) == ["image_url", "input_audio", "text"]
    assert "img\\.example" in schemas["ImageURL"]["properties"]["url"]["pattern"]
    assert schemas["InputAudio"]["properties"]["format"]["enum"] == ["wav", "mp3", "flac", "ogg"]
    assert ["text", "audio"] in schemas["ChatCompletionRequest"]["properties"]["modalities"]["anyOf"][0]["enum"]
    assert "AudioOutput" in schemas and "audio" in schemas["ChatCompletionRequest"]["properties"]
    multipart = doc["paths"]["/generate"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert sorted(multipart["schema"]["properties"]) == ["audio", "image", "request"]

    text = TestClient(build_app(FakeBackend())).get("/openapi.json").json()
    schemas = text["components"]["schemas"]
    items = schemas["ChatMessage"]["properties"]["content"]["anyOf"][1]["items"]
    assert items["oneOf"] == [{"$ref": "#/components/schemas/TextPart"}]
    assert schemas["ChatCompletionRequest"]["properties"]["modalities"]["anyOf"][0]["enum"] == [["text"]]
    assert schemas["GenerateRequest"]["properties"]["modalities"]["anyOf"][0]["items"]["enum"] == ["text"]
    assert "multipart/form-data" not in text["paths"]["/generate"]["post"]["requestBody"]["content"]


def test_generated_media_requests_never_get_5xx():
    """schemathesis over the document of a model that reads images and audio and speaks: the new fields, valid and
    invalid, in process (the e2e fuzz test runs a text model, whose document has none of them)."""
    if schemathesis is None:
        pytest.skip("schemathesis is not installed (the [test] extra)")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis.generation import GenerationMode

    app = build_app(omni(), media=MediaConfig(max_item_bytes=2048))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))
    failures: list[str] = []
    seen: dict[tuple[str, int], int] = {}

    @settings(max_examples=300, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def run(case):
        response = case.call()
        key = (f"{case.method} {case.path}", response.status_code)
        seen[key] = seen.get(key, 0) + 1
        if response.status_code >= 500:
            failures.append(f"{case.method} {case.path} -> {response.status_code}: {response.text[:300]}\n"
                            f"  body: {str(case.body)[:300]}")

    run()
    assert not failures, "\n".join(failures[:5])
    assert sum(n for (route, code), n in seen.items() if route == "POST /generate" and code == 200) > 0, seen
