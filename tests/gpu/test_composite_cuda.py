"""Composite models on CUDA through the real launcher with tiny random checkpoints of their layouts (written on
the spot): streaming speech with the codec on the second GPU, and CFG-parallel image generation with one guidance
branch on each GPU. Skipped without two GPUs. A failure means a walk across ranks does not move its values device
to device over NCCL (edge bytes, host staging copies), or that splitting changes the output bytes.
"""

from __future__ import annotations

import base64
import time

import httpx
import pytest
import torch

from tests.e2e.server import REPO, Server, per_rank

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    from models.qwen_image.checkpoint import make_qwen_image_checkpoint
    from models.speech.checkpoint import write_tiny_speech_checkpoint

    root = tmp_path_factory.mktemp("weights")
    return {"speech": str(write_tiny_speech_checkpoint(root / "orpheus")),
            "image": str(make_qwen_image_checkpoint(root / "qwen-image"))}


def media(base_url: str, body: dict, modality: str) -> list[bytes]:
    r = httpx.post(f"{base_url}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return [base64.b64decode(o["data"]) for o in r.json()["outputs"] if o["modality"] == modality]


def run_speech(config: str, nproc: int, weights: str) -> tuple[list[list[bytes]], dict]:
    server = Server(REPO / config, nproc, overrides={"weights": weights})
    try:
        audio = [media(server.base_url, {"prompt": f"Hello number {i}", "model_kwargs": {
            "voice": "zoe", "max_tokens": 80, "seed": 40 + i, "temperature": 0.7}}, "audio") for i in range(3)]
        stats = {name: per_rank(server.base_url, f"mstar_dist_{name}")
                 for name in ("edge_bytes_sent_total", "host_staging_copies_total", "live_tensors")}
    finally:
        server.stop()
    return audio, stats


def test_speech_with_the_codec_on_the_other_gpu_equals_one_gpu(weights):
    single, _ = run_speech("launch/configs/speech_single.yaml", 1, weights["speech"])
    split, stats = run_speech("launch/configs/speech_split.yaml", 2, weights["speech"])
    assert split == single and all(sum(map(len, a)) > 0 for a in single)
    assert not any(stats["live_tensors"].values()), stats


def run_image(config: str, nproc: int, weights: str) -> tuple[list[bytes], dict]:
    server = Server(REPO / config, nproc, overrides={"weights": weights, "transport": {"inline_max_bytes": 1024}})
    try:
        pngs = [media(server.base_url, {"prompt": "a red fox", "model_kwargs": {
            "steps": 6, "seed": s, "width": 64, "height": 64}}, "image")[0] for s in (1, 2)]
        deadline = time.monotonic() + 10  # per-rank gauges reach the conductor every 0.5 s
        while True:
            stats = {name: per_rank(server.base_url, f"mstar_dist_{name}")
                     for name in ("edge_bytes_sent_total", "host_staging_copies_total", "live_tensors")}
            if nproc == 1 or min(stats["edge_bytes_sent_total"].values()) >= 12 * 16384 \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        server.stop()
    return pngs, stats


def test_cfg_parallel_over_nccl_equals_one_gpu_and_moves_latents_device_to_device(weights):
    single, _ = run_image("launch/configs/image_single.yaml", 1, weights["image"])
    parallel, stats = run_image("launch/configs/image_cfg_parallel_2gpu.yaml", 2, weights["image"])
    assert parallel == single
    # every step: latents 0 -> 1 (16 x 16 x 16 fp32 = 16 KB) and the unconditional prediction 1 -> 0
    assert stats["edge_bytes_sent_total"]["0"] >= 2 * 6 * 16384 and stats["edge_bytes_sent_total"]["1"] >= 2 * 6 * 16384
    assert not any(stats["host_staging_copies_total"].values()), stats
    assert not any(stats["live_tensors"].values()), stats
