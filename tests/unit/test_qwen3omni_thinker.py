"""The Qwen3-Omni thinker's text decoder (models/qwen3_omni/thinker.py) against transformers' on a small random config.

The weights travel by the published names: transformers' ``Qwen3OmniMoeThinkerForConditionalGeneration`` saves its
checkpoint, and our module loads the text part of that file as it is (``load_state_dict(assign=True)``).

A failure points to: the parameter names (a key our state dict has and the published checkpoint lacks, or the
reverse) or the expert fusion (views that lost their fused tensors after loading) if text-only logits differ; the
M-RoPE interleaving (which rotary column takes which axis) if text-only logits match and the multimodal ones do
not; deepstack (which positions, after which layers) or the placement of image / audio embeddings if only a prompt
with an image differs; the KV engine's hook (inputs reaching the forward, the decode position offset) if the logits
match and the engine's greedy tokens do not.
"""

from __future__ import annotations

import pytest
import torch

from models.moe.routers import LoadBiasedRouter
from models.qwen3_omni.rope import RopeTokens, audio_token_count, image_token_count, rope_index
from models.qwen3_omni.thinker import Qwen3OmniThinker, ThinkerConfig, mrope_axes, place
from mstar_dist.config.engine import EngineConfig
from mstar_dist.engine.kv_cache import StaticKVCache
from mstar_dist.engine.kv_engine import KVCacheEngine
from mstar_dist.engine.scheduler import Held
from tests.unit.test_kv_engine import call

pytestmark = pytest.mark.usefixtures("one_intraop_thread")

TOKENS = {"audio_token_id": 2001, "image_token_id": 2002, "video_token_id": 2003, "audio_start_token_id": 2004,
          "vision_start_token_id": 2005}
VISION_END, AUDIO_END = 2006, 2007
TINY_THINKER = {
    "text_config": {"vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32,
                    "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 512,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2],
                                        "interleaved": True, "mrope_interleaved": True}},
    "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                      "deepstack_visual_indexes": [0, 1], "patch_size": 16, "spatial_merge_size": 2},
    "audio_config": {"d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
                     "output_dim": 64, "n_window": 50},
    "position_id_per_seconds": 13,
    **TOKENS,
}
"""The small thinker of every parity test: hidden 64, 2 layers, 4 experts top-2, 4 heads of 16 (2 KV heads), vocab
2048 with the placeholder and start ids inside it, mrope_section [4, 2, 2] (adds up to head_dim / 2)."""
ATOL = 1e-5
PLAIN = EngineConfig(cuda_graphs=False, prefill_graphs=False, lookahead=False, prefill_in_flight=False,
                     decode_yield_ms=0.0)


def prompt_ids(parts: list, seed: int = 0) -> list[int]:
    """A prompt from parts: an int n (n random text ids), ("image", (t, h, w)) or ("audio", feature_frames), each
    span between its start and end tokens with as many placeholders as the model reads for it."""
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for part in parts:
        if isinstance(part, int):
            ids += torch.randint(0, 2000, (part,), generator=gen).tolist()
        elif part[0] == "image":
            n = image_token_count(part[1], TINY_THINKER["vision_config"]["spatial_merge_size"])
            ids += [TOKENS["vision_start_token_id"], *[TOKENS["image_token_id"]] * n, VISION_END]
        else:
            n = audio_token_count(part[1], TINY_THINKER["audio_config"]["n_window"])
            ids += [TOKENS["audio_start_token_id"], *[TOKENS["audio_token_id"]] * n, AUDIO_END]
    return ids


def hf_thinker():
    """transformers' thinker of TINY_THINKER with the text decoder's weights drawn wide (N(0, 0.08), norms around
    1): with its default init the logits are nearly flat and a greedy comparison would hang on rounding."""
    transformers = pytest.importorskip("transformers", minversion="5.25")  # its in-memory names moved after 5.17
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

    config = transformers.Qwen3OmniMoeThinkerConfig(**TINY_THINKER)
    torch.manual_seed(0)
    model = hf.Qwen3OmniMoeThinkerForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in [*model.model.language_model.named_parameters(), *model.lm_head.named_parameters()]:
            fresh = 1 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in name else \
                0.08 * torch.randn(p.shape, generator=gen)
            p.copy_(fresh)
    return model


@pytest.fixture(scope="module")
def hf_model():
    return hf_thinker()


@pytest.fixture(scope="module")
def published(hf_model, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The text decoder's tensors of the checkpoint transformers saves, by their published names."""
    from safetensors.torch import load_file

    out = tmp_path_factory.mktemp("thinker")
    hf_model.save_pretrained(out)
    tensors = {}
    for file in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return {n: t for n, t in tensors.items() if n == "lm_head.weight" or
            (n.startswith("model.") and not n.startswith(("model.visual.", "model.audio_tower.")))}


def build(state: dict[str, torch.Tensor], router=None) -> Qwen3OmniThinker:
    with torch.device("meta"):
        model = Qwen3OmniThinker(ThinkerConfig.from_hf(TINY_THINKER), router=router)
    model.load_state_dict(state, strict=True, assign=True)
    model.finish_load()
    return model.eval()


@pytest.fixture(scope="module")
def ours(published) -> Qwen3OmniThinker:
    return build(published)


def cache_for(model: Qwen3OmniThinker, slots: int = 1) -> StaticKVCache:
    cfg = model.config
    return StaticKVCache(n_layers=cfg.n_layers, n_kv_heads=model.local_kv_heads, head_dim=cfg.head_dim,
                         max_slots=slots, max_seq_len=128)


def run(model: Qwen3OmniThinker, ids: torch.Tensor, positions: torch.Tensor, **kwargs):
    """One prefill forward of (1, T) ids from position 0 of a fresh slot: the model's answer."""
    cache = cache_for(model)
    cache.bind([cache.alloc()], [0], ids.shape[-1])
    with torch.inference_mode():
        return model(ids, positions, cache, **kwargs)


def test_the_state_dict_holds_exactly_the_published_text_tensors(published) -> None:
    with torch.device("meta"):
        model = Qwen3OmniThinker(ThinkerConfig.from_hf(TINY_THINKER))
    assert set(model.state_dict()) == set(published)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in published and "model.layers.0.mlp.gate.weight" in published
    assert {n: tuple(t.shape) for n, t in model.state_dict().items()} == \
        {n: tuple(t.shape) for n, t in published.items()}
    assert model.checkpoint_sources()["lm_head.weight"] == ("thinker.lm_head.weight",)


def test_expert_parameters_are_views_of_the_fused_tensors_after_loading(ours, published) -> None:
    experts = ours.model.layers[0].mlp.experts
    gate = experts.get_submodule("2").gate_proj.weight
    assert gate.untyped_storage().data_ptr() == experts.w_gate_up.untyped_storage().data_ptr()
    torch.testing.assert_close(experts.w_gate_up[2, 32:], published["model.layers.0.mlp.experts.2.up_proj.weight"])


def test_text_only_logits_and_cached_decode_steps_match_transformers(hf_model, ours) -> None:
    ids = torch.tensor([prompt_ids([12], seed=3)])
    with torch.inference_mode():
        expect = hf_model(input_ids=ids).logits
    torch.testing.assert_close(run(ours, ids, torch.arange(12)[None]), expect, atol=ATOL, rtol=0)
    cache = cache_for(ours)
    slot = cache.alloc()
    with torch.inference_mode():  # a prefill of 8, then one token at a time through the cache
        cache.bind([slot], [0], 8)
        steps = [ours(ids[:, :8], torch.arange(8)[None], cache, last_only=True)[0, -1]]
        for pos in range(8, 12):
            cache.bind([slot], [pos], 1)
            steps.append(ours(ids[:, pos:pos + 1], torch.tensor([[pos]]), cache, last_only=True)[0, -1])
    torch.testing.assert_close(torch.stack(steps), expect[0, 7:], atol=ATOL, rtol=0)


MM_PARTS = [5, ("image", (1, 4, 6)), 3, ("audio", 180), 4]
"""Text, an image of 2 x 3 merged patches, text, an audio clip of 180 log-mel frames (23 tokens), text."""


def multimodal_inputs(hf_model, seed: int = 0) -> dict:
    """The MM_PARTS prompt with random image / audio embeddings and deepstack features; transformers' positions."""
    ids = torch.tensor([prompt_ids(MM_PARTS, seed=seed)])
    image_mask, audio_mask = ids == TOKENS["image_token_id"], ids == TOKENS["audio_token_id"]
    gen = torch.Generator().manual_seed(seed + 10)
    n_image, n_audio = int(image_mask.sum()), int(audio_mask.sum())
    positions, delta = hf_model.model.get_rope_index(ids, image_grid_thw=torch.tensor([[1, 4, 6]]),
                                                     attention_mask=torch.ones_like(ids),
                                                     audio_seqlens=torch.tensor([180]))
    return {"ids": ids, "image_mask": image_mask, "audio_mask": audio_mask,
            "image_emb": torch.randn(n_image, 64, generator=gen), "audio_emb": torch.randn(n_audio, 64, generator=gen),
            "deepstack": torch.randn(2, n_image, 64, generator=gen), "hf_positions": positions.long(),
            "hf_delta": int(delta)}


def hf_multimodal(hf_model, x: dict, ids: torch.Tensor | None = None, positions: torch.Tensor | None = None):
    """transformers' thinker text model on x's prompt (or a continuation ``ids`` of it): image and audio embeddings
    placed by its own masks (masked_scatter), deepstack at the image positions -> (logits, hidden_states)."""
    lm = hf_model.model.language_model
    ids = x["ids"] if ids is None else ids
    with torch.inference_mode():
        emb = lm.embed_tokens(ids)
        image, _, audio = hf_model.model.get_placeholder_mask(ids, inputs_embeds=emb)
        emb = emb.masked_scatter(image, x["image_emb"]).masked_scatter(audio, x["audio_emb"])
        out = lm(inputs_embeds=emb, position_ids=x["hf_positions"] if positions is None else positions,
                 visual_pos_masks=image[..., 0], deepstack_visual_embeds=list(x["deepstack"]),
                 output_hidden_states=True)
        return hf_model.lm_head(out.last_hidden_state), out.hidden_states


def test_a_prompt_with_an_image_deepstack_and_audio_matches_transformers(hf_model, ours) -> None:
    x = multimodal_inputs(hf_model)
    positions, delta = rope_index(x["ids"][0].tolist(), RopeTokens.from_hf(TINY_THINKER), [(1, 4, 6)], [180])
    assert torch.equal(torch.from_numpy(positions)[:, None], x["hf_positions"]) and delta == x["hf_delta"] < 0
    # one placement of both kinds (rows in prompt order: the image comes first) and two placements agree
    both = ours.embed_input(x["ids"], torch.cat([x["image_emb"], x["audio_emb"]]), x["image_mask"] | x["audio_mask"])
    apart = place(place(ours.embed_input(x["ids"]), x["image_emb"], x["image_mask"]), x["audio_emb"], x["audio_mask"])
    assert torch.equal(both, apart)
    expect, hidden = hf_multimodal(hf_model, x)
    logits, captured = run(ours, x["ids"], torch.from_numpy(positions)[:, None], inputs_embeds=both,
                           deepstack=x["deepstack"], visual_mask=x["image_mask"], capture=(0, 1))
    torch.testing.assert_close(logits, expect, atol=ATOL, rtol=0)
    for got, want in zip(captured, hidden[:2]):  # the input embeddings; layer 0's output before deepstack
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    without = run(ours, x["ids"], torch.from_numpy(positions)[:, None], inputs_embeds=both)
    assert (without - logits).abs().max() > 1e-3  # deepstack and M-RoPE are not no-ops here
    plain = run(ours, x["ids"], torch.arange(x["ids"].shape[1])[None], inputs_embeds=both,
                deepstack=x["deepstack"], visual_mask=x["image_mask"])
    assert (plain - logits).abs().max() > 1e-3


def greedy_hf_multimodal(hf_model, x: dict, steps: int) -> list[int]:
    """transformers' greedy continuation of x's prompt: the token at cache position p rotates by p + rope_delta
    on every axis, as its generate does after the prompt."""
    ids, positions, n = x["ids"], x["hf_positions"], x["ids"].shape[1]
    out = []
    for _ in range(steps):
        logits, _ = hf_multimodal(hf_model, x, ids, positions)
        token = int(logits[0, -1].argmax())
        out.append(token)
        nxt = torch.full((3, 1, 1), ids.shape[1] + x["hf_delta"])
        ids, positions = torch.cat([ids, torch.tensor([[token]])], 1), torch.cat([positions, nxt], 2)
    assert ids.shape[1] == n + steps
    return out


def engine(model: Qwen3OmniThinker, slots: int = 4) -> KVCacheEngine:
    return KVCacheEngine(model, cache_for(model, slots), torch.device("cpu"), PLAIN)


def decode(eng: KVCacheEngine, first: dict[str, int], steps: int) -> dict[str, list[int]]:
    """Greedy decode steps of the requests whose first tokens are ``first``, batched: every token per request."""
    out = {rid: [token] for rid, token in first.items()}
    for _ in range(steps):
        results = eng.run_batch([call(rid, {"token": torch.tensor([toks[-1]])}) for rid, toks in out.items()])
        for toks, result in zip(out.values(), results):
            if not isinstance(result, Held):  # a row that joined a lookahead launch brings its token next turn
                toks.append(int(result.outputs["token"]))
    return out


def test_the_kv_engine_runs_a_multimodal_prompt_beside_a_text_one_as_transformers_does(hf_model, ours) -> None:
    x = multimodal_inputs(hf_model, seed=1)
    positions, delta = rope_index(x["ids"][0].tolist(), RopeTokens.from_hf(TINY_THINKER), [(1, 4, 6)], [180])
    embeds = ours.embed_input(x["ids"], torch.cat([x["image_emb"], x["audio_emb"]]), x["image_mask"] | x["audio_mask"])
    text = torch.tensor(prompt_ids([10], seed=10))
    eng = engine(ours)
    mm, txt = eng.run_batch([
        call("mm", {"input_ids": x["ids"][0], "inputs_embeds": embeds, "position_ids": torch.from_numpy(positions),
                    "deepstack": x["deepstack"], "visual_mask": x["image_mask"], "position_offset": delta}),
        call("txt", {"input_ids": text})])
    assert eng.prefill_batches == 2  # the prompt with model inputs is a forward of its own
    tokens = decode(eng, {"mm": int(mm.outputs["token"]), "txt": int(txt.outputs["token"])}, steps=4)
    assert len(set(tokens["mm"])) > 2 and len(set(tokens["txt"])) > 2  # no greedy fixed point hides a drift
    assert tokens["mm"] == greedy_hf_multimodal(hf_model, x, steps=5)
    with torch.inference_mode():
        expect = hf_model.generate(input_ids=text[None], attention_mask=torch.ones(1, 10, dtype=torch.long),
                                   max_new_tokens=5, do_sample=False)[0, 10:].tolist()
    assert tokens["txt"] == expect


def test_greedy_text_decode_through_the_kv_engine_matches_transformers_generate(hf_model, ours) -> None:
    prompts = [torch.tensor(prompt_ids([n], seed=n)) for n in (8, 13)]
    eng = engine(ours)
    firsts = eng.run_batch([call(f"r{i}", {"input_ids": p}) for i, p in enumerate(prompts)])
    assert eng.prefill_batches == 1  # ragged text prompts share a forward (the top-k router keeps no state)
    tokens = decode(eng, {f"r{i}": int(r.outputs["token"]) for i, r in enumerate(firsts)}, steps=6)
    for i, p in enumerate(prompts):
        with torch.inference_mode():
            expect = hf_model.generate(input_ids=p[None], attention_mask=torch.ones(1, p.numel(), dtype=torch.long),
                                       max_new_tokens=7, do_sample=False)[0, p.numel():].tolist()
        assert tokens[f"r{i}"] == expect and len(set(expect)) > 2


def test_mrope_columns_interleave_the_axes_as_transformers_recomposes_them() -> None:
    transformers = pytest.importorskip("transformers", minversion="5.25")  # its in-memory names moved after 5.17
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextRotaryEmbedding

    text = transformers.Qwen3OmniMoeTextConfig(head_dim=128, hidden_size=64, num_attention_heads=4, rope_parameters={
        "rope_type": "default", "rope_theta": 1e6, "mrope_section": [24, 20, 20]})
    rotary = Qwen3OmniMoeThinkerTextRotaryEmbedding(text)
    axes = mrope_axes(128, (24, 20, 20))
    assert [axes[:64].count(a) for a in range(3)] == [24, 20, 20] and axes[:64] == axes[64:]
    tags = torch.tensor([0.0, 1.0, 2.0]).view(3, 1, 1, 1).expand(3, 1, 1, 64).clone()  # each axis tagged by its index
    assert rotary.recomposition_frequencies(tags)[0, 0].tolist() == [float(a) for a in axes]


def test_config_mistakes_name_the_key() -> None:
    text = dict(TINY_THINKER["text_config"])
    with pytest.raises(ValueError, match="mrope_section"):
        ThinkerConfig.from_hf({**text, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    with pytest.raises(ValueError, match="head_dim / 2 = 8"):
        ThinkerConfig.from_hf({**text, "rope_parameters": {"rope_type": "default", "mrope_section": [4, 2, 3]}})
    defaults = ThinkerConfig.from_hf({k: v for k, v in text.items() if k != "norm_topk_prob"}).text
    assert defaults.norm_topk_prob and defaults.rope_theta == 1e6  # transformers' defaults for this model


def test_bad_multimodal_inputs_are_value_errors(ours) -> None:
    ids = torch.tensor([prompt_ids([4, ("image", (1, 2, 2)), 2])])
    mask = ids == TOKENS["image_token_id"]
    with pytest.raises(ValueError, match="do not fill 1 placeholder"):
        ours.embed_input(ids, torch.zeros(2, 64), mask)
    with pytest.raises(ValueError, match="visual_mask"):
        run(ours, ids, torch.arange(ids.shape[1])[None], deepstack=torch.zeros(2, 1, 64))
    with pytest.raises(ValueError, match="capture"):
        run(ours, ids, torch.arange(ids.shape[1])[None], capture=(2,))


def test_a_stateful_router_makes_padding_not_inert(published) -> None:
    assert ours_pads(published, None) and not ours_pads(published, {"name": "load_biased", "strength": 1.0})


def ours_pads(published, router) -> bool:
    model = build(published, router=router)
    if router is not None:
        assert isinstance(model.model.layers[0].mlp.gate, LoadBiasedRouter)
    return model.pads_are_inert


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_decode_graphs_give_the_eager_tokens_of_a_multimodal_and_a_text_request() -> None:
    with torch.device("meta"):
        meta = Qwen3OmniThinker(ThinkerConfig.from_hf(TINY_THINKER))
    gen = torch.Generator().manual_seed(5)
    state = {n: (1 + 0.1 * torch.randn(t.shape, generator=gen)) if "norm" in n
             else 0.08 * torch.randn(t.shape, generator=gen) for n, t in meta.state_dict().items()}
    model = build({n: t.cuda() for n, t in state.items()})
    ids = torch.tensor(prompt_ids(MM_PARTS, seed=4))
    positions, delta = rope_index(ids.tolist(), RopeTokens.from_hf(TINY_THINKER), [(1, 4, 6)], [180])
    mask = (ids == TOKENS["image_token_id"])[None]
    embeds = torch.randn(1, ids.numel(), 64, generator=gen)
    deepstack = torch.randn(2, int(mask.sum()), 64, generator=gen)

    def tokens(graphs: bool) -> dict[str, list[int]]:
        cache = StaticKVCache(n_layers=2, n_kv_heads=2, head_dim=16, max_slots=5, max_seq_len=128, device="cuda")
        eng = KVCacheEngine(model, cache, torch.device("cuda"), EngineConfig(
            cuda_graphs=graphs, prefill_graphs=graphs, lookahead=graphs, prefill_in_flight=False, decode_yield_ms=0.0))
        eng.warmup()
        mm, txt = eng.run_batch([
            call("mm", {"input_ids": ids, "inputs_embeds": embeds, "position_ids": torch.from_numpy(positions),
                        "deepstack": deepstack, "visual_mask": mask, "position_offset": delta}),
            call("txt", {"input_ids": torch.tensor(prompt_ids([10], seed=10))})])
        return decode(eng, {"mm": int(mm.outputs["token"]), "txt": int(txt.outputs["token"])}, steps=6)

    eager, replayed = tokens(graphs=False), tokens(graphs=True)
    for rid in eager:  # with lookahead a request's tokens may come one step later: compare what both have
        assert replayed[rid] == eager[rid][:len(replayed[rid])] and len(replayed[rid]) >= len(eager[rid]) - 1
