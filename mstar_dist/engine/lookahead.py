"""Decode lookahead (docs/architecture.md §8, "Decode lookahead"): the record of a decode step launched before the
host saw the tokens it starts from, and how the next turn's calls claim its rows.

Right after a step's tokens are sampled on the device, the KV engine launches the next step of the same rows from
them, before the host has copied them back; the host then works on step N while the device runs step N+1. In the
next turn a row whose request is still here with the token the lookahead used takes the lookahead's result
(`claim`). Rows that no call claims (the request stopped, was released or skipped a step) are dropped: their KV
write lands at a position the request has not reached (it is rewritten before it is read) and their generators are
put back as they were (`rewind`), so a pinned seed gives the same text with or without lookahead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mstar_dist.engine.kv_cache import Seq
from mstar_dist.engine.logits import Logprobs
from mstar_dist.engine.sampling import to_device
from mstar_dist.graph.walk import NodeCall


@dataclass
class Ahead:
    """A decode step launched before the host saw the tokens it starts from."""

    rows: list[int]
    """Each row's index in the step that launched it."""
    request_ids: list[str]
    seqs: list[Seq]
    """The rows' sequences when launched: a row is only valid while its request still owns that very Seq."""
    lengths: list[int]
    """Each row's position written (its sequence's length at launch)."""
    tokens: torch.Tensor
    """(n,) the sampled tokens, on the device."""
    host: torch.Tensor
    """(n,) their host copy, complete once ``ready`` has fired."""
    ready: object
    """A CUDA event after the copy (None on CPU: the copy is done)."""
    generator_states: dict[int, tuple[torch.Generator, torch.Tensor]] = field(default_factory=dict)
    """Row -> (generator, its state before this step drew from it), for sampled rows."""
    inputs: list[int | None] = field(default_factory=list)
    """The token ids each row started from (host values, set once the launching step's copy completed; empty if
    that step failed, and then no row is claimed). None for a joining row: see ``given``."""
    given: dict[int, torch.Tensor] = field(default_factory=dict)
    """Row -> the very token tensor a joining row started from (a request's first decode step, launched here
    instead of in a forward of its own): its call, handed over again, is claimed by that tensor's identity."""
    logprobs: Logprobs | None = None
    """The rows' logprob tables on the host (complete with ``host``), for the rows that asked."""
    handed: list[torch.Tensor | None] = field(default_factory=list)
    """The token tensor each row started from as the launching step handed it out (its ``NodeResult``), None for a
    joining row: a call that brings that very tensor back is claimed without reading its value (reading a token
    tensor's value costs a call into torch per row, a visible share of a large step's host time)."""


def claim(ahead: Ahead, calls: list[NodeCall], seqs: list[Seq], live: dict[str, Seq]) -> tuple[dict[int, int], int]:
    """({call index: lookahead row} for the calls (``seqs``: their requests' sequences) that ``ahead`` already ran,
    how many of its rows no call claimed). The unclaimed rows are dropped (`rewind`; ``live``: request id -> its
    sequence now)."""
    if ahead.inputs and not ahead.given and len(calls) == len(ahead.rows):
        # the common turn: every row of the step before, in its order, each routed the tensor it was handed
        claimed: dict[int, int] = {}
        for i, (call, seq, was, length, handed) in enumerate(zip(calls, seqs, ahead.seqs, ahead.lengths,
                                                                  ahead.handed)):
            if seq is not was or length != seq.length or call.inputs["token"] is not handed:
                break
            claimed[i] = i
        else:
            return claimed, 0
    claimed = _claim_rows(ahead, calls, seqs)
    return claimed, rewind(ahead, claimed, live)


def _claim_rows(ahead: Ahead, calls: list[NodeCall], seqs: list[Seq]) -> dict[int, int]:
    """`claim` row by row: by request id, then by the token each call brings."""
    claimed: dict[int, int] = {}
    row_of = {rid: row for row, rid in enumerate(ahead.request_ids)} if ahead.inputs else {}
    for i, (call, seq) in enumerate(zip(calls, seqs)):
        row = row_of.get(call.request_id)
        token = call.inputs["token"]
        if row is None or ahead.seqs[row] is not seq or ahead.lengths[row] != seq.length:
            continue
        given = ahead.given.get(row)
        if given is not None:  # a joining row: its call, handed over again, brings the very tensor it was launched from
            if token is given:
                claimed[i] = row
        elif token is ahead.handed[row]:  # the walk routes the tensor this engine handed out
            claimed[i] = row
        # a token on the device did not come from this engine's last step (and reading it would sync)
        elif token.device.type == "cpu" and int(token.reshape(-1)[0]) == ahead.inputs[row]:
            claimed[i] = row
    return claimed


def rewind(ahead: Ahead, claimed: dict[int, int], live: dict[str, Seq]) -> int:
    """Drop the rows of ``ahead`` no call claimed: the generator of each whose request lives on (``live``: request id
    -> its sequence now) is put back, so its next draw is the one the dropped row took. Returns how many."""
    used = set(claimed.values())
    dropped = 0
    for row, rid in enumerate(ahead.request_ids):
        if row in used:
            continue
        dropped += 1
        saved = ahead.generator_states.get(row)
        if saved is not None and live.get(rid) is ahead.seqs[row]:
            saved[0].set_state(saved[1])
    return dropped


def step_tokens(ahead: Ahead | None, claimed: dict[int, int], fresh: list[int], run: list[int],
                fresh_tokens: torch.Tensor | None) -> torch.Tensor | None:
    """A step's tokens (len(run),) on the device, in ``run``'s order (call indices): the lookahead's for the
    ``claimed`` rows (call index -> its row), ``fresh_tokens`` (the ``fresh`` rows' forward) for the others."""
    if not claimed:
        return fresh_tokens
    if not fresh and list(claimed.values()) == list(range(len(ahead.request_ids))):
        return ahead.tokens  # the common case: the same rows in the same order
    device = ahead.tokens.device
    at = {i: k for k, i in enumerate(run)}
    tokens = torch.empty(len(run), dtype=torch.long, device=device)
    tokens[to_device([at[i] for i in claimed], device)] = ahead.tokens[to_device(list(claimed.values()), device)]
    if fresh:
        tokens[to_device([at[i] for i in fresh], device)] = fresh_tokens
    return tokens


def tokens_on_device(calls: list[NodeCall], device: torch.device) -> torch.Tensor:
    """The calls' input tokens as one (n,) long tensor on ``device``, without a stream sync. Tokens the engine
    sampled are host tensors; a request's first one may arrive on the device (from a prefill elsewhere)."""
    given = [c.inputs["token"].reshape(1) for c in calls]
    if all(t.device.type == "cpu" for t in given):
        return to_device(torch.cat(given), device).long()
    return torch.cat([to_device(t, device) for t in given]).long()
