"""Test doubles shared by unit tests.

FakeBackend implements ``GenerationBackend`` the way the conductor does, over a scripted model: text, audio or
image deltas; stop strings applied once, before the app sees the text (the conductor's ``StopTrimmer``); model
knobs (``model_kwargs``) validated like a family's ``preprocess`` (an unknown knob or value is a 400 naming it) and
listed (``model_knobs``); ``n`` choices (choice j repeats each text delta j + 1 times) and log-probabilities
(:func:`fake_logprob`, and the prompt's on a choice's first delta) as the engine gives them; a character-level
tokenizer (:class:`FakeTokenizer`).
A fake that reads media (``input_modalities``) says first what it received (``media_echo``); one that also speaks
(``output_modalities=("text", "audio")``) follows each text delta with audio when a request asks for it.
It records every request it saw and whether each generator was closed and whether it was aborted (closed before
its Finished). The flags are ``threading.Event``s because the app may run on a server thread while the test
waits on the main thread. ``parse_wav`` and ``png_size`` read back what clients receive.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import struct
import threading
import wave
import zlib
from collections.abc import Callable
from typing import Any

from mstar_dist.conductor.stop_strings import StopTrimmer
from mstar_dist.events import ChoiceEnd, TokenLogprob
from mstar_dist.server.backend import BackendError, Finished, GenerationParams, MediaDelta, TextDelta

UNICODE_DELTAS = ["hé", "llo → ", "東", "京 ", "🚀"]
UNICODE_TEXT = "".join(UNICODE_DELTAS)  # "héllo → 東京 🚀"

SAMPLE_RATE = 16000
VOICES = ("alice", "bob")
IMAGE_SIZES = ((32, 32), (64, 64))


def pcm_chunk(i: int, n_samples: int = 160) -> bytes:
    """``n_samples`` mono PCM16 samples, different for every ``i`` (and including negative values)."""
    return struct.pack(f"<{n_samples}h", *(((i * 7919 + k * 31) % 65536) - 32768 for k in range(n_samples)))


def audio_delta(pcm: bytes, sample_rate: int = SAMPLE_RATE) -> MediaDelta:
    return MediaDelta("audio", pcm, {"sample_rate": sample_rate, "num_channels": 1}, n_tokens=1)


AUDIO_DELTAS = [audio_delta(pcm_chunk(i)) for i in range(3)]
AUDIO_PCM = b"".join(d.data for d in AUDIO_DELTAS)


def tiny_png(width: int, height: int, seed: int) -> bytes:
    """A valid 8-bit greyscale PNG whose pixels depend on ``seed``."""
    rows = b"".join(b"\x00" + bytes((seed + x * 3 + y * 5) % 256 for x in range(width)) for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a PNG file; asserts it is one."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return struct.unpack(">II", data[16:24])


def parse_wav(data: bytes) -> tuple[int, int, bytes]:
    """(sample rate, channels, PCM) as Python's ``wave`` module reads a 16-bit WAV file."""
    with wave.open(io.BytesIO(data)) as w:
        assert w.getsampwidth() == 2
        return w.getframerate(), w.getnchannels(), w.readframes(1 << 30)


def image_seed(params: GenerationParams) -> int:
    """The request's seed, else a hash of its request id (as the conductor seeds a pinned id)."""
    if params.seed is not None:
        return params.seed
    return int.from_bytes(hashlib.sha256(params.request_id.encode()).digest()[:4], "little")


def fake_image(params: GenerationParams) -> MediaDelta:
    """One PNG of the requested size (default 64x64) drawn from the request's seed."""
    width, height = params.model_kwargs.get("width", 64), params.model_kwargs.get("height", 64)
    png = tiny_png(width, height, image_seed(params))
    return MediaDelta("image", png, {"width": width, "height": height}, n_tokens=1)


def _check_voice(value: Any) -> str | None:
    return None if value in VOICES else f"voice {value!r} is not one of this model's voices: {', '.join(VOICES)}"


def _check_range(name: str, kind: type, lo: float, hi: float) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        ok = isinstance(value, kind) and not isinstance(value, bool) and lo <= value <= hi
        return None if ok else f"{name} must be a {kind.__name__} in [{lo}, {hi}], got {value!r}"
    return check


def _check_side(name: str, value: Any) -> str | None:
    sides = sorted({w for w, _ in IMAGE_SIZES})
    return None if value in sides else f"{name} {value!r} is not supported; this model draws {sides} pixels"


KNOBS: dict[str, dict[str, Callable[[Any], str | None]]] = {
    "text": {},
    "audio": {"voice": _check_voice},
    "image": {"width": lambda v: _check_side("width", v), "height": lambda v: _check_side("height", v),
              "steps": _check_range("steps", int, 1, 50),
              "guidance_scale": _check_range("guidance_scale", float, 0, 20),
              "negative_prompt": lambda v: None if isinstance(v, str) else "negative_prompt must be a string"},
}
"""The knobs each fake family takes, with their checks (a message for the client, or None when valid)."""

Script = list[str | MediaDelta | Callable[[GenerationParams], MediaDelta]]


def media_echo(params: GenerationParams) -> str:
    """What the fake says first about the media it received: the byte sizes of its images and audio clips, in order,
    e.g. ``"images=[68, 70] audio=[44] "`` (the whole path from the client's parts to the family, in one line)."""
    images = [len(m.data) for m in params.media if m.kind == "image"]
    audio = [len(m.data) for m in params.media if m.kind == "audio"]
    return f"images={images} audio={audio} "


def speech_for(i: int) -> MediaDelta:
    """The audio delta a speaking fake sends after its text delta number ``i``."""
    return audio_delta(pcm_chunk(100 + i))


class FakeTokenizer:
    """One token per character: the id is the code point, below the surrogates (anything above is id 0,
    ``<unk>``); messages are written ``"role: content\\n"`` each, then ``"assistant: "``."""

    vocab_size = 0xD800

    def encode_prompt(self, prompt: str | None, messages: list[dict[str, str]] | None) -> list[int]:
        text = prompt if messages is None else "".join(f"{m['role']}: {m['content']}\n" for m in messages) + \
            "assistant: "
        return [ord(c) if ord(c) < self.vocab_size else 0 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("<unk>" if i == 0 else chr(i) for i in ids)


def fake_token(text: str, logprob: float) -> TokenLogprob:
    """The fake's token for ``text`` (its first character, as :class:`FakeTokenizer` has it), alternatives aside."""
    token = ord(text[0]) if text and ord(text[0]) < FakeTokenizer.vocab_size else 0
    piece = FakeTokenizer().decode([token])
    return TokenLogprob(token, piece, piece.encode(), logprob)


def fake_logprob(text: str, position: int, choice: int, k: int) -> TokenLogprob:
    """The log-probability the fake gives the token of ``text`` (:func:`fake_token`) at ``position`` of choice
    ``choice``, with ``k`` alternatives: the token itself first, then "a", "b", ... each 1 less likely."""
    chosen = fake_token(text, -0.125 * (position + 1) - choice)
    top = [chosen] + [fake_token(chr(ord("a") + r), chosen.logprob - r - 1) for r in range(k - 1)] if k else []
    return TokenLogprob(chosen.token_id, chosen.token, chosen.token_bytes, chosen.logprob, top)


def choice_text(item: str, choice: int) -> str:
    """What choice ``choice`` says where the script says ``item``."""
    return item * (choice + 1)


class FakeChoice:
    """One choice of a fake generation: its stop strings, tokens and end."""

    def __init__(self, index: int, stop: list[str]) -> None:
        self.index, self.stops, self.tokens, self.done = index, StopTrimmer(stop), 0, False


class FakeBackend:
    model_name = "fake-model"
    max_context_tokens = 64
    max_tokens_limit = 32

    def __init__(self, deltas: Script | None = None, *, output_modality: str = "text", fail_at: int | None = None,
                 error: BaseException | None = None, hang_at: int | None = None, gate_at: int | None = None,
                 input_modalities: tuple[str, ...] = ("text",),
                 output_modalities: tuple[str, ...] | None = None, lists_knobs: bool = True,
                 tokenizer: bool = True) -> None:
        self.output_modality = output_modality
        self.input_modalities = input_modalities
        """What requests may carry; with "image" / "audio" the fake's first text delta is :func:`media_echo`."""
        self.output_modalities = output_modalities or (output_modality,)
        """With ("text", "audio"), a request asking for audio gets :func:`speech_for` after each text delta."""
        default = {"text": UNICODE_DELTAS, "audio": AUDIO_DELTAS, "image": [fake_image]}[output_modality]
        self.deltas: Script = list(default if deltas is None else deltas)
        """What each request yields, one token an item: text, a media delta, or a function of the request's
        params returning a media delta."""
        self.fail_at = fail_at
        """Raise ``error`` (default RuntimeError) before yielding delta number ``fail_at`` (0 = before any)."""
        self.error = error
        self.hang_at = hang_at
        """Block forever before yielding delta number ``hang_at`` (until the app closes the generator)."""
        self.gate_at = gate_at
        """Wait before yielding delta number ``gate_at`` until ``open_gate()`` is called (every request)."""
        knobs = set(KNOBS[output_modality]) | ({"voice"} if "audio" in self.output_modalities else set())
        self.model_knobs = tuple(sorted(knobs)) if lists_knobs else None
        """The family's request knobs the server checks ``model_kwargs`` against (None: not listed)."""
        self.tokenizer = FakeTokenizer() if tokenizer and output_modality == "text" else None
        self.serving = True
        self.calls: list[GenerationParams] = []
        self.started = threading.Event()
        self.hanging = threading.Event()
        self.gated = threading.Event()
        self.closed = threading.Event()
        self.aborted = threading.Event()
        self.n_closed = 0
        self.n_aborted = 0
        self.n_yielded = 0
        self.n_gated = 0
        self._gates: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def health(self) -> tuple[bool, str]:
        return (True, "ok") if self.serving else (False, "rank 1 is not ready")

    def metrics_text(self) -> str:
        return "# TYPE fake_requests_total counter\nfake_requests_total %d\n" % len(self.calls)

    def open_gate(self) -> None:
        """Lets the requests waiting at ``gate_at`` go on; callable from any thread, once they are ``gated``."""
        for loop, event in self._gates:
            loop.call_soon_threadsafe(event.set)

    @staticmethod
    def count_tokens(params: GenerationParams) -> int:
        """One token per whitespace-separated word of the prompt (or of every message)."""
        texts = [params.prompt] if params.prompt is not None else [m["content"] for m in params.messages or []]
        return sum(len(t.split()) for t in texts)

    def _check(self, params: GenerationParams) -> int:
        """Like a family's preprocess: the prompt's token count, or BackendError naming what is wrong."""
        if not self.serving:
            raise BackendError(503, "not serving: rank 1 is not ready")
        knobs = dict(KNOBS[self.output_modality])
        if "audio" in self.output_modalities:
            knobs["voice"] = _check_voice
        for name, value in params.model_kwargs.items():
            if name not in knobs:
                raise BackendError(400, f"unknown model_kwargs key {name!r}; this model takes {sorted(knobs)}")
            problem = knobs[name](value)
            if problem:
                raise BackendError(400, problem)
        prompt_tokens = len(params.prompt_ids) if params.prompt_ids is not None else self.count_tokens(params)
        if prompt_tokens > self.max_context_tokens:
            raise BackendError(400, f"prompt is {prompt_tokens} tokens, context is {self.max_context_tokens}")
        return prompt_tokens

    async def _pause(self, i: int) -> None:
        if i == self.fail_at:
            raise self.error or RuntimeError("boom in the fake model")
        if i == self.hang_at:
            self.hanging.set()
            await asyncio.Event().wait()
        if i == self.gate_at:
            gate = asyncio.Event()
            self._gates.append((asyncio.get_running_loop(), gate))
            self.n_gated += 1
            self.gated.set()
            await gate.wait()
        await asyncio.sleep(0)

    def script(self, params: GenerationParams) -> Script:
        """What this request yields: the media echo first when it carries media, then the deltas, each text delta
        followed by its speech when the request asks for audio from a text model that speaks."""
        script: Script = [media_echo(params)] if params.media else []
        speaks = (self.output_modality == "text" and "audio" in self.output_modalities
                  and "audio" in (params.output_modalities or ()))
        for i, item in enumerate(self.deltas):
            script.append(item)
            if speaks and isinstance(item, str):
                script.append(speech_for(i))
        return script

    async def generate(self, params: GenerationParams):
        self.calls.append(params)
        prompt_tokens = self._check(params)
        self.started.set()
        finished = False
        choices = [FakeChoice(j, params.stop) for j in range(params.n)]  # the conductor's job: the app relays text
        try:
            n = 0
            for i, item in enumerate(self.script(params)):
                await self._pause(i)
                if n == params.max_tokens:
                    break
                n += 1
                self.n_yielded += 1
                if not isinstance(item, str):
                    yield item(params) if callable(item) else item
                    continue
                for choice in choices:
                    if not choice.done:
                        yield self._delta(params, choice, item)
                if all(choice.done for choice in choices):
                    finished = True
                    yield self._finished(choices, prompt_tokens, n, params)
                    return
            if self.fail_at is not None and self.fail_at >= len(self.deltas):
                raise self.error or RuntimeError("boom in the fake model")
            for choice in choices:
                tail = "" if choice.done else choice.stops.flush()
                if tail:
                    yield TextDelta(text=tail, n_tokens=0, index=choice.index)
            finished = True
            yield self._finished(choices, prompt_tokens, n, params)
        finally:
            self.n_closed += 1
            self.closed.set()
            if not finished:
                self.n_aborted += 1
                self.aborted.set()

    def _delta(self, params: GenerationParams, choice: FakeChoice, item: str) -> TextDelta:
        """Choice ``choice``'s delta for the script's text ``item``, cut at the stop strings, with log-probabilities
        as asked for (the prompt's on its first delta)."""
        text = choice.stops.feed(choice_text(item, choice.index))
        logprobs = None if params.logprobs is None else [fake_logprob(item, choice.tokens, choice.index,
                                                                     params.logprobs)]
        prompt = None
        if params.prompt_logprobs is not None and choice.tokens == 0:
            ids = params.prompt_ids if params.prompt_ids is not None else FakeTokenizer().encode_prompt(
                params.prompt, params.messages)
            prompt = [None] + [fake_token(FakeTokenizer().decode([t]), -0.5 * p) for p, t in enumerate(ids[1:], 1)]
        choice.tokens += 1
        choice.done = choice.stops.stopped
        return TextDelta(text=text, n_tokens=1, index=choice.index, logprobs=logprobs, prompt_logprobs=prompt)

    @staticmethod
    def _finished(choices: list[FakeChoice], prompt_tokens: int, n: int, params: GenerationParams) -> Finished:
        reasons = ["stop" if c.stops.stopped or n < params.max_tokens else "length" for c in choices]
        tokens = n + sum(c.tokens for c in choices[1:])  # media items count once
        ends = [ChoiceEnd(c.index, reason, c.tokens) for c, reason in zip(choices, reasons)] if len(choices) > 1 else []
        return Finished(reasons[0], prompt_tokens, tokens, ends)


class IdlePlane:
    """The data-plane operations (mstar_dist/transport/base.py) a fake transport does not care about: nothing to
    acknowledge, issue, withdraw or report. Fakes subclass it and define posting, receiving and dying."""

    def poll(self):
        return []

    def flush(self):
        pass

    def device_inflight(self):
        return False

    def withdraw(self, transfer):
        return False

    def on_ack(self, src, ack):
        pass

    def stats(self):
        return {}

    def close(self):
        pass

