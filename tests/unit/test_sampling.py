"""sample() and SamplingParams.

A failure here means a user would see: temperature 0 not being deterministic, a pinned seed giving a
different text depending on which other requests share the batch, top-k/top-p letting through tokens
they should cut, or bad request parameters accepted instead of rejected with the field's name.
"""

from __future__ import annotations

import pytest
import torch

from mstar_dist.engine.sampling import SamplingParams, make_generator, sample, seeded

V = 49152  # SmolLM2's vocabulary: wide enough for the top-p first-guess path


def logits(rows: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_is_argmax_and_needs_no_generator() -> None:
    x = logits(4)
    params = [SamplingParams(temperature=0)] * 4
    assert torch.equal(sample(x, params, [None] * 4), x.argmax(-1))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=7),
    SamplingParams(temperature=1.0, top_p=0.9, seed=7),
    SamplingParams(temperature=1.2, top_k=40, top_p=0.95, seed=7),
    SamplingParams(temperature=5.0, top_p=0.99, seed=7),  # flat: the nucleus exceeds the first guess
], ids=["temperature", "top_p", "top_k+top_p", "wide-nucleus"])
def test_seeded_row_is_independent_of_batch(params: SamplingParams) -> None:
    steps = [logits(1, seed=100 + i)[0] for i in range(8)]
    gen = make_generator(params)
    alone = [int(sample(x[None], [params], [gen])[0]) for x in steps]

    others = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5, seed=1),
              SamplingParams(temperature=1.0, top_p=0.5)]
    gens = [None, make_generator(others[1]), make_generator(others[2])]
    gen = make_generator(params)
    in_batch = []
    for i, x in enumerate(steps):
        batch = torch.cat([logits(3, seed=200 + i), x[None]])[[0, 3, 1, 2]]  # our row sits second
        in_batch.append(int(sample(batch, [others[0], params, others[1], others[2]],
                                   [gens[0], gen, gens[1], gens[2]])[1]))
    assert alone == in_batch
    assert len(set(alone)) > 1  # it really sampled


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    x = logits(1, scale=1.0)
    def draw(seed: int) -> list[int]:
        p = SamplingParams(temperature=1.0, seed=seed)
        g = make_generator(p)
        return [int(sample(x, [p], [g])[0]) for _ in range(20)]
    assert draw(3) == draw(3)
    assert draw(3) != draw(4)


def test_top_k_1_is_greedy() -> None:
    x = logits(5)
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(5)]
    assert torch.equal(sample(x, params, [make_generator(p) for p in params]), x.argmax(-1))


def test_tiny_top_p_is_greedy() -> None:
    x = logits(3)
    params = [SamplingParams(temperature=1.0, top_p=1e-6, seed=i) for i in range(3)]
    assert torch.equal(sample(x, params, [make_generator(p) for p in params]), x.argmax(-1))


def test_top_k_and_top_p_cut_exactly() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    x = probs.log()[None]
    for params, allowed in [(SamplingParams(top_p=0.8, seed=0), {0, 1}),   # mass before token 2 is 0.8
                            (SamplingParams(top_p=0.81, seed=0), {0, 1, 2}),
                            (SamplingParams(top_k=3, seed=0), {0, 1, 2}),
                            (SamplingParams(top_k=3, top_p=0.6, seed=0), {0, 1})]:  # 0.5/0.95 < 0.6
        g = make_generator(params)
        seen = {int(sample(x, [params], [g])[0]) for _ in range(300)}
        assert seen == allowed, params


def test_frequencies_follow_probabilities() -> None:
    x = torch.tensor([[0.0, 1.0, 2.0]])
    p = SamplingParams(temperature=1.0, seed=5)
    g = make_generator(p)
    counts = torch.bincount(torch.stack([sample(x, [p], [g])[0] for _ in range(3000)]), minlength=3)
    torch.testing.assert_close(counts / 3000, x[0].softmax(0), atol=0.03, rtol=0)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"),
    ({"seed": -1}, "seed"), ({"seed": "7"}, "seed"),
    ({"min_p": 1.5}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"min_tokens": -1}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"guided": "json"}, "guided"),
])
def test_bad_params_raise_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} ") as err:
        SamplingParams(**kwargs)
    assert repr(kwargs[field]) in str(err.value)


def test_mismatched_lengths_raise() -> None:
    with pytest.raises(ValueError, match="2 params"):
        sample(logits(3, vocab=10), [SamplingParams()] * 2, [None] * 3)


def test_a_request_s_knobs_become_a_walk_s_parameters_in_one_place_and_go_back_as_sent() -> None:
    """Every shape a request's knobs travel in (the conductor's GenerationParams, the wire's Sampling, a TP call) has
    the three knobs; the walk's seed comes apart. A bad knob is refused naming it, whichever shape brought it."""
    from mstar_dist.control.messages import Sampling
    from mstar_dist.events import GenerationParams

    from mstar_dist.events import GuidedSpec

    wire = Sampling(temperature=0.7, top_p=0.9, top_k=20)
    params = SamplingParams.of(wire, seed=11)
    assert params == SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=11)
    assert Sampling(**params.knobs()) == wire
    assert not params.extras  # a request with none of the knobs beyond the draw takes none of their work
    every = Sampling(temperature=0.5, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.5,
                     min_tokens=3, logprobs=4, prompt_logprobs=1, guided=GuidedSpec("regex", "a+"))
    assert Sampling(**SamplingParams.of(every, seed=1).knobs()) == every
    assert SamplingParams.of(every, seed=1).extras and SamplingParams.of(every, seed=1).penalized
    request = GenerationParams(request_id="r", prompt="hi", messages=None, max_tokens=4, temperature=0.0, top_k=3)
    assert SamplingParams.of(request, seed=None) == SamplingParams(temperature=0.0, top_k=3)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams.of(Sampling(top_p=0.0), seed=1)
    a, b = seeded(5), make_generator(SamplingParams(seed=5))
    assert torch.equal(torch.rand(3, generator=a), torch.rand(3, generator=b))
