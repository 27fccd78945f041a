"""Random test weights are announced (mstar_dist/random_weights.py): every checkpoint maker marks its directory, the
deployment's ``served`` labels the model, ``/v1/models`` shows the label, the start-up line says the output is noise.

A failure here means a user who serves a checkpoint made by scripts/ is not told its output is noise (or a real
checkpoint is called random): a maker stopped writing the marker, a family's ``weights_dirs`` misses a directory, or
the label does not reach ``/v1/models``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from mstar_dist.random_weights import (
    CHECKPOINT, MARKER, RANDOM, announcement, mark_prepared, read_marker, weights_label, write_marker,
)
from mstar_dist.server.app import build_app
from tests.fakes import FakeBackend


def test_marker_round_trips_and_labels_the_model(tmp_path: Path) -> None:
    write_marker(tmp_path, 7, "scripts/make_x.py")
    assert json.loads((tmp_path / MARKER).read_text()) == {"weights": RANDOM, "seed": 7, "made_by": "scripts/make_x.py"}
    assert read_marker(tmp_path)["seed"] == 7
    real = tmp_path / "real"
    real.mkdir()
    assert weights_label([real]) == CHECKPOINT and announcement("m", [real]) is None
    assert weights_label([real, tmp_path]) == RANDOM  # any random part makes the model's output noise
    line = announcement("m", [real, tmp_path])
    assert "noise by design" in line and "seed 7" in line and "scripts/make_x.py" in line and "\n" not in line
    assert weights_label([None]) == CHECKPOINT


def test_a_damaged_marker_is_an_error_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / MARKER).write_text("[1, 2]")
    with pytest.raises(ValueError, match=MARKER):
        weights_label([tmp_path])


def test_mark_prepared_marks_an_unmarked_default_and_keeps_a_marker(tmp_path: Path) -> None:
    mark_prepared(tmp_path, 0, "scripts/a.py")
    mark_prepared(tmp_path, 5, "scripts/b.py")
    assert read_marker(tmp_path) == {"weights": RANDOM, "seed": 0, "made_by": "scripts/a.py"}
    mark_prepared(tmp_path / "missing", 0, "scripts/a.py")
    assert not (tmp_path / "missing").exists()


def test_every_checkpoint_maker_writes_the_marker(tmp_path: Path) -> None:
    from models.moe.checkpoint import make_moe_checkpoint
    from models.qwen3_omni.checkpoint import make_qwen3omni_checkpoint
    from models.qwen_image.checkpoint import make_qwen_image_checkpoint
    from models.speech.checkpoint import write_speech_family

    made = {
        "scripts/make_speech_checkpoint.py": write_speech_family(tmp_path / "speech", "tiny", 3),
        "scripts/make_moe_checkpoint.py": (make_moe_checkpoint(tmp_path / "moe", seed=3, writer="plain"),
                                           tmp_path / "moe")[1],
        "scripts/make_qwen3omni_checkpoint.py": (make_qwen3omni_checkpoint(tmp_path / "omni", seed=3),
                                                 tmp_path / "omni")[1],
        "scripts/make_qwen_image_checkpoint.py": make_qwen_image_checkpoint(tmp_path / "image", seed=3),
    }
    for script, directory in made.items():
        assert read_marker(directory) == {"weights": RANDOM, "seed": 3, "made_by": script}, script
        assert Path(script).name in {p.name for p in (Path(__file__).parents[2] / "scripts").iterdir()}
    assert read_marker(tmp_path / "speech" / "snac")["made_by"] == "scripts/make_speech_checkpoint.py"


def test_the_standalone_scripts_write_the_marker(tmp_path: Path) -> None:
    """scripts/make_snac_checkpoint.py and scripts/make_random_checkpoint.py (random weights shaped like a given
    checkpoint) are scripts of their own, run as a user runs them."""
    import subprocess
    import sys

    from models.speech.checkpoint import make_speech_checkpoint

    repo = Path(__file__).parents[2]
    make_speech_checkpoint(tmp_path / "like", "tiny", seed=0, codebook_size=None)
    runs = {"make_snac_checkpoint.py": ["--out", str(tmp_path / "snac"), "--seed", "4"],
            "make_random_checkpoint.py": ["--like", str(tmp_path / "like"), "--out", str(tmp_path / "random"),
                                          "--seed", "4"]}
    for script, args in runs.items():
        done = subprocess.run([sys.executable, str(repo / "scripts" / script), *args], capture_output=True,
                              text=True, timeout=300, cwd=repo)
        assert done.returncode == 0, done.stderr
    for out, script in (("snac", "make_snac_checkpoint.py"), ("random", "make_random_checkpoint.py")):
        assert read_marker(tmp_path / out) == {"weights": RANDOM, "seed": 4, "made_by": f"scripts/{script}"}


def test_the_orpheus_family_looks_at_its_codec_too(tmp_path: Path) -> None:
    from models.speech.checkpoint import write_speech_family
    from models.speech.orpheus import OrpheusSpeech

    root = write_speech_family(tmp_path / "speech", "tiny", 0)
    (root / MARKER).unlink()
    model = OrpheusSpeech(str(root))
    assert model.weights_dirs() == [str(root), str(root / "snac")]
    assert weights_label(model.weights_dirs()) == RANDOM  # the codec alone is random: the audio is noise
    (root / "snac" / MARKER).unlink()
    assert weights_label(model.weights_dirs()) == CHECKPOINT


@pytest.mark.parametrize("weights", [RANDOM, CHECKPOINT])
def test_models_route_shows_the_label(weights: str) -> None:
    backend = FakeBackend()
    backend.weights = weights
    with TestClient(build_app(backend)) as client:
        (card,) = client.get("/v1/models").json()["data"]
    assert card["weights"] == weights


def test_served_labels_a_random_deployment_and_a_real_one(tmp_path: Path) -> None:
    """``runtime.deployment.served`` (what the HTTP app and every intake are told) on a tiny random checkpoint and on
    a checkpoint directory without the marker (the same files: a real checkpoint has no marker)."""
    from types import SimpleNamespace

    from models.moe.chat import MoEChat
    from models.moe.checkpoint import make_moe_checkpoint
    from mstar_dist.runtime.deployment import served

    make_moe_checkpoint(tmp_path / "random", seed=0, writer="plain")
    shutil.copytree(tmp_path / "random", tmp_path / "real", ignore=shutil.ignore_patterns(MARKER))
    for name, label in (("random", RANDOM), ("real", CHECKPOINT)):
        model = MoEChat(str(tmp_path / name))
        model.load_frontend()
        dep = SimpleNamespace(config=SimpleNamespace(model="qwen3_moe", limits=SimpleNamespace(max_tokens=64)),
                              model=model)
        assert served(dep)["weights"] == label, name
