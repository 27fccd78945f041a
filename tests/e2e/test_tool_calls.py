"""End to end: tool calls through the real launcher with the ``openai`` client, on two tiny random models that each
teach one call format in their chat template: a Llama-3-shaped model with a Llama 3.1-style template (``llama3_json``,
served by the front end's own HTTP server) and a Qwen3-MoE-shaped model with a Qwen 2.5-style template (``hermes``,
served by two HTTP intake processes). ``tool_choice`` "required" or a named function makes the answer a call whatever
the random weights say (the grammar engine holds the model to the format), so the round trip is deterministic in
shape: the call comes back as ``message.tool_calls`` and, streamed, as ``delta.tool_calls`` chunks in OpenAI's
shapes that add up to the same call; the assistant's call and the tool's result go back in the next turn and reach
the chat template.

A failure here means an agent framework cannot use the server's tools: the template never sees the tools or the
results, the call is not parsed out of the model's format, or the chunks do not add up.
"""

from __future__ import annotations

import json

import httpx
import pytest

from models.moe.checkpoint import make_moe_checkpoint
from models.speech.checkpoint import make_speech_checkpoint
from tests.e2e.server import REPO, Server
from tests.tool_templates import LLAMA3_TOOLS, QWEN_TOOLS, use_template

pytest.importorskip("llguidance")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MODELS = {"llama3": ("llama", LLAMA3_TOOLS, 1), "qwen": ("qwen3_moe", QWEN_TOOLS, 2)}
"""Template style -> (family, chat template, HTTP processes)."""


@pytest.fixture(scope="module", params=sorted(MODELS))
def served(request, tmp_path_factory):
    family, template, http_processes = MODELS[request.param]
    weights = tmp_path_factory.mktemp("tools") / request.param
    if family == "llama":
        make_speech_checkpoint(weights, "tiny", 0, 64)
    else:
        make_moe_checkpoint(weights)
    use_template(weights, template)
    overrides = {"model": family, "weights": str(weights),
                 "engine": {"max_batch": 8, "max_seq_len": 1024},
                 "server": {"host": "127.0.0.1", "port": 8000, "http_processes": http_processes}}
    server = Server(REPO / "launch/configs/smollm2_single.yaml", nproc=1, overrides=overrides)
    server.family = family
    yield server
    assert server.stop_clean(1), server.log()


def client(server: Server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=120)


def test_a_named_call_round_trip(served):
    openai = client(served)
    forced = {"type": "function", "function": {"name": "get_weather"}}
    first = openai.chat.completions.create(model=served.family, messages=ASK, tools=TOOLS, tool_choice=forced,
                                           max_tokens=150, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert set(args) == {"city", "unit"} and args["unit"] in ("C", "F") and isinstance(args["city"], str)
    assert not choice.message.content
    # the call and its result go back: the template renders both (the prompt grows by them) and the model answers
    turn = [*ASK, choice.message, {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"}]
    second = openai.chat.completions.create(model=served.family, messages=turn, tools=TOOLS, tool_choice="none",
                                            max_tokens=4, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.tool_calls is None
    wire = json.loads(second.model_dump_json())["choices"][0]["message"]
    rendered = httpx.post(f"{served.base_url}/tokenize", timeout=60, json={
        "messages": [*ASK, json.loads(choice.message.model_dump_json(exclude_none=True)),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"}],
        "tools": TOOLS}).json()
    text = httpx.post(f"{served.base_url}/detokenize", json={"tokens": rendered["tokens"]}, timeout=60).json()
    assert "sunny, 21 degrees" in text["prompt"] and call.function.arguments in text["prompt"], text
    assert rendered["count"] == second.usage.prompt_tokens and isinstance(wire["content"], str)


def test_a_required_call_streams_in_openai_chunks_that_add_up_to_the_whole_answer(served):
    openai = client(served)
    kwargs = dict(model=served.family, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=150, temperature=0)
    whole = openai.chat.completions.create(**kwargs)
    (call,) = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and call.function.name in ("get_weather", "get_time")
    chunks = list(openai.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    head = calls[0]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == call.function.name
    assert all(tc.index == 0 and tc.id is None and tc.function.name is None for tc in calls[1:])
    assert len(calls) > 2  # the arguments come as they are written, not at the end
    assert "".join(tc.function.arguments for tc in calls) == call.function.arguments
    json.loads(call.function.arguments)
    assert not "".join(d.content or "" for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_lets_the_model_answer_and_mistakes_are_400s(served):
    openai = client(served)
    answer = openai.chat.completions.create(model=served.family, messages=ASK, tools=TOOLS, max_tokens=8,
                                            temperature=0)
    message = answer.choices[0].message
    assert message.tool_calls or isinstance(message.content, str)
    bad = httpx.post(f"{served.base_url}/v1/chat/completions", timeout=60, json={
        "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert bad.status_code == 400 and "'nope'" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "tool_choice"
