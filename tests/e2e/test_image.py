"""CFG image generation (BAGEL shape, tiny random weights prepared on first start) through the real launcher:
launch/configs/image_cfg_parallel.yaml (main loop on rank 0, the guidance branches on ranks 1 and 2) and, for
the comparison, image_single.yaml.

A failure here means the images route or SDK breaks the PNGs, CFG-parallel changes the picture, the per-step
latents do not go over the pair groups between the ranks, or bad input is not a clear 4xx.
"""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image

from mstar_dist.client import MStarClient
from tests.e2e.server import REPO, Server, per_rank, wait_for

WEIGHTS = {"weights": "~/.cache/mstar_dist/bagel-tiny"}  # the default path: prepared by the family itself


@pytest.fixture(scope="module")
def parallel():
    server = Server(REPO / "launch/configs/image_cfg_parallel.yaml", nproc=3, overrides=WEIGHTS)
    yield server
    assert server.stop_clean(3), server.log()


def images(base_url: str, **body) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/images/generations", timeout=120,
                      json={"model": "bagel", "prompt": "a red fox in the snow", **body})


def pngs(r: httpx.Response) -> list[bytes]:
    assert r.status_code == 200, r.text
    return [base64.b64decode(d["b64_json"]) for d in r.json()["data"]]


def test_n_pngs_of_the_asked_size(parallel):
    out = pngs(images(parallel.base_url, n=2, size="32x48", seed=3, steps=4))
    assert [Image.open(io.BytesIO(p)).size for p in out] == [(32, 48), (32, 48)]
    assert out[0] != out[1]  # seeds 3 and 4
    assert MStarClient(parallel.base_url).images("a red fox in the snow", n=1, size="32x48", seed=4,
                                                 steps=4) == [out[1]]


def test_cfg_parallel_gives_the_same_png_bytes_as_one_rank(parallel):
    cases = [dict(seed=1, steps=5), dict(seed=2, steps=3, guidance_scale=7.0, size="64x32")]
    on_parallel = [pngs(images(parallel.base_url, **c)) for c in cases]
    single = Server(REPO / "launch/configs/image_single.yaml", nproc=1, overrides=WEIGHTS)
    try:
        on_single = [pngs(images(single.base_url, **c)) for c in cases]
    finally:
        assert single.stop_clean(1), single.log()
    assert on_parallel == on_single


def test_each_steps_latents_cross_the_pair_groups(parallel):
    before = per_rank(parallel.base_url, "mstar_dist_edge_bytes_sent_total")
    pngs(images(parallel.base_url, seed=9, steps=6, size="64x64"))
    latent = 4 * 32 * 32 * 4  # 64x64 image: 4 x 32 x 32 fp32 latents, above the config's inline_max_bytes
    def settled() -> bool:  # per-rank gauges arrive every 0.5 s (later on a loaded machine)
        sent = {r: v - before.get(r, 0)
                for r, v in per_rank(parallel.base_url, "mstar_dist_edge_bytes_sent_total").items()}
        live = per_rank(parallel.base_url, "mstar_dist_live_tensors")
        # rank 0 sends the latents to both branches every step; each branch sends its velocity back every step
        assert sent.get("0", 0) >= 2 * 6 * latent and sent.get("1", 0) >= 6 * latent \
            and sent.get("2", 0) >= 6 * latent, sent
        assert not any(live.values()), live
        return True

    wait_for(settled, 30, "the edges' bytes counted and live tensors at 0", interval=0.2)


@pytest.mark.parametrize("body, words", [
    ({"size": "65x64"}, "width"), ({"size": "big"}, "size"), ({"n": 9}, "n"), ({"steps": 0}, "steps"),
    ({"guidance_scale": -1}, "guidance_scale"), ({"response_format": "url"}, "b64_json"),
])
def test_bad_image_requests_are_4xx_and_the_server_stays_healthy(parallel, body, words):
    r = images(parallel.base_url, **body)
    assert 400 <= r.status_code < 500 and words in r.text, r.text
    assert httpx.get(f"{parallel.base_url}/health", timeout=10).status_code == 200
