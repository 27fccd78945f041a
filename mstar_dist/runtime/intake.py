"""An HTTP intake process: the FastAPI app on connections the front end passes it, talking to the conductor over
its control socket (docs/architecture.md §2, "Intake processes"; ``server.http_processes`` > 1).

The front end spawns N of them (``python -m mstar_dist.runtime.intake --index k``: :class:`IntakeProcess`) so that a
burst of arrivals is parsed, validated and framed by N interpreters instead of the one HTTP thread that shares the
conductor's GIL. The front end accepts the connections on ``server.host:port`` and passes each to the intake with
the fewest open ones (``server/handoff.py``: a client keeps its connection, so that is where its requests are
parsed). Its HTTP thread runs uvicorn and the app (``server/app.py``) with ``server/intake_backend.IntakeBackend``
as its backend. No torch is imported here.

Startup, as JSON lines with the front end (no pickle): it binds its channel and writes ``{"endpoint"}``; reads the
handover (the launch's secret, the conductor's endpoint, what the app serves) on stdin; connects, waits for the
conductor's first ``Health``, starts uvicorn on the connections passed to it and writes ``{"listening": port}``. It
stops on SIGTERM (in-flight responses get up to ``DRAIN_S`` to finish) or when its stdin closes (the front end is
gone).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from typing import Any

from mstar_dist.config.deployment import MediaConfig
from mstar_dist.control.channel import ControlChannel
from mstar_dist.control.envelope import CONDUCTOR
from mstar_dist.runtime.children import (
    WHERE_ENV, ChildProcess, ParentGone, ParentPipe, quick_hand_offs, start_watching_parent, where_from_env,
)
from mstar_dist.runtime.lifecycle import Lifecycle
from mstar_dist.runtime.registry import load_prompt_encoder
from mstar_dist.server.app import build_app
from mstar_dist.server.handoff import handoff_pair
from mstar_dist.server.http_metrics import HttpStats
from mstar_dist.server.http_server import HttpServer
from mstar_dist.server.intake_backend import ConductorLink, IntakeBackend

log = logging.getLogger(__name__)

INTAKE_MODULE = "mstar_dist.runtime.intake"
"""What the front end runs as an intake (``python -m``)."""
HANDOVER_WAIT_S = 600.0
"""How long an intake waits for the front end's handover (the front end hands over once every rank is READY)."""
HEALTH_WAIT_S = 10.0
"""How long an intake waits for the conductor's first ``Health`` before it gives up starting."""
DRAIN_S = 5.0
"""How long in-flight responses get to finish when the intake stops (they got their last events already)."""


class IntakeProcess(ChildProcess):
    """The front end's handle on one intake process; ``link`` is the front end's end of the pair on which it passes
    the intake its connections (``server/handoff.py``)."""

    def __init__(self, index: int, *, host_name: str, addr: str, log_level: str, log_format: str):
        self.what = f"HTTP intake {index}"
        self.name = f"intake{index}"
        self.link, theirs = handoff_pair()
        try:
            super().__init__(INTAKE_MODULE,
                             ["--index", str(index), "--log-level", log_level, "--log-format", log_format,
                              "--handoff-fd", str(theirs.fileno())],
                             {WHERE_ENV: f"{host_name} {addr}", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
                             pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {INTAKE_MODULE}")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", default="text")
    p.add_argument("--handoff-fd", type=int, required=True, help="this intake's end of the front end's pair "
                   "(server/handoff.py): the connections it serves come on it")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    host_name, addr = where_from_env()
    lc = Lifecycle(f"intake{args.index}", log_level=args.log_level, rank=0, host=host_name,
                   log_format=args.log_format, progress="off")
    quick_hand_offs()  # the link thread hands work to the HTTP loop until uvicorn runs
    intake = Intake(args, lc, addr)
    return lc.run(intake.serve, intake.failed, intake.teardown)


class Intake:
    """One intake's parts, built step by step (module docstring), and their teardown. Parts not built yet are
    None."""

    def __init__(self, args: argparse.Namespace, lc: Lifecycle, addr: str) -> None:
        self.args, self.lc, self.addr = args, lc, addr
        self.name = lc.name
        self.parent = ParentPipe()
        self.channel: ControlChannel | None = None
        self.link: ConductorLink | None = None
        self.http: HttpServer | None = None

    def serve(self) -> int:
        self.channel = ControlChannel(self.name, self.addr)
        self.parent.report({"endpoint": self.channel.endpoint})
        handover = self.parent.read(HANDOVER_WAIT_S)
        if handover is None:
            raise RuntimeError(f"the front end did not hand over within {HANDOVER_WAIT_S:g} s")
        # from here on a stop drains what is in flight (before, SIGTERM's default ending is the right one)
        self.lc.catch_signals()
        self.channel.connect(CONDUCTOR, handover["conductor"])
        stats = HttpStats()
        backend = self.link_up(handover, stats)
        app = build_app(backend, api_key=handover["api_key"], max_body_bytes=handover["max_body_bytes"], stats=stats,
                        media=MediaConfig(**handover["media"]), tool_call_parser=handover["tool_call_parser"])
        if backend.output_modality == "text":
            warm_up(app, backend, handover["api_key"])
            stats.reset()
        self.http = HttpServer(app)
        self.http.start(handover["host"], handover["port"], timeout_s=30,
                        handoff=socket.socket(fileno=self.args.handoff_fd))
        # the app, its warmed routes and what uvicorn imported as it started leave the collector (heap.py); before
        # the front end hears that this intake listens, so before any request can come
        self.lc.ready()
        self.link.attach(self.http.loop)
        self.parent.report({"listening": self.http.port})
        start_watching_parent(self.lc.stop, "the front end")
        self.lc.wait(self.check)
        return 0

    def link_up(self, handover: dict[str, Any], stats: HttpStats) -> IntakeBackend:
        """The link to the conductor and the backend behind the app; returns once the conductor's first ``Health``
        came (RuntimeError after ``HEALTH_WAIT_S``)."""
        self.link = ConductorLink(self.channel, handover["token"], self.name)
        backend = IntakeBackend(self.link, stats, model_name=handover["model_name"],
                                max_context_tokens=handover["max_context_tokens"],
                                max_tokens_limit=handover["max_tokens_limit"],
                                output_modality=handover["output_modality"],
                                output_modalities=handover["output_modalities"],
                                input_modalities=handover["input_modalities"],
                                weights=handover.get("weights", "checkpoint"),
                                encoder=load_prompt_encoder(handover.get("prompt_encoder")))
        self.link.backend = backend
        self.link.thread.start()
        if not self.link.heard.wait(HEALTH_WAIT_S):
            raise RuntimeError(f"no word from the conductor within {HEALTH_WAIT_S:g} s")
        return backend

    def check(self) -> None:
        if not self.http.running:
            raise RuntimeError("the HTTP thread ended")
        if not self.link.alive:  # nothing would come from the conductor: stop, and the front end says so
            raise RuntimeError("receiving from the conductor stopped; see the error above")

    def failed(self, exc: Exception) -> None:
        if isinstance(exc, ParentGone):  # the front end's own exit says why
            log.info("%s stops: the front end is gone", self.name)
            return
        log.error("%s failed: %s", self.name, exc, exc_info=not isinstance(exc, (TimeoutError, RuntimeError)))

    def teardown(self, rc: int) -> bool:
        if self.http is not None:
            self.http.stop(timeout_s=DRAIN_S)  # what is in flight got its last events from the conductor already
        if self.link is not None:
            self.link.stop()
        if self.channel is not None:
            self.channel.close()
        return True


def warm_up(app, backend: IntakeBackend, api_key: str | None) -> None:
    """Run the app's generation routes once, streamed and not, against canned replies, before the intake listens.
    A first request through the app costs much more than the next ones (lazily built routes, validators and
    encoders); with several intakes, clients would pay it once per intake after every start."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    chat = {"messages": [{"role": "user", "content": "warm-up"}], "max_tokens": 1}
    native = {"prompt": "warm-up"}

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://intake",
                                     headers=headers) as client:
            for path, body in (("/v1/chat/completions", chat), ("/generate", native)):
                for stream in (False, True):
                    response = await client.post(path, json={**body, "stream": stream})
                    if response.status_code != 200:
                        log.warning("intake warm-up: %s gave %d: %s", path, response.status_code, response.text[:200])

    backend.warming = True
    try:
        asyncio.run(run())
    finally:
        backend.warming = False


if __name__ == "__main__":
    sys.exit(main())
