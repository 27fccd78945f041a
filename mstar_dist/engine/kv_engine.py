"""KV-cache engine for an autoregressive node (docs/architecture.md §8): slots, continuous batching, sampling, stop checks.

Inputs a call may carry:
- ``input_ids`` (T,) int64: a prefill. Takes a KV slot, runs the prompt, samples the first token.
- ``token`` (1,) int64: one decode step. All decode calls handed over together run as one batched forward,
  whatever each request's length.
- ``kv`` (n_layers, 2, n_kv_heads, T, head_dim): a KV cache produced by a prefill on another rank (P/D split);
  it is imported into a fresh slot before the request's first decode step here.

Outputs: ``token`` (1,) int64 always; ``kv`` after a prefill when the walk context exports it (the decode rank is
another rank), in which case this rank's slot is freed at once. The stop check fires on the model's EOS ids.
A call that finds no free slot is answered ``None`` and retried by the worker once slots free up.

Prefills handed over together run as batched forwards of at most ``prefill_token_budget`` tokens (rows right-padded
to the batch's longest prompt; a row's logits are read at its own last token, and the pad positions it writes into
its slot are never attended: decode overwrites and masks them). A model whose pads are not inert (a stateful MoE
router would count them) sets ``pads_are_inert = False``: then only prompts of one length share a forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mstar_dist.engine.component import Component, WalkContext
from mstar_dist.engine.kv_cache import StaticKVCache
from mstar_dist.engine.sampling import sample
from mstar_dist.graph.walk import NodeCall, NodeResult


@dataclass
class _Seq:
    slot: int
    length: int
    """Positions already in the cache."""


class KVCacheEngine(Component):
    def __init__(self, name: str, model: torch.nn.Module, cache: StaticKVCache, device: torch.device,
                 cuda_graphs: bool = False, logit_bias: torch.Tensor | None = None,
                 prefill_token_budget: int = 4096):
        """With ``cuda_graphs`` (CUDA only) decode steps replay captured graphs; the cache must hold one slot
        more than the batch: it is kept as the padding rows' scratch slot. ``logit_bias`` (V,) is added to every
        row's logits before sampling (``-inf`` forbids a token: e.g. a speech LLM restricted to audio codes)."""
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
        self._seqs: dict[str, _Seq] = {}
        self.steps = 0
        self.decode_rows = 0
        self.prefills = 0
        self.prefill_batches = 0
        self.decode_seconds = 0.0

    @torch.inference_mode()
    def run_batch(self, calls: list[NodeCall]) -> list[NodeResult | BaseException | None]:
        results: list[NodeResult | BaseException | None] = [None] * len(calls)
        decode: list[int] = []
        prefill: list[tuple[int, torch.Tensor]] = []
        for i, call in enumerate(calls):
            try:
                if "input_ids" in call.inputs:
                    prefill.append((i, self._prompt(call)))
                elif self._ensure_seq(call):
                    if self._seqs[call.request_id].length + 1 > self.cache.max_seq_len:
                        raise RuntimeError(f"request {call.request_id!r} reached the context limit "
                                           f"{self.cache.max_seq_len}")
                    decode.append(i)
            except Exception as exc:  # one request's failure must not take the batch down
                results[i] = exc
        for group in self._prefill_groups(prefill):
            try:
                for (i, _), result in zip(group, self._prefill([calls[i] for i, _ in group], [ids for _, ids in group])):
                    results[i] = result
            except Exception as exc:  # a broken batch fails exactly its requests
                for i, _ in group:
                    results[i] = exc
        if decode:
            try:
                for i, result in zip(decode, self._decode([calls[i] for i in decode])):
                    results[i] = result
            except Exception as exc:  # a broken batch fails exactly its requests
                for i in decode:
                    results[i] = exc
        return results

    def release(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.cache.free(seq.slot)

    def stats(self) -> dict[str, int]:
        return {"kv_slots_used": len(self._seqs), "kv_slots_free": self.cache.num_free,
                "prefills_total": self.prefills, "prefill_batches_total": self.prefill_batches,
                "decode_steps_total": self.steps,
                "decode_rows_total": self.decode_rows, "decode_ms_total": int(self.decode_seconds * 1000)}

    def warmup(self) -> None:
        if self.graphs is not None:
            self.graphs.capture()
        with torch.inference_mode():
            slot = self.cache.alloc()
            try:
                ids = torch.zeros((1, 4), dtype=torch.long, device=self.device)
                pos = torch.arange(4, device=self.device)[None]
                self.cache.bind([slot], [0], 4)
                self.model(ids, pos, self.cache, last_only=True)
            finally:
                self.cache.free(slot)

    # ---- internals ----
    def _prompt(self, call: NodeCall) -> torch.Tensor:
        """The call's prompt ids (T,) on the device, checked."""
        if call.request_id in self._seqs:
            raise RuntimeError(f"request {call.request_id!r} already has a KV slot on {self.name!r}")
        ids = call.inputs["input_ids"].to(self.device, torch.long).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("empty prompt")
        if ids.numel() >= self.cache.max_seq_len:
            raise ValueError(f"prompt is {ids.numel()} tokens; this engine's context is {self.cache.max_seq_len}")
        return ids

    def _prefill_groups(self, prefill: list[tuple[int, torch.Tensor]]) -> list[list[tuple[int, torch.Tensor]]]:
        """The prefills that get a slot now, in arrival order, cut into forwards of at most the token budget
        (padded size: rows x longest prompt); prompts of one length only when pads are not inert. The rest wait
        (answered None) for a free slot."""
        admitted = prefill[: self.cache.num_free]
        groups: list[list[tuple[int, torch.Tensor]]] = []
        for item in admitted:
            n = item[1].numel()
            for group in groups:
                longest = max(n, *(ids.numel() for _, ids in group))
                if (self.ragged_prefill or group[0][1].numel() == n) and longest * (len(group) + 1) <= \
                        self.prefill_token_budget:
                    group.append(item)
                    break
            else:
                groups.append([item])
        return groups

    def _prefill(self, calls: list[NodeCall], prompts: list[torch.Tensor]) -> list[NodeResult]:
        """One forward for every prompt (right-padded), then one sample per row."""
        lengths = [p.numel() for p in prompts]
        longest = max(lengths)
        slots = [self.cache.alloc() for _ in calls]
        try:
            ids = torch.zeros((len(calls), longest), dtype=torch.long, device=self.device)
            for row, prompt in enumerate(prompts):
                ids[row, : prompt.numel()] = prompt
            positions = torch.arange(longest, device=self.device).expand(len(calls), longest)
            self.cache.bind(slots, [0] * len(calls), longest)
            last = None if min(lengths) == longest else torch.tensor(lengths, device=self.device) - 1
            logits = self.model(ids, positions, self.cache, last_only=True, last_index=last)
            ctxs: list[WalkContext] = [c.ctx for c in calls]
            tokens = sample(self._biased(logits[:, -1]), [x.sampling for x in ctxs],
                            [x.generator("cpu") for x in ctxs]).cpu()
        except BaseException:
            for slot in slots:
                self.cache.free(slot)
            raise
        self.prefills += len(calls)
        self.prefill_batches += 1
        results = []
        for row, (call, ctx, slot, n) in enumerate(zip(calls, ctxs, slots, lengths)):
            self._seqs[call.request_id] = _Seq(slot=slot, length=n)
            token = tokens[row : row + 1]
            outputs = {"token": token}
            if "kv" in ctx.export:
                outputs["kv"] = self.cache.export(slot, n)
                self.release(call.request_id)
            results.append(NodeResult(outputs=outputs, stop=int(token) in ctx.stop_token_ids))
        return results

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

    def _decode(self, calls: list[NodeCall]) -> list[NodeResult | BaseException]:
        t0 = time.perf_counter()
        try:
            return self._decode_step(calls)
        finally:
            self.decode_seconds += time.perf_counter() - t0

    def _decode_step(self, calls: list[NodeCall]) -> list[NodeResult | BaseException]:
        seqs = [self._seqs[c.request_id] for c in calls]
        # tokens this engine sampled are host tensors; a request's first one may arrive on the device
        tokens = torch.cat([c.inputs["token"].reshape(1).cpu() for c in calls]).to(self.device, torch.long)
        if self.graphs is not None and len(calls) <= self.graphs.max_rows:
            logits = self.graphs.logits(tokens, [s.length for s in seqs], [s.slot for s in seqs])
        else:
            positions = torch.tensor([s.length for s in seqs], dtype=torch.long, device=self.device)
            self.cache.bind([s.slot for s in seqs], [s.length for s in seqs], 1)
            logits = self.model(tokens[:, None], positions[:, None], self.cache, last_only=True)
        ctxs: list[WalkContext] = [c.ctx for c in calls]
        sampled = sample(self._biased(logits[:, -1]), [x.sampling for x in ctxs],
                         [x.generator("cpu") for x in ctxs])
        sampled = sampled.cpu()  # the step's one device-to-host copy: stop checks, emits and streams read it
        ids = sampled.tolist()
        self.steps += 1
        self.decode_rows += len(calls)
        results: list[NodeResult | BaseException] = []
        for i, (ctx, seq) in enumerate(zip(ctxs, seqs)):
            seq.length += 1
            results.append(NodeResult(outputs={"token": sampled[i : i + 1]}, stop=ids[i] in ctx.stop_token_ids))
        return results
