"""Fixtures that unit-test modules opt into with `pytestmark = pytest.mark.usefixtures(...)`."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_intraop_thread():
    """Run the test with one intra-op thread, then restore the count.

    For tests of tiny models: a second thread gains them nothing, and on a busy 2-core host OpenMP's
    waiting threads make each small op up to ~100x slower (tiny denoiser forward: 3 ms on one thread,
    300 ms on two while other processes use the cores).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
