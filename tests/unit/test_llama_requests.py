"""The Llama family's requests with vLLM's and OpenAI's extra knobs, conductor and workers in one process
(tests/inproc.py) on a tiny random Llama checkpoint with a real byte-level BPE tokenizer, on one rank and split
prefill / decode over two: logprobs against a log-softmax of the model's own logits, ``n`` > 1, stop tokens
(``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``include_stop_str_in_output``), penalties, and structured
outputs (JSON schema, regex, choice) for 20 seeds each.

A failure here points at the path from the request's knobs to the engine and back (the conductor's per-request
sampling and stop ids, the family's detokenising and logprob entries, the fan-out of choices) rather than at the
engine's arithmetic, which tests/unit/test_logits.py checks alone.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from models.llama.chat import LlamaChat
from models.speech.checkpoint import make_speech_checkpoint
from mstar_dist.config.deployment import parse_config
from mstar_dist.events import BackendError, Finished, GenerationParams, GuidedSpec, TextDelta
from mstar_dist.graph.model import Layout
from tests.inproc import InProcDeployment

pytestmark = pytest.mark.usefixtures("one_intraop_thread")

PLACEMENTS = {
    "one rank": ([{"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill", "decode"]}], 1),
    "P/D": ([{"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill"]},
             {"node_names": ["LLM"], "ranks": [1], "graph_walks": ["decode"]}], 2),
}
PROMPT = "The lighthouse keeper climbed the spiral stairs"


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("llm") / "tiny"
    make_speech_checkpoint(out, "tiny", 0, 64)  # a Llama-3-shaped LLM with a byte-level BPE tokenizer
    return str(out)


def deployment(weights: str, where: str, eos: tuple[int, ...] | None = None) -> InProcDeployment:
    groups, world = PLACEMENTS[where]
    cfg = {"model": "llama", "weights": weights, "node_groups": groups, "transport": {"inline_max_bytes": 1 << 22},
           "engine": {"max_batch": 24, "max_seq_len": 256}}
    model = LlamaChat(weights)
    model.configure(Layout.from_node_groups(parse_config(cfg, "test").node_groups))
    model.load_frontend()
    if eos is not None:
        model.tokenizer.eos_token_ids = eos
    return InProcDeployment(model, cfg, world, max_concurrent=64)


@pytest.fixture(scope="module", params=sorted(PLACEMENTS))
def dep(request, weights) -> InProcDeployment:
    return deployment(weights, request.param)


def ask(rid: str, max_tokens: int = 12, **knobs) -> GenerationParams:
    knobs.setdefault("temperature", 0.0)
    return GenerationParams(request_id=rid, prompt=knobs.pop("prompt", PROMPT), messages=None, max_tokens=max_tokens,
                            **knobs)


def text_of(events: list, index: int = 0) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta) and e.index == index)


def finished(events: list) -> Finished:
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1]


DRAWN = {"temperature": 1.0, "seed": 3}
"""A random model's greedy text repeats one token: stop tests draw (the same seed, so the same tokens)."""


def drawn_ids(dep: InProcDeployment, n: int) -> list[int]:
    """The ids PROMPT's request draws with ``DRAWN`` (their logprobs carry them)."""
    (events,) = dep.run([ask("ids", max_tokens=n, logprobs=0, ignore_eos=True, **DRAWN)])
    return [lp.token_id for e in events if isinstance(e, TextDelta) for lp in e.logprobs or []]


def full_log_softmax(weights: str, ids: list[int]) -> torch.Tensor:
    from models.common.linear import pack_for_cpu
    from models.llama.weights import load_llama
    from mstar_dist.engine.kv_cache import StaticKVCache

    model, cfg = load_llama(weights)
    pack_for_cpu(model)  # as the engine runs it
    cache = StaticKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, max_slots=1, max_seq_len=len(ids))
    cache.bind([cache.alloc()], [0], len(ids))
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0].log_softmax(-1)


def test_logprobs_are_the_model_s_and_name_their_tokens(dep: InProcDeployment, weights: str) -> None:
    (events,) = dep.run([ask("lp", max_tokens=8, logprobs=3, prompt_logprobs=2, ignore_eos=True)])
    deltas = [e for e in events if isinstance(e, TextDelta)]
    entries = [lp for e in deltas for lp in e.logprobs or []]
    prompt_ids = dep.conductor.model.tokenizer.encode(PROMPT)
    made = [lp.token_id for lp in entries]
    assert len(entries) == finished(events).completion_tokens == 8
    ref = full_log_softmax(weights, prompt_ids + made[:-1])
    tok = dep.conductor.model.tokenizer
    for step, entry in enumerate(entries):
        row = ref[len(prompt_ids) - 1 + step]
        assert abs(entry.logprob - float(row[entry.token_id])) < 1e-5
        assert [t.token_id for t in entry.top] == row.topk(3).indices.tolist()
        assert all(abs(t.logprob - float(row[t.token_id])) < 1e-5 for t in entry.top)
        assert (entry.token, entry.token_bytes) == tok.token_piece(entry.token_id)
    assert entries[0].token_id == int(ref[len(prompt_ids) - 1].argmax())  # greedy: the most likely
    assert "".join(e.text for e in deltas) == tok.decode(made)
    prompt = deltas[0].prompt_logprobs
    assert prompt[0] is None and [p.token_id for p in prompt[1:]] == prompt_ids[1:]
    assert all(abs(p.logprob - float(ref[i, p.token_id])) < 1e-5 for i, p in enumerate(prompt[1:]))
    assert all(len(p.top) == 2 for p in prompt[1:]) and all(e.prompt_logprobs is None for e in deltas[1:])


def test_n_choices_share_the_prompt_and_each_has_its_seed(dep: InProcDeployment) -> None:
    greedy, sampled, again = dep.run([ask("g", n=3), ask("s", n=3, temperature=1.0, seed=7),
                                      ask("t", n=3, temperature=1.0, seed=7)])
    texts = [text_of(greedy, i) for i in range(3)]
    assert texts[0] and texts == [texts[0]] * 3
    end = finished(greedy)
    assert [c.index for c in end.choices] == [0, 1, 2]
    assert end.prompt_tokens == len(dep.conductor.model.tokenizer.encode(PROMPT))  # counted once
    assert end.completion_tokens == sum(c.completion_tokens for c in end.choices)
    drawn = [text_of(sampled, i) for i in range(3)]
    assert drawn == [text_of(again, i) for i in range(3)]  # reproducible
    assert len(set(drawn)) == 3  # and different: choice i draws with seed + i
    (alone,) = dep.run([ask("one", temperature=1.0, seed=8)])
    assert text_of(alone) == drawn[1]
    assert not dep.conductor._fanouts and not dep.conductor._active
    for worker in dep.workers:
        assert worker.held_requests() == set()


def test_stop_tokens_ignore_eos_and_min_tokens(weights: str) -> None:
    ids = drawn_ids(deployment(weights, "one rank"), 12)
    at = next(k for k in range(2, 12) if ids[k] not in ids[:k])
    stop = ids[at]
    dep = deployment(weights, "one rank", eos=(stop,))  # the model's EOS: a token the request makes
    plain, ignored, extra, held, shown = dep.run([
        ask("eos", **DRAWN), ask("ignore", ignore_eos=True, **DRAWN),
        ask("extra", ignore_eos=True, stop_token_ids=[ids[1]], **DRAWN),
        ask("min", min_tokens=at + 2, **DRAWN),
        ask("shown", include_stop_str_in_output=True, skip_special_tokens=False, **DRAWN)])
    tok = dep.conductor.model.tokenizer
    assert finished(plain).finish_reason == "stop" and finished(plain).completion_tokens == at + 1
    assert text_of(plain) == tok.decode(ids[:at])  # the stop token's text is left out
    assert finished(ignored).finish_reason == "length" and finished(ignored).completion_tokens == 12
    assert finished(extra).finish_reason == "stop" and finished(extra).completion_tokens == ids.index(ids[1]) + 1
    assert finished(held).completion_tokens > at + 1  # the EOS was masked for min_tokens
    assert text_of(shown) == tok.decode(ids[:at + 1], skip_special_tokens=False)


def test_stop_strings_may_be_kept_and_wait_for_min_tokens(weights: str) -> None:
    dep = deployment(weights, "one rank")
    (free,) = dep.run([ask("free", ignore_eos=True, max_tokens=16)])
    text = text_of(free)
    stop = text[len(text) // 3: len(text) // 3 + 2]
    cut, kept = dep.run([ask("cut", ignore_eos=True, max_tokens=16, stop=[stop]),
                         ask("kept", ignore_eos=True, max_tokens=16, stop=[stop], include_stop_str_in_output=True)])
    assert text_of(cut) == text[:text.index(stop)] and text_of(kept) == text[:text.index(stop) + len(stop)]
    (late,) = dep.run([ask("late", ignore_eos=True, max_tokens=16, stop=[stop], min_tokens=12)])
    assert text.startswith(text_of(late)) and len(text_of(late)) > len(text_of(cut)) + len(stop)


def test_penalties_change_the_text_alike_on_every_placement(weights: str) -> None:
    knobs = dict(ignore_eos=True, max_tokens=16, repetition_penalty=1.5, frequency_penalty=0.5)
    texts = [text_of(deployment(weights, where).run([ask("p", **knobs)])[0]) for where in sorted(PLACEMENTS)]
    plain = text_of(deployment(weights, "one rank").run([ask("p", ignore_eos=True, max_tokens=16)])[0])
    assert texts[0] == texts[1] != plain


def valid_person(text: str) -> bool:
    """``text`` is an instance of PERSON (checked by hand: no validator is installed)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) <= {"name", "age", "pet"} and {"name", "age"} <= set(value)
            and isinstance(value["name"], str) and len(value["name"]) <= 6
            and type(value["age"]) is int and 0 <= value["age"] <= 120
            and value.get("pet", "cat") in ("cat", "dog"))


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog"]}}, "required": ["name", "age"], "additionalProperties": False}


def test_structured_outputs_hold_for_twenty_seeds(dep: InProcDeployment) -> None:
    pytest.importorskip("llguidance")
    kinds = {"json": GuidedSpec("json_schema", json.dumps(PERSON)), "regex": GuidedSpec("regex", r"[a-c]{2,4}-\d\d"),
             "choice": GuidedSpec("choice", json.dumps(["north", "south", "east west"])),
             "object": GuidedSpec("json_object")}
    asks = [ask(f"{kind}{seed}", max_tokens=64, temperature=1.0, seed=seed, guided=spec)
            for kind, spec in kinds.items() for seed in range(20)]
    for params, events in zip(asks, dep.run(asks)):
        text, kind = text_of(events), params.request_id.rstrip("0123456789")
        if kind == "object" and finished(events).finish_reason == "length":
            assert text.startswith("{"), text  # any object: a random model may well not close it in time
            continue
        assert finished(events).finish_reason == "stop", (params.request_id, text)
        if kind == "json":
            assert valid_person(text), text
        elif kind == "regex":
            assert re.fullmatch(r"[a-c]{2,4}-\d\d", text), text
        elif kind == "choice":
            assert text in ("north", "south", "east west"), text
        else:
            assert isinstance(json.loads(text), dict), text


def test_an_unsupported_schema_is_a_400_naming_it(dep: InProcDeployment) -> None:
    pytest.importorskip("llguidance")
    bad = GuidedSpec("json_schema", json.dumps({"type": "array", "uniqueItems": True}))
    (events,) = dep.run([ask("bad", guided=bad)])
    assert isinstance(events[-1], BackendError) and events[-1].status == 400 and "uniqueItems" in str(events[-1])
    (events,) = dep.run([ask("many", n=2, logprobs=99)])
    assert isinstance(events[-1], BackendError) and events[-1].status == 400 and "logprobs" in str(events[-1])
