"""A composite model with a Parallel walk and a streaming partition (tests/toy_model.py:ToyAudioModel), served
by the real launcher on 2 ranks: COUNT on rank 1 streams every value across ranks into CODEC on rank 0, which
consumes chunks of 3 (Fixed policy) and stops on the final chunk. A failure means streamed values are lost,
reordered or chunked wrongly, the final chunk is missing or doubled, a request ends before all its partitions
do (or never ends), or a partition that starts done blocks the request.
"""

from __future__ import annotations

import concurrent.futures as cf
import re

import httpx
import pytest

from tests.e2e.server import REPO, Server, wait_for
from tests.toy_model import audio_text as expected


@pytest.fixture(scope="module")
def toy():
    server = Server(REPO / "tests/toy_audio_deploy.yaml", nproc=2)
    yield server
    assert server.stop_clean(2), server.log()


def text(base_url: str, prompt: str, max_tokens: int) -> str:
    r = httpx.post(f"{base_url}/generate", timeout=60, json={"prompt": prompt, "model_kwargs": {"max_tokens": max_tokens}})
    assert r.status_code == 200, r.text
    return r.json()["text"]


@pytest.mark.parametrize("start, max_tokens", [(5, 8), (0, 7), (100, 2), (40, 1)])
def test_streamed_chunks_and_final_chunk(toy, start, max_tokens):
    assert text(toy.base_url, f"start={start}", max_tokens) == expected(start, max_tokens)


def test_partition_that_starts_done(toy):
    assert text(toy.base_url, "start=3 no-audio", 5) == expected(3, 5, audio=False)


def test_concurrent_streaming_requests_keep_their_own_streams(toy):
    starts = list(range(0, 2000, 100))
    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda s: text(toy.base_url, f"start={s + 5}", 11), starts))
    assert got == [expected(s + 5, 11) for s in starts]
    wait_for(lambda: re.search(r"^mstar_dist_requests_running 0(\.0)?$",
                               httpx.get(f"{toy.base_url}/metrics", timeout=10).text, re.M),
             15, "mstar_dist_requests_running back at 0")
