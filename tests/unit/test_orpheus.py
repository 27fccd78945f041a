"""The Orpheus speech family against the published canopylabs/orpheus-3b-0.1-ft: a small checkpoint of its config
(scripts/make_speech_checkpoint.py --size small) that transformers' LlamaForCausalLM loads with no missing key, the
prompt Orpheus-TTS builds (its hard-coded ids), and its model card's sampling as the family's defaults.

A failure here means the family would not serve the published checkpoint as Orpheus's own code does: another
prompt, other special-token ids, a checkpoint layout transformers does not read, or sampling other than the model
card's where a request leaves the knobs out.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models.llama.speech_tokens import SpeechTokens
from models.speech.checkpoint import write_speech_family
from models.speech.orpheus import MAX_TOKENS, SAMPLING_DEFAULTS, OrpheusSpeech
from mstar_dist.conductor.request import wire_sampling
from mstar_dist.engine.sampling import SamplingParams
from mstar_dist.events import GenerationParams
from mstar_dist.graph.model import RequestState

START_OF_HUMAN, BOS, EOT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH, END_OF_SPEECH = \
    128259, 128000, 128009, 128260, 128261, 128257, 128258
"""The ids Orpheus-TTS's engine_class.py hard-codes (and its Colab's end of generation)."""
AUDIO_OFFSET = 128266
"""<custom_token_10>: Orpheus's decoder subtracts 10 + 4096 x the position in the frame from <custom_token_N>."""


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_speech_family(tmp_path_factory.mktemp("orpheus") / "small", "small", 0)


@pytest.fixture(scope="module")
def frontend(small: Path) -> OrpheusSpeech:
    model = OrpheusSpeech(str(small))
    model.load_frontend()
    return model


def test_small_checkpoint_has_the_published_config_and_ids(small: Path) -> None:
    config = json.loads((small / "config.json").read_text())
    assert config["vocab_size"] == 156940 and config["tie_word_embeddings"] is True
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert (config["rope_theta"], config["max_position_embeddings"]) == (500000.0, 131072)
    assert config["num_attention_heads"] // config["num_key_value_heads"] == 3  # as 24 / 8
    tokens = SpeechTokens.from_tokenizer_dir(small, 4096)
    assert (tokens.start_of_human, tokens.begin_of_text, tokens.end_of_text, tokens.end_of_human,
            tokens.start_of_ai, tokens.start_of_speech, tokens.end_of_speech, tokens.audio_offset) == \
        (START_OF_HUMAN, BOS, EOT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH, END_OF_SPEECH, AUDIO_OFFSET)
    assert tokens.audio_token(4095, 6) == AUDIO_OFFSET + 6 * 4096 + 4095 == 156940 - 3  # the last code fits


@torch.inference_mode()
def test_transformers_loads_it_with_no_missing_key_and_the_same_logits(small: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from models.llama.weights import load_llama
    from mstar_dist.engine.kv_cache import StaticKVCache

    hf, info = transformers.LlamaForCausalLM.from_pretrained(small, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert hf.config.rope_scaling["rope_type"] == "llama3" and hf.lm_head.weight is hf.model.embed_tokens.weight
    ids = torch.tensor([SpeechTokens.from_tokenizer_dir(small, 4096).prompt_ids("tara", "Hello there.")])
    ours, config = load_llama(small)
    cache = StaticKVCache(n_layers=config.n_layers, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
                          max_slots=1, max_seq_len=ids.shape[1])
    cache.bind([cache.alloc()], [0], ids.shape[1])
    torch.testing.assert_close(ours(ids, torch.arange(ids.shape[1])[None], cache), hf(ids).logits,
                               atol=1e-4, rtol=1e-4)


def test_the_prompt_is_orpheus_tts_s(small: Path, frontend: OrpheusSpeech) -> None:
    """engine_class.py: [128259] + tokenizer("{voice}: {text}") (which starts with <|begin_of_text|>) +
    [128009, 128260, 128261, 128257]."""
    from tokenizers import Tokenizer

    # what transformers' fast tokenizer call runs (its post-processor adds <|begin_of_text|>); AutoTokenizer itself
    # reads the same tokenizer.json (tests/unit/test_speech_tokens.py compares the two on the tiny checkpoint)
    hf_tok = Tokenizer.from_file(str(small / "tokenizer.json"))
    text = "tara: Hi, how are you? <laugh>"
    theirs = [START_OF_HUMAN, *hf_tok.encode(text).ids, EOT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH]
    assert theirs[1] == BOS
    model = frontend
    state = request_state(model, GenerationParams(request_id="r", prompt="Hi, how are you? <laugh>", messages=None,
                                                  max_tokens=50, model_kwargs={"voice": "tara"}))
    assert state.data["input_ids"].tolist() == theirs
    assert model.stop_token_ids() == [END_OF_SPEECH]


def request_state(model: OrpheusSpeech, params: GenerationParams) -> RequestState:
    state = RequestState(request_id=params.request_id, seed=0, max_tokens=params.max_tokens,
                         max_tokens_given=params.max_tokens_given, knobs=dict(params.model_kwargs), params=params)
    model.preprocess(state, params.prompt, params.messages)
    return state


def test_the_model_card_s_sampling_fills_the_knobs_a_request_leaves_out(frontend: OrpheusSpeech) -> None:
    assert SAMPLING_DEFAULTS == {"temperature": 0.6, "top_p": 0.95, "repetition_penalty": 1.1} and MAX_TOKENS == 1200
    model = frontend

    def walk_knobs(**fields) -> tuple[SamplingParams, RequestState]:
        params = GenerationParams(request_id="r", prompt="Hello.", messages=None, max_tokens=4000,
                                  max_tokens_given=False, model_kwargs={}, **fields)
        state = request_state(model, params)
        return SamplingParams.of(wire_sampling(params, state.sampling_defaults, 0), None), state

    bare, state = walk_knobs(sampling_given=())
    assert (bare.temperature, bare.top_p, bare.repetition_penalty, bare.top_k) == (0.6, 0.95, 1.1, 0)
    assert state.max_tokens == MAX_TOKENS and state.penalized
    # written knobs win, even at the value that turns them off; the others keep the card's
    own, state = walk_knobs(temperature=1.0, repetition_penalty=1.0, min_p=0.1,
                            sampling_given=("temperature", "repetition_penalty", "min_p"))
    assert (own.temperature, own.top_p, own.repetition_penalty, own.min_p) == (1.0, 0.95, 1.0, 0.1)
    assert not state.penalized
    # a caller that does not say which knobs it wrote: a knob at its neutral value takes the card's
    legacy, _ = walk_knobs(temperature=0.8)
    assert (legacy.temperature, legacy.top_p, legacy.repetition_penalty) == (0.8, 0.95, 1.1)
    params = GenerationParams(request_id="r", prompt="Hello.", messages=None, max_tokens=1500, model_kwargs={})
    assert request_state(model, params).max_tokens == 1500  # a budget the client named is its own


def test_the_small_checkpoint_speaks_through_the_family(small: Path) -> None:
    """Served in process (conductor and worker, tests/inproc.py): codes of the published layout become audio."""
    from mstar_dist.config.deployment import parse_config
    from mstar_dist.events import Finished, MediaDelta
    from mstar_dist.graph.model import Layout
    from tests.inproc import InProcDeployment

    groups = [{"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill", "decode"]},
              {"node_names": ["CODEC"], "ranks": [0], "graph_walks": ["codec"]}]
    cfg = {"model": "orpheus", "weights": str(small), "node_groups": groups}
    model = OrpheusSpeech(str(small))
    model.configure(Layout.from_node_groups(parse_config(cfg, "test").node_groups))
    model.load_frontend()
    (events,) = InProcDeployment(model, cfg, 1).run([GenerationParams(
        request_id="s", prompt="Hello there.", messages=None, max_tokens=35, seed=3,
        model_kwargs={"voice": "tara"})], max_turns=100_000)
    end = events[-1]
    assert isinstance(end, Finished), end
    pcm = b"".join(e.data for e in events if isinstance(e, MediaDelta))
    codes = end.completion_tokens - (1 if end.finish_reason == "stop" else 0)
    assert len(pcm) == 2 * 2048 * (codes // 7)
