"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, one seeded generator per request.

The one place where a request's sampling knobs become what the device draws with: `SamplingParams.of` turns the knobs
a request carries (``GenerationParams``, the wire's ``control.messages.Sampling``, a TP call's) and its walk's seed
into a walk's `SamplingParams`; `sample` turns the rows' parameters into per-row tensors on the device and draws;
`seeded` turns a seed into a generator (the engine's, and a family's own noise). Every family's tokens go through
`sample` (the KV engine calls it); no family reads temperature, top-p or top-k itself. The knobs that change the
logits before the draw (penalties, ``min_tokens``, a grammar) and the logprobs a row returns are the KV engine's
(engine/logits.py, engine/grammar.py), from the same `SamplingParams`; a row that uses none of them
(``SamplingParams.extras`` False) costs what it cost before they existed.

A row's token depends only on its own logits, parameters and generator - never on which other requests
share the batch - so a pinned seed gives the same text whatever the batching. To keep that exact, the
filtering of sampled rows runs per row (the width of every tensor a row touches is a function of that row
alone); greedy rows are one batched argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

_NUCLEUS_GUESS = 1024
"""top-p first tries the 1024 most likely tokens (on a CPU a topk of them is far cheaper than sorting a whole
vocabulary of tens of thousands)."""


MAX_LOGPROBS = 20
"""The most alternatives a request may ask for per token (``logprobs``, ``prompt_logprobs``), as vLLM's default."""
KNOBS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
         "min_tokens", "logprobs", "prompt_logprobs", "guided")
"""The request's knobs a `SamplingParams` is made of (``of``) and gives back (``knobs``), by their one name."""


class SamplingKnobs(Protocol):
    """A request's sampling knobs as any layer carries them (validated where they enter: the HTTP models, and
    `SamplingParams` itself on the conductor before anything runs). The knobs after ``top_k`` may be absent (a
    family's own knobs object): they then take `SamplingParams`' defaults."""

    temperature: float
    top_p: float
    top_k: int


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
    min_p: float = 0.0
    """Drawn rows keep only tokens whose probability is at least min_p x the row's most likely one's (after
    temperature, before top-k/top-p, as vLLM). In [0, 1]; 0 = off."""
    repetition_penalty: float = 1.0
    """Logits of tokens in the prompt or the output so far: divided by it when positive, multiplied when negative
    (HF's and vLLM's). > 0; 1 = off."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token the output contains (OpenAI's). In [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per occurrence in the output (OpenAI's). In [-2, 2]."""
    min_tokens: int = 0
    """This walk's first ``min_tokens`` tokens cannot be one of the walk's stop tokens (their logits are -inf)."""
    logprobs: int | None = None
    """Each token of the walk comes with its logprob and the ``logprobs`` most likely alternatives' (0: its own
    only; None: none), computed from the logits before any knob changes them. 0 to ``MAX_LOGPROBS``."""
    prompt_logprobs: int | None = None
    """A prefill also returns the logprob of each prompt token after the first, with as many alternatives."""
    guided: Any = None
    """A structured-output spec (``events.GuidedSpec``: kind and spec): tokens that leave its grammar are masked."""
    penalized: bool = field(init=False, repr=False, compare=False)
    """Some penalty is on (the row's prompt and output are kept on the device: engine/logits.py)."""
    extras: bool = field(init=False, repr=False, compare=False)
    """Some knob beyond temperature, top-k, top-p and min-p is on: the engine's per-row work of engine/logits.py
    runs for this row (off: the row costs what a plain draw costs)."""

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
        self._check_extras()
        penalized = self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
        object.__setattr__(self, "penalized", penalized)
        object.__setattr__(self, "extras", penalized or self.min_tokens > 0 or self.guided is not None
                           or self.logprobs is not None or self.prompt_logprobs is not None)

    def _check_extras(self) -> None:
        """ValueError naming the knob for a value out of its range."""
        for name, low, high in (("min_p", 0, 1), ("presence_penalty", -2, 2), ("frequency_penalty", -2, 2),
                                ("repetition_penalty", 0, math.inf)):
            v = getattr(self, name)
            number = not isinstance(v, bool) and isinstance(v, (int, float))
            if not (number and low <= v <= high) or (high == math.inf and not 0 < v < high):
                span = "> 0 and finite" if high == math.inf else f"in [{low}, {high}]"
                raise ValueError(f"SamplingParams.{name} must be a number {span}, got {v!r}")
        m = self.min_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"SamplingParams.min_tokens must be an int >= 0, got {m!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"SamplingParams.{name} must be None or an int in [0, {MAX_LOGPROBS}], got {k!r}")
        g = self.guided
        if g is not None and not (isinstance(getattr(g, "kind", None), str) and isinstance(getattr(g, "spec", None),
                                                                                            str)):
            raise ValueError(f"SamplingParams.guided must be None or a GuidedSpec (kind, spec), got {g!r}")

    @classmethod
    def of(cls, knobs: SamplingKnobs, seed: int | None) -> SamplingParams:
        """A walk's parameters: the request's ``knobs`` and the walk's ``seed`` (docs/architecture.md §4)."""
        return cls(**{name: getattr(knobs, name) for name in KNOBS if hasattr(knobs, name)}, seed=seed)

    def knobs(self) -> dict[str, Any]:
        """The request's knobs these were made of (``control.messages.Sampling(**params.knobs())`` on the wire: the
        seed travels apart, as the walk's)."""
        return {name: getattr(self, name) for name in KNOBS}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def seeded(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (an int in [0, 2**64)), or from OS entropy when it is None."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one request: seeded with params.seed, or from OS entropy when it is None."""
    return seeded(params.seed, device)


def to_device(values: list | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host list or tensor on ``device`` without a stream sync: on CUDA through pinned memory and an
    asynchronous copy (a plain ``torch.tensor(..., device=cuda)`` waits for every kernel queued before it, which
    would stall a decode step launched ahead, see kv_engine)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values)
    if device.type != "cuda":
        return t.to(device)
    if t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits (B, V) -> next tokens (B,) long, on logits' device.

    Greedy rows take the argmax. Sampled rows are drawn together, vectorised on the device: temperature, top-k and
    top-p per row, then inverse CDF with one uniform per row drawn from generators[b] (best a CPU generator: the
    draw is then no device launch; None: the default CPU generator). A row's token depends only on its own logits,
    parameters and generator, never on the other rows of the batch. Nothing here waits for the device: every
    decision is taken from the parameters on the host.
    """
    if logits.dim() != 2 or not len(params) == len(generators) == logits.shape[0]:
        raise ValueError(f"sample: logits must be (B, V) with B params and generators, got "
                         f"{tuple(logits.shape)}, {len(params)} params, {len(generators)} generators")
    tokens = logits.argmax(dim=-1)  # greedy for every row; sampled rows are overwritten
    rows = [b for b, p in enumerate(params) if not p.greedy]
    if rows:
        device = logits.device
        u = torch.stack([torch.rand((), generator=generators[b], device=_gen_device(generators[b]))
                         .to("cpu") for b in rows])
        index = None if len(rows) == len(params) else to_device(rows, device)
        picked = _sample_rows((logits if index is None else logits[index]).float(), [params[b] for b in rows],
                              to_device(u, device))
        if index is None:
            tokens = picked
        else:
            tokens[index] = picked
    return tokens


def _gen_device(gen: torch.Generator | None) -> torch.device | str:
    return gen.device if gen is not None else "cpu"


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """logits (R, V) fp32, uniforms u (R,) -> tokens (R,). Rows without top-k/top-p draw over the vocabulary in
    its order; the others over their candidates sorted most likely first. Either way a row's numbers do not
    depend on the other rows (normalisers are per row, over the row's own top-k set, in vocabulary order)."""
    device, vocab = logits.device, logits.shape[1]
    x = logits / to_device([float(p.temperature) for p in params], device)[:, None]
    if any(p.min_p > 0 for p in params):
        x = min_p_filtered(x, [p.min_p for p in params])
    plain = [i for i, p in enumerate(params) if not (0 < p.top_k < vocab) and p.top_p >= 1]
    if len(plain) == len(params):
        return _sample_plain(x, u)
    if not plain:
        return _sample_cut(x, params, u)
    cut = [i for i in range(len(params)) if i not in set(plain)]
    tokens = torch.empty(len(params), dtype=torch.long, device=device)
    at_plain, at_cut = to_device(plain, device), to_device(cut, device)
    tokens[at_plain] = _sample_plain(x[at_plain], u[at_plain])
    tokens[at_cut] = _sample_cut(x[at_cut], [params[i] for i in cut], u[at_cut])
    return tokens


def _sample_plain(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Rows drawn over the whole vocabulary in its order: x (R, V) tempered logits -> tokens (R,)."""
    cdf = x.softmax(dim=-1).cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (u[:, None] * cdf[:, -1:]).contiguous(), right=True)[:, 0]
    return pick.clamp(max=x.shape[1] - 1)


def _sample_cut(x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Rows with top-k and/or top-p: x (R, V) tempered logits -> tokens (R,)."""
    device, vocab = x.device, x.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    k = to_device(ks, device)[:, None]
    top_p = to_device([float(p.top_p) for p in params], device)[:, None]
    width = max(ks)
    masked = _top_k_masked(x, k, width) if min(ks) < vocab else x
    log_total = torch.logsumexp(masked, dim=-1, keepdim=True)  # the row's top-k mass, in vocabulary order
    if width > _NUCLEUS_GUESS and all(p.top_p < 1 for p in params) and device.type == "cpu":
        # On a CPU a sort of the whole vocabulary costs far more than a topk(1024); the check reads the device, so on
        # a GPU (where the sort is cheap and a sync is not) the whole vocabulary is sorted instead.
        guess = x.topk(_NUCLEUS_GUESS, dim=-1).values
        if bool((torch.logsumexp(guess, dim=-1, keepdim=True) - log_total >= torch.log(top_p)).all()):
            width = _NUCLEUS_GUESS  # every nucleus fits in the guess: no sort of the whole vocabulary
    vals, candidates = x.topk(width, dim=-1)  # (R, width), most likely first
    ranks = torch.arange(width, device=device)[None]
    probs = (vals - log_total).exp() * (ranks < k)
    # the first token always stays (a top_p that rounds to 0 in fp32 keeps it alone: greedy)
    keep = (((probs.cumsum(dim=-1) - probs) < top_p) | (ranks == 0)) & (ranks < k)
    probs = probs * keep
    cdf = probs.cumsum(dim=-1)
    # first index whose cdf exceeds u * mass; the clamp guards u * mass rounding up to the full mass
    pick = torch.searchsorted(cdf, (u[:, None] * cdf[:, -1:]).contiguous(), right=True)[:, 0]
    pick = torch.minimum(pick, keep.sum(dim=-1) - 1)
    return candidates.gather(1, pick[:, None])[:, 0]


def _top_k_masked(x: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """x (R, V) with everything below each row's k-th largest value set to -inf (k (R, 1), at most ``k_max``;
    k = V keeps all)."""
    kth = x.topk(k_max, dim=-1).values.gather(1, k - 1)
    return x.masked_fill(x < kth, float("-inf"))


def min_p_filtered(x: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """x (R, V) tempered logits with every token whose probability is below ``min_p[r]`` x the row's most likely
    one's set to -inf (HF's ``MinPLogitsWarper``, vLLM's min-p): p / p_max < min_p is x - x_max < log(min_p)."""
    floor = to_device([math.log(p) if p > 0 else -math.inf for p in min_p], x.device)
    return x.masked_fill(x < x.amax(dim=-1, keepdim=True) + floor[:, None], float("-inf"))


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logits (R, V), the tokens drawn (R,) -> (R, 1 + k, 2) float64 on logits' device: [r, 0] = (token id, its
    logprob), [r, 1:] = the k most likely (id, logprob), most likely first. Logprobs are the log-softmax of these
    logits in fp32; ids ride as float64 (exact below 2**53). One log-softmax and one topk for the whole batch."""
    lp = logits.float().log_softmax(dim=-1)
    chosen = torch.stack([tokens.double(), lp.gather(1, tokens[:, None].long())[:, 0].double()], dim=-1)[:, None]
    if k == 0:
        return chosen
    top = lp.topk(k, dim=-1)
    return torch.cat([chosen, torch.stack([top.indices.double(), top.values.double()], dim=-1)], dim=1)
