"""The marker of a checkpoint made of random weights, and what the server says about it.

A checkpoint directory written by a maker under ``scripts/`` (``models/*/checkpoint.py``) holds random weights drawn
from a seed: what it generates is noise by design (speech that plays as full-scale hiss, images of coloured noise,
text of random tokens). Such a directory carries :data:`MARKER`, a JSON file
``{"weights": "random-test", "seed": <int>, "made_by": "<script path>"}``; a real checkpoint has none. The front end
reads it at load (`weights_label` over the family's ``weights_dirs()``): ``/v1/models`` shows ``"weights":
"random-test"`` (else ``"checkpoint"``) and one log line at start says the output is noise (`announcement`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MARKER = "mstar_random_weights.json"
"""The marker's file name, in the checkpoint directory's root."""
RANDOM = "random-test"
"""``weights`` of a checkpoint with the marker (its own ``weights`` value)."""
CHECKPOINT = "checkpoint"
"""``weights`` of a checkpoint without the marker."""


def write_marker(directory: str | Path, seed: int, made_by: str) -> Path:
    """Mark ``directory`` (which exists) as random weights drawn from ``seed`` by the script ``made_by`` (a path
    relative to the repository, e.g. "scripts/make_speech_checkpoint.py"). Returns the marker's path."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    path = Path(directory) / MARKER
    path.write_text(json.dumps({"weights": RANDOM, "seed": seed, "made_by": made_by}, indent=2) + "\n")
    return path


def read_marker(directory: str | Path | None) -> dict[str, Any] | None:
    """The marker of ``directory`` (None: no marker, or no directory). A marker that is not a JSON object with a
    string ``weights`` is a ValueError naming the file: a damaged marker must not pass for a real checkpoint."""
    if directory is None:
        return None
    path = Path(directory).expanduser() / MARKER
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(marker, dict) or not isinstance(marker.get("weights"), str):
        raise ValueError(f"{path}: expected {{\"weights\": \"{RANDOM}\", \"seed\": ..., \"made_by\": ...}}, "
                         f"got {marker!r:.200}")
    return marker


def weights_label(directories: list[str | Path | None]) -> str:
    """:data:`RANDOM` when any of a model's weight directories carries the marker, else :data:`CHECKPOINT`."""
    return RANDOM if any(read_marker(d) is not None for d in directories) else CHECKPOINT


def announcement(model: str, directories: list[str | Path | None]) -> str | None:
    """The one line the server logs at start for a model with random weights (None for real ones)."""
    marked = [(Path(d).expanduser(), m) for d in directories if (m := read_marker(d)) is not None]
    if not marked:
        return None
    where = "; ".join(f"{d} (seed {m.get('seed')}, made by {m.get('made_by')})" for d, m in marked)
    return (f"model {model!r} serves RANDOM TEST WEIGHTS, not a trained checkpoint: its output is noise by design "
            f"({where}); point 'weights:' at a real checkpoint for real output")


def mark_prepared(directory: str | Path, seed: int, made_by: str) -> None:
    """Mark a family's default directory, which only its maker ever writes, when it lacks the marker (prepared by a
    version that wrote none): its weights are random all the same."""
    directory = Path(directory).expanduser()
    if directory.is_dir() and read_marker(directory) is None:
        write_marker(directory, seed, made_by)
