"""Property tests (hypothesis) of the deployment config loader: whatever a user writes, ``load_config`` /
``parse_config`` give a ``DeploymentConfig`` or a ``ConfigError`` naming the file and the key, never another
exception (a traceback from deep inside the loader, a KeyError, a TypeError on an odd value).

A failure prints the smallest document that breaks that promise.
"""

from __future__ import annotations

import dataclasses
import math

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar_dist.config.deployment import (
    DeploymentConfig, Limits, NodeGroup, ServerConfig, TransportConfig, load_config, parse_config,
)
from mstar_dist.config.schema import ConfigError

SETTINGS = settings(max_examples=150, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
TOP_KEYS = ("model", "model_kwargs", "weights", "node_groups", "cluster", "transport", "limits", "server")

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 70000), st.integers(), st.floats(allow_nan=True),
    st.text(max_size=12), st.sampled_from(["", "p2p", "LLM", "prefill", "decode", "127.0.0.1", "~/w", "smollm2"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)


def fields_of(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def mapping_of(keys, value_strategy=values, extra=True):
    """Mappings over ``keys`` (each present or not) with random values, sometimes with a stray key."""
    keys = list(keys) + (["node_group", "tp", "xyz"] if extra else [])
    return st.dictionaries(st.sampled_from(keys), value_strategy, max_size=len(keys))


node_group = mapping_of(fields_of(NodeGroup), st.one_of(
    values, st.lists(st.integers(-1, 4), max_size=4), st.lists(st.sampled_from(["LLM", "A", "prefill"]), max_size=3)))
host = mapping_of(["name", "addr", "devices", "transfer_device", "env"], st.one_of(
    values, st.sampled_from(["10.0.0.1", "h1", "::1"]), st.integers(0, 4)))
section_values = {
    "model": st.one_of(values, st.sampled_from(["smollm2", "m"])),
    "node_groups": st.one_of(values, st.lists(node_group, max_size=3)),
    "cluster": st.one_of(values, st.fixed_dictionaries({"hosts": st.one_of(values, st.lists(host, max_size=3))})),
    "transport": st.one_of(values, mapping_of(fields_of(TransportConfig))),
    "limits": st.one_of(values, mapping_of(fields_of(Limits))),
    "server": st.one_of(values, mapping_of(fields_of(ServerConfig))),
}
documents = st.fixed_dictionaries(
    {}, optional={key: section_values.get(key, values) for key in (*TOP_KEYS, "node_group", "limit")})


def check_outcome(data, source: str = "deploy.yaml") -> None:
    try:
        cfg = parse_config(data, source)
    except ConfigError as err:
        assert str(err).startswith(f"{source}: "), str(err)
        if isinstance(data, dict) and data:
            assert err.key or "unknown key ''" in str(err), f"the error names no key: {err}"
            top = err.key.split(".")[0].split("[")[0]
            # a stray top-level key holding a dot ('.', 'a.b') is named whole
            assert top in (*TOP_KEYS, *data) or err.key in data, f"{err.key!r} is not a key of the document: {err}"
        return
    assert isinstance(cfg, DeploymentConfig)
    assert parse_config(cfg.to_dict(), source) == cfg  # what loads, round-trips


@SETTINGS
@given(documents)
def test_any_mapping_of_the_schemas_keys_loads_or_names_the_key(data):
    check_outcome(data)


@SETTINGS
@given(values)
def test_any_value_at_the_top_loads_or_is_a_config_error(data):
    check_outcome(data)


@SETTINGS
@given(st.one_of(st.text(max_size=200), documents.map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
                 values.map(yaml.safe_dump)))
def test_any_yaml_file_loads_or_is_a_config_error_naming_the_file(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "deploy.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        cfg = load_config(path)
    except ConfigError as err:
        assert str(err).startswith(f"{path}: "), str(err)
        return
    assert isinstance(cfg, DeploymentConfig)


def test_nan_and_infinity_are_config_errors():
    base = {"model": "m", "node_groups": [{"node_names": ["A"], "ranks": [0], "graph_walks": ["w"]}]}
    for value in (math.nan, math.inf, -math.inf):
        check_outcome({**base, "limits": {"request_timeout_s": value}})
        check_outcome({**base, "limits": {"max_tokens": value}})
