"""The Qwen3-Omni talker (models/qwen3_omni/talker.py, talker_io.py) against transformers' Qwen3OmniMoeTalker* on a
small random config (fp32, CPU): parameter names, logits, the code predictor, the prompt and step inputs, and
generated codes, greedy and sampled with one seed.

A failure points to: the state-dict hooks (`_publish_names`) if the names or the round trip differ; the M-RoPE
tables (`mrope_cos_sin`: interleaving, sections) if logits match with text positions but not with 3-D ones; the
models/moe blocks or the shared expert if both differ; `CodePredictor.residual_codes` (prefill of 2, head and
embedding indices) if the residual codes differ; `prefill_embeds` / `user_positions` / `TextFeed` if the prompt or
trailing text differ from HF's `_get_talker_user_parts` / `_get_talker_assistant_parts`; `step_embeds` or the loop's
order of picks (RNG order) if logits match but generated codes do not; `CodecLogitsProcessor` if it differs from HF's
repetition penalty and suppression.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from models.qwen3_omni.talker import Talker, TalkerConfig, mrope_cos_sin
from models.qwen3_omni.talker_io import (
    ASSISTANT_PREFIX, CodecLogitsProcessor, TalkerSampling, TextFeed, TtsEmbeds, assistant_start, generate_codes,
    multimodal_mask, prefill_embeds, prompt_ids, step_embeds, tts_embeds, user_positions,
)
from mstar_dist.engine.kv_cache import StaticKVCache

transformers = pytest.importorskip("transformers")
omni = pytest.importorskip("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe")
from transformers.generation.logits_process import (  # noqa: E402
    RepetitionPenaltyLogitsProcessor, SuppressTokensLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTalkerConfig  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_intraop_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

H, DT, G = 64, 48, 4
EOS, SPEAKER = 66, 80
TOP = {"im_start_token_id": 10, "user_token_id": 11, "assistant_token_id": 12, "tts_bos_token_id": 20,
       "tts_eos_token_id": 21, "tts_pad_token_id": 22,
       "thinker_config": {"audio_token_id": 30, "image_token_id": 31, "video_token_id": 32}}
ATOL = 1e-5


def small_hf_config() -> Qwen3OmniMoeTalkerConfig:
    """Talker hidden 64, 2 MoE layers of 4 experts top-2 + a shared expert, 4 codebooks of 64 codes; codec vocabulary
    1088 so that HF's rule (the last 1024 ids are special) leaves codes 0..63 and EOS samplable."""
    return Qwen3OmniMoeTalkerConfig(
        text_config=dict(vocab_size=1088, hidden_size=H, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                         norm_topk_prob=True, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2],
                                          "interleaved": True}),
        code_predictor_config=dict(vocab_size=64, hidden_size=H, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_code_groups=G,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        num_code_groups=G, thinker_hidden_size=DT, codec_eos_token_id=EOS, codec_pad_id=64, codec_bos_id=65,
        codec_nothink_id=70, codec_think_bos_id=71, codec_think_eos_id=72,
        speaker_id={"ethan": SPEAKER, "chelsie": 81}, spatial_merge_size=2, accept_hidden_layer=1)


def published(hf: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF's in-memory state (fused ``gate_up_proj`` experts) in the published per-expert layout."""
    out = {}
    for name, t in hf.state_dict().items():
        m = re.match(r"(.*mlp\.experts\.)(gate_up_proj|down_proj)$", name)
        if not m:
            out[name] = t.clone()
            continue
        for e in range(t.shape[0]):
            if m.group(2) == "down_proj":
                out[f"{m.group(1)}{e}.down_proj.weight"] = t[e].clone()
            else:
                gate, up = t[e].chunk(2)
                out[f"{m.group(1)}{e}.gate_proj.weight"] = gate.clone()
                out[f"{m.group(1)}{e}.up_proj.weight"] = up.clone()
    return out


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    tc = small_hf_config()
    hf = omni.Qwen3OmniMoeTalkerForConditionalGeneration(tc).eval()
    with torch.no_grad():  # weights large enough that logits are decisive (no near-ties between codes)
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.15 * torch.randn_like(p))
    config = TalkerConfig.from_hf({"talker_config": tc.to_dict(), **TOP})
    with torch.device("meta"):
        ours = Talker(config)
    ours.load_state_dict(published(hf), assign=True, strict=True)
    return hf, ours.eval().requires_grad_(False), config


def new_cache(config: TalkerConfig, length: int) -> tuple[StaticKVCache, int]:
    t = config.text
    cache = StaticKVCache(t.n_layers, t.n_kv_heads, t.head_dim, max_slots=1, max_seq_len=length)
    return cache, cache.alloc()


def test_the_state_dict_speaks_the_published_names_and_round_trips(models):
    hf, ours, _ = models
    pub = published(hf)
    state = ours.state_dict()
    assert set(state) == set(pub)
    assert all(torch.equal(state[k], pub[k]) for k in pub)
    assert state["model.layers.0.mlp.experts.3.up_proj.weight"].untyped_storage().data_ptr() != \
        state["model.layers.0.mlp.experts.3.gate_proj.weight"].untyped_storage().data_ptr()  # no shared storage
    with torch.device("meta"):
        again = Talker(ours.config)
    again.load_state_dict(state, assign=True, strict=True)
    assert torch.equal(again.model.layers[1].mlp.experts.w_gate_up, ours.model.layers[1].mlp.experts.w_gate_up)
    outer = torch.nn.Module()  # inside a composite: the names under ``talker.``, as in the published checkpoint
    outer.talker = again
    nested = outer.state_dict()
    assert set(nested) == {"talker." + k for k in pub}
    outer.load_state_dict(nested, strict=True)


def test_the_published_talker_config_is_read(models):
    tc = small_hf_config().to_dict()
    tc.update(num_code_groups=16, accept_hidden_layer=24, speaker_id={"Chelsie": 2301, "Ethan": 2302, "Aiden": 2303},
              codec_eos_token_id=2150, codec_pad_id=2148, codec_bos_id=2149, codec_nothink_id=2155,
              codec_think_bos_id=2156, codec_think_eos_id=2157)
    tc["text_config"] = {**tc["text_config"], "vocab_size": 3072, "rope_parameters": None, "rope_theta": 1e6,
                         "rope_scaling": {"mrope_section": [24, 20, 20], "interleaved": True, "type": "default"},
                         "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 6}
    tc["text_config"].pop("num_local_experts", None)
    tc["code_predictor_config"] = {**tc["code_predictor_config"], "num_code_groups": 16, "vocab_size": 2048}
    config = TalkerConfig.from_hf({"talker_config": tc, **TOP})
    assert config.mrope_section == (24, 20, 20) and config.text.rope_theta == 1e6 and config.text.num_experts == 128
    assert config.num_code_groups == 16 and config.accept_hidden_layer == 24
    assert config.speaker_id("ETHAN") == 2302 and config.tokens.multimodal == (30, 31, 32)
    assert config.suppress_tokens == tuple(i for i in range(2048, 3072) if i != 2150)
    assert not any(config.code_predictor.is_sparse(i) for i in range(config.code_predictor.n_layers))
    with pytest.raises(ValueError, match="unknown voice 'nobody'.*aiden"):
        config.speaker_id("nobody")


@pytest.mark.parametrize("key, value, match", [
    ("num_code_groups", 5, "num_code_groups"),
    ("codec_eos_token_id", 5000, "outside the codec vocabulary"),
    ("thinker_hidden_size", None, "missing key 'thinker_hidden_size'"),
    ("text_config.shared_expert_intermediate_size", None,
     "talker_config.text_config: missing key 'shared_expert_intermediate_size'"),
    ("code_predictor_config.hidden_size", 32, "must equal text_config.hidden_size"),
])
def test_a_talker_config_the_architecture_cannot_run_is_refused(key, value, match):
    tc = small_hf_config().to_dict()
    *outer, last = key.split(".")
    (tc[outer[0]] if outer else tc)[last] = value
    with pytest.raises(ValueError, match=match):
        TalkerConfig.from_hf({"talker_config": tc, **TOP})


def test_prefill_logits_match_with_text_and_multimodal_positions(models):
    hf, ours, config = models
    torch.manual_seed(1)
    x = torch.randn(1, 9, H)
    mask = torch.ones(1, 9, dtype=torch.long)
    text = torch.arange(9)[None]
    mrope = torch.stack([torch.tensor([0, 1, 2, 2, 2, 2, 6, 7, 8]), torch.tensor([0, 1, 2, 2, 3, 3, 6, 7, 8]),
                         torch.tensor([0, 1, 2, 3, 2, 3, 6, 7, 8])])[:, None]  # (3, 1, T): a 2x2 image at 2..5
    cache, slot = new_cache(config, 16)
    with torch.no_grad():
        for positions in (text, mrope):
            ref = hf(inputs_embeds=x, attention_mask=mask, position_ids=positions).logits
            cache.bind([slot], [0], 9)
            torch.testing.assert_close(ours(x, positions, cache), ref, atol=ATOL, rtol=0)
        cache.bind([slot], [0], 9)
        with_mrope = ours(x, mrope, cache)
        cache.bind([slot], [0], 9)
        assert not torch.allclose(with_mrope, ours(x, text, cache), atol=1e-3), "3-D positions must change the logits"


def test_mrope_of_equal_rows_is_plain_rope():
    pos = torch.tensor([[0, 3, 7]])
    a = mrope_cos_sin(pos, 16, 1e4, (4, 2, 2), torch.float32)
    b = mrope_cos_sin(pos.expand(3, 1, 3), 16, 1e4, (4, 2, 2), torch.float32)
    plain = mrope_cos_sin(pos, 16, 1e4, (8, 0, 0), torch.float32)
    for x, y, z in zip(a, b, plain):
        assert torch.equal(x, y) and torch.equal(x, z)


def test_the_code_predictor_fills_a_frame_as_hf(models):
    hf, ours, _ = models
    torch.manual_seed(2)
    hidden, code0 = torch.randn(2, H), torch.tensor([5, 40])
    with torch.no_grad():
        e0 = ours.model.codec_embedding(code0)
        got = ours.code_predictor.residual_codes(hidden, e0, lambda logits, group: logits.argmax(-1))
        ref = hf.code_predictor.generate(inputs_embeds=torch.stack((hidden, e0), 1), max_new_tokens=G - 1,
                                         do_sample=False)
    assert got.shape == (2, G - 1)
    assert torch.equal(got, ref[:, -(G - 1):])


def _chat():
    """A system turn, a user turn with an image and an audio clip, the assistant's generation prompt; then 5
    generated tokens (the last one EOS, never fed back)."""
    prompt = torch.tensor([10, 99, 5, 6, 7, 13, 14, 10, 11, 14, 40, 31, 31, 31, 41, 30, 30, 5, 6, 13, 14, 10, 12, 14])
    return prompt, torch.cat((prompt, torch.tensor([50, 51, 52, 53, 13])))


def test_user_positions_follow_hfs_role_rule():
    prompt, _ = _chat()
    tokens = TalkerConfig.from_hf({"talker_config": small_hf_config().to_dict(), **TOP}).tokens
    assert user_positions(prompt, tokens).tolist() == list(range(7, 21))
    assert assistant_start(prompt, tokens) == 21
    two_users = torch.tensor([10, 11, 5, 13, 10, 12, 6, 13, 10, 11, 7, 13, 10, 12])
    assert user_positions(two_users, tokens).tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="assistant"):
        assistant_start(prompt[:20], tokens)


def test_the_prompt_and_trailing_text_match_hfs_talker_parts(models):
    hf, ours, config = models
    prompt, seq = _chat()
    torch.manual_seed(3)
    embed, hidden = torch.randn(1, seq.shape[0] - 1, DT), torch.randn(1, seq.shape[0] - 1, DT)
    tokens = config.tokens
    fake = SimpleNamespace(talker=hf, config=SimpleNamespace(talker_config=hf.config, tts_pad_token_id=tokens.tts_pad))
    full = omni.Qwen3OmniMoeForConditionalGeneration
    rows = torch.randn(1, 3, DT)  # thinker embeddings of tts_bos, tts_eos, tts_pad
    users, start = user_positions(prompt, tokens), assistant_start(prompt, tokens)
    with torch.no_grad():
        hf_user = full._get_talker_user_parts(fake, 0, prompt.shape[0], multimodal_mask(seq, tokens)[None], hidden,
                                              embed)[:, users]
        bos, eos, pad = hf.text_projection(rows).chunk(3, dim=1)
        hf_assistant, hf_ids, hf_trailing = full._get_talker_assistant_parts(fake, start, seq.shape[0], SPEAKER, embed,
                                                                             pad, bos, eos)
        tts = tts_embeds(ours, rows[0])
        got = prefill_embeds(ours, user_embeds=embed[0, users], user_hidden=hidden[0, users],
                             user_multimodal=multimodal_mask(prompt, tokens)[users],
                             assistant_embeds=embed[0, start:start + 4], speaker_id=SPEAKER, tts=tts)
        feed = TextFeed(tts)
        feed.push(ours.text_projection(embed[0, start + 4:]))
    torch.testing.assert_close(got, torch.cat((hf_user, hf_assistant), 1)[0], atol=ATOL, rtol=0)
    assert got.shape[0] == users.numel() + ASSISTANT_PREFIX
    assert torch.equal(prompt_ids(prompt[users], tokens)[-ASSISTANT_PREFIX:], hf_ids[0])
    entries = [feed.take() for _ in range(hf_trailing.shape[1] - 1)]
    assert feed.take() is None, "the thinker has not finished: the talker waits"
    feed.finish()
    entries += [feed.take() for _ in range(3)]
    torch.testing.assert_close(torch.stack(entries[:hf_trailing.shape[1]]), hf_trailing[0], atol=ATOL, rtol=0)
    assert torch.equal(entries[-1], tts.pad) and torch.equal(entries[-2], tts.pad)


def _hf_generate(hf, prompt, trailing, tts, frames, **sampling):
    out = hf.generate(inputs_embeds=prompt[None], trailing_text_hidden=torch.cat((trailing, tts.eos[None]))[None],
                      tts_pad_embed=tts.pad[None, None], talker_input_ids=torch.full((1, prompt.shape[0]), 22),
                      attention_mask=torch.ones(1, prompt.shape[0], dtype=torch.long), max_new_tokens=frames + 1,
                      eos_token_id=EOS, repetition_penalty=1.05, suppress_tokens=list(hf_suppress(hf)),
                      output_hidden_states=True, return_dict_in_generate=True, **sampling)
    return torch.stack([h[-1] for h in out.hidden_states if h[-1] is not None], dim=1)[0]  # (n, G)


def hf_suppress(hf) -> list[int]:
    """HF ``generate``'s talker suppression rule, written out."""
    V = hf.config.text_config.vocab_size
    return [i for i in range(V - 1024, V) if i != EOS]


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    prompt, trailing = torch.randn(12, H, generator=g), torch.randn(3, H, generator=g)
    tts = TtsEmbeds(bos=torch.randn(H, generator=g), eos=torch.randn(H, generator=g), pad=torch.randn(H, generator=g))
    feed = TextFeed(tts)
    feed.push(trailing)
    feed.finish()
    return prompt, trailing, tts, feed


def test_greedy_generation_matches_hfs_talker_generate(models):
    hf, ours, config = models
    assert list(config.suppress_tokens) == hf_suppress(hf)
    prompt, trailing, tts, feed = _inputs(4)
    proc = CodecLogitsProcessor(config.text.vocab_size, config.suppress_tokens, 1.05)
    got = generate_codes(ours, prompt, feed, max_frames=8,
                         pick_code0=lambda logits, seen: proc(logits, seen).argmax(-1),
                         pick_residual=lambda logits, group: logits.argmax(-1))
    ref = _hf_generate(hf, prompt, trailing, tts, 8, do_sample=False)
    assert got.shape == (8, G)  # more frames than text entries: tts_eos, then tts_pad steps are covered
    assert torch.equal(got, ref)


def test_generation_stops_at_codec_eos_as_hf(models):
    hf, ours, config = models
    prompt, trailing, tts, _ = _inputs(5)
    proc = CodecLogitsProcessor(config.text.vocab_size, config.suppress_tokens, 1.05)
    pick0 = lambda logits, seen: proc(logits, seen).argmax(-1)  # noqa: E731
    pick = lambda logits, group: logits.argmax(-1)  # noqa: E731
    first = generate_codes(ours, prompt, _inputs(5)[3], max_frames=12, pick_code0=pick0, pick_residual=pick)
    repeated = int(first[:, 0].mode().values)
    saved = (hf.codec_head.weight[EOS].clone(), ours.codec_head.weight[EOS].clone())
    with torch.no_grad():  # EOS scores as the repeated code: it wins once the penalty lowers that code
        hf.codec_head.weight[EOS] = hf.codec_head.weight[repeated]
        ours.codec_head.weight[EOS] = ours.codec_head.weight[repeated]
    try:
        got = generate_codes(ours, prompt, _inputs(5)[3], max_frames=12, pick_code0=pick0, pick_residual=pick)
        ref = _hf_generate(hf, prompt, trailing, tts, 12, do_sample=False)
    finally:
        with torch.no_grad():
            hf.codec_head.weight[EOS], ours.codec_head.weight[EOS] = saved
    assert 0 < got.shape[0] < 12 and torch.equal(got, ref)


def _multinomial(warpers, gen: torch.Generator):
    """HF's sampling step (warpers, softmax, one multinomial draw) on our generator."""
    def pick(logits: torch.Tensor) -> torch.Tensor:
        for warper in warpers:
            logits = warper(None, logits)
        return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen).squeeze(1)
    return pick


def test_sampled_generation_with_one_seed_matches_hf(models):
    """HF draws with torch.multinomial from the global generator; driving our modules with the same draws from a
    generator seeded alike gives the same codes (the engine's sampler draws differently, see engine/sampling.py)."""
    hf, ours, config = models
    prompt, trailing, tts, feed = _inputs(6)
    s = TalkerSampling()
    proc = CodecLogitsProcessor(config.text.vocab_size, config.suppress_tokens, s.repetition_penalty)
    gen = torch.Generator().manual_seed(1234)
    code0 = _multinomial([TemperatureLogitsWarper(s.temperature), TopKLogitsWarper(s.top_k)], gen)
    residual = s.residual(None)
    rest = _multinomial([TopKLogitsWarper(residual.top_k), TopPLogitsWarper(residual.top_p)], gen)
    got = generate_codes(ours, prompt, feed, max_frames=8, pick_code0=lambda logits, seen: code0(proc(logits, seen)),
                         pick_residual=lambda logits, group: rest(logits))
    torch.manual_seed(1234)
    ref = _hf_generate(hf, prompt, trailing, tts, 8, do_sample=True, temperature=s.temperature, top_k=s.top_k,
                       top_p=s.top_p)
    assert torch.equal(got, ref)


def test_step_embeds_sum_a_frames_codec_embeddings_and_the_text(models):
    _, ours, _ = models
    codes, text = torch.tensor([[3, 1, 2, 63]]), torch.randn(1, H)
    cp = ours.code_predictor.model.codec_embedding
    want = ours.model.codec_embedding(codes[:, 0]) + cp[0](codes[:, 1]) + cp[1](codes[:, 2]) + cp[2](codes[:, 3]) + text
    torch.testing.assert_close(step_embeds(ours, codes, text)[:, 0], want, atol=1e-6, rtol=0)


def test_the_codec_logits_processor_equals_hfs_penalty_and_suppression():
    torch.manual_seed(7)
    logits = torch.randn(3, 40) * 3
    history = torch.tensor([[1, 5, 5, 9], [0, 0, 0, 0], [39, 2, 7, 1]])
    suppress = [30, 31, 35]
    ref = SuppressTokensLogitsProcessor(suppress)(history, RepetitionPenaltyLogitsProcessor(1.3)(history,
                                                                                                  logits.clone()))
    proc = CodecLogitsProcessor(40, suppress, 1.3)
    seen = proc.history(3)
    for step in history.T:
        CodecLogitsProcessor.record(seen, step)
    assert torch.equal(proc(logits, seen), ref)
    assert torch.equal(proc(logits, proc.history(3)), SuppressTokensLogitsProcessor(suppress)(history, logits))
    assert torch.equal(logits + proc.logit_bias(), proc(logits, proc.history(3)))  # the engine's logit_bias form
    # vLLM's frequency and presence penalties over the same codes (no prompt), after HF's repetition penalty
    both = TalkerSampling(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.75).processor(40, suppress)
    counts = torch.stack([torch.bincount(row, minlength=40) for row in history]).float()
    want = SuppressTokensLogitsProcessor(suppress)(history, RepetitionPenaltyLogitsProcessor(1.3)(
        history, logits.clone()) - 0.75 * counts - 0.5 * (counts > 0).float())
    torch.testing.assert_close(both(logits, seen), want, atol=1e-6, rtol=0)
    bools = torch.zeros(3, 40, dtype=torch.bool)
    for step in history.T:  # a bool history serves the repetition penalty alone
        CodecLogitsProcessor.record(bools, step)
    assert torch.equal(proc(logits, bools), ref)


def test_routers_are_probed_after_loading(models):
    _, ours, _ = models
    ours.check_routers()
    original = ours.model.layers[1].mlp.router.forward
    out_of_range = torch.full((4, 2), 7)  # expert 7 of 4
    ours.model.layers[1].mlp.router.forward = lambda x, state=None: (x[:, :2], out_of_range, None)
    try:
        with pytest.raises(ValueError, match=r"layer 1: router selected_experts has indices in .*outside"):
            ours.check_routers()
    finally:
        ours.model.layers[1].mlp.router.forward = original


def test_talker_sampling_defaults_and_checks():
    s = TalkerSampling()
    assert (s.temperature, s.top_k, s.top_p, s.repetition_penalty) == (0.9, 50, 1.0, 1.05)
    assert s.params(7).seed == 7 and s.residual(None).top_p == 0.8
    assert TalkerSampling(temperature=0).residual(None).greedy
    with pytest.raises(ValueError, match="repetition_penalty"):
        TalkerSampling(repetition_penalty=0)
    with pytest.raises(ValueError, match="talker sampling.*top_p"):
        TalkerSampling(top_p=1.5)
    assert (s.min_p, s.presence_penalty, s.frequency_penalty) == (0.0, 0.0, 0.0)  # HF's talker has none
    assert TalkerSampling(min_p=0.3).params(None).min_p == 0.3
    for bad in ({"min_p": 1.5}, {"presence_penalty": 3.0}, {"frequency_penalty": -2.5}):
        with pytest.raises(ValueError, match=f"talker sampling.*{next(iter(bad))}"):
            TalkerSampling(**bad)


def test_a_feed_that_runs_dry_stops_the_reference_loop(models):
    _, ours, config = models
    prompt, trailing, tts, _ = _inputs(8)
    feed = TextFeed(tts)
    feed.push(trailing[:1])
    proc = CodecLogitsProcessor(config.text.vocab_size, config.suppress_tokens + (EOS,), 1.05)
    with pytest.raises(RuntimeError, match="text feed has no entry for step 2"):
        generate_codes(ours, prompt, feed, max_frames=4, pick_code0=lambda logits, seen: proc(logits, seen).argmax(-1),
                       pick_residual=lambda logits, group: logits.argmax(-1))
