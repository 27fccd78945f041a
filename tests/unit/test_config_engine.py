"""The deployment's ``engine:`` key (mstar_dist/config/engine.py, mstar_dist/config/deployment.py).

A failure here means an engine knob's default changed (the serving path would run another policy), a mistake in
``engine:`` is accepted or reported without the key path and value, a knob left under ``model_kwargs`` (where it
used to live) is silently ignored, or a node group's override reaches the wrong ranks or nodes."""

from __future__ import annotations

import dataclasses

import pytest

from mstar_dist.config.deployment import parse_config
from mstar_dist.config.schema import ConfigError
from mstar_dist.config.engine import EngineConfig
from tests.unit.test_config import BASE, error, with_

PD = {
    "model": "smollm2",
    "node_groups": [
        {"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill"], "engine": {"prefill_token_budget": 8192}},
        {"node_names": ["LLM"], "ranks": [1, 2], "graph_walks": ["decode"], "engine": {"max_batch": 32}},
        {"node_names": ["CODEC"], "ranks": [1], "graph_walks": ["codec"]},
    ],
    "engine": {"max_seq_len": 1024, "lookahead": False},
}


def test_the_defaults_are_the_single_rank_cuda_policy():
    assert dataclasses.asdict(EngineConfig()) == {
        "max_batch": 16, "max_seq_len": 2048, "cuda_graphs": True, "prefill_token_budget": 4096,
        "prefill_graphs": True, "lookahead": True, "prefill_stream": True, "prefill_in_flight": True,
        "prefill_gather_ms": 0.0, "decode_yield_ms": 8.0, "decode_attention": "auto", "fused_pointwise": "auto",
        "cpu_packed_linear": True,
    }
    assert parse_config(BASE, "deploy.yaml").engine == EngineConfig()


@pytest.mark.parametrize("device, tp_size, on", [
    ("cuda:0", 1, {"cuda_graphs", "prefill_graphs", "lookahead", "prefill_in_flight"}),
    ("cuda", 2, {"cuda_graphs"}),  # TP members run in lockstep: no lookahead, prefill graphs or prefills in flight
    ("cpu", 1, set()),  # what needs CUDA is off on a CPU rank
    ("cpu", 2, set()),
])
def test_a_rank_turns_off_what_its_device_or_tp_group_cannot_use(device, tp_size, on):
    flags = ("cuda_graphs", "prefill_graphs", "lookahead", "prefill_in_flight")
    resolved = EngineConfig().on(device, tp_size)
    assert {f for f in flags if getattr(resolved, f)} == on
    assert resolved.prefill_stream and resolved.decode_yield_ms == 8.0  # the rest as asked
    assert not EngineConfig(cuda_graphs=False).on("cuda", 1).prefill_graphs  # prefill graphs need decode graphs


@pytest.mark.parametrize("data, expected", [
    (with_("engine.lookahead", "yes"), ["engine.lookahead = 'yes'", "must be true or false"]),
    (with_("engine.max_batch", 0), ["engine.max_batch = 0", ">= 1"]),
    (with_("engine.max_seq_len", 1), ["engine.max_seq_len = 1", ">= 2"]),
    (with_("engine.prefill_token_budget", 0), ["engine.prefill_token_budget = 0", ">= 1"]),
    (with_("engine.prefill_gather_ms", -1), ["engine.prefill_gather_ms = -1", ">= 0"]),
    (with_("engine.decode_yield_ms", "5"), ["engine.decode_yield_ms = '5'", "must be a number"]),
    (with_("engine.decode_yield_ms", True), ["engine.decode_yield_ms = True", "must be a number"]),
    (with_("engine.decode_attention", "flash"), ["engine.decode_attention = 'flash'", "auto | triton | sdpa"]),
    (with_("engine.fused_pointwise", "inductor"), ["engine.fused_pointwise = 'inductor'", "auto | triton | torch"]),
    (with_("engine.lookahed", True), ["engine.lookahed: unknown key", "did you mean 'lookahead'?"]),
    (with_("engine", [1]), ["engine = [1]", "must be a mapping"]),
    (with_("model_kwargs.lookahead", False), ["model_kwargs.lookahead", "is engine policy: set engine.lookahead"]),
    (with_("model_kwargs.max_batch", 8), ["model_kwargs.max_batch", "is engine policy: set engine.max_batch"]),
    (with_("node_groups.1.engine", {"max_seq_len": 512}),
     ["node_groups[1].engine.max_seq_len = 512", "one value per deployment"]),
    (with_("node_groups.1.engine", {"max_batch": -1}), ["node_groups[1].engine.max_batch = -1", ">= 1"]),
    (with_("node_groups.0.engine", {"budget": 1}), ["node_groups[0].engine.budget: unknown key"]),
])
def test_engine_mistakes_name_file_key_path_and_value(data, expected):
    msg = error(data)
    assert msg.startswith("deploy.yaml: "), msg
    for part in expected:
        assert part in msg, (part, msg)


def test_a_node_group_overrides_the_engine_of_its_nodes_on_its_ranks_only():
    cfg = parse_config(PD, "pd.yaml")
    assert cfg.engine == EngineConfig(max_seq_len=1024, lookahead=False)
    assert cfg.engine_for(0, "LLM") == EngineConfig(max_seq_len=1024, lookahead=False, prefill_token_budget=8192)
    assert cfg.engine_for(2, "LLM") == EngineConfig(max_seq_len=1024, lookahead=False, max_batch=32)
    assert cfg.engine_for(1, "CODEC") == cfg.engine  # another node of the same rank keeps the deployment's
    assert parse_config(cfg.to_dict(), "pd.yaml") == cfg


def test_two_groups_placing_one_node_on_one_rank_must_not_disagree():
    groups = [{"node_names": ["LLM"], "ranks": [0], "graph_walks": ["prefill"], "engine": {"max_batch": 8}},
              {"node_names": ["LLM"], "ranks": [0], "graph_walks": ["decode"], "engine": {"max_batch": 4}}]
    with pytest.raises(ConfigError, match=r"node_groups\[1\].engine.max_batch = 4: node_groups\[0\] gives LLM on "
                                          r"rank 0 8"):
        parse_config({"model": "smollm2", "node_groups": groups}, "pd.yaml")
    groups[1]["engine"] = {"max_batch": 8, "lookahead": False}  # the same value twice, and other keys: fine
    assert parse_config({"model": "smollm2", "node_groups": groups}, "pd.yaml").engine_for(0, "LLM") == \
        EngineConfig(max_batch=8, lookahead=False)
