"""Edge-transfer benchmark: every data-plane transport vs raw `dist.send/recv` on gloo (or NCCL), side by side.

    torchrun --standalone --nproc-per-node 2 scripts/bench_edges.py --device cpu    # gloo, shm, mooncake
    torchrun --standalone --nproc-per-node 2 scripts/bench_edges.py --device cuda   # NCCL (p2p only by default)
    # two hosts (e.g. the network-namespace rig): torchrun --nnodes 2 --node-rank K --master-addr A ... on each

"raw" is `dist.send` / `dist.recv` on the pair groups with the shape known in advance and one reused buffer;
"raw_fresh" the same with a new receive buffer each time (as a real receive allocates), which separates
allocation cost (page faults on CPU, ~nothing with CUDA's caching allocator) from protocol cost. Every other
path is what the runtime does per edge on that transport (transport/base.py): `post_send`, the descriptor
(`WireTensor` in a control message on the control channel: its local link on one machine, ZMQ between machines), `post_recv` on the consumer, completion seen by
polling `done()`, and for the arena transports the consumer's `TransferAck` when it lets the tensor go:
- p2p: the directed pair groups (gloo for host tensors, NCCL for CUDA ones);
- shm: the producer copies into its /dev/shm arena, the consumer wraps the bytes (no copy);
- mooncake: the Mooncake transfer engine over tcp (P2PHANDSHAKE), the consumer reads one-sided;
- inline (up to 1 MiB): the tensor's bytes inside the control message, what the runtime does up to
  transport.inline_max_bytes (64 KiB by default), so the 4 KiB row's real path.

One-way time = half a ping-pong measured on rank 0 (0 -> 1, and back: rank 1 sends what it received), so no
clock is shared between ranks and the number also holds across hosts. The paths alternate sample by sample, so
drift hits all alike; an untimed barrier starts every sample, so no path is charged for the previous one's tail
on the other rank. Up to 1 MiB a sample is the mean of a burst of `--burst` ping-pongs back to back (as OSU's
latency test loops): one ping-pong there is tens of microseconds, about what the ranks' skew leaving the barrier
costs, which would otherwise be timed as latency. Prints a table and writes JSON (medians, GB/s, ratios over raw,
versions, device names, command line). Not a timed test: ratios only mean something measured in one run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mstar_dist.config.deployment import TransportConfig  # noqa: E402
from mstar_dist.control import messages as m  # noqa: E402
from mstar_dist.control.channel import ControlChannel, default_store, lookup_endpoint, publish_endpoint  # noqa: E402
from mstar_dist.distributed.groups import create_pair_groups, warm_pairs  # noqa: E402
from mstar_dist.distributed.init import backend_for_device, init_distributed, shutdown_distributed  # noqa: E402
from mstar_dist.transport.base import ArenaFull, DataPlane  # noqa: E402
from mstar_dist.transport.inline import decode_tensor, dtype_to_str, encode_tensor  # noqa: E402
from mstar_dist.transport.p2p import P2PTransport, Transfer  # noqa: E402

SIZES = [("4 KiB", 4 << 10), ("1 MiB", 1 << 20), ("16 MiB", 16 << 20), ("64 MiB", 64 << 20), ("256 MiB", 256 << 20)]


TOKEN = "bench-edges"


class Host(msgspec.Struct):
    rank: int
    host: str
    device: str
    device_name: str


_enc = msgspec.msgpack.Encoder()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], required=True)
    p.add_argument("--iters", type=int, default=20,
                   help="timed ping-pongs per size and path (5x that for sizes up to 1 MiB, which are cheap and noisy)")
    p.add_argument("--warmup", type=int, default=3, help="untimed samples per size and path")
    p.add_argument("--burst", type=int, default=10, help="ping-pongs per sample for sizes up to 1 MiB")
    p.add_argument("--max-bytes", type=int, default=256 << 20, help="skip sizes above this")
    p.add_argument("--bind-addr", default=None, help="control-socket address (default: the address that "
                   "routes to MASTER_ADDR, 127.0.0.1 on one host)")
    p.add_argument("--transports", default=None,
                   help="comma-separated subset of p2p,shm,mooncake (default: all three on cpu, p2p on cuda)")
    p.add_argument("--arena-bytes", type=int, default=None,
                   help="shm arena / Mooncake pool per rank (default: twice the largest size)")
    p.add_argument("--window", type=int, default=None,
                   help="bandwidth: transfers per sample sent back to back before one acknowledgement, for sizes "
                        "from 1 MiB (default 8 on cuda, 0 = no bandwidth rows on cpu)")
    p.add_argument("--spin-us", type=float, default=None,
                   help="a receiver waiting for a descriptor polls without blocking this long before it blocks "
                        "(default: what a rank of this device does, transport.spin_us: 200 on cuda, 0 on cpu)")
    p.add_argument("--out", default=None, help="JSON path (default bench/raw/edges_<device>.json)")
    return p.parse_args(argv)


def _route_addr(master: str) -> str:
    if master in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent
        s.connect((master, 9))
        return s.getsockname()[0]


class Bench:
    def __init__(self, rank: int, device: str, channel: ControlChannel, planes: dict[str, DataPlane], groups) -> None:
        self.rank, self.peer = rank, 1 - rank
        self.device = torch.device(device)
        self.channel, self.planes = channel, planes
        self.out_group = groups[(rank, self.peer)].group
        self.in_group = groups[(self.peer, rank)].group
        self._wires: list = []  # descriptors (and inline values) from the peer, in order
        self.inline_max_bytes = 1 << 20  # the inline path is measured up to this size
        self.other: list[bytes] = []
        self.spin_s = 0.0
        self.ack = torch.zeros(1, device=self.device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # raw: the shape is known on both sides; NCCL ops return at enqueue, so rank 0 syncs before stopping time
    def raw_once(self, buf: torch.Tensor) -> None:
        if self.rank == 0:
            dist.send(buf, group=self.out_group, group_dst=1)
            dist.recv(buf, group=self.in_group, group_src=1)
            self._sync()
        else:
            dist.recv(buf, group=self.in_group, group_src=0)
            dist.send(buf, group=self.out_group, group_dst=0)

    # raw_fresh: raw with a freshly allocated receive buffer, as a real receive allocates one per transfer. It
    # splits a transport's cost into allocation (page faults on CPU; ~free with CUDA's caching allocator) and protocol.
    def raw_fresh_once(self, buf: torch.Tensor) -> None:
        if self.rank == 0:
            dist.send(buf, group=self.out_group, group_dst=1)
            dist.recv(torch.empty_like(buf), group=self.in_group, group_src=1)
            self._sync()
        else:
            got = torch.empty_like(buf)
            dist.recv(got, group=self.in_group, group_src=0)
            dist.send(got, group=self.out_group, group_dst=0)

    # -- the runtime's path on one transport --------------------------------------------------------------------
    def _hand_back(self) -> None:
        """What the worker's loop does each turn: hand back the slots we let go and free the ones handed back to
        us (through the shm rings, or as acknowledgements that we send here)."""
        for plane in self.planes.values():
            for peer, ack in plane.poll():
                self.channel.send(f"rank{peer}", m.encode(TOKEN, f"rank{self.rank}", ack))

    def _pump(self, timeout_ms: int = 0) -> None:
        """Hand back, apply the acks we are owed, keep descriptors for `_recv`."""
        self._hand_back()
        for _, payload in self.channel.recv(timeout_ms):
            try:
                body = m.decode(payload).body
            except msgspec.ValidationError:  # the peer's host report (it may finish first)
                self.other.append(payload)
                continue
            if isinstance(body, m.TransferAck):
                self.planes[body.via].on_ack(self.peer, body)
            else:
                self._wires.extend(body.values)

    def _send(self, plane: DataPlane, t: torch.Tensor):
        deadline = time.monotonic() + 60
        while True:
            try:
                transfer, at = plane.post_send(t, self.peer)
                break
            except ArenaFull:
                if time.monotonic() > deadline:
                    raise
                self._pump(1)
        wire = m.WireTensor(shape=list(t.shape), dtype=dtype_to_str(t.dtype), host=t.device.type == "cpu",
                            via=plane.name, at=at)
        self.channel.send(f"rank{self.peer}", m.encode(TOKEN, f"rank{self.rank}",
                                                         m.StreamItems(request_id="bench", signal=plane.name,
                                                                       values=[wire])))
        plane.flush()  # p2p issues the send only now: the descriptor travels ahead of the bytes
        return transfer

    def _wait_wire(self) -> None:
        """Until a descriptor from the peer is here: poll without blocking for up to ``--spin-us``, then block
        in the channel's poll (1 ms at a time)."""
        spin_until = time.perf_counter() + self.spin_s
        while not self._wires:
            self._pump(0 if time.perf_counter() < spin_until else 1)

    def _recv(self, plane: DataPlane) -> torch.Tensor:
        self._wait_wire()
        transfer = plane.post_recv(self._wires.pop(0), self.peer)
        self._wait(transfer)
        return transfer.tensor

    def _wait(self, transfer) -> None:
        if isinstance(transfer, Transfer):  # p2p: block in the transfer itself, as the old bench did
            transfer.wait(300)
            return
        while not transfer.done():  # arena transports: poll, letting acknowledgements in
            self._pump(0)
            time.sleep(20e-6)

    def inline_once(self, buf: torch.Tensor) -> None:
        """The tensor inside the control message (what the runtime does up to transport.inline_max_bytes)."""
        def send(t: torch.Tensor) -> None:
            self.channel.send(f"rank{self.peer}", m.encode(TOKEN, f"rank{self.rank}", m.StreamItems(
                request_id="bench", signal="inline", values=[encode_tensor(t)])))

        def recv() -> torch.Tensor:
            self._wait_wire()
            return decode_tensor(self._wires.pop(0), self.device)

        if self.rank == 0:
            send(buf)
            recv()
        else:
            send(recv())

    def ours_once(self, name: str, buf: torch.Tensor) -> None:
        plane = self.planes[name]
        if self.rank == 0:
            out = self._send(plane, buf)
            got = self._recv(plane)
            self._wait(out)
            self._sync()
        else:
            got = self._recv(plane)
            self._wait(self._send(plane, got))
        del got  # the arena slot goes back now (acknowledgements by message are read on the next pump)
        self._hand_back()

    # -- bandwidth: a window of transfers one way, then one small acknowledgement back (as OSU's bandwidth test) --
    def _ack_back(self) -> None:
        if self.rank == 0:
            dist.recv(self.ack, group=self.in_group, group_src=1)
            self._sync()
        else:
            dist.send(self.ack, group=self.out_group, group_dst=0)

    def raw_window(self, buf: torch.Tensor, window: int) -> None:
        if self.rank == 0:
            works = [dist.isend(buf, group=self.out_group, group_dst=1) for _ in range(window)]
        else:
            works = [dist.irecv(buf, group=self.in_group, group_src=0) for _ in range(window)]
        for work in works:
            work.wait()
        self._ack_back()

    def ours_window(self, name: str, buf: torch.Tensor, window: int) -> None:
        """``window`` tensors 0 -> 1 on the runtime's path, the receiver posting each receive as its descriptor
        arrives (the runtime's order), then waiting for every one on the host before the acknowledgement."""
        plane = self.planes[name]
        if self.rank == 0:
            outs = [self._send(plane, buf) for _ in range(window)]
            for out in outs:
                self._wait(out)
        else:
            pending, received = [], 0
            while received < window:
                self._wait_wire()
                while self._wires and received < window:
                    transfer = plane.post_recv(self._wires.pop(0), self.peer)
                    received += 1
                    if not transfer.done():  # an arena tensor is there at once: let it go, its slot goes back
                        pending.append(transfer)
            for transfer in pending:
                self._wait(transfer)
            del pending, transfer
        self._ack_back()
        self._hand_back()

    def measure_window(self, nbytes: int, iters: int, warmup: int, window: int) -> dict:
        """Per-transfer time and GB/s of a window of ``window`` back-to-back transfers, raw and every transport."""
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=self.device)
        self._sync()
        paths = {"raw": lambda b: self.raw_window(b, window)}
        paths.update({name: (lambda b, _n=name: self.ours_window(_n, b, window)) for name in self.planes})
        samples: dict[str, list[float]] = {name: [] for name in paths}
        for i in range(warmup + iters):
            for name, fn in paths.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn(buf)
                if i >= warmup:
                    samples[name].append((time.perf_counter() - t0) / window)
        return {name: _summary(s, nbytes) for name, s in samples.items()}

    def measure(self, nbytes: int, iters: int, warmup: int, burst: int = 1) -> dict:
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=self.device)
        self._sync()
        paths = {"raw": self.raw_once, "raw_fresh": self.raw_fresh_once}
        paths.update({name: (lambda b, _n=name: self.ours_once(_n, b)) for name in self.planes})
        if nbytes <= self.inline_max_bytes:
            paths["inline"] = self.inline_once
        samples: dict[str, list[float]] = {name: [] for name in paths}
        for i in range(warmup + iters):
            for name, fn in paths.items():
                # both ranks start each ping-pong together: the rank that finished the previous path's work later
                # (an acknowledgement, a waiter thread) must not be timed as this path's latency
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(burst):
                    fn(buf)
                if i >= warmup:
                    samples[name].append((time.perf_counter() - t0) / 2 / burst)
        return {name: _summary(s, nbytes) for name, s in samples.items()}


def _summary(one_way_s: list[float], nbytes: int) -> dict:
    med = statistics.median(one_way_s)
    ordered = sorted(one_way_s)
    return {
        "median_us": med * 1e6,
        "gbps": nbytes / med / 1e9,
        "min_us": ordered[0] * 1e6,
        "p25_us": ordered[len(ordered) // 4] * 1e6,
        "samples_us": [round(x * 1e6, 1) for x in one_way_s],
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cpus)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _host_info(rank: int, device: str) -> Host:
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else _cpu_name()
    return Host(rank, socket.gethostname(), device, name)


def build_planes(names: list[str], rank: int, device: str, groups, host_addr: str, arena_bytes: int) -> dict:
    planes: dict[str, DataPlane] = {}
    for name in names:
        if name == "p2p":
            planes[name] = P2PTransport(rank, groups, device)
        elif name == "shm":
            from mstar_dist.transport.shm import ShmTransport, sweep_orphans

            sweep_orphans()
            planes[name] = ShmTransport(rank, launch_id=f"bench{os.getpid()}", arena_bytes=arena_bytes, device=device)
        elif name == "mooncake":
            from mstar_dist.transport.mooncake import MooncakeTransport

            planes[name] = MooncakeTransport(rank, host_addr=host_addr, protocol="tcp", arena_bytes=arena_bytes,
                                             device=device)
        else:
            raise ValueError(f"unknown transport {name!r}: expected p2p, shm or mooncake")
    return planes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 2:
        raise ValueError(f"bench_edges needs exactly 2 ranks, got WORLD_SIZE={world}")
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if args.device == "cuda" else "cpu"
    names = (args.transports or ("p2p,shm,mooncake" if args.device == "cpu" else "p2p")).split(",")
    sizes = [(label, n) for label, n in SIZES if n <= args.max_bytes]
    arena = args.arena_bytes or 2 * max(n for _, n in sizes)
    channel = None
    planes: dict[str, DataPlane] = {}
    try:
        init_distributed(global_rank=rank, world_size=world, device=device, timeout_s=600)
        groups = create_pair_groups([(0, 1), (1, 0)], global_rank=rank, backend=backend_for_device(device),
                                    timeout_s=600)
        warm_pairs(groups, rank, device)
        addr = args.bind_addr or _route_addr(os.environ["MASTER_ADDR"])
        planes = build_planes(names, rank, device, groups, addr, arena)
        channel = ControlChannel(f"rank{rank}", addr)
        store = default_store()
        publish_endpoint(store, f"rank{rank}", channel.endpoint)
        channel.connect(f"rank{1 - rank}", lookup_endpoint(store, f"rank{1 - rank}", 120))
        bench = Bench(rank, device, channel, planes, groups)
        bench.spin_s = TransportConfig().spin_s(args.device) if args.spin_us is None else args.spin_us * 1e-6
        window = args.window if args.window is not None else (8 if args.device == "cuda" else 0)
        results = []
        for label, nbytes in sizes:
            small = nbytes <= 1 << 20
            r = bench.measure(nbytes, args.iters * (5 if small else 1), args.warmup, args.burst if small else 1)
            r.update(size=label, bytes=nbytes, paths=[p for p in ("raw", "raw_fresh", *planes, "inline") if p in r])
            for name in r["paths"][1:]:
                r[f"ratio_{name}_over_raw"] = r[name]["median_us"] / r["raw"]["median_us"]
            if window and nbytes >= 1 << 20:
                bw = bench.measure_window(nbytes, args.iters, args.warmup, window)
                r["window"] = {"transfers_per_sample": window, **bw,
                               **{f"ratio_{name}_bandwidth_over_raw": bw["raw"]["median_us"] / bw[name]["median_us"]
                                  for name in planes}}
            results.append(r)
            if rank == 0:
                print(f"{label:>8}  " + "   ".join(
                    f"{name} {r[name]['median_us']:9.1f} us {r[name]['gbps']:6.2f} GB/s"
                    for name in r["paths"]), flush=True)
                if "window" in r:
                    print(f"{'':>8}  window of {window}: " + "   ".join(
                        f"{name} {r['window'][name]['median_us']:9.1f} us {r['window'][name]['gbps']:6.2f} GB/s"
                        for name in ("raw", *planes)), flush=True)
        _report(args, rank, device, channel, planes, results, bench.other, bench.spin_s)
    finally:
        for plane in planes.values():
            plane.close()
        if channel is not None:
            channel.close()
        shutdown_distributed()
    return 0


def _command_line() -> str:
    argv = " ".join(sys.argv[1:])
    script = os.path.relpath(sys.argv[0], REPO)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun
        nnodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
        return f"torchrun --nnodes {nnodes} --nproc-per-node {os.environ['LOCAL_WORLD_SIZE']} {script} {argv}"
    return f"python {script} {argv}"


def _report(args, rank: int, device: str, channel: ControlChannel, planes: dict, results, early: list,
            spin_s: float) -> None:
    me = _host_info(rank, device)
    if rank == 1:
        channel.send("rank0", _enc.encode(me))
        time.sleep(0.2)  # let it leave before the channel closes
        return
    peer, deadline = None, time.monotonic() + 60
    while peer is None:  # late acknowledgements may come first
        if time.monotonic() > deadline:
            raise TimeoutError("rank 1's host report did not arrive within 60 s")
        for payload in early + [p for _, p in channel.recv(timeout_ms=1000)]:
            try:
                peer = msgspec.msgpack.decode(payload, type=Host)
            except msgspec.ValidationError:
                continue
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else None
    stats = {name: plane.stats() for name, plane in planes.items()}
    doc = {
        "benchmark": "edges",
        "device": args.device,
        "backend": backend_for_device(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": _command_line(),
        "torch": torch.__version__,
        "nccl": nccl,
        "python": platform.python_version(),
        "ranks": [msgspec.to_builtins(me), msgspec.to_builtins(peer)],
        "iters": args.iters,
        "iters_up_to_1MiB": args.iters * 5,
        "warmup": args.warmup,
        "burst_up_to_1MiB": args.burst,
        "method": "one-way = median over samples of half a ping-pong on rank 0 (up to 1 MiB a sample is the mean of "
                  "a burst of ping-pongs); raw, raw_fresh and every transport alternate per sample, each sample "
                  "after an untimed barrier; a transport's path is post_send + descriptor on the control channel "
                  "(its local link on one machine, else ZMQ) + post_recv + done(), arena slots acknowledged on "
                  "the control channel; `window` rows: per-transfer time of a window of back-to-back transfers one "
                  "way then one acknowledgement back (raw: isend/irecv; a transport: its path, each receive posted "
                  "as its descriptor arrives, every one waited on the host), as OSU's bandwidth test",
        "spin_us": round(spin_s * 1e6, 1),
        "load_average": os.getloadavg(),
        "results": results,
        "rank0_transport_stats": stats,
    }
    # Mooncake moves host memory only: on CUDA our transport stages every tensor through its pool (counted)
    assert all(st["host_staging_copies"] == 0 for name, st in stats.items()
               if not (name == "mooncake" and args.device == "cuda")), stats
    out = Path(args.out) if args.out else REPO / "bench" / "raw" / f"edges_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
