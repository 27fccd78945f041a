"""The startup heap leaves the garbage collector (mstar_dist/heap.py). A failure means a full collection while serving
walks every object a process built at startup again (tens of milliseconds that stop every thread of a rank or the
front end), or that a teardown can no longer free what startup left in reference cycles."""

from __future__ import annotations

import gc
import weakref

from mstar_dist.heap import freeze_startup_heap


class _Node:
    pass


def test_objects_alive_at_startup_leave_the_collector_and_come_back_for_teardown():
    built = [{"i": i, "row": [i]} for i in range(20_000)]  # what startup builds: tracked containers
    cycle = _Node()
    cycle.me = cycle
    watch = weakref.ref(cycle)
    try:
        frozen = freeze_startup_heap()
        assert frozen >= 40_000 and gc.get_freeze_count() == frozen
        tracked = {id(o) for o in gc.get_objects()}  # what a full collection walks now
        assert id(built) not in tracked and id(built[123]) not in tracked
        after = [[i] for i in range(100)]  # serving's allocations stay collectable
        assert id(after[0]) in {id(o) for o in gc.get_objects()}
        del cycle
        gc.collect()
        assert watch() is not None  # a frozen cycle survives collections...
    finally:
        gc.unfreeze()
    gc.collect()
    assert watch() is None  # ...until a teardown unfreezes the heap (runtime/rank.py)
    # what was frozen came back (some interpreters' own gc callbacks freeze a few hundred objects of their own)
    assert gc.get_freeze_count() < frozen // 10
