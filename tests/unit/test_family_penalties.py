"""The sampling knobs in every family that samples: each family's own ``LLM`` engine (``build_component``, with the
family's logit bias) decodes greedily with repetition, presence and frequency penalties and min-p, and gives the
tokens of transformers' model of the same checkpoint with HF's ``RepetitionPenaltyLogitsProcessor`` and vLLM's
presence and frequency penalties (``tests/unit/test_logits.py``'s reference) applied to the same logits.

A failure here means a family's engine drops or changes a request's knobs (a family that builds its engine without
them, a logit bias that hides the penalties, another model than transformers' reads the checkpoint).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mstar_dist.config.engine import EngineConfig
from mstar_dist.engine.sampling import SamplingParams
from tests.unit.test_logits import answered, call, tokens, vllm_penalties

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_intraop_thread")

ENGINE = EngineConfig(cuda_graphs=False, prefill_graphs=False, lookahead=False, prefill_in_flight=False,
                      decode_yield_ms=0.0, max_seq_len=64, max_batch=4)
KNOBS = dict(temperature=0.0, repetition_penalty=1.6, presence_penalty=0.4, frequency_penalty=0.7, min_p=0.2)
STEPS = 8


def llama(root: Path):
    from models.llama.chat import LlamaChat
    from models.speech.checkpoint import make_speech_checkpoint

    make_speech_checkpoint(root, "tiny", seed=2, codebook_size=None)  # a Llama-3.2-layout checkpoint
    return LlamaChat(str(root)), transformers.LlamaForCausalLM


def moe(root: Path):
    from models.moe.chat import MoEChat
    from models.moe.checkpoint import make_moe_checkpoint

    make_moe_checkpoint(root, seed=2, writer="transformers")
    return MoEChat(str(root)), transformers.Qwen3MoeForCausalLM


def orpheus(root: Path):
    from models.speech.checkpoint import write_speech_family
    from models.speech.orpheus import OrpheusSpeech

    write_speech_family(root, "tiny", 2)
    return OrpheusSpeech(str(root)), transformers.LlamaForCausalLM


@pytest.mark.parametrize("family", [llama, moe, orpheus], ids=lambda f: f.__name__)
@torch.inference_mode()
def test_the_knobs_give_transformers_tokens_with_hf_s_processors(family, tmp_path: Path) -> None:
    model, hf_class = family(tmp_path / "ckpt")
    model.configure(model.layout, ENGINE)
    eng = model.build_component("LLM", device="cpu", walks={"prefill", "decode"}, engine=replace(ENGINE))
    hf = hf_class.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    bias = eng.logit_bias if eng.logit_bias is not None else torch.zeros(hf.config.vocab_size)
    prompt = torch.randint(100, (9,), generator=torch.Generator().manual_seed(5))
    want = reference(hf, bias, prompt.tolist())
    params = SamplingParams(**KNOBS)
    first = answered(eng, [call("p", {"input_ids": prompt}, params)])[0]
    got = [first]
    for k in range(STEPS):
        step = call("p", {"token": got[-1].outputs["token"]}, params, iteration=k, state=None)
        got.append(answered(eng, [step])[0])
    assert tokens(got) == want, (tokens(got), want)
    plain = reference(hf, bias, prompt.tolist(), knobs=False)
    assert want != plain  # the knobs change this greedy decode: the comparison is not vacuous


def reference(hf, bias: torch.Tensor, prompt: list[int], knobs: bool = True) -> list[int]:
    """Greedy tokens from transformers' logits of the whole sequence, each step through the family's bias, vLLM's
    penalties (``vllm_penalties``: the repetition penalty over prompt and output, checked equal to HF's processor
    where the output is empty; presence and frequency over the output) and HF's min-p."""
    from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

    seq, made = list(prompt), []
    for _ in range(STEPS + 1):
        logits = hf(torch.tensor([seq])).logits[0, -1].float() + bias
        if knobs:
            hf_rep = RepetitionPenaltyLogitsProcessor(KNOBS["repetition_penalty"])(torch.tensor([seq]), logits[None])
            penalized = vllm_penalties(logits, prompt, made, KNOBS["repetition_penalty"], KNOBS["presence_penalty"],
                                       KNOBS["frequency_penalty"])
            if not made:  # no output yet: vLLM's definition is HF's repetition penalty alone
                torch.testing.assert_close(penalized, hf_rep[0], atol=0, rtol=0)
            logits = MinPLogitsWarper(KNOBS["min_p"])(None, penalized[None])[0]
        made.append(int(logits.argmax()))
        seq.append(made[-1])
    return made
