"""KV-cache engine for an autoregressive node (docs/architecture.md §8): slots, continuous batching, sampling, stop checks.

Inputs a call may carry:
- ``input_ids`` (T,) int64: a prefill. Takes a KV slot, runs the prompt, samples the first token.
- ``token`` (1,) int64: one decode step. All decode calls handed over together run as one batched forward,
  whatever each request's length.
- ``kv`` (n_layers, 2, n_kv_heads, T, head_dim): a KV cache produced by a prefill on another rank (P/D split);
  it is imported into a fresh slot before the request's first decode step here.

Decode steps run one ahead on CUDA (``lookahead``, §8 "Decode lookahead"): right after a step's tokens are sampled on
the device, the next step of the same rows is launched from them, before the host has copied them back. The host
then works on step N (stop checks, emits, the walks) while the GPU runs step N+1. When the next calls arrive, a row
whose request is still here with the token the lookahead used takes the lookahead's result; other calls (a new
request's first step, a token from elsewhere) join the next launch and are answered None, to be retried next turn
(with no lookahead step in use they run at once, in a forward of their own), and lookahead rows that no call claims
(the request stopped, was removed or skipped a step) are dropped: their KV write lands at a position the request
has not reached (it is rewritten before it is read) and their generators are put back as they were, so a pinned seed
gives the same text with or without lookahead.

Outputs: ``token`` (1,) int64 always; ``kv`` after a prefill when the walk context exports it (the decode rank is
another rank), in which case this rank's slot is freed at once. The stop check fires on the model's EOS ids.
A call that finds no free slot is answered ``None`` and retried by the worker once slots free up.

Prefills handed over together run as batched forwards of at most ``prefill_token_budget`` tokens (rows right-padded
to the batch's longest prompt; a row's logits are read at its own last token, and the pad positions it writes into
its slot are never attended: decode overwrites and masks them). A model whose pads are not inert (a stateful MoE
router would count them) sets ``pads_are_inert = False``: then only prompts of one length share a forward. With
prefill graphs (CUDA, with decode graphs) a batch is cut so that one captured (rows, length) bucket holds it, and
replays that bucket's graph (``cuda_graphs.PrefillGraphs``); a prompt no bucket holds runs eagerly, alone.

Prefills go first: when one turn hands over prefills and decode rows, the prefills run and the decode rows are
answered ``None`` (retried next turn), so the first tokens reach the worker, and the conductor, without waiting for
a decode step; decode rows never wait two turns in a row. TP followers replay the same turns and decide alike. In a
turn that runs both, the prefills are launched first and the decode step's host work runs while they are on the GPU.
With lookahead on CUDA, prefills that find a decode step in flight run beside it on a second, higher-priority stream
(``prefill_stream``; ``_prefill_stream`` says why that is safe), in slots that step does not write. With
``prefill_in_flight`` (docs/architecture.md §8) a turn returns while its prefills are on the GPU and a later turn
finishes them (``run_batch``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from mstar_dist import trace
from mstar_dist.engine.component import Component, WalkContext
from mstar_dist.engine.kv_cache import StaticKVCache
from mstar_dist.engine.sampling import SamplingParams, sample, to_device
from mstar_dist.graph.walk import NodeCall, NodeResult

_PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The attention kernels a prefill may use: not cuDNN's, which builds a new plan (~45 ms on an H200) for every new
(rows, length) shape, and prefill shapes vary with every batch of prompts (bench/results/ttft_trace_h200_cudnn.json:
a 6-row prefill took 55 ms, a 1-row one of a length seen before 10 ms). Decode steps keep every kernel: their
shapes are the CUDA graphs' buckets, planned once at capture."""


@dataclass
class _Seq:
    slot: int
    length: int
    """Positions already in the cache."""


@dataclass
class _Ahead:
    """A decode step launched before the host saw the tokens it starts from (see the module docstring)."""

    rows: list[int]
    """Each row's index in the step that launched it."""
    request_ids: list[str]
    seqs: list[_Seq]
    """The rows' sequences when launched: a row is only valid while its request still owns that very _Seq."""
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
    instead of in a forward of its own): its call, retried, is claimed by that tensor's identity."""
    handed: list[torch.Tensor | None] = field(default_factory=list)
    """The token tensor each row started from as the launching step handed it out (its ``NodeResult``), None for a
    joining row: a call that brings that very tensor back is claimed without reading its value (reading one token
    tensor's value cost ~3.5 us a row, 12% of a 64-row step's host time on the H200 host,
    bench/results/profile_h200_64_attn_s21.json)."""


@dataclass(eq=False)
class _Launched:
    """A batched prefill queued on the device whose tokens are not on the host yet (``_launch_prefills``). Compared by
    identity (``list.remove``, ``in``): two batches are never the same one."""

    calls: list[NodeCall]
    ctxs: list[WalkContext]
    slots: list[int]
    lengths: list[int]
    host: torch.Tensor
    """(rows,) the sampled first tokens, complete once ``ready`` has fired."""
    ready: object
    stream: object
    """The side stream it runs on, or None (the current stream)."""
    replayed: bool
    ids: list[str]
    dropped: set[str] = field(default_factory=set)
    """Requests released while the batch was on the GPU: their slots go back when it is finished."""


class KVCacheEngine(Component):
    host_inputs = frozenset({"input_ids"})  # moved to the device on the stream the prefill runs on

    def __init__(self, name: str, model: torch.nn.Module, cache: StaticKVCache, device: torch.device,
                 cuda_graphs: bool = False, logit_bias: torch.Tensor | None = None,
                 prefill_token_budget: int = 4096, lookahead: bool | None = None, prefill_graphs: bool = False,
                 prefill_stream: bool = True, prefill_in_flight: bool = False, prefill_gather_s: float = 0.0,
                 decode_yield_s: float = 0.0):
        """With ``cuda_graphs`` (CUDA only) decode steps replay captured graphs; the cache must hold one slot
        more than the batch: it is kept as the padding rows' scratch slot. ``logit_bias`` (V,) is added to every
        row's logits before sampling (``-inf`` forbids a token: e.g. a speech LLM restricted to audio codes).
        With ``prefill_graphs`` too (and a model with ``pads_are_inert``), batched prefills of at most
        ``prefill_token_budget`` padded tokens replay captured graphs as well (``cuda_graphs.PrefillGraphs``).
        ``lookahead`` runs decode steps one ahead (default: on CUDA; on a CPU it only costs the dropped rows, so
        it is off there unless asked for; never for a model without ``pads_are_inert``, whose rows affect each
        other's forward). Members of a TP group must not use it (their collectives would no longer pair up if one
        member dropped a row another used). ``prefill_stream`` (with lookahead): a prefill that finds a decode step
        in flight runs on a second, higher-priority CUDA stream beside it instead of queueing behind it (see
        ``_prefill_stream``). ``prefill_in_flight`` returns from a turn while its prefills are on the
        GPU and finishes them in a later turn (see ``run_batch``); TP members must not use it (a leader and its
        followers would see a batch end in different turns and launch different batches). ``decode_yield_s`` (with
        ``prefill_in_flight``): no new decode step starts while a prefill is on the GPU, for up to that long in a row
        (``_yields_to_prefill``). ``prefill_gather_s``: an engine with nothing else to run holds prompts back while
        more keep coming, up to that long apart (``_gathering``)."""
        self.name = name
        self.logit_bias = None if logit_bias is None else logit_bias.to(device, torch.float32)
        self.model = model
        self.cache = cache
        self.device = device
        self.graphs = None
        if cuda_graphs:
            from mstar_dist.engine.cuda_graphs import DecodeGraphs

            if device.type != "cuda":
                raise ValueError(f"cuda_graphs needs a CUDA device, got {device}")
            self.graphs = DecodeGraphs(model, cache, scratch_slot=cache.alloc(), max_batch=cache.num_free)
        if prefill_token_budget < 1:
            raise ValueError(f"prefill_token_budget must be >= 1, got {prefill_token_budget}")
        self.prefill_token_budget = prefill_token_budget
        self.ragged_prefill = bool(getattr(model, "pads_are_inert", False))
        self.prefill_graphs = None
        if self.graphs is not None and prefill_graphs and self.ragged_prefill:
            from mstar_dist.engine.cuda_graphs import PrefillGraphs

            self.prefill_graphs = PrefillGraphs(model, cache, scratch_slot=self.graphs.scratch,
                                                max_rows=self.graphs.max_rows, max_tokens=prefill_token_budget,
                                                attention=_PREFILL_ATTENTION)
            if not self.prefill_graphs.buckets:  # a budget below the shortest bucket: batches cut as without graphs
                self.prefill_graphs = None
        # a dropped lookahead row took part in its batch's forward: only models whose rows do not affect each
        # other (pads_are_inert; not a batch-wide stateful MoE router) may look ahead
        self.lookahead = (device.type == "cuda" if lookahead is None else bool(lookahead)) and self.ragged_prefill
        self._ahead: _Ahead | None = None
        self._side = torch.cuda.Stream(device, priority=-1) \
            if self.lookahead and prefill_stream and device.type == "cuda" else None
        self.prefill_in_flight = bool(prefill_in_flight)
        if decode_yield_s < 0:
            raise ValueError(f"decode_yield_s must be >= 0, got {decode_yield_s}")
        self.decode_yield_s = float(decode_yield_s)
        self.decode_yields = self.decode_yield_s > 0 and self.prefill_in_flight
        self._yield_since: float | None = None
        """When the decode rows were first held back in the current run of turns (``_yields_to_prefill``)."""
        self.decode_yields_count = 0
        if prefill_gather_s < 0:
            raise ValueError(f"prefill_gather_s must be >= 0, got {prefill_gather_s}")
        self.prefill_gather_s = float(prefill_gather_s)
        self._first_seen: dict[str, float] = {}
        """Request id -> when a prompt held by ``_gathering`` was first handed over."""
        self._gathered = False
        """The last turn held prompts back to gather more (``pending``: the worker polls instead of sleeping)."""
        self._launched: list[_Launched] = []
        """Prefill batches launched in earlier turns whose tokens the host has not taken yet (``prefill_in_flight``)."""
        self._held: set[str] = set()
        self._seqs: dict[str, _Seq] = {}
        self.steps = 0
        self.decode_rows = 0
        self.prefills = 0
        self.prefill_batches = 0
        self.prefill_batches_replayed = 0
        self.prefill_batches_beside = 0
        self.prefills_held = 0
        self.decode_seconds = 0.0
        self.ahead_rows_used = 0
        self.ahead_rows_dropped = 0
        self.joined_rows = 0
        self._decode_waited = False

    @torch.inference_mode()
    def run_batch(self, calls: list[NodeCall]) -> list[NodeResult | BaseException | None]:
        """One turn (see the module docstring). With ``prefill_in_flight`` a turn does not wait for the prefills it
        launches: their calls are answered None while they are on the GPU and get their first tokens in the first
        turn that finds them ended (the worker retries the same calls, and polls while ``pending``). A turn that finds
        a prefill still on the GPU holds new prompts back (None) and launches them as one batch once it has ended,
        right before taking its tokens, so the GPU goes from one prefill to the next without waiting for the host's
        emits, and the prompts that arrived meanwhile share one forward instead of queueing one batch each. Decode rows
        whose lookahead step is queued behind a prefill still on the GPU are answered None too
        (``_step_behind_prefill``)."""
        results: list[NodeResult | BaseException | None] = [None] * len(calls)
        at = {call: i for i, call in enumerate(calls)}
        on_gpu = {call for batch in self._launched for call in batch.calls}
        prefilling = {rid for batch in self._launched for rid in batch.ids}
        decode: list[int] = []
        prefill: list[tuple[int, torch.Tensor]] = []
        seqs, max_len = self._seqs, self.cache.max_seq_len
        for i, call in enumerate(calls):
            if on_gpu and call in on_gpu:
                continue  # answered when its batch is finished
            try:
                rid = call.request_id
                if prefilling and rid in prefilling:
                    raise RuntimeError(f"request {rid!r} already has a prefill on the GPU of {self.name!r}")
                inputs = call.inputs
                if "input_ids" in inputs:
                    prefill.append((i, self._prompt(call)))
                elif (rid in seqs and "kv" not in inputs) or self._ensure_seq(call):  # the first: a decode row's turn
                    if seqs[rid].length + 1 > max_len:
                        raise RuntimeError(f"request {rid!r} reached the context limit {max_len}")
                    decode.append(i)
            except Exception as exc:  # one request's failure must not take the batch down
                results[i] = exc
        ended = [batch for batch in self._launched if _ended(batch.ready)]
        if prefill and len(ended) < len(self._launched):  # a prefill is still on the GPU: the new prompts wait for it
            for i, _ in prefill:
                self._hold(calls[i].request_id)
            prefill = []
        self._gathered = bool(prefill) and self._gathering([calls[i].request_id for i, _ in prefill], busy=bool(decode))
        if self._gathered:
            prefill = []
        groups = self._prefill_groups(prefill)
        launched = self._launch_prefills([[calls[i] for i, _ in g] for g in groups],
                                         [[p for _, p in g] for g in groups])
        # first tokens leave before this turn's decode step (the worker sends them as run_batch returns): a new
        # request's TTFT does not include the step; decode rows wait one turn, never two in a row, and when they do not
        # wait their step's host work runs while the prefills are on the GPU
        waits = bool(decode and (ended or (launched and not self.prefill_in_flight)) and not self._decode_waited)
        self._decode_waited = waits
        if decode and not waits and not self._step_behind_prefill() and not self._yields_to_prefill(launched):
            try:
                # beside prefills, rows new to the lookahead join its next launch rather than run now: the turn, and
                # so the first tokens, would otherwise wait for their forward, queued behind the prefills
                defer = bool(launched or len(ended) < len(self._launched))
                for i, result in zip(decode, self._decode([calls[i] for i in decode], defer_fresh=defer)):
                    results[i] = result
            except Exception as exc:  # a broken batch fails exactly its requests
                for i in decode:
                    results[i] = exc
        for batch in ended:
            self._launched.remove(batch)
            self._answer(batch, at, results)
        for group, batch in zip(groups, launched):
            if isinstance(batch, BaseException):
                for i, _ in group:
                    results[i] = batch
            elif self.prefill_in_flight and not _ended(batch.ready):
                self._launched.append(batch)
            else:
                self._answer(batch, at, results)
        return results

    def _step_behind_prefill(self) -> bool:
        """With ``prefill_in_flight``: the lookahead step is still on the GPU while a prefill is (it was queued behind
        one). Its rows are answered None rather than waited for: waiting would hold the turn, and the prompts that
        arrive meanwhile, until both have ended, the stall the option exists to remove (in a 32-request wave the rank
        spent ~3 ms between two prefills reading the requests that came during the first)."""
        ahead = self._ahead
        return self.prefill_in_flight and bool(self._launched) and ahead is not None and not _ended(ahead.ready)

    def _gathering(self, request_ids: list[str], busy: bool) -> bool:
        """With ``prefill_gather_s``: whether to hold this turn's prompts back (None) so that a burst arriving at an
        idle engine goes as one forward: while the newest came less than ``prefill_gather_s`` ago, and the oldest
        less than ten times that. Never while decode rows run (the engine is busy: prompts that come during a step
        share the next turn's forward anyway) or a prefill is in flight (``prefill_in_flight`` holds them then). On a
        CPU a prefill forward takes a tenth of a second or more: the first prompt of a burst went alone and the rest
        in one or two more forwards, each of which the decode rank of a P/D pair shared the cores with."""
        if self.prefill_gather_s <= 0:
            return False
        now = time.monotonic()
        seen = [self._first_seen.setdefault(rid, now) for rid in request_ids]
        if busy or self._launched:
            return False
        return now - max(seen) < self.prefill_gather_s and now - min(seen) < 10 * self.prefill_gather_s

    def _yields_to_prefill(self, launched: list) -> bool:
        """With ``decode_yield_s``: hold this turn's decode rows back (None) while a prefill batch is on the GPU, so the
        prefills share the GPU only with the step already in flight, but never longer than ``decode_yield_s`` in a row:
        then one step runs beside them and a new hold begins, so a train of prefills during a burst of arrivals slows
        the decoding requests without stopping them. Two latency-bound graphs share the GPU rather than overlap: at 32
        streams on one H200 a prefill took 4.8 ms (median) from launch to tokens beside the decode steps launched
        meanwhile, against 2.1 ms alone, and 3.7 ms with decode rows held up to 8 ms (docs/architecture.md §8,
        "Decode yields")."""
        if not self.decode_yields:
            return False
        if not any(isinstance(b, _Launched) and not _ended(b.ready) for b in (*self._launched, *launched)):
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

    def pending(self) -> bool:
        # gathering: nothing wakes the worker when the burst is over, so it must hand the prompts over again soon (on
        # its socket's idle wait, 20 ms, a lone prompt's TTFT rose ~60 ms on the CPU P/D pair)
        return (self._gathered and bool(self._first_seen)) or \
            any(len(batch.dropped) < len(batch.calls) for batch in self._launched)

    def release(self, request_id: str) -> None:
        self._held.discard(request_id)
        self._first_seen.pop(request_id, None)
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.cache.free(seq.slot)
        for batch in self._launched:
            if request_id in batch.ids:  # on the GPU: its slot goes back when the batch is finished
                batch.dropped.add(request_id)
                if len(batch.dropped) == len(batch.calls):  # nobody waits for this batch any more
                    self._launched.remove(batch)
                    _wait_quietly(batch.ready)
                    self._give_back(batch.slots, batch.stream)
                break

    def stats(self) -> dict[str, int]:
        return {"kv_slots_used": len(self._seqs), "kv_slots_free": self.cache.num_free,
                "prefills_total": self.prefills, "prefill_batches_total": self.prefill_batches,
                "prefill_batches_replayed_total": self.prefill_batches_replayed,
                "prefill_batches_beside_decode_total": self.prefill_batches_beside,
                "prefills_held_total": self.prefills_held,
                "decode_steps_total": self.steps,
                "decode_rows_total": self.decode_rows, "decode_ms_total": int(self.decode_seconds * 1000),
                "lookahead_rows_used_total": self.ahead_rows_used,
                "lookahead_rows_dropped_total": self.ahead_rows_dropped,
                "decode_rows_joined_total": self.joined_rows, "decode_yields_total": self.decode_yields_count}

    def close(self) -> None:
        for batch in self._launched:  # nothing may still write into the cache or the graphs' pool
            _wait_quietly(batch.ready)
        self._launched.clear()
        if self.prefill_graphs is not None:
            self.prefill_graphs.close()
            self.prefill_graphs = None
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None

    def warmup(self) -> None:
        if self.graphs is not None:
            self.graphs.capture()
        if self.prefill_graphs is not None:
            self.prefill_graphs.capture()
        with torch.inference_mode():
            slot = self.cache.alloc()
            try:
                ids = torch.zeros((1, 4), dtype=torch.long, device=self.device)
                pos = torch.arange(4, device=self.device)[None]
                self.cache.bind([slot], [0], 4)
                logits = self.model(ids, pos, self.cache, last_only=True)[:, -1].repeat(2, 1)
                # and the sampling kernels, greedy and drawn, with a copy of their tokens to the host: in serving on an
                # H200 the first prefill spent 4.5 ms of host time sampling its token (0.1-0.2 ms later on)
                drawn = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9, top_k=20)]
                _wait(self._copy_to_host(sample(self._biased(logits), drawn, [torch.Generator(), torch.Generator()]))[1])
            finally:
                self.cache.free(slot)

    # ---- internals ----
    def _prompt(self, call: NodeCall) -> torch.Tensor:
        """The call's prompt ids (T,), checked; on the host if they came from it (``_launch_prefills`` moves them on the
        stream the prefill runs on)."""
        if call.request_id in self._seqs:
            raise RuntimeError(f"request {call.request_id!r} already has a KV slot on {self.name!r}")
        ids = call.inputs["input_ids"].reshape(-1).long()
        if ids.numel() == 0:
            raise ValueError("empty prompt")
        if ids.numel() >= self.cache.max_seq_len:
            raise ValueError(f"prompt is {ids.numel()} tokens; this engine's context is {self.cache.max_seq_len}")
        return ids

    def _prefill_groups(self, prefill: list[tuple[int, torch.Tensor]]) -> list[list[tuple[int, torch.Tensor]]]:
        """The prefills that get a slot now, in arrival order, cut into forwards of at most the token budget
        (padded size: rows x longest prompt; with prefill graphs, the size of the bucket that holds them, so every
        batch of more than one prompt replays a graph); prompts of one length only when pads are not inert. The rest
        wait (answered None) for a free slot."""
        admitted = prefill[: self.cache.num_free]
        groups: list[list[tuple[int, torch.Tensor]]] = []
        longest: list[int] = []  # of each group's prompts
        for item in admitted:
            n = item[1].numel()
            for g, group in enumerate(groups):
                if (self.ragged_prefill or group[0][1].numel() == n) and self._fits(len(group) + 1, max(n, longest[g])):
                    group.append(item)
                    longest[g] = max(n, longest[g])
                    break
            else:
                groups.append([item])
                longest.append(n)
        return groups

    def _fits(self, rows: int, longest: int) -> bool:
        if self.prefill_graphs is not None:
            return self.prefill_graphs.bucket_for(rows, longest) is not None
        return rows * longest <= self.prefill_token_budget

    def _launch_prefills(self, groups: list[list[NodeCall]], prompts: list[list[torch.Tensor]]
                         ) -> list[_Launched | BaseException]:
        """Queue one forward per group of prompts (right-padded), and its samples' copy to the host; one entry per
        group, an exception for a group that failed (its slots given back). All on one stream: the side stream when
        they may run beside the decode step in flight (``_prefill_stream``), else the current one."""
        busy = self._busy_slots()
        slots = [[self.cache.alloc(avoid=busy) for _ in group] for group in groups]
        side = self._prefill_stream(busy, [s for g in slots for s in g], [p for g in prompts for p in g])
        out: list[_Launched | BaseException] = []
        for group, group_prompts, group_slots in zip(groups, prompts, slots):
            lengths = [p.numel() for p in group_prompts]
            longest = max(lengths)
            ids = [c.request_id for c in group]
            self._held.difference_update(ids)
            for rid in ids:
                self._first_seen.pop(rid, None)
            if trace.ON:
                trace.event("eng_prefill_start", rows=len(group), tokens=sum(lengths), padded=longest * len(group),
                            ids=ids, engine=self.name)
            try:
                with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                    bucket = None if self.prefill_graphs is None else self.prefill_graphs.bucket_for(len(group), longest)
                    if bucket is not None:  # host prompts go to the graph's inputs in one copy
                        logits = self.prefill_graphs.logits(group_prompts, group_slots, bucket)
                    else:
                        on_device = [to_device(p, self.device) for p in group_prompts]  # no stream sync
                        logits = self._prefill_eager(on_device, group_slots, lengths)
                    if trace.ON:
                        trace.event("eng_prefill_replayed", rows=len(group), engine=self.name)
                    ctxs: list[WalkContext] = [c.ctx for c in group]
                    tokens = sample(self._biased(logits[:, -1]), [x.sampling for x in ctxs], _generators(ctxs))
                    host, ready = self._copy_to_host(tokens)
                    if trace.ON:
                        trace.event("eng_prefill_launched", rows=len(group), engine=self.name)
            except Exception as exc:  # a broken batch fails exactly its requests
                self._give_back(group_slots, side)
                out.append(exc)
                continue
            self.prefill_batches_replayed += bucket is not None
            self.prefill_batches_beside += side is not None
            out.append(_Launched(group, ctxs, group_slots, lengths, host, ready, side, bucket is not None, ids))
        return out

    def _finish_prefill(self, launched: _Launched) -> list[NodeResult]:
        """The results of a launched prefill once its tokens are on the host: each request keeps its slot (or exports
        its KV and lets the slot go, for a decode rank elsewhere)."""
        try:
            _wait(launched.ready)
            tokens = launched.host.tolist()
        except Exception:
            self._give_back(launched.slots, launched.stream)
            raise
        self.prefills += len(launched.calls)
        self.prefill_batches += 1
        results: list[NodeResult | None] = []
        for call, ctx, slot, n, token in zip(launched.calls, launched.ctxs, launched.slots, launched.lengths, tokens):
            if call.request_id in launched.dropped:  # released while on the GPU: nobody takes its token
                self.cache.free(slot)
                results.append(None)
                continue
            self._seqs[call.request_id] = _Seq(slot=slot, length=n)
            outputs = {"token": torch.tensor([token])}
            if "kv" in ctx.export:  # on the current stream, where a p2p send of it is ordered (its KV writes are done)
                outputs["kv"] = self.cache.export(slot, n)
                self.release(call.request_id)
            results.append(NodeResult(outputs=outputs, stop=token in ctx.stop_token_ids))
        if trace.ON:  # the tokens are on the host: the forward has ended
            trace.event("eng_prefill_end", rows=len(launched.calls), ids=launched.ids, engine=self.name,
                        replayed=launched.replayed, beside=launched.stream is not None)
        return results

    def _answer(self, batch: _Launched, at: dict[NodeCall, int], results: list) -> None:
        """Finish a launched prefill and put its results where its calls are in this turn's ``results``."""
        try:
            finished = self._finish_prefill(batch)
        except Exception as exc:  # a broken batch fails exactly its requests
            finished = [exc] * len(batch.calls)
        for call, result in zip(batch.calls, finished):
            i = at.get(call)
            if i is not None:
                results[i] = result

    def _hold(self, request_id: str) -> None:
        if request_id not in self._held:
            self._held.add(request_id)
            self.prefills_held += 1

    def _give_back(self, slots: list[int], stream: torch.cuda.Stream | None) -> None:
        if stream is not None:
            with contextlib.suppress(Exception):  # nothing of a failed batch may write into slots given out again
                stream.synchronize()
        for slot in slots:
            self.cache.free(slot)

    def _busy_slots(self) -> set[int]:
        """The slots the decode step still in flight writes (empty when none is, or it has ended)."""
        ahead = self._ahead
        if ahead is None or _ended(ahead.ready):
            return set()
        return {seq.slot for seq in ahead.seqs}

    def _prefill_stream(self, busy: set[int], slots: list[int], prompts: list[torch.Tensor]
                        ) -> torch.cuda.Stream | None:
        """The side stream when this turn's prefills may run beside the decode step in flight (``busy``: the slots it
        writes), else None (the current stream).

        A lookahead step launched last turn is usually still on the GPU when prefills arrive; on the same stream the
        prefill, and so the first tokens, would wait for it (a decode step of 32 rows takes ~2-3 ms on an H200). Both
        are latency-bound graphs that leave most of the GPU idle, so the prefill runs beside it on a higher-priority
        stream. Safe because nothing on the side stream touches what the step does: the prefill writes only its own
        slots (chosen outside ``busy``; if it must take a slot the step writes, such as a finished request's whose
        dropped row the step still runs, it goes behind the step), the prompts cross on the side stream, the host
        waits for the prefill's tokens (an event after its KV writes) before anything reads its slots (a later decode
        step, an export), and the only memory both write is the graphs' scratch slot, which only padding rows read. Earlier
        steps are done: the host waited for their tokens. The prompts must be host tensors (the worker hands inline
        ``input_ids`` over on the host, ``host_inputs``): one already on the device may have been made by work still
        queued on the current stream. All of a turn's prefills take one stream: the prefill graphs share one memory
        pool, so two replays on two streams could write each other's outputs."""
        if self._side is None or not busy or busy.intersection(slots):
            return None
        if any(p.device.type != "cpu" for p in prompts):  # made on the current stream, maybe still queued there
            return None
        return self._side

    def _prefill_eager(self, prompts: list[torch.Tensor], slots: list[int], lengths: list[int]) -> torch.Tensor:
        longest = max(lengths)
        ids = torch.zeros((len(prompts), longest), dtype=torch.long, device=self.device)
        for row, prompt in enumerate(prompts):
            ids[row, : prompt.numel()] = prompt
        positions = torch.arange(longest, device=self.device).expand(len(prompts), longest)
        self.cache.bind(slots, [0] * len(prompts), longest)
        last = None if min(lengths) == longest else to_device([n - 1 for n in lengths], self.device)
        with sdpa_kernel(_PREFILL_ATTENTION):
            return self.model(ids, positions, self.cache, last_only=True, last_index=last)

    def _biased(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.logit_bias is None else logits.float() + self.logit_bias

    def _ensure_seq(self, call: NodeCall) -> bool:
        """Make sure the request has a slot holding its KV; False when it must wait for a free slot."""
        kv = call.inputs.get("kv")
        if call.request_id in self._seqs:
            if kv is not None:
                raise RuntimeError(f"request {call.request_id!r} got a KV cache but already has one here")
            return True
        if kv is None:
            raise RuntimeError(
                f"request {call.request_id!r}: decode on {self.name!r} without a KV cache (no prefill here, none sent)"
            )
        if self.cache.num_free == 0:
            return False
        slot = self.cache.alloc()
        try:
            self.cache.import_(slot, kv.to(self.device))
        except Exception:
            self.cache.free(slot)  # a malformed KV must not cost a slot for good
            raise
        self._seqs[call.request_id] = _Seq(slot=slot, length=int(kv.shape[3]))
        call.inputs.pop("kv")  # imported: let the received buffer go
        return True

    def _decode(self, calls: list[NodeCall], defer_fresh: bool = False) -> list[NodeResult | BaseException]:
        t0 = time.perf_counter()
        if trace.ON:
            trace.event("eng_decode_start", rows=len(calls), engine=self.name)
        try:
            return self._decode_step(calls, defer_fresh)
        finally:
            self.decode_seconds += time.perf_counter() - t0
            if trace.ON:
                trace.event("eng_decode_end", rows=len(calls), engine=self.name)

    def _decode_step(self, calls: list[NodeCall], defer_fresh: bool = False) -> list[NodeResult | BaseException | None]:
        """One decode step of ``calls``: rows the lookahead already ran take its tokens, the others run now; then
        (lookahead) the next step of all of them is launched before this step's tokens are copied to the host.

        Joining: when a lookahead step is being used and some calls are new to it (a request's first decode step,
        a row the lookahead did not run), those rows do not get a forward of their own: they are launched with the
        next step of the others and answered None (the worker retries them next turn, when the lookahead has
        their token). One forward per step instead of two while requests keep arriving (a P/D decode rank takes
        them one handoff at a time), for one step of delay on each new request's first decode token. With
        ``defer_fresh`` (prefills ran this turn) new rows join a launch even when no lookahead step is in use: run now,
        their forward would queue behind the prefills and the turn, with the prefills' first tokens, would wait for
        it."""
        ahead, self._ahead = self._ahead, None
        seqs = [self._seqs[c.request_id] for c in calls]
        claimed = self._claim(ahead, calls, seqs) if ahead is not None else {}
        fresh = [i for i in range(len(calls)) if i not in claimed]
        join: list[int] = []
        if fresh and self.lookahead and (claimed or defer_fresh):
            join, fresh = fresh, []
        run = [i for i in range(len(calls)) if i in claimed or i in fresh]  # this step's rows, in call order
        ctxs: list[WalkContext] = [c.ctx for c in calls]
        fresh_tokens = fresh_host = fresh_ready = None
        if fresh:
            inputs = self._given_on_device([calls[i] for i in fresh])
            fresh_tokens, _ = self._forward_sample(inputs, [seqs[i] for i in fresh], [ctxs[i] for i in fresh])
            fresh_host, fresh_ready = self._copy_to_host(fresh_tokens)
        if not claimed:
            step_tokens = fresh_tokens
        elif not fresh and list(claimed.values()) == list(range(len(ahead.request_ids))):
            step_tokens = ahead.tokens  # the common case: the same rows in the same order
        else:
            at = {i: k for k, i in enumerate(run)}
            step_tokens = torch.empty(len(run), dtype=torch.long, device=self.device)
            step_tokens[to_device([at[i] for i in claimed], self.device)] = \
                ahead.tokens[to_device(list(claimed.values()), self.device)]
            if fresh:
                step_tokens[to_device([at[i] for i in fresh], self.device)] = fresh_tokens
        for i in run:
            seqs[i].length += 1
        launch = run + join
        if self.lookahead:
            given = self._given_on_device([calls[i] for i in join]) if join else None
            tokens = step_tokens if given is None else given if step_tokens is None else torch.cat([step_tokens, given])
            self._launch_ahead([calls[i] for i in launch], [seqs[i] for i in launch], [ctxs[i] for i in launch],
                               tokens, given={len(run) + k: calls[i].inputs["token"] for k, i in enumerate(join)})
        # the step's device-to-host copies (the lookahead, if any, is already queued behind them)
        ids = [0] * len(calls)
        if claimed:
            _wait(ahead.ready)
            ahead_ids = ahead.host.tolist()
            for i, row in claimed.items():
                ids[i] = ahead_ids[row]
        if fresh:
            _wait(fresh_ready)
            for i, value in zip(fresh, fresh_host.tolist()):
                ids[i] = value
        tokens_out = torch.tensor(ids, dtype=torch.long).split(1)  # one (1,) view a row, in one call
        if self._ahead is not None:
            started = [ids[i] for i in run] + [None] * len(join)
            handed = [tokens_out[i] for i in run] + [None] * len(join)
            self._ahead.inputs = [started[k] for k in self._ahead.rows]
            self._ahead.handed = [handed[k] for k in self._ahead.rows]
        self.steps += bool(run)  # a launch of joining rows only is counted when they claim it
        self.decode_rows += len(run)
        self.joined_rows += len(join)
        results: list[NodeResult | BaseException | None] = [None] * len(calls)  # joining rows: retried
        for i in run:
            results[i] = NodeResult(outputs={"token": tokens_out[i]}, stop=ids[i] in ctxs[i].stop_token_ids)
        return results

    def _given_on_device(self, calls: list[NodeCall]) -> torch.Tensor:
        """The calls' input tokens as one (n,) long tensor on the device, without a stream sync. Tokens this engine
        sampled are host tensors; a request's first one may arrive on the device (from a prefill elsewhere)."""
        given = [c.inputs["token"].reshape(1) for c in calls]
        if all(t.device.type == "cpu" for t in given):
            return to_device(torch.cat(given), self.device).long()
        return torch.cat([to_device(t, self.device) for t in given]).long()

    def _forward_sample(self, tokens: torch.Tensor, seqs: list[_Seq], ctxs: list[WalkContext],
                        keep_states: bool = False) -> tuple[torch.Tensor, dict]:
        """One decode forward of ``tokens`` (n,) on the device, each row writing its sequence's next position, and
        its samples (n,) on the device. With ``keep_states``: {row: (generator, state before the draw)}."""
        positions = [s.length for s in seqs]
        slots = [s.slot for s in seqs]
        if self.graphs is not None and len(seqs) <= self.graphs.max_rows:
            logits = self.graphs.logits(tokens, positions, slots)
        else:
            self.cache.bind(slots, positions, 1)
            logits = self.model(tokens[:, None], to_device(positions, self.device)[:, None], self.cache,
                                last_only=True)
        params: list[SamplingParams] = [x.sampling for x in ctxs]
        generators = _generators(ctxs)
        states = {row: (generators[row], generators[row].get_state())
                  for row, p in enumerate(params) if keep_states and not p.greedy}
        return sample(self._biased(logits[:, -1]), params, generators), states

    def _copy_to_host(self, tokens: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Start copying ``tokens`` to the host: (host tensor, CUDA event to wait for; None when already done)."""
        if self.device.type != "cuda":
            return tokens.cpu(), None
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _launch_ahead(self, calls: list[NodeCall], seqs: list[_Seq], ctxs: list[WalkContext],
                      tokens: torch.Tensor, given: dict[int, torch.Tensor] | None = None) -> None:
        """Queue the step after this one for every row that has room for it (its KV write is harmless if dropped).
        ``given``: joining rows (index in ``calls``) -> the token tensor they start from."""
        rows = [i for i, s in enumerate(seqs) if s.length < self.cache.max_seq_len]
        if not rows:
            return
        if len(rows) < len(seqs):
            tokens = tokens[to_device(rows, self.device)]
        picked = [seqs[i] for i in rows]
        sampled, states = self._forward_sample(tokens, picked, [ctxs[i] for i in rows], keep_states=True)
        host, ready = self._copy_to_host(sampled)
        given = given or {}
        self._ahead = _Ahead(rows=rows, request_ids=[calls[i].request_id for i in rows], seqs=picked,
                             lengths=[s.length for s in picked], tokens=sampled, host=host, ready=ready,
                             generator_states=states, given={k: given[i] for k, i in enumerate(rows) if i in given})

    def _claim(self, ahead: _Ahead, calls: list[NodeCall], seqs: list[_Seq]) -> dict[int, int]:
        """{call index: lookahead row} for the calls the lookahead already ran; drops (and rewinds the generators
        of) the rows no call claims."""
        claimed: dict[int, int] = {}
        if ahead.inputs and not ahead.given and len(calls) == len(ahead.rows):
            # the common turn: every row of the step before, in its order, each routed the tensor it was handed
            for i, (call, seq, was, length, handed) in enumerate(zip(calls, seqs, ahead.seqs, ahead.lengths,
                                                                      ahead.handed)):
                if seq is not was or length != seq.length or call.inputs["token"] is not handed:
                    claimed.clear()
                    break
                claimed[i] = i
            else:
                self.ahead_rows_used += len(claimed)
                return claimed
        row_of = {rid: row for row, rid in enumerate(ahead.request_ids)} if ahead.inputs else {}
        for i, (call, seq) in enumerate(zip(calls, seqs)):
            row = row_of.get(call.request_id)
            token = call.inputs["token"]
            if row is None or ahead.seqs[row] is not seq or ahead.lengths[row] != seq.length:
                continue
            given = ahead.given.get(row)
            if given is not None:  # a joining row: its retried call brings the very tensor it was launched from
                if token is given:
                    claimed[i] = row
            elif token is ahead.handed[row]:  # the walk routes the tensor this engine handed out
                claimed[i] = row
            # a token on the device did not come from this engine's last step (and reading it would sync)
            elif token.device.type == "cpu" and int(token.reshape(-1)[0]) == ahead.inputs[row]:
                claimed[i] = row
        used = set(claimed.values())
        for row, rid in enumerate(ahead.request_ids):
            if row in used:
                continue
            self.ahead_rows_dropped += 1
            saved = ahead.generator_states.get(row)
            if saved is not None and self._seqs.get(rid) is ahead.seqs[row]:
                saved[0].set_state(saved[1])  # the request lives on: its next draw must be the one it skipped
        self.ahead_rows_used += len(claimed)
        return claimed


def _wait(event: object) -> None:
    if event is not None:
        event.synchronize()


def _generators(ctxs: list[WalkContext]) -> list[torch.Generator | None]:
    """The rows' sampling generators, made only for rows that draw (a greedy row never does: no generator to build
    for each greedy request's prefill)."""
    return [None if x.sampling.greedy else x.generator("cpu") for x in ctxs]


def _ended(event: object) -> bool:
    """Whether the work before ``event`` is done (None: done already, on the CPU), without waiting."""
    return event is None or event.query()


def _wait_quietly(event: object) -> None:
    with contextlib.suppress(Exception):  # a failed stream has nothing left to write
        _wait(event)
