"""The composition root (docs/architecture.md §2): every process of a deployment is assembled here, from typed parts.

- ``cli.py``: ``python -m mstar_dist.serve`` (flags, exit codes) -> the dry run or a rank;
- ``deployment.py``: the immutable ``Deployment`` every process builds from the same files;
- ``rank.py``: a torchrun rank (process groups, data plane, control channel, components, the worker loop);
- ``frontend.py``: the front end on rank 0's host (conductor thread, HTTP or the acceptor of the intakes);
- ``intake.py``: an HTTP intake process (``server.http_processes`` > 1);
- ``children.py``: rank 0's and the front end's handles on their child processes, and the child's side of the pipe;
- ``lifecycle.py``: what the three mains share (signals, logging, heap freeze, bounded teardown);
- ``registry.py``: the one door into the model zoo (``models``).

Only this package imports across the rank and the front end; the rank loop (``worker/``), the conductor
(``conductor/``) and HTTP (``server/``) import nothing from each other's processes.
"""
