"""Qwen-Image (tiny random weights in the published layout, prepared on first start) through the real launcher on
every image config: image_cfg_parallel.yaml (main loop on rank 0, the guidance branches on ranks 1 and 2),
image_single.yaml, image_split.yaml (the text encoder on its own rank), image_cfg_parallel_2gpu.yaml (the negative
branch alone on rank 1) and image_cfg_parallel_2host.yaml (two torchrun invocations, the negative-prompt branch on
the second host). One server per config, tiny pictures,
few steps.

A failure here means the images route, the openai SDK or the PNGs break, a placement changes the picture (CFG
across ranks, the embeddings sent from the encoder's rank), the per-step latents do not go rank to rank over the
data plane (counted per transport in /metrics), or bad input is not a clear 400.
"""

from __future__ import annotations

import base64
import io
import re
import time

import httpx
import pytest
from PIL import Image

from tests.e2e.server import REPO, Server, wait_for

openai = pytest.importorskip("openai")

WEIGHTS = {"weights": "~/.cache/mstar_dist/qwen-image-tiny"}  # the default path: prepared by the family itself
CASES = [dict(seed=1, steps=3, size="32x32"),
         dict(seed=2, steps=2, guidance_scale=7.0, size="48x24", negative_prompt="blurry, dark"),
         dict(seed=3, steps=2, guidance_scale=1.0, size="24x32")]
"""Pinned requests every config must draw byte for byte alike (with and without guidance)."""


@pytest.fixture(scope="module")
def parallel():
    server = Server(REPO / "launch/configs/image_cfg_parallel.yaml", nproc=3, overrides=WEIGHTS)
    yield server
    assert server.stop_clean(3), server.log()


@pytest.fixture(scope="module")
def on_parallel(parallel):
    return [pngs(images(parallel.base_url, **c)) for c in CASES]


def images(base_url: str, **body) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/images/generations", timeout=120,
                      json={"model": "qwen-image", "prompt": "a red fox in the snow", **body})


def pngs(r: httpx.Response) -> list[bytes]:
    assert r.status_code == 200, r.text
    return [base64.b64decode(d["b64_json"]) for d in r.json()["data"]]


def sdk_images(base_url: str, n: int = 1) -> list[bytes]:
    """The openai client's ``images.generate`` (steps and seed through ``extra_body``)."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    out = client.images.generate(model="qwen-image", prompt="a red fox in the snow", n=n, size="32x32",
                                 response_format="b64_json", extra_body={"seed": 1, "steps": 3})
    return [base64.b64decode(d.b64_json) for d in out.data]


def test_n_pngs_of_the_asked_size_and_the_openai_client(parallel, on_parallel):
    out = pngs(images(parallel.base_url, n=2, size="48x24", seed=3, steps=2))
    assert [Image.open(io.BytesIO(p)).size for p in out] == [(48, 24), (48, 24)]
    assert out[0] != out[1]  # seeds 3 and 4
    assert sdk_images(parallel.base_url) == on_parallel[0]


@pytest.mark.parametrize("config, nodes", [("image_single.yaml", [1]), ("image_split.yaml", [2]),
                                           ("image_cfg_parallel_2gpu.yaml", [2]),
                                           ("image_cfg_parallel_2host.yaml", [1, 1])])
def test_every_config_draws_the_cfg_parallel_pictures_byte_for_byte(on_parallel, config, nodes):
    server = Server(REPO / "launch/configs" / config, nproc=0 if len(nodes) > 1 else nodes[0], overrides=WEIGHTS,
                    nodes=nodes if len(nodes) > 1 else None)
    try:
        assert [pngs(images(server.base_url, **c)) for c in CASES] == on_parallel
        assert sdk_images(server.base_url, n=2)[0] == on_parallel[0][0]
    finally:
        assert server.stop_clean(sum(nodes)), server.log()


def flows(base_url: str) -> dict[tuple[str, str, str, str], int]:
    """``mstar_dist_edge_transfers_total`` of the generate walk: (src, dst, signal, transport) -> count."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    out = {}
    for m in re.finditer(r'^mstar_dist_edge_transfers_total\{([^}]*)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m[1]))
        if labels["walk"] == "generate":
            out[labels["src"], labels["dst"], labels["signal"], labels["transport"]] = int(float(m[2]))
    return out


def settled_flows(base_url: str) -> dict[tuple[str, str, str, str], int]:
    """:func:`flows` once two reads a second apart agree (the ranks report their stats every 0.5 s)."""
    last = [flows(base_url)]

    def still() -> bool:
        time.sleep(1.0)
        now = flows(base_url)
        same, last[0] = now == last[0], now
        return same

    wait_for(still, 30, "the edge counters to settle", interval=0)
    return last[0]


def test_each_steps_latents_and_predictions_are_counted_per_transport(parallel, on_parallel):
    before = settled_flows(parallel.base_url)
    steps = 5
    pngs(images(parallel.base_url, seed=9, steps=steps, size="32x32"))

    def settled() -> bool:  # per-rank stats arrive every 0.5 s (later on a loaded machine)
        now = flows(parallel.base_url)
        moved = {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}
        # each step: the latents go from rank 0 to both branches and both predictions come back, over p2p
        # (32x32: 16 x 8 x 8 fp32 latents, above the config's inline_max_bytes); once per request, the prompt's
        # embeddings to the conditional branch (p2p) and the short negative prompt's to the other (inline)
        assert moved == {("0", "1", "latents", "p2p"): steps, ("0", "2", "latents", "p2p"): steps,
                         ("1", "0", "v_cond", "p2p"): steps, ("2", "0", "v_uncond", "p2p"): steps,
                         ("0", "1", "text", "p2p"): 1, ("0", "2", "neg_text", "inline"): 1}, moved
        return True

    wait_for(settled, 30, "the per-step edges counted in /metrics", interval=0.2)


@pytest.mark.parametrize("body, words", [
    ({"size": "36x32"}, "size '36x32' is not supported: width must be a multiple of 8"),
    ({"size": "512x64"}, "in [8, 256]"), ({"size": "big"}, "size"), ({"n": 9}, "n"), ({"n": 0}, "n"),
    ({"steps": 1}, "steps must be an integer in [2, 100]"), ({"steps": 101}, "steps"),
    ({"guidance_scale": -1}, "guidance_scale"), ({"response_format": "url"}, "b64_json"),
])
def test_bad_image_requests_are_400_and_the_server_stays_healthy(parallel, body, words):
    r = images(parallel.base_url, **body)
    assert r.status_code == 400 and words in r.text, r.text
    assert httpx.get(f"{parallel.base_url}/health", timeout=10).status_code == 200
