"""Next-token sampling: greedy, temperature, top-k, top-p, one seeded generator per request.

A row's token depends only on its own logits, parameters and generator - never on which other requests
share the batch - so a pinned seed gives the same text whatever the batching. To keep that exact, the
filtering of sampled rows runs per row (the width of every tensor a row touches is a function of that row
alone); greedy rows are one batched argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_NUCLEUS_GUESS = 1024
"""top-p first tries the 1024 most likely tokens (a topk is ~70x cheaper than sorting a 49k vocabulary)."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 = greedy (argmax); otherwise the logits are divided by it. Finite, >= 0."""
    top_p: float = 1.0
    """Nucleus sampling: keep the most likely tokens until their mass reaches top_p. In (0, 1]; 1 = off."""
    top_k: int = 0
    """Keep only the k most likely tokens (applied before top_p). >= 0; 0 = off."""
    seed: int | None = None
    """Seed of the request's generator (see make_generator); None = nondeterministic."""

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {p!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0, got {k!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**64):
            raise ValueError(f"SamplingParams.seed must be None or an int in [0, 2**64), got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one request: seeded with params.seed, or from OS entropy when it is None."""
    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits (B, V) -> next tokens (B,) long, on logits' device.

    Row b uses params[b] and draws one uniform number from generators[b] if it samples (None: the
    device's default generator; greedy rows draw nothing, so their generator may be None).
    """
    if logits.dim() != 2 or not len(params) == len(generators) == logits.shape[0]:
        raise ValueError(f"sample: logits must be (B, V) with B params and generators, got "
                         f"{tuple(logits.shape)}, {len(params)} params, {len(generators)} generators")
    tokens = logits.argmax(dim=-1)  # greedy for every row; sampled rows are overwritten
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy:
            tokens[row] = _sample_row(logits[row].float(), p, gen)
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    """logits (V,) fp32 -> a 0-d token id drawn by inverse CDF with one uniform from `gen`."""
    x = logits / p.temperature
    vocab = x.shape[0]
    k = p.top_k if 0 < p.top_k < vocab else vocab
    candidates: torch.Tensor | None = None  # vocabulary ids of `probs`, most likely first; None = all, in order
    if p.top_p < 1 and k > _NUCLEUS_GUESS:
        # Normalise against the top-k distribution, then check the nucleus fits in the first guess.
        log_total = torch.logsumexp(x if k == vocab else x.topk(k).values, dim=0)
        vals, candidates = x.topk(_NUCLEUS_GUESS)
        if torch.logsumexp(vals, dim=0) - log_total < math.log(p.top_p):
            vals, candidates = x.topk(k)  # a flat distribution: the nucleus is wider than the guess
        probs = (vals - log_total).exp()
    elif k < vocab or p.top_p < 1:
        vals, candidates = x.topk(k)
        probs = vals.softmax(dim=0)
    else:
        probs = x.softmax(dim=0)
    n_kept = torch.tensor(probs.shape[0], device=probs.device)
    if p.top_p < 1:  # probs are sorted: keep the prefix whose mass before each token is < top_p
        keep = (probs.cumsum(dim=0) - probs) < p.top_p  # the first token always stays
        probs, n_kept = probs * keep, keep.sum()
    cdf = probs.cumsum(dim=0)
    u = torch.rand((), generator=gen, device=gen.device if gen is not None else cdf.device).to(cdf.device)
    # First index whose cdf exceeds u * mass; the clamp guards u * mass rounding up to the full mass.
    pick = torch.minimum(torch.searchsorted(cdf, u * cdf[-1], right=True), n_kept - 1)
    return pick if candidates is None else candidates[pick]
