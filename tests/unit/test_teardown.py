"""A rank's teardown at exit (docs/architecture.md §2, Teardown): components close before the process groups go,
and a backend stuck in its teardown costs a bounded time instead of a rank that never exits."""

import threading
import time

from mstar_dist.engine.component import Component
from mstar_dist.runtime import rank


class _Recorder(Component):
    def __init__(self, name: str, order: list[str], fail: bool = False):
        self.name, self._order, self._fail = name, order, fail

    def run_batch(self, calls):
        return []

    def close(self) -> None:
        self._order.append(f"close {self.name}")
        if self._fail:
            raise RuntimeError("boom")


def test_components_close_before_the_process_groups_are_destroyed_even_when_one_close_fails():
    order: list[str] = []
    comps = {"A": _Recorder("A", order, fail=True), "B": _Recorder("B", order)}
    assert rank.teardown(comps, lambda: order.append("destroy"), timeout_s=5)
    assert order == ["close A", "close B", "destroy"]
    assert comps == {}  # no reference to the graphs is left behind


def test_a_stuck_process_group_teardown_is_abandoned_after_the_timeout():
    release = threading.Event()
    t0 = time.monotonic()
    try:
        assert not rank.teardown({}, lambda: release.wait(30), timeout_s=0.3)
        assert time.monotonic() - t0 < 5
    finally:
        release.set()
