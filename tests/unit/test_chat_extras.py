"""``/v1/chat/completions`` beyond one plain choice: vLLM's extra parameters, structured outputs, ``n`` choices,
log-probabilities and running usage, each response parsed by the ``openai`` package's own types.

A failure here means a benchmark client (guidellm, aiperf, ``vllm bench serve``) has its parameters refused or
silently dropped, structured-output constraints never reach the engine, choices come back without their index, or
logprobs / usage arrive in a shape an OpenAI client cannot read.
"""

from __future__ import annotations

import json

import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from starlette.testclient import TestClient

from mstar_dist.events import GuidedSpec
from mstar_dist.server.app import build_app
from tests.fakes import UNICODE_DELTAS, FakeBackend, FakeTokenizer, choice_text

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "say hi"}]


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def client(fake: FakeBackend):
    with TestClient(build_app(fake), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def oai(client) -> OpenAI:
    return OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)


def sse_chunks(body: str) -> list[dict]:
    events = [e[len("data: "):] for e in body.split("\n\n") if e]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def test_vllms_extra_parameters_reach_the_backend_with_their_values(client, fake):
    body = {"messages": MSGS, "ignore_eos": True, "min_tokens": 4, "min_p": 0.05, "repetition_penalty": 1.1,
            "top_k": 20, "stop_token_ids": [2, 3], "include_stop_str_in_output": True, "skip_special_tokens": False,
            "spaces_between_special_tokens": False, "presence_penalty": 0.25, "frequency_penalty": 0.5,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert client.post(CHAT, json=body).status_code == 200
    (p,) = fake.calls
    assert (p.ignore_eos, p.min_tokens, p.min_p, p.repetition_penalty, p.top_k) == (True, 4, 0.05, 1.1, 20)
    assert (p.stop_token_ids, p.include_stop_str_in_output, p.skip_special_tokens) == ([2, 3], True, False)
    assert (p.spaces_between_special_tokens, p.presence_penalty, p.frequency_penalty) == (False, 0.25, 0.5)
    assert (p.n, p.logprobs, p.guided) == (1, None, None)


def test_defaults_ask_for_nothing_extra(client, fake):
    assert client.post(CHAT, json={"messages": MSGS}).status_code == 200
    (p,) = fake.calls
    assert (p.ignore_eos, p.min_tokens, p.min_p, p.repetition_penalty, p.stop_token_ids) == (False, 0, 0.0, 1.0, [])
    assert (p.skip_special_tokens, p.spaces_between_special_tokens, p.logprobs, p.n) == (True, True, None, 1)
    assert p.prompt_ids is None  # nothing needs the prompt's length up front: the family encodes it


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("fields,guided", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}},
     GuidedSpec("json_schema", json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_object"}}, GuidedSpec("json_object", "")),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": SCHEMA}, GuidedSpec("json_schema", json.dumps(SCHEMA))),
    ({"guided_json": json.dumps(SCHEMA)}, GuidedSpec("json_schema", json.dumps(SCHEMA))),
    ({"guided_regex": "[0-9]{3}"}, GuidedSpec("regex", "[0-9]{3}")),
    ({"guided_choice": ["yes", "no"]}, GuidedSpec("choice", '["yes", "no"]')),
    ({"guided_grammar": "start: \"a\"+"}, GuidedSpec("grammar", "start: \"a\"+")),
    ({"structured_outputs": {"regex": "a+"}}, GuidedSpec("regex", "a+")),
    ({"structured_outputs": {"json_object": True}}, GuidedSpec("json_object", "")),
    ({"guided_decoding_backend": "xgrammar", "guided_choice": ["a"]}, GuidedSpec("choice", '["a"]')),
])
def test_structured_output_fields_become_one_guided_spec(client, fake, fields, guided):
    assert client.post(CHAT, json={"messages": MSGS, **fields}).status_code == 200
    assert fake.calls[0].guided == guided


@pytest.mark.parametrize("fields,needle,param", [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "give one structured-output constraint, not guided_regex and "
                                                    "guided_choice", "guided_choice"),
    ({"guided_regex": "(", "stream": True}, "guided_regex is not a regular expression", "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json is not valid JSON", "guided_json"),
    ({"guided_json": "[1]"}, "guided_json must be a JSON schema object", "guided_json"),
    ({"guided_choice": []}, "guided_choice: List should have at least 1 item", "guided_choice"),
    ({"response_format": {"type": "json_schema"}}, 'type "json_schema" needs "json_schema"', "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": True, "nmae": "x"}}},
     "unknown field 'nmae' (did you mean 'name'?)", "response_format.json_schema.nmae"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "needs exactly one of json", "structured_outputs"),
    ({"structured_outputs": {"jsonn": {}}}, "unknown field 'jsonn' (did you mean 'json'?)", "structured_outputs.jsonn"),
])
def test_bad_structured_output_fields_are_400_naming_them(client, fake, fields, needle, param):
    resp = client.post(CHAT, json={"messages": MSGS, **fields})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert needle in err["message"] and err["param"] == param, err
    assert fake.calls == []


def test_n_choices_come_back_whole_with_their_indexes(oai, fake):
    out = oai.chat.completions.create(model="fake-model", messages=MSGS, n=3, max_tokens=2)
    assert isinstance(out, ChatCompletion) and [c.index for c in out.choices] == [0, 1, 2]
    assert [c.message.content for c in out.choices] == \
        ["".join(choice_text(d, j) for d in UNICODE_DELTAS[:2]) for j in range(3)]
    assert [c.finish_reason for c in out.choices] == ["length"] * 3
    assert out.usage.completion_tokens == 6 and fake.calls[0].n == 3


def test_n_choices_stream_interleaved_each_chunk_with_its_index(oai):
    chunks = list(oai.chat.completions.create(model="fake-model", messages=MSGS, n=2, max_tokens=3, stream=True,
                                              stream_options={"include_usage": True}))
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    *body, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == 6
    indexes = [c.choices[0].index for c in body]
    assert indexes[:2] == [0, 1] and [c.choices[0].delta.role for c in body[:2]] == ["assistant"] * 2
    assert indexes[2:8] == [0, 1] * 3  # as the choices make them
    texts = {i: "".join(c.choices[0].delta.content or "" for c in body if c.choices[0].index == i) for i in (0, 1)}
    assert texts == {j: "".join(choice_text(d, j) for d in UNICODE_DELTAS[:3]) for j in (0, 1)}
    assert [(c.choices[0].index, c.choices[0].finish_reason) for c in body[-2:]] == [(0, "length"), (1, "length")]


def test_logprobs_come_in_openais_shape_whole_and_streamed(oai, fake):
    out = oai.chat.completions.create(model="fake-model", messages=MSGS, logprobs=True, top_logprobs=2,
                                      max_tokens=2)
    content = out.choices[0].logprobs.content
    assert [(e.token, e.logprob, e.bytes) for e in content] == [("h", -0.125, [104]), ("l", -0.25, [108])]
    assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in content] == [
        [("h", -0.125), ("a", -1.125)], [("l", -0.25), ("a", -1.25)]]
    assert fake.calls[0].logprobs == 2
    chunks = list(oai.chat.completions.create(model="fake-model", messages=MSGS, logprobs=True, max_tokens=2,
                                              stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.top_logprobs) for e in streamed] == [("h", []), ("l", [])]
    assert fake.calls[1].logprobs == 0


def test_logprobs_need_no_tokenizer_on_the_server(fake):
    fake.__init__(tokenizer=False)
    with TestClient(build_app(fake)) as client:
        data = client.post(CHAT, json={"messages": MSGS, "logprobs": True, "max_tokens": 1}).json()
    assert data["choices"][0]["logprobs"]["content"][0]["token"] == "h"


def test_continuous_usage_stats_count_the_prompt_from_the_first_chunk(client, fake):
    body = {"messages": MSGS, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse_chunks(client.post(CHAT, json=body).text)
    prompt = len(FakeTokenizer().encode_prompt(None, MSGS))
    assert fake.calls[0].prompt_ids is not None and len(fake.calls[0].prompt_ids) == prompt
    assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks)
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3, 3, 3]
    assert chunks[-1]["choices"] == []


def test_continuous_usage_stats_alone_still_put_usage_on_every_chunk_but_no_last_one(client):
    body = {"messages": MSGS, "max_tokens": 2, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    chunks = sse_chunks(client.post(CHAT, json=body).text)
    assert all(c["usage"] is not None for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("fields,needle,param", [
    ({"top_logprobs": 2}, 'top_logprobs needs "logprobs": true', "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs: Input should be less than or equal to 20", "top_logprobs"),
    ({"min_p": 1.5}, "min_p: Input should be less than or equal to 1", "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty: Input should be greater than 0", "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens", "min_tokens"),
    ({"stop_token_ids": [1, -2]}, "[1] = -2 is not a token id", "stop_token_ids"),
    ({"presence_penalty": 3}, "presence_penalty: Input should be less than or equal to 2", "presence_penalty"),
    ({"ignore_eos": "true"}, "ignore_eos: Input should be a valid boolean", "ignore_eos"),
    ({"stream_options": {"continuous_usage": True}}, "unknown field 'continuous_usage' (did you mean "
                                                     "'continuous_usage_stats'?)", "stream_options.continuous_usage"),
    ({"use_beam_search": True}, "use_beam_search is not supported", "use_beam_search"),
    ({"prompt_logprobs": 1}, "prompt_logprobs is not supported", "prompt_logprobs"),
    ({"echo": True}, "echo is not supported", "echo"),
    ({"web_search_options": {}}, "web_search_options is not supported", "web_search_options"),
    ({"chat_template": "{{x}}"}, "chat_template is not supported", "chat_template"),
    ({"seed": 2**63}, "seed: Input should be less than or equal to 9223372036854775807", "seed"),
])
def test_bad_extra_parameters_are_400_naming_them(client, fake, fields, needle, param):
    resp = client.post(CHAT, json={"messages": MSGS, **fields})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert needle in err["message"] and err["param"] == param, err
    assert fake.calls == []


def test_vllm_fields_at_their_off_value_are_accepted(client, fake):
    body = {"messages": MSGS, "use_beam_search": False, "echo": False, "add_generation_prompt": True,
            "length_penalty": 1.0, "priority": 0, "chat_template_kwargs": {}, "bad_words": [], "best_of": 1}
    assert client.post(CHAT, json=body).status_code == 200
