"""``python -m mstar_dist.serve CFG.yaml [flags]``: the torchrun entry point (docs/architecture.md §2). The command
line, its exit codes and the rank it starts live in ``mstar_dist/runtime/`` (``cli.py``)."""

from __future__ import annotations

import sys

from mstar_dist.runtime.cli import main

if __name__ == "__main__":
    sys.exit(main())
