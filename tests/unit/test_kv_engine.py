"""KVCacheEngine's batched prefill on a tiny random Llama (engine/kv_engine.py).

A failure here means decode steps run one ahead (lookahead) give other tokens than steps run one at a time, or
prompts that arrive together change each other's output when they share a prefill forward
(right padding leaks into a row's logits or its KV), the token budget is not honoured, a request without a free
slot is lost instead of handed over again, or one bad prompt fails the others in its batch. A call the engine does
not answer in a turn is ``Held`` with the reason its scheduler gives (engine/scheduler.py): a wrong reason means the
engine took another branch of its policy than the test describes.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from models.llama.config import LlamaConfig
from models.llama.model import Llama
from mstar_dist.config.engine import EngineConfig
from mstar_dist.engine.component import WalkContext
from mstar_dist.engine.kv_cache import StaticKVCache
from mstar_dist.engine.kv_engine import KVCacheEngine
from mstar_dist.engine.sampling import SamplingParams
from mstar_dist.engine.scheduler import (
    BEHIND_PREFILL, DECODE_YIELD, GATHERING, JOINED_LOOKAHEAD, NO_FREE_SLOT, PREFILL_IN_FLIGHT, PREFILL_RUNNING,
    PREFILLS_FIRST, Held, Scheduler,
)
from mstar_dist.graph.walk import NodeCall, NodeResult

CFG = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, n_layers=2, n_heads=4, n_kv_heads=2,
                  head_dim=16, rope_theta=10000.0, max_position_embeddings=128)


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    return Llama(CFG).eval().requires_grad_(False)


PLAIN = EngineConfig(cuda_graphs=False, prefill_graphs=False, lookahead=False, prefill_in_flight=False,
                     decode_yield_ms=0.0)
"""Every policy off: each test turns on what it tests."""


def config(**knobs) -> EngineConfig:
    return replace(PLAIN, **knobs)


def engine(model: Llama, slots: int = 8, budget: int = 4096, lookahead: bool = False,
           max_seq_len: int = 64) -> KVCacheEngine:
    cache = StaticKVCache(n_layers=CFG.n_layers, n_kv_heads=CFG.n_kv_heads, head_dim=CFG.head_dim,
                          max_slots=slots, max_seq_len=max_seq_len)
    return KVCacheEngine(model, cache, torch.device("cpu"), config(prefill_token_budget=budget, lookahead=lookahead))


def on_cuda(model: Llama) -> Llama:
    """A copy of the test model on the GPU."""
    gpu = Llama(CFG).to("cuda").eval().requires_grad_(False)
    gpu.load_state_dict(model.state_dict())
    gpu.init_rope_tables()
    return gpu


def cuda_engine(gpu: Llama, slots: int = 9, **kwargs) -> KVCacheEngine:
    """A warmed-up engine with decode graphs on ``gpu`` (one of the ``slots`` is the graphs' scratch slot)."""
    cache = StaticKVCache(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, max_slots=slots, max_seq_len=64, device="cuda")
    eng = KVCacheEngine(gpu, cache, torch.device("cuda"), config(cuda_graphs=True, **kwargs))
    eng.warmup()
    return eng


def call(request_id: str, inputs: dict, *, seed: int = 0, temperature: float = 0.0,
         export: frozenset[str] = frozenset()) -> NodeCall:
    ctx = WalkContext(request_id=request_id, walk="w", walk_index=0, seed=seed,
                      sampling=SamplingParams(temperature=temperature, seed=seed), export=export)
    return NodeCall(run=SimpleNamespace(request_id=request_id, ctx=ctx), node="LLM", inputs=inputs, iteration=0)


def held(results: list) -> bool:
    """Whether any call of a turn was held (handed over again by the worker next turn)."""
    return any(isinstance(r, Held) for r in results)


def prompt(n: int, salt: int) -> torch.Tensor:
    return torch.randint(CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(salt))


def generate(eng: KVCacheEngine, calls: list[NodeCall], steps: int) -> dict[str, list[int]]:
    """Prefill ``calls`` in one run_batch, then decode them together ``steps`` times; every token per request."""
    out = {c.request_id: [int(r.outputs["token"])] for c, r in zip(calls, eng.run_batch(calls))}
    for _ in range(steps):
        step = [call(rid, {"token": torch.tensor([toks[-1]])}, seed=c.ctx.seed, temperature=c.ctx.sampling.temperature)
                for c, (rid, toks) in zip(calls, out.items())]
        for c, s in zip(calls, step):
            s.run.ctx.state.update(c.ctx.state)  # the request's generator carries over, as in a walk
        for (rid, toks), result in zip(out.items(), eng.run_batch(step)):
            toks.append(int(result.outputs["token"]))
    return out


def test_ragged_prompts_in_one_prefill_give_what_each_gives_alone(model: Llama) -> None:
    lengths = [5, 17, 9, 1, 30]
    knobs = [(0.0, 0), (0.9, 11), (0.0, 0), (1.0, 5), (0.7, 3)]

    def calls():
        return [call(f"r{i}", {"input_ids": prompt(n, i)}, temperature=t, seed=s)
                for i, (n, (t, s)) in enumerate(zip(lengths, knobs))]

    alone = {}
    for c in calls():
        alone.update(generate(engine(model), [c], steps=6))
    eng = engine(model)
    together = generate(eng, calls(), steps=6)
    assert together == alone
    assert eng.prefill_batches == 1 and eng.prefills == len(lengths)


def test_exported_kv_of_a_padded_row_equals_its_prefill_alone(model: Llama) -> None:
    export = frozenset({"kv"})
    alone = engine(model).run_batch([call("a", {"input_ids": prompt(7, 1)}, export=export)])[0]
    eng = engine(model)
    short, _ = eng.run_batch([call("a", {"input_ids": prompt(7, 1)}, export=export),
                              call("b", {"input_ids": prompt(20, 2)}, export=export)])
    assert short.outputs["kv"].shape == alone.outputs["kv"].shape == (CFG.n_layers, 2, CFG.n_kv_heads, 7, 16)
    torch.testing.assert_close(short.outputs["kv"], alone.outputs["kv"], atol=1e-5, rtol=1e-5)
    assert eng.cache.num_free == 8  # exported prefills give their slots back at once


def test_token_budget_cuts_the_batch_and_a_request_without_a_slot_waits(model: Llama) -> None:
    eng = engine(model, slots=3, budget=40)
    calls = [call(f"r{i}", {"input_ids": prompt(n, i)}) for i, n in enumerate([10, 10, 25, 4])]
    results = eng.run_batch(calls)
    # slots for three: [10, 10] share a forward (2 x 10 <= 40), 25 would pad them to 75 tokens: its own forward
    assert eng.prefill_batches == 2 and eng.prefills == 3
    assert all(isinstance(r, NodeResult) for r in results[:3]) and results[3] is NO_FREE_SLOT  # until a slot frees
    eng.release("r0")
    assert isinstance(eng.run_batch([calls[3]])[0], NodeResult)


def test_a_bad_prompt_fails_alone(model: Llama) -> None:
    eng = engine(model)
    results = eng.run_batch([call("ok", {"input_ids": prompt(6, 1)}), call("empty", {"input_ids": torch.tensor([])}),
                             call("long", {"input_ids": prompt(64, 2)}), call("ok2", {"input_ids": prompt(3, 3)})])
    assert isinstance(results[1], ValueError) and "empty prompt" in str(results[1])
    assert isinstance(results[2], ValueError) and "context is 64" in str(results[2])
    assert int(results[0].outputs["token"].numel()) == 1 and int(results[3].outputs["token"].numel()) == 1
    assert eng.prefill_batches == 1 and eng.cache.num_free == 6


def test_models_with_stateful_padding_share_forwards_only_at_one_length(model: Llama) -> None:
    import copy

    coupled = copy.copy(model)
    coupled.pads_are_inert = False  # a model whose pads are not inert (a stateful MoE router would count them)
    eng = engine(coupled)
    eng.run_batch([call(f"r{i}", {"input_ids": prompt(n, i)}) for i, n in enumerate([5, 8, 5, 8, 3])])
    assert eng.prefill_batches == 3 and eng.prefills == 5


def run_schedule(eng: KVCacheEngine, steps: int, sampled: bool = True, routed: bool = False) -> dict[str, list[int]]:
    """Requests that come and go the way a server's do, driven through ``eng``: every request's tokens.

    r0..r2 start together; r3 arrives at step 3; r1 is stopped by its client (released) at step 5; r2 skips
    steps 4 and 5 (its walk waits on something else) and resumes; r4 arrives at step 6 with a KV cache made
    elsewhere (a P/D decode rank's first step); at step 7 r0 is fed a token this engine did not sample; r3 is
    r0, r2 and r5 sampled with seeds, the rest greedy; r5 runs into the context limit. ``routed``: a request's next
    call brings the very token tensor its last result held, as a walk routes it (otherwise a new tensor of its value)."""
    knobs = {"r0": (0.8, 7), "r1": (0.0, 0), "r2": (0.7, 5), "r3": (1.0, 3), "r4": (0.0, 0), "r5": (0.9, 1)}
    if not sampled:  # every row greedy
        knobs = {rid: (0.0, 0) for rid in knobs}
    calls: dict[str, NodeCall] = {}
    out: dict[str, list[int]] = {}
    retry: dict[str, NodeCall] = {}
    handed: dict[str, torch.Tensor] = {}

    def make(rid: str, inputs: dict) -> NodeCall:
        t, seed = knobs[rid]
        c = call(rid, inputs, temperature=t, seed=seed)
        if rid in calls:
            c.run.ctx.state.update(calls[rid].ctx.state)  # the request's generator carries over, as in a walk
        calls[rid] = c
        return c

    donor = KVCacheEngine(eng.model, StaticKVCache(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, max_slots=1,
                                                   max_seq_len=64, device=eng.device), eng.device, PLAIN, name="donor")
    kv = donor.run_batch([call("r4", {"input_ids": prompt(11, 4)}, export=frozenset({"kv"}))])[0]
    live = {"r0", "r1", "r2", "r5"}
    first = [make(rid, {"input_ids": prompt(n, i)}) for i, (rid, n) in enumerate([("r0", 6), ("r1", 9), ("r2", 4),
                                                                                    ("r5", 52)])]
    for c, r in zip(first, eng.run_batch(first)):
        out[c.request_id] = [int(r.outputs["token"])]
    for step in range(steps):
        batch = []
        if step == 3:
            live.add("r3")
            batch.append(make("r3", {"input_ids": prompt(13, 3)}))
        if step == 5:
            live.discard("r1")
            eng.release("r1")
        if step == 6:
            live.add("r4")
            out["r4"] = [int(kv.outputs["token"])]
            batch.append(make("r4", {"token": kv.outputs["token"].clone(), "kv": kv.outputs["kv"]}))
        for rid in sorted(live):
            if rid in {c.request_id for c in batch} or (rid == "r2" and step in (4, 5)):
                continue
            if rid in retry:  # held last step (it joined the lookahead, or a prefill went first): the same call
                batch.append(retry.pop(rid))
                continue
            if rid == "r0" and step == 7:
                given = torch.tensor([42])
            else:
                given = handed[rid] if routed and rid in handed else torch.tensor([out[rid][-1]])
            batch.append(make(rid, {"token": given}))
        for c, r in zip(batch, eng.run_batch(batch)):
            if isinstance(r, Held):
                retry[c.request_id] = c
                continue
            if isinstance(r, BaseException):
                assert c.request_id == "r5" and "context limit" in str(r)
                live.discard("r5")
                eng.release("r5")
                out["r5"].append(-1)
                continue
            out.setdefault(c.request_id, []).append(int(r.outputs["token"]))
            handed[c.request_id] = r.outputs["token"]
    return out


def test_lookahead_gives_the_tokens_of_steps_run_one_at_a_time(model: Llama) -> None:
    plain = run_schedule(engine(model), steps=14)
    eng = engine(model, lookahead=True)
    ahead = run_schedule(eng, steps=14)
    # a request that came while a lookahead step was in use joined the next launch: its tokens are the same, each one
    # step later, so it has one token fewer after the 14 steps; every other request has exactly the same tokens
    joined = {rid for rid in plain if len(ahead[rid]) == len(plain[rid]) - 1}
    # r3 and r4 arrived mid-run, r2 came back after skipping two steps, r0 was fed a token it did not sample
    assert joined == {"r0", "r2", "r3", "r4"}
    assert all(ahead[rid] == plain[rid][:len(ahead[rid])] for rid in plain), (ahead, plain)
    assert eng.stats()["decode_rows_joined_total"] == eng.joined_rows == 4
    assert plain["r5"][-1] == -1  # r5 did reach the context limit in both
    # the rows it ran ahead were used in steady steps and dropped where requests left, skipped or changed token
    assert eng.ahead_rows_used > 20 and eng.ahead_rows_dropped >= 3
    assert eng.stats()["lookahead_rows_used_total"] == eng.ahead_rows_used
    # the tensors it handed out, routed back as a walk routes them, are claimed by identity: the same tokens, the same
    # rows run ahead used and dropped
    routed = engine(model, lookahead=True)
    assert run_schedule(routed, steps=14, routed=True) == ahead
    assert (routed.ahead_rows_used, routed.ahead_rows_dropped) == (eng.ahead_rows_used, eng.ahead_rows_dropped)
    for rid in list(eng._seqs):
        eng.release(rid)
    assert eng.cache.num_free == 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lookahead_with_cuda_graphs_gives_the_tokens_of_steps_run_one_at_a_time(model: Llama) -> None:
    gpu = on_cuda(model)

    def make(lookahead: bool) -> KVCacheEngine:
        return cuda_engine(gpu, lookahead=lookahead)

    plain = run_schedule(make(False), steps=14, sampled=False)
    eng = make(True)
    ahead = run_schedule(eng, steps=14, sampled=False)
    assert all(ahead[rid] == plain[rid][:len(ahead[rid])] and len(ahead[rid]) >= len(plain[rid]) - 1
               for rid in plain), (ahead, plain)  # joining rows: one step later (the CPU test above says which)
    assert eng.ahead_rows_used > 20 and eng.ahead_rows_dropped >= 3 and eng.joined_rows == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_prefill_runs_beside_the_decode_step_in_flight_unless_it_takes_a_slot_that_step_writes(model: Llama) -> None:
    """A prefill that arrives while a lookahead step is on the GPU replays on the engine's side stream and its first
    token reaches the host before that step ends; its tokens, and the decoding requests', are those of an engine that
    runs everything on one stream. A prefill given the slot of a request whose dropped row the step still writes
    waits behind it."""
    gpu = on_cuda(model)

    def make(prefill_stream: bool) -> KVCacheEngine:
        # 4 slots: the graphs' scratch, r0, r1 and r2; r3 can only have the one r0 lets go
        return cuda_engine(gpu, slots=4, lookahead=True, prefill_graphs=True, prefill_stream=prefill_stream)

    def run(eng: KVCacheEngine, hold_gpu: bool) -> tuple[dict[str, list[int]], list[bool]]:
        out: dict[str, list[int]] = {}
        retry: dict[str, NodeCall] = {}
        still_busy = []

        def turn(batch: list[NodeCall]) -> None:
            for c, r in zip(batch, eng.run_batch(batch)):
                if isinstance(r, Held):
                    retry[c.request_id] = c
                else:
                    out.setdefault(c.request_id, []).append(int(r.outputs["token"]))

        def decoding(skip: set[str] = frozenset()) -> list[NodeCall]:
            return [retry.pop(rid) if rid in retry else call(rid, {"token": torch.tensor([toks[-1]])})
                    for rid, toks in out.items() if rid not in skip]

        turn([call("r0", {"input_ids": prompt(7, 0)}), call("r1", {"input_ids": prompt(12, 1)})])
        for _ in range(3):
            turn(decoding())  # a lookahead step is now in flight
        for rid, skip in (("r2", set()), ("r3", {"r0"})):
            if skip:
                eng.release("r0")  # r0 leaves: its slot is free, but the step in flight still writes its dropped row
                del out["r0"]
            if hold_gpu:  # keep that step on the GPU for a while: the engine sees it in flight
                torch.cuda._sleep(200_000_000)
                eng._ahead.ready = torch.cuda.Event()
                eng._ahead.ready.record()
            busy = eng._ahead.ready
            turn([call(rid, {"input_ids": prompt(9, 2)})])
            still_busy.append(not busy.query())
            for _ in range(4):
                turn(decoding())
        return out, still_busy

    plain, _ = run(make(False), hold_gpu=False)
    eng = make(True)
    beside, busy = run(eng, hold_gpu=True)
    assert beside == plain
    # r2's first token came back while the decode step was still on the GPU; r3 took r0's slot and waited for it
    assert busy == [True, False]
    assert eng.prefill_batches_beside == 1 and eng.stats()["prefill_batches_beside_decode_total"] == 1


def test_with_prefill_graphs_every_batch_fits_a_bucket_and_an_overlong_prompt_runs_alone(model: Llama) -> None:
    """The grouping the engine does for prefill graphs (bucket_for needs no capture, so this runs on CPU)."""
    from mstar_dist.engine.cuda_graphs import PrefillGraphs

    eng = engine(model, slots=8, budget=128, max_seq_len=200)
    graphs = PrefillGraphs(model, eng.cache, scratch_slot=7, max_rows=4, max_tokens=128)
    assert sorted({length for _, length in graphs.buckets}) == [16, 24, 32, 48, 64, 96, 128]
    plan = Scheduler(token_budget=128, ragged=True, buckets=graphs.buckets)  # what the engine's scheduler gets
    lengths = [5, 12, 20, 150, 30, 3, 9]
    groups = plan.groups([(i, f"r{i}", n) for i, n in enumerate(lengths)])
    # first fit in arrival order: 3 does not fit the first batch (4 rows at most) nor join the overlong prompt
    assert [[lengths[i] for i in g] for g in groups] == [[5, 12, 20, 30], [150], [3, 9]]
    buckets = [graphs.bucket_for(len(g), max(lengths[i] for i in g)) for g in groups]
    assert buckets == [(4, 32), None, (2, 16)]  # what the forwards replay, each within the budget
    # three 35-token prompts: 105 tokens fit the budget unpadded, but their bucket would be (4, 48), 192 tokens
    three = [(i, f"r{i}", 35) for i in range(3)]
    assert [len(g) for g in plan.groups(three)] == [2, 1]
    plan.buckets = None
    assert [len(g) for g in plan.groups(three)] == [3]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("where", ["cpu", "cuda"])  # inline prompts stay on the host; another rank's are on the GPU
def test_prefills_replayed_from_cuda_graphs_give_the_tokens_of_eager_prefills(model: Llama, where: str) -> None:
    gpu = on_cuda(model)

    def make(prefill_graphs: bool, budget: int = 4096) -> KVCacheEngine:
        return cuda_engine(gpu, lookahead=False, prefill_token_budget=budget, prefill_graphs=prefill_graphs)

    def calls():  # ragged: bucket (8, 32) for the five together, each alone its own
        return [call(f"r{i}", {"input_ids": prompt(n, i).to(where)}) for i, n in enumerate([5, 17, 9, 1, 30])]

    eager = generate(make(False), calls(), steps=6)
    replayed = make(True)
    assert generate(replayed, calls(), steps=6) == eager
    assert replayed.prefill_batches_replayed == replayed.prefill_batches == 1
    alone = make(True)
    for c in calls():
        assert generate(alone, [c], steps=6)[c.request_id] == eager[c.request_id]
        alone.release(c.request_id)
    assert alone.prefill_batches_replayed == 5
    tight = make(True, budget=64)  # 5 rows x 32 is past the budget: cut into batches the buckets hold
    assert generate(tight, calls(), steps=6) == eager
    assert tight.prefill_batches_replayed == tight.prefill_batches > 1


def test_a_model_whose_rows_affect_each_other_never_looks_ahead(model: Llama) -> None:
    """A dropped lookahead row took part in its batch: with a batch-wide stateful MoE router it would have steered
    the routing of the rows that were kept."""
    import copy

    coupled = copy.copy(model)
    coupled.pads_are_inert = False
    assert engine(model, lookahead=True).lookahead and not engine(coupled, lookahead=True).lookahead


def test_a_new_prompt_gets_its_first_token_before_the_decode_step_of_the_others(model: Llama) -> None:
    # a turn holding prefills and decode rows answers the prefills at once and the decode rows next turn (the
    # first token of a new request does not wait for a decode step), never two turns in a row; tokens unchanged
    eng = engine(model)
    first = eng.run_batch([call("a", {"input_ids": prompt(7, 1)})])[0].outputs["token"]
    step_a = call("a", {"token": first})
    mixed = eng.run_batch([step_a, call("b", {"input_ids": prompt(5, 2)})])
    assert mixed[0] is PREFILLS_FIRST and mixed[1].outputs["token"].shape == (1,)
    assert eng.steps == 0
    again = eng.run_batch([step_a, call("c", {"input_ids": prompt(4, 3)})])  # never twice in a row
    assert isinstance(again[0], NodeResult) and isinstance(again[1], NodeResult) and eng.steps == 1
    reference = generate(engine(model), [call("a", {"input_ids": prompt(7, 1)})], steps=1)["a"]
    assert [int(first), int(again[0].outputs["token"])] == reference


def test_beside_prefills_new_decode_rows_join_a_launch_instead_of_holding_the_first_tokens_back(model: Llama) -> None:
    """With lookahead, a turn that runs prefills and decode rows no lookahead step has run (a request's first decode)
    launches those rows and holds them: run at once, their forward would queue behind the prefills on the
    GPU and the turn, with the prefills' first tokens, would wait for it. Next turn they take the launched step's
    tokens, which are those of an engine without lookahead."""
    eng = engine(model, lookahead=True)
    first = eng.run_batch([call("a", {"input_ids": prompt(7, 1)})])[0].outputs["token"]
    step_a = call("a", {"token": first})
    assert eng.run_batch([step_a, call("b", {"input_ids": prompt(5, 2)})])[0] is PREFILLS_FIRST  # waits a turn
    again = eng.run_batch([step_a, call("c", {"input_ids": prompt(4, 3)})])  # not twice: it goes, as a launch
    assert again[0] is JOINED_LOOKAHEAD and isinstance(again[1], NodeResult)
    assert eng.steps == 0 and eng.joined_rows == 1 and eng._ahead is not None
    done = eng.run_batch([step_a])[0]  # the same call, handed over again, claims the launched row
    assert isinstance(done, NodeResult) and eng.steps == 1 and eng.ahead_rows_used == 1
    reference = generate(engine(model), [call("a", {"input_ids": prompt(7, 1)})], steps=1)["a"]
    assert [int(first), int(done.outputs["token"])] == reference


class GpuClock:
    """Stands in for the CUDA events of the prefills an engine launches (CPU engine, ``prefill_in_flight``): each
    launch's copy of its first tokens is "on the GPU" until the test ends it."""

    def __init__(self, eng: KVCacheEngine) -> None:
        self.events: list[SimpleNamespace] = []
        plain = eng._copy_to_host

        def copy_to_host(tokens: torch.Tensor):
            host, _ = plain(tokens)
            event = SimpleNamespace(ended=False)
            event.query = lambda: event.ended
            event.synchronize = lambda: setattr(event, "ended", True)
            self.events.append(event)
            return host, event

        eng._copy_to_host = copy_to_host

    def end(self, k: int) -> None:
        self.events[k].ended = True


def in_flight_engine(model: Llama, slots: int = 8, lookahead: bool = False) -> tuple[KVCacheEngine, GpuClock]:
    cache = StaticKVCache(n_layers=CFG.n_layers, n_kv_heads=CFG.n_kv_heads, head_dim=CFG.head_dim, max_slots=slots,
                          max_seq_len=64)
    eng = KVCacheEngine(model, cache, torch.device("cpu"), config(prefill_in_flight=True, lookahead=lookahead))
    return eng, GpuClock(eng)


def test_prompts_that_arrive_while_a_prefill_is_on_the_gpu_go_as_one_batch_when_it_ends(model: Llama) -> None:
    """With ``prefill_in_flight`` a turn returns while its prefill is on the GPU (its call held, the engine
    pending); prompts that come meanwhile wait, and go as one forward in the turn that takes the first prefill's
    tokens. Every request's tokens are those of an engine that waits for each prefill."""
    eng, gpu = in_flight_engine(model)
    a, b, c = (call(rid, {"input_ids": prompt(n, i)}) for i, (rid, n) in enumerate([("a", 7), ("b", 12), ("c", 3)]))
    assert eng.run_batch([a]) == [PREFILL_RUNNING] and eng.pending()
    assert eng.run_batch([a, b]) == [PREFILL_RUNNING, PREFILL_IN_FLIGHT]
    assert eng.run_batch([a, b, c]) == [PREFILL_RUNNING, PREFILL_IN_FLIGHT, PREFILL_IN_FLIGHT]
    assert len(gpu.events) == 1 and eng.stats()["prefills_held_total"] == 2  # b and c wait for a's prefill
    gpu.end(0)
    first = eng.run_batch([a, b, c])
    assert isinstance(first[0], NodeResult) and first[1:] == [PREFILL_RUNNING] * 2  # a's token; b and c launched
    assert len(gpu.events) == 2 and eng.pending()
    gpu.end(1)
    rest = eng.run_batch([b, c])
    assert all(isinstance(r, NodeResult) for r in rest) and not eng.pending() and eng.prefill_batches == 2
    got = {"a": int(first[0].outputs["token"]), "b": int(rest[0].outputs["token"]),
           "c": int(rest[1].outputs["token"])}
    waiting = engine(model)  # each prefill waited for
    want = {x.request_id: int(r.outputs["token"]) for x, r in zip((a, b, c), waiting.run_batch(
        [call(rid, {"input_ids": prompt(n, i)}) for i, (rid, n) in enumerate([("a", 7), ("b", 12), ("c", 3)])]))}
    assert got == want
    # decoding goes on from the slots those prefills filled
    step = [call(rid, {"token": torch.tensor([tok])}) for rid, tok in got.items()]
    ref = [call(rid, {"token": torch.tensor([tok])}) for rid, tok in got.items()]
    assert [int(r.outputs["token"]) for r in eng.run_batch(step)] == \
        [int(r.outputs["token"]) for r in waiting.run_batch(ref)]


def test_a_second_call_for_a_request_whose_prefill_is_on_the_gpu_fails_alone(model: Llama) -> None:
    eng, gpu = in_flight_engine(model)
    a = call("a", {"input_ids": prompt(7, 1)})
    assert eng.run_batch([a]) == [PREFILL_RUNNING]
    gpu.end(0)
    again = eng.run_batch([call("a", {"input_ids": prompt(7, 1)}), a])  # two slots for one request would leak one
    assert isinstance(again[0], RuntimeError) and "prefill on the GPU" in str(again[0])
    assert isinstance(again[1], NodeResult)
    assert eng.cache.num_free == 7


def decoding_a_and_prompt_b(eng: KVCacheEngine, gpu: GpuClock) -> tuple[NodeCall, NodeCall, torch.Tensor]:
    """Request a prefilled (its first token out), its first decode call, and a new prompt b."""
    a = call("a", {"input_ids": prompt(7, 1)})
    eng.run_batch([a])
    gpu.end(0)
    tok_a = eng.run_batch([a])[0].outputs["token"]
    return call("a", {"token": tok_a}), call("b", {"input_ids": prompt(5, 2)}), tok_a


def test_decode_steps_run_while_a_prefill_is_on_the_gpu_and_wait_one_turn_for_its_first_tokens(model: Llama) -> None:
    eng, gpu = in_flight_engine(model)
    step_a, b, _ = decoding_a_and_prompt_b(eng, gpu)
    both = eng.run_batch([step_a, b])  # b launches and stays on the GPU: a's step is not held back for it
    assert isinstance(both[0], NodeResult) and both[1] is PREFILL_RUNNING and eng.steps == 1
    gpu.end(1)
    step_a2 = call("a", {"token": both[0].outputs["token"]})
    again = eng.run_batch([step_a2, b])  # b's first token goes out; a's step waits this one turn
    assert again[0] is PREFILLS_FIRST and isinstance(again[1], NodeResult) and eng.steps == 1
    assert isinstance(eng.run_batch([step_a2])[0], NodeResult) and eng.steps == 2


def test_a_lookahead_step_queued_behind_a_prefill_in_flight_is_not_waited_for(model: Llama) -> None:
    """The turn after a prefill's launch finds the lookahead step queued behind it: its rows are held and the
    turn returns at once (waiting would hold the rank, and the prompts arriving meanwhile, until both end); the step's
    tokens are taken once the prefill's have gone out, and they are an engine's that waits for everything."""
    eng, gpu = in_flight_engine(model, lookahead=True)
    step_a, b, tok_a = decoding_a_and_prompt_b(eng, gpu)
    # b on the GPU; a's first step launched behind it (lookahead)
    assert eng.run_batch([step_a, b]) == [JOINED_LOOKAHEAD, PREFILL_RUNNING]
    assert len(gpu.events) == 3
    assert eng.run_batch([step_a, b]) == [BEHIND_PREFILL, PREFILL_RUNNING] and eng.pending()
    assert not gpu.events[2].ended  # nobody waited for a's step
    gpu.end(1)
    out = eng.run_batch([step_a, b])  # b's first token; a's step waits this one turn
    assert out[0] is PREFILLS_FIRST and isinstance(out[1], NodeResult)
    gpu.end(2)
    tok_a2 = eng.run_batch([step_a])[0].outputs["token"]
    ref = engine(model)
    ref_a = ref.run_batch([call("a", {"input_ids": prompt(7, 1)})])[0].outputs["token"]
    assert int(ref_a) == int(tok_a)
    assert int(ref.run_batch([call("a", {"token": ref_a})])[0].outputs["token"]) == int(tok_a2)
    assert int(ref.run_batch([call("b", {"input_ids": prompt(5, 2)})])[0].outputs["token"]) == \
        int(out[1].outputs["token"])


def test_decode_steps_yield_to_prefills_on_the_gpu_for_at_most_decode_yield_s_in_a_row(model: Llama,
                                                                                        monkeypatch) -> None:
    """With ``decode_yield_s`` decode rows are held back while any prefill is on the GPU, across batches, but never
    longer than that in a row: then one step runs beside the prefills and a new hold begins. Their tokens are those of
    an engine that never holds them."""
    import mstar_dist.engine.scheduler as scheduler

    now = [100.0]
    monkeypatch.setattr(scheduler.time, "monotonic", lambda: now[0])
    cache = StaticKVCache(n_layers=CFG.n_layers, n_kv_heads=CFG.n_kv_heads, head_dim=CFG.head_dim, max_slots=8,
                          max_seq_len=64)
    eng = KVCacheEngine(model, cache, torch.device("cpu"), config(prefill_in_flight=True, decode_yield_ms=10.0))
    gpu = GpuClock(eng)
    step_a, b, tok_a = decoding_a_and_prompt_b(eng, gpu)
    assert eng.run_batch([step_a, b]) == [DECODE_YIELD, PREFILL_RUNNING] and eng.steps == 0  # b on the GPU
    gpu.end(1)
    c = call("c", {"input_ids": prompt(4, 3)})
    out = eng.run_batch([step_a, b, c])  # b's token; c launched; a still held (b's first token goes first)
    assert out[0] is PREFILLS_FIRST and isinstance(out[1], NodeResult) and out[2] is PREFILL_RUNNING
    assert eng.steps == 0
    now[0] += 0.009
    assert eng.run_batch([step_a, c]) == [DECODE_YIELD, PREFILL_RUNNING] and eng.steps == 0  # 9 ms held: within 10
    now[0] += 0.002
    ran = eng.run_batch([step_a, c])  # 11 ms: a's step runs beside c's prefill
    assert isinstance(ran[0], NodeResult) and ran[1] is PREFILL_RUNNING and eng.steps == 1
    step_a2 = call("a", {"token": ran[0].outputs["token"]})
    assert eng.run_batch([step_a2, c]) == [DECODE_YIELD, PREFILL_RUNNING]  # and a new hold begins
    gpu.end(2)  # c's prefill
    assert isinstance(eng.run_batch([step_a2, c])[1], NodeResult)
    assert isinstance(eng.run_batch([step_a2])[0], NodeResult)
    assert eng.steps == 2 and eng.stats()["decode_yields_total"] == 2
    ref = engine(model)
    want = generate(ref, [call("a", {"input_ids": prompt(7, 1)})], steps=1)["a"]
    assert [int(tok_a), int(ran[0].outputs["token"])] == want
    with pytest.raises(ValueError, match="decode_yield_ms = -1: must be a finite number >= 0"):
        config(prefill_in_flight=True, decode_yield_ms=-1)


def test_an_idle_engine_gathers_a_burst_of_prompts_into_one_forward(model: Llama, monkeypatch) -> None:
    """With ``prefill_gather_s`` an engine with nothing else to run holds prompts back while more keep coming (on a CPU
    the first of a burst went alone, the rest in one or two more forwards of a tenth of a second each): they go as one
    forward once none came for that long, or the oldest has waited ten times it; never while decode rows run. Their
    tokens are those of an engine that does not gather."""
    import mstar_dist.engine.scheduler as scheduler

    now = [100.0]
    monkeypatch.setattr(scheduler.time, "monotonic", lambda: now[0])
    cache = StaticKVCache(n_layers=CFG.n_layers, n_kv_heads=CFG.n_kv_heads, head_dim=CFG.head_dim, max_slots=32,
                          max_seq_len=64)
    eng = KVCacheEngine(model, cache, torch.device("cpu"), config(prefill_gather_ms=3.0))
    a, b, c = (call(rid, {"input_ids": prompt(n, i)}) for i, (rid, n) in enumerate([("a", 7), ("b", 12), ("c", 3)]))
    assert eng.run_batch([a]) == [GATHERING] and eng.pending()  # the worker hands it over again soon, not when woken
    now[0] += 0.002
    assert eng.run_batch([a, b]) == [GATHERING, GATHERING]  # b came 2 ms after a: more may follow
    now[0] += 0.0031
    first = eng.run_batch([a, b])  # nothing new for 3.1 ms: both go, in one forward
    assert not held(first) and eng.prefill_batches == 1 and not eng.pending()
    want = engine(model).run_batch([call(rid, {"input_ids": prompt(n, i)})
                                    for i, (rid, n) in enumerate([("a", 7), ("b", 12)])])
    assert [int(r.outputs["token"]) for r in first] == [int(r.outputs["token"]) for r in want]
    # decoding rows: a new prompt is not held for company
    steps = [call(x.request_id, {"token": r.outputs["token"]}) for x, r in zip((a, b), first)]
    out = eng.run_batch([*steps, c])
    assert isinstance(out[2], NodeResult) and eng.prefill_batches == 2
    # prompts that keep coming 2.1 ms apart go once the oldest has waited 30 ms, in one forward
    for rid in ("a", "b", "c"):
        eng.release(rid)
    burst = [call(f"r{k}", {"input_ids": prompt(4, 10 + k)}) for k in range(7)]
    for k in range(7):
        got = eng.run_batch(burst[: k + 1])
        if not held(got):
            break
        now[0] += 0.0021 if k < 6 else 0.0
    assert held(got)  # 12.6 ms: still coming
    for k in range(12):
        now[0] += 0.0021
        burst.append(call(f"s{k}", {"input_ids": prompt(4, 30 + k)}))
        got = eng.run_batch(burst)
        if not held(got):
            break
    assert k == 8 and len(got) == 16 and eng.prefill_batches == 3  # the oldest came 31.5 ms ago: all 16 go at once


def test_a_request_released_while_its_prefill_is_on_the_gpu_gives_its_slot_back(model: Llama) -> None:
    eng, gpu = in_flight_engine(model, slots=4)
    a, b = call("a", {"input_ids": prompt(7, 1)}), call("b", {"input_ids": prompt(9, 2)})
    eng.run_batch([a, b])
    assert eng.cache.num_free == 2
    eng.release("a")  # its client left: b still waits for the batch, a's slot comes back when it has ended
    assert eng.cache.num_free == 2 and eng.pending()
    gpu.end(0)
    assert isinstance(eng.run_batch([b])[0], NodeResult)
    assert eng.cache.num_free == 3 and "a" not in eng._seqs and not eng.pending()
    c = call("c", {"input_ids": prompt(5, 3)})
    eng.run_batch([c])
    eng.release("c")  # nobody is left waiting for that batch: it is given back at once
    assert not eng.pending() and eng.cache.num_free == 3 and gpu.events[1].ended


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_turn_returns_while_its_prefill_replays_and_the_next_prompts_share_one_batch(model: Llama) -> None:
    gpu = on_cuda(model)

    def make(in_flight: bool) -> KVCacheEngine:
        return cuda_engine(gpu, lookahead=True, prefill_graphs=True, prefill_in_flight=in_flight)

    lengths = [7, 12, 3, 20]

    def calls() -> list[NodeCall]:
        return [call(f"r{i}", {"input_ids": prompt(n, i)}) for i, n in enumerate(lengths)]

    waited = make(False)
    want = {c.request_id: int(r.outputs["token"]) for c, r in zip(calls(), waited.run_batch(calls()))}
    eng = make(True)
    first, *rest = calls()
    torch.cuda._sleep(200_000_000)  # the GPU is busy: r0's prefill queues behind this
    assert eng.run_batch([first]) == [PREFILL_RUNNING] and eng.pending()
    got: dict[str, int] = {}
    waiting = [first, *rest]
    while waiting:  # the worker's loop: the same calls, handed over again until answered
        results = eng.run_batch(waiting)
        got.update({c.request_id: int(r.outputs["token"]) for c, r in zip(waiting, results)
                    if not isinstance(r, Held)})
        waiting = [c for c, r in zip(waiting, results) if isinstance(r, Held)]
    assert got == want
    assert eng.prefill_batches == 2 and eng.stats()["prefills_held_total"] == 3  # r1..r3 waited, then went together
    assert not eng.pending()
