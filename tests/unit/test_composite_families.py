"""The speech (Orpheus shape) and image (Qwen-Image) families on tiny random checkpoints, conductor and workers
in one process (tests/inproc.py), colocated and split over ranks.

A failure here points at the families (models/speech/orpheus.py, models/qwen_image/family.py: the walks, the codec's
frame accounting, the denoising plan) or at walks across ranks carrying their values (mstar_dist/worker/spans.py)
rather than at sockets: the e2e tests drive the same deployments through the real launcher.
"""

from __future__ import annotations

import pytest
import torch

from mstar_dist.config.deployment import parse_config
from mstar_dist.events import BackendError, Finished, GenerationParams, MediaDelta
from mstar_dist.graph.model import Layout
from models.qwen_image.checkpoint import make_qwen_image_checkpoint
from models.qwen_image.family import QwenImage
from models.speech.checkpoint import write_tiny_speech_checkpoint
from models.speech.orpheus import STRIDE, WINDOW, OrpheusSpeech
from tests.inproc import InProcDeployment

pytestmark = pytest.mark.usefixtures("one_intraop_thread")

SPEECH = {
    "single": ([{"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill", "decode"]},
                {"node_names": ["CODEC"], "ranks": [0], "graph_walks": ["codec"]}], 1),
    "split": ([{"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill", "decode"]},
               {"node_names": ["CODEC"], "ranks": [1], "graph_walks": ["codec"]}], 2),
}
IMAGE = {
    "single": ([{"node_names": ["TEXT"], "ranks": [0], "graph_walks": ["encode"]},
                {"node_names": ["DENOISER", "VAE"], "ranks": [0], "graph_walks": ["generate"]}], 1),
    "cfg_parallel": ([{"node_names": ["TEXT"], "ranks": [0], "graph_walks": ["encode"]},
                      {"node_names": ["GUIDE", "VAE"], "ranks": [0], "graph_walks": ["generate"]},
                      {"node_names": ["DENOISE_COND"], "ranks": [1], "graph_walks": ["generate"]},
                      {"node_names": ["DENOISE_UNCOND"], "ranks": [2], "graph_walks": ["generate"]}], 3),
    "split": ([{"node_names": ["TEXT"], "ranks": [0], "graph_walks": ["encode"]},
               {"node_names": ["DENOISER", "VAE"], "ranks": [1], "graph_walks": ["generate"]}], 2),
}
IMAGE_KWARGS = {"default_size": "32x32", "max_size": 256}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {"speech": str(write_tiny_speech_checkpoint(root / "orpheus")),
            "image": str(make_qwen_image_checkpoint(root / "qwen-image"))}


def deployment(cls, weights_dir: str, placement: tuple[list[dict], int], **model_kwargs) -> InProcDeployment:
    groups, world = placement
    cfg = {"model": "x", "weights": weights_dir, "node_groups": groups, "transport": {"inline_max_bytes": 1024}}
    model = cls(weights_dir, **model_kwargs)
    model.configure(Layout.from_node_groups(parse_config(cfg, "test").node_groups))
    model.load_frontend()
    return InProcDeployment(model, cfg, world)


def speech(rid: str, text: str = "Hello there", max_tokens: int = 60, **knobs) -> GenerationParams:
    return GenerationParams(request_id=rid, prompt=text, messages=None, max_tokens=max_tokens, seed=11,
                            temperature=0.8, model_kwargs={"voice": "leo", **knobs})


def audio_of(events) -> bytes:
    return b"".join(e.data for e in events if isinstance(e, MediaDelta) and e.modality == "audio")


def expected_chunks(items: int) -> int:
    """SlidingWindow(28, 7) over ``items`` codes: regular chunks, then exactly one final chunk."""
    regular = 0 if items < WINDOW else (items - WINDOW) // STRIDE + 1
    return regular + 1


def test_speech_split_equals_single_and_follows_the_window_policy(weights):
    runs = {}
    for name, placement in SPEECH.items():
        dep = deployment(OrpheusSpeech, weights["speech"], placement)
        cases = [speech("a", max_tokens=60), speech("b", "A longer sentence to say out loud.", max_tokens=45),
                 speech("c", max_tokens=20)]
        events = dep.run(cases, max_turns=100_000)
        codec = next(w.components["CODEC"] for w in dep.workers if "CODEC" in w.components)
        runs[name] = ([audio_of(ev) for ev in events], [ev[-1] for ev in events], codec.chunks)
        for worker in dep.workers:
            assert worker.held_requests() == set() and worker.store.live_tensors == 0
    (audio, ends, chunks), (audio_split, ends_split, chunks_split) = runs["single"], runs["split"]
    assert audio == audio_split and ends == ends_split and chunks == chunks_split
    frame_samples = 2048
    for pcm, end in zip(audio, ends):
        assert isinstance(end, Finished)
        codes = end.completion_tokens - (1 if end.finish_reason == "stop" else 0)  # end_of_speech is no code
        assert len(pcm) == 2 * frame_samples * (codes // 7)  # every complete frame once, int16
    assert chunks == sum(expected_chunks(e.completion_tokens) for e in ends)
    assert ends[2].completion_tokens == 20 and expected_chunks(20) == 1  # under 4 frames: the final chunk only,
    assert len(audio[2]) == 2 * frame_samples * 2  # holding the 2 complete frames


def test_first_audio_leaves_before_the_llm_writes_its_last_code(weights):
    dep = deployment(OrpheusSpeech, weights["speech"], SPEECH["split"])
    (events,) = dep.run([speech("long", max_tokens=120)], max_turns=100_000)
    audio = [e for e in events if isinstance(e, MediaDelta)]
    end = events[-1]
    assert isinstance(end, Finished) and len(audio) > 1
    assert 28 <= audio[0].metadata["tokens_so_far"] < end.completion_tokens  # 4 frames were enough to start


def test_speech_knobs_are_checked(weights):
    dep = deployment(OrpheusSpeech, weights["speech"], SPEECH["single"])
    bad_voice, bad_knob = dep.run([speech("v", voice="nobody"), speech("k", speed=2)])
    assert isinstance(bad_voice[-1], BackendError) and bad_voice[-1].status == 400
    assert "tara" in bad_voice[-1].message and "nobody" in bad_voice[-1].message
    assert isinstance(bad_knob[-1], BackendError) and "speed" in bad_knob[-1].message


def image(rid: str, **knobs) -> GenerationParams:
    return GenerationParams(request_id=rid, prompt="a red fox in the snow", messages=None, max_tokens=1, seed=5,
                            model_kwargs={"steps": 3, **knobs})


def test_cfg_parallel_and_split_give_the_same_png_bytes_as_one_rank(weights):
    from PIL import Image
    import io

    pngs = {}
    for name, placement in IMAGE.items():
        dep = deployment(QwenImage, weights["image"], placement, **IMAGE_KWARGS)
        events = dep.run([image("a"), image("b", width=24, height=40, guidance_scale=7.5, negative_prompt="blur"),
                          image("c", guidance_scale=1.0)])
        pngs[name] = [[e for e in ev if isinstance(e, MediaDelta)] for ev in events]
        assert all(isinstance(ev[-1], Finished) and ev[-1].finish_reason == "stop" for ev in events)
        for worker in dep.workers:
            assert worker.held_requests() == set() and worker.store.live_tensors == 0
    single = [[d.data for d in ds] for ds in pngs["single"]]
    assert single == [[d.data for d in ds] for ds in pngs["cfg_parallel"]]
    assert single == [[d.data for d in ds] for ds in pngs["split"]]
    first, second = pngs["single"][0][0], pngs["single"][1][0]
    assert Image.open(io.BytesIO(first.data)).size == (32, 32) and first.metadata["width"] == 32
    assert Image.open(io.BytesIO(second.data)).size == (24, 40)
    assert len({first.data, second.data, pngs["single"][2][0].data}) == 3  # guidance changes the picture


def test_cfg_parallel_moves_each_steps_latents_between_the_ranks(weights):
    dep = deployment(QwenImage, weights["image"], IMAGE["cfg_parallel"], **IMAGE_KWARGS)
    sent = []
    for worker in dep.workers:
        plane = worker.transport.transports["p2p"]
        original = plane.post_send
        plane.post_send = lambda t, dst, _o=original, _r=worker.global_rank: sent.append((_r, dst)) or _o(t, dst)
    (events,) = dep.run([image("a", steps=4)])
    assert isinstance(events[-1], Finished)
    # per step: v_cond 1 -> 0, v_uncond 2 -> 0, the next latents 0 -> 1 and 0 -> 2 (4 KB each: above
    # inline_max_bytes; the first latents come with the walk, and GUIDE's last ones go out before the loop ends);
    # plus, once, the prompt embeddings 0 -> 1 for the conditional branch (the negative prompt " " is short
    # enough to ride inline to rank 2)
    assert sorted(set(sent)) == [(0, 1), (0, 2), (1, 0), (2, 0)]
    assert sent.count((1, 0)) == sent.count((2, 0)) == sent.count((0, 2)) == 4 and sent.count((0, 1)) == 5


@pytest.mark.parametrize("knobs, words", [
    ({"steps": 1}, "steps must be an integer in [2, 100]"), ({"width": 60}, "width must be a multiple of 8"),
    ({"guidance_scale": 99}, "guidance_scale must be a number in [0.0, 30.0]"), ({"height": 4096}, "height"),
    ({"style": "noir"}, "unknown knob(s) ['style']"), ({"negative_prompt": 3}, "negative_prompt must be a string"),
])
def test_image_knobs_are_checked(weights, knobs, words):
    dep = deployment(QwenImage, weights["image"], IMAGE["single"], **IMAGE_KWARGS)
    (events,) = dep.run([image("x", **knobs)])
    assert isinstance(events[-1], BackendError) and events[-1].status == 400 and words in events[-1].message


def test_the_served_png_is_the_diffusers_pipelines_picture(weights):
    """The family's nodes (template, both prompts, packing, norm-rescaled CFG, the schedule for the image's token
    count, Euler, VAE, PNG) against diffusers' QwenImagePipeline on the same checkpoint and the same initial noise."""
    diffusers = pytest.importorskip("diffusers")
    from models.qwen_image.pipeline import pack
    from models.qwen_image.png import encode_png

    dep = deployment(QwenImage, weights["image"], IMAGE["split"], **IMAGE_KWARGS)
    (events,) = dep.run([image("d", width=40, height=24, steps=3, guidance_scale=3.0, negative_prompt="blur")])
    served = next(e for e in events if isinstance(e, MediaDelta)).data
    pipe = diffusers.QwenImagePipeline.from_pretrained(weights["image"])
    pipe.set_progress_bar_config(disable=True)
    noise = torch.randn((1, 1, 16, 6, 10), generator=torch.Generator().manual_seed(5))[:, 0]  # the request's seed
    with torch.no_grad():
        rgb = pipe(prompt="a red fox in the snow", negative_prompt="blur", true_cfg_scale=3.0, height=24, width=40,
                   num_inference_steps=3, latents=pack(noise), output_type="pt").images[0]
    assert served == encode_png((rgb * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous())
