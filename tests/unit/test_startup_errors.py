"""Startup mistakes and clean exits without processes: the entry point's one-line errors, the weights check, the
HTTP port reservation, and a rank's ``Leaving`` message. A failure means a new user sees a traceback, the same
error once per rank, ``(rank ?)``, a typo'd weights path silently turned into a fresh conversion, a port clash
only after every rank loaded its model, or requests of a stopped rank hanging until ``limits.rank_timeout_s``.
"""

from __future__ import annotations

import asyncio

import socket

import pytest
import torch

from mstar_dist.config.deployment import parse_config
from mstar_dist.config.schema import ConfigError
from mstar_dist.control import messages as m
from mstar_dist.server.backend import BackendError
from mstar_dist.server.http_server import HttpServer, reserve_port
from mstar_dist.transport.inline import encode_tensor
from mstar_dist.runtime.cli import main
from mstar_dist.runtime.deployment import check_weights
from models.llama.chat import SmolLM2Chat
from tests.toy_model import ToyModel
from tests.unit.test_conductor import make, params, submit, walks_sent

GROUPS = [{"node_names": ["ADD"], "ranks": [0], "graph_walks": ["start"]}]


def test_errors_outside_torchrun_are_one_line_without_a_rank(tmp_path, monkeypatch, capsys):
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert main([str(tmp_path / "missing.yaml"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"mstar-dist: error: {tmp_path / 'missing.yaml'}: no such file (give the path of a deployment " \
                  "YAML, e.g. launch/configs/smollm2_pd.yaml)"


def test_under_torchrun_only_local_rank_0_prints_and_names_its_rank(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: m\nnode_group: []\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        assert main([str(bad)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mstar-dist: error (rank 0): ")
    assert "node_group: unknown key 'node_group' (did you mean 'node_groups'?" in lines[0]


def test_a_missing_weights_path_is_an_error_unless_the_family_prepares_it(tmp_path):
    missing = str(tmp_path / "nope")
    cfg = parse_config({"model": "tests.toy_model:ToyModel", "weights": missing, "node_groups": GROUPS}, "d.yaml")
    with pytest.raises(ConfigError, match=r"d.yaml: weights = '.*nope': no such directory$"):
        check_weights(cfg, ToyModel(missing))
    check_weights(parse_config({"model": "m", "weights": str(tmp_path), "node_groups": GROUPS}, "d.yaml"),
                  ToyModel(str(tmp_path)))  # exists: fine
    smol = parse_config({"model": "smollm2", "weights": missing, "node_groups": GROUPS}, "d.yaml")
    with pytest.raises(ConfigError, match="only the default ~/.cache/mstar_dist/smollm2-135m-instruct is prepared"):
        check_weights(smol, SmolLM2Chat(missing))
    default = parse_config({"model": "smollm2", "weights": SmolLM2Chat.default_weights_dir, "node_groups": GROUPS},
                           "d.yaml")
    check_weights(default, SmolLM2Chat(default.weights))  # the family prepares its default path


def test_an_existing_folder_that_is_not_a_checkpoint_is_an_error_and_stays_empty(tmp_path):
    """A family that prepares its default weights must not fill some other folder the user named by mistake."""
    empty = tmp_path / "empty"
    empty.mkdir()
    smol = parse_config({"model": "smollm2", "weights": str(empty), "node_groups": GROUPS}, "d.yaml")
    with pytest.raises(ConfigError, match=r"weights = '.*empty': is not a checkpoint \(no config.json in it; only "
                                          r"the default ~/.cache/mstar_dist/smollm2-135m-instruct is prepared"):
        check_weights(smol, SmolLM2Chat(str(empty)))
    assert list(empty.iterdir()) == []
    (empty / "config.json").write_text("{}")
    check_weights(smol, SmolLM2Chat(str(empty)))  # a checkpoint folder: its files are checked at load


def test_smollm2_prepares_only_its_default_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="weights: .*typo does not exist"):
        SmolLM2Chat(str(tmp_path / "typo")).prepare_weights()
    assert not (tmp_path / "typo").exists()


def test_bad_engine_knobs_are_errors_naming_the_key_before_any_rank_builds_an_engine(tmp_path):
    """The deployment's engine: is checked when the config is read (every rank reads it before loading weights), so a
    typo or a negative wait is one error naming the key, not a traceback from each rank's engine after its weights
    loaded; an engine knob left in the family's model_kwargs, where it used to be, says where it goes now."""
    for key in ("prefill_gather_ms", "decode_yield_ms"):
        for bad in (-1, "5", True):
            with pytest.raises(ConfigError, match=rf"d.yaml: engine.{key} = {bad!r}: must be"):
                parse_config({"model": "smollm2", "node_groups": GROUPS, "engine": {key: bad}}, "d.yaml")
            with pytest.raises(ValueError, match=rf"model_kwargs.{key} = {bad!r}: is engine policy: set engine.{key}"):
                SmolLM2Chat(str(tmp_path), **{key: bad})
    with pytest.raises(ValueError, match=r"model_kwargs: unknown keys \['prefill_gather_s'\]"):
        SmolLM2Chat(str(tmp_path), prefill_gather_s=5)
    with pytest.raises(ConfigError, match=r"engine.prefill_gather_s: unknown key .*did you mean 'prefill_gather_ms'"):
        parse_config({"model": "smollm2", "node_groups": GROUPS, "engine": {"prefill_gather_s": 5}}, "d.yaml")
    assert parse_config({"model": "smollm2", "node_groups": GROUPS, "engine": {"prefill_gather_ms": 5}},
                        "d.yaml").engine.prefill_gather_ms == 5.0


def test_a_port_in_use_is_an_error_naming_it_and_a_reserved_port_serves():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot bind HTTP server to 127.0.0.1:{port} \\(port already in use\\)"):
            reserve_port("127.0.0.1", port)
    sock = reserve_port("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # reserved, not listening: refused
    from starlette.applications import Starlette

    server = HttpServer(Starlette())
    server.start("127.0.0.1", port, timeout_s=10, sock=sock)
    try:
        assert server.port == port and server.running
    finally:
        server.stop(timeout_s=2)


def test_the_port_of_a_running_server_is_refused_to_a_second_one():
    first = reserve_port("127.0.0.1", 0)
    first.listen(8)  # the front end (or its acceptor, with intakes) listens on it
    try:
        with pytest.raises(OSError, match="port already in use"):
            reserve_port("127.0.0.1", first.getsockname()[1])
    finally:
        first.close()


def test_connections_accepted_on_a_reserved_port_have_nagle_off():
    # with Nagle on, each streamed chunk waits for the client's delayed ACK: 40 ms added to every first token
    async def accepted_nodelay() -> int:
        sock = reserve_port("127.0.0.1", 0)
        sock.listen(8)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        got = loop.create_future()

        class Accept(asyncio.Protocol):
            def connection_made(self, transport) -> None:
                got.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await loop.create_server(Accept, sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        try:
            return await asyncio.wait_for(got, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0


def test_a_leaving_rank_fails_its_requests_at_once_and_is_avoided():
    c, ch = make(max_concurrent=10)
    c.serving = True
    events = submit(c, params("r"))
    wire = walks_sent(ch, "start")[0][1].request_id
    c.handle("rank0", m.encode("tok", "rank0", m.WalkDone(request_id=wire, walk="start", rank=0,
                                                           outputs={"x": encode_tensor(torch.tensor([1]))})))
    (peer, _), = walks_sent(ch, "count")
    rank = int(peer[4:])
    c.handle(peer, m.encode("tok", peer, m.Leaving(rank=rank, host="h", reason="stopped by a signal (SIGTERM)")))
    assert isinstance(events[-1], BackendError) and events[-1].status == 503
    assert f"rank {rank} on host h stopped (stopped by a signal (SIGTERM))" in events[-1].message
    assert rank in c.dead_ranks and c.unservable_walks() == []  # the other COUNT replica serves
    submit(c, params("next"))
    assert rank not in c.running("next").choice.nodes.values()
