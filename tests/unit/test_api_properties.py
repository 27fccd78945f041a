"""Generated requests against every route of the app over the fake backend, in process (no sockets): schemathesis
draws bodies, headers and parameters from the app's own OpenAPI document (valid ones and broken ones), and
hypothesis draws arbitrary JSON, and JSON holding lone surrogate escapes, for every POST route. Every answer must be a
2xx or a 4xx, never a 5xx; the served model changes what the routes accept (text with and without a tokenizer or a
list of knobs, speech, images, a model reading images and audio and speaking), so each is tried.

A failure names the request that got a 5xx: some input reaches a path the checks do not cover.
"""

from __future__ import annotations

import collections
import json

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.generation import GenerationMode
from starlette.testclient import TestClient

from mstar_dist.server.app import build_app
from tests.fakes import FakeBackend

CASES = {"text": 200, "text-bare": 100, "speech": 80, "image": 80, "omni": 120, "json": 150}
"""Requests drawn per served model (most for the text model, whose routes have the most fields), and arbitrary JSON
bodies per model."""
BACKENDS = {
    "text": dict(),
    "text-bare": dict(tokenizer=False, lists_knobs=False),
    "speech": dict(output_modality="audio"),
    "image": dict(output_modality="image"),
    "omni": dict(input_modalities=("text", "image", "audio"), output_modalities=("text", "audio")),
}
POST_ROUTES = ("/generate", "/v1/chat/completions", "/v1/completions", "/v1/audio/speech", "/v1/images/generations",
               "/tokenize", "/detokenize")
SETTINGS = settings(max_examples=CASES["text"], deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("kind", sorted(BACKENDS))
def test_requests_drawn_from_the_openapi_document_never_get_a_5xx(kind):
    app = build_app(FakeBackend(**BACKENDS[kind]))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    # every route drawn from alike: each operation gets its share of the cases
    operations = [result.ok() for result in schema.get_all_operations()]
    seen: collections.Counter[tuple[str, int]] = collections.Counter()
    failures: list[str] = []

    def run_operation(op) -> None:
        @settings(SETTINGS, max_examples=max(8, CASES[kind] // len(operations)))
        @given(case=st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE)))
        def run(case):
            response = case.call()
            seen[(f"{case.method} {case.path}", response.status_code)] += 1
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.path} -> {response.status_code}: {response.text[:300]}\n"
                                f"  body: {str(case.body)[:300]}")

        run()

    for op in operations:
        run_operation(op)
    assert not failures, "\n".join(failures[:5])
    routes = {route for route, _ in seen}
    assert len(routes) == 10, sorted(routes)  # every route of the document was tried
    assert any(code < 300 for (route, code) in seen if route.startswith("POST")), seen


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4), max_leaves=12)
"""Arbitrary JSON values (numbers beyond every range, strings where objects go, ...)."""


def _keys(route: str) -> list[str]:
    """The keys the route's body knows, so that drawn objects often reach past the first check."""
    return {"/generate": ["prompt", "messages", "model_kwargs", "stream", "modalities", "request_id"],
            "/v1/chat/completions": ["messages", "n", "logprobs", "stream", "stream_options", "response_format",
                                     "max_tokens", "temperature", "top_p", "guided_json", "modalities", "audio"],
            "/v1/completions": ["prompt", "n", "best_of", "echo", "logprobs", "stream", "suffix", "max_tokens"],
            "/v1/audio/speech": ["input", "voice", "response_format", "stream", "speed"],
            "/v1/images/generations": ["prompt", "n", "size", "steps", "guidance_scale", "seed", "negative_prompt"],
            "/tokenize": ["prompt", "messages"], "/detokenize": ["tokens"]}[route]


@st.composite
def bodies(draw, route: str):
    keys = _keys(route)
    return draw(st.dictionaries(st.sampled_from(keys) | st.text(max_size=6), JSON, max_size=5))


@pytest.mark.parametrize("kind", ["text", "omni"])
def test_arbitrary_json_bodies_and_lone_surrogates_never_get_a_5xx(kind):
    with TestClient(build_app(FakeBackend(**BACKENDS[kind])), raise_server_exceptions=False) as client:
        failures: list[str] = []

        @settings(SETTINGS, max_examples=CASES["json"])
        @given(route=st.sampled_from(POST_ROUTES), data=st.data(),
               text=st.text(st.characters(codec="utf-16", categories=["Cs", "Ll"]), min_size=1, max_size=4))
        def run(route, data, text):
            body = data.draw(bodies(route))
            for raw in (json.dumps(body), json.dumps({**body, _keys(route)[0]: text})):  # surrogates as escapes
                resp = client.post(route, content=raw.encode(), headers={"content-type": "application/json"})
                if resp.status_code >= 500:
                    failures.append(f"{route} -> {resp.status_code}: {resp.text[:300]}\n  body: {raw[:300]}")

        run()
        assert not failures, "\n".join(failures[:5])
