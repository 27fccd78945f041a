"""Per-rank tensor store: uuid -> a tensor kept for a later walk or a later transfer (docs/architecture.md §7).

Lifetime rules:
- `put` keeps a tensor a walk produced (an output kept on its rank, or one too large to ride inline) until it
  is let go;
- `unpersist` lets it go once its one consumer took it (the send of it completed, or a walk on this rank
  consumed it);
- `drop_tag` lets go at once of everything stored under a request id (aborts, client disconnects).
`live_tensors` / `live_bytes` are the leak canary: both are 0 on an idle rank.

Not thread-safe, by design: the store belongs to the rank's one worker thread (docs/architecture.md §2), the same
thread that issues its transfers, so there is no lock to take on the hot path. Callers on other threads (the
HTTP thread on rank 0) must hand work to the worker thread instead of touching the store.
"""

from __future__ import annotations

import uuid as _uuid
from dataclasses import dataclass

import torch

__all__ = ["TensorStore"]


@dataclass
class _Entry:
    tensor: torch.Tensor
    tag: str | None
    nbytes: int


class TensorStore:
    """uuid -> tensor, each kept until unpersisted or dropped with its request; one per rank, used from its worker
    thread only."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._by_tag: dict[str, set[str]] = {}
        self._live_bytes = 0

    def put(self, tensor: torch.Tensor, *, tag: str | None = None) -> str:
        """Keep ``tensor`` until ``unpersist`` (or ``drop_tag``); return its new uuid (hex). ``tag`` is the
        request id the tensor belongs to, so ``drop_tag`` can let it go on abort."""
        key = _uuid.uuid4().hex
        nbytes = tensor.numel() * tensor.element_size()
        self._entries[key] = _Entry(tensor, tag, nbytes)
        if tag is not None:
            self._by_tag.setdefault(tag, set()).add(key)
        self._live_bytes += nbytes
        return key

    def get(self, uuid: str) -> torch.Tensor:
        """The tensor stored under ``uuid``. KeyError if it is unknown or already let go."""
        return self._entry(uuid).tensor

    def __contains__(self, uuid: str) -> bool:
        return uuid in self._entries

    def unpersist(self, uuid: str) -> None:
        """Let the tensor stored under ``uuid`` go. KeyError if it is unknown or already let go (a double
        release is a bug to surface, not hide)."""
        entry = self._entry(uuid)
        del self._entries[uuid]
        self._live_bytes -= entry.nbytes
        if entry.tag is not None:
            keys = self._by_tag.get(entry.tag)
            if keys is not None:
                keys.discard(uuid)
                if not keys:
                    del self._by_tag[entry.tag]

    def drop_tag(self, tag: str) -> int:
        """Let go of every tensor stored under request id ``tag``. Returns how many."""
        keys = self._by_tag.pop(tag, set())
        for key in keys:
            self._live_bytes -= self._entries.pop(key).nbytes
        return len(keys)

    @property
    def live_tensors(self) -> int:
        """Number of tensors currently held (0 on an idle rank)."""
        return len(self._entries)

    @property
    def live_bytes(self) -> int:
        """Sum of the element bytes of the tensors currently held (0 on an idle rank)."""
        return self._live_bytes

    def _entry(self, uuid: str) -> _Entry:
        try:
            return self._entries[uuid]
        except KeyError:
            raise KeyError(
                f"tensor {uuid!r} is not in this rank's store (never stored here, already let go, "
                f"or dropped with its request); {len(self._entries)} tensor(s) live"
            ) from None
