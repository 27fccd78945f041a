"""Speech, images and media on /generate, over the fake backend; plus the WAV writer (``mstar_dist.media.wav``).

A failure here means a speech client gets a WAV that does not parse or does not hold the model's audio, streamed
audio that waits for the whole utterance, a failed stream that looks like a complete file, n images that are the
same image or run one after another, a bad request that is a 500 (or not OpenAI-shaped), or /generate media
lines and outputs a client cannot decode.
"""

from __future__ import annotations

import base64
import json
import struct
import threading

import httpx
import pytest
from starlette.testclient import TestClient

from mstar_dist.media.wav import wav_bytes, wav_header
from mstar_dist.server.app import build_app
from mstar_dist.server.backend import BackendError, MediaDelta
from mstar_dist.server.http_server import HttpServer
from tests.fakes import (
    AUDIO_DELTAS, AUDIO_PCM, SAMPLE_RATE, FakeBackend, audio_delta, fake_image, parse_wav, pcm_chunk, png_size,
)

SPEECH = "/v1/audio/speech"
IMAGES = "/v1/images/generations"
SAY = {"model": "fake-model", "input": "hello there", "voice": "alice"}
DRAW = {"model": "fake-model", "prompt": "a red square"}


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend(output_modality="audio")


@pytest.fixture
def client(fake: FakeBackend):
    with TestClient(build_app(fake), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def served():
    fake = FakeBackend(output_modality="audio")
    server = HttpServer(build_app(fake))
    server.start("127.0.0.1", 0, timeout_s=10)
    try:
        yield fake, server.url
    finally:
        server.stop(timeout_s=2)


@pytest.fixture
def live(served):
    """(fake, base url) of a real server; the fake is reset for every test."""
    fake, url = served
    fake.__init__(output_modality="audio")
    return fake, url


def ndjson(body: bytes) -> list[dict]:
    return [json.loads(line) for line in body.split(b"\n") if line]


def openai_error(resp, status: int, needle: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert needle in err["message"], err
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return err


# ------------------------------------------------------------------------------------------------- WAV


@pytest.mark.parametrize("rate,channels,n", [(16000, 1, 0), (24000, 1, 5), (44100, 2, 3)])
def test_wav_bytes_parse_with_the_wave_module(rate, channels, n):
    pcm = pcm_chunk(7, n * channels)
    assert parse_wav(wav_bytes(pcm, rate, channels)) == (rate, channels, pcm)
    assert len(wav_header(rate, channels, n)) == 44


def test_streaming_wav_header_has_unknown_sizes_and_still_parses():
    header = wav_header(SAMPLE_RATE, 1, None)
    assert struct.unpack("<I", header[4:8]) == (0xFFFFFFFF,) == struct.unpack("<I", header[40:44])
    assert parse_wav(header + AUDIO_PCM) == (SAMPLE_RATE, 1, AUDIO_PCM)


@pytest.mark.parametrize("call,needle", [
    (lambda: wav_bytes(b"\x00" * 3, 16000, 1), "whole number"),
    (lambda: wav_bytes(b"\x00" * 2, 16000, 2), "whole number"),
    (lambda: wav_header(0, 1, 0), "sample_rate > 0"),
    (lambda: wav_header(16000, 1, 1 << 31), "do not fit"),
])
def test_wav_rejects_what_it_cannot_write(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


# ---------------------------------------------------------------------------------------------- speech


def test_speech_wav_holds_exactly_the_models_pcm(client, fake):
    resp = client.post(SPEECH, json={**SAY, "seed": 3, "temperature": 0.5}, headers={"X-Request-Id": "tts-1"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"] == "audio/wav"
    assert (resp.headers["x-request-id"], resp.headers["x-sample-rate"]) == ("tts-1", str(SAMPLE_RATE))
    assert parse_wav(resp.content) == (SAMPLE_RATE, 1, AUDIO_PCM)
    (params,) = fake.calls
    assert (params.prompt, params.messages, params.model_kwargs) == ("hello there", None, {"voice": "alice"})
    assert (params.max_tokens, params.max_tokens_given) == (FakeBackend.max_tokens_limit, False)
    assert (params.seed, params.temperature, params.request_id) == (3, 0.5, "tts-1")


def test_speech_takes_the_penalties_and_min_p_and_says_which_knobs_were_written(client, fake):
    """The four knobs beyond temperature/top-p/top-k, as top-level keys (what the openai client's ``extra_body``
    sends); ``sampling_given`` names the knobs written, so the family's defaults fill only the others."""
    knobs = {"min_p": 0.05, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": -0.25,
             "temperature": 1.0}
    assert client.post(SPEECH, json={**SAY, **knobs}).status_code == 200
    assert client.post(SPEECH, json=SAY).status_code == 200
    written, bare = fake.calls
    assert {k: getattr(written, k) for k in knobs} == knobs
    assert set(written.sampling_given) == set(knobs) and bare.sampling_given == ()
    assert (bare.min_p, bare.repetition_penalty, bare.presence_penalty, bare.frequency_penalty) == (0, 1, 0, 0)


def test_speech_pcm_is_the_raw_samples_and_voice_is_optional(client, fake):
    resp = client.post(SPEECH, json={"input": "hi", "response_format": "pcm"})
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "audio/pcm" and resp.headers["x-num-channels"] == "1"
    assert resp.content == AUDIO_PCM
    assert fake.calls[0].model_kwargs == {}  # the family's default voice


def test_speech_stream_is_a_streaming_wav_header_then_each_delta(client):
    with client.stream("POST", SPEECH, json={**SAY, "stream": True}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"] == "audio/wav"
        chunks = list(resp.iter_bytes())
    assert chunks == [wav_header(SAMPLE_RATE, 1, None)] + [d.data for d in AUDIO_DELTAS]
    assert parse_wav(b"".join(chunks)) == (SAMPLE_RATE, 1, AUDIO_PCM)


def test_speech_stream_pcm_leaves_text_out(client, fake):
    fake.deltas = ["a transcript", *AUDIO_DELTAS[:2], "more", AUDIO_DELTAS[2]]
    resp = client.post(SPEECH, json={**SAY, "stream": True, "response_format": "pcm"})
    assert resp.content == AUDIO_PCM


def test_first_audio_reaches_the_client_before_the_last_is_produced(live):
    fake, url = live
    fake.gate_at = len(AUDIO_DELTAS) - 1
    with httpx.stream("POST", f"{url}{SPEECH}", json={**SAY, "stream": True}, timeout=10) as resp:
        got = b""
        pieces = resp.iter_raw()
        while len(got) < 44 + len(AUDIO_DELTAS[0].data):
            got += next(pieces)
        assert fake.gated.wait(5)
        assert fake.n_yielded == len(AUDIO_DELTAS) - 1  # the last delta does not exist yet
        fake.open_gate()
        got += b"".join(pieces)
    assert parse_wav(got) == (SAMPLE_RATE, 1, AUDIO_PCM)


@pytest.mark.parametrize("stream", [False, True])
def test_no_audio_is_a_valid_empty_wav(client, fake, stream):
    fake.deltas = ["only text"]
    resp = client.post(SPEECH, json={**SAY, "stream": stream})
    assert resp.status_code == 200
    assert parse_wav(resp.content) == (24000, 1, b"")


SPEECH_BAD = [
    ({**SAY, "voice": "carol"}, "voice 'carol' is not one of this model's voices: alice, bob"),
    ({**SAY, "response_format": "mp3"}, "response_format: 'mp3' is not supported; use 'wav' or 'pcm'"),
    ({**SAY, "speed": 1.5}, "speed: 1.5 is not supported: only 1.0"),
    ({**SAY, "instructions": "whisper"}, "instructions: not supported"),
    ({**SAY, "stream_format": "sse"}, "stream_format: 'sse' is not supported"),
    ({**SAY, "input": ""}, "input: String should have at least 1 character"),
    ({"voice": "alice"}, "input: field required"),
    ({**SAY, "input": 5}, "input: Input should be a valid string"),
    ({**SAY, "voise": "bob"}, "unknown field 'voise' (did you mean 'voice'?)"),
    ({**SAY, "quality": "hd"}, "unknown field 'quality'"),
    ({**SAY, "stream": "yes"}, "stream"),
    ({**SAY, "temperature": 3}, "temperature"),
    ({**SAY, "repetition_penalty": 0}, "repetition_penalty: Input should be greater than 0"),
    ({**SAY, "presence_penalty": 2.5}, "presence_penalty: Input should be less than or equal to 2"),
    ({**SAY, "frequency_penalty": -3}, "frequency_penalty: Input should be greater than or equal to -2"),
    ({**SAY, "min_p": 1.5}, "min_p: Input should be less than or equal to 1"),
    ({**SAY, "repetition_penalty": "1.1"}, "repetition_penalty: Input should be a valid number"),
    ({**SAY, "repetiton_penalty": 1.1}, "did you mean 'repetition_penalty'?"),
    ({**SAY, "input": " ".join(["w"] * 65)}, "prompt is 65 tokens, context is 64"),
]


@pytest.mark.parametrize("body,needle", SPEECH_BAD)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_speech_request_is_400_and_the_server_keeps_serving(client, body, needle, stream):
    openai_error(client.post(SPEECH, json={**body, "stream": body.get("stream", stream)}), 400, needle)
    assert client.get("/health").status_code == 200
    assert parse_wav(client.post(SPEECH, json=SAY).content)[2] == AUDIO_PCM


def test_failure_before_the_first_audio_is_a_json_error_even_streaming(client, fake):
    fake.fail_at, fake.error = 0, BackendError(503, "not serving: rank 1 is not ready")
    openai_error(client.post(SPEECH, json={**SAY, "stream": True}), 503, "rank 1 is not ready")


def test_failure_mid_stream_truncates_the_transfer(live, caplog):
    fake, url = live
    fake.fail_at = 2
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream("POST", f"{url}{SPEECH}", json={**SAY, "stream": True}, timeout=10) as resp:
            assert resp.status_code == 200
            for _ in resp.iter_bytes():
                pass
    assert fake.closed.wait(5)
    assert any("failed after its audio started streaming" in r.getMessage() for r in caplog.records)
    assert httpx.get(f"{url}/health").status_code == 200


def test_closing_a_speech_stream_aborts_the_request(live):
    fake, url = live
    fake.hang_at = 1
    with httpx.stream("POST", f"{url}{SPEECH}", json={**SAY, "stream": True}, timeout=10) as resp:
        next(resp.iter_raw())
        assert fake.hanging.wait(5)
    assert fake.aborted.wait(5)


@pytest.mark.parametrize("modality,path,body", [("audio", SPEECH, SAY), ("image", IMAGES, {**DRAW, "n": 3})])
def test_giving_up_on_a_whole_response_aborts_every_request(live, modality, path, body):
    fake, url = live
    fake.__init__(output_modality=modality, hang_at=0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}{path}", json=body, timeout=0.5)
    n = body.get("n", 1)
    for _ in range(500):
        if fake.n_aborted == n:
            break
        fake.aborted.wait(0.01)
    assert fake.n_aborted == fake.n_closed == n


def test_audio_that_changes_format_is_a_500(client, fake):
    fake.deltas = [audio_delta(pcm_chunk(0), 16000), audio_delta(pcm_chunk(1), 24000)]
    openai_error(client.post(SPEECH, json=SAY), 500, "changed audio format")


@pytest.mark.parametrize("path,body,needle", [
    (SPEECH, SAY, "POST /v1/audio/speech needs a model that produces audio; 'fake-model' produces text: use "
                  "POST /v1/chat/completions"),
    (IMAGES, DRAW, "POST /v1/images/generations needs a model that produces images"),
])
def test_media_route_on_a_text_model_is_400(client, fake, path, body, needle):
    fake.__init__()
    openai_error(client.post(path, json=body), 400, needle)
    assert fake.calls == []


# ---------------------------------------------------------------------------------------------- images


def test_images_n2_gives_two_pngs_with_their_own_seeds(client, fake):
    fake.__init__(output_modality="image")
    body = {**DRAW, "n": 2, "size": "32x32", "seed": 5, "steps": 4, "guidance_scale": 1.5,
            "response_format": "b64_json", "quality": "auto", "user": "u1"}  # what asks for nothing is accepted
    resp = client.post(IMAGES, json=body, headers={"X-Request-Id": "img"})
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert isinstance(data["created"], int) and data["size"] == "32x32" and data["output_format"] == "png"
    pngs = [base64.b64decode(d["b64_json"]) for d in data["data"]]
    assert [png_size(p) for p in pngs] == [(32, 32), (32, 32)] and pngs[0] != pngs[1]
    assert sorted((p.request_id, p.seed) for p in fake.calls) == [("img-0", 5), ("img-1", 6)]
    assert all(p.model_kwargs == {"width": 32, "height": 32, "steps": 4, "guidance_scale": 1.5} for p in fake.calls)
    assert all(p.prompt == "a red square" for p in fake.calls)


def test_images_negative_prompt_reaches_the_family_as_a_knob(client, fake):
    fake.__init__(output_modality="image")
    resp = client.post(IMAGES, json={**DRAW, "negative_prompt": "blurry"})
    assert resp.status_code == 200, resp.text
    assert [p.model_kwargs for p in fake.calls] == [{"negative_prompt": "blurry"}]


def test_images_without_seed_or_size_leave_them_to_the_family(client, fake):
    fake.__init__(output_modality="image")
    data = client.post(IMAGES, json={"prompt": "x", "n": 3, "size": "auto"}).json()
    assert len(data["data"]) == 3 and "size" not in data
    assert [p.seed for p in fake.calls] == [None] * 3 and len({p.request_id for p in fake.calls}) == 3
    assert all(p.model_kwargs == {} for p in fake.calls)


def test_images_run_concurrently(live):
    fake, url = live
    fake.__init__(output_modality="image", gate_at=0)
    with httpx.Client(timeout=10) as http:
        result = {}
        thread = threading.Thread(target=lambda: result.update(resp=http.post(f"{url}{IMAGES}",
                                                                              json={**DRAW, "n": 3})))
        thread.start()
        for _ in range(500):
            if fake.n_gated == 3:
                break
            thread.join(0.01)
        assert fake.n_gated == 3  # all three requests are in the backend at once
        fake.open_gate()
        thread.join(10)
    assert len(result["resp"].json()["data"]) == 3


IMAGES_BAD = [
    ({**DRAW, "n": 0}, "n: Input should be greater than or equal to 1"),
    ({**DRAW, "n": 5}, "n: Input should be less than or equal to 4"),
    ({**DRAW, "size": "big"}, "size: 'big' is not a size: write WIDTHxHEIGHT"),
    ({**DRAW, "size": "64"}, "size: '64' is not a size"),
    ({**DRAW, "size": "100x100"}, "size '100x100' is not supported: width 100 is not supported"),
    ({**DRAW, "quality": "hd"}, "quality is not supported by this server"),
    ({**DRAW, "sizes": "64x64"}, "unknown field 'sizes' (did you mean 'size'?)"),
    ({**DRAW, "response_format": "url"}, "response_format: 'url' is not supported: only 'b64_json'"),
    ({**DRAW, "output_format": "jpeg"}, "output_format: 'jpeg' is not supported; use 'png'"),
    ({**DRAW, "stream": True}, "streaming images is not supported"),
    ({**DRAW, "prompt": ""}, "prompt"),
    ({**DRAW, "steps": 0}, "steps must be a int in [1, 50], got 0"),
    ({**DRAW, "steps": 2.5}, "steps: Input should be a valid integer"),
    ({**DRAW, "guidance_scale": 99.0}, "guidance_scale must be a float in [0, 20]"),
]


@pytest.mark.parametrize("body,needle", IMAGES_BAD)
def test_bad_image_request_is_400_and_the_server_keeps_serving(client, fake, body, needle):
    fake.__init__(output_modality="image")
    err = openai_error(client.post(IMAGES, json=body), 400, needle)
    assert fake.n_aborted == 0
    if err["param"] is not None:
        assert err["param"] in body
    assert client.get("/health").status_code == 200
    assert len(client.post(IMAGES, json=DRAW).json()["data"]) == 1


def test_a_request_without_an_image_is_a_500_naming_it(client, fake):
    fake.__init__(["just text"], output_modality="image")
    openai_error(client.post(IMAGES, json=DRAW, headers={"X-Request-Id": "r9"}), 500,
                 "request r9-0 finished (stop) without producing an image")


def test_one_failed_image_fails_the_request_and_closes_every_generator(client, fake):
    def image_or_fail(params):
        if params.request_id.endswith("-1"):
            raise BackendError(400, "image 1 cannot be drawn")
        return fake_image(params)

    fake.__init__([image_or_fail], output_modality="image")
    openai_error(client.post(IMAGES, json={**DRAW, "n": 2}), 400, "image 1 cannot be drawn")
    assert fake.n_closed == 2


# ------------------------------------------------------------------------------------ /generate media


def test_generate_stream_has_one_audio_line_per_delta(client):
    lines = ndjson(client.post("/generate", json={"prompt": "hi", "stream": True, "request_id": "g1"}).content)
    *media, final = lines
    assert [base64.b64decode(m["data"]) for m in media] == [d.data for d in AUDIO_DELTAS]
    assert all(m["modality"] == "audio" for m in media)
    assert media[0]["metadata"] == {"encoding": "base64", "sample_rate": SAMPLE_RATE, "num_channels": 1,
                                    "request_id": "g1", "n_tokens": 1}
    assert final["metadata"]["finish_reason"] == "stop" and final["metadata"]["usage"]["completion_tokens"] == 3


def test_generate_stream_image_line_is_a_png(client, fake):
    fake.__init__(output_modality="image")
    body = {"prompt": "x", "stream": True, "model_kwargs": {"width": 32, "height": 32}}
    (image, final) = ndjson(client.post("/generate", json=body).content)
    assert image["modality"] == "image" and png_size(base64.b64decode(image["data"])) == (32, 32)
    assert (image["metadata"]["width"], image["metadata"]["height"]) == (32, 32)


def test_generate_outputs_have_one_entry_per_modality(client, fake):
    fake.deltas = ["spoken: ", AUDIO_DELTAS[0], "hi", AUDIO_DELTAS[1], fake_image, fake_image]
    data = client.post("/generate", json={"prompt": "hi", "model_kwargs": {"voice": "bob"}}).json()
    assert [o["modality"] for o in data["outputs"]] == ["text", "audio", "image", "image"]
    text, audio, *images = data["outputs"]
    assert text["data"] == "spoken: hi" == data["text"] and text["metadata"]["encoding"] == "utf-8"
    assert audio["metadata"]["encoding"] == "base64" == images[0]["metadata"]["encoding"]
    assert base64.b64decode(audio["data"]) == AUDIO_DELTAS[0].data + AUDIO_DELTAS[1].data
    assert (audio["metadata"]["sample_rate"], audio["metadata"]["num_channels"]) == (SAMPLE_RATE, 1)
    assert all(png_size(base64.b64decode(i["data"])) == (64, 64) for i in images)


def test_generate_outputs_of_an_audio_model_have_no_empty_text(client):
    data = client.post("/generate", json={"prompt": "hi"}).json()
    assert [o["modality"] for o in data["outputs"]] == ["audio"] and data["text"] == ""
    assert base64.b64decode(data["outputs"][0]["data"]) == AUDIO_PCM


def test_audio_metadata_without_num_channels_is_mono_and_without_rate_is_a_500(client, fake):
    fake.deltas = [MediaDelta("audio", pcm_chunk(0), {"sample_rate": 8000.0})]
    assert parse_wav(client.post(SPEECH, json=SAY).content) == (8000, 1, pcm_chunk(0))
    fake.deltas = [MediaDelta("audio", pcm_chunk(0), {})]
    openai_error(client.post(SPEECH, json=SAY), 500, "no valid sample_rate/num_channels")
