"""Per-rank tensor store: uuid -> tensor with a reference count and a persist count (docs/architecture.md §7).

Lifetime rules:
- `put` stores a tensor with `refs` references (one per pending consumer or in-flight send).
- `release` drops references; `persist`/`unpersist` pin and unpin. A tensor is freed when its refcount is 0
  and its persist count is 0 (a persisted tensor outlives its consumers until the conductor unpersists it
  with the count it dispatched).
- `drop_tag` frees everything stored under a request id at once, whatever the counts (aborts, client
  disconnects).
`live_tensors` / `live_bytes` are the leak canary: both are 0 on an idle rank.

Not thread-safe, by design: the store belongs to the rank's one worker thread (docs/architecture.md §2), the same thread that
issues its transfers, so there is no lock to take on the hot path. Callers on other threads (the HTTP thread on
rank 0) must hand work to the worker thread instead of touching the store.
"""

from __future__ import annotations

import uuid as _uuid
from dataclasses import dataclass

import torch

__all__ = ["TensorStore"]


@dataclass
class _Entry:
    tensor: torch.Tensor
    refs: int
    persists: int
    tag: str | None
    nbytes: int


class TensorStore:
    """uuid -> tensor with refcount and persist count; one per rank, used from its worker thread only."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._by_tag: dict[str, set[str]] = {}
        self._live_bytes = 0

    # -- adding and reading ---------------------------------------------------------------------------------
    def put(self, tensor: torch.Tensor, *, refs: int = 1, persist: bool = False, tag: str | None = None) -> str:
        """Store `tensor` with `refs` references (and one persist if `persist`); return its new uuid (hex).

        `tag` is the request id the tensor belongs to, so `drop_tag` can free it on abort.
        ValueError if the tensor would be born dead (refs 0 and not persisted) or refs < 0.
        """
        if refs < 0:
            raise ValueError(f"refs must be >= 0, got {refs}")
        if refs == 0 and not persist:
            raise ValueError("put with refs=0 and persist=False would free the tensor at once")
        key = _uuid.uuid4().hex
        nbytes = tensor.numel() * tensor.element_size()
        self._entries[key] = _Entry(tensor, refs, 1 if persist else 0, tag, nbytes)
        if tag is not None:
            self._by_tag.setdefault(tag, set()).add(key)
        self._live_bytes += nbytes
        return key

    def get(self, uuid: str) -> torch.Tensor:
        """The tensor stored under `uuid`. KeyError if it is unknown or already freed."""
        return self._entry(uuid).tensor

    def __contains__(self, uuid: str) -> bool:
        return uuid in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def refcount(self, uuid: str) -> int:
        """Current reference count of `uuid` (KeyError if unknown)."""
        return self._entry(uuid).refs

    # -- counts ---------------------------------------------------------------------------------------------
    def incref(self, uuid: str, n: int = 1) -> None:
        """Add `n` references (e.g. one per extra consumer)."""
        if n < 0:
            raise ValueError(f"incref by a negative count ({n}); use release")
        self._entry(uuid).refs += n

    def release(self, uuid: str, n: int = 1) -> bool:
        """Drop `n` references; free the tensor if no references and no persists remain. True if freed.

        ValueError if that would take the refcount below 0 (a double release is a bug to surface, not hide).
        """
        entry = self._entry(uuid)
        if n < 0 or n > entry.refs:
            raise ValueError(f"release({uuid}, n={n}) but its refcount is {entry.refs}")
        entry.refs -= n
        return self._maybe_free(uuid, entry)

    def persist(self, uuid: str, n: int = 1) -> None:
        """Pin the tensor `n` more times: it survives refcount 0 until unpersisted as many times."""
        if n < 0:
            raise ValueError(f"persist by a negative count ({n}); use unpersist")
        self._entry(uuid).persists += n

    def unpersist(self, uuid: str, count: int = 1) -> bool:
        """Remove `count` pins; free the tensor if nothing holds it any more. True if freed."""
        entry = self._entry(uuid)
        if count < 0 or count > entry.persists:
            raise ValueError(f"unpersist({uuid}, count={count}) but it is persisted {entry.persists} time(s)")
        entry.persists -= count
        return self._maybe_free(uuid, entry)

    def drop_tag(self, tag: str) -> int:
        """Free every tensor stored under request id `tag`, whatever its counts. Returns how many were freed."""
        keys = self._by_tag.pop(tag, set())
        for key in keys:
            self._free(key, self._entries[key], untag=False)
        return len(keys)

    # -- gauges ---------------------------------------------------------------------------------------------
    @property
    def live_tensors(self) -> int:
        """Number of tensors currently held (0 on an idle rank)."""
        return len(self._entries)

    @property
    def live_bytes(self) -> int:
        """Sum of the element bytes of the tensors currently held (0 on an idle rank)."""
        return self._live_bytes

    # -- internals ------------------------------------------------------------------------------------------
    def _entry(self, uuid: str) -> _Entry:
        try:
            return self._entries[uuid]
        except KeyError:
            raise KeyError(
                f"tensor {uuid!r} is not in this rank's store (never stored here, already freed, "
                f"or dropped with its request); {len(self._entries)} tensor(s) live"
            ) from None

    def _maybe_free(self, uuid: str, entry: _Entry) -> bool:
        if entry.refs == 0 and entry.persists == 0:
            self._free(uuid, entry, untag=True)
            return True
        return False

    def _free(self, uuid: str, entry: _Entry, *, untag: bool) -> None:
        del self._entries[uuid]
        self._live_bytes -= entry.nbytes
        if untag and entry.tag is not None:
            keys = self._by_tag.get(entry.tag)
            if keys is not None:
                keys.discard(uuid)
                if not keys:
                    del self._by_tag[entry.tag]
