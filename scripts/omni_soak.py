"""Mixed Qwen3-Omni requests against a running server, a share of them abandoned mid-answer; then every rank's live
tensors must fall to 0 (the leak canary, ``mstar_dist_live_tensors`` on ``/metrics``).

    torchrun --standalone --nproc-per-node 3 -m mstar_dist.serve launch/configs/qwen3omni.yaml &
    python scripts/omni_soak.py --url http://127.0.0.1:8000 [--requests 200] [--concurrency 8] [--abandon-every 5]

The plan is deterministic (``--seed``): chat completions with text, an image and / or an audio clip in, text or text
and speech out (``message.audio`` as WAV, or streamed ``delta.audio``), and native ``/generate`` streams; every
``--abandon-every``-th request is streamed and its connection closed after the first chunk (the server aborts it).
Prints one JSON object: outcomes, seconds, requests per second, and the live tensors per rank at the end.
``tests/e2e/test_qwen3omni.py`` runs :func:`run` with fewer requests.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures as cf
import io
import json
import random
import re
import time

import httpx
import numpy as np


def _png(seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (40, 56, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def _wav(seconds: float) -> bytes:
    import soundfile

    t = np.arange(int(seconds * 16000)) / 16000
    out = io.BytesIO()
    soundfile.write(out, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000, format="WAV",
                    subtype="PCM_16")
    return out.getvalue()


def content(rng: random.Random, i: int) -> list[dict]:
    """A user message's parts: text, and maybe an image and / or an audio clip."""
    parts: list[dict] = [{"type": "text", "text": f"Request {i}: what is in here?"}]
    if rng.random() < 0.4:
        url = "data:image/png;base64," + base64.b64encode(_png(i)).decode()
        parts.append({"type": "image_url", "image_url": {"url": url}})
    if rng.random() < 0.3:
        parts.append({"type": "input_audio", "input_audio": {"data": base64.b64encode(_wav(0.6)).decode(),
                                                             "format": "wav"}})
    return parts


def plan(n: int, seed: int = 0, abandon_every: int = 5) -> list[dict]:
    """The requests: (route, body, streamed, abandoned) as dicts."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        abandon = abandon_every > 0 and i % abandon_every == abandon_every - 1
        speak = abandon or rng.random() < 0.6
        stream = abandon or rng.random() < 0.5
        knobs = {"max_tokens": rng.choice([4, 12, 24]), "temperature": rng.choice([0.0, 0.8]), "seed": i}
        messages = [{"role": "user", "content": content(rng, i)}]
        if rng.random() < 0.3:
            body = {"messages": messages, "stream": stream, "model_kwargs": {**knobs, "talker_max_new_tokens": 40},
                    "modalities": ["text", "audio"] if speak else ["text"]}
            out.append({"route": "/generate", "body": body, "abandon": abandon})
            continue
        body = {"messages": messages, "stream": stream, **knobs}
        if speak:
            body.update(modalities=["text", "audio"], audio={"voice": "chelsie", "format": "pcm16" if stream
                                                                else "wav"})
        out.append({"route": "/v1/chat/completions", "body": body, "abandon": abandon})
    return out


def one(base_url: str, item: dict, timeout: float = 300) -> str:
    """Run one planned request: "done", "abandoned", or what went wrong."""
    url = base_url + item["route"]
    try:
        if not item["body"].get("stream"):
            r = httpx.post(url, json=item["body"], timeout=timeout)
            return "done" if r.status_code == 200 else f"http {r.status_code}: {r.text[:200]}"
        with httpx.stream("POST", url, json=item["body"], timeout=timeout) as r:
            if r.status_code != 200:
                return f"http {r.status_code}"
            for n, line in enumerate(r.iter_lines()):
                if item["abandon"] and n >= 1:
                    return "abandoned"
                if '"error"' in line[:40]:
                    return f"error line: {line[:200]}"
        return "done"
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"


def live_tensors(base_url: str) -> dict[str, int]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {m.group(1): int(float(m.group(2)))
            for m in re.finditer(r'^mstar_dist_live_tensors\{rank="(\d+)"\} (\S+)$', text, re.M)}


def run(base_url: str, n: int, *, concurrency: int = 8, abandon_every: int = 5, seed: int = 0,
        settle_s: float = 30.0) -> dict:
    """Run the plan; then wait (up to ``settle_s``) for every rank's live tensors to reach 0."""
    items = plan(n, seed, abandon_every)
    start = time.monotonic()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        outcomes = list(pool.map(lambda item: one(base_url, item), items))
    seconds = time.monotonic() - start
    deadline, live = time.monotonic() + settle_s, {}
    while time.monotonic() < deadline:
        live = live_tensors(base_url)
        if live and not any(live.values()):
            break
        time.sleep(0.25)
    counts: dict[str, int] = {}
    for outcome in outcomes:
        key = outcome if outcome in ("done", "abandoned") else "failed"
        counts[key] = counts.get(key, 0) + 1
    return {"requests": n, "outcomes": counts, "failures": [o for o in outcomes if o not in ("done", "abandoned")],
            "seconds": round(seconds, 2), "requests_per_second": round(n / seconds, 2), "live_tensors": live}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--abandon-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(json.dumps(run(args.url.rstrip("/"), args.requests, concurrency=args.concurrency,
                         abandon_every=args.abandon_every, seed=args.seed), indent=2))


if __name__ == "__main__":
    main()
