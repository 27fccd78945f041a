"""The Qwen3-Omni family served in process (models/qwen3_omni/family.py; tests/inproc.py: a conductor and workers on
one bus), on the tiny checkpoint of the published layout.

A failure here points to: the pipeline's text or speech differing from transformers' ``generate`` (the thinker's
multimodal prefill, the rows the talker reads, the talker's text feed, its sampling, the code2wav chunks), a placement
changing the bytes a request gets, the chunk policy not followed, a text-only answer starting the speech partitions,
or a bad request (media, voice, knobs) not refused with a message naming what to fix.
"""

from __future__ import annotations

import pytest
import torch

from models.qwen3_omni.checkpoint import write_default_checkpoint
from models.qwen3_omni.family import Qwen3Omni
from models.qwen3_omni.nodes import to_pcm16
from mstar_dist.config.deployment import parse_config
from mstar_dist.events import BackendError, Finished, GenerationParams, MediaDelta, MediaItem, MediaLimits, TextDelta
from mstar_dist.graph.model import Layout
from tests.inproc import InProcDeployment
from tests.omni_media import CHUNK, LEFT_CONTEXT, check_chunks, png, wav

pytestmark = pytest.mark.usefixtures("one_intraop_thread")

WALKS = {"ENCODE": ["prefill"], "THINKER": ["prefill", "decode"], "TALKER": ["talk"],
         "CODE2WAV": ["code2wav"]}
PLACEMENTS = {
    "colocated": ({"ENCODE": 0, "THINKER": 0, "TALKER": 0, "CODE2WAV": 0}, 1),
    "three_ranks": ({"ENCODE": 0, "CODE2WAV": 0, "THINKER": 1, "TALKER": 2}, 3),
}
LIMITS = MediaLimits(max_item_bytes=8 << 20, max_image_pixels=1 << 20, max_audio_seconds=30.0)
GREEDY = {"talker_temperature": 0.0}
IM_END = 1026
"""``<|im_end|>`` of the tiny tokenizer: the thinker's EOS."""


def config_of(where: dict[str, int], decode_rank: int | None = None) -> dict:
    groups = []
    for node, rank in where.items():
        walks = WALKS[node] if not (node == "THINKER" and decode_rank is not None) else ["prefill"]
        groups.append({"node_names": [node], "ranks": [rank], "graph_walks": walks})
    if decode_rank is not None:
        groups.append({"node_names": ["THINKER"], "ranks": [decode_rank], "graph_walks": ["decode"]})
    # packed CPU linears round differently from transformers' F.linear: off, for the parity tests
    return {"model": "qwen3_omni", "engine": {"max_seq_len": 512, "max_batch": 4, "cpu_packed_linear": False},
            "node_groups": groups}


class Recorded(Qwen3Omni):
    """The family, remembering each request's thinker tokens (as ints) for the parity tests."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tokens: dict[str, list[int]] = {}

    def postprocess(self, state, signal, values):
        if signal == "token":
            self.tokens.setdefault(state.request_id, []).extend(int(v) for v in values)
        return super().postprocess(state, signal, values)


def deploy(config: dict, world_size: int) -> tuple[Recorded, InProcDeployment, dict[str, list[torch.Tensor]]]:
    """The family on an in-process deployment, and each request's codec frames as CODE2WAV receives them."""
    write_default_checkpoint()
    model = Recorded(None)
    parsed = parse_config(config, "test")
    model.configure(Layout.from_node_groups(parsed.node_groups), parsed.engine)
    model.load_frontend()
    dep = InProcDeployment(model, config, world_size)
    frames: dict[str, list[torch.Tensor]] = {}
    for worker in dep.workers:
        node = worker.components.get("CODE2WAV")
        if node is not None:
            node.run_batch = _recording(node.run_batch, frames)
    return model, dep, frames


def _recording(run_batch, frames):
    def run(calls):
        for call in calls:
            codes, n_context = call.inputs["codes"], int(call.inputs.get("codes_context", torch.tensor([0])))
            if codes.dim() == 2:
                frames.setdefault(call.request_id.split("#")[0], []).append(codes[n_context:].clone())
        return run_batch(calls)
    return run


@pytest.fixture(scope="module")
def deployments():
    built = {}

    def get(name: str):
        if name not in built:
            if name == "pd":
                built[name] = deploy(config_of({"ENCODE": 0, "CODE2WAV": 0, "TALKER": 0, "THINKER": 1}, 2), 3)
            else:
                where, world = PLACEMENTS[name]
                built[name] = deploy(config_of(where), world)
        return built[name]
    return get


def params(rid: str, content: str = "Hello there", media=(), audio: bool = True, **kw) -> GenerationParams:
    knobs = {"talker_max_new_tokens": 60, **kw.pop("knobs", {})}
    return GenerationParams(request_id=rid, prompt=None, messages=[{"role": "user", "content": content}],
                            max_tokens=kw.pop("max_tokens", 20), temperature=kw.pop("temperature", 0.0),
                            seed=kw.pop("seed", 7), media=list(media), media_limits=LIMITS if media else None,
                            output_modalities=["text", "audio"] if audio else None, model_kwargs=knobs, **kw)


def image_item(data: bytes | None = None, fmt: str = "image/png", source: str = "messages[0].content[0]"):
    return MediaItem(kind="image", data=png() if data is None else data, format=fmt, message=0, offset=0,
                     source=source)


def audio_item(data: bytes | None = None, fmt: str = "wav", source: str = "messages[0].content[1]"):
    return MediaItem(kind="audio", data=wav() if data is None else data, format=fmt, message=0, offset=0,
                     source=source)


def outcome(events: list) -> tuple[str, list[bytes], object]:
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    return text, [e.data for e in events if isinstance(e, MediaDelta)], events[-1]


# ---- parity with transformers ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers", minversion="5.25")  # the module names of 5.25
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hfm

    model = hfm.Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        str(write_default_checkpoint()), dtype=torch.float32).eval()
    codes: list[torch.Tensor] = []
    decode = model.code2wav.chunked_decode

    def recording(c, chunk_size=300, left_context_size=25):
        codes.append(c.clone())
        return decode(c, chunk_size=chunk_size, left_context_size=left_context_size)

    model.code2wav.chunked_decode = recording
    return model, codes


def hf_inputs(model: Recorded, p: GenerationParams) -> dict:
    """transformers' inputs of the prompt our front end made (its processors are tested against ours apart)."""
    prompt = model.frontend.prompt(None, p.messages, p.media, p.media_limits)
    ids = torch.tensor([prompt.ids])
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if prompt.images is not None:
        kw.update(pixel_values=torch.from_numpy(prompt.images.pixel_values),
                  image_grid_thw=torch.from_numpy(prompt.images.grid_thw))
    if prompt.audio is not None:
        features = torch.from_numpy(prompt.audio.features[0])[None]
        kw.update(input_features=features, feature_attention_mask=torch.ones(features.shape[::2], dtype=torch.long))
    return kw


def test_the_thinkers_greedy_tokens_for_an_image_and_an_audio_clip_equal_transformers(deployments, hf):
    model, dep, _ = deployments("three_ranks")
    p = params("mm-text", "What is this?", media=[image_item(), audio_item()], audio=False, max_tokens=12)
    [events] = dep.run([p])
    assert isinstance(events[-1], Finished), events
    kw = hf_inputs(model, p)
    with torch.inference_mode():
        out = hf[0].thinker.generate(**kw, max_new_tokens=12, do_sample=False, eos_token_id=IM_END)
    expect = out[0, kw["input_ids"].shape[1]:].tolist()
    assert model.tokens["mm-text"] == expect and len(set(expect)) > 2


def test_the_thinkers_penalized_greedy_tokens_equal_transformers(deployments, hf):
    """The request's repetition penalty on the thinker (its KV engine, over the prompt and the answer) is
    transformers' ``generate(repetition_penalty=...)``; min-p leaves a greedy pick alone."""
    model, dep, _ = deployments("colocated")
    p = params("penalized", "Hello there", audio=False, max_tokens=12, repetition_penalty=1.8, min_p=0.1)
    [events] = dep.run([p])
    assert isinstance(events[-1], Finished), events
    kw = hf_inputs(model, p)
    with torch.inference_mode():
        out = hf[0].thinker.generate(**kw, max_new_tokens=12, do_sample=False, eos_token_id=IM_END,
                                     repetition_penalty=1.8)
        plain = hf[0].thinker.generate(**kw, max_new_tokens=12, do_sample=False, eos_token_id=IM_END)
    n = kw["input_ids"].shape[1]
    assert model.tokens["penalized"] == out[0, n:].tolist() != plain[0, n:].tolist()


def test_the_talkers_penalties_reach_its_codes(deployments):
    """``talker_presence_penalty`` / ``talker_frequency_penalty`` / ``talker_min_p`` travel to the TALKER node
    (``talker_sampling``) and change the codes of a greedy talker; the same knobs give the same codes (the processor
    itself is checked against HF's and vLLM's definitions in test_qwen3omni_talker.py)."""
    _, dep, frames = deployments("colocated")
    knobs = {**GREEDY, "talker_presence_penalty": 2.0, "talker_frequency_penalty": 2.0, "talker_min_p": 0.05}
    runs = [params("t-plain", knobs=GREEDY), params("t-pen", knobs=knobs), params("t-pen2", knobs=knobs)]
    for events in dep.run(runs):
        assert isinstance(events[-1], Finished), events
    plain, pen, again = (torch.cat(frames[p.request_id]) for p in runs)
    assert torch.equal(pen, again) and not torch.equal(pen, plain)


@pytest.mark.parametrize("media", ["text", "image"])
def test_the_talkers_codes_and_the_waveform_equal_transformers(deployments, hf, media):
    """Greedy thinker and talker. transformers 5.25 cannot speak for a prompt holding an image and an audio clip
    (its talker's M-RoPE index reads ``config.audio_config``, which the talker config lacks: AttributeError), so
    audio input is compared for the thinker only."""
    model, dep, frames = deployments("three_ranks")
    items = [image_item()] if media == "image" else []
    p = params(f"speak-{media}", "What is this?" if items else "Hello there", media=items, knobs=GREEDY)
    [events] = dep.run([p])
    text, chunks, end = outcome(events)
    assert isinstance(end, Finished), events
    hf_model, hf_codes = hf
    hf_codes.clear()
    kw = hf_inputs(model, p)
    with torch.inference_mode():
        seq, _ = hf_model.generate(**kw, return_audio=True, speaker="ethan", thinker_max_new_tokens=20,
                                   thinker_do_sample=False, thinker_eos_token_id=IM_END, talker_do_sample=False,
                                   talker_max_new_tokens=60)
    assert model.tokens[p.request_id] == seq[0, kw["input_ids"].shape[1]:].tolist()
    ours = torch.cat(frames[p.request_id]).t()  # (G, frames)
    assert torch.equal(ours, hf_codes[0][0])
    with torch.inference_mode():
        wave = hf_model.code2wav.chunked_decode(hf_codes[0], chunk_size=CHUNK, left_context_size=LEFT_CONTEXT)
    pcm = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.int16).int()
    expect = to_pcm16(wave.reshape(-1)).int()
    assert pcm.shape == expect.shape and (pcm - expect).abs().max() <= 1  # the two codecs' fp32 rounding, x 32767
    check_chunks([len(c) for c in chunks])


# ---- serving --------------------------------------------------------------------------------------------------

def test_every_placement_gives_the_same_text_and_audio_bytes_with_a_pinned_seed(deployments):
    """Sampled thinker and talker (the talker's own defaults), one request at a time."""
    asks = [params("s1", temperature=0.8, seed=11),
            params("s2", "What is this?", media=[image_item(), audio_item()], temperature=0.8, seed=12)]
    got = {}
    for name in ("colocated", "three_ranks", "pd"):
        _, dep, _ = deployments(name)
        got[name] = [outcome(dep.run([p])[0]) for p in asks]
    first = got["colocated"]
    assert all(isinstance(end, Finished) and chunks for _, chunks, end in first), first
    for name, answers in got.items():
        assert [(t, c) for t, c, _ in answers] == [(t, c) for t, c, _ in first], name


def test_chunks_follow_the_policy_and_the_talker_reads_past_the_text(deployments):
    """25 frames a chunk with 25 of left context, exactly one final chunk; the talker goes on after the thinker's
    text ended (tts_eos, then tts_pad) until its frame budget."""
    _, dep, frames = deployments("colocated")
    [events] = dep.run([params("chunks", max_tokens=8, temperature=0.8, seed=2, knobs={"talker_max_new_tokens": 57})])
    _, chunks, end = outcome(events)
    assert isinstance(end, Finished)
    assert check_chunks([len(c) for c in chunks]) == 57 == sum(f.shape[0] for f in frames["chunks"])
    assert len(chunks) == 3  # 25 + 25 + the final 7


def test_the_first_audio_chunk_comes_before_the_thinkers_last_token(deployments):
    """The talker speaks while the thinker writes: a chunk of speech is out long before the text is complete."""
    _, dep, _ = deployments("three_ranks")
    [events] = dep.run([params("early", max_tokens=80, temperature=0.8, seed=3)])
    kinds = [type(e).__name__ for e in events]
    assert kinds[-1] == "Finished" and "MediaDelta" in kinds
    assert kinds.index("MediaDelta") < len(kinds) - 1 - kinds[::-1].index("TextDelta") - 20, kinds


def test_a_text_only_answer_never_starts_the_talker_or_code2wav(deployments):
    _, dep, _ = deployments("three_ranks")
    talker = dep.workers[2].components["TALKER"]
    before = talker.stats()["talker_prefills_total"]
    [events] = dep.run([params("text-only", audio=False)])
    text, chunks, end = outcome(events)
    assert isinstance(end, Finished) and text and not chunks
    assert talker.stats()["talker_prefills_total"] == before
    assert all(not w.held_requests() and w.store.live_tensors == 0 for w in dep.workers)


def test_an_intake_encoded_prompt_and_a_raw_spoken_prompt(deployments):
    model, dep, _ = deployments("colocated")
    ids = model.frontend.tokenizer.encode_prompt(None, [{"role": "user", "content": "Hello there"}])
    direct = outcome(dep.run([params("direct", audio=False)])[0])[0]
    # what an HTTP intake hands over: the ids (GenerationParams has no slot: the conductor's state does)
    state_ids = {}
    original = model.preprocess

    def with_ids(state, prompt, messages):
        state.data["prompt_ids"] = state_ids["ids"]
        return original(state, prompt, messages)

    state_ids["ids"] = ids
    model.preprocess = with_ids
    try:
        assert outcome(dep.run([params("intake", audio=False)])[0])[0] == direct
    finally:
        model.preprocess = original
    raw = GenerationParams(request_id="raw", prompt="Hello there", messages=None, max_tokens=20, temperature=0.0,
                           seed=7, output_modalities=["audio"], model_kwargs={"talker_max_new_tokens": 30})
    text, chunks, end = outcome(dep.run([raw])[0])
    assert isinstance(end, Finished) and chunks and text == direct  # spoken as the user's message of a chat


def test_abandoned_and_mixed_requests_leave_nothing_behind(deployments):
    _, dep, _ = deployments("three_ranks")
    asks = [params(f"m{i}", media=[image_item()] if i % 3 == 0 else [], audio=i % 2 == 0, max_tokens=30,
                   temperature=0.7, seed=i) for i in range(10)]
    events = [[] for _ in asks]
    for p, ev in zip(asks, events):
        dep.conductor.submit(p, ev.append, True)
    for _ in range(6):
        dep.turn()
    for p in asks[::5]:  # a client gone: no more events for it
        dep.conductor.abort(p.request_id)
    kept = [ev for i, ev in enumerate(events) if i % 5]
    for _ in range(5000):
        if all(ev and isinstance(ev[-1], Finished) for ev in kept):
            break
        dep.turn()
    for _ in range(20):  # the removals reach every rank
        dep.turn()
    assert all(ev and isinstance(ev[-1], Finished) for ev in kept), [ev[-1:] for ev in kept]
    for worker in dep.workers:
        assert worker.held_requests() == set() and worker.store.live_tensors == 0


# ---- bad requests -------------------------------------------------------------------------------------------------

def refusal(dep: InProcDeployment, p: GenerationParams) -> str:
    [events] = dep.run([p])
    assert isinstance(events[-1], BackendError) and events[-1].status == 400, events
    return events[-1].message


BAD_MEDIA = {
    "not an image": ([image_item(b"hello, not an image at all")], "messages[0].content[0]", "not PNG, JPEG or WebP"),
    "truncated png": ([image_item(png()[:200])], "messages[0].content[0]", "truncated"),
    "too many pixels": ([image_item(png(2048, 1024, noise=False))], "messages[0].content[0]",
                        "media.max_image_pixels = 1048576"),
    "too long": ([audio_item(wav(40.0))], "messages[0].content[1]", "media.max_audio_seconds = 30"),
    "wrong audio format": ([audio_item(fmt="mp3")], "messages[0].content[1]", "format"),
    "wrong image type": ([image_item(fmt="image/jpeg")], "messages[0].content[0]", "image/jpeg"),
}


@pytest.mark.parametrize("case", sorted(BAD_MEDIA))
def test_bad_media_is_refused_naming_the_item_and_what_to_fix(deployments, case):
    _, dep, _ = deployments("colocated")
    items, source, words = BAD_MEDIA[case]
    message = refusal(dep, params(f"bad-{case}", "What is this?", media=items))
    assert message.startswith(source) and words in message, message


@pytest.mark.parametrize("knobs, words", [
    ({"voice": "nobody"}, "['aiden', 'chelsie', 'ethan']"),
    ({"talker_temperature": -1}, "talker_temperature"),
    ({"talker_top_k": 2.5}, "talker_top_k"),
    ({"talker_max_new_tokens": 0}, "talker_max_new_tokens"),
    ({"talker_min_p": 1.5}, "talker_min_p"), ({"talker_presence_penalty": 2.5}, "talker_presence_penalty"),
    ({"talker_frequency_penalty": -3}, "talker_frequency_penalty"),
    ({"speed": 2}, "unknown knob"),
])
def test_voice_and_talker_knobs_are_checked(deployments, knobs, words):
    _, dep, _ = deployments("colocated")
    assert words in refusal(dep, params("knobs", knobs=knobs))
