"""The KV engine's turn policy (docs/architecture.md §8): which prompts prefill now and in which batches, whether the
decode rows step, and why a call waits. Pure Python, no torch: the engine (engine/kv_engine.py) gathers the facts a
decision needs (prompt lengths, free slots, what is still on the device), asks, and executes the plan.

A turn is planned in two halves, because the second reads what the first launched:

1. `Scheduler.plan_prefills`: the turn's prompts -> forwards of at most the token budget (each group one batched
   prefill), and the prompts held back: behind a prefill still on the device (they go as one batch once it ends),
   gathering a burst at an idle engine, or short of a free KV slot.
2. `Scheduler.plan_decode`, once the prefills are launched: the decode rows step now (`Step`), or all wait this turn
   (`Held`): so that a prefill's first tokens leave before the step; because their lookahead step is queued behind a
   prefill still on the device; or to yield the device to prefills for a bounded time.

A call that waits is answered `Held(reason)` (one shared instance per reason): the worker hands the same call over
again in a later turn, and polls instead of blocking while the engine says it is ``pending``. Holds always end: a
prompt behind a prefill goes when that prefill ends, a gathered one within ten gather windows, decode rows wait for
first tokens one turn and never two in a row, and a yield lasts at most ``decode_yield_s``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Held:
    """A call a component did not answer this turn, and why; the worker hands the same call over again later.

    False as a bool, like the None a component without reasons may still answer: the worker's loop over a turn's
    results skips both with one ``not result`` per row (answered results and exceptions are true)."""

    reason: str

    def __bool__(self) -> bool:
        return False


PREFILL_RUNNING = Held("prefill_running")
"""The call's own prefill is on the device (``prefill_in_flight``): its first token comes in a later turn."""
PREFILL_IN_FLIGHT = Held("prefill_in_flight")
"""A new prompt waits for the prefill on the device to end; the prompts that arrive meanwhile then go as one batch."""
GATHERING = Held("gathering")
"""An idle engine holds a prompt while more keep coming (``prefill_gather_s``), so a burst goes as one forward."""
NO_FREE_SLOT = Held("no_free_slot")
"""Every KV slot is taken; the call goes once a request is released."""
PREFILLS_FIRST = Held("prefills_first")
"""A decode row waits one turn so that the prefills' first tokens leave before its step (never two turns in a row)."""
BEHIND_PREFILL = Held("lookahead_behind_prefill")
"""The row's lookahead step was queued behind a prefill still on the device; waiting for it would hold the turn."""
DECODE_YIELD = Held("decode_yield")
"""Decode rows yield the device to prefills on it, for at most ``decode_yield_s`` in a row."""
JOINED_LOOKAHEAD = Held("joined_lookahead")
"""A row new to the lookahead joined its next launch instead of a forward of its own; its token comes next turn."""
RELEASED = Held("released")
"""The request was released while its prefill was on the device: nobody takes its token."""


@dataclass(frozen=True)
class Step:
    """The decode rows step this turn."""

    beside_prefills: bool
    """Prefills are on the device or were launched this turn: rows new to the lookahead join its next launch rather
    than run a forward of their own now (queued behind the prefills, it would hold the turn and the first tokens)."""


STEP = Step(beside_prefills=False)
STEP_BESIDE_PREFILLS = Step(beside_prefills=True)


@dataclass
class PrefillPlan:
    """What to do with this turn's prompts."""

    groups: list[list[int]]
    """Call indices, one list per batched forward, in arrival order (every prompt in one has a slot)."""
    held: list[tuple[int, Held]] = field(default_factory=list)
    """(call index, why) of the prompts that wait."""


NO_PREFILLS = PrefillPlan(groups=[])
"""The plan of a turn without prompts (shared: never modified)."""


class Scheduler:
    """One engine's turn policy and the little state it keeps between turns (holds and their clocks)."""

    def __init__(self, *, token_budget: int, ragged: bool, buckets: list[tuple[int, int]] | None = None,
                 prefill_in_flight: bool = False, decode_yield_s: float = 0.0, gather_s: float = 0.0):
        """``token_budget``: the most padded tokens (rows x longest prompt) in one prefill forward. ``ragged``:
        prompts of different lengths may share a forward (the model's pads are inert). ``buckets``: the (rows,
        length) shapes of the captured prefill graphs; a batch must fit one (None: no prefill graphs, the budget
        alone). ``prefill_in_flight``: prefills may stay on the device across turns. ``decode_yield_s`` (with it):
        how long decode rows may yield to prefills in a row. ``gather_s``: how far apart prompts may come and still
        be gathered into one forward at an idle engine (0: never)."""
        self.token_budget = token_budget
        self.ragged = ragged
        self.buckets = buckets
        self.prefill_in_flight = prefill_in_flight
        self.decode_yield_s = decode_yield_s
        self.decode_yields = decode_yield_s > 0 and prefill_in_flight
        self.gather_s = gather_s
        self._decode_waited = False
        """The decode rows waited for first tokens last turn (they never wait two turns in a row)."""
        self._yield_since: float | None = None
        """When the decode rows were first held back in the current run of yields."""
        self._first_seen: dict[str, float] = {}
        """Request id -> when a prompt held by gathering was first handed over."""
        self._gathered = False
        """The last turn held prompts back to gather more."""
        self._held_ids: set[str] = set()
        """Requests whose prompt is held behind a prefill on the device (each counted once in ``prefills_held``)."""
        self.prefills_held = 0
        self.decode_yields_count = 0
        self.held_rows: dict[str, int] = {}
        """Reason -> calls answered Held for it, over all turns."""

    # ---- prefills ----
    def plan_prefills(self, prompts: list[tuple[int, str, int]], *, free_slots: int, on_device: bool,
                      busy: bool) -> PrefillPlan:
        """``prompts``: (call index, request id, length) in arrival order. ``free_slots``: KV slots free now.
        ``on_device``: a prefill launched in an earlier turn is still on the device. ``busy``: the engine has other
        work this turn (decode rows, or earlier prefills to answer), so gathering would only delay the prompts."""
        self._gathered = False
        if not prompts:
            return NO_PREFILLS
        if on_device:  # they wait for it, and then go as one batch
            for _, rid, _ in prompts:
                if rid not in self._held_ids:
                    self._held_ids.add(rid)
                    self.prefills_held += 1
            return self._hold(prompts, PREFILL_IN_FLIGHT)
        if self.gather_s > 0 and self._gathering([rid for _, rid, _ in prompts], busy):
            self._gathered = True
            return self._hold(prompts, GATHERING)
        admitted = prompts[:free_slots]
        plan = PrefillPlan(groups=self.groups(admitted))
        if len(admitted) < len(prompts):
            plan.held = [(i, NO_FREE_SLOT) for i, _, _ in prompts[free_slots:]]
            self.count(NO_FREE_SLOT, len(plan.held))
        for _, rid, _ in admitted:  # launched now: no longer held or gathered
            self._held_ids.discard(rid)
            self._first_seen.pop(rid, None)
        return plan

    def groups(self, prompts: list[tuple[int, str, int]]) -> list[list[int]]:
        """``prompts`` cut into forwards, first fit in arrival order: a prompt joins the first group it fits (within
        the budget, or a bucket with prefill graphs, so that every batch of more than one prompt replays a graph;
        of its own length only when pads are not inert), else starts one."""
        groups: list[list[int]] = []
        longest: list[int] = []  # of each group's prompts
        for i, _, n in prompts:
            for g, group in enumerate(groups):
                if (self.ragged or longest[g] == n) and self.fits(len(group) + 1, max(n, longest[g])):
                    group.append(i)
                    longest[g] = max(n, longest[g])
                    break
            else:
                groups.append([i])
                longest.append(n)
        return groups

    def fits(self, rows: int, longest: int) -> bool:
        """Whether ``rows`` prompts of at most ``longest`` tokens may share one forward."""
        if self.buckets is not None:
            return any(r >= rows and length >= longest for r, length in self.buckets)
        return rows * longest <= self.token_budget

    def _gathering(self, request_ids: list[str], busy: bool) -> bool:
        """Whether to hold the prompts back so that a burst arriving at an idle engine goes as one forward: while
        the newest came less than ``gather_s`` ago and the oldest less than ten times that. Never while the engine
        is busy: prompts that come during its work share the next turn's forward anyway."""
        now = time.monotonic()
        seen = [self._first_seen.setdefault(rid, now) for rid in request_ids]
        if busy:
            return False
        return now - max(seen) < self.gather_s and now - min(seen) < 10 * self.gather_s

    def _hold(self, prompts: list[tuple[int, str, int]], why: Held) -> PrefillPlan:
        self.count(why, len(prompts))
        return PrefillPlan(groups=[], held=[(i, why) for i, _, _ in prompts])

    # ---- decode rows ----
    def plan_decode(self, rows: bool, *, ended: bool, launched: bool, earlier_on_device: bool, behind: bool,
                    on_device: bool) -> Step | Held:
        """Whether this turn's decode rows (``rows``: there are some) step. ``ended``: earlier prefills ended this
        turn (their first tokens go out now). ``launched``: prefills were launched this turn. ``earlier_on_device``:
        an earlier turn's prefill is still on the device. ``behind``: the lookahead step in flight was queued behind
        a prefill and has not ended. ``on_device``: any prefill, earlier or this turn's, is still on the device.

        The first tokens leave before the turn's decode step: decode rows wait one turn, never two in a row, when
        prefills ended (or, without ``prefill_in_flight``, ran) this turn."""
        waits = rows and (ended or (launched and not self.prefill_in_flight)) and not self._decode_waited
        self._decode_waited = waits
        if not rows:
            return STEP
        if waits:
            return PREFILLS_FIRST
        if self.prefill_in_flight and behind:
            return BEHIND_PREFILL
        if self._yields(on_device):
            return DECODE_YIELD
        return STEP_BESIDE_PREFILLS if launched or earlier_on_device else STEP

    def _yields(self, on_device: bool) -> bool:
        """With ``decode_yields``: hold the decode rows back while a prefill is on the device, so the prefills share
        it only with the step already in flight, but never longer than ``decode_yield_s`` in a row: then one step
        runs beside them and a new hold begins, so a train of prefills during a burst slows the decoding requests
        without stopping them (docs/architecture.md §8, "Decode yields")."""
        if not self.decode_yields:
            return False
        if not on_device:
            self._yield_since = None
            return False
        now = time.monotonic()
        if self._yield_since is None:
            self._yield_since = now
            self.decode_yields_count += 1
            return True
        if now - self._yield_since < self.decode_yield_s:
            return True
        self._yield_since = None
        return False

    @staticmethod
    def joins(lookahead: bool, claimed: bool, step: Step) -> bool:
        """Whether the rows of a step that no lookahead step has run (a request's first decode step, a row the
        lookahead dropped) join the next lookahead launch, answered `JOINED_LOOKAHEAD`, instead of running a forward
        of their own now: when a lookahead step is being used (one forward a step instead of two while requests keep
        arriving, for one step of delay on each new request's first decode token) or beside prefills."""
        return lookahead and (claimed or step.beside_prefills)

    # ---- bookkeeping ----
    def count(self, why: Held, n: int = 1) -> None:
        """Count ``n`` calls answered ``why`` (``stats``)."""
        self.held_rows[why.reason] = self.held_rows.get(why.reason, 0) + n

    def pending(self) -> bool:
        """Prompts were held back to gather more: nothing wakes the worker when the burst is over, so it must hand
        them over again soon rather than sleep until a message comes."""
        return self._gathered and bool(self._first_seen)

    def forget(self, request_id: str) -> None:
        """The request was released: drop what the holds kept for it."""
        self._held_ids.discard(request_id)
        self._first_seen.pop(request_id, None)

    def stats(self) -> dict[str, int]:
        return {"prefills_held_total": self.prefills_held, "decode_yields_total": self.decode_yields_count,
                **{f"held_{reason}_total": n for reason, n in self.held_rows.items()}}
