"""Conductor rules on one thread with a fake control channel (no processes): seeds, walk transitions, stop strings,
admission FIFO, timeouts, duplicates, aborts. A failure means pinned requests stop being reproducible, stop strings
leak into the text, queued requests are lost or reordered, or an aborted/timed-out request keeps its ranks busy.
"""

from __future__ import annotations

import pytest
import torch

from mstar_dist.conductor.conductor import Conductor
from mstar_dist.conductor.request import request_seed
from mstar_dist.config.deployment import parse_config
from mstar_dist.graph.model import WalkStep
from mstar_dist.control import messages as m
from mstar_dist.server.backend import BackendError, Finished, GenerationParams, TextDelta
from mstar_dist.topology.placement import Placement
from mstar_dist.transport.inline import encode_tensor
from tests.helpers import FakeChannel
from tests.toy_model import ToyModel

TOKEN = "tok"


def make(max_concurrent=2, timeout=60.0, intakes=()):
    cfg = parse_config({"model": "tests.toy_model:ToyModel", "node_groups": [
        {"node_names": ["ADD"], "ranks": [0], "graph_walks": ["start"]},
        {"node_names": ["COUNT"], "ranks": [1, 2], "graph_walks": ["count"]}]}, "test")
    model = ToyModel(None)
    placement = Placement.build(cfg, {"start": frozenset({"ADD"}), "count": frozenset({"COUNT"})}, 3)
    ch = FakeChannel()
    c = Conductor(model=model, placement=placement, channel=ch, token=TOKEN, world_size=3,
                  max_concurrent=max_concurrent, request_timeout_s=timeout,
                  rank_hosts={0: "h", 1: "h", 2: "h"}, intakes=intakes)
    return c, ch


def params(rid, prompt="start=0", max_tokens=5, stop=(), seed=None):
    return GenerationParams(request_id=rid, prompt=prompt, messages=None, max_tokens=max_tokens,
                            stop=list(stop), seed=seed)


def submit(c, p):
    events = []
    c.submit(p, events.append, True)
    return events


def from_rank(c, body):
    c.handle("rank1", m.encode(TOKEN, "rank1", body))


def walks_sent(ch, walk=None):
    return [(peer, b) for peer, b in ch.sent if isinstance(b, m.RunWalk) and (walk is None or b.walk == walk)]


def emit(c, wire_id, *values):
    from_rank(c, m.Emit(request_id=wire_id, signal="x",
                        values=[encode_tensor(torch.tensor([v])) for v in values]))


def test_seed_rules():
    assert request_seed(params("a", seed=5), True) == 5
    assert request_seed(params("a"), True) == request_seed(params("a"), True)
    assert request_seed(params("a"), True) != request_seed(params("b"), True)


def test_walk_transitions_and_seed_advance_per_walk():
    c, ch = make()
    events = submit(c, params("r1", max_tokens=3, seed=100))
    (peer, first), = walks_sent(ch, "start")
    assert peer == "rank0" and first.seed == 100 and first.walk_index == 0
    emit(c, first.request_id, 1)
    from_rank(c, m.WalkDone(request_id=first.request_id, walk="start", rank=0,
                            outputs={"x": encode_tensor(torch.tensor([1]))}))
    (peer, second), = walks_sent(ch, "count")
    assert peer in ("rank1", "rank2") and second.seed == 101 and second.walk_index == 1
    assert second.loop_limits == {"count": 2}
    emit(c, first.request_id, 2, 3)
    from_rank(c, m.WalkDone(request_id=first.request_id, walk="count", rank=1, outputs={},
                            finish_reason="length"))
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "1 2 3 "
    assert events[-1] == Finished("length", 1, 3)
    removed = sorted(peer for peer, b in ch.sent if isinstance(b, m.RemoveRequest))
    assert removed == sorted({"rank0", peer})  # every rank the request touched forgets it


def test_a_walk_left_no_iteration_ends_at_the_conductor_with_the_walks_own_finish_reason():
    """max_tokens=1: the family still asks for its decode walk, with no token left to make. No rank is asked to run a
    walk that runs nothing (in P/D its KV would cross for nothing), and "length" is the walk's word, as on a rank."""

    class AlwaysCounts(ToyModel):
        def after_walk(self, state, walk, outputs):
            if walk == "start":
                return WalkStep("count", {"x": outputs["x"]}, loop_limits={"count": state.max_tokens - 1})
            return None

    c, ch = make()
    c.model = AlwaysCounts(None)
    events = submit(c, params("one", max_tokens=1))
    (_, first), = walks_sent(ch, "start")
    emit(c, first.request_id, 1)
    from_rank(c, m.WalkDone(request_id=first.request_id, walk="start", rank=0,
                            outputs={"x": encode_tensor(torch.tensor([1]))}))
    assert walks_sent(ch, "count") == []
    assert events[-1] == Finished("length", 1, 1)


def test_stop_string_split_across_deltas_is_cut_and_held_back_text_is_not_lost():
    c, ch = make()
    events = submit(c, params("s", stop=["3 4"]))
    wire = walks_sent(ch)[0][1].request_id
    emit(c, wire, 1, 2, 3)  # "1 2 3 " ends with "3 ", a prefix of the stop string: held back
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "1 2 "
    emit(c, wire, 4)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "1 2 "
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "stop"
    assert any(isinstance(b, m.RemoveRequest) for _, b in ch.sent)


def test_admission_is_fifo_and_frees_on_completion_abort_and_failure():
    c, ch = make(max_concurrent=2)
    evs = {rid: submit(c, params(rid)) for rid in ("a", "b", "c", "d", "e")}
    started = lambda: [b.request_id.split("#")[0] for _, b in walks_sent(ch, "start")]  # noqa: E731
    assert started() == ["a", "b"] and c.queue_depth == 3
    c.abort("a")
    assert started() == ["a", "b", "c"]
    wire_b = walks_sent(ch, "start")[1][1].request_id
    from_rank(c, m.WalkDone(request_id=wire_b, walk="start", rank=0, outputs={}, error="boom"))
    assert started() == ["a", "b", "c", "d"]
    assert isinstance(evs["b"][-1], BackendError) and evs["b"][-1].status == 500 and "rank 0" in str(evs["b"][-1])
    c.abort("e")  # aborting a queued request removes it from the queue
    assert c.queue_depth == 0 and started() == ["a", "b", "c", "d"]


def test_duplicate_in_flight_id_is_409_and_a_finished_id_can_be_reused():
    c, ch = make()
    submit(c, params("dup"))
    again = submit(c, params("dup"))
    assert isinstance(again[0], BackendError) and again[0].status == 409
    c.abort("dup")
    submit(c, params("dup"))
    ids = [b.request_id for _, b in walks_sent(ch, "start")]
    assert len(ids) == 2 and ids[0] != ids[1]  # a new incarnation on the wire


def test_timeout_fails_the_request_and_releases_its_ranks():
    c, ch = make(timeout=5.0)
    events = submit(c, params("slow"))
    c.check_timeouts(now=c.running("slow").arrived + 6)
    assert isinstance(events[-1], BackendError) and events[-1].status == 504
    assert "request_timeout_s" in str(events[-1])
    assert any(isinstance(b, m.RemoveRequest) for _, b in ch.sent) and c.active_count == 0


def test_bad_prompt_is_400_and_preprocess_crash_is_500():
    c, _ = make()
    assert submit(c, params("x", prompt="start=abc"))[0].status == 400
    assert submit(c, params("y", prompt="fail-pre"))[0].status == 500


def test_late_messages_for_finished_requests_are_dropped():
    c, ch = make()
    events = submit(c, params("late"))
    wire = walks_sent(ch)[0][1].request_id
    c.abort("late")
    emit(c, wire, 1)
    from_rank(c, m.WalkDone(request_id=wire, walk="start", rank=0, outputs={}))
    assert events == []  # an aborted request's client hears nothing more


def test_silent_rank_is_declared_dead_its_requests_fail_and_new_ones_avoid_it():
    c, ch = make(max_concurrent=50)
    c.serving, c.rank_timeout_s = True, 5.0
    now = 1000.0
    c.last_seen = {0: now, 1: now, 2: now}
    events = submit(c, params("on-count", max_tokens=8))
    wire = walks_sent(ch, "start")[0][1].request_id
    from_rank(c, m.WalkDone(request_id=wire, walk="start", rank=0, outputs={"x": encode_tensor(torch.tensor([1]))}))
    (peer, _), = walks_sent(ch, "count")
    victim = int(peer[4:])
    c.last_seen = {0: now, 1: now, 2: now, victim: now - 10}
    c.check_ranks(now)
    assert isinstance(events[-1], BackendError) and events[-1].status == 503
    assert f"rank {victim} on host h died" in str(events[-1])
    assert f'mstar_dist_rank_up{{rank="{victim}"}} 0.0' in c.metrics.render()
    for i in range(6):  # every new request avoids the dead replica
        submit(c, params(f"n{i}", max_tokens=8))
        assert victim not in c.running(f"n{i}").walk_ranks("count")
    assert c.unservable_walks() == []
    c.dead_ranks[3 - victim] = "also dead"
    assert c.unservable_walks() == ["count"]
    assert submit(c, params("none-left"))[0].status == 503


def one_replica_each() -> Conductor:
    """ADD on rank 0 and COUNT on rank 1, one replica each."""
    cfg = parse_config({"model": "tests.toy_model:ToyModel", "node_groups": [
        {"node_names": ["ADD"], "ranks": [0], "graph_walks": ["start"]},
        {"node_names": ["COUNT"], "ranks": [1], "graph_walks": ["count"]}]}, "test")
    placement = Placement.build(cfg, {"start": frozenset({"ADD"}), "count": frozenset({"COUNT"})}, 2)
    return Conductor(model=ToyModel(None), placement=placement, channel=FakeChannel(), token=TOKEN, world_size=2,
                     max_concurrent=10, request_timeout_s=60.0, rank_hosts={0: "h", 1: "h"})


def test_with_one_replica_per_node_a_rank_that_dies_after_earlier_requests_still_fails_new_ones():
    """Every node has one replica: the conductor keeps the one choice it makes, and must drop it when a rank dies."""
    c = one_replica_each()
    for rid in ("a", "b"):
        submit(c, params(rid))
        assert c.running(rid).walk_ranks("count") == [1]
    c.handle("rank1", m.encode(TOKEN, "rank1", m.Leaving(rank=1, host="h", reason="gone")))
    refused = submit(c, params("c"))
    assert refused[0].status == 503 and "rank 1 (gone)" in str(refused[0])


def test_a_rank_leaving_on_a_signal_fails_the_deployment_only_after_a_grace_for_a_whole_stop():
    """SIGTERM to every host: a rank's ``Leaving`` may reach the conductor before the front end's own signal; the walk
    it leaves without a replica is no failure then (the stop is clean, exit 0), only once the grace has passed."""
    import time as clock

    c = one_replica_each()
    c.serving = True
    c.handle("rank1", m.encode(TOKEN, "rank1", m.Leaving(rank=1, host="h", reason="stopped by a signal (SIGTERM)")))
    assert c.unservable_walks() == ["count"] and not c.failed
    c.check_ranks(clock.monotonic())
    assert not c.failed
    c.left_at -= 2.5  # the grace is over and nobody stopped the front end: the deployment has failed
    c.check_ranks(clock.monotonic())
    assert c.failed and "no live replica can serve walks ['count'] and no restart is left" in c.failed


def test_log_stats_reports_throughput_load_and_the_leak_canary(caplog):
    c, _ = make()
    c.metrics.rank_stats = {1: m.Stats(rank=1, live_tensors=3, live_bytes=12, edge_bytes_sent=0,
                                        edge_bytes_received=0, host_staging_copies=0)}
    c.log_stats(100.0)  # the throughput is counted from here
    c.metrics.tokens_generated = 50
    submit(c, params("busy"))
    with caplog.at_level("INFO"):
        c.log_stats(110.0)
    line = caplog.records[-1].getMessage()
    assert "5.0 tok/s" in line and "1 running" in line and "{1: 3}" in line


def test_the_conductors_own_rank_is_never_declared_dead():
    c, _ = make()
    c.serving, c.rank_timeout_s = True, 5.0
    c.last_seen = {0: 0.0, 1: 100.0, 2: 100.0}  # rank 0's worker busy in a long step
    c.check_ranks(100.0)
    assert c.dead_ranks == {}


def test_a_conductor_that_was_itself_stopped_declares_nobody_dead_for_the_silence_meanwhile():
    """Its host stopped (SIGSTOP, a frozen VM) for longer than the rank timeout: once it runs again, every rank's
    last message is old, but only because the conductor did not read; a rank silent after that is dead."""
    c, _ = make()
    c.serving, c.rank_timeout_s = True, 5.0
    c.last_seen = {0: 100.0, 1: 100.0, 2: 100.0}
    c.check_ranks(100.0)
    c.check_ranks(112.0)  # nothing ran for 12 s
    assert c.dead_ranks == {}
    for step in range(1, 28):  # then 5.4 s of checks every 0.2 s: rank 2 speaks, rank 1 stays silent
        c.last_seen[2] = 112.0 + 0.2 * step
        c.check_ranks(112.0 + 0.2 * step)
    assert 1 in c.dead_ranks and 2 not in c.dead_ranks


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_tp_replica_holding_rank_0_is_gone_for_good_when_its_partner_dies(replicas):
    """Rank 0 is not restarted in place, so neither is a TP replica that holds it: its partner's death must not tell
    rank 0 to restart (that would end the launch), the partner is not waited for, and the deployment goes on only
    where another replica serves the walks (otherwise it fails, saying why)."""
    add = [0, 1, 2, 3][:2 * replicas]
    ranks = [*add, len(add)]
    cfg = parse_config({"model": "tests.toy_model:ToyModel", "node_groups": [
        {"node_names": ["ADD"], "ranks": add, "tp_size": 2, "graph_walks": ["start"]},
        {"node_names": ["COUNT"], "ranks": [len(add)], "graph_walks": ["count"]}]}, "test")
    placement = Placement.build(cfg, {"start": frozenset({"ADD"}), "count": frozenset({"COUNT"})}, len(ranks))
    ch = FakeChannel()
    c = Conductor(model=ToyModel(None), placement=placement, channel=ch, token=TOKEN, world_size=len(ranks),
                  max_concurrent=4, request_timeout_s=60.0, rank_hosts={r: "h" for r in ranks}, restarts=True)
    c.serving, c.rank_timeout_s = True, 5.0
    c.last_seen = {r: 100.0 for r in ranks}
    c.last_seen[1] = 90.0
    c.check_ranks(100.0)
    assert 1 in c.dead_ranks and 0 not in c.dead_ranks
    assert not [b for _, b in ch.sent if isinstance(b, m.Shutdown)], "rank 0 must not be told to restart"
    assert 1 not in c.membership.hoped()
    assert bool(c.failed) == (replicas == 1)
    if c.failed:
        assert "share a TP replica with rank 0" in c.failed


def test_an_intakes_requests_come_back_in_one_outputs_message_per_turn_and_can_be_cancelled():
    c, ch = make(intakes=("intake0",))
    c.serving = True

    def from_intake(body, name="intake0"):
        c.handle(name, m.encode(TOKEN, name, body))

    def outputs():
        sent = [b for peer, b in ch.sent if peer == "intake0" and isinstance(b, m.Outputs)]
        ch.sent[:] = [(p, b) for p, b in ch.sent if not (p == "intake0" and isinstance(b, m.Outputs))]
        return sent

    c.intakes.push_health()
    c.intakes.push_health()  # no change: no second message
    assert [b for p, b in ch.sent if p == "intake0"] == [m.Health(serving=True, reason="ok")]
    from_intake(m.Submit(params=params("r1", max_tokens=3), pinned_id=True))
    (_, first), = walks_sent(ch, "start")
    emit(c, first.request_id, 1)
    emit(c, first.request_id, 2)
    c.intakes.flush()
    (out,) = outputs()  # two Emits, one message
    assert "".join(e.text for _, e in out.items if isinstance(e, TextDelta)) == "1 2 "
    from_intake(m.Submit(params=params("r1"), pinned_id=True))  # the same id while it runs
    c.intakes.flush()
    (dup,) = outputs()
    assert [(e.status, rid) for rid, e in dup.items] == [(409, "r1")]
    from_intake(m.Cancel(request_id="r1"))  # the running one is still found: its client left
    assert c.active_count == 0
    assert any(isinstance(b, m.RemoveRequest) for _, b in ch.sent)
    from_intake(m.Submit(params=params("r2"), pinned_id=True), name="intake7")  # not an intake of this launch
    assert c.metrics.rejected_messages == 1 and c.active_count == 0
    c.failed = "rank 1 failed to load"
    c.intakes.push_health()
    assert [b for p, b in ch.sent if p == "intake0"][-1] == m.Health(serving=False, reason="rank 1 failed to load")


@pytest.mark.parametrize("together", [False, True], ids=["apart", "in_the_emits"])
def test_an_intakes_first_tokens_leave_before_the_next_walks_are_dispatched(together: bool):
    """A rank's first tokens (Emits) and its WalkDones come in one turn of the conductor, or in one message (a worker
    step's Emits carries the walks that ended in it): the tokens go to the intake before the conductor dispatches the
    next walks, which for a batch of requests takes about a millisecond."""
    c, ch = make(intakes=("intake0",))
    c.serving = True
    c.handle("intake0", m.encode(TOKEN, "intake0", m.Submit(params=params("r1", max_tokens=3), pinned_id=True)))
    (_, first), = walks_sent(ch, "start")
    ch.sent.clear()
    tokens = m.Emit(request_id=first.request_id, signal="x", values=[encode_tensor(torch.tensor([4]))])
    done = m.WalkDone(request_id=first.request_id, walk="start", rank=0, outputs={"x": encode_tensor(torch.tensor([4]))})
    if together:
        from_rank(c, m.Emits(items=[tokens], done=[done]))
    else:
        from_rank(c, tokens)
        from_rank(c, done)
    kinds = [type(b).__name__ for peer, b in ch.sent if peer == "intake0" or isinstance(b, m.RunWalk)]
    assert kinds[:2] == ["Outputs", "RunWalk"], kinds
    assert [e.text for _, e in ch.sent[0][1].items if isinstance(e, TextDelta)] == ["4 "]


def test_every_kind_of_event_crosses_to_an_intake_unchanged():
    from mstar_dist.events import MediaDelta, from_wire

    c, ch = make(intakes=("intake0",))
    sent = [TextDelta(text="héllo ", n_tokens=2),
            MediaDelta(modality="image", data=bytes(range(256)) * 1000, metadata={"width": 64, "height": 32}),
            MediaDelta(modality="audio", data=b"\x01\x00" * 10, metadata={"sample_rate": 24000, "num_channels": 1},
                       n_tokens=7),
            Finished(finish_reason="length", prompt_tokens=3, completion_tokens=9)]
    sink = c.intakes.sink("intake0", "r1")
    for event in sent:
        sink(event)
    failed = c.intakes.sink("intake0", "r2")
    failed(BackendError(429, "the server is at capacity", retry_after_s=3))
    c.intakes.flush()
    (out,) = [b for peer, b in ch.sent if peer == "intake0"]  # decoded from the wire by the fake channel
    got = [from_wire(event) for _, event in out.items]
    assert got[:4] == sent and [rid for rid, _ in out.items] == ["r1"] * 4 + ["r2"]
    assert (got[4].status, got[4].message, got[4].retry_after_s) == (429, "the server is at capacity", 3)


def test_prompt_ids_an_intake_encoded_reach_the_family_and_a_failed_encoding_leaves_it_to_the_conductor():
    """An intake tokenizes in place of the conductor (``prompt_encoder``): its Submit carries the ids, which the
    family's preprocess finds in ``state.data``; when the intake's encoder fails, the Submit carries none and the
    conductor's preprocess does the work (and answers any error) as with one HTTP process."""
    import asyncio
    import dataclasses

    from mstar_dist.server.intake_backend import IntakeBackend

    c, _ = make()
    seen = []
    preprocess = c.model.preprocess

    def recording(state, prompt, messages):
        seen.append(state.data.get("prompt_ids"))
        preprocess(state, prompt, messages)

    c.model.preprocess = recording
    assert submit(c, dataclasses.replace(params("a"), prompt_ids=[5, 6])) == []
    assert submit(c, params("b")) == []
    assert seen == [[5, 6], None]

    class Encoder:
        def encode_prompt(self, prompt, messages):
            if prompt == "bad":
                raise ValueError("no template")
            return [len(prompt)]

    class Link:
        health = (True, "ok")
        sent: list = []

        def send(self, body):
            self.sent.append(body)

    link = Link()
    backend = IntakeBackend(link, None, model_name="toy", max_context_tokens=64, max_tokens_limit=8,
                            output_modality="text", encoder=Encoder())

    async def start(p):
        stream = backend.generate(p)
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)  # the Submit is out; nothing comes back here
        task.cancel()

    async def both():
        await start(params("c", prompt="start=0"))
        await start(params("d", prompt="bad"))

    asyncio.run(both())
    submits = [b for b in link.sent if isinstance(b, m.Submit)]
    assert [(s.params.request_id, s.params.prompt_ids) for s in submits] == [("c", [7]), ("d", None)]


class _WakingChannel(FakeChannel):
    """Blocks in ``recv`` like a socket until ``wake``: a stop that forgot to wake the thread would time out."""

    def __init__(self):
        super().__init__()
        import threading

        self.woken = threading.Event()

    def recv(self, timeout_ms=0, **_):
        self.woken.wait(timeout_ms / 1000)
        return []

    def wake(self):
        self.woken.set()


def test_start_then_stop_ends_the_thread_and_fails_in_flight_requests_with_503():
    c, _ = make()
    ch = c.channel = _WakingChannel()
    c.serving = True
    events = submit(c, params("r1"))
    c.start()
    assert c.alive
    with pytest.raises(RuntimeError, match="started already"):
        c.start()
    assert c.stop(timeout_s=5)
    assert not c.alive and ch.woken.is_set()
    errors = [e for e in events if isinstance(e, BackendError)]
    assert [e.status for e in errors] == [503], events


def test_choices_of_a_request_run_as_requests_of_their_own_and_end_together():
    c, ch = make(max_concurrent=8)
    events = submit(c, GenerationParams(request_id="n", prompt="start=0", messages=None, max_tokens=1, n=3, seed=40))
    starts = walks_sent(ch, "start")
    assert [b.seed for _, b in starts] == [40, 41, 42]  # choice i draws with seed + i
    assert submit(c, params("n"))[0].status == 409  # the request's id is in flight
    for i, (_, walk) in enumerate(starts):
        emit(c, walk.request_id, 10 * i)
        from_rank(c, m.WalkDone(request_id=walk.request_id, walk="start", rank=0, outputs={}))
    deltas = [e for e in events if isinstance(e, TextDelta)]
    assert [d.index for d in deltas] == [0, 1, 2] and deltas[2].text == "20 "
    end = events[-1]
    assert isinstance(end, Finished) and [ch.index for ch in end.choices] == [0, 1, 2]
    assert end.completion_tokens == 3 and end.prompt_tokens == 1  # the prompt counted once
    assert c.active_count == 0 and not c._fanouts


def test_a_failed_choice_fails_its_request_once_and_an_abort_ends_every_choice():
    c, ch = make(max_concurrent=8)
    events = submit(c, GenerationParams(request_id="f", prompt="start=0", messages=None, max_tokens=5, n=2))
    first, second = (b.request_id for _, b in walks_sent(ch, "start"))
    from_rank(c, m.WalkDone(request_id=first, walk="start", rank=0, outputs={}, error="boom"))
    assert [type(e) for e in events] == [BackendError] and c.active_count == 0  # the other choice was aborted
    assert {b.request_id for _, b in ch.sent if isinstance(b, m.RemoveRequest)} == {first, second}
    ch.sent.clear()
    events = submit(c, GenerationParams(request_id="a", prompt="start=0", messages=None, max_tokens=5, n=2))
    c.abort("a")
    assert events == [] and c.active_count == 0 and not c._fanouts
    assert len({b.request_id for _, b in ch.sent if isinstance(b, m.RemoveRequest)}) == 2
