"""Markers by tier: every test under tests/dist, tests/e2e and tests/slurm starts processes or servers and is marked
``slow``, so ``pytest -m "not slow"`` runs the in-process tiers alone (a quick check while editing)."""

from __future__ import annotations

from pathlib import Path

import pytest

SLOW_TIERS = ("dist", "e2e", "slurm")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    root = Path(__file__).parent
    for item in items:
        parts = Path(item.fspath).resolve().relative_to(root).parts
        if parts and parts[0] in SLOW_TIERS:
            item.add_marker(pytest.mark.slow)
