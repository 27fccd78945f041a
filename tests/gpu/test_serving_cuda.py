"""Serving on CUDA through the real launcher, with a same-shaped random checkpoint (``MSTAR_TEST_WEIGHTS``; make
it with scripts/make_random_checkpoint.py). Skipped without CUDA. A failure means the engine does not run on GPU
(device/dtype mix-ups, generators on the wrong device), pinned requests stop repeating on GPU, or — with two
GPUs — the P/D split's KV does not go device to device over NCCL or changes the output."""

from __future__ import annotations

import os

import httpx
import pytest
import torch

from tests.e2e.server import REPO, WEIGHTS, Server, per_rank

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not os.path.exists(os.path.join(WEIGHTS, "config.json")), reason="no test weights"),
]
LLAMA = {"model": "llama"}  # the same-shaped checkpoint is plain HF Llama; no GGUF import on the GPU host


def pinned(base_url: str) -> list[str]:
    out = []
    for i, sampling in enumerate([{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.9}, {"seed": 3}]):
        r = httpx.post(f"{base_url}/generate", timeout=120, json={
            "prompt": "Tell me about the sea.", "request_id": f"gpu-pin-{i}",
            "model_kwargs": {"max_tokens": 24, **sampling}})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0
        out.append(r.json()["text"])
    return out


def test_the_llama_engine_on_cuda_leaves_prefills_in_flight_and_decode_yields_to_them_unless_told_not_to():
    """The engine's CUDA defaults (docs/architecture.md §8, "Prefill in flight", "Decode yields"): without them the
    rank waits for each prefill, and decode steps start beside prefills on the GPU, both of which delay first tokens
    under a wave of requests."""
    from models.llama.chat import LLM, LlamaChat
    from mstar_dist.config.engine import EngineConfig

    def engine(**knobs):
        return LlamaChat(WEIGHTS).build_component(LLM, device="cuda", walks={"prefill", "decode"},
                                                  engine=EngineConfig(cuda_graphs=False, max_batch=4, **knobs))

    default = engine()
    assert default.prefill_in_flight and default.scheduler.decode_yields and default.scheduler.decode_yield_s == 0.008
    assert not engine(prefill_in_flight=False).prefill_in_flight
    told = engine(decode_yield_ms=0)
    assert told.prefill_in_flight and not told.scheduler.decode_yields


def test_single_rank_serves_on_cuda_and_repeats_pinned_requests():
    server = Server(REPO / "launch/configs/smollm2_single.yaml", 1, overrides=LLAMA)
    try:
        first = pinned(server.base_url)
        assert pinned(server.base_url) == first
    finally:
        assert server.stop_clean(1), server.log()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_pd_split_moves_kv_over_nccl_device_to_device():
    import time

    pd = Server(REPO / "launch/configs/smollm2_pd.yaml", 2, overrides=LLAMA)
    try:
        split = pinned(pd.base_url)
        time.sleep(1.5)
        received = per_rank(pd.base_url, "mstar_dist_edge_bytes_received_total")
        staged = per_rank(pd.base_url, "mstar_dist_host_staging_copies_total")
    finally:
        assert pd.stop_clean(2), pd.log()
    assert received["1"] > 0, "the decode rank received no KV bytes over the pair"
    assert staged == {"0": 0, "1": 0}, f"host staging copies on a CUDA edge: {staged}"
    single = Server(REPO / "launch/configs/smollm2_single.yaml", 1, overrides=LLAMA)
    try:
        assert pinned(single.base_url) == split
    finally:
        single.stop()
