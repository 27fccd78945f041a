"""The garbage collector's share of a serving process (docs/architecture.md §2, "Startup heap").

Every process of the runtime (a rank, the front end, an intake) builds a large heap before it serves: imports, the
model's modules and parameters, tokenizer tables, the app's routes and validators (about 180,000 objects in a front
end). A full collection walks all of it and stops every thread of the process meanwhile, in the middle of someone's
request. Serving itself allocates mostly short-lived objects, which the young
generations collect cheaply. So once a process is ready, what is alive then is moved out of the collector's reach.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then exempt every object alive now from later collections (``gc.freeze``); they are still freed
    by reference counting when let go, but a reference cycle among them is not (a teardown that needs such cycles gone,
    e.g. CUDA graphs, calls ``gc.unfreeze()`` first). Call once, when the process is ready and before it serves: it
    blocks for one full collection. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
