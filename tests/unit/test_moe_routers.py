"""Pluggable MoE routers (models/moe/routers.py) inside the Qwen3-MoE model and its chat family.

A failure points to: the router contract checks (a broken router that is not refused, or refused without naming
its layer); the registry or spec parsing (a name, `package.module:Class` or kwargs that do not reach the router
that runs); the decoder's state threading (a router that does not see the previous MoE layer's state, or sees
state from an earlier forward call); or LoadBiasedRouter's bias (experts the previous layer loaded are not
penalised, or the weights are not the unbiased probabilities).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from models.llama.chat import LLM
from models.moe.chat import MoEChat
from models.moe.checkpoint import make_moe_checkpoint
from models.moe.config import MoEConfig
from models.moe.model import Qwen3Moe
from models.moe.routers import LoadBiasedRouter, TopKRouter, build_router
from models.moe.weights import load_moe
from mstar_dist.config.engine import EngineConfig
from mstar_dist.engine.kv_cache import StaticKVCache

pytestmark = pytest.mark.usefixtures("one_intraop_thread")

CFG = MoEConfig(vocab_size=50, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, n_layers=4,
                n_heads=2, n_kv_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2, mlp_only_layers=(2,),
                max_position_embeddings=64)
"""Sparse layers 0, 1, 3; layer 2 is dense (it must pass the router state through)."""
SPARSE = [0, 1, 3]
THIRD_LAYER_FIRST = MoEConfig(**{**CFG.__dict__, "mlp_only_layers": (0, 1)})
"""Layer 2 is the first MoE layer: errors must name it, not 0."""


# ---- routers the tests plug in (importable as tests.unit.test_moe_routers:Class) -------------------------------

class RecordingRouter(TopKRouter):
    """TopK routing; records the state it receives and returns (layer_idx, calls so far) as its state."""

    def __init__(self, *, tag: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.tag = tag
        self.received: list = []

    def forward(self, x, router_states=None):
        weights, selected, _ = super().forward(x)
        self.received.append(router_states)
        return weights, selected, (self.layer_idx, len(self.received))


class WrongK(TopKRouter):
    def forward(self, x, router_states=None):
        weights, selected, _ = super().forward(x)
        return torch.cat((weights, weights[:, :1]), 1), torch.cat((selected, selected[:, :1]), 1), None


class Int32Indices(TopKRouter):
    def forward(self, x, router_states=None):
        weights, selected, _ = super().forward(x)
        return weights, selected.int(), None


class OutOfRange(TopKRouter):
    def forward(self, x, router_states=None):
        weights, selected, _ = super().forward(x)
        return weights, selected + self.num_experts, None


class PairReturn(TopKRouter):
    def forward(self, x, router_states=None):
        return super().forward(x)[:2]


class BreaksOnLongInputs(TopKRouter):
    """Keeps the contract on the 4-token probe, breaks it (k - 1 columns) on more tokens."""

    def forward(self, x, router_states=None):
        weights, selected, _ = super().forward(x)
        return (weights, selected, None) if x.shape[0] <= 4 else (weights[:, :1], selected[:, :1], None)


class WithBuffer(TopKRouter):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.register_buffer("temperature", torch.ones(1))


def run(model: nn.Module, config: MoEConfig, ids: list[int]) -> torch.Tensor:
    cache = StaticKVCache(n_layers=config.n_layers, n_kv_heads=model.local_kv_heads, head_dim=config.head_dim,
                          max_slots=1, max_seq_len=32)
    cache.bind([cache.alloc()], [0], len(ids))
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)


def build(config: MoEConfig = CFG, router=None) -> Qwen3Moe:
    torch.manual_seed(0)
    return Qwen3Moe(config, router=router).eval()


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("moe") / "ckpt"
    make_moe_checkpoint(out, seed=0, writer="plain", n_layers=3, mlp_only_layers=(1,))
    return out


# ---- contract ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [TopKRouter, LoadBiasedRouter])
def test_builtin_routers_keep_the_contract(cls) -> None:
    router = cls(layer_idx=0, hidden=32, num_experts=4, k=2, norm_topk_prob=True)
    x = torch.randn(5, 32)
    weights, selected, state = router(x, None)
    assert weights.shape == selected.shape == (5, 2)
    assert weights.dtype == torch.float32 and selected.dtype == torch.int64
    assert int(selected.min()) >= 0 and int(selected.max()) < 4
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))  # norm_topk_prob
    if cls is TopKRouter:
        assert state is None
    else:
        assert state.shape == (4,) and float(state.sum()) == pytest.approx(1.0)
        assert router(x, state)[0].shape == (5, 2)


def test_load_biased_router_penalises_the_previous_layers_busy_experts() -> None:
    router = LoadBiasedRouter(layer_idx=1, hidden=8, num_experts=4, k=2, norm_topk_prob=False, strength=1.0)
    with torch.no_grad():
        router.weight.zero_()  # equal logits: only the bias decides
    x = torch.randn(6, 8)
    weights, selected, load = router(x, torch.tensor([0.5, 0.5, 0.0, 0.0]))
    assert sorted(selected.flatten().unique().tolist()) == [2, 3]
    torch.testing.assert_close(weights, torch.full((6, 2), 0.25))  # unbiased probabilities
    torch.testing.assert_close(load, torch.tensor([0.0, 0.0, 0.5, 0.5]))
    plain = TopKRouter(layer_idx=0, hidden=8, num_experts=4, k=2)
    with torch.no_grad():
        router.weight.copy_(plain.weight)
    for got, want in zip(router(x, None)[:2], plain(x, None)[:2]):  # no state (first MoE layer): plain top-k
        torch.testing.assert_close(got, want)


def test_block_returns_router_states_on_request() -> None:
    block = build(router="load_biased").layers[0].mlp
    h = torch.randn(1, 3, 32)
    assert block(h).shape == (1, 3, 32)
    out, state = block(h, None, return_router_states=True)
    assert out.shape == (1, 3, 32) and state.shape == (4,)


# ---- plugging routers in ----------------------------------------------------------------------------------------

def test_injected_router_runs_once_per_block_forward_and_states_thread_across_layers() -> None:
    model = build(router={"name": "tests.unit.test_moe_routers:RecordingRouter", "tag": "x"})
    routers = {i: model.layers[i].mlp.router for i in SPARSE}
    assert all(isinstance(r, RecordingRouter) and r.tag == "x" for r in routers.values())
    for r in routers.values():
        r.received.clear()  # build_router's probe called them
    for call in (1, 2):
        run(model, CFG, [1, 2, 3, 4, 5])
        assert [len(r.received) for r in routers.values()] == [call] * len(SPARSE)  # once per forward each
        assert routers[0].received[-1] is None  # every forward starts without state
        assert routers[1].received[-1] == (0, call)  # layer 1 sees layer 0's state of this call
        assert routers[3].received[-1] == (1, call)  # through the dense layer 2 unchanged


def test_router_spec_kwargs_reach_the_router() -> None:
    model = build(router={"name": "load_biased", "strength": 3.0})
    assert all(isinstance(model.layers[i].mlp.router, LoadBiasedRouter) for i in SPARSE)
    assert model.layers[0].mlp.router.strength == 3.0
    assert run(model, CFG, [3, 1, 4, 1, 5]).isfinite().all()


def test_custom_router_from_model_kwargs_is_the_one_that_runs(weights_dir: Path) -> None:
    family = MoEChat(str(weights_dir), router="tests.unit.test_moe_routers:RecordingRouter")
    assert family.model_kwargs["router"] == "tests.unit.test_moe_routers:RecordingRouter"
    engine = family.build_component(LLM, device="cpu", walks={"prefill", "decode"},
                                    engine=EngineConfig(max_batch=2, max_seq_len=64))
    router = engine.model.layers[0].mlp.router
    assert type(router) is RecordingRouter and not engine.model.layers[1].sparse
    before = len(router.received)
    engine.warmup()  # one forward through the engine's own cache
    assert len(router.received) == before + 1
    assert engine.model.layers[2].mlp.router.received[-1] == (0, len(router.received))


def test_loaded_router_takes_the_checkpoints_gate_weight(weights_dir: Path) -> None:
    from safetensors import safe_open

    model, _ = load_moe(weights_dir, router="load_biased")
    with safe_open(str(weights_dir / "model.safetensors"), "pt") as f:
        torch.testing.assert_close(model.layers[2].mlp.router.weight, f.get_tensor("model.layers.2.mlp.gate.weight"))


# ---- refusals ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, match", [
    ("nope", r"layer 2: router: unknown router 'nope'"),
    ("tests.unit.test_moe_routers:Missing", r"layer 2: router: cannot load"),
    ({"name": "topk", "temperature": 2}, r"layer 2: router 'topk' cannot be built with \['temperature'\]"),
    ({"strength": 2}, r"layer 2: router: expected a name"),
    ("tests.unit.test_moe_routers:WrongK", r"layer 2: router routing_weights has shape \(4, 3\), expected"),
    ("tests.unit.test_moe_routers:Int32Indices", r"layer 2: router selected_experts has dtype torch.int32"),
    ("tests.unit.test_moe_routers:OutOfRange", r"layer 2: router selected_experts has indices in \[4, 7\]"),
    ("tests.unit.test_moe_routers:PairReturn", r"layer 2: a router must return"),
])
def test_bad_routers_are_refused_at_build_naming_the_layer(spec, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build(THIRD_LAYER_FIRST, router=spec)


def test_out_of_range_router_is_refused_when_loading_from_meta(weights_dir: Path) -> None:
    """On meta the build-time probe sees no values; the probe after loading does."""
    with pytest.raises(ValueError, match=r"layer 0: router selected_experts has indices"):
        load_moe(weights_dir, router="tests.unit.test_moe_routers:OutOfRange")
    with pytest.raises(ValueError, match=r"layer 0: router WithBuffer has tensors \['temperature'\]"):
        load_moe(weights_dir, router="tests.unit.test_moe_routers:WithBuffer")


def test_contract_breach_at_run_time_names_the_layer() -> None:
    model = build(THIRD_LAYER_FIRST, router="tests.unit.test_moe_routers:BreaksOnLongInputs")
    with pytest.raises(ValueError, match=r"layer 2: router routing_weights has shape \(6, 1\)"):
        run(model, THIRD_LAYER_FIRST, [1, 2, 3, 4, 5, 6])


def test_chat_family_refuses_a_bad_router_name_up_front(weights_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown router 'nope'"):
        MoEChat(str(weights_dir), router="nope")


def test_build_router_directly() -> None:
    router = build_router(None, layer_idx=5, hidden=8, num_experts=3, k=1)
    assert isinstance(router, TopKRouter) and router.layer_idx == 5 and router.k == 1
