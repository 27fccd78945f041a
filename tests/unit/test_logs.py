"""Log lines: rank and host on every line, ``--log-format json`` one JSON object a line. A failure means logs of
several ranks and hosts cannot be told apart, or a log collector fed with JSON logs gets lines it cannot parse
(a multi-line message, a traceback, uvicorn's own format, a bare print).
"""

from __future__ import annotations

import json
import logging

import pytest

from mstar_dist.logs import JsonFormatter, announce, configure_logging
from mstar_dist.runtime.cli import parse_args


@pytest.fixture
def root():
    """The root logger's handlers and level, restored after the test."""
    logger = logging.getLogger()
    saved = (logger.level, list(logger.handlers), [h.formatter for h in logger.handlers])
    yield logger
    logger.setLevel(saved[0])
    for handler, formatter in zip(saved[1], saved[2]):
        handler.setFormatter(formatter)


def records(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line]


def test_text_lines_carry_rank_and_host(root, capsys):
    handler = logging.StreamHandler()
    root.addHandler(handler)
    try:
        configure_logging("INFO", rank=3, host="node-b", fmt="text")
        logging.getLogger("mstar_dist.worker").info("hello")
    finally:
        root.removeHandler(handler)
    (line,) = [line for line in records(capsys) if "hello" in line]
    assert "[rank 3 host node-b] INFO mstar_dist.worker: hello" in line


def test_json_lines_are_one_object_each_with_every_field(root, capsys):
    handler = logging.StreamHandler()
    root.addHandler(handler)
    try:
        configure_logging("INFO", rank=1, host="node-a", fmt="json")
        logging.getLogger("uvicorn.error").warning("two\nlines")
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("mstar_dist.boot").exception("failed")
        announce("placement table\nrow 2")
    finally:
        root.removeHandler(handler)
    lines = records(capsys)
    objects = [json.loads(line) for line in lines]  # every line parses on its own
    assert {o["message"] for o in objects} >= {"two\nlines", "failed", "placement table\nrow 2"}
    for o in objects:
        assert set(o) >= {"time", "level", "rank", "host", "logger", "message"}
        assert o["rank"] == 1 and o["host"] == "node-a" and o["time"].endswith("+00:00")
    failed = next(o for o in objects if o["message"] == "failed")
    assert failed["level"] == "ERROR" and "ValueError: boom" in failed["exc"]


def test_announce_prints_plainly_with_text_logs(root, capsys):
    configure_logging("INFO", rank=0, host="h", fmt="text")
    announce("mstar_dist: serving m on http://127.0.0.1:1")
    assert capsys.readouterr().out == "mstar_dist: serving m on http://127.0.0.1:1\n"


def test_the_flag_and_its_environment_default(monkeypatch):
    assert parse_args(["c.yaml"]).log_format == "text"
    assert parse_args(["c.yaml", "--log-format", "json"]).log_format == "json"
    monkeypatch.setenv("MSTAR_LOG_FORMAT", "json")
    assert parse_args(["c.yaml"]).log_format == "json"
    with pytest.raises(ValueError, match="--log-format must be one of text, json"):
        configure_logging("INFO", rank=0, host="h", fmt="xml")


def test_rank_unknown_before_identification_is_null_in_json():
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "msg", None, None)
    assert json.loads(JsonFormatter(None, "h").format(record))["rank"] is None
