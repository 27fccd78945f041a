"""Composite-model benchmarks on real deployments, side by side in one run: streaming speech (Orpheus shape) with
the codec beside the LLM or on another GPU, and Qwen-Image's CFG image generation sequential on one GPU or
CFG-parallel.

    python scripts/bench_composite.py speech --weights DIR [--streams 1 8 32] [--max-tokens 560] --out JSON
        [--placement both|colocated|split] [--tokens-at 256:280 ...] [--intakes K] [--budget-s S]
    python scripts/bench_composite.py image --weights DIR [--size 1024] [--steps 8 24] --out JSON

speech: for each placement (``launch/configs/speech_single.yaml`` on 1 device, ``speech_split.yaml`` on 2) and each
concurrency N, N clients stream ``/generate`` at once (greedy-free sampling with a pinned seed per client, the
same ``--max-tokens`` codes each): time to first audio (p50, p99) and real-time factor per stream (seconds of
wall time per second of audio produced; < 1 is faster than real time), plus whether both placements gave the same
audio bytes for the same pinned requests. Per concurrency also the p99 RTF, the p99 playback stall and whether it
stays real time (every stream's RTF <= 1 and TTFA p99 <= 300 ms); per placement the largest such concurrency.
``--tokens-at N:T`` gives fewer codes per stream at high concurrencies (a wave's time grows with both), recorded in
the JSON's ``tokens_at``; the JSON is rewritten after every wave, so a run cut short keeps what it measured.
image: ``image_single.yaml`` (sequential CFG: both branch forwards one after the other on one device) against a
two-rank CFG-parallel placement (main loop + conditional branch on rank 0, unconditional branch on rank 1): time
per denoising step = the slope of request time between two step counts (so text encoding, VAE and HTTP cancel),
the whole request at each step count (``request_s``; at the larger one, CFG-parallel over sequential end to end), the
same pinned request's PNG bytes on both, and each rank's edge bytes and host-staging copies from /metrics.
Weights: any directory of the family's layout (real or random; ``--make tiny|3b`` / ``--make tiny|1b`` writes a
random one first; Qwen-Image: ``--make tiny`` or ``--make full``, the published denoiser and VAE, ~41 GB drawn on
the GPU). Device: whatever torch sees (one process per GPU).
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures as cf
import contextlib
import hashlib
import json
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e.server import Server, per_rank  # noqa: E402

TEXTS = ["The lighthouse keeper climbed the spiral stairs every evening at dusk.",
         "In the morning the village woke slowly, and the baker opened her shutters first.",
         "Children ran along the sea wall, counting the boats that had come home.",
         "He wound the clockwork, trimmed the wick and polished the great lens."]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


REALTIME_TTFA_P99_S = 0.3
"""A concurrency stays real time when every stream's RTF is <= 1 and the p99 time to first audio is within this."""
PLACEMENTS = {"colocated": ("codec_colocated", "launch/configs/speech_single.yaml", 1),
              "split": ("codec_other_gpu", "launch/configs/speech_split.yaml", 2)}
"""--placement value -> (name in the JSON, deployment, ranks)."""


LIVE: list[Server] = []
"""Deployments running now: stopped by SIGTERM's handler (a time limit's ``timeout``) before the process exits, so
no rank outlives the benchmark and holds the device for the next step."""


def stop_live_and_exit(signum, frame) -> None:
    for server in list(LIVE):
        server.stop(timeout=10)
    os._exit(128 + signum)


def speech_request(base_url: str, i: int, max_tokens: int) -> dict:
    """One streaming /generate speech request: time to first audio, total time, audio seconds, audio digest, and the
    playback stall: a listener who starts at the first chunk and plays each chunk when it has both arrived and the
    audio before it has played waits this long in all (0: the stream never ran dry)."""
    body = {"prompt": TEXTS[i % len(TEXTS)], "stream": True,
            "model_kwargs": {"voice": "tara", "max_tokens": max_tokens, "seed": 1000 + i, "temperature": 0.6,
                             "top_p": 0.95}}
    t0 = time.perf_counter()
    first, pcm, rate, chunks = None, bytearray(), 24000, []
    with httpx.stream("POST", f"{base_url}/generate", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.strip():
                continue
            item = json.loads(line)
            if item["modality"] == "error":
                raise RuntimeError(item["metadata"])
            if item["modality"] == "audio":
                now = time.perf_counter() - t0
                first = first if first is not None else now
                data = base64.b64decode(item["data"])
                pcm += data
                rate = item["metadata"].get("sample_rate", rate)
                chunks.append((now, len(data) / 2 / rate))
    total = time.perf_counter() - t0
    audio_s = len(pcm) / 2 / rate
    return {"ttfa_s": first, "seconds": total, "audio_s": audio_s, "rtf": total / audio_s if audio_s else None,
            "stall_s": playback_stall(chunks), "sha256": hashlib.sha256(bytes(pcm)).hexdigest()}


def playback_stall(chunks: list[tuple[float, float]]) -> float:
    """Total wait of a player fed (arrival time, audio seconds) chunks in order, starting at the first arrival."""
    clock, stall = None, 0.0  # clock: when the audio received so far finishes playing
    for arrived, seconds in chunks:
        if clock is not None and arrived > clock:
            stall += arrived - clock
        clock = max(clock if clock is not None else arrived, arrived) + seconds
    return stall


def speech_wave(base_url: str, n: int, max_tokens: int) -> dict:
    """N clients at once, one request each: the row of this concurrency in the JSON."""
    with cf.ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda i: speech_request(base_url, i, max_tokens), range(n)))
    ttfa = [r["ttfa_s"] if r["ttfa_s"] is not None else float("inf") for r in results]
    rtf = [r["rtf"] if r["rtf"] is not None else float("inf") for r in results]
    row = {"max_tokens": max_tokens, "ttfa_p50_s": pct(ttfa, 0.5), "ttfa_p99_s": pct(ttfa, 0.99),
           "rtf_p50": pct(rtf, 0.5), "rtf_p99": pct(rtf, 0.99), "rtf_max": max(rtf),
           "stall_s_p99": pct([r["stall_s"] for r in results], 0.99),
           "audio_s_per_stream": statistics.median(r["audio_s"] for r in results),
           "streams_real_time": sum(1 for r in rtf if r <= 1.0)}
    row["real_time"] = row["rtf_max"] <= 1.0 and row["ttfa_p99_s"] <= REALTIME_TTFA_P99_S
    row["digests"] = [r["sha256"] for r in results]
    return row


def tokens_at(args, n: int) -> int:
    """The codes per stream at concurrency n: ``--tokens-at N:T`` where given, else ``--max-tokens``."""
    return dict(args.tokens_at).get(n, args.max_tokens)


def serve_speech(args, name: str, config: str, nproc: int, out: dict, save) -> dict:
    """One placement: every concurrency of --streams in turn (those past --budget-s skipped, and said so)."""
    top = max(args.streams)
    overrides = {"weights": args.weights, "engine": {"max_seq_len": 1024, "max_batch": top},
                 "limits": {"max_concurrent_requests": top, "max_queued_requests": max(256, top),
                            "request_timeout_s": 600, "max_tokens": max(700, args.max_tokens)}}
    flags = ("--http-processes", str(args.intakes)) if args.intakes > 1 else ()
    server = Server(REPO / config, nproc=nproc, overrides=overrides, args=flags, startup_timeout=600)
    LIVE.append(server)
    rows = out["placements"][name] = {"cold_start_s": server.ready_seconds, "intakes": args.intakes}
    save()
    try:
        speech_request(server.base_url, 0, 28)  # warm the route
        for n in args.streams:
            if args.budget_s and time.perf_counter() - args.started > args.budget_s:
                rows.setdefault("skipped", []).append(n)
                continue
            rows[f"streams_{n}"] = speech_wave(server.base_url, n, tokens_at(args, n))
            print(name, n, {k: v for k, v in rows[f"streams_{n}"].items() if k != "digests"}, flush=True)
            save()
        rows["edge_bytes_sent"] = per_rank(server.base_url, "mstar_dist_edge_bytes_sent_total")
    except Exception:
        print(server.log()[-6000:], flush=True)
        raise
    finally:
        server.stop()
        LIVE.remove(server)
    real = [n for n in args.streams if rows.get(f"streams_{n}", {}).get("real_time")]
    rows["real_time_streams"] = max(real, default=0)
    return rows


def bench_speech(args, save=lambda: None, out: dict | None = None) -> dict:
    """Every chosen placement; ``out`` (filled in place, so ``save`` sees each wave) is returned."""
    chosen = [PLACEMENTS[p] for p in (("colocated", "split") if args.placement == "both" else (args.placement,))]
    out = out if out is not None else {}
    out.update({"placements": {}, "real_time_rule": f"every stream's RTF <= 1 and TTFA p99 <= "
                                                      f"{REALTIME_TTFA_P99_S} s; one request per stream per wave",
                "tokens_at": {str(n): tokens_at(args, n) for n in args.streams}})
    for name, config, nproc in chosen:
        serve_speech(args, name, config, nproc, out, save)
    if len(chosen) == 2:
        a, b = (out["placements"][name] for name, _, _ in chosen)
        out["same_audio_split_vs_colocated"] = all(a.get(f"streams_{n}", {}).get("digests") ==
                                                   b.get(f"streams_{n}", {}).get("digests") for n in args.streams)
    return out


def image_request(base_url: str, size: int, steps: int, seed: int) -> tuple[float, str]:
    body = {"prompt": "a lighthouse on a cliff at dusk", "model_kwargs": {
        "width": size, "height": size, "steps": steps, "guidance_scale": 4.0, "seed": seed}}
    t0 = time.perf_counter()
    r = httpx.post(f"{base_url}/generate", json=body, timeout=900)
    r.raise_for_status()
    png = base64.b64decode(next(o["data"] for o in r.json()["outputs"] if o["modality"] == "image"))
    return time.perf_counter() - t0, hashlib.sha256(png).hexdigest()


def bench_image(args) -> dict:
    placements = {"sequential_cfg_1gpu": ("launch/configs/image_single.yaml", 1),
                  "cfg_parallel_2gpu": ("launch/configs/image_cfg_parallel_2gpu.yaml", 2)}
    out: dict = {"placements": {}}
    lo, hi = args.steps
    for name, (config, nproc) in placements.items():
        server = Server(REPO / config, nproc=nproc, startup_timeout=600, overrides={
            "weights": args.weights, "model_kwargs": {"max_size": args.size, "default_size": "64x64"}})
        try:
            image_request(server.base_url, args.size, 2, 0)  # warm up kernels at this size
            times = {s: [] for s in (lo, hi)}
            digest = None
            for _ in range(args.rounds):
                for steps in (lo, hi):
                    seconds, digest_now = image_request(server.base_url, args.size, steps, 7)
                    times[steps].append(seconds)
                    digest = digest_now if steps == hi else digest
            med = {s: statistics.median(v) for s, v in times.items()}
            out["placements"][name] = {
                "step_ms": 1000 * (med[hi] - med[lo]) / (hi - lo), "request_s": med, "png_sha256": digest,
                "edge_bytes_sent": per_rank(server.base_url, "mstar_dist_edge_bytes_sent_total"),
                "host_staging_copies": per_rank(server.base_url, "mstar_dist_host_staging_copies_total"),
            }
            print(name, out["placements"][name], flush=True)
        except Exception:
            print(server.log()[-6000:], flush=True)
            raise
        finally:
            server.stop()
    seq, par = (out["placements"][p] for p in placements)
    out["step_speedup_cfg_parallel"] = seq["step_ms"] / par["step_ms"]
    out["image_s_cfg_parallel_over_sequential"] = par["request_s"][hi] / seq["request_s"][hi]  # end to end, hi steps
    out["same_png_parallel_vs_sequential"] = seq["png_sha256"] == par["png_sha256"]
    return out


def write_random_on_device(path: Path, shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, seed: int,
                           device: str = "cuda") -> None:
    """``models.speech.checkpoint.write_random_safetensors``'s file (same header and layout, same distribution: 1-D
    tensors ones, the rest N(0, 0.02)) with the values drawn on ``device``, one tensor at a time: drawing the 3B
    shape's 3.3 billion values on one CPU core takes minutes of a time-limited device run. Other values than the
    CPU writer's for the same seed."""
    import math
    import struct

    st_dtype, itemsize = {torch.float32: ("F32", 4), torch.bfloat16: ("BF16", 2)}[dtype]
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes:
        nbytes = math.prod(shape) * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    gen = torch.Generator(device=device).manual_seed(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, shape in shapes:
            t = torch.ones(shape, dtype=dtype) if len(shape) == 1 else \
                torch.randn(shape, generator=gen, device=device).mul_(0.02).to(dtype).cpu()
            f.write((t.view(torch.int16) if dtype == torch.bfloat16 else t).numpy().tobytes())


def make_checkpoint(args, device: str | None = None) -> None:
    """``--make``: a random checkpoint of the family's layout in ``--weights``; a speech LLM's values drawn on
    ``device`` (default: the GPU where there is one, else the CPU writer of models/speech/checkpoint.py)."""
    import functools
    from unittest import mock

    if args.what == "image":
        from models.qwen_image.checkpoint import make_qwen_image_checkpoint
        if args.make not in ("tiny", "full"):
            raise SystemExit(f"--make {args.make}: Qwen-Image's random checkpoint comes in two sizes, tiny and full")
        return make_qwen_image_checkpoint(Path(args.weights), seed=0, size=args.make,
                                          device=device or ("cuda" if torch.cuda.is_available() else "cpu"))
    import models.speech.checkpoint as speech

    device = device or ("cuda" if torch.cuda.is_available() else None)
    writer = mock.patch.object(speech, "write_random_safetensors",
                               functools.partial(write_random_on_device, device=device)) \
        if device else contextlib.nullcontext()
    with writer:
        speech.write_speech_family(Path(args.weights), args.make, 0)


def stream_tokens(text: str) -> tuple[int, int]:
    """``N:T`` of ``--tokens-at``."""
    n, _, t = text.partition(":")
    try:
        return int(n), int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens-at takes STREAMS:TOKENS, got {text!r}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["speech", "image"])
    p.add_argument("--weights", required=True)
    p.add_argument("--make", default=None, help="write a random checkpoint of this size to --weights first")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=560)
    p.add_argument("--tokens-at", type=stream_tokens, nargs="+", default=[], metavar="STREAMS:TOKENS",
                   help="speech: fewer (or more) codes per stream at these concurrencies, e.g. 128:280 256:280")
    p.add_argument("--placement", choices=["both", *PLACEMENTS], default="both",
                   help="speech: the codec beside the LLM (colocated, one GPU), on the other GPU (split), or both")
    p.add_argument("--intakes", type=int, default=1, help="speech: HTTP intake processes (server.http_processes)")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="speech: skip the concurrencies that would start this many seconds after the start (0: none)")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, nargs=2, default=[8, 24])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if any(n < 1 for n in args.streams) or any(n < 1 or t < 1 for n, t in args.tokens_at):
        p.error("--streams and --tokens-at take positive numbers")
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, stop_live_and_exit)
    args.started = t0 = time.perf_counter()
    if args.make and not Path(args.weights, "config.json").exists():
        make_checkpoint(args)
        print(f"random {args.make} checkpoint written in {time.perf_counter() - t0:.0f} s", flush=True)
    meta = dict(command=" ".join(sys.argv), device=torch.cuda.get_device_name(0) if torch.cuda.is_available()
                else platform.processor() or "cpu", gpus=torch.cuda.device_count(), torch=torch.__version__)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    partial: dict = {}

    def save() -> None:  # after every speech wave, so a run stopped by its time limit keeps what it measured
        Path(args.out).write_text(json.dumps({**partial, **meta}, indent=2) + "\n")

    if args.what == "speech":
        partial["placements"] = {}
        result = bench_speech(args, save, partial)
    else:
        result = bench_image(args)
    result.update(meta)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "placements"}, indent=2))


if __name__ == "__main__":
    main()
