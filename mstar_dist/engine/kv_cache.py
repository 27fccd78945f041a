"""Static, slot-based KV cache with batched attention (model-agnostic).

One request owns one *slot*: a row of static per-layer K/V buffers, allocated once when the cache is built
(no reallocation per step, so a decode step can later be captured in a CUDA graph). A forward pass is
described to the cache by `bind(slots, start_pos, n_new)`: batch row b is slot `slots[b]` and writes its
`n_new` new tokens at positions `start_pos[b] ...`. Rows may sit at different lengths (continuous batching
of decode steps). Each attention layer of the model then calls `attend(layer, q, k, v)`.

Layout: one tensor `kv` of shape (n_layers, 2, max_slots, n_kv_heads, max_seq_len, head_dim); index 0 of
dim 1 is K, index 1 is V. `export`/`import_` move one slot's prefix as a single contiguous tensor
(n_layers, 2, n_kv_heads, length, head_dim) - the tensor a prefill rank sends to a decode rank.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from mstar_dist.engine import decode_attention
from mstar_dist.engine.sampling import to_device


class AttentionCache(Protocol):
    """What a model's attention layer needs: store this step's K/V and attend over the cached context."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, n_heads, T, hd), k/v (B, n_kv_heads, T, hd), RoPE applied -> (B, n_heads, T, hd)."""
        ...


@dataclass
class Seq:
    """One request's place in the cache: its slot and how many positions of it are filled."""

    slot: int
    length: int
    """Positions already in the cache."""


class KVCacheFullError(RuntimeError):
    """`alloc()` found no free slot."""


@dataclass(frozen=True)
class _Binding:
    """Everything `attend` needs for one forward pass, computed once in `bind` and reused by every layer."""

    n_rows: int
    n_new: int
    ctx: int
    """Keys attended: max over rows of start_pos + n_new."""
    slot_start: int | None
    """First slot when the rows are the contiguous range slot_start.. (K/V are then views, not copies)."""
    slot_idx: torch.Tensor
    """(B,) slot of each row."""
    uniform_start: int | None
    """The shared start position when every row has the same one."""
    write_pos: torch.Tensor | None
    """(B, n_new) positions written by each row; None when uniform_start is set."""
    mask: torch.Tensor | None
    """Boolean attention mask broadcastable to (B, 1, n_new, ctx); True = attend. None = see is_causal."""
    is_causal: bool
    """Plain causal attention over the new tokens (prefill from position 0)."""


class StaticKVCache:
    """Per-slot K/V storage for `n_layers` attention layers; see the module docstring for the contract."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_slots: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 decode_kernel: bool = False) -> None:
        """``decode_kernel``: graph-bound decode passes (``bind_graph``) attend with ``decode_attention.decode_attend``,
        which reads each row's own positions of its slot in place, instead of copying the rows' keys and values out of
        the cache for SDPA, and graph-bound prefills (``bind_prefill_graph``) write their keys and values in one launch
        (``decode_attention.store_prompt``) (needs Triton and CUDA: ``decode_attention.available``)."""
        for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                            ("max_slots", max_slots), ("max_seq_len", max_seq_len)):
            if value <= 0:
                raise ValueError(f"StaticKVCache: {name} must be positive, got {value}")
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        if decode_kernel and not decode_attention.available(device):
            raise ValueError(f"StaticKVCache: decode_kernel needs Triton and a CUDA device, got {device!r} "
                             f"(Triton {'importable' if decode_attention.triton is not None else 'not installed'})")
        self.decode_kernel = bool(decode_kernel)
        # Zeros, not empty: rows shorter than the batch's longest row read (masked) stale positions, and a
        # masked NaN would still poison the softmax-weighted sum.
        self.kv = torch.zeros(n_layers, 2, max_slots, n_kv_heads, max_seq_len, head_dim,
                              dtype=dtype, device=device)
        self._free: list[int] = list(range(max_slots))  # a heap: alloc hands out the lowest free slot
        self._allocated: set[int] = set()
        self._binding: _Binding | None = None
        self._graph_binding: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None
        self._prefill_binding: tuple[torch.Tensor, torch.Tensor] | None = None
        self._positions = torch.arange(max_seq_len, device=device)  # (L,) for graph-mode masks

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    # ---- slots ----------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, avoid: frozenset[int] | set[int] = frozenset()) -> int:
        """Reserve the lowest free slot (low slots keep batches contiguous, which avoids K/V copies); the lowest one
        not in ``avoid`` if there is one (slots that work still queued on the device writes)."""
        if not self._free:
            raise KVCacheFullError(f"KV cache full: all {self.max_slots} slots are in use "
                                   f"(max_seq_len {self.max_seq_len}); free a slot or build a larger cache")
        if avoid and self._free[0] in avoid:
            slot = min((s for s in self._free if s not in avoid), default=self._free[0])
            self._free.remove(slot)
            heapq.heapify(self._free)
        else:
            slot = heapq.heappop(self._free)
        self._allocated.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back. Its contents stay until overwritten (they are never read unmasked)."""
        self._check_allocated(slot)
        self._allocated.remove(slot)
        heapq.heappush(self._free, slot)

    def _check_allocated(self, slot: int) -> None:
        if slot not in self._allocated:
            raise ValueError(f"KV cache slot {slot} is not allocated (max_slots {self.max_slots})")

    # ---- one forward pass -----------------------------------------------------------------------

    def bind_graph(self, slot_idx: torch.Tensor, positions: torch.Tensor, ctx: int | None = None) -> None:
        """Bind a one-token-per-row decode pass whose slots and positions are device tensors (B,), read inside the
        pass. Nothing here reads them on the host, so the pass can be captured in a CUDA graph and replayed after
        new values are copied into the same tensors. Rows attend over the first ``ctx`` positions (default all
        ``max_seq_len``) under a mask (static shapes): every position written must be below ``ctx``. Rows may
        repeat a slot only if they write the same position (padding rows). With ``decode_kernel`` a row reads its own
        positions up to the one it writes, whatever ``ctx``: no mask."""
        ctx = self.max_seq_len if ctx is None else ctx
        if not 0 < ctx <= self.max_seq_len:
            raise ValueError(f"bind_graph: ctx must be in [1, {self.max_seq_len}], got {ctx}")
        mask = None if self.decode_kernel else \
            (self._positions[None, :ctx] <= positions[:, None])[:, None, None, :]  # (B, 1, 1, ctx)
        self._binding = self._prefill_binding = None
        self._graph_binding = (slot_idx, positions, mask, ctx)

    def bind_prefill_graph(self, slot_idx: torch.Tensor, n_new: int) -> None:
        """Bind a prefill pass from position 0 whose slots are a device tensor (B,), read inside the pass (so it can
        be captured in a CUDA graph, as ``bind_graph``): row b writes its ``n_new`` tokens at positions
        [0, n_new) of slot ``slot_idx[b]`` and attends causally over them. Rows may repeat a slot only when
        what they write is never read (padding rows into a scratch slot)."""
        if not 0 < n_new <= self.max_seq_len:
            raise ValueError(f"bind_prefill_graph: n_new must be in [1, {self.max_seq_len}], got {n_new}")
        self._binding = self._graph_binding = None
        self._prefill_binding = (slot_idx, self._positions[:n_new])

    def bind(self, slots: list[int], start_pos: list[int], n_new: int) -> None:
        """Describe the next forward pass: row b is slot slots[b], writing n_new tokens from start_pos[b]."""
        if not slots or len(slots) != len(start_pos):
            raise ValueError(f"bind: need one start_pos per slot, got {len(slots)} slots and "
                             f"{len(start_pos)} start positions")
        if n_new < 1:
            raise ValueError(f"bind: n_new must be >= 1, got {n_new}")
        if len(set(slots)) != len(slots):
            raise ValueError(f"bind: slots must be distinct, got {slots}")
        for slot, start in zip(slots, start_pos):
            self._check_allocated(slot)
            if start < 0 or start + n_new > self.max_seq_len:
                raise ValueError(f"bind: slot {slot} writes positions [{start}, {start + n_new}) outside "
                                 f"[0, max_seq_len={self.max_seq_len})")
        dev = self.device
        n_rows = len(slots)
        ctx = max(start_pos) + n_new
        self._prefill_binding = None
        contiguous = slots == list(range(slots[0], slots[0] + n_rows))
        uniform = all(s == start_pos[0] for s in start_pos)
        new = torch.arange(n_new, device=dev)
        write_pos = mask = None
        is_causal = False
        if uniform:
            start = start_pos[0]
            if n_new > 1 and start == 0:
                is_causal = True
            elif n_new > 1:  # the new tokens continue a prefix: causal mask offset by `start`
                mask = torch.arange(ctx, device=dev)[None, :] <= (start + new)[:, None]  # (T, ctx)
        else:
            starts = to_device(start_pos, dev)
            write_pos = starts[:, None] + new[None, :]  # (B, T)
            mask = (torch.arange(ctx, device=dev)[None, None, :] <= write_pos[:, :, None])[:, None]  # (B,1,T,ctx)
        self._graph_binding = None
        self._binding = _Binding(
            n_rows=n_rows, n_new=n_new, ctx=ctx,
            slot_start=slots[0] if contiguous else None,
            slot_idx=to_device(slots, dev),
            uniform_start=start_pos[0] if uniform else None,
            write_pos=write_pos, mask=mask, is_causal=is_causal,
        )

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k/v of the bound rows at their positions, then attend over each row's [0, start+n_new).

        q: (B, n_heads, T, hd); k, v: (B, n_kv_heads, T, hd), RoPE applied. Returns (B, n_heads, T, hd).
        Causal inside the new tokens; GQA by SDPA's enable_gqa (no repeated K/V).
        """
        if self._graph_binding is not None:
            return self._attend_graph(layer, q, k, v)
        if self._prefill_binding is not None:
            return self._attend_prefill_graph(layer, q, k, v)
        b = self._binding
        if b is None:
            raise RuntimeError("StaticKVCache.attend called before bind()")
        assert q.shape[0] == b.n_rows and q.shape[2] == b.n_new, (q.shape, b.n_rows, b.n_new)
        k_cache, v_cache = self.kv[layer, 0], self.kv[layer, 1]  # (S, nkv, L, hd) each
        self._write(b, k_cache, k)
        self._write(b, v_cache, v)
        if b.slot_start is not None:
            rows = slice(b.slot_start, b.slot_start + b.n_rows)
            keys, values = k_cache[rows, :, :b.ctx], v_cache[rows, :, :b.ctx]  # views (B, nkv, ctx, hd)
        else:
            keys = k_cache[:, :, :b.ctx].index_select(0, b.slot_idx)
            values = v_cache[:, :, :b.ctx].index_select(0, b.slot_idx)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=b.mask, is_causal=b.is_causal,
                                              enable_gqa=True)

    def _attend_graph(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        slot_idx, positions, mask, ctx = self._graph_binding
        k_cache, v_cache = self.kv[layer, 0], self.kv[layer, 1]  # (S, nkv, L, hd)
        if self.decode_kernel:
            return decode_attention.decode_attend(q, k, v, k_cache, v_cache, slot_idx, positions, ctx)
        # advanced indices around a slice: the indexed view is (B, nkv, hd); k/v are (B, nkv, 1, hd)
        k_cache[slot_idx, :, positions] = k[:, :, 0]
        v_cache[slot_idx, :, positions] = v[:, :, 0]
        keys = k_cache[:, :, :ctx].index_select(0, slot_idx)  # (B, nkv, ctx, hd)
        values = v_cache[:, :, :ctx].index_select(0, slot_idx)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    def _attend_prefill_graph(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        slot_idx, positions = self._prefill_binding
        if self.decode_kernel:  # Triton runs here: both writes in one launch
            decode_attention.store_prompt(k, v, self.kv[layer, 0], self.kv[layer, 1], slot_idx)
        else:  # two advanced indices around a slice: the indexed view is (B, T, nkv, hd)
            self.kv[layer, 0][slot_idx[:, None], :, positions[None, :]] = k.transpose(1, 2)
            self.kv[layer, 1][slot_idx[:, None], :, positions[None, :]] = v.transpose(1, 2)
        # from position 0, a row's context is exactly its new tokens: attend over them, not the cache
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    @staticmethod
    def _write(b: _Binding, cache: torch.Tensor, new: torch.Tensor) -> None:
        # cache (S, nkv, L, hd); new (B, nkv, T, hd)
        if b.uniform_start is not None:
            pos = slice(b.uniform_start, b.uniform_start + b.n_new)
            if b.slot_start is not None:
                cache[b.slot_start:b.slot_start + b.n_rows, :, pos] = new
            else:
                cache[b.slot_idx, :, pos] = new
        else:
            # Two advanced indices around a slice: the indexed view is (B, T, nkv, hd).
            cache[b.slot_idx[:, None], :, b.write_pos] = new.transpose(1, 2)

    # ---- moving a request's KV between ranks ----------------------------------------------------

    def export(self, slot: int, length: int) -> torch.Tensor:
        """A new contiguous (n_layers, 2, n_kv_heads, length, hd) copy of the slot's first `length` positions."""
        self._check_allocated(slot)
        if not 0 < length <= self.max_seq_len:
            raise ValueError(f"export: length must be in [1, {self.max_seq_len}], got {length}")
        return self.kv[:, :, slot, :, :length].clone(memory_format=torch.contiguous_format)

    def import_(self, slot: int, kv: torch.Tensor) -> None:
        """Write an `export`ed tensor into positions [0, length) of `slot` (copied, converted to our dtype)."""
        self._check_allocated(slot)
        want = (self.n_layers, 2, self.n_kv_heads)
        if kv.dim() != 5 or tuple(kv.shape[:3]) != want or kv.shape[4] != self.head_dim \
                or not 0 < kv.shape[3] <= self.max_seq_len:
            raise ValueError(f"import_: expected shape ({want[0]}, 2, {want[2]}, length<= {self.max_seq_len}, "
                             f"{self.head_dim}), got {tuple(kv.shape)}")
        self.kv[:, :, slot, :, :kv.shape[3]].copy_(kv)
