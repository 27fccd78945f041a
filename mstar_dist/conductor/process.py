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


class ChildProcess:
    """A helper process of the front end's family (``python -m <module>``) that talks JSON lines: it writes them on an
    inherited pipe (``MSTAR_FRONTEND_OUT_FD``), reads them on its stdin, and stops on SIGTERM or when its stdin
    closes (its parent is gone)."""

    what = "child process"

    def __init__(self, module: str, argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()):
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", module, *argv], stdin=subprocess.PIPE,
                                         env={**os.environ, **env, _OUT_FD: str(write_fd)},
                                         pass_fds=(*pass_fds, write_fd))
        finally:
            os.close(write_fd)
        self._out = os.fdopen(read_fd, "rb")
        self.pid = self.proc.pid
        self._checked_at, self._alive = 0.0, True

    def read(self, timeout_s: float, what: str) -> dict[str, Any]:
        """The next JSON line it writes; RuntimeError naming ``what`` it owed when none comes within ``timeout_s``."""
        line = _read_line(self._out.fileno(), timeout_s, self.proc)
        if line is None:
            raise RuntimeError(f"{self.what} (pid {self.pid}) did not report {what} within {timeout_s:g} s "
                               f"(exit status {self.proc.poll()}); see its log lines")
        return json.loads(line)

    def write(self, obj: dict[str, Any]) -> None:
        """One JSON line on its stdin (nothing when it is gone already: ``alive()`` says so)."""
        try:
            self.proc.stdin.write(json.dumps(obj).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def alive(self) -> bool:
        """Whether it runs (checked at most every 0.2 s: callers ask every turn of their loop)."""
        now = time.monotonic()
        if now - self._checked_at >= 0.2:
            self._checked_at, self._alive = now, self.proc.poll() is None
        return self._alive

    def describe_exit(self) -> str:
        return f"{self.what} (pid {self.pid}) exited with status {self.proc.poll()}"

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, wait up to ``timeout_s`` (it finishes what it must on the way out), then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.error("%s (pid %d) did not stop within %g s; killing it", self.what, self.pid, timeout_s)
                self.proc.kill()
                self.proc.wait(5)
        for f in (self.proc.stdin, self._out):
            try:
                f.close()
            except OSError:
                pass
        return self.proc.returncode


class FrontendProcess(ChildProcess):
    """Rank 0's handle on its front-end process."""

    what = "the front end (conductor and HTTP)"

    def __init__(self, argv: list[str], *, host_name: str, addr: str, http_sock: socket.socket):
        """Spawn it now; ``argv`` are this rank's serve flags (the front end parses the same ones)."""
        env = {_HTTP_FD: str(http_sock.fileno()), _WHERE: f"{host_name} {addr}", "CUDA_VISIBLE_DEVICES": "",
               "OMP_NUM_THREADS": "1"}
        super().__init__("mstar_dist.conductor.process", argv, env, pass_fds=(http_sock.fileno(),))
        http_sock.close()  # the front end holds the port now; it is freed when the front end exits

    def endpoint(self, timeout_s: float) -> str:
        """The front end's control endpoint (blocks until it has bound its socket)."""
        return self.read(timeout_s, "its control endpoint")["endpoint"]

    def configure(self, token: str, endpoints: dict[str, str], failed: str | None = None) -> None:
        """Hand over the launch's secret and every rank's endpoint (or that rank 0 failed to load)."""
        self.write({"token": token, "endpoints": endpoints, "failed": failed})


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
    from mstar_dist.heap import freeze_startup_heap
    from mstar_dist.logs import configure_logging
    from mstar_dist.serve import parse_args
    from mstar_dist.conductor.intake import IntakeProcess
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

    channel = conductor = http = acceptor = None
    intakes: list[IntakeProcess] = []
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
        if dep.config.server.http_processes > 1:  # spawned now: their imports overlap the ranks' loading
            intakes = [IntakeProcess(k, host_name=host_name, addr=addr, log_level=args.log_level,
                                     log_format=args.log_format) for k in range(dep.config.server.http_processes)]
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
        threading.Thread(target=watch_parent, args=(stop, "rank 0"), name="parent-watch", daemon=True).start()
        for intake in intakes:
            channel.connect(intake.name, intake.read(60, "its control endpoint")["endpoint"])
        conductor = _start_conductor(dep, channel, args.startup_timeout, log_stats_s=args.log_stats,
                                     intakes=tuple(intake.name for intake in intakes))
        if intakes:  # the acceptor owns the port from here
            acceptor = _start_intakes(dep, intakes, http_sock, conductor_endpoint=channel.endpoint,
                                      api_key=args.api_key)
        else:
            http = _start_http(dep, conductor, api_key=args.api_key, sock=http_sock)
        http_sock = None
        # tokenizer, model family, app and what uvicorn imported as it started leave the collector (heap.py)
        freeze_startup_heap()
        while not stop.wait(0.2):
            if not conductor.alive:
                raise RuntimeError("the conductor thread died")
            for intake in intakes:
                if not intake.alive():
                    raise RuntimeError(intake.describe_exit())
    except Exception as exc:
        log.error("the front end failed: %s", exc, exc_info=not isinstance(exc, (TimeoutError, ValueError)))
        rc = 1
        if conductor is None and channel is not None and dep is not None and dep.token:
            _broadcast_shutdown(dep, channel, world_size, f"the front end on rank 0's host failed: {exc}")
            time.sleep(0.2)
    finally:
        if acceptor is not None:  # no new connections while what is in flight ends
            acceptor.stop()
        if conductor is not None:
            # in-flight requests get their 503 while HTTP still delivers them; only after the join may this
            # thread use the conductor's socket (ZMQ sockets are single-threaded)
            conductor.stop(timeout_s=10)
        _stop_all(intakes)  # after the conductor's last word (503 to what was in flight) has reached them
        if conductor is not None:
            _broadcast_shutdown(dep, conductor.channel, world_size, "rank 0 is stopping", error=rc != 0)
            time.sleep(0.2)  # let the shutdown messages leave before the socket closes
        if http is not None:
            http.stop()
        if http_sock is not None:
            http_sock.close()
        if channel is not None:
            channel.close()
    return rc


def _start_intakes(dep, intakes: list, sock: socket.socket, *, conductor_endpoint: str, api_key: str | None):
    """Hand every intake what it serves, wait until each serves, then accept on ``sock`` (the reserved port) and pass
    the connections to them (docs/architecture.md §2): the running ``Acceptor``."""
    from mstar_dist.server.handoff import Acceptor
    from mstar_dist.worker.boot import announce, served

    server = dep.config.server
    port = sock.getsockname()[1]
    for intake in intakes:
        intake.write({"token": dep.token, "conductor": conductor_endpoint, "host": server.host, "port": port,
                      "api_key": api_key, "max_body_bytes": server.max_body_bytes,
                      "prompt_encoder": dep.model.prompt_encoder(), **served(dep)})
    for intake in intakes:
        intake.read(60, "that it listens on the port")
    acceptor = Acceptor(sock, [intake.link for intake in intakes])
    acceptor.start()
    announce(f"mstar_dist: serving {dep.config.model} on http://{server.host}:{port} "
             f"({len(intakes)} HTTP intake processes)")
    return acceptor


def _stop_all(children: list, timeout_s: float = 8.0) -> None:
    """SIGTERM each at once, then wait for each (their drains overlap; an intake drains for at most 5 s, so the
    front end stays within the 15 s rank 0 gives it)."""
    for child in children:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    for child in children:
        child.stop(timeout_s)


def watch_parent(stop: threading.Event, parent: str) -> None:
    """Our ``parent`` holds our stdin: end of file means it is gone (even SIGKILLed)."""
    fd = sys.stdin.fileno()
    try:
        while not stop.is_set():
            if select.select([fd], [], [], 0.5)[0] and not os.read(fd, 65536):
                break
    except (OSError, ValueError):
        pass
    if not stop.is_set():
        log.error("%s is gone (its pipe to this process closed): stopping", parent)
        stop.set()


if __name__ == "__main__":
    sys.exit(main())
