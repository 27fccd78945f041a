"""Decode attention that reads the KV cache in place: one Triton kernel per layer and step (docs/architecture.md §8,
"Decode attention").

The SDPA path of ``StaticKVCache.bind_graph`` writes the step's K and V with two scatters, copies every row's keys
and values over its context bucket out of the cache (``index_select``, a large share of a step's device time) and
runs SDPA over the copies under a mask. ``decode_attend`` does all of
it in one launch: program (row b, KV head h) loads the queries of the heads that share h, writes the new K/V at the
row's position, takes the new token's score from registers and walks the row's cached positions [0, pos) of its own
slot block by block with an online softmax. It reads each row's own length (a device tensor), so a graph serves
every length up to its bucket; two buckets remain (``kernel_contexts``): above ``SPLIT_CONTEXT`` a small batch splits
each row's positions over several programs and a second kernel combines their partial softmaxes (``splits_for``).

Rows are one token each (decode); padding rows point at the scratch slot with position 0 and read nothing from the
cache. ``available`` says whether the kernel can run on a device (Triton importable, and CUDA, or Triton's
interpreter for the CPU tests)."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU wheels of torch come without Triton: the SDPA path serves
    triton = None

BLOCK = 64
"""Cached positions per iteration of a program's loop."""


def available(device: torch.device | str) -> bool:
    """Whether ``decode_attend`` can run on ``device``."""
    if triton is None:
        return False
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def wanted(choice: str, device: str, graphs: bool) -> bool:
    """Whether CUDA-graph decode steps (``graphs``: the engine captures them) on ``device`` attend with the kernel, for
    ``engine.decode_attention`` = ``choice`` (mstar_dist/config/engine.py): ``auto`` wherever it can run, ``sdpa``
    never, ``triton`` always, and a ValueError naming the key where it cannot run."""
    if choice == "sdpa":
        return False
    if choice == "triton":
        if not graphs:
            raise ValueError("engine.decode_attention: triton attends in CUDA-graph decode steps, and cuda_graphs is "
                             f"off (device {device!r})")
        if not available(device):
            why = "Triton is not installed" if triton is None else f"not on {device}"
            raise ValueError(f"engine.decode_attention: triton needs Triton on a CUDA device, and {why}")
    return graphs and available(device)


SPLIT_CONTEXT = 512
"""Context buckets above this split a row's positions over several programs when the batch is small
(``splits_for``); graphs at or below it run one program a (row, KV head) and no combine."""
SPLIT_PROGRAMS = 96
MAX_SPLITS = 8


def kernel_contexts(max_seq_len: int) -> list[int]:
    """The decode graphs' context buckets with the kernel: ``SPLIT_CONTEXT`` (no split) and the whole cache."""
    return [SPLIT_CONTEXT, max_seq_len] if max_seq_len > SPLIT_CONTEXT else [max_seq_len]


def splits_for(rows: int, n_kv: int, ctx: int) -> int:
    """Programs a (row, KV head) splits its positions over: 1 up to ``SPLIT_CONTEXT``; above, doubled while the grid
    stays within ``SPLIT_PROGRAMS`` programs (at most ``MAX_SPLITS``). A single row at position 1500 otherwise walks
    24 blocks in each of 3 programs, on a GPU of a hundred or more SMs: its step takes longer than at a short position
    by the length of that walk, with most of the GPU idle."""
    splits = 1
    if ctx > SPLIT_CONTEXT:
        while splits < MAX_SPLITS and 2 * splits * rows * n_kv <= SPLIT_PROGRAMS:
            splits *= 2
    return splits


if triton is not None:

    @triton.jit
    def _decode_kernel(q_ptr, kn_ptr, vn_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, out_ptr, acc_ptr, ml_ptr,
                       sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sc_slot, sc_head, sc_pos, so_b, so_h, scale,
                       GROUP: tl.constexpr, G_PAD: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr, SPLITS: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        pos = tl.load(pos_ptr + b).to(tl.int64)
        d = tl.arange(0, HD)
        g = tl.arange(0, G_PAD)
        heads = h * GROUP + g
        q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
        k_new = tl.load(kn_ptr + b * sk_b + h * sk_h + d)
        v_new = tl.load(vn_ptr + b * sv_b + h * sv_h + d)
        base = slot * sc_slot + h * sc_head
        first = sp == 0
        tl.store(kc_ptr + base + pos * sc_pos + d, k_new, mask=(d < HD) & first)
        tl.store(vc_ptr + base + pos * sc_pos + d, v_new, mask=(d < HD) & first)
        # this split's positions, whole blocks (one split: all of [0, pos)); the new token's own score seeds the first
        # split's online softmax (the others start empty): it is never read back from the cache
        per = tl.cdiv(tl.cdiv(pos, SPLITS), BLOCK_N) * BLOCK_N
        lo = sp * per
        hi = tl.minimum(lo + per, pos)
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale  # (G_PAD,)
        m = tl.where(first, s_new, tl.full((G_PAD,), float("-inf"), tl.float32))
        l = tl.where(first, tl.full((G_PAD,), 1.0, tl.float32), tl.zeros((G_PAD,), tl.float32))
        acc = tl.where(first, tl.zeros((G_PAD, HD), tl.float32) + v_new.to(tl.float32)[None, :],
                       tl.zeros((G_PAD, HD), tl.float32))
        n = tl.arange(0, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            at = start + n
            inside = at < hi
            offs = base + at[:, None] * sc_pos + d[None, :]
            keys = tl.load(kc_ptr + offs, mask=inside[:, None], other=0.0)  # (BLOCK_N, HD)
            values = tl.load(vc_ptr + offs, mask=inside[:, None], other=0.0)
            s = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale  # (G_PAD, BLOCK_N), fp32
            s = tl.where(inside[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision=PRECISION)
            m = m_new
        if SPLITS == 1:
            out = acc / l[:, None]
            tl.store(out_ptr + b * so_b + heads[:, None] * so_h + d[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=(g < GROUP)[:, None])
        else:  # partial results, combined by _combine_kernel
            part = (b * tl.num_programs(1) + h) * SPLITS + sp
            tl.store(acc_ptr + (part * G_PAD + g[:, None]) * HD + d[None, :], acc)
            tl.store(ml_ptr + part * 2 * G_PAD + g, m)
            tl.store(ml_ptr + part * 2 * G_PAD + G_PAD + g, l)

    @triton.jit
    def _combine_kernel(acc_ptr, ml_ptr, out_ptr, so_b, so_h, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                        HD: tl.constexpr, SPLITS: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        parts = (b * tl.num_programs(1) + h) * SPLITS + tl.arange(0, SPLITS)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, HD)
        m = tl.load(ml_ptr + parts[:, None] * 2 * G_PAD + g[None, :])  # (SPLITS, G_PAD); -inf for an empty split
        l = tl.load(ml_ptr + parts[:, None] * 2 * G_PAD + G_PAD + g[None, :])
        top = tl.max(m, 0)  # finite: the first split holds the new token
        w = tl.exp(m - top[None, :])
        total = tl.sum(w * l, 0)
        acc = tl.load(acc_ptr + (parts[:, None, None] * G_PAD + g[None, :, None]) * HD + d[None, None, :])
        out = tl.sum(w[:, :, None] * acc, 0) / total[:, None]
        heads = h * GROUP + g
        tl.store(out_ptr + b * so_b + heads[:, None] * so_h + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(g < GROUP)[:, None])

    @triton.jit
    def _store_prompt_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                             sc_slot, sc_head, sc_pos, n_kv, H_PAD: tl.constexpr, HD: tl.constexpr):
        b = tl.program_id(0)
        t = tl.program_id(1)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        h = tl.arange(0, H_PAD)
        d = tl.arange(0, HD)
        inside = (h < n_kv)[:, None]
        k = tl.load(k_ptr + b * sk_b + t * sk_t + h[:, None] * sk_h + d[None, :], mask=inside)
        v = tl.load(v_ptr + b * sv_b + t * sv_t + h[:, None] * sv_h + d[None, :], mask=inside)
        at = slot * sc_slot + h[:, None] * sc_head + t * sc_pos + d[None, :]
        tl.store(kc_ptr + at, k, mask=inside)
        tl.store(vc_ptr + at, v, mask=inside)


def store_prompt(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """A prefill from position 0 writes its keys and values: k / v (B, nkv, T, hd), row b to positions [0, T) of slot
    ``slots[b]`` (a device tensor) of k_cache / v_cache (S, nkv, L, hd). One launch where the indexed assignments took
    two (``index_put``, two of a short prefill's few hundred kernels a layer pair)."""
    B, nkv, T, hd = k.shape
    if hd & (hd - 1) or k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError(f"store_prompt: a power-of-two head_dim, contiguous in it, got k {tuple(k.shape)} strides "
                         f"{k.stride()}")
    if B * T:
        _store_prompt_kernel[(B, T)](
            k, v, k_cache, v_cache, slots, k.stride(0), k.stride(2), k.stride(1), v.stride(0), v.stride(2),
            v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), nkv,
            H_PAD=triton.next_power_of_2(nkv), HD=hd)


def decode_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slots: torch.Tensor, positions: torch.Tensor, ctx: int | None = None,
                  splits: int | None = None) -> torch.Tensor:
    """One decode step's attention for B rows: q (B, nh, 1, hd), k/v (B, nkv, 1, hd) with RoPE applied, k_cache /
    v_cache (S, nkv, L, hd) one layer's cache, slots / positions (B,) device tensors. Writes k/v at each row's position
    of its slot and returns (B, nh, 1, hd): row b attends over positions [0, positions[b]] of slot slots[b]. ``ctx``:
    the graph's context bucket (every position is below it), which with the batch sets ``splits`` (``splits_for``;
    a power of two), the programs a row's positions are split over."""
    B, nh, T, hd = q.shape
    nkv = k.shape[1]
    if T != 1 or k.shape[2] != 1 or nh % nkv or hd & (hd - 1) or hd < 16:
        raise ValueError(f"decode_attend: needs one token a row, heads a multiple of the KV heads and a power-of-two "
                         f"head_dim >= 16, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"decode_attend: {name} must be contiguous in head_dim, got strides {t.stride()}")
    splits = splits_for(B, nkv, k_cache.shape[2] if ctx is None else ctx) if splits is None else splits
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"decode_attend: splits must be a power of two, got {splits}")
    group = nh // nkv
    g_pad = max(16, triton.next_power_of_2(group))
    out = torch.empty((B, nh, 1, hd), dtype=q.dtype, device=q.device)
    acc = ml = out  # unused without a split
    if splits > 1:
        acc = torch.empty((B * nkv * splits, g_pad, hd), dtype=torch.float32, device=q.device)
        ml = torch.empty((B * nkv * splits, 2, g_pad), dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 caches: no TF32 rounding
    _decode_kernel[(B, nkv, splits)](
        q, k, v, k_cache, v_cache, slots, positions, out, acc, ml,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1), hd ** -0.5,
        GROUP=group, G_PAD=g_pad, HD=hd, BLOCK_N=BLOCK, PRECISION=precision, SPLITS=splits, num_warps=4)
    if splits > 1:
        _combine_kernel[(B, nkv)](acc, ml, out, out.stride(0), out.stride(1), GROUP=group, G_PAD=g_pad, HD=hd,
                                  SPLITS=splits, num_warps=4)
    return out
