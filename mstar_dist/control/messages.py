"""Every message that crosses a control socket, in one place (docs/architecture.md §6).

Messages are msgspec structs encoded as msgpack inside an :class:`Envelope` that carries the deployment token
and the sender's name; a receiver drops (and logs) envelopes whose token is not its own. Never pickle.

Ranks in these messages are *global* ranks (torch.distributed's world numbering of the logical cluster).
Sender names are ``"rank<N>"`` for a worker, ``"conductor"`` for the conductor on rank 0 and ``"intake<N>"`` for
an HTTP intake process of the front end.
"""

from __future__ import annotations

from typing import Union

import msgspec

from mstar_dist.events import GenerationParams, GuidedSpec, WireEvent


class InlineTensor(msgspec.Struct, frozen=True, tag=True):
    """A tensor carried by value inside a control message."""

    dtype: str
    """torch dtype name without the `torch.` prefix, e.g. "bfloat16" (see `dtype_to_str`)."""
    shape: list[int]
    """Tensor shape; `[]` for a 0-d tensor."""
    data: bytes
    """Raw row-major element bytes, `prod(shape) * itemsize` long."""


class TensorRef(msgspec.Struct, frozen=True, tag=True):
    """A tensor kept in a rank's tensor store; moved over the data plane, never inside a message."""

    uuid: str
    rank: int
    """Global rank whose store holds the tensor."""
    shape: list[int]
    dtype: str
    nbytes: int


class ShmLocation(msgspec.Struct, frozen=True, tag=True):
    """Where a tensor waits in the producer's shared-memory arena (``transport/shm.py``)."""

    segment: str
    """Name of the producer's segment under /dev/shm."""
    offset: int
    """Byte offset of the tensor's bytes in the segment."""
    nbytes: int
    slot: int
    """The producer's id for this allocation: the consumer names it in its ``TransferAck``."""
    ring: int = -1
    """Byte offset in the producer's segment of the ring where this consumer hands slots back without a message
    (-1: none; acknowledge by ``TransferAck``)."""


class MooncakeLocation(msgspec.Struct, frozen=True, tag=True):
    """Where a tensor waits in the producer's registered memory (``transport/mooncake.py``): the consumer reads
    it one-sided from ``session`` and acknowledges with a ``TransferAck``."""

    session: str
    """The producer's transfer-engine session, ``host:rpc_port`` (P2PHANDSHAKE)."""
    addr: int
    """Virtual address of the bytes in the producer's process."""
    nbytes: int
    slot: int


class EncodedLocation(msgspec.Struct, frozen=True, tag=True):
    """Where the bytes wait, for a transport whose location is its own type: that type encoded by the transport
    (e.g. ``msgspec.msgpack.encode``) and read back by the same transport on the consumer (``WireTensor.via``
    names it). A new transport needs no struct here."""

    data: bytes


Location = Union[ShmLocation, MooncakeLocation, EncodedLocation]


class WireTensor(msgspec.Struct, frozen=True, tag=True):
    """A tensor moved by the data plane (docs/architecture.md §7). ``via`` names the transport the producer chose
    and ``at`` where the bytes wait, so the consumer never guesses.

    p2p (``at`` is None): the tensor follows the message carrying this descriptor on the sender -> receiver pair
    (NCCL device to device for CUDA tensors, gloo for host ones); the sender posts its sends in the order of
    the descriptors it sends and the receiver posts a receive for each descriptor in message order (FIFO per
    sender), so sends and receives pair up without ids. shm / mooncake: the bytes wait at ``at`` in the
    producer's arena until the consumer's ``TransferAck``."""

    shape: list[int]
    dtype: str
    host: bool = False
    """A host (CPU) tensor: it is received into host memory (p2p: it travels on the pair's gloo half)."""
    via: str = "p2p"
    """The transport that carries it: "p2p", "shm" or "mooncake"."""
    at: Location | None = None
    """Where the bytes are (arena transports; another transport's own location as ``EncodedLocation``); None for
    p2p."""


class Remote(msgspec.Struct, frozen=True, tag=True):
    """A walk input that only nodes on other ranks consume: the receiving rank's copy of the walk needs to
    know it is there, not its value."""


Value = Union[InlineTensor, TensorRef, Remote]
Carried = Union[InlineTensor, WireTensor]
"""A value moving between two workers: inline when small, else a descriptor of a data-plane transfer."""


class Sampling(msgspec.Struct, frozen=True, omit_defaults=True):
    """A request's sampling knobs on the wire (the walk's seed travels beside them); a rank turns them into its
    per-row parameters with ``engine.sampling.SamplingParams.of``, the one conversion every family uses. The
    fields are ``SamplingParams``' (its docstrings say what each means); knobs left at their defaults cost nothing
    on the wire."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    """Counted from the walk's first token (the conductor subtracts what earlier walks generated)."""
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    guided: GuidedSpec | None = None


# ---- conductor -> worker -------------------------------------------------------------------------------------


class RunWalk(msgspec.Struct, tag=True):
    """Run the part of ``walk`` placed on the receiving rank for one request.

    ``inputs`` maps signal names to values; a :class:`TensorRef` held by another rank arrives over the data
    plane after that rank's :class:`TensorDesc`. ``export`` names persisted outputs whose consumer is on another
    rank (so the producer must materialise them). ``loop_limits`` overrides a named loop's ``max_iters``.
    """

    request_id: str
    walk: str
    walk_index: int
    seed: int
    inputs: dict[str, Value]
    sampling: Sampling
    export: list[str] = []
    loop_limits: dict[str, int] = {}
    stop_token_ids: list[int] = []
    stream_routes: dict[str, int] = {}
    """Streaming signals this walk produces -> global rank of the consuming walk (another partition)."""
    release: list[str] = []
    """Inputs that are tensors kept on the receiving rank itself and consumed by this walk: unpersist once read."""
    node_ranks: dict[str, int] = {}
    """For a walk whose nodes run on several ranks: node -> global rank running it for this request. Every one
    of those ranks gets this ``RunWalk`` and runs a copy of the whole walk in lockstep, executing its own nodes
    and taking the others' results from their :class:`NodeDone` (see ``mstar_dist/worker/spans.py``). Empty
    when the whole walk runs on the receiving rank."""


class Push(msgspec.Struct, tag=True):
    """Send the stored tensor ``uuid`` to global rank ``dst`` (a ``TensorDesc``, then the data-plane transfer).

    With ``release`` the producer drops its persisted reference once the send completes.
    """

    request_id: str
    uuid: str
    dst: int
    release: bool = True
    tp_dst: list[int] = []
    """When the tensor is a TP shard (its producer is a TP replica): the consuming replica's ranks; shard r goes
    to ``tp_dst[r]`` (the receiving rank's own shard goes to ``dst`` = ``tp_dst[0]``; the producer's followers
    are told by ``TPPush``)."""
    walk: str = ""
    """The consuming walk and the input the tensor becomes there (edge statistics labels)."""
    signal: str = ""


class RemoveRequest(msgspec.Struct, tag=True):
    """Forget a request: end its walks, free its KV and every tensor tagged with it. Idempotent."""

    request_id: str


class Shutdown(msgspec.Struct, tag=True):
    """Stop serving; with ``error`` the receiving rank exits non-zero (another rank failed). With ``restart`` only this
    rank goes and its supervisor starts it again, to rejoin (it was declared dead, or a member of its TP replica
    died: docs/architecture.md §10); without, the deployment is over."""

    reason: str
    error: bool = False
    restart: bool = False


class Repair(msgspec.Struct, tag=True):
    """Conductor -> every live rank when global rank ``rank`` (re)joins: connect to ``rank``'s new control
    ``endpoint`` (empty for the rejoining rank itself), then form a fresh 2-rank group for each directed pair of
    ``pairs`` this rank belongs to, under the launch store's ``prefix`` (docs/architecture.md §10), and answer
    ``Repaired``. To the rejoining rank itself, ``endpoints`` has the control endpoints of the ranks that rejoined
    before it (what it read from the launch's store at its start may be their old processes')."""

    rank: int
    endpoint: str
    pairs: list[tuple[int, int]]
    prefix: str
    endpoints: dict[int, str] = {}


class Repaired(msgspec.Struct, tag=True):
    """Rank ``rank`` is ready for rejoining rank ``joined``: connected, its pairs with it formed (``error`` says why
    not)."""

    rank: int
    joined: int
    error: str = ""


class RankDown(msgspec.Struct, tag=True):
    """The conductor declared global rank ``rank`` dead: the receiver aborts its data plane to it (pending
    transfers fail, arena slots lent to it are reclaimed)."""

    rank: int
    reason: str


OWN_PAUSE_S = 2.0
"""A gap this long between two of a process's own liveness checks (the conductor checks its ranks every 0.2 s, a rank
its conductor every turn of a loop that never blocks longer than 20 ms) means that process itself did not run
(stopped, or its host froze): the other side's silence over that gap does not count (docs/architecture.md §10)."""


class Heartbeat(msgspec.Struct, tag=True):
    """The conductor is alive (sent to every live rank every second); a rank that hears nothing from the
    conductor for its rank timeout exits non-zero instead of serving nobody forever."""

    sent_at: float


# ---- worker -> worker ----------------------------------------------------------------------------------------


class AbortPair(msgspec.Struct, tag=True):
    """The sender gave up on its data plane to the receiver after a failure on the pair (src, dst) (a post failed,
    a transfer timed out): the receiver marks its side dead too, so no later send or receive is matched against
    the wrong partner (docs/architecture.md §7)."""

    src: int
    dst: int
    reason: str


class TensorDesc(msgspec.Struct, tag=True):
    """A kept tensor that ``src`` sends to the receiver on the conductor's ``Push`` (the receiver posts its
    receive when this arrives: for p2p in descriptor order)."""

    request_id: str
    uuid: str
    src: int
    value: Carried
    """The tensor, inline or as a data-plane descriptor."""
    walk: str = ""
    """The walk that consumes it (labels the edge in the per-edge statistics)."""
    signal: str = ""
    """The walk input it becomes (labels the edge)."""


class TransferAck(msgspec.Struct, tag=True):
    """Consumer -> producer: these arena slots (``ShmLocation.slot`` / ``MooncakeLocation.slot``) of transport
    ``via`` were read (or abandoned); the producer may reuse them."""

    via: str
    slots: list[int]


class NodeDone(msgspec.Struct, tag=True):
    """A node of a walk that spans ranks finished one run on the sender; sent to every other rank of the walk.

    ``seq`` counts the node's runs in this walk (0, 1, ... one per loop iteration), so a receiver applies the
    result to the same run of the node in its copy of the walk. ``signals`` are every output the run produced;
    ``values`` carries those that nodes on the receiver consume (the others are placeholders there). ``stop``
    is the node's dynamic stop (its innermost loop ends after this iteration on every rank).
    """

    request_id: str
    walk: str
    node: str
    seq: int
    signals: list[str]
    values: dict[str, Carried] = {}
    stop: bool = False


class ShardRef(msgspec.Struct, frozen=True, tag=True):
    """A tensor this TP follower holds or is receiving under ``uuid`` (its own shard of a kept tensor, e.g. its
    part of a P/D KV cache sent by its counterpart on the producing replica)."""

    uuid: str


class TPCall(msgspec.Struct):
    """One node call of a TP leader's batch, as its followers replay it (same request, walk, seed, inputs)."""

    request_id: str
    walk: str
    walk_index: int
    seed: int
    sampling: Sampling
    iteration: int
    inputs: dict[str, Union[InlineTensor, ShardRef]]
    export: list[str] = []
    stop_token_ids: list[int] = []


class TPStep(msgspec.Struct, tag=True):
    """TP leader -> each follower of its replica: run this batch of ``node`` now, in this order (the forward's
    collectives on the TP group pair up because every member runs the same batches in the same order)."""

    node: str
    calls: list[TPCall]
    release: list[str] = []
    """Requests the leader removed since its last step: release them here, in this order (a follower never acts
    on the conductor's RemoveRequest for a TP component, which could overtake a step that still holds them)."""


class TPEnd(msgspec.Struct, tag=True):
    """TP leader -> each follower, as the leader stops: no step of ``node`` follows the ones already sent. A stopping
    follower runs those first (each holds collectives the leader is waiting in), then exits."""

    node: str


class TPPush(msgspec.Struct, tag=True):
    """TP leader -> a follower: send your shard of ``signal`` for ``request_id`` to global rank ``dst`` (your
    counterpart on the consuming replica) as ``uuid`` (descriptor first, then the p2p send)."""

    request_id: str
    signal: str
    uuid: str
    dst: int
    release: bool = True


class StreamItems(msgspec.Struct, tag=True):
    """Values a producer walk emitted on a streaming edge, for the consumer's buffer (FIFO per sender); large
    ones follow on the pair (:class:`WireTensor`) and join the buffer in order once they arrived."""

    request_id: str
    signal: str
    values: list[Carried]


class StreamEnd(msgspec.Struct, tag=True):
    """The producing partition of ``signal`` is done: the consumer's buffer emits its final chunk.

    The conductor sends it to the rank that produced the stream with ``forward_to`` = the consumer's rank; that
    rank forwards it, so it arrives after every ``StreamItems`` it sent (FIFO per sender). When nothing was
    produced the conductor sends it to the consumer directly.
    """

    request_id: str
    signal: str
    forward_to: int = -1


# ---- worker -> conductor -------------------------------------------------------------------------------------


class Emit(msgspec.Struct, tag=True):
    """Values a node sent to ``EMIT_TO_CLIENT`` (e.g. one sampled token per decode step)."""

    request_id: str
    signal: str
    values: list[InlineTensor]


class WalkDone(msgspec.Struct, tag=True):
    """The receiving rank finished its part of a walk; ``outputs`` are the walk's outputs it produced."""

    request_id: str
    walk: str
    rank: int
    outputs: dict[str, Value]
    error: str | None = None
    finish_reason: str | None = None
    status: int = 500
    """HTTP status for ``error``: 503 when the rank could not serve it for lack of a peer (a TP member died)."""


class Emits(msgspec.Struct, tag=True):
    """Every ``Emit`` of one worker step, for all of the rank's requests, and the walks that ended in it: one message
    per step, not per token or per walk (the conductor would otherwise read a whole prefill batch's ``WalkDone``s
    before it took their first tokens). The conductor handles ``items`` first."""

    items: list[Emit]
    done: list[WalkDone] = []


class Ready(msgspec.Struct, tag=True):
    rank: int
    host: str
    load_seconds: float


class Rejoin(msgspec.Struct, tag=True):
    """A rank restarted in place (incarnation > 0) has loaded its components and asks to serve again: the conductor
    connects to its new ``endpoint`` and has its peers form fresh pairs with it (``Repair``); it is re-admitted once
    every one of them answered."""

    rank: int
    host: str
    incarnation: int
    endpoint: str
    load_seconds: float


class LoadFailed(msgspec.Struct, tag=True):
    rank: int
    host: str
    error: str


class EdgeHistogram(msgspec.Struct, frozen=True):
    """One rank's edge transfers on one transport in one direction, as a histogram of ``unit`` ("bytes" or
    "seconds"): ``counts[i]`` transfers at most ``bounds[i]`` and above the bound before (the last count is above
    every bound), ``total`` the sum of the values."""

    transport: str
    direction: str
    """"send" or "recv"."""
    unit: str
    bounds: list[float]
    counts: list[int]
    total: float


class Leaving(msgspec.Struct, tag=True):
    """The sending rank is exiting cleanly (SIGTERM): the conductor declares it dead at once, so its requests fail
    fast with a 503 instead of after ``limits.rank_timeout_s``."""

    rank: int
    host: str
    reason: str


class EdgeStat(msgspec.Struct, array_like=True):
    """Transfers into the reporting rank on one edge since it started: (walk, src -> dst, signal, transport)."""

    walk: str
    src: int
    dst: int
    signal: str
    via: str
    count: int
    nbytes: int
    p50_s: float
    """Median seconds from the descriptor's arrival to the data being ready, over the last transfers."""
    p99_s: float


class Stats(msgspec.Struct, tag=True):
    """Periodic per-rank gauges for /metrics (live tensors is the leak canary)."""

    rank: int
    live_tensors: int
    live_bytes: int
    edge_bytes_sent: int
    edge_bytes_received: int
    host_staging_copies: int
    engine: dict[str, int] = {}
    """Component counters and gauges (KV slots, decode steps and rows...), summed over this rank's components."""
    rejected_messages: int = 0
    """Control messages this rank dropped: undecodable, without the launch's secret, or from a spoofed sender."""
    rss_bytes: float = 0.0
    """Resident memory of the rank's process."""
    cpu_seconds: float = 0.0
    """User + system CPU time of the rank's process so far."""
    open_fds: float = 0.0
    """Open file descriptors of the rank's process."""
    edge_histograms: list[EdgeHistogram] = []
    """Sizes and times of this rank's data-plane transfers per transport and direction (``mstar_dist/telemetry``)."""

    arena_bytes_used: dict[str, int] = {}
    """Transport ("shm", "mooncake") -> bytes of this rank's arena lent out and not yet acknowledged."""
    edges: list[EdgeStat] = []
    """Per-edge transfer statistics (collected always; logged with ``--log-stats``)."""
    incarnation: int = 0
    """How many times this rank was restarted in place: the conductor tells a rank declared dead that speaks again
    (it was stopped, not killed) from its new incarnation."""



# ---- intake processes <-> the conductor (docs/architecture.md §2, "Intake processes") ----


class Submit(msgspec.Struct, tag=True):
    """Intake -> conductor: run this validated request; its events come back in ``Outputs`` to the same intake."""

    params: GenerationParams
    pinned_id: bool
    """The client chose the request id (it then seeds sampling, as on the in-process path)."""


class Cancel(msgspec.Struct, tag=True):
    """Intake -> conductor: the client of ``request_id`` went away (or the intake is stopping): abort it."""

    request_id: str


class HttpCounts(msgspec.Struct, tag=True):
    """Intake -> conductor: this intake's HTTP metrics (``server/http_metrics.HttpStats.counts``), sent when they
    change (at most once a second) and with every ``MetricsAsk``; ``/metrics`` shows their sum over intakes."""

    requests: dict[str, int]
    """``"route code"`` -> requests answered."""
    in_flight: int
    disconnects: int


class MetricsAsk(msgspec.Struct, tag=True):
    """Intake -> conductor: a client asked this intake for ``/metrics``; answered by ``MetricsText``."""

    ask: int
    counts: HttpCounts


class MetricsText(msgspec.Struct, tag=True):
    """Conductor -> intake: the runtime's metrics and every intake's HTTP metrics, as Prometheus text."""

    ask: int
    text: str


class Health(msgspec.Struct, tag=True):
    """Conductor -> intake: whether the deployment serves (``/health``); sent at start and on every change."""

    serving: bool
    reason: str


class Outputs(msgspec.Struct, tag=True):
    """Conductor -> intake: every event produced for that intake's requests since the last ``Outputs`` (one message
    per turn of the conductor's loop, not one per token): (request id, event), in order. The events are
    ``mstar_dist/events.py``'s own (``to_wire`` / ``from_wire``)."""

    items: list[tuple[str, WireEvent]]


Message = Union[
    RunWalk, Push, RemoveRequest, Shutdown, Heartbeat, RankDown, AbortPair, TensorDesc, TransferAck,
    NodeDone, StreamItems, StreamEnd, TPStep, TPEnd, TPPush, Emit, Emits, WalkDone, Ready, LoadFailed, Leaving, Stats,
    Rejoin, Repair, Repaired,
    Submit, Cancel, HttpCounts, MetricsAsk, MetricsText, Health, Outputs,
]


class Envelope(msgspec.Struct):
    token: str
    """The launch's secret (drawn by the conductor's rank, shared through the torchrun store); an envelope
    without it is dropped and counted."""
    sender: str
    body: Message


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)


def encode(token: str, sender: str, body: Message) -> bytes:
    return _encoder.encode(Envelope(token=token, sender=sender, body=body))


def decode(payload: bytes) -> Envelope:
    """Raises ``msgspec.DecodeError`` / ``ValidationError`` for bytes that are not an envelope."""
    return _decoder.decode(payload)
