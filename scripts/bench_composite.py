"""Composite-model benchmarks on real deployments, side by side in one run: streaming speech (Orpheus shape) with
the codec beside the LLM or on another GPU, and Qwen-Image's CFG image generation sequential on one GPU or
CFG-parallel.

    python scripts/bench_composite.py speech --weights DIR [--streams 1 8 32] [--max-tokens 560] --out JSON
    python scripts/bench_composite.py image --weights DIR [--size 1024] [--steps 8 24] --out JSON

speech: for each placement (``launch/configs/speech_single.yaml`` on 1 device, ``speech_split.yaml`` on 2) and each
concurrency N, N clients stream ``/generate`` at once (greedy-free sampling with a pinned seed per client, the
same ``--max-tokens`` codes each): time to first audio (p50, p99) and real-time factor per stream (seconds of
wall time per second of audio produced; < 1 is faster than real time), plus whether both placements gave the same
audio bytes for the same pinned requests.
image: ``image_single.yaml`` (sequential CFG: both branch forwards one after the other on one device) against a
two-rank CFG-parallel placement (main loop + conditional branch on rank 0, unconditional branch on rank 1): time
per denoising step = the slope of request time between two step counts (so text encoding, VAE and HTTP cancel),
the same pinned request's PNG bytes on both, and each rank's edge bytes and host-staging copies from /metrics.
Weights: any directory of the family's layout (real or random; ``--make tiny|3b`` / ``--make tiny|1b`` writes a
random one first; Qwen-Image: ``--make tiny`` only). Device: whatever torch sees (one process per GPU).
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures as cf
import hashlib
import json
import platform
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


def speech_request(base_url: str, i: int, max_tokens: int) -> dict:
    """One streaming /generate speech request: time to first audio, total time, audio seconds, audio digest."""
    body = {"prompt": TEXTS[i % len(TEXTS)], "stream": True,
            "model_kwargs": {"voice": "tara", "max_tokens": max_tokens, "seed": 1000 + i, "temperature": 0.6,
                             "top_p": 0.95}}
    t0 = time.perf_counter()
    first, pcm, rate = None, bytearray(), 24000
    with httpx.stream("POST", f"{base_url}/generate", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.strip():
                continue
            item = json.loads(line)
            if item["modality"] == "error":
                raise RuntimeError(item["metadata"])
            if item["modality"] == "audio":
                first = first if first is not None else time.perf_counter() - t0
                pcm += base64.b64decode(item["data"])
                rate = item["metadata"].get("sample_rate", rate)
    total = time.perf_counter() - t0
    audio_s = len(pcm) / 2 / rate
    return {"ttfa_s": first, "seconds": total, "audio_s": audio_s, "rtf": total / audio_s if audio_s else None,
            "sha256": hashlib.sha256(bytes(pcm)).hexdigest()}


def bench_speech(args) -> dict:
    placements = {"codec_colocated": ("launch/configs/speech_single.yaml", 1),
                  "codec_other_gpu": ("launch/configs/speech_split.yaml", 2)}
    kwargs = {"max_seq_len": 1024, "max_batch": max(args.streams)}
    out: dict = {"placements": {}}
    for name, (config, nproc) in placements.items():
        server = Server(REPO / config, nproc=nproc, overrides={"weights": args.weights, "engine": kwargs},
                        startup_timeout=600)
        try:
            rows = {"cold_start_s": server.ready_seconds}
            speech_request(server.base_url, 0, 28)  # warm the route
            for n in args.streams:
                with cf.ThreadPoolExecutor(n) as pool:
                    results = list(pool.map(lambda i: speech_request(server.base_url, i, args.max_tokens), range(n)))
                ttfa = [r["ttfa_s"] for r in results if r["ttfa_s"] is not None]
                rtf = [r["rtf"] for r in results if r["rtf"] is not None]
                rows[f"streams_{n}"] = {
                    "ttfa_p50_s": pct(ttfa, 0.5), "ttfa_p99_s": pct(ttfa, 0.99), "rtf_p50": statistics.median(rtf),
                    "rtf_max": max(rtf), "audio_s_per_stream": statistics.median(r["audio_s"] for r in results),
                    "digests": [r["sha256"] for r in results],
                }
                print(name, n, {k: v for k, v in rows[f"streams_{n}"].items() if k != "digests"}, flush=True)
            rows["edge_bytes_sent"] = per_rank(server.base_url, "mstar_dist_edge_bytes_sent_total")
        except Exception:
            print(server.log()[-6000:], flush=True)
            raise
        finally:
            server.stop()
        out["placements"][name] = rows
    a, b = (out["placements"][p] for p in placements)
    out["same_audio_split_vs_colocated"] = all(a[f"streams_{n}"]["digests"] == b[f"streams_{n}"]["digests"]
                                               for n in args.streams)
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
    out["same_png_parallel_vs_sequential"] = seq["png_sha256"] == par["png_sha256"]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["speech", "image"])
    p.add_argument("--weights", required=True)
    p.add_argument("--make", default=None, help="write a random checkpoint of this size to --weights first")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=560)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, nargs=2, default=[8, 24])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    t0 = time.perf_counter()
    if args.make:
        if args.what == "speech":
            from models.speech.checkpoint import write_speech_family
            write_speech_family(Path(args.weights), args.make, 0)
        else:
            from models.qwen_image.checkpoint import make_qwen_image_checkpoint
            if args.make != "tiny":
                raise SystemExit(f"--make {args.make}: Qwen-Image's random checkpoint comes in one size, tiny")
            make_qwen_image_checkpoint(Path(args.weights), seed=0)
        print(f"random {args.make} checkpoint written in {time.perf_counter() - t0:.0f} s", flush=True)
    result = bench_speech(args) if args.what == "speech" else bench_image(args)
    result.update(command=" ".join(sys.argv), device=torch.cuda.get_device_name(0) if torch.cuda.is_available()
                  else platform.processor() or "cpu", gpus=torch.cuda.device_count(), torch=torch.__version__)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "placements"}, indent=2))


if __name__ == "__main__":
    main()
