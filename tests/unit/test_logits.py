"""The KV engine's knobs beyond the draw (engine/logits.py, engine/grammar.py, engine/sampling.py) on a tiny random
Llama, each against a reference: HF's logits processors for min-p and the repetition penalty, OpenAI's formula for
presence and frequency penalties, a log-softmax of the model's own logits for logprobs, hand-made cases for
``min_tokens`` and grammars.

A failure here means a request's penalties, min-p, ``min_tokens``, logprobs or grammar give other tokens (or other
numbers) than those references, differ with decode lookahead or across a P/D split (a KV import), or that one row's
knobs leak into its batch mates.
"""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from models.llama.config import LlamaConfig
from models.llama.model import Llama
from mstar_dist.config.engine import EngineConfig
from mstar_dist.engine.component import WalkContext
from mstar_dist.engine.grammar import compile_guided
from mstar_dist.engine.kv_cache import StaticKVCache
from mstar_dist.engine.kv_engine import KVCacheEngine
from mstar_dist.engine.sampling import SamplingParams, make_generator, min_p_filtered, sample
from mstar_dist.events import GuidedSpec
from mstar_dist.graph.walk import NodeCall

CFG = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, n_layers=2, n_heads=4, n_kv_heads=2,
                  head_dim=16, rope_theta=10000.0, max_position_embeddings=128)
PLAIN = EngineConfig(cuda_graphs=False, prefill_graphs=False, lookahead=False, prefill_in_flight=False,
                     decode_yield_ms=0.0)


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    return Llama(CFG).eval().requires_grad_(False)


def engine(model: Llama, lookahead: bool = False, **kwargs) -> KVCacheEngine:
    cache = StaticKVCache(n_layers=CFG.n_layers, n_kv_heads=CFG.n_kv_heads, head_dim=CFG.head_dim, max_slots=8,
                          max_seq_len=64)
    return KVCacheEngine(model, cache, torch.device("cpu"), replace(PLAIN, lookahead=lookahead), **kwargs)


def call(rid: str, inputs: dict, params: SamplingParams, iteration: int = 0, stops=(), state=None,
         export: frozenset[str] = frozenset()) -> NodeCall:
    ctx = WalkContext(request_id=rid, walk="w", walk_index=0, seed=params.seed or 0, sampling=params,
                      stop_token_ids=frozenset(stops), export=export)
    if state is not None:
        ctx.state = state  # the request's generator carries over, as in a walk
    return NodeCall(run=SimpleNamespace(request_id=rid, ctx=ctx), node="LLM", inputs=inputs, iteration=iteration)


def prompt(n: int, salt: int) -> torch.Tensor:
    return torch.randint(CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(salt))


def run(eng: KVCacheEngine, prompts: dict[str, torch.Tensor], params: dict[str, SamplingParams], steps: int,
        stops: dict[str, tuple] | None = None, decode_on: KVCacheEngine | None = None,
        after_step=lambda engine, live: None) -> dict[str, list]:
    """Prefill every prompt in one turn, then decode them together ``steps`` times (on ``decode_on`` when given: a
    P/D split, the KV and the prompt ids imported there); each request's results in order. A request whose walk
    stopped leaves the batch. ``after_step(engine, live requests)`` is called after every step."""
    stops = stops or {}
    export = frozenset({"kv"}) if decode_on is not None else frozenset()
    first = [call(r, {"input_ids": p}, params[r], stops=stops.get(r, ()), export=export) for r, p in prompts.items()]
    out = {c.request_id: [res] for c, res in zip(first, answered(eng, first))}
    states = {c.request_id: c.ctx.state for c in first}
    live = list(prompts)
    decoder = decode_on or eng
    for k in range(steps):
        live = [r for r in live if not out[r][-1].stop]
        calls = []
        for r in live:
            inputs = {"token": out[r][-1].outputs["token"]}
            if k == 0 and decode_on is not None:
                inputs.update(kv=out[r][0].outputs["kv"], prompt_ids=prompts[r])
            calls.append(call(r, inputs, params[r], iteration=k, stops=stops.get(r, ()), state=states[r]))
        for r, res in zip(live, answered(decoder, calls)):
            out[r].append(res)
        after_step(decoder, live)
    return out


def answered(eng: KVCacheEngine, calls: list[NodeCall]) -> list:
    """Every call's result, handing the calls a turn holds (a row joining a lookahead launch, a prefill on the GPU)
    over again as a worker does."""
    results = eng.run_batch(calls)
    for _ in range(20):
        held = [c for c, res in zip(calls, results) if not hasattr(res, "outputs") and not isinstance(res, Exception)]
        if not held:
            return results
        again = dict(zip([id(c) for c in held], eng.run_batch(held)))
        results = [again.get(id(c), res) for c, res in zip(calls, results)]
    raise AssertionError(f"calls still held after 20 turns: {results}")


def tokens(results: list) -> list[int]:
    return [int(r.outputs["token"]) for r in results]


def full_logits(model: Llama, ids: list[int]) -> torch.Tensor:
    """The model's logits (T, V) at every position of ``ids``, one forward from scratch."""
    cache = StaticKVCache(n_layers=CFG.n_layers, n_kv_heads=CFG.n_kv_heads, head_dim=CFG.head_dim, max_slots=1,
                          max_seq_len=64)
    cache.bind([cache.alloc()], [0], len(ids))
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0]


def reference(model: Llama, ids: list[int], steps: int, adjust) -> list[int]:
    """Greedy tokens from the full-sequence logits, each step's last-position logits through ``adjust(logits,
    generated so far, whole sequence so far)``."""
    seq, made = list(ids), []
    for _ in range(steps + 1):
        logits = adjust(full_logits(model, seq)[-1][None].clone(), made, seq)
        made.append(int(logits.argmax(-1)))
        seq.append(made[-1])
    return made


def test_min_p_is_hf_s_min_p_warper() -> None:
    from transformers.generation.logits_process import MinPLogitsWarper

    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(3)) * 3
    ours = min_p_filtered(x, [0.05, 0.2, 0.5, 0.01, 0.9, 0.3])
    for row, p in enumerate([0.05, 0.2, 0.5, 0.01, 0.9, 0.3]):
        theirs = MinPLogitsWarper(p)(None, x[row:row + 1])
        assert torch.equal(ours[row:row + 1].isinf(), theirs.isinf()), row
    # min_p 1 keeps the most likely token only: greedy, whatever the seed
    params = [SamplingParams(temperature=1.0, min_p=1.0, seed=s) for s in range(6)]
    assert torch.equal(sample(x, params, [make_generator(p) for p in params]), x.argmax(-1))


def vllm_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], repetition: float, presence: float,
                   frequency: float) -> torch.Tensor:
    """vLLM's ``apply_penalties`` for one row, written from its definition: the repetition penalty over the tokens
    of the prompt and the output (divide a positive logit, multiply a negative one), then the frequency penalty
    times each token's count in the output and the presence penalty once for each token the output holds."""
    vocab = logits.shape[-1]
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[torch.tensor(prompt + output, dtype=torch.long)] = True
    x = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).to(x.dtype)
    return x - frequency * counts - presence * (counts > 0).to(x.dtype)


def test_the_penalties_and_min_p_of_a_batch_are_each_row_s_references() -> None:
    """One batched call of the engine's penalties (``RowExtras``) on the same logits as HF's
    ``RepetitionPenaltyLogitsProcessor`` and vLLM's definition of presence and frequency penalties, every row with
    its own knobs, prompt and output (of other lengths); then min-p after temperature as HF's ``TemperatureLogitsWarper``
    and ``MinPLogitsWarper`` (vLLM's order)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
    )

    from mstar_dist.engine.logits import RowExtras
    from mstar_dist.engine.sampling import min_p_filtered

    vocab, gen = 257, torch.Generator().manual_seed(11)
    rows = [  # (repetition, presence, frequency, prompt length, output length, temperature, min_p)
        (1.3, 0.0, 0.0, 7, 5, 0.7, 0.05), (1.0, 0.6, 0.0, 4, 9, 1.0, 0.0), (1.0, 0.0, -0.8, 10, 3, 1.3, 0.2),
        (0.8, 1.5, 0.9, 3, 12, 0.5, 0.1), (1.0, 0.0, 0.0, 5, 4, 1.0, 0.0), (2.0, -0.5, 1.7, 6, 0, 0.9, 0.5)]
    extras = RowExtras(torch.device("cpu"), max_slots=8, max_seq_len=32, grammar_tokenizer=None, engine="test")
    ctxs, slots, positions, seqs = [], [], [], []
    for b, (rep, pres, freq, n_prompt, n_out, temp, min_p) in enumerate(rows):
        seq = torch.randint(40, (n_prompt + n_out,), generator=gen)  # a small alphabet: tokens repeat
        params = SamplingParams(temperature=temp, min_p=min_p, repetition_penalty=rep, presence_penalty=pres,
                                frequency_penalty=freq)
        slot = 7 - b  # slots in another order than the rows
        extras.admit(f"r{b}", params, slot, seq[:n_prompt], n_prompt)
        ctxs.append(SimpleNamespace(sampling=params, request_id=f"r{b}", stop_token_ids=frozenset()))
        slots.append(slot)
        seqs.append(seq)
    for k in range(max(r[4] for r in rows)):  # decode steps: each writes its input token where its KV goes
        positions = [r[3] - 1 + min(k + 1, r[4]) for r in rows]  # a row done with its output repeats its last
        inputs = torch.stack([seqs[b][p] for b, p in enumerate(positions)])
        prep = extras.prepare(ctxs, slots, positions, done=[0] * len(rows), inputs=inputs, given=list(inputs))
    logits = torch.randn(len(rows), vocab, generator=gen) * 4
    assert prep.penalized == [b for b, r in enumerate(rows) if r[:3] != (1.0, 0.0, 0.0)]
    ours = extras.adjust(logits.clone(), prep)
    for b, (rep, pres, freq, n_prompt, n_out, temp, min_p) in enumerate(rows):
        seq = seqs[b]
        want = vllm_penalties(logits[b], seq[:n_prompt].tolist(), seq[n_prompt:].tolist(), rep, pres, freq)
        torch.testing.assert_close(ours[b], want, atol=1e-6, rtol=0)
        hf = RepetitionPenaltyLogitsProcessor(rep)(seq[None], logits[b:b + 1].clone())[0]  # over prompt + output
        if pres == freq == 0:
            torch.testing.assert_close(ours[b], hf, atol=1e-6, rtol=0)
        warped = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temp)(None, ours[b:b + 1].clone())) \
            if min_p > 0 else ours[b:b + 1]
        kept = min_p_filtered(ours[b:b + 1] / temp, [min_p])
        assert torch.equal(kept.isinf(), warped.isinf()), b


def test_a_tiny_top_p_at_temperature_1_is_greedy() -> None:
    x = torch.randn(3, 49152, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, top_p=5e-324, seed=i) for i in range(3)]
    assert torch.equal(sample(x, params, [make_generator(p) for p in params]), x.argmax(-1))


@pytest.mark.parametrize("where", ["one engine", "lookahead", "P/D"])
def test_repetition_penalty_is_hf_s_over_prompt_and_output(model: Llama, where: str) -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    ids = prompt(12, 4)
    hf = RepetitionPenaltyLogitsProcessor(1.8)
    want = reference(model, ids.tolist(), 10, lambda logits, made, seq: hf(torch.tensor([seq]), logits))
    penalized = SamplingParams(temperature=0.0, repetition_penalty=1.8)
    plain = SamplingParams(temperature=0.0)
    eng = engine(model, lookahead=where == "lookahead")
    decode_on = engine(model) if where == "P/D" else None
    got = run(eng, {"p": ids, "q": prompt(9, 5)}, {"p": penalized, "q": plain}, 10, decode_on=decode_on)
    assert tokens(got["p"]) == want
    assert tokens(got["p"]) != reference(model, ids.tolist(), 10, lambda logits, made, seq: logits)
    # the unpenalized batch mate decodes as it would alone
    assert tokens(got["q"]) == reference(model, prompt(9, 5).tolist(), 10, lambda logits, made, seq: logits)
    for e in (eng, decode_on or eng):
        for rid in list(e._seqs):
            e.release(rid)
        assert not e.rows.live and e.cache.num_free == 8


def test_presence_and_frequency_penalties_are_openai_s_over_the_output(model: Llama) -> None:
    ids = prompt(10, 6)

    def openai(logits, made, seq):
        counts = torch.bincount(torch.tensor(made, dtype=torch.long), minlength=CFG.vocab_size).float()
        return logits - 1.5 * counts - 0.7 * (counts > 0).float()

    want = reference(model, ids.tolist(), 12, openai)
    got = run(engine(model), {"p": ids}, {"p": SamplingParams(temperature=0.0, frequency_penalty=1.5,
                                                               presence_penalty=0.7)}, 12)
    assert tokens(got["p"]) == want


def test_a_penalized_kv_import_without_the_prompt_fails_naming_it(model: Llama) -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    first = engine(model).run_batch([call("a", {"input_ids": prompt(5, 1)}, params, export=frozenset({"kv"}))])[0]
    step = call("a", {"token": first.outputs["token"], "kv": first.outputs["kv"]}, params)
    (result,) = engine(model).run_batch([step])
    assert isinstance(result, ValueError) and "prompt_ids" in str(result)


def test_min_tokens_masks_the_stop_tokens_for_that_many_tokens_of_the_walk(model: Llama) -> None:
    ids = prompt(8, 7)
    free = tokens(run(engine(model), {"a": ids}, {"a": SamplingParams(temperature=0.0)}, 6)["a"])
    stop = {"a": (free[0], free[2])}  # greedy would stop at once
    stopped = run(engine(model), {"a": ids}, {"a": SamplingParams(temperature=0.0)}, 6, stops=stop)["a"]
    assert len(stopped) == 1 and stopped[0].stop
    held = run(engine(model), {"a": ids}, {"a": SamplingParams(temperature=0.0, min_tokens=3)}, 6, stops=stop)["a"]
    made = tokens(held)
    assert not set(made[:3]) & set(stop["a"]) and not any(r.stop for r in held[:3])
    masked = full_logits(model, ids.tolist())[-1].clone()
    masked[list(stop["a"])] = float("-inf")
    assert made[0] == int(masked.argmax())  # the next most likely token


@pytest.mark.parametrize("lookahead", [False, True])
def test_logprobs_are_the_log_softmax_of_the_model_s_logits(model: Llama, lookahead: bool) -> None:
    ids = prompt(11, 8)
    params = {"a": SamplingParams(temperature=0.9, seed=3, logprobs=5, prompt_logprobs=2, repetition_penalty=1.3),
              "b": SamplingParams(temperature=0.0, logprobs=0), "c": SamplingParams(temperature=0.0)}
    got = run(engine(model, lookahead=lookahead), {"a": ids, "b": prompt(6, 9), "c": prompt(7, 10)}, params, 5)
    for rid, k in (("a", 5), ("b", 0)):
        seq = (ids if rid == "a" else prompt(6, 9)).tolist()
        made = tokens(got[rid])
        ref = full_logits(model, seq + made[:-1]).log_softmax(-1)[len(seq) - 1:]  # the logits each token came from
        for step, result in enumerate(got[rid]):
            table = result.outputs["logprobs"]
            assert table.shape == (1 + k, 2) and table.dtype == torch.float64
            assert int(table[0, 0]) == made[step]
            torch.testing.assert_close(table[0, 1].float(), ref[step, made[step]], atol=1e-5, rtol=0)
            top = ref[step].topk(k) if k else None
            if top is not None:
                assert table[1:, 0].long().tolist() == top.indices.tolist()
                torch.testing.assert_close(table[1:, 1].float(), top.values, atol=1e-5, rtol=0)
    assert all("logprobs" not in r.outputs for r in got["c"])  # a row that asks for none gets none
    prompt_lp = got["a"][0].outputs["prompt_logprobs"]
    full = full_logits(model, ids.tolist()).log_softmax(-1)
    assert prompt_lp.shape == (10, 3, 2)
    torch.testing.assert_close(prompt_lp[:, 0, 1].float(), full[:-1].gather(1, ids[1:, None])[:, 0], atol=1e-5,
                               rtol=0)
    assert prompt_lp[:, 1:, 0].long().tolist() == full[:-1].topk(2).indices.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_with_graphs_and_lookahead_the_knobs_give_what_the_cpu_gives(model: Llama) -> None:
    gpu = Llama(CFG).to("cuda").eval().requires_grad_(False)
    gpu.load_state_dict(model.state_dict())
    gpu.init_rope_tables()
    cache = StaticKVCache(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, max_slots=9, max_seq_len=64, device="cuda")
    eng = KVCacheEngine(gpu, cache, torch.device("cuda"), replace(PLAIN, cuda_graphs=True, lookahead=True,
                                                                   prefill_graphs=True, prefill_in_flight=True),
                        grammar_tokenizer=ByteTokenizer.build)
    eng.warmup()
    params = {"p": SamplingParams(temperature=0.0, repetition_penalty=1.8, logprobs=2, prompt_logprobs=1),
              "f": SamplingParams(temperature=0.0, frequency_penalty=1.0, min_tokens=3),
              "g": SamplingParams(temperature=0.0, guided=GuidedSpec("regex", "[a-e]{6}"), logprobs=0),
              "q": SamplingParams(temperature=0.0)}
    prompts = {r: prompt(6 + i, 40 + i) for i, r in enumerate(params)}
    stops = {"f": tuple(range(0, CFG.vocab_size, 4)), "g": (100,)}
    want = run(engine(model, grammar_tokenizer=ByteTokenizer.build), prompts, params, 9, stops=stops)
    got = run(eng, prompts, params, 9, stops=stops)
    for r in params:
        assert tokens(got[r]) == tokens(want[r]), r
        for x, y in zip(got[r], want[r]):
            for name in ("logprobs", "prompt_logprobs"):
                if name in y.outputs:
                    torch.testing.assert_close(x.outputs[name], y.outputs[name], atol=1e-4, rtol=0)
    assert text(tokens(got["g"])) and set(text(tokens(got["g"]))) <= set("abcde")
    assert eng.ahead_rows_used > 0


def test_logprobs_with_lookahead_equal_those_without(model: Llama) -> None:
    params = {r: SamplingParams(temperature=0.8, seed=i, logprobs=3, min_tokens=2, frequency_penalty=0.5)
              for i, r in enumerate("abc")}
    prompts = {r: prompt(5 + i, 20 + i) for i, r in enumerate("abc")}
    stops = {r: tuple(range(0, CFG.vocab_size, 10)) for r in prompts}  # masked for each walk's first 2 tokens
    plain = run(engine(model), prompts, params, 8, stops=stops)
    eng = engine(model, lookahead=True)
    ahead = run(eng, prompts, params, 8, stops=stops)
    assert eng.ahead_rows_used > 0
    for r in prompts:
        assert tokens(ahead[r]) == tokens(plain[r])
        for x, y in zip(ahead[r], plain[r]):  # the same numbers, up to the rounding of another batch's forward
            torch.testing.assert_close(x.outputs["logprobs"], y.outputs["logprobs"], atol=1e-5, rtol=0)


class ByteTokenizer:
    """An llguidance tokenizer over the tiny model's vocabulary: ids 0-94 are the printable ASCII characters, 100 is
    EOS (what a family builds from its tokenizer.json)."""

    @staticmethod
    def build():
        import llguidance
        from llguidance import TokenizerWrapper

        class Words:
            eos_token_id = 100
            bos_token_id = None
            tokens = [bytes([32 + i]) for i in range(95)] + [b"<%d>" % i for i in range(95, 101)]
            special_token_ids = [100]

            def __call__(self, text: bytes | str) -> list[int]:
                data = text.encode() if isinstance(text, str) else text
                return [b - 32 for b in data]

        return llguidance.LLTokenizer(TokenizerWrapper(Words()), n_vocab=CFG.vocab_size)


def text(ids: list[int]) -> str:
    return "".join(chr(32 + i) for i in ids if i < 95)


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_grammar_row_writes_its_language_and_opts_out_of_lookahead(model: Llama, lookahead: bool) -> None:
    pytest.importorskip("llguidance")
    spec = {"r": GuidedSpec("regex", "(yes|no|maybe)!"), "c": GuidedSpec("choice", json.dumps(["alpha", "beta"])),
            "j": GuidedSpec("json_schema", json.dumps({"type": "object", "properties": {
                "n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
                "additionalProperties": False}))}
    for seed in range(4):
        eng = engine(model, lookahead=lookahead, grammar_tokenizer=ByteTokenizer.build)
        params = {r: SamplingParams(temperature=1.0, seed=seed, guided=g) for r, g in spec.items()}
        params["free"] = SamplingParams(temperature=1.0, seed=seed)
        prompts = {r: prompt(4 + i, seed * 10 + i) for i, r in enumerate(params)}
        ahead = []  # whether a lookahead step was left in flight after a step with a grammar row
        got = run(eng, prompts, params, 30, stops={r: (100,) for r in params},
                  after_step=lambda e, live: ahead.append(e._ahead is not None) if set(live) & set(spec) else None)
        made = {r: tokens(got[r]) for r in got}
        assert made["r"][-1] == 100 and text(made["r"]) in ("yes!", "no!", "maybe!")
        assert made["c"][-1] == 100 and text(made["c"]) in ("alpha", "beta")
        assert made["j"][-1] == 100 and list(json.loads(text(made["j"]))) == ["n"]
        assert ahead and not any(ahead)  # no step with a grammar row launched the next one ahead
        for r in list(eng._seqs):
            eng.release(r)
        assert not eng.rows.live and not any(r in eng.rows.guided for r in params)


@pytest.mark.parametrize("kind, spec, words", [
    ("json_schema", '{"type": "array", "uniqueItems": true}', "uniqueItems"),
    ("json_schema", '{"type": "string", "format": "no-such-format"}', "no-such-format"),
    ("json_schema", "{not json", "not valid JSON"),
    ("regex", "a[bc", "unclosed character class"),
    ("choice", '["a", 3]', "list of non-empty strings"),
    ("grammar", "start: nothing_defined", "nothing_defined"),
])
def test_an_unsupported_grammar_is_a_value_error_naming_it(kind: str, spec: str, words: str) -> None:
    pytest.importorskip("llguidance")
    with pytest.raises(ValueError, match=words):
        compile_guided(kind, spec)


@pytest.mark.parametrize("lookahead", [False, True])
def test_a_bias_that_allows_a_window_draws_the_tokens_and_logprobs_of_the_whole_vocabulary(model: Llama,
                                                                                         lookahead: bool) -> None:
    """A speech LLM's bias allows its audio codes alone: the engine then draws over that slice of the logits (engine
    ``window``). Top-p, penalties (whose history holds prompt tokens outside the window), ``min_tokens`` and logprobs
    must give what the same bias gives over the whole vocabulary (there the first and last ids are allowed at -1e4,
    which spans the window over everything and changes no probability)."""
    window = torch.full((CFG.vocab_size,), float("-inf"))
    window[30:80] = 0.0
    window[55] = float("-inf")  # a forbidden id inside the window stays forbidden
    whole = window.clone()
    whole[0] = whole[-1] = -1e4
    params = {"a": SamplingParams(temperature=0.8, top_p=0.9, seed=3, logprobs=3, repetition_penalty=1.5),
              "b": SamplingParams(temperature=1.0, seed=4, min_tokens=4, frequency_penalty=0.5),
              "c": SamplingParams(temperature=0.0, logprobs=1)}
    prompts = {"a": prompt(9, 1), "b": prompt(5, 2), "c": prompt(7, 3)}
    stops = {"b": (40, 90)}  # 90: a stop id outside the window
    runs = {}
    for name, bias in (("window", window), ("whole", whole)):
        eng = engine(model, lookahead=lookahead, logit_bias=bias)
        assert (eng.rows.window is not None) == (name == "window")
        runs[name] = run(eng, prompts, params, 8, stops=stops)
    for rid in prompts:
        got, want = runs["window"][rid], runs["whole"][rid]
        assert tokens(got) == tokens(want)
        assert all(30 <= t < 80 and t != 55 for t in tokens(got))
        for g, w in zip(got, want):
            if "logprobs" in w.outputs:
                torch.testing.assert_close(g.outputs["logprobs"], w.outputs["logprobs"], atol=1e-5, rtol=0)
    assert len(set(tokens(runs["window"]["a"]))) > 1  # drawn, not a constant: the comparison is not vacuous
