"""MStarClient and the official openai client against a real HttpServer (127.0.0.1, free port) over the fake
backend, plus HttpServer's own contract.

A failure here means SDK users get mojibake or split characters from streams, audio or images they cannot
decode, audio that arrives only once it is all made, errors that do not raise, requests that keep running after
the client gave up, an OpenAI-compatible route (chat, speech, images) that the openai package cannot parse, or a
server thread that cannot be started, reached, or stopped cleanly.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import threading
import time
import wave
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from openai import OpenAI

from mstar_dist.client import MStarClient, MStarError, audio_part, image_part
from mstar_dist.server.app import build_app
from mstar_dist.server.http_server import HttpServer
from mstar_dist.media.wav import wav_bytes, wav_header
from tests.fakes import (
    AUDIO_DELTAS, AUDIO_PCM, SAMPLE_RATE, UNICODE_DELTAS, UNICODE_TEXT, FakeBackend, parse_wav, pcm_chunk, png_size,
    speech_for, tiny_png,
)


@pytest.fixture(scope="module")
def served():
    fake = FakeBackend()
    server = HttpServer(build_app(fake))
    server.start("127.0.0.1", 0, timeout_s=10)
    try:
        yield fake, server
    finally:
        server.stop(timeout_s=2)
        assert not server.running


@pytest.fixture
def fake(served) -> FakeBackend:
    fake, _ = served
    fake.__init__()  # fresh script and flags for every test
    return fake


@pytest.fixture
def client(served, fake):
    with MStarClient(served[1].url, timeout=10) as c:
        yield c


# ------------------------------------------------------------------------------------------ HttpServer


def test_server_exposes_its_running_loop(served):
    _, server = served

    async def where() -> int:
        return threading.get_ident()

    ident = asyncio.run_coroutine_threadsafe(where(), server.loop).result(timeout=5)
    assert ident != threading.get_ident()


def test_start_on_a_taken_port_names_host_and_port(served):
    _, server = served
    with pytest.raises(OSError, match=f"127.0.0.1:{server.port}.*in use"):
        HttpServer(build_app(FakeBackend())).start("127.0.0.1", server.port, timeout_s=5)


def test_stop_is_bounded_with_a_request_in_flight():
    fake = FakeBackend(hang_at=1)
    server = HttpServer(build_app(fake))
    server.start("127.0.0.1", 0, timeout_s=10)
    with MStarClient(server.url, timeout=10) as c:
        chunks = c.stream("hi")
        next(chunks)
        assert fake.hanging.wait(5)
        t0 = time.monotonic()
        server.stop(timeout_s=1)
        assert time.monotonic() - t0 < 5 and not server.running
        assert fake.aborted.wait(1)
        with pytest.raises(MStarError):
            list(chunks)


# ------------------------------------------------------------------------------------------ MStarClient


def test_health(client, fake, served):
    assert client.health().ok
    fake.serving = False
    health = client.health()
    assert not health and "rank 1 is not ready" in health.reason
    assert not MStarClient(f"http://127.0.0.1:{_free_port()}", timeout=2).health()


def test_chat_and_models(client):
    result = client.chat("hello there", temperature=0.0, max_tokens=10)
    assert (result.text, result.finish_reason) == (UNICODE_TEXT, "stop")
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (2, 5, 7)
    assert client.models() == ["fake-model"]
    with pytest.raises(TypeError, match="max_tokenz"):
        client.chat("hi", max_tokenz=3)


def test_every_sampling_knob_reaches_the_backend(client, fake):
    knobs = {"min_p": 0.1, "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5}
    client.chat("hi", max_tokens=3, **knobs)
    client.generate(prompt="hi", max_tokens=3, **knobs)
    for call in fake.calls:
        assert {k: getattr(call, k) for k in knobs} == knobs


def test_generate(client, fake):
    result = client.generate(prompt="one two three", request_id="pinned-1", max_tokens=3, seed=5)
    assert result.request_id == "pinned-1" and result.text == "".join(UNICODE_DELTAS[:3])
    assert result.finish_reason == "length" and result.usage.prompt_tokens == 3
    assert result.outputs[0].data.decode("utf-8") == result.text
    assert fake.calls[0].seed == 5
    assert client.generate(messages=[{"role": "user", "content": "hi"}]).text == UNICODE_TEXT


def test_complete_tokenize_and_detokenize(client, fake):
    out = client.complete(["one", "two"], n=2, max_tokens=2, echo=True, ignore_eos=True, min_tokens=1)
    assert len(out.texts) == 4 and out.texts[0] == "one" + "".join(UNICODE_DELTAS[:2])
    assert out.finish_reasons == ["length"] * 4 and out.usage.prompt_tokens == 2 and out.id.startswith("cmpl-")
    assert all(p.ignore_eos and p.min_tokens == 1 and p.n == 2 for p in fake.calls)
    assert client.complete([104, 105], max_tokens=1).text == UNICODE_DELTAS[0]
    ids = client.tokenize("héllo")
    assert ids == [104, 233, 108, 108, 111] and client.detokenize(ids) == "héllo"
    assert client.tokenize(messages=[{"role": "user", "content": "x"}])[:6] == [117, 115, 101, 114, 58, 32]


def test_stream_yields_typed_chunks(client):
    chunks = list(client.stream("hi", request_id="st-1"))
    *deltas, final = chunks
    assert [c.text for c in deltas] == UNICODE_DELTAS
    assert all(c.modality == "text" and c.data == c.text.encode() for c in deltas)
    assert final.finish_reason == "stop" and final.usage.completion_tokens == 5 and final.data == b""
    assert final.metadata["request_id"] == "st-1"


def test_http_errors_raise_with_the_server_message(client):
    with pytest.raises(MStarError) as err:
        client.chat("hi", max_tokens=1000)
    assert err.value.status == 400 and "limit of 32" in err.value.message
    with pytest.raises(MStarError) as err:
        client.generate(prompt="a", max_tokens=0)
    assert err.value.status == 400 and "max_tokens" in err.value.message
    with pytest.raises(MStarError) as err:
        list(client.stream(" ".join(["w"] * 100)))
    assert err.value.status == 400 and err.value.message == "prompt is 100 tokens, context is 64"


def test_error_line_in_a_stream_raises(client, fake):
    fake.fail_at = 2
    seen = []
    with pytest.raises(MStarError) as err:
        for chunk in client.stream("hi"):
            seen.append(chunk.text)
    assert seen == UNICODE_DELTAS[:2]
    assert err.value.status == 500 and "boom in the fake model" in err.value.message
    assert client.health().ok


def test_closing_a_stream_aborts_the_request(client, fake):
    fake.hang_at = 2
    chunks = client.stream("hi")
    assert [next(chunks).text, next(chunks).text] == UNICODE_DELTAS[:2]
    assert fake.hanging.wait(5)
    chunks.close()
    assert fake.aborted.wait(5)


def test_giving_up_on_a_whole_response_aborts_the_request(served, fake):
    fake.hang_at = 1
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served[1].url}/generate", json={"prompt": "hi"}, timeout=0.5)
    assert fake.aborted.wait(5)


# ------------------------------------------------------------------------------------- MStarClient media


def test_speech_returns_wav_or_pcm(client, fake):
    fake.__init__(output_modality="audio")
    assert parse_wav(client.speech("hello", "alice", seed=4, temperature=0.3)) == (SAMPLE_RATE, 1, AUDIO_PCM)
    assert (fake.calls[0].seed, fake.calls[0].temperature, fake.calls[0].model_kwargs) == (4, 0.3, {"voice": "alice"})
    assert client.speech("hello", None, response_format="pcm") == AUDIO_PCM
    client.speech("hello", "alice", repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25, min_p=0.1)
    last = fake.calls[-1]
    assert (last.repetition_penalty, last.presence_penalty, last.frequency_penalty, last.min_p) == (1.3, 0.5, 0.25, 0.1)
    with pytest.raises(TypeError, match="speeed"):
        client.speech("hello", "alice", speeed=1.0)


def test_speech_stream_yields_the_header_then_pcm_as_it_is_made(client, fake):
    fake.__init__(output_modality="audio", gate_at=len(AUDIO_DELTAS) - 1)
    pieces = client.speech_stream("hello", "bob")
    assert next(pieces) == wav_header(SAMPLE_RATE, 1, None)
    first = next(pieces)
    assert AUDIO_DELTAS[0].data.startswith(first)
    assert fake.gated.wait(5) and fake.n_yielded == len(AUDIO_DELTAS) - 1  # the last delta is not made yet
    fake.open_gate()
    assert first + b"".join(pieces) == AUDIO_PCM
    fake.gate_at = None
    assert b"".join(client.speech_stream("hello", "bob", response_format="pcm")) == AUDIO_PCM


def test_speech_errors_raise(client, fake):
    fake.__init__(output_modality="audio")
    with pytest.raises(MStarError) as err:
        client.speech("hello", "carol")
    assert err.value.status == 400 and "alice, bob" in err.value.message
    with pytest.raises(MStarError) as err:
        list(client.speech_stream("hello", "alice", response_format="mp3"))
    assert err.value.status == 400 and "'wav' or 'pcm'" in err.value.message
    fake.fail_at = 2
    with pytest.raises(MStarError) as err:
        list(client.speech_stream("hello", "alice"))
    assert err.value.status == 0  # the transfer broke off mid-stream
    assert client.health().ok


def test_images_returns_pngs(client, fake):
    fake.__init__(output_modality="image")
    pngs = client.images("a cat", n=2, size="32x32", steps=3, guidance_scale=2.0, seed=10)
    assert [png_size(p) for p in pngs] == [(32, 32)] * 2 and pngs[0] != pngs[1]
    assert sorted(p.seed for p in fake.calls) == [10, 11]
    assert fake.calls[0].model_kwargs == {"width": 32, "height": 32, "steps": 3, "guidance_scale": 2.0}
    with pytest.raises(MStarError) as err:
        client.images("a cat", n=9)
    assert err.value.status == 400 and "n:" in err.value.message


def test_generate_decodes_media(client, fake):
    fake.__init__(output_modality="audio")
    chunks = list(client.stream("hi", model_kwargs={"voice": "bob"}, max_tokens=5))
    *media, final = chunks
    assert [(c.modality, c.data, c.text) for c in media] == [("audio", d.data, None) for d in AUDIO_DELTAS]
    assert media[0].metadata["sample_rate"] == SAMPLE_RATE and final.finish_reason == "stop"
    assert fake.calls[0].model_kwargs == {"voice": "bob"} and fake.calls[0].max_tokens == 5
    (out,) = client.generate(prompt="hi").outputs
    assert (out.modality, out.data, out.metadata["sample_rate"]) == ("audio", AUDIO_PCM, SAMPLE_RATE)
    with pytest.raises(TypeError, match="seed"):
        client.generate(prompt="hi", seed=1, model_kwargs={"seed": 2})


# ------------------------------------------------------------------------------------------ openai package


def test_openai_client_non_streaming(served, fake):
    oai = OpenAI(base_url=f"{served[1].url}/v1", api_key="x", max_retries=0, timeout=10)
    resp = oai.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=8, temperature=0)
    assert resp.choices[0].message.content == UNICODE_TEXT
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == 5
    assert [m.id for m in oai.models.list()] == ["fake-model"]


def test_openai_client_streaming_with_usage(served, fake):
    oai = OpenAI(base_url=f"{served[1].url}/v1", api_key="x", max_retries=0, timeout=10)
    stream = oai.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == UNICODE_TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage.total_tokens == 6


def test_openai_client_sees_bad_requests_as_400(served, fake):
    import openai

    oai = OpenAI(base_url=f"{served[1].url}/v1", api_key="x", max_retries=0, timeout=10)
    with pytest.raises(openai.BadRequestError, match="logit_bias is not supported"):
        oai.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                    logit_bias={"5": 10})
    with pytest.raises(openai.NotFoundError, match="does not exist") as err:
        oai.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert err.value.code == "model_not_found" and err.value.param == "model"


def test_openai_client_speech(served, fake):
    import openai

    fake.__init__(output_modality="audio")
    oai = OpenAI(base_url=f"{served[1].url}/v1", api_key="x", max_retries=0, timeout=10)
    audio = oai.audio.speech.create(model="fake-model", voice="alice", input="hello", response_format="wav")
    assert parse_wav(audio.content) == (SAMPLE_RATE, 1, AUDIO_PCM)
    with oai.audio.speech.with_streaming_response.create(model="fake-model", voice="alice", input="hello",
                                                          response_format="pcm", extra_body={"stream": True}) as resp:
        assert b"".join(resp.iter_bytes()) == AUDIO_PCM
    with pytest.raises(openai.BadRequestError, match="alice, bob"):
        oai.audio.speech.create(model="fake-model", voice="nova", input="hello")


def test_openai_client_images(served, fake):
    import openai

    fake.__init__(output_modality="image")
    oai = OpenAI(base_url=f"{served[1].url}/v1", api_key="x", max_retries=0, timeout=10)
    resp = oai.images.generate(model="fake-model", prompt="a cat", n=2, size="32x32", response_format="b64_json",
                               extra_body={"seed": 1})
    pngs = [base64.b64decode(d.b64_json) for d in resp.data]
    assert [png_size(p) for p in pngs] == [(32, 32)] * 2 and pngs[0] != pngs[1]
    with pytest.raises(openai.BadRequestError, match="only 'b64_json'"):
        oai.images.generate(model="fake-model", prompt="a cat", response_format="url")


# ------------------------------------------------------------------------------- images and audio, both ways

OMNI = {"input_modalities": ("text", "image", "audio"), "output_modalities": ("text", "audio")}
PNG = tiny_png(3, 2, seed=4)
WAV_IN = wav_bytes(pcm_chunk(9, 80), 16000, 1)
SPOKEN = b"".join(speech_for(i).data for i in range(len(UNICODE_DELTAS)))


def test_sdk_sends_image_and_audio_parts_and_reads_spoken_answers(client, fake):
    fake.__init__(**OMNI)
    parts = [{"type": "text", "text": "what is this? "}, image_part(PNG), audio_part(WAV_IN, "wav")]
    result = client.chat([{"role": "user", "content": parts}])
    assert result.text == f"images=[{len(PNG)}] audio=[{len(WAV_IN)}] " + UNICODE_TEXT and result.audio is None
    assert [(i.kind, i.data, i.format, i.offset) for i in fake.calls[0].media] == [
        ("image", PNG, "image/png", 14), ("audio", WAV_IN, "wav", 14)]
    spoken = client.chat("speak", modalities=["text", "audio"], voice="bob")
    assert spoken.audio.transcript == spoken.text == UNICODE_TEXT and spoken.audio.id.startswith("audio-")
    assert parse_wav(spoken.audio.data) == (SAMPLE_RATE, 1, SPOKEN)
    assert fake.calls[1].model_kwargs == {"voice": "bob"}
    assert client.chat("speak", modalities=["text", "audio"], audio_format="pcm16").audio.data == SPOKEN
    deltas = list(client.chat_stream("speak", modalities=["text", "audio"]))
    assert "".join(d.text for d in deltas) == UNICODE_TEXT and b"".join(d.audio for d in deltas) == SPOKEN
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["stop"]
    with pytest.raises(MStarError) as err:
        client.chat("speak", modalities=["text", "audio"], voice="zed")
    assert err.value.status == 400 and "alice, bob" in err.value.message


def test_sdk_uploads_files_to_generate_and_streams_audio(client, fake):
    fake.__init__(**OMNI)
    messages = [{"role": "user", "content": "describe"}]
    result = client.generate(messages=messages, images=[PNG], audio=[(WAV_IN, "wav")], max_tokens=1)
    assert result.text == f"images=[{len(PNG)}] audio=[{len(WAV_IN)}] "
    assert [(i.kind, i.format, i.offset, i.source) for i in fake.calls[0].media] == [
        ("image", "image/png", 8, "files[0] ('image0')"), ("audio", "wav", 8, "files[1] ('audio0.wav')")]
    chunks = list(client.stream(messages=messages, modalities=["text", "audio"], images=[PNG]))
    assert chunks[0].text == f"images=[{len(PNG)}] audio=[] "
    assert b"".join(c.data for c in chunks if c.modality == "audio") == SPOKEN
    with pytest.raises(MStarError) as err:
        client.generate(prompt="describe", images=[PNG])
    assert err.value.status == 400 and "send 'messages'" in err.value.message
    fake.__init__()
    with pytest.raises(MStarError) as err:
        client.chat([{"role": "user", "content": [image_part(PNG)]}])
    assert err.value.status == 400 and "takes only text parts" in err.value.message


def test_openai_client_sends_image_and_audio_and_gets_speech(served, fake):
    import openai

    fake.__init__(**OMNI)
    oai = OpenAI(base_url=f"{served[1].url}/v1", api_key="x", max_retries=0, timeout=10)
    content = [{"type": "text", "text": "what do you see and hear?"},
               {"type": "image_url", "image_url": {"url": image_part(PNG)["image_url"]["url"], "detail": "low"}},
               {"type": "input_audio", "input_audio": {"data": base64.b64encode(WAV_IN).decode(), "format": "wav"}}]
    resp = oai.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": content}])
    assert resp.choices[0].message.content == f"images=[{len(PNG)}] audio=[{len(WAV_IN)}] " + UNICODE_TEXT

    resp = oai.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                       modalities=["text", "audio"], audio={"voice": "alice", "format": "wav"})
    spoken = resp.choices[0].message.audio
    with wave.open(io.BytesIO(base64.b64decode(spoken.data))) as w:  # the stdlib reads the WAV
        assert (w.getframerate(), w.getnchannels(), w.readframes(1 << 20)) == (SAMPLE_RATE, 1, SPOKEN)
    assert spoken.transcript == UNICODE_TEXT and spoken.id and spoken.expires_at > 0

    stream = oai.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                         modalities=["text", "audio"], audio={"voice": "alice", "format": "pcm16"},
                                         stream=True)
    chunks = [c for c in stream if c.choices]
    audio = [c.choices[0].delta.audio for c in chunks if c.choices[0].delta.audio]  # ChoiceDeltaAudio
    assert b"".join(base64.b64decode(a.data) for a in audio if a.data) == SPOKEN
    assert "".join(a.transcript or "" for a in audio) == UNICODE_TEXT and audio[-1].expires_at > 0
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == UNICODE_TEXT
    fake.__init__()
    with pytest.raises(openai.BadRequestError, match="has no audio output"):
        oai.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                    modalities=["text", "audio"], audio={"voice": "alice", "format": "wav"})


# ---------------------------------------------------------------- NDJSON decoding regression (no charset)

NOTE = "東京\u2028ligne é"  # U+2028 is a line break to str.splitlines(), but not to NDJSON


def _ndjson_body(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line, ensure_ascii=False).encode("utf-8") + b"\n" for line in lines)


class _TinyNdjsonServer:
    """Serves one fixed NDJSON body with a given Content-Type, written in 3-byte pieces so that multi-byte
    characters and lines are split across network reads."""

    def __init__(self, body: bytes, content_type: str) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 -- http.server API
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(200)
                self.send_header("Content-Type", outer.content_type)
                self.send_header("Connection", "close")
                self.end_headers()
                for i in range(0, len(outer.body), 3):
                    self.wfile.write(outer.body[i:i + 3])
                    self.wfile.flush()

            def log_message(self, *args) -> None:
                pass

        self.body, self.content_type = body, content_type
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@pytest.mark.parametrize("content_type", ["application/x-ndjson", "application/x-ndjson; charset=iso-8859-1"])
@pytest.mark.parametrize("text_as_itself", [True, False])
def test_stream_decodes_utf8_whatever_the_content_type_says(content_type, text_as_itself):
    """Text lines as servers send them now (``encoding: utf-8``, the text itself) and as they did before (base64, no
    ``encoding``): the SDK reads both."""
    lines = [{"modality": "text", "data": d, "metadata": {"note": NOTE, "encoding": "utf-8"}} if text_as_itself else
             {"modality": "text", "data": base64.b64encode(d.encode()).decode(), "metadata": {"note": NOTE}}
             for d in UNICODE_DELTAS]
    lines.append({"modality": "text", "data": "", "metadata": {"finish_reason": "stop", "note": NOTE}})
    with _TinyNdjsonServer(_ndjson_body(lines), content_type) as url, MStarClient(url, timeout=5) as c:
        chunks = list(c.stream("hi"))
    assert "".join(ch.text for ch in chunks) == UNICODE_TEXT
    assert all(ch.metadata["note"] == NOTE for ch in chunks)
    assert chunks[-1].finish_reason == "stop"


def test_stream_error_line_with_non_ascii_message():
    lines = [{"modality": "text", "data": base64.b64encode("é".encode()).decode(), "metadata": {}},
             {"modality": "error", "data": "", "metadata": {"status": 502, "message": "rang 2 perdu: 東京"}}]
    with _TinyNdjsonServer(_ndjson_body(lines), "application/x-ndjson") as url, MStarClient(url, timeout=5) as c:
        with pytest.raises(MStarError) as err:
            list(c.stream("hi"))
    assert (err.value.status, err.value.message) == (502, "rang 2 perdu: 東京")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
