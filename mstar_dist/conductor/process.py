"""The front end (conductor + HTTP server) in its own process on rank 0's host (docs/architecture.md §2).

Detokenisation, stop strings, admission and HTTP framing run here, not under the GIL of the process that feeds
rank 0's GPU. Rank 0 starts it first thing (so its imports overlap the distributed setup) and owns its life:

1. rank 0 spawns ``python -m mstar_dist.conductor.process <the rank's own serve flags>`` with the reserved HTTP
   socket and a pipe inherited (``MSTAR_FRONTEND_HTTP_FD``, ``MSTAR_FRONTEND_OUT_FD``);
2. the front end binds the ``conductor`` control socket and writes ``{"endpoint": ...}`` on the pipe; rank 0
   publishes it in the torchrun store, where every rank looks it up;
3. once rank 0 has loaded its components (the weights are on this host then), it writes one JSON line on the
   front end's stdin: the launch's secret and every rank's control endpoint (``failed`` instead when rank 0
   could not load: the front end tells every rank to stop and exits);
4. the front end loads the model's front half (tokenizer), waits for every READY, announces the placement,
   starts the conductor thread and HTTP, and serves until SIGTERM or until its stdin closes (rank 0 is gone);
   on the way out it fails in-flight requests with 503 and tells every rank to shut down.

Rank 0 stops with an error when the front end exits on its own; the front end exits when rank 0 does. Nothing
here is pickled: the handshake is JSON over a pipe and stdin.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0005
"""How long a thread of the front end may keep the GIL while the other waits for it (Python's default: 5 ms). The
HTTP thread and the conductor thread hand each request over to each other; with 5 ms a burst of 32 arrivals left
the conductor 6.8 ms (median) behind the HTTP thread, and a first token 5 ms behind the conductor
(bench/results/ttft_trace_h200_cudnn.json). Set on hosts of 8 cores or more only: on the 2-core CI machine the
extra hand-offs cost P/D about 3% of its tokens per second at 8 streams (93.5 / 90.3 against 96.2 / 92.8 tok/s)."""

_HTTP_FD = "MSTAR_FRONTEND_HTTP_FD"
_OUT_FD = "MSTAR_FRONTEND_OUT_FD"
_WHERE = "MSTAR_FRONTEND_WHERE"  # "host_name addr"


class FrontendProcess:
    """Rank 0's handle on its front-end process."""

    def __init__(self, argv: list[str], *, host_name: str, addr: str, http_sock: socket.socket):
        """Spawn it now; ``argv`` are this rank's serve flags (the front end parses the same ones)."""
        read_fd, write_fd = os.pipe()
        env = {**os.environ, _HTTP_FD: str(http_sock.fileno()), _OUT_FD: str(write_fd),
               _WHERE: f"{host_name} {addr}", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "mstar_dist.conductor.process", *argv],
                                         stdin=subprocess.PIPE, env=env, pass_fds=(http_sock.fileno(), write_fd))
        finally:
            os.close(write_fd)
        http_sock.close()  # the front end holds the port now; it is freed when the front end exits
        self._out = os.fdopen(read_fd, "rb")
        self.pid = self.proc.pid
        self._checked_at, self._alive = 0.0, True

    def endpoint(self, timeout_s: float) -> str:
        """The front end's control endpoint (blocks until it has bound its socket)."""
        line = _read_line(self._out.fileno(), timeout_s, self.proc)
        if line is None:
            raise RuntimeError(f"the front-end process (pid {self.pid}) did not report its control endpoint "
                               f"within {timeout_s:g} s (exit status {self.proc.poll()}); see its log lines")
        return json.loads(line)["endpoint"]

    def configure(self, token: str, endpoints: dict[str, str], failed: str | None = None) -> None:
        """Hand over the launch's secret and every rank's endpoint (or that rank 0 failed to load)."""
        line = json.dumps({"token": token, "endpoints": endpoints, "failed": failed}) + "\n"
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # it is gone already: alive() says so

    def alive(self) -> bool:
        """Whether it runs (checked at most every 0.2 s: rank 0's loop asks every turn)."""
        now = time.monotonic()
        if now - self._checked_at >= 0.2:
            self._checked_at, self._alive = now, self.proc.poll() is None
        return self._alive

    def describe_exit(self) -> str:
        return f"the front end (conductor and HTTP, pid {self.pid}) exited with status {self.proc.poll()}"

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, wait (it fails in-flight requests and tells the ranks to stop), then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.error("the front end (pid %d) did not stop within %g s; killing it", self.pid, timeout_s)
                self.proc.kill()
                self.proc.wait(5)
        for f in (self.proc.stdin, self._out):
            try:
                f.close()
            except OSError:
                pass
        return self.proc.returncode


def _read_line(fd: int, timeout_s: float, proc: subprocess.Popen | None = None) -> bytes | None:
    """One line from ``fd`` within ``timeout_s`` (None on timeout, EOF, or ``proc`` exiting)."""
    deadline = time.monotonic() + timeout_s
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or (proc is not None and proc.poll() is not None and not select.select([fd], [], [], 0)[0]):
            return None
        ready, _, _ = select.select([fd], [], [], min(left, 0.2))
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            data += chunk
    return data


def main(argv: list[str] | None = None) -> int:
    from mstar_dist.control.channel import ControlChannel
    from mstar_dist.logs import configure_logging
    from mstar_dist.serve import parse_args
    from mstar_dist.worker.boot import (
        _broadcast_shutdown, _start_conductor, _start_http, load_deployment,
    )
    from mstar_dist.worker.worker import CONDUCTOR

    from mstar_dist import trace

    trace.set_process("frontend")
    args = parse_args(argv)
    host_name, addr = os.environ[_WHERE].split(" ", 1)
    configure_logging(args.log_level, rank=0, host=host_name, fmt=args.log_format, progress="off")
    import torch

    torch.set_num_threads(1)
    if (os.cpu_count() or 1) >= 8:  # on a small host the other processes need the cores more than we need hand-offs
        sys.setswitchinterval(SWITCH_INTERVAL_S)
    out = os.fdopen(int(os.environ[_OUT_FD]), "wb")
    http_sock = socket.socket(fileno=int(os.environ[_HTTP_FD]))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    channel = conductor = http = None
    dep = None
    world_size = 0
    rc = 0
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        local_ws = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
        dep = load_deployment(args, world_size, local_ws)
        channel = ControlChannel(CONDUCTOR, addr)
        out.write(json.dumps({"endpoint": channel.endpoint}).encode() + b"\n")
        out.flush()
        line = _read_line(sys.stdin.fileno(), args.startup_timeout + 30)
        if line is None:
            raise RuntimeError(f"rank 0 did not hand over the ranks' endpoints within {args.startup_timeout:g} s "
                               f"(--startup-timeout)")
        handover: dict[str, Any] = json.loads(line)
        import dataclasses

        dep = dataclasses.replace(dep, token=handover["token"])
        for name, endpoint in sorted(handover["endpoints"].items()):
            channel.connect(name, endpoint)
        if handover.get("failed"):
            _broadcast_shutdown(dep, channel, world_size, handover["failed"])
            time.sleep(0.2)
            return 1
        threading.Thread(target=_watch_parent, args=(stop,), name="parent-watch", daemon=True).start()
        conductor = _start_conductor(dep, channel, args.startup_timeout, log_stats_s=args.log_stats)
        http = _start_http(dep, conductor, api_key=args.api_key, sock=http_sock)
        http_sock = None
        while not stop.wait(0.2):
            if not conductor.thread.is_alive():
                raise RuntimeError("the conductor thread died")
    except Exception as exc:
        log.error("the front end failed: %s", exc, exc_info=not isinstance(exc, (TimeoutError, ValueError)))
        rc = 1
        if conductor is None and channel is not None and dep is not None and dep.token:
            _broadcast_shutdown(dep, channel, world_size, f"the front end on rank 0's host failed: {exc}")
            time.sleep(0.2)
    finally:
        if conductor is not None:
            # in-flight requests get their 503 while HTTP still delivers them; only after the join may this
            # thread use the conductor's socket (ZMQ sockets are single-threaded)
            conductor.stopped.set()
            if conductor.thread is not None:
                conductor.thread.join(timeout=10)
            _broadcast_shutdown(dep, conductor.channel, world_size, "rank 0 is stopping", error=rc != 0)
            time.sleep(0.2)  # let the shutdown messages leave before the socket closes
        if http is not None:
            http.stop()
        if http_sock is not None:
            http_sock.close()
        if channel is not None:
            channel.close()
    return rc


def _watch_parent(stop: threading.Event) -> None:
    """Rank 0 holds our stdin: end of file means it is gone (even SIGKILLed)."""
    fd = sys.stdin.fileno()
    try:
        while not stop.is_set():
            if select.select([fd], [], [], 0.5)[0] and not os.read(fd, 65536):
                break
    except (OSError, ValueError):
        pass
    if not stop.is_set():
        log.error("rank 0 is gone (its pipe to the front end closed): stopping")
        stop.set()


if __name__ == "__main__":
    sys.exit(main())
