"""``POST /v1/completions`` (OpenAI's legacy completions, as vLLM serves them) and ``/tokenize`` / ``/detokenize``
over the fake backend, every response parsed by the ``openai`` package's own types.

A failure here means a client of the legacy route (``vllm bench serve``, lm-eval-harness's ``local-completions``)
gets a 404 or a shape its library cannot read, choices out of order, a prompt run through the chat template, token
ids that never reach the model as ids, logprobs or an echo in the wrong place, or usage that does not add up.
"""

from __future__ import annotations

import json

import pytest
from openai import OpenAI
from openai.types import Completion
from starlette.testclient import TestClient

from mstar_dist.server.app import build_app
from tests.fakes import UNICODE_DELTAS, UNICODE_TEXT, FakeBackend, FakeTokenizer, choice_text

COMPLETIONS = "/v1/completions"


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def client(fake: FakeBackend):
    with TestClient(build_app(fake), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def oai(client) -> OpenAI:
    """The openai package, talking to the app in process."""
    return OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)


def sse_chunks(body: str) -> list[dict]:
    events = [e[len("data: "):] for e in body.split("\n\n") if e]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def test_a_string_prompt_runs_as_written_with_the_openai_defaults(oai, fake):
    out = oai.completions.create(model="fake-model", prompt="The capital of France is")
    assert isinstance(out, Completion) and out.object == "text_completion" and out.id.startswith("cmpl-")
    (choice,) = out.choices
    assert (choice.index, choice.text, choice.finish_reason, choice.logprobs) == (0, UNICODE_TEXT, "stop", None)
    (params,) = fake.calls
    assert params.prompt == "The capital of France is" and params.messages is None  # no chat template
    assert params.prompt_ids is None and params.max_tokens == 16  # OpenAI's default max_tokens
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 5 and out.usage.total_tokens == 10


def test_the_default_max_tokens_is_the_servers_limit_when_that_is_lower(client, fake):
    fake.max_tokens_limit = 8
    assert client.post(COMPLETIONS, json={"prompt": "x"}).status_code == 200
    assert (fake.calls[0].max_tokens, fake.calls[0].max_tokens_given) == (8, False)


def test_a_list_of_prompts_gives_n_choices_each_in_index_order(oai, fake):
    out = oai.completions.create(model="fake-model", prompt=["one", "two words", "three more words"], n=2,
                                 max_tokens=3, seed=7, extra_headers={"X-Request-Id": "batch"})
    assert [c.index for c in out.choices] == list(range(6))
    texts = ["".join(choice_text(d, j) for d in UNICODE_DELTAS[:3]) for j in range(2)]
    assert [c.text for c in out.choices] == texts * 3
    assert [c.finish_reason for c in out.choices] == ["length"] * 6
    calls = sorted(fake.calls, key=lambda p: p.request_id)
    assert [(p.request_id, p.prompt, p.n, p.seed, p.max_tokens) for p in calls] == [
        ("batch-0", "one", 2, 7, 3), ("batch-1", "two words", 2, 7, 3), ("batch-2", "three more words", 2, 7, 3)]
    assert out.usage.prompt_tokens == 1 + 2 + 3 and out.usage.completion_tokens == 3 * 2 * 3


@pytest.mark.parametrize("prompt,expected", [([104, 105], [[104, 105]]), ([[104, 105], [0x6771, 33]],
                                                                          [[104, 105], [0x6771, 33]])])
def test_token_id_prompts_reach_the_family_as_ids(oai, fake, prompt, expected):
    out = oai.completions.create(model="fake-model", prompt=prompt, max_tokens=2, echo=True)
    calls = sorted(fake.calls, key=lambda p: p.request_id)
    assert [p.prompt_ids for p in calls] == expected
    texts = [FakeTokenizer().decode(ids) for ids in expected]
    assert [p.prompt for p in calls] == texts  # their text too, which echo repeats
    assert [c.text for c in out.choices] == [t + "".join(UNICODE_DELTAS[:2]) for t in texts]
    assert out.usage.prompt_tokens == sum(len(ids) for ids in expected)


def test_token_ids_outside_the_vocabulary_are_a_400_naming_the_place(client, fake):
    resp = client.post(COMPLETIONS, json={"prompt": [[1, 2], [3, 0xD800]]})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert "prompt[1][1] = 55296 is not a token id of this model (its vocabulary has 55296 tokens)" in err["message"]
    assert err["param"] == "prompt[1]" and fake.calls == []


def test_a_model_without_a_tokenizer_takes_text_prompts_only(fake):
    fake.__init__(tokenizer=False)
    with TestClient(build_app(fake)) as client:
        assert client.post(COMPLETIONS, json={"prompt": "hi"}).status_code == 200
        resp = client.post(COMPLETIONS, json={"prompt": [1, 2]})
        assert resp.status_code == 400 and "a prompt of token ids needs the model's tokenizer" in resp.text
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
            resp = client.post(path, json=body)
            assert resp.status_code == 400 and f"{path} needs the model's tokenizer" in resp.json()["error"]


def test_echo_and_logprobs_give_the_prompt_then_the_answer_with_offsets(oai, fake):
    out = oai.completions.create(model="fake-model", prompt="ab", max_tokens=2, echo=True, logprobs=2)
    (choice,) = out.choices
    assert choice.text == "ab" + "".join(UNICODE_DELTAS[:2])
    lp = choice.logprobs
    assert lp.tokens == ["a", "b", "h", "l"]  # the prompt's tokens, then the answer's (the fake's: first characters)
    assert lp.token_logprobs == [None, -0.5, -0.125, -0.25]
    assert lp.top_logprobs[0] is None and lp.top_logprobs[1] == {"b": -0.5}
    assert lp.top_logprobs[2] == {"h": -0.125, "a": -1.125} and lp.top_logprobs[3] == {"l": -0.25, "a": -1.25}
    assert lp.text_offset == [0, 1, 2, 3]
    (params,) = fake.calls
    assert (params.logprobs, params.prompt_logprobs, params.prompt_ids) == (2, 2, [97, 98])


def test_logprobs_zero_keeps_the_chosen_token_in_top_logprobs(oai):
    out = oai.completions.create(model="fake-model", prompt="x", max_tokens=1, logprobs=0)
    assert out.choices[0].logprobs.tokens == ["h"] and out.choices[0].logprobs.top_logprobs == [{"h": -0.125}]


def test_streamed_completions_interleave_choices_and_end_with_usage_and_done(client, oai, fake):
    stream = oai.completions.create(model="fake-model", prompt=["a", "b"], n=2, max_tokens=2, stream=True,
                                    stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "text_completion" for c in chunks)
    *pieces, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 8 and last.usage.prompt_tokens == 2
    texts: dict[int, str] = {}
    finishes = {}
    for chunk in pieces:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        if choice.finish_reason is not None:
            finishes[choice.index] = choice.finish_reason
        assert chunk.usage is None
    want = ["".join(choice_text(d, j) for d in UNICODE_DELTAS[:2]) for j in range(2)] * 2
    assert [texts[i] for i in range(4)] == want and finishes == {i: "length" for i in range(4)}
    raw = client.post(COMPLETIONS, json={"prompt": "a", "max_tokens": 2, "stream": True}).text
    assert raw.endswith("data: [DONE]\n\n") and all("usage" not in c for c in sse_chunks(raw))


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, fake):
    body = {"prompt": "abc", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse_chunks(client.post(COMPLETIONS, json=body).text)
    usages = [c["usage"] for c in chunks]
    assert all(u is not None and u["prompt_tokens"] == 3 for u in usages)  # counted up front: its ids are known
    assert [u["completion_tokens"] for u in usages] == [1, 2, 3, 3, 3]
    assert fake.calls[0].prompt_ids == [97, 98, 99]


def test_echo_streams_the_prompt_with_the_first_piece(client):
    chunks = sse_chunks(client.post(COMPLETIONS, json={"prompt": "Q: ", "max_tokens": 1, "echo": True,
                                                       "stream": True}).text)
    assert chunks[0]["choices"][0]["text"] == "Q: " + UNICODE_DELTAS[0]


def test_stop_seed_and_sampling_fields_reach_the_backend(client, fake):
    fake.deltas = ["Hello ", "wor", "ld ST", "OP and more"]
    body = {"prompt": "p", "max_tokens": 8, "stop": "STOP", "seed": 11, "temperature": 0.5, "top_p": 0.9,
            "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "ignore_eos": True, "min_tokens": 2, "stop_token_ids": [7], "include_stop_str_in_output": True,
            "skip_special_tokens": False, "spaces_between_special_tokens": False, "best_of": 1, "user": "u"}
    data = client.post(COMPLETIONS, json=body).json()
    assert data["choices"][0]["text"] == "Hello world " and data["choices"][0]["finish_reason"] == "stop"
    (p,) = fake.calls
    assert (p.stop, p.seed, p.temperature, p.top_p, p.top_k, p.min_p) == (["STOP"], 11, 0.5, 0.9, 5, 0.1)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.2, 0.5, -0.5)
    assert (p.ignore_eos, p.min_tokens, p.stop_token_ids, p.include_stop_str_in_output) == (True, 2, [7], True)
    assert (p.skip_special_tokens, p.spaces_between_special_tokens, p.n, p.guided) == (False, False, 1, None)


@pytest.mark.parametrize("body,needle,param", [
    ({"prompt": "a", "suffix": "b"}, "suffix is not supported", "suffix"),
    ({"prompt": "a", "n": 2, "best_of": 3}, "best_of is 3 and n is 2: best_of must equal n", "best_of"),
    ({"prompt": ""}, "prompt: the prompt is empty", "prompt"),
    ({"prompt": []}, "not an empty list", "prompt"),
    ({"prompt": ["a", 1]}, "one kind throughout", "prompt"),
    ({"prompt": [[1], []]}, "[1] must be a non-empty list of token ids", "prompt"),
    ({"prompt": [-1]}, "[0] = -1 is not a token id", "prompt"),
    ({"prompt": "a", "logprobs": 21}, "logprobs: Input should be less than or equal to 20", "logprobs"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens: Input should be greater than 0", "max_tokens"),
    ({"prompt": "a", "max_tokens": 33}, "max_tokens is 33, above this server's limit of 32", "max_tokens"),
    ({"prompt": "a", "echo": "yes"}, "echo: Input should be a valid boolean", "echo"),
    ({"prompt": "a", "max_token": 3}, "unknown field 'max_token' (did you mean 'max_tokens'?)", "max_token"),
    ({"prompt": "a", "logit_bias": {"1": 5}}, "logit_bias is not supported", "logit_bias"),
    ({"prompt": "a", "use_beam_search": True}, "use_beam_search is not supported", "use_beam_search"),
    ({"prompt": "a", "prompt_logprobs": 1}, "use echo with logprobs", "prompt_logprobs"),
    ({"prompt": " ".join(["w"] * 65)}, "prompt is 65 tokens, context is 64", None),
])
def test_bad_completions_are_400_naming_the_field(client, fake, body, needle, param):
    resp = client.post(COMPLETIONS, json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert needle in err["message"] and err["param"] == param and err["type"] == "invalid_request_error", err
    assert client.get("/health").status_code == 200


def test_a_failure_mid_stream_is_an_error_event_and_every_prompt_is_aborted(client, fake):
    fake.__init__(fail_at=2)
    body = client.post(COMPLETIONS, json={"prompt": ["a", "b"], "stream": True}).text
    events = [e for e in body.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and "boom in the fake model" in events[-2]
    assert fake.n_closed == 2


# ------------------------------------------------------------------------------------ tokenize


def test_tokenize_and_detokenize_use_the_models_tokenizer(client):
    data = client.post("/tokenize", json={"prompt": "héllo"}).json()
    assert data == {"count": 5, "max_model_len": 64, "tokens": [104, 233, 108, 108, 111]}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == FakeTokenizer().encode_prompt(None, [{"role": "user", "content": "hi"}])
    assert client.post("/detokenize", json={"tokens": data["tokens"]}).json() == {"prompt": "héllo"}


@pytest.mark.parametrize("path,body,needle", [
    ("/tokenize", {}, "give exactly one of 'prompt'"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "got both"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": True}, "unknown field 'add_special_tokens'"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                "image_url": {"url": "data:,"}}]}]}, "only text"),
    ("/detokenize", {"tokens": [1, 0xD800]}, "tokens[1] = 55296 is not a token id of this model"),
    ("/detokenize", {"tokens": [-5]}, "tokens[0] = -5 is not a token id"),
    ("/detokenize", {"tokens": "abc"}, "tokens: Input should be a valid list"),
    ("/detokenize", {"token": [1]}, "unknown field 'token' (did you mean 'tokens'?)"),
])
def test_bad_tokenize_requests_are_400(client, path, body, needle):
    resp = client.post(path, json=body)
    assert resp.status_code == 400 and needle in resp.json()["error"], resp.text
