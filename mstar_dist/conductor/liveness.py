"""The conductor's side of rank failures (docs/architecture.md §10): declaring ranks dead, failing or retrying what
they had in flight, taking their restarted process back, and giving up when a walk can never be served again.

A part of :class:`~mstar_dist.conductor.conductor.Conductor` (its base class), kept apart so that the request
lifecycle and the failure model each read in one place; it uses the conductor's requests, channel and routes and
runs on the conductor thread. The bookkeeping of who is dead, expected back or rejoining is
:class:`~mstar_dist.conductor.membership.Membership`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from mstar_dist.conductor.commands import RankDied
from mstar_dist.control import messages as m

if TYPE_CHECKING:
    from mstar_dist.conductor.request import Request

log = logging.getLogger("mstar_dist.conductor.conductor")

LEAVING_GRACE_S = 2.0
"""How long after a rank left on a signal (``Leaving``) a walk it leaves without a replica is not yet a failure of the
deployment: when every host is being stopped, the front end's own signal arrives within this."""


class Liveness:
    """Rank failures, restarts and rejoins, on the conductor thread (see the module docstring)."""

    def check_ranks(self, now: float) -> None:
        """Declare ranks that went silent dead (docs/architecture.md §10) and fail every request that touches them;
        let go of dead ranks that did not come back in time. Conductor thread, a few times a second."""
        if not self.serving:
            return
        gap, self.last_rank_check = now - (self.last_rank_check or now), now
        if gap > m.OWN_PAUSE_S:  # this process did not run (stopped, or its host froze): nobody's silence counts
            log.warning("the conductor did not run for %.1f s (its process was stopped or starved): the ranks' "
                        "silence over that time does not count", gap)
            for rank in self.last_seen:
                self.last_seen[rank] += gap
        for rank in range(self.world_size):
            seen = self.last_seen.get(rank, now)
            if self.placement.is_conductor(rank):
                continue  # our own process: if it were dead, so would we be; silence is only a long step
            if rank in self.dead_ranks or now - seen <= self.rank_timeout_s:
                continue
            why = f"silent for {now - seen:.0f} s on host {self.rank_hosts.get(rank, '?')}"
            log.error("rank %d declared dead: %s (limits.rank_timeout_s=%g)", rank, why, self.rank_timeout_s)
            self._declare_dead(rank, why, "died")
        expired = self.membership.expire(now)
        for rank, what in expired:
            log.error("rank %d on %s %s", rank, self.rank_hosts.get(rank, "?"), what)
        if expired or self.left_at is not None:
            self._check_servable()

    def _declare_dead(self, rank: int, why: str, verb: str) -> None:
        """``rank`` serves no more: new requests avoid it, and every request touching it fails with a 503 (or, with
        ``restart.retry_in_flight`` and nothing streamed yet, runs again on another replica). With restarts on, the
        other members of its TP replicas are told to restart too: the replica comes back as a whole."""
        host = self.rank_hosts.get(rank, "?")
        for joiner in self.membership.declared_dead(rank, why, time.monotonic()):
            self._readmitted(joiner)
        self._publish_health()
        for peer in range(self.world_size):  # their data planes give up on it: pending transfers end
            if peer not in self.dead_ranks:
                self._send(peer, m.RankDown(rank=rank, reason=why))
        for req in list(self._active.values()):
            if rank in req.touched or rank in req.choice.ranks():
                self._retry_or_fail(req, f"rank {rank} on host {host} {verb} ({why}); retry the request")
        partners = sorted({r for g in self.placement.tp_groups if rank in g for r in g} - {rank})
        if any(self.placement.is_conductor(r) for r in partners):
            # the replica comes back only with all its members, and the conductor's rank is not restarted in place:
            # this rank's replica is gone for good, whether or not the rank itself comes back
            if self.membership.expected.pop(rank, None) is not None:
                log.error("rank %d on host %s will not serve again: its TP replica holds rank 0, which is not "
                          "restarted in place", rank, host)
            self.membership.never_back.add(rank)
        elif self.membership.restarts:
            for partner in partners:
                if partner not in self.dead_ranks:
                    self.membership.tell_restart(partner, f"rank {rank} of its TP replica {verb}")
                    self._declare_dead(partner, f"restarting with its TP replica (rank {rank} {verb})", "restarts")
        self._check_servable()

    def _retry_or_fail(self, req: Request, message: str) -> None:
        if self.retry_in_flight and req.first_token_at is None:
            log.warning("request %s runs again on another replica: %s", req.state.request_id, message)
            self._active.pop(req.state.request_id, None)
            self._by_wire.pop(req.wire_id, None)
            for rank in sorted(req.touched | req.choice.ranks()):
                self._send(rank, m.RemoveRequest(request_id=req.wire_id))
            self._start(req.params, req.sink, req.pinned_id, req.arrived)
        else:
            self._finish_error(req, 503, message)

    def unservable_walks(self) -> list[str]:
        """Walks with no live replica left (the service is down for them)."""
        return self.routes.unservable_walks(self.dead_ranks)

    def _publish_health(self) -> None:
        down = self.unservable_walks()
        if down:
            dead = ", ".join(f"rank {r} ({why})" for r, why in sorted(self.dead_ranks.items()))
            self._health = (False, f"no live replica for walks {down}; dead: {dead}")
        else:
            self._health = (True, "ok")

    def _check_servable(self) -> None:
        """Fail the deployment (``failed``: the front end then stops every rank, non-zero) when some walk has no
        live replica and none of its dead ranks may come back."""
        if self.failed or not self.unservable_walks():
            self.left_at = None
            return
        hoped = self.membership.hoped()
        hopeless = self.routes.unservable_walks({r: w for r, w in self.dead_ranks.items() if r not in hoped})
        if hopeless and self.left_at is not None and time.monotonic() - self.left_at < LEAVING_GRACE_S:
            return  # a rank stopped by a signal: the whole deployment may be stopping, which is no failure
        if hopeless:
            dead = ", ".join(f"rank {r} ({why})" for r, why in sorted(self.dead_ranks.items()))
            why = ("no restart is left for their ranks (restart.max_restarts)" if not self.membership.never_back else
                   f"ranks {sorted(self.membership.never_back)} share a TP replica with rank 0, which is not restarted "
                   f"in place (the launch as a whole must start again), or no restart is left for the others")
            self.failed = f"no live replica can serve walks {hopeless} and {why}; dead: {dead}"
            log.error("the deployment cannot serve any more: %s", self.failed)

    def _on_rank_died(self, cmd: RankDied) -> None:
        """A supervisor's death record (the front end's watcher of the launch's store hands it over)."""
        if cmd.incarnation < self.membership.incarnation.get(cmd.rank, 0):
            return  # an earlier process of a rank that came back since
        now = time.monotonic()
        if cmd.rank not in self.dead_ranks:
            log.error("rank %d on %s %s", cmd.rank, cmd.host, cmd.cause)
            self._declare_dead(cmd.rank, cmd.cause, "died")
        self.membership.supervisor_says(cmd.rank, cmd.restarting, now)
        self._check_servable()

    def _on_early_rejoin(self, body: m.Rejoin) -> None:
        """A rank's new process rejoins before its old one was declared dead (a host killed and started again
        within ``limits.rank_timeout_s``): the old one is gone, so it is declared dead now, then the new one
        rejoins as after any restart."""
        log.warning("rank %d on %s started again (incarnation %d) before it was found dead", body.rank, body.host,
                    body.incarnation)
        self._declare_dead(body.rank, f"its process was replaced by incarnation {body.incarnation} on {body.host}",
                           "restarted")
        self._on_dead_rank_message(body.rank, body)

    def _on_dead_rank_message(self, rank: int, body: m.Message) -> None:
        """A message from a rank declared dead: its new process rejoining, or its old one (stopped, not killed)
        speaking again, which is told to restart."""
        membership = self.membership
        if isinstance(body, m.Rejoin):
            membership.on_rejoin(body, time.monotonic())
        elif isinstance(body, m.Repaired):
            self._on_repaired(body)
        elif isinstance(body, m.Stats) and body.incarnation > membership.incarnation.get(rank, 0):
            self.metrics.rank_stats[body.rank] = body  # the new process, not re-admitted yet
        elif not isinstance(body, (m.Leaving, m.LoadFailed, m.Stats)) or rank not in membership.rejoining:
            membership.tell_restart(rank, f"it was declared dead ({self.dead_ranks.get(rank, '?')})")

    def _on_repaired(self, body: m.Repaired) -> None:
        joined, error = self.membership.on_repaired(body)
        if error:
            self.membership.tell_restart(body.joined, f"its rejoin failed: {error}")
        if joined is not None:
            self._readmitted(joined)

    def _readmitted(self, rank: int) -> None:
        self.last_seen[rank] = time.monotonic()
        self._publish_health()
