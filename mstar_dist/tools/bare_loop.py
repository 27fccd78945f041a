"""A plain batched greedy generate loop: the performance ceiling a serving benchmark compares against."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only: the loop runs any model with the Llama forward's signature
    from models.llama.model import Llama
    from mstar_dist.engine.kv_cache import StaticKVCache


@torch.inference_mode()
def bare_generate(model: Llama, cache: StaticKVCache, prompts_ids: list[list[int]], max_new_tokens: int,
                  graphs=None, phases: dict | None = None) -> tuple[list[list[int]], float]:
    """Greedy-generate exactly `max_new_tokens` per prompt (no EOS stop); return (new tokens, seconds).

    Prompts of equal length are prefilled together, then every row decodes in one batch per step (rows
    at different lengths share a step). Needs len(prompts_ids) free cache slots; frees them on return.
    With ``graphs`` (an ``engine.cuda_graphs.DecodeGraphs`` over this model and cache, captured) decode steps
    replay CUDA graphs, as the serving engine's do. The time covers prefill and decode and ends after the tokens
    reach the host. With ``phases`` (a dict) it also gets ``prefill_s`` and ``decode_s``: the device is synchronised
    once between the prefills and the first decode step, so ``decode_s`` times the decode steps alone (the
    ``max_new_tokens - 1`` tokens a row gets after its first), the rate a decode loop can reach.
    """
    if max_new_tokens < 1 or not prompts_ids or any(len(p) == 0 for p in prompts_ids):
        raise ValueError(f"bare_generate: need max_new_tokens >= 1 and non-empty prompts, got "
                         f"{max_new_tokens} and lengths {[len(p) for p in prompts_ids]}")
    device = model.embed.weight.device
    slots = [cache.alloc() for _ in prompts_ids]
    try:
        start = time.perf_counter()
        by_length: dict[int, list[int]] = defaultdict(list)  # prompt length -> rows
        for row, ids in enumerate(prompts_ids):
            by_length[len(ids)].append(row)
        first = torch.empty(len(prompts_ids), dtype=torch.long, device=device)
        for length, rows in by_length.items():
            cache.bind([slots[r] for r in rows], [0] * len(rows), length)
            ids = torch.tensor([prompts_ids[r] for r in rows], device=device)  # (b, length)
            positions = torch.arange(length, device=device).expand(len(rows), length)
            logits = model(ids, positions, cache, last_only=True)  # (b, 1, V)
            first[torch.tensor(rows, device=device)] = logits[:, -1].argmax(-1)
        if phases is not None:
            _sync(device)
            decode_start = time.perf_counter()
            phases["prefill_s"] = decode_start - start
        lengths = [len(p) for p in prompts_ids]
        positions = torch.tensor(lengths, device=device)[:, None]  # (B, 1)
        tokens, out = first, [first]
        for _ in range(max_new_tokens - 1):
            if graphs is not None:
                tokens = graphs.logits(tokens, lengths, slots)[:, -1].argmax(-1)  # (B,)
            else:
                cache.bind(slots, lengths, 1)
                tokens = model(tokens[:, None], positions, cache, last_only=True)[:, -1].argmax(-1)  # (B,)
            out.append(tokens)
            lengths = [n + 1 for n in lengths]
            positions = positions + 1
        result = torch.stack(out, dim=1).tolist()  # the only host sync (with ``phases``, the second)
        end = time.perf_counter()
        if phases is not None:
            phases["decode_s"] = end - decode_start
        return result, end - start
    finally:
        for slot in slots:
            cache.free(slot)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
