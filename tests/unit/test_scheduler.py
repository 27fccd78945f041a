"""The KV engine's turn policy alone (mstar_dist/engine/scheduler.py), without torch or a model.

A failure here points at a decision, not at its execution: a prompt batched past the token budget or a bucket, a
prompt launched while a prefill is on the device (it should wait and go with the others), a burst not gathered (or
gathered while the engine is busy), decode rows held two turns in a row, a yield that never ends, or a held call
answered without the reason the worker and the metrics see. The engine's own tests (test_kv_engine.py) check that it
executes these plans with the tokens of an engine that never holds anything.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import mstar_dist.engine.scheduler as scheduler
from mstar_dist.engine.scheduler import (
    BEHIND_PREFILL, DECODE_YIELD, GATHERING, NO_FREE_SLOT, PREFILL_IN_FLIGHT, PREFILLS_FIRST, STEP,
    STEP_BESIDE_PREFILLS, Held, Scheduler,
)


def prompts(*lengths: int) -> list[tuple[int, str, int]]:
    """(call index, request id, length) of prompts that came in this order."""
    return [(i, f"r{i}", n) for i, n in enumerate(lengths)]


def test_importing_the_scheduler_imports_no_torch():
    code = "import sys, mstar_dist.engine.scheduler; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_a_held_call_is_false_like_the_none_it_replaces():
    assert not PREFILL_IN_FLIGHT and Held("x") == Held("x") and PREFILL_IN_FLIGHT.reason == "prefill_in_flight"


@pytest.mark.parametrize("lengths, free, budget, ragged, buckets, groups, held", [
    # first fit in arrival order within the budget (padded: rows x longest)
    ((10, 10, 25, 4), 3, 40, True, None, [[0, 1], [2]], [(3, NO_FREE_SLOT)]),
    ((10, 10, 10, 10), 8, 40, True, None, [[0, 1, 2, 3]], []),
    ((5, 30, 5), 8, 40, True, None, [[0, 2], [1]], []),  # 5 pads to 30 beside the 30: 60 > 40
    ((50,), 8, 40, True, None, [[0]], []),  # a prompt past the budget runs alone
    # pads not inert: one length a forward
    ((5, 8, 5, 8, 3), 8, 4096, False, None, [[0, 2], [1, 3], [4]], []),
    # prefill graphs: a batch must fit a captured (rows, length) bucket
    ((35, 35, 35), 8, 128, True, [(2, 48), (4, 32)], [[0, 1], [2]], []),
    ((150, 3), 8, 128, True, [(4, 32)], [[0], [1]], []),  # no bucket holds 150: alone
    ((), 8, 4096, True, None, [], []),
    ((4, 4), 0, 4096, True, None, [], [(0, NO_FREE_SLOT), (1, NO_FREE_SLOT)]),
])
def test_prompts_are_cut_into_forwards_within_the_budget_and_the_slots(lengths, free, budget, ragged, buckets, groups,
                                                                        held):
    plan = Scheduler(token_budget=budget, ragged=ragged, buckets=buckets)
    got = plan.plan_prefills(prompts(*lengths), free_slots=free, on_device=False, busy=False)
    assert (got.groups, got.held) == (groups, held)


def test_prompts_that_come_while_a_prefill_is_on_the_device_wait_and_are_counted_once():
    plan = Scheduler(token_budget=4096, ragged=True, prefill_in_flight=True)
    for _ in range(3):
        got = plan.plan_prefills(prompts(7, 12), free_slots=8, on_device=True, busy=False)
        assert got.groups == [] and got.held == [(0, PREFILL_IN_FLIGHT), (1, PREFILL_IN_FLIGHT)]
    assert plan.prefills_held == 2 and plan.held_rows == {"prefill_in_flight": 6}
    assert plan.plan_prefills(prompts(7, 12), free_slots=8, on_device=False, busy=False).groups == [[0, 1]]
    plan.plan_prefills(prompts(7), free_slots=8, on_device=True, busy=False)  # launched: a new hold counts again
    assert plan.prefills_held == 3


def test_an_idle_engine_gathers_a_burst_while_it_keeps_coming(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(scheduler.time, "monotonic", lambda: now[0])
    plan = Scheduler(token_budget=4096, ragged=True, gather_s=0.003)
    assert plan.plan_prefills(prompts(7), free_slots=8, on_device=False, busy=False).held == [(0, GATHERING)]
    assert plan.pending()  # nothing wakes the worker when the burst ends: it polls
    now[0] += 0.002
    assert len(plan.plan_prefills(prompts(7, 12), free_slots=8, on_device=False, busy=False).held) == 2
    now[0] += 0.0031  # none new for longer than the window: all go, in one forward
    assert plan.plan_prefills(prompts(7, 12), free_slots=8, on_device=False, busy=False).groups == [[0, 1]]
    assert not plan.pending()
    busy = plan.plan_prefills([(0, "b", 4)], free_slots=8, on_device=False, busy=True)
    assert busy.groups == [[0]]  # never held while the engine has other work
    ids = [(k, f"s{k}", 4) for k in range(20)]
    for k in range(20):  # one more every 2.1 ms: held until the oldest waited ten windows
        now[0] += 0.0021
        got = plan.plan_prefills(ids[: k + 1], free_slots=32, on_device=False, busy=False)
        if got.groups:
            break
    assert k == 15 and got.groups == [list(range(16))]  # the oldest came 31.5 ms ago


# (ended, launched, earlier_on_device, behind, on_device, prefill_in_flight, waited) -> the decode rows' plan
@pytest.mark.parametrize("ended, launched, earlier, behind, on_device, in_flight, waited, want", [
    (False, False, False, False, False, False, False, STEP),  # nothing else this turn
    (False, True, False, False, False, False, False, PREFILLS_FIRST),  # prefills ran this turn: their tokens first
    (False, True, False, False, False, False, True, STEP_BESIDE_PREFILLS),  # ...but never two turns in a row
    (False, True, False, False, True, True, False, STEP_BESIDE_PREFILLS),  # in flight: no wait for a launch
    (True, False, False, False, False, True, False, PREFILLS_FIRST),  # an earlier prefill ended: its tokens first
    (False, False, True, True, True, True, False, BEHIND_PREFILL),  # the lookahead step is queued behind it
    (False, False, True, True, True, False, False, STEP_BESIDE_PREFILLS),  # (only prefills in flight hold for that)
    (False, False, True, False, True, True, False, STEP_BESIDE_PREFILLS),
])
def test_decode_rows_step_unless_first_tokens_or_a_queued_step_come_first(ended, launched, earlier, behind, on_device,
                                                                          in_flight, waited, want):
    plan = Scheduler(token_budget=4096, ragged=True, prefill_in_flight=in_flight)
    plan._decode_waited = waited
    got = plan.plan_decode(True, ended=ended, launched=launched, earlier_on_device=earlier, behind=behind,
                           on_device=on_device)
    assert got is want


def test_decode_rows_wait_for_first_tokens_one_turn_never_two_and_a_turn_without_rows_resets_that():
    plan = Scheduler(token_budget=4096, ragged=True)
    turn = dict(ended=False, launched=True, earlier_on_device=False, behind=False, on_device=False)
    assert [plan.plan_decode(True, **turn) for _ in range(4)] == \
        [PREFILLS_FIRST, STEP_BESIDE_PREFILLS, PREFILLS_FIRST, STEP_BESIDE_PREFILLS]
    assert plan.plan_decode(True, **turn) is PREFILLS_FIRST
    assert plan.plan_decode(False, **turn) is STEP  # no rows: nothing waited
    assert plan.plan_decode(True, **turn) is PREFILLS_FIRST


def test_decode_rows_yield_to_prefills_for_at_most_the_yield_time_in_a_row(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(scheduler.time, "monotonic", lambda: now[0])
    plan = Scheduler(token_budget=4096, ragged=True, prefill_in_flight=True, decode_yield_s=0.010)
    turn = dict(ended=False, launched=False, earlier_on_device=True, behind=False)
    got = []
    for _ in range(6):
        got.append(plan.plan_decode(True, on_device=True, **turn))
        now[0] += 0.004
    # held at 0, 4 and 8 ms; at 12 ms the hold is over: one step runs, and a new hold begins
    assert got == [DECODE_YIELD, DECODE_YIELD, DECODE_YIELD, STEP_BESIDE_PREFILLS, DECODE_YIELD, DECODE_YIELD]
    assert plan.decode_yields_count == 2
    assert plan.plan_decode(True, on_device=False, **turn) is STEP_BESIDE_PREFILLS  # nothing on the device: no hold
    assert plan.plan_decode(True, on_device=True, **turn) is DECODE_YIELD and plan.decode_yields_count == 3
    never = Scheduler(token_budget=4096, ragged=True, prefill_in_flight=False, decode_yield_s=0.010)
    assert never.plan_decode(True, on_device=True, **turn) is STEP_BESIDE_PREFILLS  # yields need prefills in flight


@pytest.mark.parametrize("lookahead, claimed, step, joins", [
    (True, True, STEP, True),  # a lookahead step is in use: new rows join its next launch
    (True, False, STEP_BESIDE_PREFILLS, True),  # beside prefills: a forward of their own would hold the turn
    (True, False, STEP, False),
    (False, True, STEP_BESIDE_PREFILLS, False),  # no lookahead: nothing to join
])
def test_rows_new_to_the_lookahead_join_its_launch_when_one_is_in_use_or_prefills_are_beside(lookahead, claimed,
                                                                                              step, joins):
    assert Scheduler.joins(lookahead, claimed, step) is joins


def test_held_calls_are_counted_by_reason_and_a_released_request_is_forgotten(monkeypatch):
    monkeypatch.setattr(scheduler.time, "monotonic", lambda: 5.0)
    plan = Scheduler(token_budget=4096, ragged=True, gather_s=1.0)
    plan.plan_prefills(prompts(4, 4), free_slots=8, on_device=False, busy=False)
    plan.count(NO_FREE_SLOT, 3)
    assert plan.stats() == {"prefills_held_total": 0, "decode_yields_total": 0, "held_gathering_total": 2,
                            "held_no_free_slot_total": 3}
    plan.forget("r0")
    plan.forget("r1")
    assert not plan.pending()
