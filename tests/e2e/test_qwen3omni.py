"""Qwen3-Omni through the real launcher on the CPU default (the tiny random checkpoint, written on first start):
launch/configs/qwen3omni_colocated.yaml (one rank), qwen3omni.yaml (three), qwen3omni_thinker_tp2.yaml,
qwen3omni_pd.yaml and qwen3omni_2host.yaml (two hosts on loopback).

A failure here means a placement changes the text or the speech a pinned request gets, speech does not start while
the thinker is still writing, the audio chunks do not follow the chunk policy, the official ``openai`` client cannot
send images and audio or read the spoken answer, bad media is not a clear 4xx (or hurts the server), or requests
(some abandoned) leave tensors behind on a rank.
"""

from __future__ import annotations

import base64
import io
import json
import wave

import httpx
import pytest

from scripts.omni_soak import run as soak
from tests.e2e.server import REPO, Server, per_rank, wait_for
from tests.omni_media import check_chunks, png, wav

BUDGET = {"model_kwargs": {"chunk": 25, "left_context": 25, "talker_max_new_tokens": 60},
          "limits": {"max_concurrent_requests": 16, "request_timeout_s": 300, "max_tokens": 256},
          "weights": None}
"""Every server: the family's default weights, at most 60 codec frames (4.8 s) a request."""


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


ASKS = [
    {"messages": [{"role": "user", "content": "Hello there"}], "modalities": ["text", "audio"],
     "model_kwargs": {"max_tokens": 24, "temperature": 0.8, "seed": 5, "voice": "chelsie"}},
    {"messages": [{"role": "user", "content": [image_part(png()), audio_part(wav()),
                                               {"type": "text", "text": "What is this?"}]}],
     "modalities": ["text", "audio"], "model_kwargs": {"max_tokens": 24, "temperature": 0.8, "seed": 6}},
    {"messages": [{"role": "user", "content": "Count to ten"}], "model_kwargs": {"max_tokens": 16, "seed": 7}},
]
"""Sampled text and speech (pinned seeds), with and without media; and a text-only answer."""


def streamed(base_url: str, body: dict) -> list[tuple[str, bytes]]:
    """A streamed /generate: (modality, data) per NDJSON line, in arrival order (the final line's data is empty)."""
    lines = []
    with httpx.stream("POST", f"{base_url}/generate", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            item = json.loads(line)
            assert item["modality"] != "error", item
            data = item.get("data") or ""
            utf8 = item.get("metadata", {}).get("encoding") == "utf-8"  # text as itself, media as base64
            lines.append((item["modality"], data.encode() if utf8 else base64.b64decode(data)))
    return lines


def answers(base_url: str) -> list[tuple[str, list[bytes]]]:
    """Each ask's text and audio chunks."""
    out = []
    for body in ASKS:
        lines = streamed(base_url, body)
        text = b"".join(d for m, d in lines if m == "text").decode()
        out.append((text, [d for m, d in lines if m == "audio"]))
    return out


def no_live_tensors(base_url: str, ranks: int) -> None:
    def settled() -> bool:
        live = per_rank(base_url, "mstar_dist_live_tensors")
        assert len(live) == ranks and not any(live.values()), live
        return True

    wait_for(settled, 30, "every rank's live tensors at 0", interval=0.3)


def serve(config: str, nproc: int, nodes: list[int] | None = None) -> Server:
    return Server(REPO / config, nproc, overrides=BUDGET, nodes=nodes)


@pytest.fixture(scope="module")
def colocated():
    server = serve("launch/configs/qwen3omni_colocated.yaml", 1)
    yield server
    assert server.stop_clean(1), server.log()


@pytest.fixture(scope="module")
def reference(colocated) -> list[tuple[str, list[bytes]]]:
    got = answers(colocated.base_url)
    assert got[0][1] and got[1][1] and not got[2][1] and all(text for text, _ in got), got
    return got


# ---- the same bytes on every placement -----------------------------------------------------------------------

@pytest.mark.parametrize("config, nproc, nodes", [
    ("launch/configs/qwen3omni.yaml", 3, None),
    ("launch/configs/qwen3omni_thinker_tp2.yaml", 3, None),
    ("launch/configs/qwen3omni_pd.yaml", 3, None),
    ("launch/configs/qwen3omni_2host.yaml", 0, [1, 1]),
], ids=["three_ranks", "thinker_tp2", "pd", "two_hosts"])
def test_every_placement_gives_the_colocated_text_and_audio_byte_for_byte(reference, config, nproc, nodes):
    server = serve(config, nproc, nodes)
    try:
        assert answers(server.base_url) == reference
        ranks = sum(nodes or [nproc])
        if config.endswith("qwen3omni.yaml"):
            speech_starts_early_and_follows_the_chunk_policy(server.base_url)
        no_live_tensors(server.base_url, ranks)
    finally:
        assert server.stop_clean(sum(nodes or [nproc])), server.log()


def speech_starts_early_and_follows_the_chunk_policy(base_url: str) -> None:
    """The first audio chunk reaches the client while the thinker still writes (long before its last token); every
    chunk is 25 frames but the last (1..25), and one request's frames add up to its budget or to where it ended."""
    body = {"messages": [{"role": "user", "content": "Tell me a long story"}], "modalities": ["text", "audio"],
            "model_kwargs": {"max_tokens": 250, "temperature": 0, "seed": 3, "talker_max_new_tokens": 60}}
    lines = streamed(base_url, body)
    kinds = [m for m, _ in lines]
    text = [i for i, (m, d) in enumerate(lines) if m == "text" and d]  # the final line (usage) has no data
    assert kinds.index("audio") < text[-1], kinds  # (text deltas that wait are joined: lines are not tokens)
    assert len(b"".join(d for m, d in lines if m == "text")) > 250  # the thinker ran its whole budget
    frames = check_chunks([len(d) for m, d in lines if m == "audio"])
    assert frames == 60, frames  # this seed's talker runs to its budget


# ---- the official openai client ----------------------------------------------------------------------------------

def test_the_openai_client_sends_an_image_and_a_clip_and_hears_the_answer(colocated, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{colocated.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    content = [{"type": "text", "text": "What do you see and hear?"}, image_part(png()), audio_part(wav())]
    messages = [{"role": "user", "content": content}]
    resp = client.chat.completions.create(model="qwen3_omni", messages=messages, max_tokens=12, seed=1)
    assert resp.choices[0].message.content and resp.usage.prompt_tokens > 30  # with the image and audio tokens
    resp = client.chat.completions.create(model="qwen3_omni", messages=messages, max_tokens=12, seed=1,
                                          modalities=["text", "audio"], audio={"voice": "aiden", "format": "wav"})
    spoken = resp.choices[0].message.audio
    with wave.open(io.BytesIO(base64.b64decode(spoken.data))) as w:  # the stdlib reads the WAV
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2) and w.getnframes() > 0
    assert spoken.transcript == resp.choices[0].message.content
    stream = client.chat.completions.create(model="qwen3_omni", messages=messages, max_tokens=12, seed=1,
                                            modalities=["text", "audio"], audio={"voice": "aiden", "format": "pcm16"},
                                            stream=True)
    chunks = [c for c in stream if c.choices]
    audio = [base64.b64decode(c.choices[0].delta.audio.data) for c in chunks
             if c.choices[0].delta.audio and c.choices[0].delta.audio.data]
    assert audio and b"".join(audio) == base64.b64decode(spoken.data)[44:]  # the same speech, PCM16 after the header
    check_chunks([len(a) for a in audio])


def test_speech_route_speaks_the_answer_to_its_input(colocated):
    """``/v1/audio/speech``: the input is the user's message; the answer comes back as a WAV."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{colocated.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    spoken = client.audio.speech.create(model="qwen3_omni", voice="chelsie", input="Hello there",
                                        response_format="wav")
    with wave.open(io.BytesIO(spoken.content)) as w:
        assert (w.getframerate(), w.getnchannels()) == (24000, 1) and w.getnframes() > 0


def test_an_unknown_voice_is_a_400_listing_the_checkpoints_voices(colocated):
    r = httpx.post(f"{colocated.base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"],
        "audio": {"voice": "nobody", "format": "wav"}})
    assert r.status_code == 400 and "aiden" in r.text and "chelsie" in r.text and "ethan" in r.text, r.text


# ---- bad media ---------------------------------------------------------------------------------------------------

def ten_minutes_of_audio() -> bytes:
    return wav(600.0, rate=4000, subtype="PCM_U8")  # 2.4 MB: within the body and item limits, not in seconds


BAD = {
    "not an image": (lambda: [image_part(b"plain text, not a picture")], "not PNG, JPEG or WebP"),
    "truncated png": (lambda: [image_part(png()[:300])], "truncated"),
    "fifty megabytes": (lambda: [image_part(b"\x89PNG\r\n\x1a\n" + bytes(50 << 20))], "bytes"),
    "ten minutes of audio": (lambda: [audio_part(ten_minutes_of_audio())], "media.max_audio_seconds = 300"),
    "twenty images": (lambda: [image_part(png(seed=i)) for i in range(20)], "max_items"),
    "an http url": (lambda: [{"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}],
                    "allowed"),
    "a wrong format": (lambda: [audio_part(wav(), fmt="mp3")], "format"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_media_is_a_4xx_naming_what_to_fix_and_the_server_stays_healthy(colocated, case):
    parts, words = BAD[case]
    r = httpx.post(f"{colocated.base_url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts()]}],
        "max_tokens": 4})
    assert 400 <= r.status_code < 500 and words in r.text, (r.status_code, r.text[:400])
    assert httpx.get(f"{colocated.base_url}/health", timeout=10).status_code == 200


# ---- the leak canary -------------------------------------------------------------------------------------------

def test_sixty_mixed_requests_with_a_fifth_abandoned_leave_no_live_tensor(colocated):
    """scripts/omni_soak.py's plan at a small scale (the script runs 200)."""
    result = soak(colocated.base_url, 60, concurrency=6, abandon_every=5)
    assert result["outcomes"] == {"done": 48, "abandoned": 12}, result
    assert result["live_tensors"] == {"0": 0}, result
    assert httpx.get(f"{colocated.base_url}/health", timeout=10).status_code == 200
