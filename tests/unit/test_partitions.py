"""Partitions and streaming-edge declarations (docs/architecture.md §4). A failure here means a request finishes while a
partition (e.g. the audio codec) still runs, never finishes because a partition that was not requested waits
forever, or a model with a misdeclared streaming edge is accepted and hangs at run time."""

import pytest

from mstar_dist.graph.nodes import Edge, GraphNode, Loop
from mstar_dist.graph.partitions import Partition, PartitionTracker, StreamingEdge, check_partitions
from mstar_dist.graph.streaming import Fixed, LeftContext

LLM = Partition("llm", ("prefill", "decode"))
AUDIO = Partition("audio", ("codec",))

GRAPHS = {
    "prefill": GraphNode("LLM", inputs=("tokens",), outputs=(Edge("token"),)),
    "decode": Loop(GraphNode("LLM", inputs=("token",), outputs=(Edge("token", "LLM"), Edge("codes"))),
                   max_iters=8, name="decode"),
    "codec": Loop(GraphNode("Codec", inputs=("codes",), outputs=(Edge("audio", "@client"),)), max_iters=8),
}


# ---- tracker ----

def test_request_is_done_only_when_every_partition_is():
    t = PartitionTracker([LLM, AUDIO])
    t.start("llm")
    t.start("audio")
    assert t.walk_done("llm") == 1 and t.walk_done("llm") == 2
    t.partition_done("llm")
    assert t.is_done("llm") and not t.is_done("audio") and not t.request_done
    t.walk_done("audio")
    t.partition_done("audio")
    assert t.request_done
    assert t.walks_done("llm") == 2 and t.walks_done("audio") == 1


def test_partition_can_start_already_done():
    t = PartitionTracker([LLM, AUDIO], start_done={"audio"})  # no audio requested
    assert t.is_done("audio") and not t.request_done
    with pytest.raises(RuntimeError, match="done"):
        t.start("audio")
    t.start("llm")
    t.partition_done("llm")
    assert t.request_done


def test_pending_partition_can_be_finished_without_starting():
    t = PartitionTracker([LLM, AUDIO])
    t.partition_done("audio")
    assert t.state("audio") == "done" and t.state("llm") == "pending"


def test_calls_in_the_wrong_state_raise():
    t = PartitionTracker([LLM])
    with pytest.raises(RuntimeError, match="pending"):
        t.walk_done("llm")
    t.start("llm")
    with pytest.raises(RuntimeError, match="running"):
        t.start("llm")
    t.partition_done("llm")
    with pytest.raises(RuntimeError, match="already done"):
        t.partition_done("llm")
    with pytest.raises(RuntimeError, match="done"):
        t.walk_done("llm")


def test_unknown_names_raise():
    t = PartitionTracker([LLM, AUDIO])
    for call in (t.start, t.walk_done, t.partition_done, t.is_done, t.state):
        with pytest.raises(ValueError, match="unknown partition 'video'"):
            call("video")
    with pytest.raises(ValueError, match="unknown partition"):
        PartitionTracker([LLM], start_done={"audio"})
    assert t.partition_of("codec") == "audio"
    with pytest.raises(ValueError, match="in no partition"):
        t.partition_of("nope")


def test_tracker_rejects_bad_partition_sets():
    with pytest.raises(ValueError, match="twice"):
        PartitionTracker([LLM, Partition("llm", ("codec",))])
    with pytest.raises(ValueError, match="more than one partition"):
        PartitionTracker([LLM, Partition("other", ("decode",))])
    with pytest.raises(ValueError, match="at least one"):
        PartitionTracker([])


# ---- declarations ----

def test_partition_validation():
    with pytest.raises(ValueError, match="name"):
        Partition("", ("a",))
    with pytest.raises(ValueError, match="walks"):
        Partition("p", ())
    with pytest.raises(ValueError, match="walks"):
        Partition("p", "decode")  # a str, not a tuple of names
    with pytest.raises(ValueError, match="twice"):
        Partition("p", ("a", "a"))


def test_check_partitions_covers_every_walk_once():
    assert check_partitions([LLM, AUDIO], GRAPHS) == {"llm": LLM, "audio": AUDIO}
    with pytest.raises(ValueError, match=r"walks \['codec'\] are in no partition"):
        check_partitions([LLM], GRAPHS)
    with pytest.raises(ValueError, match="unknown walk 'tts'"):
        check_partitions([LLM, Partition("audio", ("codec", "tts"))], GRAPHS)
    with pytest.raises(ValueError, match="'decode' is in partitions 'llm' and 'x'"):
        check_partitions([LLM, AUDIO, Partition("x", ("decode",))], GRAPHS)


def test_streaming_edge_checked_against_walk_graphs():
    parts = check_partitions([LLM, AUDIO], GRAPHS)
    StreamingEdge("codes", "llm", "audio", "Codec", LeftContext(4, 2)).check(parts, GRAPHS)
    bad = {
        "unknown src_partition": StreamingEdge("codes", "video", "audio", "Codec", Fixed(4)),
        "no node of partition 'llm' outputs 'audio'": StreamingEdge("audio", "llm", "audio", "Codec", Fixed(4)),
        "'LLM' is in no walk": StreamingEdge("codes", "llm", "audio", "LLM", Fixed(4)),
    }
    for message, edge in bad.items():
        with pytest.raises(ValueError, match=message):
            edge.check(parts, GRAPHS)
    with pytest.raises(ValueError, match="does not take 'codes'"):
        StreamingEdge("codes", "audio", "llm", "LLM", Fixed(4)).check(
            parts, {**GRAPHS, "codec": GraphNode("Codec", outputs=(Edge("codes"),))})
    with pytest.raises(ValueError, match="crosses partitions"):
        StreamingEdge("codes", "llm", "llm", "LLM", Fixed(4))
    with pytest.raises(ValueError, match="chunk policy"):
        StreamingEdge("codes", "llm", "audio", "Codec", 4)
