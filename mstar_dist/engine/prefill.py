"""The pieces of the KV engine's batched prefill (engine/kv_engine.py): the record of a batch on the device, the
eager padded forward, and the rule for running a batch beside the decode step in flight.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from mstar_dist.engine.component import WalkContext
from mstar_dist.engine.kv_cache import StaticKVCache
from mstar_dist.engine.logits import Logprobs
from mstar_dist.engine.sampling import to_device
from mstar_dist.graph.walk import NodeCall

PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The attention kernels a prefill may use: not cuDNN's, which builds a new plan for every new (rows, length) shape,
and prefill shapes vary with every batch of prompts. Decode steps keep every kernel: their shapes are the CUDA
graphs' buckets, planned once at capture."""


@dataclass(eq=False)
class Launched:
    """A batched prefill queued on the device whose tokens are not on the host yet. Compared by identity
    (``list.remove``, ``in``): two batches are never the same one."""

    calls: list[NodeCall]
    ctxs: list[WalkContext]
    slots: list[int]
    lengths: list[int]
    host: torch.Tensor
    """(rows,) the sampled first tokens, complete once ``ready`` has fired."""
    ready: object
    """A CUDA event after the copy (None on CPU: the copy is done)."""
    stream: object
    """The side stream it runs on, or None (the current stream)."""
    replayed: bool
    """It replays a captured prefill graph."""
    ids: list[str]
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """Outputs besides the token that the model's forward gave for the batch's one prompt (``prefill_eager``)."""
    dropped: set[str] = field(default_factory=set)
    """Requests released while the batch was on the device: their slots go back when it is finished."""
    logprobs: Logprobs | None = None
    """The rows' logprob tables on the host (complete with ``host``), for the rows that asked."""


def alone_with_inputs(groups: list[list[int]], calls: list[NodeCall], names: tuple[str, ...]) -> list[list[int]]:
    """The prefill ``groups`` (call indices) with every prompt that carries model inputs (``names`` or
    ``position_ids``) in a group of its own: its inputs are one row's; and so is one that asks for its prompt's
    logprobs (its forward keeps the logits of every position, `prefill_eager`)."""
    out: list[list[int]] = []
    for group in groups:
        rest = []
        for i in group:
            if calls[i].ctx.sampling.prompt_logprobs is not None or \
                    any(name in calls[i].inputs for name in (*names, "position_ids")):
                out.append([i])
            else:
                rest.append(i)
        if rest:
            out.append(rest)
    return out


def row_inputs(call: NodeCall, names: tuple[str, ...], device: torch.device) -> dict[str, torch.Tensor] | None:
    """The model inputs a prefill call carries (those in ``names``, the model's ``prefill_inputs``, and
    ``position_ids``) moved to ``device``, or None. ``prefill_eager`` hands them to the model's forward of that one
    row as keyword arguments, as given, except ``position_ids`` (T,) or (A, T), which become its ``positions``
    (1, T) or (A, 1, T) in place of 0..T-1 (A position axes: M-RoPE's three). Such a prompt is a forward of its own
    (``alone_with_inputs``) and eager: prefill graphs capture token ids only."""
    if not names:
        return None
    given = {name: call.inputs[name] for name in (*names, "position_ids") if name in call.inputs}
    return {name: to_device(t, device) for name, t in given.items()} or None


def position_offset(call: NodeCall, accepted: bool, engine: str) -> int:
    """The call's ``position_offset`` (0 without one); ValueError when the engine's model takes none
    (``accepted`` False)."""
    offset = call.inputs.get("position_offset")
    if offset is None:
        return 0
    if not accepted:
        raise ValueError(f"{engine!r}: its model takes no position_offset (request {call.request_id!r})")
    return int(offset.reshape(-1)[0]) if isinstance(offset, torch.Tensor) else int(offset)


def prefill_eager(model: torch.nn.Module, cache: StaticKVCache, prompts: list[torch.Tensor], slots: list[int],
                  lengths: list[int], inputs: dict[str, torch.Tensor] | None = None, *,
                  every_position: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward of ``prompts`` (on the cache's device) right-padded to the longest, each row from position 0 of
    its slot: the last-token logits (rows, 1, V), each row's at its own last token (with ``every_position``, one
    prompt: the logits of every position, (1, T, V)), and the outputs the model gave besides them. ``inputs``: one
    prompt's model inputs (``row_inputs``); given them, a model may return ``(logits, {name: tensor})`` rather than
    the logits, and the engine adds those to the prompt's call outputs (e.g. the hidden states another node
    reads)."""
    device = cache.device
    longest = max(lengths)
    ids = torch.zeros((len(prompts), longest), dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, : prompt.numel()] = prompt
    positions = torch.arange(longest, device=device).expand(len(prompts), longest)
    kwargs = dict(inputs or {})
    given = kwargs.pop("position_ids", None)
    if given is not None:
        if len(prompts) != 1 or given.shape[-1] != longest or given.dim() > 2:
            raise ValueError(f"position_ids of shape {tuple(given.shape)} do not fit one prompt of {longest} tokens "
                             f"(expected (T,) or (axes, T))")
        positions = given.long().reshape(*given.shape[:-1], 1, longest)
    cache.bind(slots, [0] * len(prompts), longest)
    last = None if min(lengths) == longest else to_device([n - 1 for n in lengths], device)
    with sdpa_kernel(PREFILL_ATTENTION):
        out = model(ids, positions, cache, last_only=not every_position, last_index=last, **kwargs)
    return out if isinstance(out, tuple) else (out, {})


def side_stream(side: torch.cuda.Stream | None, busy: set[int], slots: list[int], prompts: list[torch.Tensor]
                ) -> torch.cuda.Stream | None:
    """``side`` when a turn's prefills (into ``slots``, from ``prompts``) may run beside the decode step in flight
    (``busy``: the slots it writes), else None (the current stream).

    A lookahead step launched last turn is usually still on the device when prefills arrive; on the same stream the
    prefill, and so the first tokens, would wait for it. Both are latency-bound graphs that leave most of the device
    idle, so the prefill runs beside it on a higher-priority stream. Safe because nothing on the side stream touches
    what the step does: the prefill writes only its own slots (chosen outside ``busy``; if it must take a slot the step
    writes, such as a finished request's whose dropped row the step still runs, it goes behind the step), the prompts
    cross on the side stream, the host waits for the prefill's tokens (an event after its KV writes) before anything
    reads its slots (a later decode step, an export), and the only memory both write is the graphs' scratch slot,
    which only padding rows read. Earlier steps are done: the host waited for their tokens. The prompts must be host
    tensors (the worker hands inline ``input_ids`` over on the host, ``Component.host_inputs``): one already on the
    device may have been made by work still queued on the current stream. All of a turn's prefills take one stream:
    the prefill graphs share one memory pool, so two replays on two streams could write each other's outputs."""
    if side is None or not busy or busy.intersection(slots):
        return None
    if any(p.device.type != "cpu" for p in prompts):  # made on the current stream, maybe still queued there
        return None
    return side


def wait(event: object) -> None:
    """Block until the work before ``event`` (a CUDA event; None on the CPU) is done."""
    if event is not None:
        event.synchronize()


def has_ended(event: object) -> bool:
    """Whether the work before ``event`` is done (None: done already, on the CPU), without waiting."""
    return event is None or event.query()


def wait_quietly(event: object) -> None:
    """`wait`, where a failed stream has nothing left to write."""
    with contextlib.suppress(Exception):
        wait(event)
