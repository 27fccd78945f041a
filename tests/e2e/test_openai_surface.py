"""End to end: the OpenAI surface beyond chat on SmolLM2-135M-Instruct served by the real launcher (one rank), once
with the HTTP server in the front end and once behind two intake processes: legacy completions on raw prompts and on
token ids, ``/tokenize`` and ``/detokenize`` through the model's own tokenizer, running usage counted up front, and
client mistakes answered with a 4xx.

A failure here means ``vllm bench serve`` or lm-eval's ``local-completions`` cannot use the server, token ids do not
reach the model as ids (the same prompt as text and as ids answers differently), the server's prompt count differs
from the model's, or a mistake takes a real deployment down.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.server import REPO, Server

SINGLE = REPO / "launch/configs/smollm2_single.yaml"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module", params=[1, 2], ids=["front-end", "intakes"])
def served(request):
    overrides = {"server": {"host": "127.0.0.1", "port": 8000, "http_processes": request.param}}
    server = Server(SINGLE, nproc=1, overrides=overrides)
    yield server
    assert server.stop_clean(1), server.log()


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def test_completions_on_text_and_on_its_token_ids_answer_alike(served):
    from openai import OpenAI

    client = OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", timeout=120)
    text = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=0)
    assert "Paris" in text.choices[0].text and text.usage.completion_tokens == 8
    ids = post(served, "/tokenize", {"prompt": PROMPT}).json()
    assert ids["count"] == len(ids["tokens"]) == text.usage.prompt_tokens and ids["max_model_len"] > 0
    assert post(served, "/detokenize", {"tokens": ids["tokens"]}).json() == {"prompt": PROMPT}
    by_ids = client.completions.create(model="smollm2", prompt=ids["tokens"], max_tokens=8, temperature=0,
                                       echo=True)
    assert by_ids.choices[0].text == PROMPT + text.choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8,
                                                                    temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == text.choices[0].text


def test_chat_tokenize_counts_what_chat_completions_count(served):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    counted = post(served, "/tokenize", {"messages": messages}).json()["count"]
    body = {"model": "smollm2", "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{served.base_url}/v1/chat/completions", json=body, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all(e["usage"]["prompt_tokens"] == counted for e in events)  # from the first chunk on
    assert events[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/completions", {"prompt": PROMPT, "suffix": "."}, 400, "suffix is not supported"),
    ("/v1/completions", {"prompt": [[1, 2], [10**9]]}, 400, "is not a token id of this model"),
    ("/v1/completions", {"prompt": PROMPT, "max_token": 3}, 400, "did you mean 'max_tokens'?"),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404,
     "does not exist"),
    ("/generate", {"prompt": "x", "model_kwargs": {"max_token": 2}}, 400, "did you mean 'max_tokens'?"),
    ("/detokenize", {"tokens": [10**9]}, 400, "is not a token id of this model"),
])
def test_mistakes_are_4xx_and_the_server_keeps_serving(served, path, body, status, needle):
    r = post(served, path, body)
    assert r.status_code == status and needle in r.text, r.text
    assert httpx.get(f"{served.base_url}/health", timeout=10).status_code == 200


def test_a_lone_surrogate_is_a_400(served):
    raw = json.dumps({"messages": [{"role": "user", "content": "\ud800"}]}).encode()
    r = httpx.post(f"{served.base_url}/v1/chat/completions", content=raw, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "lone surrogate" in r.text, r.text
