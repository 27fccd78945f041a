"""Edge-transfer benchmark: our p2p edge path vs raw `dist.send/recv` on the same pair groups, side by side.

    torchrun --standalone --nproc-per-node 2 scripts/bench_edges.py --device cuda   # NCCL, two GPUs
    torchrun --standalone --nproc-per-node 2 scripts/bench_edges.py --device cpu    # gloo

"ours" is what the runtime does per edge: a msgpack descriptor over the ZMQ ControlChannel, then
`P2PTransport.send` / `recv` on the directed pair group, completion seen by the consumer's `Transfer.wait`.
"raw" is `dist.send` / `dist.recv` on the same groups with the shape known in advance and one reused buffer;
"raw_fresh" is the same with a new receive buffer each time (as `recv` allocates), to separate allocation cost
(page faults on CPU, ~nothing with CUDA's caching allocator) from our protocol's cost.

One-way time = half a ping-pong measured on rank 0 (0 -> 1 on pair 0->1, back on pair 1->0), so no clock
is shared between ranks and the number also holds across hosts. The two paths alternate iteration by
iteration, so drift hits both alike. Prints a table and writes JSON (medians, GB/s, ratio ours/raw, versions,
device names, command line). Not a timed test: ratios only mean something measured in one run.
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

from mstar_dist.control.channel import ControlChannel, default_store, lookup_endpoint, publish_endpoint  # noqa: E402
from mstar_dist.distributed.groups import create_pair_groups, warm_pairs  # noqa: E402
from mstar_dist.distributed.init import backend_for_device, init_distributed, shutdown_distributed  # noqa: E402
from mstar_dist.transport.inline import dtype_to_str, str_to_dtype  # noqa: E402
from mstar_dist.transport.p2p import P2PTransport  # noqa: E402

SIZES = [("4 KiB", 4 << 10), ("1 MiB", 1 << 20), ("16 MiB", 16 << 20), ("64 MiB", 64 << 20), ("256 MiB", 256 << 20)]


class Desc(msgspec.Struct, array_like=True):
    """Same fields as the runtime's TensorDesc (control/messages.py) minus the request bookkeeping."""

    seq: int
    shape: list[int]
    dtype: str


class Host(msgspec.Struct):
    rank: int
    host: str
    device: str
    device_name: str


_enc = msgspec.msgpack.Encoder()
_desc_dec = msgspec.msgpack.Decoder(Desc)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], required=True)
    p.add_argument("--iters", type=int, default=20,
                   help="timed ping-pongs per size and path (5x that for sizes up to 1 MiB, which are cheap and noisy)")
    p.add_argument("--warmup", type=int, default=3, help="untimed ping-pongs per size and path")
    p.add_argument("--max-bytes", type=int, default=256 << 20, help="skip sizes above this")
    p.add_argument("--bind-addr", default=None, help="control-socket address (default: the address that "
                   "routes to MASTER_ADDR, 127.0.0.1 on one host)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/edges_<device>.json)")
    return p.parse_args(argv)


def _route_addr(master: str) -> str:
    if master in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent
        s.connect((master, 9))
        return s.getsockname()[0]


class Bench:
    def __init__(self, rank: int, device: str, channel: ControlChannel, transport: P2PTransport, groups) -> None:
        self.rank, self.peer = rank, 1 - rank
        self.device = torch.device(device)
        self.channel, self.transport = channel, transport
        self.out_group = groups[(rank, self.peer)].group
        self.in_group = groups[(self.peer, rank)].group
        self.seq = 0

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

    # raw_fresh: raw with a freshly allocated receive buffer, as `recv` allocates one per transfer. It splits
    # ours/raw into allocation cost (page faults on CPU; ~free with CUDA's caching allocator) and protocol cost.
    def raw_fresh_once(self, buf: torch.Tensor) -> None:
        if self.rank == 0:
            dist.send(buf, group=self.out_group, group_dst=1)
            dist.recv(torch.empty_like(buf), group=self.in_group, group_src=1)
            self._sync()
        else:
            got = torch.empty_like(buf)
            dist.recv(got, group=self.in_group, group_src=0)
            dist.send(got, group=self.out_group, group_dst=0)

    def _ours_send(self, t: torch.Tensor):
        self.channel.send(f"rank{self.peer}", _enc.encode(Desc(self.seq, list(t.shape), dtype_to_str(t.dtype))))
        self.seq += 1
        return self.transport.send(t, self.peer)

    def _ours_recv(self) -> torch.Tensor:
        while not (msgs := self.channel.recv(timeout_ms=1000)):
            pass
        (sender, payload), = msgs
        d = _desc_dec.decode(payload)
        return self.transport.recv(d.shape, str_to_dtype(d.dtype), self.peer).wait(300)

    def ours_once(self, buf: torch.Tensor) -> None:
        if self.rank == 0:
            out = self._ours_send(buf)
            self._ours_recv()
            out.wait(300)
        else:
            got = self._ours_recv()
            self._ours_send(got).wait(300)

    def measure(self, nbytes: int, iters: int, warmup: int) -> dict:
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=self.device)
        self._sync()
        paths = {"raw": self.raw_once, "raw_fresh": self.raw_fresh_once, "ours": self.ours_once}
        samples: dict[str, list[float]] = {name: [] for name in paths}
        for i in range(warmup + iters):
            for name, fn in paths.items():
                t0 = time.perf_counter()
                fn(buf)
                if i >= warmup:
                    samples[name].append((time.perf_counter() - t0) / 2)
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 2:
        raise ValueError(f"bench_edges needs exactly 2 ranks, got WORLD_SIZE={world}")
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if args.device == "cuda" else "cpu"
    channel = None
    try:
        init_distributed(global_rank=rank, world_size=world, device=device, timeout_s=600)
        groups = create_pair_groups([(0, 1), (1, 0)], global_rank=rank, backend=backend_for_device(device),
                                    timeout_s=600)
        warm_pairs(groups, rank, device)
        transport = P2PTransport(rank, groups, device)
        channel = ControlChannel(f"rank{rank}", args.bind_addr or _route_addr(os.environ["MASTER_ADDR"]))
        store = default_store()
        publish_endpoint(store, f"rank{rank}", channel.endpoint)
        channel.connect(f"rank{1 - rank}", lookup_endpoint(store, f"rank{1 - rank}", 120))
        bench = Bench(rank, device, channel, transport, groups)
        results = []
        for label, nbytes in SIZES:
            if nbytes > args.max_bytes:
                continue
            r = bench.measure(nbytes, args.iters * (5 if nbytes <= 1 << 20 else 1), args.warmup)
            r.update(size=label, bytes=nbytes,
                     ratio_ours_over_raw=r["ours"]["median_us"] / r["raw"]["median_us"],
                     ratio_ours_over_raw_fresh=r["ours"]["median_us"] / r["raw_fresh"]["median_us"])
            results.append(r)
            if rank == 0:
                print(f"{label:>8}  " + "   ".join(
                    f"{name} {r[name]['median_us']:9.1f} us {r[name]['gbps']:7.2f} GB/s" for name in
                    ("raw", "raw_fresh", "ours")) + f"   ours/raw {r['ratio_ours_over_raw']:.2f}"
                    f"   ours/raw_fresh {r['ratio_ours_over_raw_fresh']:.2f}", flush=True)
        _report(args, rank, device, channel, transport, results)
        transport.close()
    finally:
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


def _report(args, rank: int, device: str, channel: ControlChannel, transport: P2PTransport, results) -> None:
    me = _host_info(rank, device)
    if rank == 1:
        channel.send("rank0", _enc.encode(me))
        return
    while not (msgs := channel.recv(timeout_ms=10_000)):
        pass
    peer = msgspec.msgpack.decode(msgs[0][1], type=Host)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else None
    stats = transport.stats()
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
        "method": "one-way = median of half a ping-pong on rank 0; raw, raw_fresh and ours alternate per iteration",
        "load_average": os.getloadavg(),
        "results": results,
        "rank0_transport_stats": stats,
    }
    assert stats["host_staging_copies"] == 0, stats
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"edges_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
