"""Test doubles shared by unit tests.

FakeBackend implements ``GenerationBackend`` with scripted text deltas. It records every request it saw and
whether each generator was closed and whether it was aborted (closed before its Finished). The flags are
``threading.Event``s because the app may run on a server thread while the test waits on the main thread.
"""

from __future__ import annotations

import asyncio
import threading

from mstar_dist.server.backend import BackendError, Finished, GenerationParams, TextDelta

UNICODE_DELTAS = ["hé", "llo → ", "東", "京 ", "🚀"]
UNICODE_TEXT = "".join(UNICODE_DELTAS)  # "héllo → 東京 🚀"


class FakeBackend:
    model_name = "fake-model"
    max_context_tokens = 64
    max_tokens_limit = 32

    def __init__(self, deltas: list[str] | None = None, *, fail_at: int | None = None,
                 error: BaseException | None = None, hang_at: int | None = None) -> None:
        self.deltas = list(UNICODE_DELTAS if deltas is None else deltas)
        self.fail_at = fail_at
        """Raise ``error`` (default RuntimeError) before yielding delta number ``fail_at`` (0 = before any)."""
        self.error = error
        self.hang_at = hang_at
        """Block forever before yielding delta number ``hang_at`` (until the app closes the generator)."""
        self.serving = True
        self.calls: list[GenerationParams] = []
        self.started = threading.Event()
        self.hanging = threading.Event()
        self.closed = threading.Event()
        self.aborted = threading.Event()
        self.n_closed = 0
        self.n_aborted = 0

    def health(self) -> tuple[bool, str]:
        return (True, "ok") if self.serving else (False, "rank 1 is not ready")

    def metrics_text(self) -> str:
        return "# TYPE fake_requests_total counter\nfake_requests_total %d\n" % len(self.calls)

    @staticmethod
    def count_tokens(params: GenerationParams) -> int:
        """One token per whitespace-separated word of the prompt (or of every message)."""
        texts = [params.prompt] if params.prompt is not None else [m["content"] for m in params.messages or []]
        return sum(len(t.split()) for t in texts)

    async def generate(self, params: GenerationParams):
        self.calls.append(params)
        if not self.serving:
            raise BackendError(503, "not serving: rank 1 is not ready")
        prompt_tokens = self.count_tokens(params)
        if prompt_tokens > self.max_context_tokens:
            raise BackendError(400, f"prompt is {prompt_tokens} tokens, context is {self.max_context_tokens}")
        self.started.set()
        finished = False
        text = ""
        try:
            n = 0
            for i, delta in enumerate(self.deltas):
                if i == self.fail_at:
                    raise self.error or RuntimeError("boom in the fake model")
                if i == self.hang_at:
                    self.hanging.set()
                    await asyncio.Event().wait()
                if n == params.max_tokens:
                    break
                await asyncio.sleep(0)
                n += 1
                text += delta
                yield TextDelta(text=delta, n_tokens=1)
                if any(s in text for s in params.stop):  # like the engine: stop once a stop string appeared
                    finished = True
                    yield Finished("stop", prompt_tokens, n)
                    return
            if self.fail_at is not None and self.fail_at >= len(self.deltas):
                raise self.error or RuntimeError("boom in the fake model")
            finished = True
            yield Finished("length" if n == params.max_tokens else "stop", prompt_tokens, n)
        finally:
            self.n_closed += 1
            self.closed.set()
            if not finished:
                self.n_aborted += 1
                self.aborted.set()
