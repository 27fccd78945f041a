"""Streaming speech (Orpheus shape, tiny random weights prepared on first start) through the real launcher:
launch/configs/speech_split.yaml (LLM on rank 0, codec on rank 1) and, for the comparison, speech_single.yaml
served through 2 HTTP intake processes (server.http_processes).

A failure here means the speech route or SDK breaks the WAV, audio does not start while the LLM is still writing
codes, splitting the codec onto another rank (or parsing HTTP in intake processes) changes the audio, bad input is not a clear 4xx, or abandoned speech
requests leave tensors behind on some rank.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import json
import random
import wave

import httpx
import pytest

from mstar_dist.client import MStarClient
from tests.e2e.server import REPO, Server, per_rank, wait_for

# the default path (prepared by the family itself); a random tiny model rarely says end_of_speech, so the
# service's max_tokens bounds every request: 140 codes = 20 frames = 1.7 s of audio
WEIGHTS = {"weights": "~/.cache/mstar_dist/orpheus-tiny",
           "limits": {"max_concurrent_requests": 32, "request_timeout_s": 120, "max_tokens": 140}}
FRAME = 2048


@pytest.fixture(scope="module")
def split():
    server = Server(REPO / "launch/configs/speech_split.yaml", nproc=2, overrides=WEIGHTS)
    yield server
    assert server.stop_clean(2), server.log()


def speak(base_url: str, text: str, seed: int, **extra) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/audio/speech", timeout=120, json={
        "model": "orpheus", "input": text, "voice": "leo", "seed": seed, "temperature": 0.8, **extra})


def test_wav_parses_and_holds_whole_frames(split):
    r = speak(split.base_url, "Hello there, how are you?", seed=1)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("audio/wav")
    with wave.open(io.BytesIO(r.content)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() > 0 and w.getnframes() % FRAME == 0
    client = MStarClient(split.base_url)
    assert client.speech("Hello there, how are you?", "leo", seed=1, temperature=0.8) == r.content


def test_audio_streams_window_by_window(split):
    """The first audio line is the first window (4 frames) and one frame follows per line; the in-process test
    (tests/unit/test_composite_families.py) shows the first window leaves before the LLM's last code, which a
    loaded 2-core machine cannot time reliably here."""
    body = {"prompt": "A sentence long enough to speak for a while.", "stream": True,
            "model_kwargs": {"voice": "tara", "max_tokens": 120, "seed": 5, "temperature": 0.8}}
    sizes = []
    with httpx.stream("POST", f"{split.base_url}/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            item = json.loads(line) if line.strip() else None
            if item and item["modality"] == "audio":
                sizes.append(len(base64.b64decode(item["data"])) // 2)
    assert sizes[0] == 4 * FRAME and len(sizes) > 1, sizes
    assert sum(sizes) % FRAME == 0


def test_split_codec_gives_the_same_audio_as_one_rank(split):
    texts = [("One.", 3), ("Two sentences here. And another one.", 4)]
    on_split = [speak(split.base_url, t, s).content for t, s in texts]
    # the one-rank server parses HTTP in 2 intake processes: the WAV bytes cross to them as Outputs too
    single = Server(REPO / "launch/configs/speech_single.yaml", nproc=1,
                    overrides={**WEIGHTS, "server": {"http_processes": 2}})
    try:
        on_single = [speak(single.base_url, t, s).content for t, s in texts]
        # the intakes were told too
        assert httpx.get(f"{single.base_url}/v1/models", timeout=10).json()["data"][0]["weights"] == "random-test"
    finally:
        assert single.stop_clean(1), single.log()
    assert on_split == on_single and all(len(a) > 44 for a in on_split)


def test_random_weights_are_announced(split):
    """The default checkpoint is random (scripts/make_speech_checkpoint.py marks it): /v1/models says so and the log
    says once, at start, that the audio is noise by design."""
    (card,) = httpx.get(f"{split.base_url}/v1/models", timeout=10).json()["data"]
    assert card["weights"] == "random-test"
    assert split.log().count("noise by design") == 1


def test_openai_client_sends_the_penalties_and_min_p_as_extra_body(split):
    """The sampling knobs beyond OpenAI's speech fields travel as top-level keys (the openai client's
    ``extra_body``) and change the codes the model writes; the same knobs give the same audio."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{split.base_url}/v1", api_key="unused", timeout=120)
    knobs = {"seed": 6, "repetition_penalty": 1.8, "presence_penalty": 1.0, "frequency_penalty": 0.5, "min_p": 0.02}

    def say(extra: dict) -> bytes:
        return client.audio.speech.create(model="orpheus", input="Penalties change the codes.", voice="tara",
                                          extra_body=extra).content

    penalized = say(knobs)
    assert penalized == say(knobs) and penalized != say({"seed": 6})
    assert penalized[:4] == b"RIFF"


@pytest.mark.parametrize("body, words", [
    ({"voice": "nobody"}, "tara"), ({"speed": 2.0}, "speed"), ({"response_format": "mp3"}, "wav"),
    ({"input": ""}, "input"),
])
def test_bad_speech_requests_are_4xx_and_the_server_stays_healthy(split, body, words):
    r = httpx.post(f"{split.base_url}/v1/audio/speech", timeout=60,
                   json={"model": "orpheus", "input": "Hi.", "voice": "tara", **body})
    assert 400 <= r.status_code < 500 and words in r.text, r.text
    assert httpx.get(f"{split.base_url}/health", timeout=10).status_code == 200


def one(base_url: str, i: int, abandon: bool) -> str:
    if i % 3 == 0:  # whole WAV files between the streams
        return "done" if speak(base_url, f"Number {i}.", i, stream=False).status_code == 200 else "error"
    body = {"model": "orpheus", "input": f"Streaming number {i}, a little longer.", "voice": "zac", "seed": i,
            "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/audio/speech", json=body, timeout=120) as r:
        if r.status_code != 200:
            return f"http {r.status_code}"
        for n, _ in enumerate(r.iter_bytes()):
            if abandon and n >= 1:
                return "abandoned"
    return "done"


def test_two_hundred_speech_requests_with_some_abandoned_leave_nothing_behind(split):
    rng = random.Random(1)
    plan = [(i, i % 3 != 0 and rng.random() < 0.25) for i in range(200)]
    with cf.ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(lambda p: one(split.base_url, *p), plan))
    kept = [o for o, (_, abandon) in zip(outcomes, plan) if not abandon]
    dropped = [o for o, (_, abandon) in zip(outcomes, plan) if abandon]
    assert kept == ["done"] * len(kept), outcomes
    # a request to abandon that says end_of_speech within its first chunk completes before it can be abandoned
    assert set(dropped) <= {"abandoned", "done"} and dropped.count("abandoned") >= len(dropped) - 3, dropped
    def settled() -> bool:  # aborts and gauges settle within a few heartbeats
        live = per_rank(split.base_url, "mstar_dist_live_tensors")
        assert len(live) == 2 and not any(live.values()), live
        return True

    wait_for(settled, 20, "both ranks' live tensors at 0", interval=0.25)
    assert httpx.get(f"{split.base_url}/health", timeout=10).status_code == 200
