"""Which ranks serve: dead, coming back, rejoining, re-admitted (docs/architecture.md §10, "Restart and rejoin").

The conductor declares a rank dead (silence, ``Leaving``, a transport error, its supervisor's death record); with
restarts on (``restart.max_restarts`` > 0) it then *expects* the rank back for a while (``rejoin_timeout_s``), unless
the supervisor says no restart is left. A rank restarted in place sends ``Rejoin`` once it has loaded: the conductor
connects to its new endpoint and sends every other rank that serves (or is rejoining itself) a ``Repair`` naming the
pairs it shares with the newcomer and a fresh store prefix, and the newcomer one naming all of them; each forms those
pair groups (``distributed/repair.py``) and answers ``Repaired``. When every answer is in, the rank is re-admitted:
new requests may choose its replica again. A walk that no live rank serves and no expected rank could serve again
makes the deployment unservable: the conductor fails, and the whole deployment exits non-zero.

A rank declared dead that speaks again as the same process (it was stopped, not killed: SIGSTOP then SIGCONT) is
told to restart (``Shutdown(restart=True)``): its peers gave up its pairs, so it can only come back as a new process.
Pure bookkeeping plus the sends it is given; runs on the conductor thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mstar_dist.control import messages as m
from mstar_dist.control.envelope import rank_name

__all__ = ["Membership", "Rejoining"]

log = logging.getLogger(__name__)


@dataclass
class Rejoining:
    """A rank that sent ``Rejoin`` and whose pairs are being formed again."""

    incarnation: int
    host: str
    waiting: set[int]
    """Ranks whose ``Repaired`` is still due (the newcomer itself included)."""
    since: float = field(default_factory=time.monotonic)


class Membership:
    """The conductor's view of which ranks serve (see the module docstring)."""

    def __init__(self, *, world_size: int, rank_hosts: dict[int, str], p2p_pairs: tuple[tuple[int, int], ...],
                 restarts: bool, rejoin_timeout_s: float, repair_timeout_s: float,
                 send: Callable[[int, m.Message], None], reconnect: Callable[[str, str], None]) -> None:
        """``restarts``: whether dead ranks may come back (``restart.max_restarts`` > 0); ``rejoin_timeout_s``: how
        long a dead rank is expected back; ``send(rank, body)`` / ``reconnect(name, endpoint)``: the conductor's
        channel."""
        self.world_size, self.rank_hosts, self.p2p_pairs = world_size, rank_hosts, tuple(p2p_pairs)
        self.restarts, self.rejoin_timeout_s, self.repair_timeout_s = restarts, rejoin_timeout_s, repair_timeout_s
        self._send, self._reconnect = send, reconnect
        self.dead: dict[int, str] = {}
        """Rank -> why it was declared dead (shared with the conductor as ``dead_ranks``)."""
        self.expected: dict[int, float] = {}
        """Dead rank -> until when it is expected back (restarting)."""
        self.rejoining: dict[int, Rejoining] = {}
        self.incarnation: dict[int, int] = {}
        """Rank -> its incarnation as last heard (``Stats``, ``Rejoin``)."""
        self.never_back: set[int] = set()
        """Dead ranks whose replica cannot come back in place (it holds the conductor's rank)."""
        self.endpoints: dict[int, str] = {}
        """Rank -> the control endpoint of its latest process, for the ranks that rejoined."""
        self.died_at: dict[int, float] = {}
        self._told: set[tuple[int, int]] = set()  # (rank, incarnation) told to restart
        self._repairs = 0

    def declared_dead(self, rank: int, why: str, now: float) -> list[int]:
        """Record ``rank``'s death; returns the rejoining ranks that need nothing more from it (re-admit them)."""
        self.dead[rank] = why
        self.died_at.setdefault(rank, now)
        self.rejoining.pop(rank, None)
        if self.restarts and rank != 0 and rank not in self.never_back:
            self.expected[rank] = now + self.rejoin_timeout_s
        done = []
        for joiner, job in list(self.rejoining.items()):
            job.waiting.discard(rank)  # it forms its pairs with the newcomer when it rejoins itself
            if not job.waiting:
                done.append(joiner)
        return [r for r in done if self.readmit(r)]

    def supervisor_says(self, rank: int, restarting: bool, now: float) -> None:
        """The supervisor's death record: the rank comes back (expected for ``rejoin_timeout_s``) or never."""
        if restarting and self.restarts and rank not in self.never_back:
            self.expected[rank] = now + self.rejoin_timeout_s
        else:
            self.expected.pop(rank, None)

    def on_rejoin(self, msg: m.Rejoin, now: float) -> None:
        """``msg.rank`` restarted and loaded: connect to it, have every serving or rejoining rank form its pairs
        with it, and it with them."""
        rank = msg.rank
        self._reconnect(rank_name(rank), msg.endpoint)
        self.incarnation[rank] = msg.incarnation
        self._repairs += 1
        prefix = f"repair/{self._repairs}"
        targets = [r for r in range(self.world_size) if r != rank and (r not in self.dead or r in self.rejoining)]
        for r in targets:
            self._send(r, m.Repair(rank=rank, endpoint=msg.endpoint, pairs=self._pairs(rank, {r}), prefix=prefix))
        self._send(rank, m.Repair(rank=rank, endpoint="", pairs=self._pairs(rank, set(targets)), prefix=prefix,
                                  endpoints={r: ep for r, ep in self.endpoints.items() if r != rank}))
        self.endpoints[rank] = msg.endpoint
        self.rejoining[rank] = Rejoining(msg.incarnation, msg.host, waiting={*targets, rank}, since=now)
        log.info("rank %d on %s rejoins (incarnation %d, loaded in %.1f s): forming its pairs again with ranks %s",
                 rank, msg.host, msg.incarnation, msg.load_seconds, targets)

    def _pairs(self, rank: int, peers: set[int]) -> list[tuple[int, int]]:
        return [p for p in self.p2p_pairs if rank in p and (p[0] if p[1] == rank else p[1]) in peers]

    def on_repaired(self, msg: m.Repaired) -> tuple[int | None, str]:
        """One ``Repaired``: (the rank to re-admit now, or None; an error that ends its rejoin, or "")."""
        job = self.rejoining.get(msg.joined)
        if job is None:
            return None, ""
        if msg.error:
            self.rejoining.pop(msg.joined)
            return None, f"rank {msg.rank} could not form its pairs with it: {msg.error}"
        job.waiting.discard(msg.rank)
        if job.waiting:
            return None, ""
        return (msg.joined if self.readmit(msg.joined) else None), ""

    def readmit(self, rank: int) -> bool:
        job = self.rejoining.pop(rank, None)
        if job is None or rank not in self.dead:
            return False
        del self.dead[rank]
        self.expected.pop(rank, None)
        since = self.died_at.pop(rank, None)
        log.warning("rank %d on %s serves again (incarnation %d)%s", rank, job.host, job.incarnation,
                    "" if since is None else f", {time.monotonic() - since:.1f} s after it was declared dead")
        return True

    def expire(self, now: float) -> list[tuple[int, str]]:
        """Dead ranks no longer expected (their time to rejoin passed) and rejoins that took too long (told to
        restart again): (rank, what happened), for the log."""
        out = []
        for rank, until in list(self.expected.items()):
            if now > until and rank not in self.rejoining:
                del self.expected[rank]
                out.append((rank, f"did not rejoin within {self.rejoin_timeout_s:g} s: it stays down"))
        for rank, job in list(self.rejoining.items()):
            if now - job.since > self.repair_timeout_s:
                del self.rejoining[rank]
                self.tell_restart(rank, f"its pairs were not formed again within {self.repair_timeout_s:g} s "
                                        f"(ranks {sorted(job.waiting)} did not answer)", job.incarnation)
                out.append((rank, "rejoin timed out: told to restart"))
        return out

    def hoped(self) -> set[int]:
        """Dead ranks that may serve again (expected back, or rejoining)."""
        return set(self.expected) | set(self.rejoining)

    def tell_restart(self, rank: int, why: str, incarnation: int | None = None) -> None:
        """Ask ``rank`` (as the process it is now) to leave and be restarted; once per incarnation."""
        incarnation = self.incarnation.get(rank, 0) if incarnation is None else incarnation
        if (rank, incarnation) in self._told:
            return
        self._told.add((rank, incarnation))
        log.warning("telling rank %d to restart: %s", rank, why)
        self._send(rank, m.Shutdown(reason=f"rank {rank}: {why}; it restarts and rejoins", error=True, restart=True))
