"""Every client mistake is a 4xx that says what to fix (issue 38), on every route, over the fake backend: unknown keys
at every level named with the closest known one, features that are not implemented refused by name, invalid Unicode,
and extreme but valid numbers drawn by the engine's own sampler.

A failure here means a typo silently does nothing (``max_token`` running to the context limit), a request the
server cannot honour is answered as if it could, or a strange but legal request is a 500.
"""

from __future__ import annotations

import base64
import json

import pytest
import torch
from starlette.testclient import TestClient

from mstar_dist.server.app import build_app
from tests.fakes import FakeBackend, tiny_png

MSGS = [{"role": "user", "content": "say hi"}]
PNG_URL = "data:image/png;base64," + base64.b64encode(tiny_png(2, 2, 0)).decode()


def app_client(fake: FakeBackend) -> TestClient:
    return TestClient(build_app(fake), raise_server_exceptions=False)


def message(resp) -> tuple[str, str | None]:
    """(message, param) of either error format."""
    err = resp.json()["error"]
    return (err["message"], err["param"]) if isinstance(err, dict) else (err, None)


TEXT_UNKNOWN = [
    ("/v1/chat/completions", {"messages": MSGS, "max_token": 3}, "unknown field 'max_token' (did you mean "
                                                                  "'max_tokens'?)", "max_token"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "contnet": "y"}]},
     "unknown field 'contnet' (did you mean 'content'?)", "messages[0].contnet"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "txt": 1}]}]},
     "content[0]: unknown field 'txt' (did you mean 'text'?)", "messages[0].content"),
    ("/v1/chat/completions", {"messages": MSGS, "stream": True, "stream_options": {"include_usge": True}},
     "unknown field 'include_usge' (did you mean 'include_usage'?)", "stream_options.include_usge"),
    ("/v1/completions", {"prompt": "x", "temprature": 0}, "unknown field 'temprature' (did you mean "
                                                         "'temperature'?)", "temprature"),
    ("/generate", {"prompt": "x", "modelkwargs": {}}, "unknown field 'modelkwargs' (did you mean 'model_kwargs'?)",
     None),
    ("/generate", {"prompt": "x", "model_kwargs": {"max_token": 2}}, "unknown field 'max_token' (did you mean "
                                                                    "'max_tokens'?)", None),
    ("/generate", {"prompt": "x", "model_kwargs": {"temprature": 0}}, "did you mean 'temperature'?", None),
    ("/generate", {"prompt": "x", "model_kwargs": {"colour": "red"}}, "unknown field 'colour'", None),
    ("/generate", {"messages": [{"role": "user", "content": "x", "rol": "y"}]}, "unknown field 'rol'", None),
    ("/generate", {"prompt": "x", "model_kwargs": {"logprobs": 1}}, "logprobs is not supported by this server: use "
                                                                   "POST /v1/completions", None),
    ("/generate", {"prompt": "x", "model_kwargs": {"n": 2}}, "n is not supported", None),
    ("/tokenize", {"prompt": "x", "prompts": "y"}, "unknown field 'prompts' (did you mean 'prompt'?)", None),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, "unknown field 'skip_special_tokens'", None),
]


@pytest.mark.parametrize("path,body,needle,param", TEXT_UNKNOWN)
def test_unknown_keys_at_every_level_are_a_400_naming_them(path, body, needle, param):
    fake = FakeBackend()
    with app_client(fake) as client:
        resp = client.post(path, json=body)
        assert resp.status_code == 400, resp.text
        got, got_param = message(resp)
        assert needle in got and got_param == param, (got, got_param)
        assert fake.calls == [] and client.get("/health").status_code == 200


@pytest.mark.parametrize("path,body,needle,param", [
    ("/v1/audio/speech", {"input": "hi", "voise": "bob"}, "unknown field 'voise' (did you mean 'voice'?)", "voise"),
    ("/v1/chat/completions", {"messages": MSGS, "modalities": ["text", "audio"], "audio": {"voise": "bob"}},
     "unknown field 'voise' (did you mean 'voice'?)", "audio.voise"),
])
def test_speech_fields_misspelled_are_a_400(path, body, needle, param):
    fake = FakeBackend(output_modality="audio") if "speech" in path else \
        FakeBackend(output_modalities=("text", "audio"))
    with app_client(fake) as client:
        resp = client.post(path, json=body)
        assert resp.status_code == 400, resp.text
        assert needle in message(resp)[0] and message(resp)[1] == param


@pytest.mark.parametrize("path,body,kind,param", [
    ("/v1/audio/speech", {"input": "hi", "voice": "carol"}, "audio", "voice"),
    ("/v1/audio/speech", {"input": "hi", "voice": "carol", "stream": True}, "audio", "voice"),
    ("/v1/chat/completions", {"messages": MSGS, "modalities": ["text", "audio"], "audio": {"voice": "carol"}},
     "speaks", "audio.voice"),
    ("/v1/images/generations", {"prompt": "p", "steps": 99}, "image", "steps"),
    ("/v1/images/generations", {"prompt": "p", "size": "48x32"}, "image", "size"),
])
def test_a_knob_the_family_refuses_is_named_as_the_client_wrote_it(path, body, kind, param):
    fake = FakeBackend(output_modalities=("text", "audio")) if kind == "speaks" else FakeBackend(output_modality=kind)
    with app_client(fake) as client:
        resp = client.post(path, json=body)
        assert resp.status_code == 400 and message(resp)[1] == param, resp.text


def test_image_url_part_keys_are_checked_too():
    fake = FakeBackend(input_modalities=("text", "image"))
    part = {"type": "image_url", "image_url": {"url": PNG_URL, "detial": "low"}}
    with app_client(fake) as client:
        resp = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}]})
        assert resp.status_code == 400
        assert "content[0].image_url: unknown field 'detial' (did you mean 'detail'?)" in message(resp)[0]


def test_a_family_that_lists_no_knobs_gets_what_is_not_a_typo():
    """With no list of the family's knobs, only a key close to a sampling field is refused here; any other goes to the
    family, which names it (the fake's preprocess)."""
    fake = FakeBackend(output_modality="audio", lists_knobs=False)
    with app_client(fake) as client:
        assert client.post("/generate", json={"prompt": "x", "model_kwargs": {"voice": "bob"}}).status_code == 200
        resp = client.post("/generate", json={"prompt": "x", "model_kwargs": {"max_tokns": 3}})
        assert resp.status_code == 400 and "did you mean 'max_tokens'?" in resp.json()["error"]
        resp = client.post("/generate", json={"prompt": "x", "model_kwargs": {"colour": "red"}})
        assert resp.status_code == 400 and "unknown model_kwargs key 'colour'" in resp.json()["error"]


def test_known_model_kwargs_are_not_compared_for_typos(monkeypatch):
    """The typo hint of a family that lists no knobs (an intake's backend, the front end's) compares only keys that
    are no sampling field, each once: difflib on every key of every request was most of an intake's request cost."""
    from mstar_dist.server.protocol import native

    calls = []
    real = native.difflib.get_close_matches
    monkeypatch.setattr(native.difflib, "get_close_matches", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    native.typo_of.cache_clear()
    fake = FakeBackend(output_modality="audio", lists_knobs=False)
    with app_client(fake) as client:
        body = {"prompt": "x", "model_kwargs": {"max_tokens": 3, "temperature": 0, "ignore_eos": True}}
        for _ in range(3):
            assert client.post("/generate", json=body).status_code == 200
        assert calls == []
        for _ in range(2):
            resp = client.post("/generate", json={"prompt": "x", "model_kwargs": {"max_tokns": 3, "voice": "bob"}})
            assert resp.status_code == 400 and "did you mean 'max_tokens'?" in resp.json()["error"]
    assert calls == ["max_tokns"]


def test_the_openapi_document_lists_ignored_and_unsupported_keys():
    with app_client(FakeBackend()) as client:
        doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["user"]["description"] == "accepted and ignored" and "description" not in chat["tools"]
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(chat)  # tool calling is described, not ignored
    assert chat["logit_bias"]["enum"] == [None, {}] and "not supported" in chat["logit_bias"]["description"]
    assert {"n", "logprobs", "top_logprobs", "min_p", "ignore_eos", "response_format", "guided_regex"} <= set(chat)
    assert set(doc["paths"]) >= {"/v1/completions", "/tokenize", "/detokenize"}
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["suffix"]["enum"] == [None] and {"echo", "logprobs", "best_of", "prompt"} <= set(completion)
    assert schemas["ModelKwargs"]["additionalProperties"] is False  # the fake lists its knobs: none for text


# ---------------------------------------------------------------------------------------------- Unicode

SURROGATE = "\ud800"
ROUTES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"a{SURROGATE}b"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": MSGS, "stop": ["x", SURROGATE]}, "stop[1]"),
    ("/v1/completions", {"prompt": SURROGATE}, "prompt"),
    ("/generate", {"prompt": f"x{SURROGATE}"}, "prompt"),
    ("/generate", {"prompt": "x", "model_kwargs": {SURROGATE: 1}}, "model_kwargs.'\\ud800'"),
    ("/tokenize", {"prompt": SURROGATE}, "prompt"),
    ("/v1/audio/speech", {"input": SURROGATE}, "input"),
    ("/v1/images/generations", {"prompt": SURROGATE}, "prompt"),
]


@pytest.mark.parametrize("path,body,where", ROUTES)
def test_a_lone_surrogate_anywhere_is_a_400_naming_where(path, body, where):
    kind = {"/v1/audio/speech": "audio", "/v1/images/generations": "image"}.get(path, "text")
    fake = FakeBackend(output_modality=kind)
    with app_client(fake) as client:
        raw = json.dumps(body).encode()  # ASCII, the surrogate as its escape: valid JSON, not valid Unicode
        resp = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert resp.status_code == 400, resp.text
        got, param = message(resp)
        assert f"{where} holds a lone surrogate escape" in got, got
        assert param in (where, None) and fake.calls == []
        pair = json.dumps({**body, **{}}).replace("\\ud800", "\\ud83d\\ude80").encode()  # a whole pair is text
        assert client.post(path, content=pair, headers={"content-type": "application/json"}).status_code < 500


def test_a_lone_surrogate_in_a_multipart_request_field_is_a_400():
    fake = FakeBackend(input_modalities=("text", "image"))
    with app_client(fake) as client:
        request = json.dumps({"messages": [{"role": "user", "content": SURROGATE}]})
        resp = client.post("/generate", data={"request": request},
                           files=[("image", ("a.png", tiny_png(2, 2, 0), "image/png"))])
        assert resp.status_code == 400 and "lone surrogate" in resp.json()["error"]


@pytest.mark.parametrize("raw", [b'{"prompt": "a", "model_kwargs": {"temperature": NaN}}',
                                 b'{"prompt": "a", "model_kwargs": {"top_p": Infinity}}'])
def test_nan_and_infinity_are_not_json(raw):
    with app_client(FakeBackend()) as client:
        resp = client.post("/generate", content=raw, headers={"content-type": "application/json"})
        assert resp.status_code == 400 and "is not a JSON number" in resp.json()["error"]


# ----------------------------------------------------------------------------------- extreme numbers


LOGITS = torch.sin(torch.arange(2048, dtype=torch.float32)) * 4
"""The fixed logits :class:`SamplingFake` draws from; their argmax is what greedy sampling gives."""
GREEDY_TOKEN = int(LOGITS.argmax())


class SamplingFake(FakeBackend):
    """A fake whose every text token is also drawn by the engine's own sampler (``engine/sampling.py``) from fixed
    logits with the request's knobs and seed, as a family's decode step would: a knob value the sampler cannot take
    fails the request as it would on a rank (a 500), and ``drawn`` records what it drew."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.drawn: list[int] = []

    async def generate(self, params):
        from mstar_dist.conductor.request import request_seed, walk_seed
        from mstar_dist.engine.sampling import SamplingParams, sample, seeded

        seed = walk_seed(request_seed(params, True), 0, 0)
        knobs, gen = SamplingParams.of(params, seed), seeded(seed)
        logits = LOGITS[None]
        async for event in super().generate(params):
            if type(event).__name__ == "TextDelta":
                self.drawn.append(int(sample(logits, [knobs], [gen])[0]))
            yield event



EXTREME = [
    pytest.param({"temperature": 1, "top_p": 5e-324}, True, id="top_p-5e-324"),
    pytest.param({"temperature": 2, "top_p": 1e-300, "top_k": 3}, True, id="top_p-1e-300"),
    pytest.param({"temperature": 5e-324}, True, id="temperature-5e-324"),
    pytest.param({"temperature": 1e-40, "top_p": 0.5}, True, id="temperature-1e-40"),
    pytest.param({"temperature": 2, "top_k": 2**31 - 1, "top_p": 1}, False, id="top_k-int32-max"),
    pytest.param({"temperature": 2, "top_k": -1, "seed": -(2**63)}, False, id="seed-int64-min"),
    pytest.param({"temperature": 2, "seed": 2**63 - 1, "top_p": 1e-9}, True, id="seed-int64-max"),
]


@pytest.mark.parametrize("knobs,greedy", EXTREME)
def test_extreme_but_valid_numbers_are_served_and_tiny_ones_are_greedy(knobs, greedy):
    fake = SamplingFake()
    with app_client(fake) as client:
        for path, body in (("/v1/chat/completions", {"messages": MSGS, **knobs}),
                           ("/v1/completions", {"prompt": "x", **knobs}),
                           ("/generate", {"prompt": "x", "model_kwargs": knobs})):
            resp = client.post(path, json=body)
            assert resp.status_code == 200, (path, resp.text)
    assert len(fake.drawn) == 3 * 5
    if greedy:
        assert set(fake.drawn) == {GREEDY_TOKEN}, fake.drawn


@pytest.mark.parametrize("path,body,where", [
    ("/v1/chat/completions", {"messages": MSGS, "min_tokens": 10 ** 30}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [1, -(10 ** 20)]}, "stop_token_ids[1]"),
    ("/generate", {"prompt": "x", "model_kwargs": {"max_tokens": 2 ** 64}}, "model_kwargs.max_tokens"),
])
def test_an_integer_beyond_64_bits_is_a_400_naming_where(path, body, where):
    """Such a number has no wire form: it was a 500 from the conductor's encoder where no field bounded it."""
    fake = FakeBackend()
    with app_client(fake) as client:
        resp = client.post(path, json=body)
        assert resp.status_code == 400, resp.text
        got, param = message(resp)
        assert f"{where}:" in got and "out of range" in got and param in (where, None) and fake.calls == [], got
