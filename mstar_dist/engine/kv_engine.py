"""KV-cache engine for an autoregressive node (docs/architecture.md §8): slots, continuous batching, sampling, stops.

Inputs a call may carry:
- ``input_ids`` (T,) int64: a prefill. Takes a KV slot, runs the prompt, samples the first token.
- ``token`` (1,) int64: one decode step. All decode calls handed over together run as one batched forward,
  whatever each request's length.
- ``kv`` (n_layers, 2, n_kv_heads, T, head_dim): a KV cache produced by a prefill on another rank (P/D split);
  it is imported into a fresh slot before the request's first decode step here.
- A prefill's model inputs (the model's ``prefill_inputs``, and ``position_ids``): see ``prefill.row_inputs``.
- ``position_offset`` (an int or one-element tensor) on a prefill or KV import, for a model with ``position_offsets``:
  its decode steps rotate by cache position + offset (M-RoPE's ``rope_delta``); requests without one cost nothing.
- ``prompt_ids`` (T,) int64 beside a ``kv`` import, for a request with penalties (they count the prompt's tokens).

Outputs: ``token`` (1,) int64 always; ``kv`` after a prefill when the walk context exports it (the decode rank is
another rank), in which case this rank's slot is freed at once; after a prompt with model inputs, what else its
forward returned (``prefill.prefill_eager``); ``logprobs`` and a prefill's ``prompt_logprobs`` for a request that
asks (engine/logits.py, like every knob beyond the draw). The stop check fires on the walk's stop ids.

The engine is the runner: each turn it sorts the calls, asks its scheduler (engine/scheduler.py) which prompts to
prefill in which batches and whether the decode rows step, and executes that plan; a call the plan holds is answered
``Held(reason)`` and handed over again by the worker in a later turn. Engine policy comes from one `EngineConfig`
(mstar_dist/config/engine.py).

Prefills handed over together run as batched forwards (rows right-padded to the batch's longest prompt; a row's
logits are read at its own last token, and the pad positions it writes into its slot are never attended: decode
overwrites and masks them). A model whose pads are not inert (a stateful MoE router would count them) sets
``pads_are_inert = False``: then only prompts of one length share a forward. With prefill graphs a batch replays the
captured (rows, length) bucket that holds it (``cuda_graphs.PrefillGraphs``); a prompt no bucket holds runs eagerly.
In a turn that runs prefills and a decode step, the prefills are launched first and the step's host work runs while
they are on the device. With lookahead, prefills that find a decode step in flight run beside it on a second,
higher-priority stream (``prefill.side_stream`` says why that is safe), in slots that step does not write. With
``prefill_in_flight`` a turn returns while its prefills are on the device and a later turn finishes them.

Decode steps run one ahead with ``lookahead`` (engine/lookahead.py): the next step of a batch's rows is launched from
its sampled tokens before the host has read them; a row whose call brings the token the lookahead used takes its
result, other rows join the next launch (answered Held, their token comes next turn) or run in a forward of their
own when no lookahead step is in use.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch

from mstar_dist import trace
from mstar_dist.config.engine import EngineConfig
from mstar_dist.engine.component import Component, WalkContext
from mstar_dist.engine.kv_cache import Seq, StaticKVCache
from mstar_dist.engine.logits import Logprobs, RowExtras, prompt_table
from mstar_dist.engine.lookahead import Ahead, claim, step_tokens, tokens_on_device
from mstar_dist.engine.prefill import (
    Launched, alone_with_inputs, has_ended, position_offset, prefill_eager, row_inputs, side_stream, wait,
    wait_quietly,
)
from mstar_dist.engine.sampling import SamplingParams, sample, to_device
from mstar_dist.engine.scheduler import (
    JOINED_LOOKAHEAD, NO_FREE_SLOT, PREFILL_RUNNING, RELEASED, Held, Scheduler, Step,
)
from mstar_dist.graph.walk import NodeCall, NodeResult

Result = NodeResult | BaseException | Held


class KVCacheEngine(Component):
    host_inputs = frozenset({"input_ids"})  # moved to the device on the stream the prefill runs on

    def __init__(self, model: torch.nn.Module, cache: StaticKVCache, device: torch.device, config: EngineConfig,
                 logit_bias: torch.Tensor | None = None, *, name: str = "LLM",
                 grammar_tokenizer: Callable[[], Any] | None = None):
        """``config`` is taken as it is (a family resolves it for its rank with ``EngineConfig.on``); its sizes are
        the ``cache``'s. With ``cuda_graphs`` (CUDA only) the cache must hold one slot more than the batch: it is
        kept as the padding rows' scratch slot. ``logit_bias`` (V,) is added to every row's logits before sampling
        (``-inf`` forbids a token: e.g. a speech LLM restricted to audio codes). Lookahead and prefill graphs need a
        model with ``pads_are_inert`` (a dropped lookahead row took part in its batch's forward; a padded prefill
        row in its bucket's). ``grammar_tokenizer()`` builds the model's ``llguidance.LLTokenizer`` for structured
        outputs (engine/grammar.py); None: requests with a grammar fail."""
        self.name = name
        self.config = config
        self.logit_bias = None if logit_bias is None else logit_bias.to(device, torch.float32)
        self.model, self.cache, self.device = model, cache, device
        self.ragged_prefill = bool(getattr(model, "pads_are_inert", False))
        self.prefill_inputs: tuple[str, ...] = tuple(getattr(model, "prefill_inputs", ()))
        """Call inputs a prefill hands the model's forward (with ``position_ids``); empty for text decoders."""
        self.position_offsets = bool(getattr(model, "position_offsets", False))
        self._offsets: dict[int, int] = {}
        """Slot -> its request's decode position offset, only the nonzero ones (empty: text-only traffic)."""
        self.graphs = self.prefill_graphs = None
        if config.cuda_graphs:
            from mstar_dist.engine.cuda_graphs import build_graphs

            self.graphs, self.prefill_graphs = build_graphs(
                model, cache, prefill=config.prefill_graphs and self.ragged_prefill,
                token_budget=config.prefill_token_budget, offsets=self.position_offsets)
        self.lookahead = config.lookahead and self.ragged_prefill
        self._ahead: Ahead | None = None
        self._side = torch.cuda.Stream(device, priority=-1) \
            if self.lookahead and config.prefill_stream and device.type == "cuda" else None
        self.prefill_in_flight = config.prefill_in_flight
        self.scheduler = Scheduler(
            token_budget=config.prefill_token_budget, ragged=self.ragged_prefill,
            buckets=None if self.prefill_graphs is None else self.prefill_graphs.buckets,
            prefill_in_flight=config.prefill_in_flight, decode_yield_s=config.decode_yield_ms / 1000,
            gather_s=config.prefill_gather_ms / 1000)
        self._launched: list[Launched] = []
        """Prefill batches launched in earlier turns whose tokens the host has not taken yet (``prefill_in_flight``)."""
        self._seqs: dict[str, Seq] = {}
        self.rows = RowExtras(device, cache.max_slots, cache.max_seq_len, grammar_tokenizer, name, self.logit_bias)
        """Penalties, min_tokens, grammars and logprobs of the rows that ask for them, and the bias's window of ids
        (engine/logits.py)."""
        self.steps = self.decode_rows = self.joined_rows = 0
        self.prefills = self.prefill_batches = self.prefill_batches_replayed = self.prefill_batches_beside = 0
        self.ahead_rows_used = self.ahead_rows_dropped = 0
        self.decode_seconds = 0.0

    @torch.inference_mode()
    def run_batch(self, calls: list[NodeCall]) -> list[Result]:
        """One turn (see the module docstring): the scheduler's plan for this turn's prompts and decode rows, executed.
        A call held this turn is answered its `Held` and handed over again by the worker (which polls while
        ``pending``). With ``prefill_in_flight`` a turn does not wait for the prefills it launches: their calls are
        answered `PREFILL_RUNNING` and get their first tokens in the first turn that finds them ended; prompts that
        arrive meanwhile are launched as one batch once it has ended, right before its tokens are taken, so the device
        goes from one prefill to the next without waiting for the host's emits."""
        results: list[Result] = [None] * len(calls)  # every entry is set below
        prompts, ids, decode = self._sort(calls, results)
        launched_before = self._launched
        done = [batch for batch in launched_before if has_ended(batch.ready)] if launched_before else []
        earlier = len(done) < len(launched_before)  # an earlier turn's prefill is still on the device
        plan = self.scheduler.plan_prefills(prompts, free_slots=self.cache.num_free, on_device=earlier,
                                            busy=bool(decode or launched_before))
        for i, why in plan.held:
            results[i] = why
        planned = alone_with_inputs(plan.groups, calls, self.prefill_inputs) if self.prefill_inputs or any(
            calls[i].ctx.sampling.prompt_logprobs is not None for group in plan.groups for i in group) else plan.groups
        groups = [[calls[i] for i in group] for group in planned]
        launched = self._launch_prefills(groups, [[ids[i] for i in group] for group in planned])
        self._decode_turn(calls, decode, results, ended=done, launched=launched, earlier=earlier)
        if done:
            at = {call: i for i, call in enumerate(calls)}
            for batch in done:
                self._launched.remove(batch)
                self._answer(batch, at, results)
        for group, batch in zip(planned, launched):
            if isinstance(batch, BaseException):
                for i in group:
                    results[i] = batch
            elif self.prefill_in_flight and not has_ended(batch.ready):
                self._launched.append(batch)
                for i in group:
                    results[i] = PREFILL_RUNNING
                self.scheduler.count(PREFILL_RUNNING, len(group))
            else:
                self._answer(batch, dict(zip(batch.calls, group)), results)
        return results

    def _sort(self, calls: list[NodeCall], results: list[Result]
              ) -> tuple[list[tuple[int, str, int]], dict[int, torch.Tensor], list[int]]:
        """The turn's calls by kind: (call index, request id, length) of each prompt, call index -> its prompt's ids,
        the indices of the decode rows. A call that cannot run fails alone (its entry of ``results`` is its error); a
        call whose prefill is on the device keeps `PREFILL_RUNNING`; a KV import short of a slot is `NO_FREE_SLOT`."""
        on_device = {call for batch in self._launched for call in batch.calls} if self._launched else None
        prefilling = {rid for batch in self._launched for rid in batch.ids} if self._launched else None
        prompts: list[tuple[int, str, int]] = []
        ids: dict[int, torch.Tensor] = {}
        decode: list[int] = []
        seqs, max_len = self._seqs, self.cache.max_seq_len
        for i, call in enumerate(calls):
            if on_device and call in on_device:  # answered when its batch is finished
                results[i] = PREFILL_RUNNING
                self.scheduler.count(PREFILL_RUNNING)
                continue
            try:
                rid = call.request_id
                if prefilling and rid in prefilling:
                    raise RuntimeError(f"request {rid!r} already has a prefill on the GPU of {self.name!r}")
                inputs = call.inputs
                if "input_ids" in inputs:
                    ids[i] = self._prompt(call)
                    prompts.append((i, rid, ids[i].numel()))
                elif (rid in seqs and "kv" not in inputs) or self._ensure_seq(call):  # the first: a decode row's turn
                    if seqs[rid].length + 1 > max_len:
                        raise RuntimeError(f"request {rid!r} reached the context limit {max_len}")
                    decode.append(i)
                else:
                    results[i] = NO_FREE_SLOT
                    self.scheduler.count(NO_FREE_SLOT)
            except Exception as exc:  # one request's failure must not take the batch down
                results[i] = exc
        return prompts, ids, decode

    def _decode_turn(self, calls: list[NodeCall], decode: list[int], results: list[Result], *,
                     ended: list[Launched], launched: list, earlier: bool) -> None:
        """The decode rows of the turn: the step the scheduler allows, or all held with its reason."""
        ahead, before = self._ahead, self._launched
        behind = bool(before) and ahead is not None and not has_ended(ahead.ready)
        on_device = bool(before or launched) and \
            any(isinstance(b, Launched) and not has_ended(b.ready) for b in (*before, *launched))
        go = self.scheduler.plan_decode(bool(decode), ended=bool(ended), launched=bool(launched),
                                        earlier_on_device=earlier, behind=behind, on_device=on_device)
        if not decode:
            return
        if isinstance(go, Held):
            for i in decode:
                results[i] = go
            self.scheduler.count(go, len(decode))
            return
        try:
            for i, result in zip(decode, self._decode([calls[i] for i in decode], go)):
                results[i] = result
        except Exception as exc:  # a broken batch fails exactly its requests
            for i in decode:
                results[i] = exc

    def pending(self) -> bool:
        return self.scheduler.pending() or any(len(batch.dropped) < len(batch.calls) for batch in self._launched)

    def release(self, request_id: str) -> None:
        self.scheduler.forget(request_id)
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self._offsets.pop(seq.slot, None)
            self.cache.free(seq.slot)
        if self.rows.live:
            self.rows.release(request_id, None if seq is None else seq.slot)
        for batch in self._launched:
            if request_id in batch.ids:  # on the device: its slot goes back when the batch is finished
                batch.dropped.add(request_id)
                if len(batch.dropped) == len(batch.calls):  # nobody waits for this batch any more
                    self._launched.remove(batch)
                    wait_quietly(batch.ready)
                    self._give_back(batch.slots, batch.stream)
                break

    def stats(self) -> dict[str, int]:
        return {"kv_slots_used": len(self._seqs), "kv_slots_free": self.cache.num_free,
                "prefills_total": self.prefills, "prefill_batches_total": self.prefill_batches,
                "prefill_batches_replayed_total": self.prefill_batches_replayed,
                "prefill_batches_beside_decode_total": self.prefill_batches_beside,
                "decode_steps_total": self.steps,
                "decode_rows_total": self.decode_rows, "decode_ms_total": int(self.decode_seconds * 1000),
                "lookahead_rows_used_total": self.ahead_rows_used,
                "lookahead_rows_dropped_total": self.ahead_rows_dropped,
                "decode_rows_joined_total": self.joined_rows, **self.scheduler.stats()}

    def close(self) -> None:
        for batch in self._launched:  # nothing may still write into the cache or the graphs' pool
            wait_quietly(batch.ready)
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
                # and the sampling kernels, greedy and drawn, with a copy of their tokens to the host: the first use of
                # each costs host time that would otherwise land on the first request's prefill
                drawn = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9, top_k=20)]
                tokens = sample(self.rows.biased(logits), drawn, [torch.Generator(), torch.Generator()])  # window ids
                wait(self._copy_to_host(tokens)[1])
            finally:
                self.cache.free(slot)

    # ---- prefills ----
    def _prompt(self, call: NodeCall) -> torch.Tensor:
        """The call's prompt ids (T,), checked; on the host if they came from it (``_launch_prefills`` moves them on the
        stream the prefill runs on)."""
        if call.request_id in self._seqs:
            raise RuntimeError(f"request {call.request_id!r} already has a KV slot on {self.name!r}")
        ids = call.inputs["input_ids"].reshape(-1).long()
        position_offset(call, self.position_offsets, self.name)  # a bad one fails the prompt now, not its batch
        if ids.numel() == 0:
            raise ValueError("empty prompt")
        if ids.numel() >= self.cache.max_seq_len:
            raise ValueError(f"prompt is {ids.numel()} tokens; this engine's context is {self.cache.max_seq_len}")
        return ids

    def _launch_prefills(self, groups: list[list[NodeCall]], prompts: list[list[torch.Tensor]]
                         ) -> list[Launched | BaseException]:
        """Queue one forward per group of prompts (right-padded), and its samples' copy to the host; one entry per
        group, an exception for a group that failed (its slots given back). All on one stream: the side stream when
        they may run beside the decode step in flight (``_prefill_stream``), else the current one."""
        if not groups:
            return []
        busy = self._busy_slots()
        slots = [[self.cache.alloc(avoid=busy) for _ in group] for group in groups]
        given = [p for g in prompts for p in g]
        if self.prefill_inputs:  # model inputs too: one made on the device must not cross to the side stream
            given += [t for g in groups for c in g for t in c.inputs.values() if torch.is_tensor(t)]
        side = side_stream(self._side, busy, [s for g in slots for s in g], given)
        out: list[Launched | BaseException] = []
        for group, group_prompts, group_slots in zip(groups, prompts, slots):
            try:
                with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                    out.append(self._launch_prefill(group, group_prompts, group_slots, side))
            except Exception as exc:  # a broken batch fails exactly its requests
                self._give_back(group_slots, side)
                out.append(exc)
        return out

    def _launch_prefill(self, group: list[NodeCall], prompts: list[torch.Tensor], slots: list[int],
                        side: torch.cuda.Stream | None) -> Launched:
        """Queue one batched prefill forward (on the current stream), its samples and their copy to the host."""
        lengths = [p.numel() for p in prompts]
        longest = max(lengths)
        ids = [c.request_id for c in group]
        if trace.ON:
            trace.event("eng_prefill_start", rows=len(group), tokens=sum(lengths), padded=longest * len(group),
                        ids=ids, engine=self.name)
        extras = row_inputs(group[0], self.prefill_inputs, self.device) if len(group) == 1 else None
        every = len(group) == 1 and group[0].ctx.sampling.prompt_logprobs is not None  # the prompt's logprobs too
        bucket = None if self.prefill_graphs is None or extras or every else \
            self.prefill_graphs.bucket_for(len(group), longest)
        if bucket is not None:  # host prompts go to the graph's inputs in one copy
            logits, given = self.prefill_graphs.logits(prompts, slots, bucket), {}
        else:
            on_device = [to_device(p, self.device) for p in prompts]  # no stream sync
            logits, given = prefill_eager(self.model, self.cache, on_device, slots, lengths, extras,
                                          every_position=every)
        if trace.ON:
            trace.event("eng_prefill_replayed", rows=len(group), engine=self.name)
        ctxs: list[WalkContext] = [c.ctx for c in group]
        tokens, logprobs = self._first_tokens(logits, group, prompts, slots, every)
        host, ready, logprobs = self._copy_out(tokens, logprobs)
        if trace.ON:
            trace.event("eng_prefill_launched", rows=len(group), engine=self.name)
        self.prefill_batches_replayed += bucket is not None
        self.prefill_batches_beside += side is not None
        return Launched(group, ctxs, slots, lengths, host, ready, side, bucket is not None, ids, given,
                        logprobs=logprobs)

    def _first_tokens(self, logits: torch.Tensor, group: list[NodeCall], prompts: list[torch.Tensor],
                      slots: list[int], every: bool) -> tuple[torch.Tensor, Logprobs | None]:
        """A prefill's first tokens from its logits (rows, 1, V) (``every``: (1, T, V), the prompt's logprobs asked),
        with what its rows' knobs ask beside the draw (engine/logits.py)."""
        ctxs: list[WalkContext] = [c.ctx for c in group]
        last = self.rows.biased(logits[:, -1])
        special = [i for i, x in enumerate(ctxs) if x.sampling.extras]
        for i in special:
            self.rows.admit(group[i].request_id, ctxs[i].sampling, slots[i], prompts[i], prompts[i].numel())
        prep = self.rows.prepare(ctxs, slots, [p.numel() - 1 for p in prompts], [0] * len(ctxs)) if special else None
        prompt = prompt_table(self.rows.biased(logits[0], whole=True), prompts[0],
                              ctxs[0].sampling.prompt_logprobs) if every else None
        return self.rows.draw(last, [x.sampling for x in ctxs], _generators(ctxs), prep, prompt)

    def _finish_prefill(self, launched: Launched) -> list[NodeResult | Held]:
        """The results of a launched prefill once its tokens are on the host: each request keeps its slot (or exports
        its KV and lets the slot go, for a decode rank elsewhere)."""
        try:
            wait(launched.ready)
            tokens = launched.host.tolist()
        except Exception:
            self._give_back(launched.slots, launched.stream)
            raise
        self.prefills += len(launched.calls)
        self.prefill_batches += 1
        results: list[NodeResult | Held] = []
        for call, ctx, slot, n, token in zip(launched.calls, launched.ctxs, launched.slots, launched.lengths, tokens):
            if call.request_id in launched.dropped:  # released while on the device: nobody takes its token
                self.cache.free(slot)
                results.append(RELEASED)
                continue
            self._seqs[call.request_id] = Seq(slot=slot, length=n)
            if offset := position_offset(call, self.position_offsets, self.name):  # decode rotates by position + it
                self._offsets[slot] = offset
            outputs = {"token": torch.tensor([token]), **launched.outputs}  # the model's own: a batch of one
            if launched.logprobs is not None:
                outputs.update(launched.logprobs.outputs(len(results)))
            if "kv" in ctx.export:  # on the current stream, where a p2p send of it is ordered (its KV writes are done)
                outputs["kv"] = self.cache.export(slot, n)
                self.release(call.request_id)
            results.append(NodeResult(outputs=outputs, stop=token in ctx.stop_token_ids))
        if trace.ON:  # the tokens are on the host: the forward has ended
            trace.event("eng_prefill_end", rows=len(launched.calls), ids=launched.ids, engine=self.name,
                        replayed=launched.replayed, beside=launched.stream is not None)
        return results

    def _answer(self, batch: Launched, at: dict[NodeCall, int], results: list[Result]) -> None:
        """Finish a launched prefill and put its results where its calls are in this turn's ``results``."""
        try:
            finished = self._finish_prefill(batch)
        except Exception as exc:  # a broken batch fails exactly its requests
            finished = [exc] * len(batch.calls)
        for call, result in zip(batch.calls, finished):
            i = at.get(call)
            if i is not None:
                results[i] = result

    def _give_back(self, slots: list[int], stream: torch.cuda.Stream | None) -> None:
        if stream is not None:
            with contextlib.suppress(Exception):  # nothing of a failed batch may write into slots given out again
                stream.synchronize()
        for slot in slots:
            self.cache.free(slot)

    def _busy_slots(self) -> set[int]:
        """The slots the decode step still in flight writes (empty when none is, or it has ended)."""
        ahead = self._ahead
        if ahead is None or has_ended(ahead.ready):
            return set()
        return {seq.slot for seq in ahead.seqs}

    # ---- decode steps ----
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
        offset = position_offset(call, self.position_offsets, self.name)
        if self.cache.num_free == 0:
            return False
        slot = self.cache.alloc()
        try:
            self.cache.import_(slot, kv.to(self.device))
        except Exception:
            self.cache.free(slot)  # a malformed KV must not cost a slot for good
            raise
        self._seqs[call.request_id] = Seq(slot=slot, length=int(kv.shape[3]))
        if offset:
            self._offsets[slot] = offset
        call.inputs.pop("kv")  # imported: let the received buffer go
        self.rows.admit(call.request_id, call.ctx.sampling, slot, call.inputs.pop("prompt_ids", None), int(kv.shape[3]))
        return True

    def _decode(self, calls: list[NodeCall], step: Step) -> list[NodeResult | Held]:
        t0 = time.perf_counter()
        if trace.ON:
            trace.event("eng_decode_start", rows=len(calls), engine=self.name)
        try:
            return self._decode_step(calls, step)
        finally:
            self.decode_seconds += time.perf_counter() - t0
            if trace.ON:
                trace.event("eng_decode_end", rows=len(calls), engine=self.name)

    def _decode_step(self, calls: list[NodeCall], step: Step) -> list[NodeResult | Held]:
        """One decode step of ``calls``: rows the lookahead already ran take its tokens, the others run now or join
        the next launch (`Scheduler.joins`); then (lookahead) the next step of all of them is launched before this
        step's tokens are copied to the host, unless a row has a grammar (its mask needs its token on the host)."""
        ahead, self._ahead = self._ahead, None
        seqs = [self._seqs[c.request_id] for c in calls]
        claimed: dict[int, int] = {}
        if ahead is not None:
            claimed, dropped = claim(ahead, calls, seqs, self._seqs)
            self.ahead_rows_used += len(claimed)
            self.ahead_rows_dropped += dropped
        live = bool(self.rows.live)  # some request here uses knobs beyond the draw (engine/logits.py)
        lookahead = self.lookahead and not (live and any(c.ctx.sampling.guided is not None for c in calls))
        fresh = [i for i in range(len(calls)) if i not in claimed]
        join: list[int] = []
        if fresh and Scheduler.joins(lookahead, bool(claimed), step):
            join, fresh = fresh, []
        run = [i for i in range(len(calls)) if i in claimed or i in fresh]  # this step's rows, in call order
        ctxs: list[WalkContext] = [c.ctx for c in calls]
        fresh_tokens = fresh_host = fresh_ready = fresh_lp = None
        if fresh:
            inputs = tokens_on_device([calls[i] for i in fresh], self.device)
            fresh_tokens, fresh_lp, _ = self._forward_sample(
                inputs, [seqs[i] for i in fresh], [ctxs[i] for i in fresh],
                done=[calls[i].iteration for i in fresh] if live else None,
                given=[calls[i].inputs["token"] for i in fresh] if live else None)
            fresh_host, fresh_ready, fresh_lp = self._copy_out(fresh_tokens, fresh_lp)
        tokens = step_tokens(ahead, claimed, fresh, run, fresh_tokens)
        for i in run:
            seqs[i].length += 1
        if lookahead:
            given = tokens_on_device([calls[i] for i in join], self.device) if join else None
            tokens = tokens if given is None else given if tokens is None else torch.cat([tokens, given])
            launch = run + join
            self._launch_ahead([calls[i] for i in launch], [seqs[i] for i in launch], [ctxs[i] for i in launch],
                               tokens, given={len(run) + k: calls[i].inputs["token"] for k, i in enumerate(join)})
        # the step's device-to-host copies (the lookahead, if any, is already queued behind them)
        ids = [0] * len(calls)
        extra: dict[int, dict[str, torch.Tensor]] = {}
        if claimed:
            wait(ahead.ready)
            ahead_ids = ahead.host.tolist()
            for i, row in claimed.items():
                ids[i] = ahead_ids[row]
            if ahead.logprobs is not None:
                extra.update({i: ahead.logprobs.outputs(row) for i, row in claimed.items()})
        if fresh:
            wait(fresh_ready)
            for i, value in zip(fresh, fresh_host.tolist()):
                ids[i] = value
            if fresh_lp is not None:
                extra.update({i: fresh_lp.outputs(k) for k, i in enumerate(fresh)})
        return self._step_results(ctxs, ids, run, join, extra)

    def _step_results(self, ctxs: list[WalkContext], ids: list[int], run: list[int], join: list[int],
                      extra: dict[int, dict[str, torch.Tensor]]) -> list[NodeResult | Held]:
        """The step's results (``ids``: each call's token on the host; ``extra``: call index -> its logprobs outputs;
        joining rows are held), and the lookahead launched from it told what its rows started from."""
        tokens_out = torch.tensor(ids, dtype=torch.long).split(1)  # one (1,) view a row, in one call
        if self._ahead is not None:
            started = [ids[i] for i in run] + [None] * len(join)
            handed = [tokens_out[i] for i in run] + [None] * len(join)
            self._ahead.inputs = [started[k] for k in self._ahead.rows]
            self._ahead.handed = [handed[k] for k in self._ahead.rows]
        self.steps += bool(run)  # a launch of joining rows only is counted when they claim it
        self.decode_rows += len(run)
        self.joined_rows += len(join)
        results: list[NodeResult | Held] = [JOINED_LOOKAHEAD] * len(ids)  # joining rows: handed over again
        for i in run:
            outputs = {"token": tokens_out[i], **extra[i]} if extra and i in extra else {"token": tokens_out[i]}
            results[i] = NodeResult(outputs=outputs, stop=ids[i] in ctxs[i].stop_token_ids)
        if join:
            self.scheduler.count(JOINED_LOOKAHEAD, len(join))
        return results

    def _forward_sample(self, tokens: torch.Tensor, seqs: list[Seq], ctxs: list[WalkContext],
                        keep_states: bool = False, done: list[int] | None = None,
                        given: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, Logprobs | None, dict]:
        """One decode forward of ``tokens`` (n,) on the device, each row writing its sequence's next position, and
        its samples (n,) on the device, their logprob tables (engine/logits.py) and, with ``keep_states``, {row:
        (generator, state before the draw)}. While a request with extras lives here (``rows.live``): ``done``, the
        tokens each row's walk made before this step, and ``given``, the calls' input token tensors (None for a
        lookahead launch)."""
        positions = [s.length for s in seqs]
        slots = [s.slot for s in seqs]
        offsets = self._offsets
        rope = [p + offsets.get(slot, 0) for p, slot in zip(positions, slots)] if offsets else None
        if self.graphs is not None and len(seqs) <= self.graphs.max_rows:
            logits = self.graphs.logits(tokens, positions, slots, rope)
        else:
            self.cache.bind(slots, positions, 1)
            logits = self.model(tokens[:, None], to_device(rope or positions, self.device)[:, None], self.cache,
                                last_only=True)
        params: list[SamplingParams] = [x.sampling for x in ctxs]
        generators = _generators(ctxs)
        states = {row: (generators[row], generators[row].get_state())
                  for row, p in enumerate(params) if keep_states and not p.greedy}
        prep = None if done is None else self.rows.prepare(ctxs, slots, positions, done, inputs=tokens, given=given)
        return *self.rows.draw(self.rows.biased(logits[:, -1]), params, generators, prep), states

    def _copy_out(self, tokens: torch.Tensor, logprobs: Logprobs | None
                  ) -> tuple[torch.Tensor, object, Logprobs | None]:
        """Start copying a forward's ``tokens`` and logprob tables to the host: (host tokens, the event to wait for,
        host tables); the tables' copies are queued first, so the tokens' event covers them."""
        tables = None if logprobs is None else logprobs.to_host(pinned=self.device.type == "cuda")
        return (*self._copy_to_host(tokens), tables)

    def _copy_to_host(self, tokens: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Start copying ``tokens`` to the host: (host tensor, CUDA event to wait for; None when already done)."""
        if self.device.type != "cuda":
            return tokens.cpu(), None
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _launch_ahead(self, calls: list[NodeCall], seqs: list[Seq], ctxs: list[WalkContext],
                      tokens: torch.Tensor, given: dict[int, torch.Tensor] | None = None) -> None:
        """Queue the step after this one for every row that has room for it (its KV write is harmless if dropped).
        ``given``: joining rows (index in ``calls``) -> the token tensor they start from."""
        rows = [i for i, s in enumerate(seqs) if s.length < self.cache.max_seq_len]
        if not rows:
            return
        if len(rows) < len(seqs):
            tokens = tokens[to_device(rows, self.device)]
        picked = [seqs[i] for i in rows]
        given = given or {}
        # a launched row follows one more token of its walk than its call made, a joining row its call's
        done = [calls[i].iteration + (i not in given) for i in rows] if self.rows.live else None
        sampled, logprobs, states = self._forward_sample(tokens, picked, [ctxs[i] for i in rows], keep_states=True,
                                                         done=done)
        host, ready, logprobs = self._copy_out(sampled, logprobs)
        self._ahead = Ahead(rows=rows, request_ids=[calls[i].request_id for i in rows], seqs=picked,
                            lengths=[s.length for s in picked], tokens=sampled, host=host, ready=ready,
                            generator_states=states, given={k: given[i] for k, i in enumerate(rows) if i in given},
                            logprobs=logprobs)

def _generators(ctxs: list[WalkContext]) -> list[torch.Generator | None]:
    """The rows' sampling generators, made only for rows that draw (a greedy row never does: no generator to build
    for each greedy request's prefill)."""
    return [None if x.sampling.greedy else x.generator("cpu") for x in ctxs]
