"""End to end: the OpenAI surface beyond chat on SmolLM2-135M-Instruct served by the real launcher (one rank), once
with the HTTP server in the front end and once behind two intake processes: legacy completions on raw prompts and on
token ids, ``/tokenize`` and ``/detokenize`` through the model's own tokenizer, running usage counted up front, and
client mistakes answered with a 4xx, and a short guidellm benchmark (the load client people point at a vLLM
server) with every request served at exactly the length asked.

A failure here means ``vllm bench serve`` or lm-eval's ``local-completions`` cannot use the server, token ids do not
reach the model as ids (the same prompt as text and as ids answers differently), the server's prompt count differs
from the model's, a mistake takes a real deployment down, or guidellm (hence aiperf and ``vllm bench serve``, which
send the same parameters) cannot hold the server's output lengths fixed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.e2e.server import REPO, WEIGHTS, Server

SINGLE = REPO / "launch/configs/smollm2_single.yaml"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module", params=[1, 2], ids=["front-end", "intakes"])
def served(request):
    overrides = {"server": {"host": "127.0.0.1", "port": 8000, "http_processes": request.param}}
    server = Server(SINGLE, nproc=1, overrides=overrides)
    server.http_processes = request.param
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


def test_a_short_guidellm_benchmark_runs_clean_with_the_lengths_asked(served, tmp_path):
    """guidellm, as its users run it (openai_http backend, synthetic prompts, streaming chat, a fixed output length
    held by vLLM's ignore_eos and continuous usage): every request succeeds with exactly the tokens asked."""
    pytest.importorskip("guidellm")
    if served.http_processes != 1:
        pytest.skip("one HTTP process is enough for the client's view (the intakes' answers are the same bytes)")
    out = tmp_path / "guidellm.json"
    cmd = [sys.executable, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={served.base_url},model=smollm2",
           "--profile", "kind=concurrent,streams=2", "--constraint", "kind=max_requests,count=4",
           "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=12",
           "--tokenizer", f"kind=huggingface_auto,model={WEIGHTS}", "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (bench,) = json.loads(out.read_text())["benchmarks"]
    requests = bench["requests"]
    assert (len(requests["successful"]), requests["errored"], requests["incomplete"]) == (4, [], []), requests
    assert [r["output_tokens"] for r in requests["successful"]] == [12] * 4


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "size": {"enum": ["small", "large"]}},
          "required": ["city", "size"], "additionalProperties": False}


def test_json_schema_answers_validate_for_twenty_seeds(served):
    """The openai client's ``response_format: json_schema``, sampled (temperature 1) under 20 seeds: every answer is
    an object of exactly the schema's keys and types, however the tiny model would have rambled unconstrained."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    if served.http_processes != 1:
        pytest.skip("the constraint runs in the engine: one HTTP process shows it")
    client = OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", timeout=300)
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}

    def ask(seed: int):
        return client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Name a city and its size as JSON."}],
            response_format=fmt, temperature=1.0, seed=seed, max_tokens=40).choices[0]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(20)))
    for choice in answers:
        assert choice.finish_reason == "stop", choice
        value = json.loads(choice.message.content)
        assert set(value) == {"city", "size"} and value["size"] in ("small", "large"), value
        assert isinstance(value["city"], str) and len(value["city"]) <= 10, value


def test_logprobs_are_the_models_log_softmax_and_n_gives_two_choices(served):
    """Greedy chat with ``logprobs``: each token's value is transformers' log-softmax of the same weights at that
    position (to fp32 rounding), the top alternatives are sorted and the chosen token is the first; ``n=2`` sampled
    gives two choices, indexes 0 and 1."""
    import torch
    from openai import OpenAI
    from transformers import AutoModelForCausalLM

    if served.http_processes != 1:
        pytest.skip("the values come from the rank: one HTTP process shows them")
    client = OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", timeout=120)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 4
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(tops[0], abs=1e-6)
    prompt = post(served, "/tokenize", {"messages": messages}).json()["tokens"]
    model = AutoModelForCausalLM.from_pretrained(WEIGHTS, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        for entry in content:
            logprobs = torch.log_softmax(model(ids).logits[0, -1].float(), dim=-1)
            best = int(logprobs.argmax())
            assert entry.logprob == pytest.approx(float(logprobs[best]), abs=2e-3), (entry, best)
            ids = torch.cat([ids, torch.tensor([[best]])], dim=1)
    two = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4, n=2, seed=3,
                                         temperature=1.0)
    assert sorted(c.index for c in two.choices) == [0, 1] and 2 <= two.usage.completion_tokens <= 8
