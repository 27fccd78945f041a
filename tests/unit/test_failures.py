"""Failing fast and naming the cause, restart policy and rejoin bookkeeping, without processes (docs/architecture.md
§10). A failure here means a rank that fails at startup leaves the others waiting (or exiting without naming it),
the startup timeout names nobody, a stop is not bounded, the restart policy restarts forever or never, or a rank that
came back is never re-admitted (or is re-admitted before its peers formed their pairs with it)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from mstar_dist.conductor.membership import Membership
from mstar_dist.config.deployment import RestartConfig, parse_config
from mstar_dist.config.schema import ConfigError
from mstar_dist.control import messages as m
from mstar_dist.distributed.guard import Guard, describe_ranks, publish_failure, startup_timeout_message
from mstar_dist.distributed.store import key
from mstar_dist.runtime.supervisor import Supervisor, describe_exit

HOSTS = {0: "host-a", 1: "host-a", 2: "host-b", 3: "host-b"}


class FakeStore:
    """The calls of a torch Store this runtime makes, in a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.broken = False

    def set(self, k: str, v) -> None:
        self.data[k] = v.encode() if isinstance(v, str) else v

    def get(self, k: str) -> bytes:
        return self.data[k]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def add(self, k: str, n: int) -> int:
        if self.broken:
            raise ConnectionResetError("connection reset by peer")
        value = int(self.data.get(k, b"0")) + n
        self.data[k] = str(value).encode()
        return value


class Exited(Exception):
    pass


def make_guard(store, *, rank: int = 0, timeout_s: float = 60.0, signal_fd=None, watch_store=True):
    codes: list[int] = []

    def leave(rc: int) -> None:
        codes.append(rc)
        raise Exited(rc)

    guard = Guard(rank=rank, host=HOSTS[rank], world_size=4, rank_hosts=HOSTS, timeout_s=timeout_s,
                  signal_fd=signal_fd, watch_store=watch_store, exit_fn=leave)
    guard._store = store
    return guard, codes


def test_a_failure_on_the_board_stops_every_other_rank_naming_rank_host_and_cause(caplog):
    store = FakeStore()
    guard, codes = make_guard(store, rank=0)
    guard.check_once(guard.started + 1)  # nothing yet
    assert codes == []
    publish_failure(store, 2, "host-b", "weights = '/x': no such directory")
    told: list = []
    guard.on_fatal = lambda message, over: told.append((message, over))
    with pytest.raises(Exited):
        guard.check_once(guard.started + 2)
    assert codes == [1]
    assert told == [("stopping: rank 2 on host host-b: weights = '/x': no such directory", True)]
    assert "rank 2 on host host-b: weights = '/x'" in caplog.text


def test_the_startup_deadline_names_the_ranks_that_never_reached_the_rendezvous_and_their_hosts():
    store = FakeStore()
    for r in (0, 1):
        store.set(key("rendezvous", rank=r), HOSTS[r])
    assert startup_timeout_message(store, 4, HOSTS, 60) == (
        "ranks 2, 3 on host host-b never reached the rendezvous within 60 s (--startup-timeout): see that host's log, "
        "or whether its torchrun started at all")
    for r in (2, 3):
        store.set(key("rendezvous", rank=r), HOSTS[r])
    store.set(key("ready", rank=0), "host-a")
    assert "ranks 1 on host host-a and ranks 2, 3 on host host-b did not finish loading" not in \
        startup_timeout_message(store, 4, HOSTS, 60)
    assert startup_timeout_message(store, 4, HOSTS, 60).startswith(
        "rank 1 on host host-a and ranks 2, 3 on host host-b did not finish loading within 60 s")
    guard, codes = make_guard(store, timeout_s=60)
    guard.check_once(guard.started + 60.5)  # the main thread's own timeout speaks first
    with pytest.raises(Exited):
        guard.check_once(guard.started + 64)
    assert codes == [1]
    assert describe_ranks([3], HOSTS) == "rank 3 on host host-b"


def test_a_signal_while_starting_ends_the_rank_at_once_with_status_0_and_a_serving_rank_is_bounded():
    r, w = os.pipe()
    os.set_blocking(r, False)
    guard, codes = make_guard(FakeStore(), signal_fd=r)
    os.write(w, bytes([signal.SIGINT]))
    with pytest.raises(Exited):
        guard.check_once(guard.started + 1)
    assert codes == [0]
    guard, codes = make_guard(FakeStore(), signal_fd=r)
    guard.serving = True
    os.write(w, bytes([signal.SIGTERM]))
    guard.check_once(100.0)  # serving: the main thread stops on its own...
    assert codes == [] and guard.stop_signal == ("SIGTERM", 100.0)
    with pytest.raises(Exited):
        guard.check_once(105.0)  # ...within the bound, else the guard leaves for it
    assert codes == [0]
    os.close(r)
    os.close(w)


def test_a_serving_rank_whose_launch_store_stops_answering_names_rank_0s_host():
    store = FakeStore()
    guard, codes = make_guard(store, rank=2)
    guard.serving = True
    guard.check_once(1.0)
    store.broken = True
    guard.check_once(1.2)
    guard.check_once(1.4)  # one slow answer is not a dead host
    told: list = []
    guard.on_fatal = lambda message, over: told.append(over)
    with pytest.raises(Exited):
        guard.check_once(1.6)
    assert codes == [1] and told == [True]


def test_restart_keys_are_checked_naming_the_key_and_the_flag_overrides_them():
    groups = [{"node_names": ["A"], "ranks": [0], "graph_walks": ["w"]}]
    cfg = parse_config({"model": "m", "node_groups": groups}, "d.yaml")
    assert cfg.restart == RestartConfig(max_restarts=3, backoff_s=1.0, window_s=300.0, retry_in_flight=False)
    for bad, words in (({"max_restarts": -1}, "restart.max_restarts = -1: must be >= 0"),
                       ({"backoff_s": "2"}, "restart.backoff_s = '2': must be a number of seconds"),
                       ({"window_s": 0}, "restart.window_s = 0"),
                       ({"retry_in_flight": "yes"}, "restart.retry_in_flight = 'yes': must be true or false"),
                       ({"max_restart": 2}, "did you mean 'max_restarts'")):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            parse_config({"model": "m", "node_groups": groups, "restart": bad}, "d.yaml")
    assert cfg.with_overrides(max_restarts=0).restart.max_restarts == 0
    with pytest.raises(ConfigError, match=r"command line \(--max-rank-restarts\)"):
        cfg.with_overrides(max_restarts=-2)


def test_the_restart_policy_backs_off_doubling_and_gives_up_past_max_restarts_within_the_window():
    sup = Supervisor(["x.yaml"], rank=1, host="h", policy=RestartConfig(max_restarts=2, backoff_s=0.5, window_s=10))
    assert sup._next_delay(0.0) == 0.5
    assert sup._next_delay(1.0) == 1.0
    assert sup._next_delay(2.0) is None  # a third death within 10 s
    assert sup._next_delay(20.0) == 0.5  # the earlier deaths are forgiven
    never = Supervisor(["x.yaml"], rank=1, host="h", policy=RestartConfig(max_restarts=0))
    assert never._next_delay(0.0) is None
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(1) == "exited with status 1"
    assert describe_exit(0) == "exited with status 0 (nobody asked it to stop)"


def test_incarnations_count_a_ranks_starts_in_the_launch_store_whichever_supervisor_starts_it():
    """A supervisor restarting its child and a new supervisor on a host started again draw from one count: only
    the launch's first start of a rank (incarnation 0) joins the world group, every later one rejoins."""
    import torch.distributed as dist

    store = dist.HashStore()

    def supervisor() -> Supervisor:
        sup = Supervisor(["x.yaml"], rank=1, host="h", policy=RestartConfig())
        sup._store = store
        sup._store_ready.set()
        return sup

    first = supervisor()
    assert [first._count_start(), first._count_start()] == [0, 1]  # the first start, a restart in place
    assert supervisor()._count_start() == 2  # its host started again: a new supervisor, a later incarnation
    alone = Supervisor(["x.yaml"], rank=1, host="h", policy=RestartConfig())  # no launch store: its own count
    alone._store_ready.set()
    assert [alone._count_start(), alone._count_start()] == [0, 1]


def membership(restarts: bool = True) -> tuple[Membership, list]:
    sent: list = []
    ms = Membership(world_size=4, rank_hosts=HOSTS, p2p_pairs=((0, 1), (1, 2), (2, 1), (0, 3)), restarts=restarts,
                    rejoin_timeout_s=30, repair_timeout_s=10, send=lambda r, body: sent.append((r, body)),
                    reconnect=lambda name, ep: sent.append((name, ep)))
    return ms, sent


def test_a_rejoining_rank_is_readmitted_only_once_every_peer_formed_its_pairs_with_it():
    ms, sent = membership()
    ms.declared_dead(1, "killed by SIGKILL", now=0.0)
    assert ms.hoped() == {1}
    ms.on_rejoin(m.Rejoin(rank=1, host="host-a", incarnation=1, endpoint="tcp://x:1", load_seconds=0.1), now=1.0)
    repairs = {r: body for r, body in sent if isinstance(body, m.Repair)}
    assert sent[0] == ("rank1", "tcp://x:1")
    assert repairs[0].pairs == [(0, 1)] and repairs[2].pairs == [(1, 2), (2, 1)] and repairs[3].pairs == []
    assert repairs[1].endpoint == "" and sorted(repairs[1].pairs) == [(0, 1), (1, 2), (2, 1)]
    assert len({body.prefix for body in repairs.values()}) == 1
    for r in (0, 1, 3):
        assert ms.on_repaired(m.Repaired(rank=r, joined=1)) == (None, "")
    assert 1 in ms.dead
    assert ms.on_repaired(m.Repaired(rank=2, joined=1)) == (1, "")
    assert 1 not in ms.dead and ms.hoped() == set()


def test_a_rank_rejoining_after_another_learns_the_others_new_endpoint():
    """Two ranks of one host come back together (a link down cut both off): the one that rejoins second read the
    launch's store at its start, perhaps before the first published its new endpoint; without the conductor's word it
    would send to the old process for good (its KV never arrives)."""
    ms, sent = membership()
    for r in (2, 3):
        ms.declared_dead(r, "silent", now=0.0)
    ms.on_rejoin(m.Rejoin(rank=3, host="b", incarnation=1, endpoint="tcp://b:3", load_seconds=0), now=1.0)
    ms.on_rejoin(m.Rejoin(rank=2, host="b", incarnation=1, endpoint="tcp://b:2", load_seconds=0), now=1.2)
    own = [body for r, body in sent if isinstance(body, m.Repair) and r == 2 and body.rank == 2]
    assert own and own[0].endpoints == {3: "tcp://b:3"}
    to_three = [body for r, body in sent if isinstance(body, m.Repair) and r == 3 and body.rank == 2]
    assert to_three and to_three[0].endpoint == "tcp://b:2"


def test_a_peer_that_dies_during_a_rejoin_is_not_waited_for_and_a_failed_repair_ends_the_rejoin():
    ms, sent = membership()
    ms.declared_dead(1, "x", now=0.0)
    ms.on_rejoin(m.Rejoin(rank=1, host="h", incarnation=1, endpoint="e", load_seconds=0), now=1.0)
    for r in (0, 1, 3):
        ms.on_repaired(m.Repaired(rank=r, joined=1))
    assert ms.declared_dead(2, "silent", now=2.0) == [1]  # rank 2 forms its pairs with 1 when it rejoins itself
    assert 1 not in ms.dead and 2 in ms.dead
    ms.on_rejoin(m.Rejoin(rank=2, host="h", incarnation=1, endpoint="e2", load_seconds=0), now=3.0)
    assert ms.on_repaired(m.Repaired(rank=1, joined=2, error="boom")) == (
        None, "rank 1 could not form its pairs with it: boom")
    assert 2 not in ms.rejoining and 2 in ms.dead


def test_without_restarts_a_dead_rank_is_not_hoped_for_and_a_late_rejoin_expires():
    ms, _ = membership(restarts=False)
    ms.declared_dead(3, "x", now=0.0)
    assert ms.hoped() == set()
    ms, sent = membership()
    ms.declared_dead(3, "x", now=0.0)
    ms.supervisor_says(3, restarting=False, now=0.5)
    assert ms.hoped() == set()
    ms.declared_dead(2, "x", now=0.0)
    assert ms.expire(31.0) == [(2, "did not rejoin within 30 s: it stays down")]
    ms.on_rejoin(m.Rejoin(rank=1, host="h", incarnation=2, endpoint="e", load_seconds=0), now=40.0)
    assert ms.expire(51.0) == [(1, "rejoin timed out: told to restart")]
    shutdown = [body for r, body in sent if r == 1 and isinstance(body, m.Shutdown)]
    assert shutdown and shutdown[0].restart and "not formed again within 10 s" in shutdown[0].reason


def test_the_board_is_written_as_json_once_per_failure():
    store = FakeStore()
    publish_failure(store, 3, "host-b", "boom")
    assert json.loads(store.get(key("failed", rank=3))) == {"rank": 3, "host": "host-b", "reason": "boom"}
    assert store.add(key("failures"), 0) == 1


def test_torchrun_ends_in_one_line_and_says_nothing_more_for_a_mistake_rank_0_named():
    """What ``launch/serve.sh`` prints last: a requested stop is exit 0, a failed worker is named with how it ended,
    and a mistake its local rank 0 already named in one line (exit 2) gets no second line."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from mstar_dist.runtime.torchrun import summary

    def failed(local_rank: int, exitcode: int) -> ChildFailedError:
        return ChildFailedError("serve", {local_rank: ProcessFailure(local_rank, 100 + local_rank, exitcode, "-")})

    assert summary(SignalException("stop", signal.SIGINT)) == (0, "mstar-dist: stopped by SIGINT")
    assert summary(failed(0, 2)) == (2, "")
    assert summary(failed(1, -9)) == (1, "mstar-dist: worker 1 (local rank 1, pid 101) was killed by SIGKILL; its "
                                         "log lines above say why")
    rc, line = summary(failed(1, 2))  # a rank other than local rank 0 prints no config line: torchrun's line stays
    assert rc == 1 and "exited with status 2" in line


@pytest.mark.parametrize("store_up,over,said", [(True, False, "leaving"), (False, False, "over"), (True, True, "over")])
def test_a_rank_the_conductor_went_silent_on_restarts_only_while_rank_0s_host_is_up(store_up, over, said):
    """A rank stopped (SIGSTOP) or starved past ``limits.rank_timeout_s`` was declared dead, and the conductor speaks
    to it no more: when it runs again it must leave to be restarted and rejoin, not take the silence for rank 0's host
    dying (its supervisor would then stop, and torchrun would stop the whole host with it)."""
    import threading
    import types

    import torch.distributed as dist

    from mstar_dist.runtime.rank import Rank, StoppedByConductor

    store = dist.HashStore()
    if over:
        store.set(key("over"), "1")
    told: list[tuple[str, str]] = []
    worker = types.SimpleNamespace(stopping=True, restart_asked=False, conductor_silent=True, rank0_gone=False,
                                   failed_reason="the conductor (rank 0) has been silent for 13 s")
    rank = types.SimpleNamespace(
        lc=types.SimpleNamespace(stop=threading.Event()), worker=worker, frontend=None, frontend_gone=lambda: False,
        store=store if store_up else None,
        supervisor=types.SimpleNamespace(leaving=lambda r: told.append(("leaving", r)),
                                         over=lambda r: told.append(("over", r))))
    rank.rank0_host_up = lambda: Rank.rank0_host_up(rank, 3.0)
    with pytest.raises(StoppedByConductor):
        Rank.check_exit(rank)
    assert [k for k, _ in told] == [said], told
    assert ("restarts and rejoins" in told[0][1]) == (said == "leaving"), told
