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
                 cuda_graphs: bool = False, logit_bias: torch.Tensor | None = None):
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
        self._seqs: dict[str, _Seq] = {}
        self.steps = 0
        self.decode_rows = 0
        self.prefills = 0
        self.decode_seconds = 0.0

    @torch.inference_mode()
    def run_batch(self, calls: list[NodeCall]) -> list[NodeResult | BaseException | None]:
        results: list[NodeResult | BaseException | None] = [None] * len(calls)
        decode: list[int] = []
        for i, call in enumerate(calls):
            try:
                if "input_ids" in call.inputs:
                    results[i] = self._prefill(call)
                elif self._ensure_seq(call):
                    if self._seqs[call.request_id].length + 1 > self.cache.max_seq_len:
                        raise RuntimeError(f"request {call.request_id!r} reached the context limit "
                                           f"{self.cache.max_seq_len}")
                    decode.append(i)
            except Exception as exc:  # one request's failure must not take the batch down
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
                "prefills_total": self.prefills, "decode_steps_total": self.steps,
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
    def _prefill(self, call: NodeCall) -> NodeResult | None:
        ctx: WalkContext = call.ctx
        if call.request_id in self._seqs:
            raise RuntimeError(f"request {call.request_id!r} already has a KV slot on {self.name!r}")
        if self.cache.num_free == 0:
            return None
        ids = call.inputs["input_ids"].to(self.device, torch.long).reshape(-1)
        n = ids.numel()
        if n == 0:
            raise ValueError("empty prompt")
        if n >= self.cache.max_seq_len:
            raise ValueError(f"prompt is {n} tokens; this engine's context is {self.cache.max_seq_len}")
        slot = self.cache.alloc()
        self.prefills += 1
        seq = _Seq(slot=slot, length=n)
        self._seqs[call.request_id] = seq
        self.cache.bind([slot], [0], n)
        logits = self.model(ids[None], torch.arange(n, device=self.device)[None], self.cache, last_only=True)
        token = sample(self._biased(logits[:, -1]), [ctx.sampling], [ctx.generator("cpu")]).cpu()
        outputs = {"token": token.reshape(1)}
        if "kv" in ctx.export:
            outputs["kv"] = self.cache.export(slot, n)
            self.release(call.request_id)
        return NodeResult(outputs=outputs, stop=int(token) in ctx.stop_token_ids)

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
