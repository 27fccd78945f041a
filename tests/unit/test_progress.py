"""Progress bars of weight preparation and loading (``mstar_dist.logs.progress_bar``). A failure means a bar went
to stdout (where an operator's pipe or a client of a script reads), into a log file that did not ask for it, into
JSON logs (a line a collector cannot parse), or lost the rank and host that tell the ranks' bars apart.
"""

from __future__ import annotations

import io
import logging
from types import SimpleNamespace

import numpy as np
import pytest

from models.llama.config import LlamaConfig
from mstar_dist import logs
from mstar_dist.logs import configure_logging, progress_bar
from mstar_dist.runtime.cli import parse_args
from mstar_dist.tools.gguf_import import dequantized_tensors


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def restore():
    """The root logger's formatters and the progress settings, restored after the test."""
    root = logging.getLogger()
    saved = (root.level, [h.formatter for h in root.handlers], dict(logs._progress))
    yield
    root.setLevel(saved[0])
    for handler, formatter in zip(root.handlers, saved[1]):
        handler.setFormatter(formatter)
    logs._progress.update(saved[2])


def drawn(monkeypatch, stderr: io.StringIO, items=range(3)) -> str:
    monkeypatch.setattr("sys.stderr", stderr)
    assert list(progress_bar(items, desc="loading w", total=3, unit="tensor")) == list(items)
    return stderr.getvalue()


def test_auto_draws_on_a_terminal_with_rank_and_host_and_never_on_stdout(restore, monkeypatch, capsys):
    configure_logging("INFO", rank=2, host="node-b", progress="auto")
    text = drawn(monkeypatch, Terminal())
    assert "[rank 2 host node-b] loading w" in text and "3/3" in text
    assert capsys.readouterr().out == ""


def test_auto_stays_out_of_a_log_file_unless_asked(restore, monkeypatch):
    configure_logging("INFO", rank=1, host="h", progress="auto")
    assert drawn(monkeypatch, io.StringIO()) == ""
    configure_logging("INFO", rank=1, host="h", progress="on")
    configure_logging("INFO", rank=1, host="h")  # boot's relabelling keeps the mode
    text = drawn(monkeypatch, io.StringIO())
    assert "[rank 1 host h] loading w" in text and "3/3" in text


def test_off_and_json_logs_draw_nothing(restore, monkeypatch):
    configure_logging("INFO", rank=0, host="h", progress="off")
    assert drawn(monkeypatch, Terminal()) == ""
    configure_logging("INFO", rank=0, host="h", fmt="json", progress="on")
    assert drawn(monkeypatch, Terminal()) == ""


def test_the_flag_its_environment_default_and_a_bad_mode(monkeypatch):
    assert parse_args(["c.yaml"]).progress == "auto"
    assert parse_args(["c.yaml", "--progress", "on"]).progress == "on"
    monkeypatch.setenv("MSTAR_PROGRESS", "off")
    assert parse_args(["c.yaml"]).progress == "off"
    with pytest.raises(ValueError, match="--progress must be one of auto, on, off"):
        configure_logging("INFO", rank=0, host="h", progress="always")


def test_gguf_dequantization_shows_a_bar_per_tensor(restore, monkeypatch):
    GGMLQuantizationType = pytest.importorskip("gguf").GGMLQuantizationType  # the GPU image has no gguf

    configure_logging("INFO", rank=0, host="h", progress="on")
    stderr = io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    tensors = [SimpleNamespace(name=name, data=np.ones((4, 4), np.float32), tensor_type=GGMLQuantizationType.F32)
               for name in ("token_embd.weight", "output_norm.weight")]
    config = LlamaConfig(vocab_size=4, hidden_size=4, intermediate_size=8, n_layers=1, n_heads=2, n_kv_heads=2,
                         head_dim=2)
    out = dequantized_tensors(SimpleNamespace(tensors=tensors), config)
    assert set(out) == {"model.embed_tokens.weight", "model.norm.weight"}
    assert "[rank 0 host h] dequantizing GGUF" in stderr.getvalue() and "2/2" in stderr.getvalue()


def test_loading_a_checkpoint_shows_a_bar(restore, monkeypatch, capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    from models.llama.weights import load_llama

    hf = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(hf).save_pretrained(tmp_path)
    configure_logging("INFO", rank=3, host="node-c", progress="auto")
    stderr = Terminal()
    monkeypatch.setattr("sys.stderr", stderr)
    load_llama(tmp_path)
    sources = 2 + 6 * 2  # embedding, final norm, six fused tensors per layer
    assert f"[rank 3 host node-c] loading {tmp_path.name}" in stderr.getvalue()
    assert f"{sources}/{sources}" in stderr.getvalue()
    assert capsys.readouterr().out == ""
