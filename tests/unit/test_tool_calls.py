"""Tool calls on the HTTP side (server/tool_calls.py, server/protocol/tools.py): the parsers of the Hermes and Llama 3
JSON formats, whole and streamed (any cut of the text gives the same content and calls, the streamed arguments add
up to the whole ones), the format a chat template teaches, the grammar of a forced call, and the chat route with a
fake model that writes calls: OpenAI's response and chunk shapes (parsed by the ``openai`` package's own types),
finish reason "tool_calls", what reaches the backend (tools, the forced call's grammar), and every mistake a 400
naming its field.

A failure here means a client's tool call is lost in the text, comes back in a shape OpenAI's SDKs cannot read, or a
misuse of ``tools`` / ``tool_choice`` reaches the model instead of the client.
"""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from mstar_dist.config.deployment import parse_config
from mstar_dist.server.app import build_app
from mstar_dist.server.tool_calls import (
    CallDelta, ToolCallParser, default_parser, forced_grammar, parse_whole, resolve_parser,
)
from tests.fakes import FakeBackend
from tests.tool_templates import LLAMA3_TOOLS, QWEN_TOOLS

CHAT = "/v1/chat/completions"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "noop"}}]
MSGS = [{"role": "user", "content": "weather?"}]

HERMES = [
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"a": "}\\""}]}}\n'
     '</tool_call>\n<tool_call>\n{"arguments": {}, "name": "noop"}\n</tool_call>',
     "Let me look.\n", [("get_weather", '{"city": "Paris", "n": [1, {"a": "}\\""}]}'), ("noop", "{}")]),
    ("no call here, only a <tool", "no call here, only a <tool", []),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call> after', "after", [("f", '{"x": 1}')]),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('<tool_call>\n{"name": "f"}\n</tool_call>', "", [("f", "{}")]),
    ("cut short <tool_call>\n ", "cut short <tool_call>\n ", []),
    ('cut short <tool_call>\n{"arguments": {"x', 'cut short <tool_call>\n{"arguments": {"x', []),
]
LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "noop", "parameters": {}}', "",
     [("get_weather", '{"city": "Paris"}'), ("noop", "{}")]),
    ('<|python_tag|>{"name": "f", "arguments": {"x": [1, 2]}}', "", [("f", '{"x": [1, 2]}')]),
    ("  The answer is {not a call}", "  The answer is {not a call}", []),
    ('{"value": 3}', '{"value": 3}', []),
]


@pytest.mark.parametrize("parser,text,content,calls", [("hermes", *c) for c in HERMES] +
                         [("llama3_json", *c) for c in LLAMA3])
def test_parsers_split_content_and_calls_alike_whole_and_streamed(parser, text, content, calls):
    whole_content, whole_calls = parse_whole(parser, text)
    assert (whole_content, [(c.name, c.arguments) for c in whole_calls]) == (content, calls)
    for cut in (1, 2, 3, 7):  # every way the deltas may fall
        p = ToolCallParser(parser)
        pieces = [piece for i in range(0, len(text), cut) for piece in p.feed(text[i:i + cut])] + p.close()
        assert "".join(x for x in pieces if isinstance(x, str)) == content
        deltas = [x for x in pieces if isinstance(x, CallDelta)]
        heads = [d for d in deltas if d.id is not None]
        assert [(d.index, d.name) for d in heads] == [(i, name) for i, (name, _) in enumerate(calls)]
        for i, (_, arguments) in enumerate(calls):
            assert "".join(d.arguments for d in deltas if d.index == i) == arguments


def test_the_parser_comes_from_the_template_or_the_config():
    assert default_parser(QWEN_TOOLS) == "hermes" and default_parser(LLAMA3_TOOLS) == "llama3_json"
    assert default_parser("{{ messages }}") is None and default_parser(None) is None
    assert resolve_parser("auto", QWEN_TOOLS) == "hermes" and resolve_parser("none", QWEN_TOOLS) is None
    assert resolve_parser("llama3_json", None) == "llama3_json"
    with pytest.raises(ValueError, match="server.tool_call_parser"):
        resolve_parser("mistral", None)
    cfg = {"model": "smollm2", "node_groups": [{"node_names": ["LLM"], "ranks": [0],
                                                "graph_walks": ["prefill", "decode"]}]}
    with pytest.raises(ValueError, match=r"server.tool_call_parser = 'qwen'"):
        parse_config({**cfg, "server": {"tool_call_parser": "qwen"}}, "x.yaml")
    assert parse_config({**cfg, "server": {"tool_call_parser": "hermes"}}, "x.yaml").server.tool_call_parser == \
        "hermes"


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_a_forced_call_grammar_is_one_the_grammar_engine_takes(parser):
    pytest.importorskip("llguidance")
    from mstar_dist.engine.grammar import compile_guided

    for only, parallel in ((None, True), (None, False), ("get_weather", True)):
        grammar = forced_grammar(parser, TOOLS, only, parallel)
        compile_guided("grammar", grammar)
        assert ("noop" in grammar) == (only is None) and ("call)*" in grammar) == (only is None and parallel)


def client(deltas: list[str], parser: str | None = "hermes") -> tuple[TestClient, FakeBackend]:
    fake = FakeBackend(deltas)
    return TestClient(build_app(fake, tool_call_parser=parser or "none"), raise_server_exceptions=False), fake


CALL = ["Sure. ", "<tool_", "call>\n", '{"name": ', '"get_weather", ', '"arguments": {"ci', 'ty": "Paris"}}',
        "\n</tool_call>"]


def test_a_whole_answer_carries_the_calls_and_the_backend_gets_the_tools():
    from openai.types.chat import ChatCompletion

    http, fake = client(CALL)
    resp = http.post(CHAT, json={"messages": MSGS, "tools": TOOLS})
    assert resp.status_code == 200, resp.text
    body = ChatCompletion.model_validate(resp.json())
    choice = body.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather",
                                                                          '{"city": "Paris"}')
    assert fake.calls[-1].tools == TOOLS and fake.calls[-1].guided is None
    plain = http.post(CHAT, json={"messages": MSGS, "tools": TOOLS, "tool_choice": "none"}).json()
    assert plain["choices"][0]["message"]["content"] == "".join(CALL) and "tool_calls" not in \
        plain["choices"][0]["message"] and plain["choices"][0]["finish_reason"] == "stop"


def test_a_streamed_answer_sends_calls_in_openai_chunks():
    from openai.types.chat import ChatCompletionChunk

    http, _ = client(CALL)
    with http.stream("POST", CHAT, json={"messages": MSGS, "tools": TOOLS, "stream": True, "n": 2}) as resp:
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: {")]
    chunks = [ChatCompletionChunk.model_validate(json.loads(line)) for line in lines]
    deltas = [c.choices[0] for c in chunks if c.choices[0].index == 0]
    calls = [tc for d in deltas for tc in d.delta.tool_calls or ()]
    assert calls[0].id.startswith("call_") and calls[0].type == "function"
    assert calls[0].function.name == "get_weather" and calls[0].function.arguments == ""
    assert all(tc.id is None and tc.function.name is None for tc in calls[1:])
    assert "".join(tc.function.arguments for tc in calls) == '{"city": "Paris"}' and len(calls) > 2
    assert "".join(d.delta.content or "" for d in deltas) == "Sure. "
    assert deltas[-1].finish_reason == "tool_calls"
    # the fake's second choice writes every piece twice: no call in its format, so all of it is content
    other = [c.choices[0] for c in chunks if c.choices[0].index == 1]
    assert "".join(d.delta.content or "" for d in other) == "".join(piece * 2 for piece in CALL)
    assert not any(d.delta.tool_calls for d in other) and other[-1].finish_reason == "stop"


@pytest.mark.parametrize("choice,parallel,only", [("required", True, None), ("required", False, None),
                                                  ({"type": "function", "function": {"name": "noop"}}, True, "noop")])
def test_a_forced_call_goes_to_the_backend_as_its_grammar(choice, parallel, only):
    http, fake = client(CALL, "llama3_json")
    resp = http.post(CHAT, json={"messages": MSGS, "tools": TOOLS, "tool_choice": choice,
                                 "parallel_tool_calls": parallel})
    assert resp.status_code == 200, resp.text
    assert fake.calls[-1].guided.kind == "grammar"
    assert fake.calls[-1].guided.spec == forced_grammar("llama3_json", TOOLS, only, parallel)


TOOL_MISTAKES = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "more than once"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name",
     "is not a function name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "structured output already"),
    ({"tools": TOOLS, "tool_choice": "maybe"}, "tool_choice", ""),
    ({"functions": [{"name": "f"}]}, "functions", "send tools instead"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "JSON object as text"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "content is required"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls",
     "belong to an assistant message"),
]


@pytest.mark.parametrize("extra,param,needle", TOOL_MISTAKES)
def test_tool_mistakes_are_400s_naming_the_field(extra, param, needle):
    http, fake = client(["x"])
    resp = http.post(CHAT, json={"messages": MSGS, **extra})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    assert fake.calls == []


def test_tools_without_a_format_are_a_400_but_none_is_served():
    http, fake = client(["x"], parser=None)
    resp = http.post(CHAT, json={"messages": MSGS, "tools": TOOLS})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tools"
    assert "server.tool_call_parser" in resp.json()["error"]["message"]
    assert http.post(CHAT, json={"messages": MSGS, "tools": TOOLS, "tool_choice": "none"}).status_code == 200


def test_a_tool_turn_reaches_the_backend_for_the_template():
    http, fake = client(["ok"])
    turn = [*MSGS, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "snow"}]
    resp = http.post(CHAT, json={"messages": turn, "tools": TOOLS})
    assert resp.status_code == 200, resp.text
    sent = fake.calls[-1].messages
    assert sent[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    assert sent[2] == {"role": "tool", "content": "snow", "tool_call_id": "call_1"}
