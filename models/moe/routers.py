"""Pluggable MoE routers: which k experts each token goes to, and with what weights.

Contract (every router, called once per MoE block forward):

    router(hidden_states, router_states) -> (routing_weights, selected_experts, router_states_next)

- hidden_states (T, H): the block's input tokens, flattened over batch and sequence.
- router_states: what the previous MoE block's router returned as router_states_next in this same forward
  call (None at the first MoE block of every forward call; dense layers pass it through unchanged).
- routing_weights (T, k), a floating dtype; selected_experts (T, k) int64 in [0, num_experts). The block's
  output for token t is sum_j routing_weights[t, j] * expert_{selected_experts[t, j]}(x_t).
- router_states_next: anything (a tensor, a dict...), or None for a stateless router.

A router class is built as ``cls(layer_idx=, hidden=, num_experts=, k=, norm_topk_prob=, **kwargs)`` where
kwargs come from the router spec. Its only checkpoint tensor is a parameter named ``weight`` (num_experts, H),
loaded from the HF checkpoint's ``mlp.gate.weight``; a router without one ignores that tensor; any other tensor
would be left unloaded, so a router keeps other constants as plain attributes.

Checks: `build_router` runs the router on a probe input and checks the contract (shapes, dtypes, k, and the
index range when the probe is on a real device, i.e. not while the model is built on `meta`); the loader runs
the same probe with values after the weights are loaded (`probe_router`). At run time every block checks shapes
and dtypes (metadata only: no device sync, CUDA-graph safe), not the index range (that would need a sync; an
out-of-range index fails in the expert gather anyway). Every failure is a ValueError naming the layer.

Under tensor parallelism the router is replicated: every TP rank routes the same (bit-identical) hidden states
with the same weights, so routing is identical on every rank with no communication, and router states are
per shard (never reduced).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ROUTERS", "TopKRouter", "LoadBiasedRouter", "build_router", "check_router_output", "probe_router",
           "resolve_router"]


class TopKRouter(nn.Module):
    """HF Qwen3-MoE routing: logits = x @ weight^T, softmax in fp32, top-k, optionally renormalised to sum 1.

    Stateless (returns None as its state). Weights are fp32.
    """

    def __init__(self, *, layer_idx: int, hidden: int, num_experts: int, k: int, norm_topk_prob: bool = False
                 ) -> None:
        super().__init__()
        self.layer_idx, self.num_experts, self.k, self.norm_topk_prob = layer_idx, num_experts, k, norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden).normal_(std=0.02))  # HF's initializer_range

    def probs(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, H) -> routing probabilities (T, E), fp32."""
        return F.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)

    def _weights(self, probs: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        top = probs.gather(1, selected)  # (T, k)
        return top / top.sum(dim=-1, keepdim=True) if self.norm_topk_prob else top

    def forward(self, x: torch.Tensor, router_states: Any = None) -> tuple[torch.Tensor, torch.Tensor, None]:
        probs = self.probs(x)  # (T, E)
        selected = torch.topk(probs, self.k, dim=-1).indices  # (T, k), most probable first
        return self._weights(probs, selected), selected, None


class LoadBiasedRouter(TopKRouter):
    """A stateful worked example: top-k routing that steers tokens away from the experts the previous MoE layer
    loaded most.

    State: (E,) fp32, the fraction of the layer's T*k assignments each expert received (sums to 1). With the
    previous layer's fractions `load`, selection uses biased scores
        logits - strength * E * (load - 1/E)
    (no bias when the previous layer was perfectly balanced; an expert that took twice its share at E=4 loses
    `strength` * 1 from its logit). The routing *weights* are the unbiased softmax probabilities of the
    selected experts (renormalised if norm_topk_prob), so the bias changes only which experts are chosen, as in
    auxiliary-loss-free balancing. The first MoE layer of a forward (state None) routes exactly like TopKRouter.
    Expert e of one layer and expert e of the next are different networks: this is a demonstration of the state
    plumbing, not a trained balancing scheme.
    """

    def __init__(self, *, strength: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.strength = float(strength)

    def forward(self, x: torch.Tensor, router_states: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight).float()  # (T, E)
        probs = F.softmax(logits, dim=-1)
        scores = logits
        if router_states is not None:
            if router_states.shape != (self.num_experts,):
                raise ValueError(f"layer {self.layer_idx}: LoadBiasedRouter state must be ({self.num_experts},), "
                                 f"got {tuple(router_states.shape)}")
            scores = logits - self.strength * self.num_experts * (router_states - 1.0 / self.num_experts)
        selected = torch.topk(scores, self.k, dim=-1).indices  # (T, k)
        # scatter_add, not bincount: no device sync (CUDA-graph safe)
        load = torch.zeros(self.num_experts, device=x.device).scatter_add_(
            0, selected.reshape(-1), torch.ones(selected.numel(), device=x.device)) / max(selected.numel(), 1)
        return self._weights(probs, selected), selected, load


ROUTERS: dict[str, type[nn.Module]] = {"topk": TopKRouter, "load_biased": LoadBiasedRouter}
"""Router names usable in ``model_kwargs.router``; any other class is named as ``package.module:Class``."""


def resolve_router(name: str) -> type:
    """The router class for a registry name or ``package.module:Class``; ValueError otherwise."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"router: cannot load {name!r} ({type(exc).__name__}: {exc})") from None
    try:
        return ROUTERS[name]
    except KeyError:
        raise ValueError(f"router: unknown router {name!r} (known: {sorted(ROUTERS)}, "
                         f"or 'package.module:Class')") from None


def parse_router_spec(spec: str | dict | None) -> tuple[str, dict[str, Any]]:
    """(name, kwargs) from a spec: None (the default "topk"), a name, or {"name": ..., **kwargs}."""
    if spec is None:
        return "topk", {}
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, dict) and isinstance(spec.get("name"), str):
        kwargs = dict(spec)
        return kwargs.pop("name"), kwargs
    raise ValueError(f"router: expected a name or {{'name': ..., **kwargs}}, got {spec!r}")


def check_router_output(out: Any, *, layer_idx: int, n_tokens: int, k: int, num_experts: int,
                        values: bool) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """`out` unpacked, or ValueError naming the layer and what breaks the contract (see the module docstring).

    `values` also checks the index range (a device sync: for probes, not for every forward)."""
    if not isinstance(out, tuple) or len(out) != 3:
        raise ValueError(f"layer {layer_idx}: a router must return (routing_weights, selected_experts, "
                         f"router_states), got {type(out).__name__}")
    weights, selected, states = out
    for name, t, ok_dtype, want in (("routing_weights", weights, "a floating dtype", None),
                                    ("selected_experts", selected, "int64", torch.int64)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"layer {layer_idx}: router {name} must be a tensor, got {type(t).__name__}")
        if tuple(t.shape) != (n_tokens, k):
            raise ValueError(f"layer {layer_idx}: router {name} has shape {tuple(t.shape)}, "
                             f"expected (tokens={n_tokens}, k={k})")
        if (t.dtype != want) if want is not None else not t.is_floating_point():
            raise ValueError(f"layer {layer_idx}: router {name} has dtype {t.dtype}, expected {ok_dtype}")
    if values and selected.device.type != "meta" and selected.numel():
        lo, hi = int(selected.min()), int(selected.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"layer {layer_idx}: router selected_experts has indices in [{lo}, {hi}], "
                             f"outside [0, num_experts={num_experts})")
    return weights, selected, states


def probe_router(router: nn.Module, *, layer_idx: int, hidden: int, k: int, num_experts: int,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
    """Run `router` on a fixed probe (4 tokens), first with no state and then with its own output state, and check
    the contract (index range too unless on meta). Device and dtype default to the router's own weights'."""
    params = list(router.parameters()) if isinstance(router, nn.Module) else []
    device = device if device is not None else (params[0].device if params else torch.empty(0).device)
    dtype = dtype or (params[0].dtype if params else torch.get_default_dtype())
    probe = torch.randn(4, hidden, generator=torch.Generator().manual_seed(0), device="cpu").to(device, dtype)
    state = None
    with torch.no_grad():
        for _ in range(2):
            try:
                out = router(probe, state)
            except Exception as exc:  # noqa: BLE001 - a router that cannot run is a configuration error
                raise ValueError(f"layer {layer_idx}: router {type(router).__name__} failed on a probe input "
                                 f"({type(exc).__name__}: {exc})") from exc
            state = check_router_output(out, layer_idx=layer_idx, n_tokens=4, k=k, num_experts=num_experts,
                                        values=True)[2]


def build_router(spec: str | dict | None, *, layer_idx: int, hidden: int, num_experts: int, k: int,
                 norm_topk_prob: bool = False) -> nn.Module:
    """Build the router of MoE layer `layer_idx` from a spec (None, a name or {"name": ..., **kwargs}) and probe it.

    ValueError naming the layer for an unknown name, a class that does not accept the arguments, or a router
    whose output breaks the contract on the probe.
    """
    try:
        name, kwargs = parse_router_spec(spec)
        cls = resolve_router(name)
    except ValueError as exc:
        raise ValueError(f"layer {layer_idx}: {exc}") from None
    try:
        router = cls(layer_idx=layer_idx, hidden=hidden, num_experts=num_experts, k=k,
                     norm_topk_prob=norm_topk_prob, **kwargs)
    except TypeError as exc:
        raise ValueError(f"layer {layer_idx}: router {name!r} cannot be built with {sorted(kwargs)} "
                         f"({exc})") from None
    if not callable(router):
        raise ValueError(f"layer {layer_idx}: router {name!r} built a {type(router).__name__}, which is not callable")
    probe_router(router, layer_idx=layer_idx, hidden=hidden, k=k, num_experts=num_experts)
    return router
