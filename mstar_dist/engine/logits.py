"""What the KV engine does with a forward's logits beside the draw (docs/architecture.md §8, "Sampling"): the
penalties, ``min_tokens`` and grammar masks applied before it, and the logprobs a row returns after it.

Only rows whose ``SamplingParams.extras`` is on take part, and the engine asks (`RowExtras.prepare`) only while a
request with extras holds a slot on it (``live``), so traffic that uses none of these knobs pays one set test per
forward. Everything a row needs is batched: each kind of work is one batched op over the rows that need it, with the
rows' parameters uploaded as tensors through pinned memory (``sampling.to_device``).

Penalties read each row's prompt and output tokens on the device: a (slots, max_seq_len) table of token ids, row =
the request's KV slot, column = position, written where the KV cache is written (the prompt at the prefill or the
KV import, a decode step's input token at the position that step writes). A dropped lookahead row wrote where its
request has not reached yet, as its KV did: the table stays right for the reason the cache does. Repetition
penalties count prompt and output (vLLM, HF); presence and frequency penalties the output only (vLLM, OpenAI).

Logprobs are the log-softmax of the logits as the model (and the family's fixed ``logit_bias``) gave them, before
penalties, masks and temperature: vLLM's default ("raw" logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mstar_dist.engine.grammar import GuidedRows, apply_mask
from mstar_dist.engine.sampling import logprobs_of, sample, to_device

NEG_INF = float("-inf")


@dataclass
class Logprobs:
    """One forward's logprob tables (``sampling.logprobs_of``'s layout), on the device until `to_host` queued their
    copy (complete with the forward's tokens)."""

    table: torch.Tensor | None
    """(rows asking, 1 + k, 2): each asking row's token and the k most likely, k the batch's largest."""
    rows: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Row of the forward -> (its row of ``table``, the k it asked for)."""
    prompt: torch.Tensor | None = None
    """(T - 1, 1 + k, 2): a prefill's prompt logprobs (a forward of that one prompt)."""

    def to_host(self, pinned: bool) -> Logprobs:
        """The tables' host copies, queued without a sync when ``pinned`` (CUDA)."""
        return Logprobs(_host(self.table, pinned), self.rows, _host(self.prompt, pinned))

    def outputs(self, row: int) -> dict[str, torch.Tensor]:
        """The outputs of ``row`` of the forward: ``logprobs`` (1 + k, 2) and, for a prefill asked for them,
        ``prompt_logprobs``; host tables only."""
        out = {}
        at = self.rows.get(row)
        if at is not None:
            out["logprobs"] = self.table[at[0], :1 + at[1]]
        if self.prompt is not None:
            out["prompt_logprobs"] = self.prompt
        return out


def _host(t: torch.Tensor | None, pinned: bool) -> torch.Tensor | None:
    if t is None or not pinned:
        return None if t is None else t.cpu()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class Prepared:
    """The rows of one forward that need more than a draw, and their parameters on the device."""

    penalized: list[int] = field(default_factory=list)
    logprobs: list[int] = field(default_factory=list)
    guided: list[int] = field(default_factory=list)
    masked: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows, tokens) whose logits are -inf: the stop tokens of rows short of their ``min_tokens``."""
    ks: list[int] = field(default_factory=list)
    penalties: tuple[torch.Tensor, ...] = ()
    """For ``penalized``, on the device: slots, lengths read, prompt lengths (R,), repetition, presence and frequency
    penalties (R, 1); then on the host: whether any presence or frequency penalty is on, the longest length read."""
    forbidden: torch.Tensor | None = None
    """(len(guided), W) bool on the device: the tokens each grammar row may not write (`GuidedRows.forbidden`)."""

    @property
    def adjusts(self) -> bool:
        return bool(self.penalized or self.guided) or self.masked is not None


def vocab_window(bias: torch.Tensor | None) -> tuple[tuple[int, int] | None, torch.Tensor | None]:
    """((lo, hi), bias[lo:hi]) when every token ``bias`` (V,) allows (a finite entry) lies in [lo, hi) and that is less
    than the whole vocabulary; else (None, None)."""
    if bias is None:
        return None, None
    allowed = torch.isfinite(bias).nonzero()
    if not len(allowed):
        raise ValueError("logit_bias forbids every token")
    lo, hi = int(allowed[0, 0]), int(allowed[-1, 0]) + 1
    if hi - lo == bias.shape[0]:
        return None, None
    return (lo, hi), bias[lo:hi].contiguous()


class RowExtras:
    """One KV engine's per-row state for the knobs beyond the draw (see the module docstring)."""

    def __init__(self, device: torch.device, max_slots: int, max_seq_len: int,
                 grammar_tokenizer: Callable[[], Any] | None, engine: str,
                 bias: torch.Tensor | None = None) -> None:
        """``bias`` (V,) on ``device``: the family's fixed logit bias (`biased`). When it allows only the ids of a
        window [lo, hi) (`vocab_window`), the logits handed to `draw` and `adjust` are those columns alone, and `draw`
        gives back vocabulary ids."""
        self.device = device
        self.bias = bias
        self.window, self._window_bias = vocab_window(bias)
        lo, hi = self.window or (0, None)
        self.offset, self.width = lo, None if hi is None else hi - lo
        self.live: set[str] = set()
        """Requests with extras holding a slot here."""
        self.guided = GuidedRows(grammar_tokenizer, engine)
        self._shape = (max_slots, max_seq_len)
        self._history: torch.Tensor | None = None
        """(slots, max_seq_len) token ids of penalized rows, made at the first one."""
        self._prompt_len: dict[int, int] = {}
        """Slot of a penalized request -> its prompt's length (the output starts there)."""

    def biased(self, logits: torch.Tensor, whole: bool = False) -> torch.Tensor:
        """Logits (..., V) with the family's bias: the window's columns alone when there is one (what `draw` takes),
        or every column with ``whole`` (a prompt's logprobs, of any id)."""
        if self.bias is None:
            return logits
        if self.window is None or whole:
            return logits.float() + self.bias
        return logits[..., self.window[0]:self.window[1]].float() + self._window_bias

    def admit(self, request_id: str, sampling: Any, slot: int, prompt: torch.Tensor | None, length: int) -> None:
        """The request took ``slot`` with ``length`` positions of KV (a prefill: ``prompt`` its ids; a KV import: the
        call's ``prompt_ids``, None when it has none). ValueError for a penalized request without its prompt."""
        if not sampling.extras:
            return
        self.live.add(request_id)
        if sampling.penalized:
            if prompt is None or prompt.numel() != length:
                raise ValueError(f"request {request_id!r}: penalties need the prompt's {length} ids with its KV "
                                 f"(the walk input 'prompt_ids'); got {None if prompt is None else prompt.numel()}")
            if self._history is None:
                self._history = torch.zeros(self._shape, dtype=torch.long, device=self.device)
            self._history[slot, :length] = to_device(prompt.reshape(-1), self.device).long()
            self._prompt_len[slot] = length

    def release(self, request_id: str, slot: int | None) -> None:
        self.live.discard(request_id)
        self.guided.release(request_id)
        if slot is not None:
            self._prompt_len.pop(slot, None)

    def prepare(self, ctxs: list[Any], slots: list[int], positions: list[int], done: list[int], *,
                inputs: torch.Tensor | None = None, given: list[torch.Tensor] | None = None) -> Prepared | None:
        """What a forward's rows need (None: nothing). Row b has walk context ``ctxs[b]``, writes ``positions[b]`` of
        ``slots[b]`` (a prefill: its last prompt position) and follows ``done[b]`` tokens of its walk. A decode step
        also gives its input tokens: ``inputs`` (B,) on the device (written to the penalties' table) and ``given``,
        the same as the calls' host tensors (a grammar consumes its row's before the mask; None for a lookahead
        launch, which has no grammar rows). Runs the host's grammar work."""
        prep = Prepared()
        masked: list[tuple[int, list[int]]] = []
        for b, ctx in enumerate(ctxs):
            p = ctx.sampling
            if not p.extras:
                continue
            if p.penalized:
                prep.penalized.append(b)
            if p.logprobs is not None:
                prep.logprobs.append(b)
                prep.ks.append(p.logprobs)
            if p.guided is not None:
                prep.guided.append(b)
            if done[b] < p.min_tokens and ctx.stop_token_ids:
                masked.append((b, sorted(ctx.stop_token_ids)))
        if not (prep.penalized or prep.logprobs or prep.guided or masked):
            return None
        masked = [(b, [t - self.offset for t in ids if self._in_window(t)]) for b, ids in masked]
        if any(ids for _, ids in masked):
            rows = [b for b, ids in masked for _ in ids]
            prep.masked = (to_device(rows, self.device), to_device([t for _, ids in masked for t in ids], self.device))
        if prep.penalized:
            self._penalty_inputs(prep, ctxs, slots, positions, inputs)
        if prep.guided:
            for b in prep.guided:
                token = None if given is None else int(given[b].reshape(-1)[0])
                self.guided.advance(ctxs[b].request_id, ctxs[b].sampling.guided, token)
            forbidden = self.guided.forbidden([ctxs[b].request_id for b in prep.guided])
            prep.forbidden = to_device(forbidden[:, self.offset:] if self.offset else forbidden, self.device)
        return prep

    def _in_window(self, token: int) -> bool:
        return self.width is None or 0 <= token - self.offset < self.width

    def _penalty_inputs(self, prep: Prepared, ctxs: list[Any], slots: list[int], positions: list[int],
                        inputs: torch.Tensor | None) -> None:
        rows = prep.penalized
        slot_ids = [slots[b] for b in rows]
        at = to_device(slot_ids, self.device)
        if inputs is not None:  # the tokens this step starts from, at the positions it writes
            self._history[at, to_device([positions[b] for b in rows], self.device)] = \
                inputs[to_device(rows, self.device)].long()
        params = [ctxs[b].sampling for b in rows]
        prep.penalties = (
            at, to_device([positions[b] + 1 for b in rows], self.device),
            to_device([self._prompt_len[s] for s in slot_ids], self.device),
            to_device([float(p.repetition_penalty) for p in params], self.device)[:, None],
            to_device([float(p.presence_penalty) for p in params], self.device)[:, None],
            to_device([float(p.frequency_penalty) for p in params], self.device)[:, None],
        )
        prep.penalties += (any(p.presence_penalty or p.frequency_penalty for p in params),
                           max(positions[b] for b in rows) + 1)

    def adjust(self, logits: torch.Tensor, prep: Prepared) -> torch.Tensor:
        """The logits (B, V) to draw from: ``logits`` itself when no row changes them, else with the penalties,
        ``min_tokens`` masks and grammar masks applied to their rows (in place, unless a row's logprobs will be read
        from ``logits``)."""
        if not prep.adjusts:
            return logits
        x = logits.float()
        if x is logits and prep.logprobs:
            x = x.clone()
        if prep.penalized:
            at = to_device(prep.penalized, self.device)
            x[at] = self._penalize(x[at], prep)
        if prep.masked is not None:
            x[prep.masked] = NEG_INF
        if len(prep.guided) == len(x):  # every row: no gather and scatter of the rows
            apply_mask(x, prep.forbidden)
        elif prep.guided:
            at = to_device(prep.guided, self.device)
            x[at] = apply_mask(x[at], prep.forbidden)
        return x

    def _penalize(self, x: torch.Tensor, prep: Prepared) -> torch.Tensor:
        """x (R, V) of the penalized rows with their penalties applied (see the module docstring)."""
        slots, read, prompt_len, rep, presence, frequency, counted, longest = prep.penalties
        hist = self._history[slots, :longest]  # (R, L): the rows' tokens up to the longest row's
        pos = torch.arange(hist.shape[1], device=x.device)[None]
        valid = pos < read[:, None]
        if self.width is not None:  # x holds the window's columns: a token outside it has nothing to penalize
            hist = hist - self.offset
            valid = valid & (hist >= 0) & (hist < self.width)
            hist = hist.clamp(0, self.width - 1)
        seen = torch.zeros_like(x).scatter_add_(1, hist, valid.float()) > 0
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        if counted:
            out = torch.zeros_like(x).scatter_add_(1, hist, (valid & (pos >= prompt_len[:, None])).float())
            x = x - frequency * out - presence * (out > 0).float()
        return x

    def draw(self, logits: torch.Tensor, params: list[Any], generators: list, prep: Prepared | None,
             prompt: torch.Tensor | None = None) -> tuple[torch.Tensor, Logprobs | None]:
        """The rows' tokens drawn (``sampling.sample``, with their ``SamplingParams`` and generators) from their
        ``logits`` (B, V) as ``prep`` adjusts them, and the forward's logprob tables (None when no row asked;
        ``prompt``: see `logprobs`)."""
        if prep is None and prompt is None:
            return self._ids(sample(logits, params, generators)), None
        tokens = sample(logits if prep is None else self.adjust(logits, prep), params, generators)
        logprobs = self.logprobs(logits, tokens, prep, prompt)
        if self.offset and logprobs is not None and logprobs.table is not None:
            logprobs.table[..., 0] += self.offset  # window ids -> vocabulary ids (exact in float64)
        return self._ids(tokens), logprobs

    def _ids(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens + self.offset if self.offset else tokens

    def logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, prep: Prepared | None,
                 prompt: torch.Tensor | None = None) -> Logprobs | None:
        """The forward's logprob tables from its model logits ``raw`` (B, V) and drawn ``tokens`` (B,); ``prompt``: a
        one-prompt prefill's table, already made (`prompt_table`)."""
        if (prep is None or not prep.logprobs) and prompt is None:
            return None
        if prep is None or not prep.logprobs:
            return Logprobs(None, {}, prompt)
        at = to_device(prep.logprobs, self.device)
        table = logprobs_of(raw[at], tokens[at], max(prep.ks))
        return Logprobs(table, {b: (j, k) for j, (b, k) in enumerate(zip(prep.logprobs, prep.ks))}, prompt)


def prompt_table(logits: torch.Tensor, prompt: torch.Tensor, k: int) -> torch.Tensor:
    """A prompt's logprobs: ``logits`` (T, V) at every prompt position, ``prompt`` (T,) its ids -> (T - 1, 1 + k, 2):
    row i is prompt token i + 1 given those before it, and the k most likely there."""
    return logprobs_of(logits[:-1], to_device(prompt[1:], logits.device), k)

