"""The rank's worker loop driven through its control messages, with fake channel/transport (no processes).

A failure here means one bad request takes its batch-mates (or the rank) down, a stray or early message is
lost or wrongly applied, an aborted request still runs, or a kept tensor is never freed after its push.
"""

from __future__ import annotations

import pytest
import torch

from mstar_dist.control import messages as m
from mstar_dist.engine.component import Component
from mstar_dist.graph.nodes import EMIT_TO_CLIENT, Edge, GraphNode, Loop
from mstar_dist.graph.walk import NodeResult
from mstar_dist.transport.inline import decode_tensor, encode_tensor
from mstar_dist.transport.base import ArenaFull
from mstar_dist.transport.router import Router
from mstar_dist.transport.store import TensorStore
from mstar_dist.worker.worker import Worker
from tests.fakes import IdlePlane
from tests.helpers import FakeChannel

TOKEN = "t0k3n"
GRAPHS = {
    "count": Loop(GraphNode("C", inputs=("x",), optional_inputs=("big",),
                            outputs=(Edge("x", "C"), Edge("x", EMIT_TO_CLIENT))),
                  max_iters=100, outputs=("x",), name="count"),
    "keep": GraphNode("C", inputs=("x",), outputs=(Edge("kept", persist=True),)),
}


class Counter(Component):
    """x -> x + 1; a call whose x is negative raises; a batch containing x == 13 breaks as a whole."""

    name = "C"

    def __init__(self):
        self.batches: list[list[str]] = []

    def run_batch(self, calls):
        self.batches.append([c.request_id for c in calls])
        if any(int(c.inputs["x"]) == 13 for c in calls):
            raise RuntimeError("batch broke")
        out = []
        for c in calls:
            x = int(c.inputs["x"])
            if x < 0:
                out.append(ValueError(f"negative x {x}"))
            else:
                out.append(NodeResult({"x": torch.tensor([x + 1]), "kept": torch.full((400,), float(x))}))
        return out


class FakeTransfer:
    def __init__(self, tensor):
        self.tensor = tensor
        self.finished = False

    def done(self):
        return self.finished


class FakeTransport(IdlePlane):
    """A p2p-like data plane whose transfers finish when the test says so."""

    name = "p2p"

    def __init__(self):
        self.sends, self.recvs = [], []
        self.dead: set[int] = set()
        self.fail_sends = False

    def abort_peer(self, peer, reason=""):
        self.dead.add(peer)

    def is_dead(self, peer):
        return peer in self.dead

    def post_send(self, tensor, dst):
        if self.fail_sends:
            raise RuntimeError("NCCL error")
        self.sends.append(FakeTransfer(tensor))
        return self.sends[-1], None

    def post_recv(self, wire, src, device=None):
        self.recvs.append(FakeTransfer(torch.full(wire.shape, 7.0, dtype=getattr(torch, wire.dtype))))
        return self.recvs[-1]


def make_worker(transport=None, wrap=lambda plane: plane, **kwargs):
    """A worker of rank 1 (of 3, one host) running node C; its data plane is ``wrap(transport)``, a p2p-like
    ``FakeTransport`` unless given. It sends no ``Stats`` unless a test asks (``stats_every_s``)."""
    channel, transport, store = FakeChannel(), transport or FakeTransport(), TensorStore()
    router = Router(global_rank=1, rank_hosts={0: "h", 1: "h", 2: "h"}, transports={transport.name: wrap(transport)},
                    intra_host=transport.name, inter_host=transport.name, inline_max_bytes=1024,
                    device=torch.device("cpu"))
    comp = Counter()
    worker = Worker(global_rank=1, graphs=GRAPHS, components={"C": comp}, channel=channel, transport=router,
                    store=store, token=TOKEN, device=torch.device("cpu"), inline_max_bytes=1024, **kwargs)
    worker.stats_every_s = float("inf")
    return worker, channel, transport, store, comp


def deliver(worker, channel, body, token=TOKEN, sender="conductor"):
    channel.inbox.append((sender, m.encode(token, sender, body)))
    for s, payload in channel.recv():
        worker.handle(s, payload)


def run_walk(rid, x, walk="count", iters=3, **inputs):
    return m.RunWalk(request_id=rid, walk=walk, walk_index=0, seed=0,
                     inputs={"x": encode_tensor(torch.tensor([x])), **inputs}, sampling=m.Sampling(),
                     loop_limits={"count": iters})


def turn(worker, n=10):
    for _ in range(n):
        worker.poll_once()


def walk_dones(channel) -> list[m.WalkDone]:
    """Every WalkDone sent, on its own (a failure) or in a step's Emits, in order."""
    return [d for _, b in channel.sent
            for d in ([b] if isinstance(b, m.WalkDone) else b.done if isinstance(b, m.Emits) else [])]


def dones(channel):
    return {d.request_id: d for d in walk_dones(channel)}


def test_failing_call_fails_only_its_request_and_batch_mates_complete():
    worker, channel, *_ = make_worker()
    for rid, x in (("a", 0), ("bad", -5), ("b", 10)):
        deliver(worker, channel, run_walk(rid, x))
    turn(worker)
    done = dones(channel)
    assert "negative x -5" in done["bad"].error
    assert done["a"].error is None and int(decode_tensor(done["a"].outputs["x"])) == 3
    assert done["b"].error is None and int(decode_tensor(done["b"].outputs["x"])) == 13
    emitted = [int(decode_tensor(v)) for _, b in channel.sent if isinstance(b, m.Emits)
               for e in b.items if e.request_id == "a" for v in e.values]
    assert emitted == [1, 2, 3]
    batches = [{e.request_id for e in b.items} for _, b in channel.sent if isinstance(b, m.Emits)]
    assert {"a", "b"} <= batches[0], batches  # one message per step carries every request's tokens


def test_walks_that_end_in_one_step_are_reported_in_its_one_message_after_their_last_tokens():
    """A batch of walks that end together costs the conductor one message: their last tokens, then their ends (it
    read 26 separate WalkDones before it took the first tokens of a 26-row prefill)."""
    worker, channel, *_ = make_worker()
    for i in range(5):
        deliver(worker, channel, run_walk(f"r{i}", 10 * i, iters=2))
    turn(worker, 1)
    turn(worker, 1)  # the second and last iteration of all five
    last = channel.sent[-1][1]
    assert [type(b).__name__ for _, b in channel.sent] == ["Emits", "Emits"]
    assert [d.request_id for d in last.done] == [f"r{i}" for i in range(5)]
    assert {e.request_id: int(decode_tensor(e.values[-1])) for e in last.items} == {f"r{i}": 10 * i + 2
                                                                                    for i in range(5)}
    assert all(int(decode_tensor(d.outputs["x"])) == 10 * i + 2 for i, d in enumerate(last.done))
    assert not worker.held_requests()  # nothing of the finished requests is kept
    turn(worker, 3)
    assert len(channel.sent) == 2  # and nothing more is sent for them


def test_broken_batch_fails_exactly_its_requests_and_the_rank_lives():
    worker, channel, _, _, comp = make_worker()
    deliver(worker, channel, run_walk("x12", 12, iters=3))
    deliver(worker, channel, run_walk("y", 100, iters=3))
    turn(worker, 1)  # both in one batch: 12 -> 13, 100 -> 101
    turn(worker, 1)  # the batch holding x == 13 breaks: both of its requests fail
    done = dones(channel)
    assert set(done) == {"x12", "y"} and all("batch broke" in d.error for d in done.values())
    deliver(worker, channel, run_walk("later", 0, iters=2))
    turn(worker)
    assert dones(channel)["later"].error is None


def test_foreign_token_is_rejected():
    worker, channel, *_ = make_worker()
    deliver(worker, channel, run_walk("a", 0), token="someone-else")
    worker.handle("conductor", b"not msgpack")
    turn(worker)
    assert dones(channel) == {}
    assert worker.rejected_messages == 2  # counted, and reported in Stats for /metrics


def test_unknown_or_spoofing_sender_is_rejected():
    worker, channel, *_ = make_worker()
    channel.inbox.append(("intruder", m.encode(TOKEN, "intruder", run_walk("a", 0))))
    channel.inbox.append(("rank3", m.encode(TOKEN, "conductor", run_walk("b", 0))))  # claims another name
    for s, payload in channel.recv():
        worker.handle(s, payload)
    turn(worker)
    assert dones(channel) == {}


def test_remove_that_overtakes_its_run_walk_is_honoured():
    worker, channel, *_ = make_worker()
    deliver(worker, channel, m.RemoveRequest(request_id="gone"))
    deliver(worker, channel, run_walk("gone", 0))
    turn(worker)
    assert dones(channel) == {}


def test_remote_input_waits_for_its_descriptor_then_runs_on_the_received_tensor():
    worker, channel, transport, *_ = make_worker()
    ref = m.TensorRef(uuid="u1", rank=0, shape=[2], dtype="float32", nbytes=8)
    deliver(worker, channel, run_walk("p", 0, iters=1, big=ref))
    turn(worker)
    assert dones(channel) == {}  # nothing runs before the tensor arrives
    deliver(worker, channel, m.TensorDesc(request_id="p", uuid="u1", src=0,
                                          value=m.WireTensor(shape=[2], dtype="float32")), sender="rank0")
    assert len(transport.recvs) == 1
    turn(worker)
    assert dones(channel) == {}
    transport.recvs[0].finished = True
    turn(worker)
    assert dones(channel)["p"].error is None


def test_persisted_output_is_pushed_then_freed():
    worker, channel, transport, store, _ = make_worker()
    deliver(worker, channel, run_walk("k", 5, walk="keep"))
    turn(worker)
    ref = dones(channel)["k"].outputs["kept"]
    assert isinstance(ref, m.TensorRef) and store.live_tensors == 1
    deliver(worker, channel, m.Push(request_id="k", uuid=ref.uuid, dst=2))
    desc = [b for peer, b in channel.sent if isinstance(b, m.TensorDesc)]
    assert desc and desc[0].uuid == ref.uuid and [p for p, b in channel.sent if b is desc[0]] == ["rank2"]
    assert torch.equal(transport.sends[0].tensor, torch.full((400,), 5.0))
    turn(worker)
    assert store.live_tensors == 1  # still sending
    transport.sends[0].finished = True
    turn(worker)
    assert store.live_tensors == 0 and store.live_bytes == 0


def test_remove_frees_kept_tensors():
    worker, channel, _, store, _ = make_worker()
    deliver(worker, channel, run_walk("k", 5, walk="keep"))
    turn(worker)
    assert store.live_tensors == 1
    deliver(worker, channel, m.RemoveRequest(request_id="k"))
    assert store.live_tensors == 0


def test_worker_stops_when_the_conductor_goes_silent():
    worker, channel, *_ = make_worker()
    worker.conductor_timeout_s = 5.0
    worker.poll_once()
    assert not worker.stopping  # not armed before the first heartbeat: the conductor starts last
    deliver(worker, channel, m.Heartbeat(sent_at=0.0))
    worker.poll_once()
    assert not worker.stopping
    worker.conductor_seen -= 6.0
    worker.poll_once()
    assert worker.stopping and "conductor (rank 0) has been silent" in worker.failed_reason


def test_a_worker_that_was_itself_stopped_does_not_take_the_conductors_silence_meanwhile_for_its_death():
    """SIGSTOP of a whole host (or a frozen VM) stops the conductor and the rank alike: after SIGCONT the rank must go
    on serving, not leave because nobody spoke while it was not running."""
    worker, channel, *_ = make_worker()
    worker.conductor_timeout_s = 5.0
    deliver(worker, channel, m.Heartbeat(sent_at=0.0))
    worker.poll_once()
    worker.conductor_seen -= 12.0  # last heard 12 s ago, but the loop's last turn was 12 s ago too
    worker._last_check -= 12.0
    worker.poll_once()
    assert not worker.stopping
    worker.conductor_seen -= 6.0  # then 6 s more of silence while it runs: that one counts
    worker.poll_once()
    assert worker.stopping and "conductor (rank 0) has been silent" in worker.failed_reason


@pytest.mark.parametrize("host_answers", [True, False])
def test_a_silent_conductor_whose_host_answers_gets_one_more_timeout_before_the_rank_leaves(host_answers):
    """Rank 0's whole host stopped and continued, or the link to it down for a while: its store answers again, so the
    rank waits for the conductor once more instead of leaving (and failing its requests); a host that does not
    answer is gone, and the rank leaves at once."""
    asked: list[bool] = []
    worker, channel, *_ = make_worker()
    worker.conductor_timeout_s = 5.0
    worker.rank0_up = lambda: asked.append(True) or host_answers
    deliver(worker, channel, m.Heartbeat(sent_at=0.0))
    worker.poll_once()
    worker.conductor_seen -= 6.0
    worker.poll_once()
    assert asked == [True] and worker.stopping != host_answers and worker.rank0_gone != host_answers
    if host_answers:
        deliver(worker, channel, m.Heartbeat(sent_at=1.0))  # the conductor speaks again: all is well
        worker.poll_once()
        worker.conductor_seen -= 6.0  # silent once more: asked once more
        worker.poll_once()
        assert asked == [True, True] and not worker.stopping
        worker.conductor_seen -= 6.0  # and again without a word in between: it leaves (to restart)
        worker.poll_once()
        assert asked == [True, True] and worker.stopping and not worker.rank0_gone


def test_a_peer_that_rejoins_over_shared_memory_is_served_again_without_pairs_to_form():
    """A restarted rank on this rank's host (shm between them) rejoins: the ``Repair`` names no p2p pair of this
    rank, and the shm plane must still take the peer back; otherwise every push to it fails as to a dead peer."""
    class Shm(FakeTransport):
        name = "shm"

        def revive_peer(self, peer, pair_groups=None):
            self.dead.discard(peer)

    worker, channel, transport, *_ = make_worker(Shm())
    transport.abort_peer(2, "declared dead")
    deliver(worker, channel, m.Repair(rank=2, endpoint="", pairs=[], prefix="repair/1"))
    assert not worker.transport.is_dead(2)
    assert [b for _, b in channel.sent if isinstance(b, m.Repaired)] == [m.Repaired(rank=1, joined=2)]


def test_a_send_that_cannot_be_posted_kills_the_pair_on_both_sides_and_fails_the_request_at_once():
    worker, channel, transport, *_ = make_worker()
    deliver(worker, channel, run_walk("k", 5, walk="keep"))
    turn(worker)
    ref = dones(channel)["k"].outputs["kept"]
    transport.fail_sends = True
    deliver(worker, channel, m.Push(request_id="k", uuid=ref.uuid, dst=2, walk="decode", signal="kv"))
    aborts = [(peer, b) for peer, b in channel.sent if isinstance(b, m.AbortPair)]
    assert aborts == [("rank2", m.AbortPair(src=1, dst=2, reason=aborts[0][1].reason))]
    assert transport.is_dead(2)
    failed = [b for b in walk_dones(channel) if b.error]
    assert failed and failed[0].walk == "decode" and "cannot send 'kv' to rank 2" in failed[0].error
    deliver(worker, channel, m.Push(request_id="k", uuid=ref.uuid, dst=2))  # dead: no descriptor at all
    assert [b for _, b in channel.sent if isinstance(b, m.TensorDesc)] == []


def test_peer_abort_fails_a_walk_waiting_on_that_pair_at_once():
    worker, channel, transport, *_ = make_worker()
    ref = m.TensorRef(uuid="u9", rank=0, shape=[2], dtype="float32", nbytes=8)
    deliver(worker, channel, run_walk("w", 0, iters=1, big=ref))
    turn(worker)
    deliver(worker, channel, m.AbortPair(src=0, dst=1, reason="send failed"), sender="rank0")
    turn(worker)
    assert transport.is_dead(0)
    assert "pair from rank 0 is dead" in dones(channel)["w"].error


def test_rank_down_from_the_conductor_aborts_the_data_plane_to_it():
    worker, channel, transport, *_ = make_worker()
    ref = m.TensorRef(uuid="u9", rank=0, shape=[2], dtype="float32", nbytes=8)
    deliver(worker, channel, run_walk("w", 0, iters=1, big=ref))
    deliver(worker, channel, m.RankDown(rank=0, reason="silent for 31 s"))
    turn(worker)
    assert transport.is_dead(0) and "pair from rank 0 is dead" in dones(channel)["w"].error


class ArenaTransport(FakeTransport):
    """An arena data plane with room for ``room`` sends; a TransferAck gives one back."""

    name = "shm"

    def __init__(self, room=1):
        super().__init__()
        self.room, self.acked = room, []

    def post_send(self, tensor, dst):
        if self.room == 0:
            raise ArenaFull("arena test-arena is full")
        self.room -= 1
        self.sends.append(FakeTransfer(tensor))
        return self.sends[-1], m.ShmLocation("test-arena", 0, 1600, len(self.sends))

    def on_ack(self, src, ack):
        self.acked.append((src, ack.slots))
        self.room += len(ack.slots)


def arena_worker(room=1):
    worker, channel, plane, store, comp = make_worker(ArenaTransport(room), backpressure_timeout_s=0.5)
    return worker, channel, plane, store


def test_a_full_arena_waits_for_acks_while_other_messages_keep_their_order():
    worker, channel, plane, store = arena_worker(room=1)
    for rid in ("a", "b"):
        deliver(worker, channel, run_walk(rid, 5, walk="keep"))
    turn(worker)
    refs = {rid: d.outputs["kept"] for rid, d in dones(channel).items()}
    deliver(worker, channel, m.Push(request_id="a", uuid=refs["a"].uuid, dst=2))
    # the second push finds the arena full; meanwhile the consumer's ack and an unrelated message arrive
    channel.inbox += [("rank2", m.encode(TOKEN, "rank2", m.TransferAck(via="shm", slots=[1]))),
                      ("conductor", m.encode(TOKEN, "conductor", run_walk("c", 0, iters=1)))]
    worker.handle("conductor", m.encode(TOKEN, "conductor", m.Push(request_id="b", uuid=refs["b"].uuid, dst=2)))
    assert plane.acked == [(2, [1])]
    descs = [b for _, b in channel.sent if isinstance(b, m.TensorDesc)]
    assert [d.request_id for d in descs] == ["a", "b"] and descs[1].value.via == "shm"
    assert "c" not in dones(channel) and len(worker.transfers.stash) == 1  # set aside, not lost
    worker.run(should_stop=lambda: "c" in dones(channel))
    assert dones(channel)["c"].error is None


def test_an_arena_that_stays_full_fails_the_request_naming_it():
    worker, channel, plane, store = arena_worker(room=0)
    deliver(worker, channel, run_walk("a", 5, walk="keep"))
    turn(worker)
    ref = dones(channel)["a"].outputs["kept"]
    deliver(worker, channel, m.Push(request_id="a", uuid=ref.uuid, dst=2, walk="decode", signal="kv"))
    failed = [b for b in walk_dones(channel) if b.error]
    assert "test-arena is full" in failed[0].error and "transport.backpressure_timeout_s" in failed[0].error
    assert not plane.is_dead(2)  # a full arena is not a broken peer


def tp_worker(rank: int):
    """A member of the TP replica of node C on ranks 0 (leader) and 1."""
    from mstar_dist.worker.tp import TPRole

    channel, transport, store = FakeChannel(), FakeTransport(), TensorStore()
    router = Router(global_rank=rank, rank_hosts={0: "h", 1: "h"}, transports={"p2p": transport},
                    intra_host="p2p", inter_host="p2p", inline_max_bytes=1024, device=torch.device("cpu"))
    comp = Counter()
    worker = Worker(global_rank=rank, graphs=GRAPHS, components={"C": comp}, channel=channel, transport=router,
                    store=store, token=TOKEN, device=torch.device("cpu"), inline_max_bytes=1024,
                    tp_roles={"C": TPRole(node="C", ranks=(0, 1), me=rank)})
    worker.stats_every_s = float("inf")
    return worker, channel, transport, comp


def test_tp_members_stop_in_step_the_follower_runs_what_its_leader_sent_before_it_ended():
    """With NCCL a leader waits without end in the collectives of a step its follower never runs."""
    leader, leader_channel, _, _ = tp_worker(0)
    leader.run(should_stop=lambda: True)
    assert ("rank1", m.TPEnd(node="C")) in leader_channel.sent

    follower, channel, _, comp = tp_worker(1)
    step = m.TPStep(node="C", calls=[m.TPCall(request_id="r1", walk="count", walk_index=0, seed=0,
                                               sampling=m.Sampling(), iteration=0,
                                               inputs={"x": encode_tensor(torch.tensor([4]))})])
    for body in (step, m.TPEnd(node="C")):  # both arrive after the signal: the loop has already stopped
        channel.inbox.append(("rank0", m.encode(TOKEN, "rank0", body)))
    follower.run(should_stop=lambda: True)
    assert comp.batches == [["r1"]]

    alone, _, transport, comp = tp_worker(1)  # the leader never says: the follower gives up after drain_s
    alone.end_tp(drain_s=0.2)
    assert comp.batches == []
    transport.dead.add(0)  # a dead leader: no wait at all
    alone.tp.ended.clear()
    alone.end_tp(drain_s=3600)


def test_an_inline_input_the_component_moves_itself_arrives_on_the_host_and_others_on_the_device():
    """The KV engine copies prompt ids to the GPU on the stream its prefill runs on (kv_engine ``_prefill_stream``):
    a prompt the worker had already queued on the current stream would make a prefill beside the decode step in
    flight read it before it landed. Here the rank's device is "meta", so a device copy is visible as such."""

    class Seen(Counter):
        def __init__(self, host_inputs):
            super().__init__()
            self.host_inputs = frozenset(host_inputs)
            self.devices: list[str] = []

        def run_batch(self, calls):
            self.devices.extend(c.inputs["x"].device.type for c in calls)
            return [NodeResult({"x": torch.tensor([1]), "kept": torch.zeros(4)}) for _ in calls]

    for host_inputs, expected in (({"x"}, "cpu"), ((), "meta")):
        comp = Seen(host_inputs)
        channel = FakeChannel()
        router = Router(global_rank=1, rank_hosts={0: "h", 1: "h"}, transports={"p2p": FakeTransport()},
                        intra_host="p2p", inter_host="p2p", inline_max_bytes=1024, device=torch.device("cpu"))
        worker = Worker(global_rank=1, graphs=GRAPHS, components={"C": comp}, channel=channel, transport=router,
                        store=TensorStore(), token=TOKEN, device=torch.device("meta"), inline_max_bytes=1024)
        worker.stats_every_s = float("inf")
        deliver(worker, channel, run_walk("a", 5, walk="keep"))
        turn(worker, 2)
        assert comp.devices == [expected]


class OnTheGpu(Counter):
    """Counter whose calls are answered None for their first three turns, with ``pending`` true: the work is on the
    GPU and will end with no message coming (a prefill the KV engine left in flight)."""

    def __init__(self):
        super().__init__()
        self.turns = 0

    def run_batch(self, calls):
        self.turns += 1
        return [None] * len(calls) if self.turns <= 3 else super().run_batch(calls)

    def pending(self):
        return 0 < self.turns <= 3


def test_the_loop_polls_instead_of_sleeping_while_a_component_has_work_on_the_gpu():
    worker, channel, *_ = make_worker()
    worker.components["C"] = comp = OnTheGpu()
    waits: list[tuple[int, bool]] = []  # (recv timeout, the component pending then)

    def recv(timeout_ms=0, spin_s=0.0):
        waits.append((timeout_ms, comp.pending()))
        out, channel.inbox = channel.inbox, []
        return out

    channel.recv = recv
    deliver(worker, channel, run_walk("k", 5, walk="keep"))
    worker.run(should_stop=lambda: "k" in dones(channel) or len(waits) > 50)
    assert "k" in dones(channel) and not dones(channel)["k"].error
    assert comp.turns == 4
    # each turn with the work on the GPU polled (timeout 0) rather than slept on the socket (20 ms when idle)
    assert [t for t, busy in waits if busy] == [0, 0, 0]
