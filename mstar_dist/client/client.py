"""MStarClient: a small synchronous SDK for an mstar_dist server (native /generate, OpenAI chat and completions,
speech and image generations, /tokenize and /detokenize), with images and audio in (``image_part``, ``audio_part``;
files on ``/generate``) and spoken answers out (``modalities=["text", "audio"]``).

Streamed NDJSON is split on b"\\n" and each line decoded as UTF-8 whatever the response's Content-Type says
(a missing charset must not turn "東京" into mojibake), and a partial line or multi-byte character split
across network reads is held until the rest arrives. ``/generate`` outputs are decoded as their
``metadata.encoding`` says: text as itself ("utf-8"), media as base64; an output without the key (a server from
before text was sent as UTF-8) is base64.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

SAMPLING_KEYS = frozenset({
    "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "ignore_eos",
    "min_tokens", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens", "response_format", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar",
})
"""Sampling arguments of ``chat``, ``complete``, ``generate`` and their streaming forms (the server's meaning, which
is vLLM's for its extra parameters)."""
SPEECH_KEYS = frozenset({"model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                         "frequency_penalty", "speed"})
"""Optional ``speech`` / ``speech_stream`` arguments beyond input, voice, response_format and seed."""
WAV_HEADER_BYTES = 44


class MStarError(Exception):
    """An HTTP error or a streamed error line. ``status`` is the HTTP status (0: no response at all)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"[{status}] {message}" if status else message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Usage | None:
        if not d:
            return None
        return cls(d["prompt_tokens"], d["completion_tokens"], d.get("total_tokens",
                                                                      d["prompt_tokens"] + d["completion_tokens"]))


@dataclass(frozen=True)
class SpokenAudio:
    """``message.audio`` of a chat answer asked for with ``modalities=["text", "audio"]``."""

    id: str
    data: bytes
    """A whole WAV file (``audio_format="wav"``) or raw little-endian PCM16 (``"pcm16"``)."""
    transcript: str
    expires_at: int = 0


@dataclass(frozen=True)
class ChatResult:
    text: str
    finish_reason: str
    usage: Usage | None
    id: str = ""
    audio: SpokenAudio | None = None
    """The spoken answer, when asked for."""


@dataclass(frozen=True)
class ChatDelta:
    """One streamed chat event: new ``text`` (may be ""), new ``audio`` (raw PCM16 bytes, may be b""), and on the
    last one the ``finish_reason``."""

    text: str
    audio: bytes = b""
    finish_reason: str | None = None


@dataclass(frozen=True)
class Completion:
    """``POST /v1/completions``: one text per choice (``n`` per prompt, in order)."""

    texts: list[str]
    finish_reasons: list[str]
    usage: Usage | None
    id: str = ""

    @property
    def text(self) -> str:
        return self.texts[0]


@dataclass(frozen=True)
class Output:
    modality: str
    data: bytes
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    text: str
    finish_reason: str
    usage: Usage | None
    outputs: list[Output]


@dataclass(frozen=True)
class StreamChunk:
    """One streamed NDJSON line: ``modality`` "text", "audio" (``data`` is PCM16, ``metadata`` has
    ``sample_rate`` / ``num_channels``) or "image" (``data`` is a PNG file, ``metadata`` has ``width`` /
    ``height``). ``text`` is ``data`` decoded as UTF-8 for modality "text", else None. The last chunk of a stream
    has empty data and ``finish_reason`` / ``usage`` set."""

    modality: str
    data: bytes
    text: str | None
    metadata: dict[str, Any]

    @property
    def finish_reason(self) -> str | None:
        return self.metadata.get("finish_reason")

    @property
    def usage(self) -> Usage | None:
        return Usage.from_dict(self.metadata.get("usage"))


@dataclass(frozen=True)
class Health:
    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


class MStarClient:
    """Talks to one server. Blocking; each call waits up to ``timeout`` seconds for each network step."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", timeout: float = 600.0,
                 headers: dict[str, str] | None = None, api_key: str | None = None) -> None:
        """``api_key`` (default: ``$MSTAR_API_KEY``) is sent as ``Authorization: Bearer <key>`` on every call,
        for a server started with ``--api-key``."""
        self.base_url = base_url.rstrip("/")
        headers = dict(headers or {})
        api_key = api_key if api_key is not None else os.environ.get("MSTAR_API_KEY")
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MStarClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- calls

    def health(self) -> Health:
        """``Health(ok, reason)``; a server that cannot be reached is not ok (never raises)."""
        try:
            resp = self._http.get("/health")
        except httpx.HTTPError as exc:
            return Health(False, f"cannot reach {self.base_url}: {exc}")
        if resp.status_code == 200:
            return Health(True, "ok")
        return Health(False, _error_message(resp))

    def models(self) -> list[str]:
        return [m["id"] for m in self._request("GET", "/v1/models").json()["data"]]

    def chat(self, messages: str | list[dict[str, Any]], *, model: str | None = None,
             modalities: list[str] | None = None, voice: str | None = None, audio_format: str | None = None,
             **sampling: Any) -> ChatResult:
        """OpenAI chat completion (non-streaming). ``messages`` may be a plain user text; a message's content may
        be a list of parts (text, ``image_part(...)``, ``audio_part(...)``). ``modalities=["text", "audio"]`` asks
        for the answer spoken too (``voice``: the model's, default its own; ``audio_format``: "wav" (default) or
        "pcm16"), returned in ``ChatResult.audio``."""
        body = _chat_body(messages, model, modalities, voice, audio_format, sampling, stream=False)
        data = self._request("POST", "/v1/chat/completions", json=body).json()
        choice = data["choices"][0]
        message = choice["message"]
        spoken = message.get("audio")
        audio = None if not spoken else SpokenAudio(id=spoken["id"], data=base64.b64decode(spoken["data"]),
                                                   transcript=spoken["transcript"],
                                                   expires_at=spoken.get("expires_at", 0))
        return ChatResult(text=message["content"] or "", finish_reason=choice["finish_reason"],
                          usage=Usage.from_dict(data.get("usage")), id=data.get("id", ""), audio=audio)

    def chat_stream(self, messages: str | list[dict[str, Any]], *, model: str | None = None,
                    modalities: list[str] | None = None, voice: str | None = None,
                    **sampling: Any) -> Iterator[ChatDelta]:
        """Streamed chat completion: a :class:`ChatDelta` per server-sent event with text or audio (PCM16 chunks, as
        the model makes them, when ``modalities`` holds "audio"), the last one with the finish reason. Raises
        MStarError on an HTTP error or an error event; closing the iterator aborts the request on the server."""
        body = _chat_body(messages, model, modalities, voice, None, sampling, stream=True)
        with self._open_stream("/v1/chat/completions", body) as resp:
            for line in _ndjson_lines(resp.iter_bytes()):
                delta = _chat_event(line)
                if delta is not None:
                    yield delta

    def generate(self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None, *,
                 request_id: str | None = None, model_kwargs: dict[str, Any] | None = None,
                 modalities: list[str] | None = None, images: list[bytes] | None = None,
                 audio: list[tuple[bytes, str]] | None = None, **sampling: Any) -> GenerateResult:
        """Native ``POST /generate`` (non-streaming); give exactly one of ``prompt`` / ``messages``.
        ``model_kwargs``: the model family's knobs (e.g. ``{"voice": "alice"}``), sent with the sampling ones.
        ``modalities``: what to produce (e.g. ["text", "audio"]; the model's default when None). ``images`` (image
        files) and ``audio`` ((file, format) pairs, format "wav", "mp3", "flac" or "ogg") go up as files of a
        multipart body, added to the last user message of ``messages``; parts in ``messages`` work too.
        ``outputs`` holds the text, all audio as one PCM16 entry, and one PNG entry per image."""
        body = _generate_body(prompt, messages, request_id, sampling, model_kwargs, stream=False,
                              modalities=modalities)
        data = self._request("POST", "/generate", **_payload(body, images, audio)).json()
        outputs = [Output(o["modality"], _output_data(o), o.get("metadata", {})) for o in data["outputs"]]
        return GenerateResult(request_id=data["request_id"], text=data["text"], finish_reason=data["finish_reason"],
                              usage=Usage.from_dict(data.get("usage")), outputs=outputs)

    def stream(self, text: str | None = None, messages: list[dict[str, Any]] | None = None, *,
               request_id: str | None = None, model_kwargs: dict[str, Any] | None = None,
               modalities: list[str] | None = None, images: list[bytes] | None = None,
               audio: list[tuple[bytes, str]] | None = None, **sampling: Any) -> Iterator[StreamChunk]:
        """Native streaming ``/generate``: yields chunks (text, audio or image) as they arrive; raises MStarError
        on an HTTP error or an error line. Breaking out of the loop (closing the iterator) closes the connection,
        which aborts the request on the server. ``modalities``, ``images``, ``audio``: as :meth:`generate`."""
        body = _generate_body(text, messages, request_id, sampling, model_kwargs, stream=True, modalities=modalities)
        with self._open_stream("/generate", body, images, audio) as resp:
            for line in _ndjson_lines(resp.iter_bytes()):
                chunk = _chunk(line)
                if chunk.modality == "error":
                    raise MStarError(int(chunk.metadata.get("status", 500)),
                                     str(chunk.metadata.get("message", "error line without a message")))
                yield chunk

    def complete(self, prompt: str | list[str] | list[int] | list[list[int]], *, model: str | None = None,
                 n: int = 1, echo: bool = False, **sampling: Any) -> Completion:
        """OpenAI's legacy completion of ``prompt`` as written (no chat template): a string, strings (``n`` choices
        each, in order), token ids, or lists of them. ``echo`` puts the prompt before each text."""
        body: dict[str, Any] = {"prompt": prompt, **_sampling(sampling)}
        if n != 1:
            body["n"] = n
        if echo:
            body["echo"] = True
        if model is not None:
            body["model"] = model
        data = self._request("POST", "/v1/completions", json=body).json()
        choices = sorted(data["choices"], key=lambda c: c["index"])
        return Completion(texts=[c["text"] for c in choices], finish_reasons=[c["finish_reason"] for c in choices],
                          usage=Usage.from_dict(data.get("usage")), id=data.get("id", ""))

    def tokenize(self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None) -> list[int]:
        """The model's token ids of ``prompt`` (as written) or of ``messages`` (through its chat template)."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt or messages")
        body = {"prompt": prompt} if prompt is not None else {"messages": messages}
        return self._request("POST", "/tokenize", json=body).json()["tokens"]

    def detokenize(self, tokens: list[int]) -> str:
        """The text of ``tokens`` (special tokens written out)."""
        return self._request("POST", "/detokenize", json={"tokens": list(tokens)}).json()["prompt"]

    def speech(self, input: str, voice: str | None, *, response_format: str = "wav", seed: int | None = None,
               **kw: Any) -> bytes:
        """``POST /v1/audio/speech``: the whole audio as a WAV file (``response_format="wav"``) or raw PCM16
        (``"pcm"``; the server sends its rate in the ``X-Sample-Rate`` header). ``voice=None``: the model's default
        voice. ``kw``: some of ``SPEECH_KEYS`` (model, the sampling knobs, speed)."""
        body = _speech_body(input, voice, response_format, seed, kw, stream=False)
        return self._request("POST", "/v1/audio/speech", json=body).content

    def speech_stream(self, input: str, voice: str | None, *, response_format: str = "wav",
                      seed: int | None = None, **kw: Any) -> Iterator[bytes]:
        """Streamed speech: for WAV first the 44-byte header (streaming form: sizes 0xFFFFFFFF, sample rate from the
        model), then PCM bytes as they arrive (pieces follow network reads, not model deltas; joined they are the
        whole PCM). Raises MStarError on an HTTP error, and with status 0 when the transfer breaks off (the server
        failed mid-stream and logged why). Closing the iterator aborts the request on the server."""
        body = _speech_body(input, voice, response_format, seed, kw, stream=True)
        with self._open_stream("/v1/audio/speech", body) as resp:
            yield from _header_first(resp.iter_bytes(), WAV_HEADER_BYTES if response_format == "wav" else 0)

    def images(self, prompt: str, *, n: int = 1, size: str = "64x64", steps: int | None = None,
               guidance_scale: float | None = None, seed: int | None = None) -> list[bytes]:
        """``POST /v1/images/generations``: ``n`` images as PNG files. With ``seed``, image ``i`` uses
        ``seed + i``; ``size`` is "WIDTHxHEIGHT" (the model says which sizes it draws)."""
        body = {"prompt": prompt, "n": n, "size": size, "response_format": "b64_json", "steps": steps,
                "guidance_scale": guidance_scale, "seed": seed}
        data = self._request("POST", "/v1/images/generations",
                             json={k: v for k, v in body.items() if v is not None}).json()
        return [base64.b64decode(item["b64_json"]) for item in data["data"]]

    @contextmanager
    def _open_stream(self, path: str, body: dict[str, Any], images: list[bytes] | None = None,
                     audio: list[tuple[bytes, str]] | None = None) -> Iterator[httpx.Response]:
        """A streamed POST whose status is checked (MStarError on >= 400); a network failure while it is open,
        including a transfer that breaks off, is MStarError with status 0. Leaving the block closes it."""
        try:
            with self._http.stream("POST", path, **_payload(body, images, audio)) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise MStarError(resp.status_code, _error_message(resp))
                yield resp
        except httpx.HTTPError as exc:
            raise MStarError(0, f"request to {self.base_url}{path} failed: {exc!r}") from exc

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise MStarError(0, f"request to {self.base_url}{path} failed: {exc!r}") from exc
        if resp.status_code >= 400:
            raise MStarError(resp.status_code, _error_message(resp))
        return resp


def _sampling(kwargs: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(kwargs) - SAMPLING_KEYS)
    if unknown:
        raise TypeError(f"unknown sampling argument(s) {unknown}; expected some of {sorted(SAMPLING_KEYS)}")
    return {k: v for k, v in kwargs.items() if v is not None}


def _generate_body(prompt: str | None, messages: list[dict[str, Any]] | None, request_id: str | None,
                   sampling: dict[str, Any], model_kwargs: dict[str, Any] | None, *, stream: bool,
                   modalities: list[str] | None = None) -> dict[str, Any]:
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt/text or messages")
    knobs = dict(model_kwargs or {})
    both = sorted(set(knobs) & set(sampling))
    if both:
        raise TypeError(f"{both} given both as argument(s) and in model_kwargs; give each once")
    body: dict[str, Any] = {"stream": stream, "model_kwargs": {**_sampling(sampling), **knobs}}
    body["prompt" if prompt is not None else "messages"] = prompt if prompt is not None else messages
    if request_id is not None:
        body["request_id"] = request_id
    if modalities is not None:
        body["modalities"] = list(modalities)
    return body


def _chat_body(messages: str | list[dict[str, Any]], model: str | None, modalities: list[str] | None,
               voice: str | None, audio_format: str | None, sampling: dict[str, Any], *,
               stream: bool) -> dict[str, Any]:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    body: dict[str, Any] = {"messages": messages, **_sampling(sampling)}
    if stream:
        body["stream"] = True
    if model is not None:
        body["model"] = model
    if modalities is not None:
        body["modalities"] = list(modalities)
    audio = {k: v for k, v in (("voice", voice), ("format", audio_format)) if v is not None}
    if audio:
        body["audio"] = audio
    return body


def _chat_event(line: bytes) -> ChatDelta | None:
    """The delta of one server-sent event line (``data: {...}``); None for other lines and ``[DONE]``."""
    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
        return None
    try:
        chunk = json.loads(line[len(b"data: "):].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise MStarError(0, f"malformed event {line[:200]!r}: {exc}") from exc
    if "error" in chunk:
        err = chunk["error"]
        raise MStarError(int(err.get("code") or 500), str(err.get("message", err)))
    if not chunk.get("choices"):
        return None
    choice = chunk["choices"][0]
    delta = choice.get("delta") or {}
    audio = (delta.get("audio") or {}).get("data")
    return ChatDelta(text=delta.get("content") or "", audio=base64.b64decode(audio) if audio else b"",
                     finish_reason=choice.get("finish_reason"))


IMAGE_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"),
                    (b"BM", "image/bmp"))


def image_type(data: bytes) -> str:
    """The MIME type of an image file from its first bytes (PNG, JPEG, WebP, GIF, BMP); ValueError otherwise."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    for signature, mime in IMAGE_SIGNATURES:
        if data.startswith(signature):
            return mime
    raise ValueError(f"not an image file this client recognises (starts {data[:8]!r}); give its MIME type")


def image_part(data: bytes, mime: str | None = None, *, detail: str | None = None) -> dict[str, Any]:
    """A chat content part carrying an image file inline (a base64 ``data:`` URL; ``mime`` sniffed when None)."""
    url = f"data:{mime or image_type(data)};base64,{base64.b64encode(data).decode('ascii')}"
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    if detail is not None:
        part["image_url"]["detail"] = detail
    return part


def image_url_part(url: str, *, detail: str | None = None) -> dict[str, Any]:
    """A chat content part naming an image by URL (the server fetches only from hosts it allows)."""
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    if detail is not None:
        part["image_url"]["detail"] = detail
    return part


def audio_part(data: bytes, format: str = "wav") -> dict[str, Any]:
    """A chat content part carrying an audio file (``format``: "wav", "mp3", "flac" or "ogg")."""
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode("ascii"), "format": format}}


AUDIO_MIME = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "ogg": "audio/ogg"}


def _payload(body: dict[str, Any], images: list[bytes] | None,
             audio: list[tuple[bytes, str]] | None) -> dict[str, Any]:
    """httpx arguments for ``body``: JSON, or with files a multipart body (``request`` + ``image`` / ``audio``)."""
    if not images and not audio:
        return {"json": body}
    files = [("image", (f"image{i}", data, image_type(data))) for i, data in enumerate(images or ())]
    for i, (data, fmt) in enumerate(audio or ()):
        if fmt not in AUDIO_MIME:
            raise ValueError(f"audio format {fmt!r} is not one of {sorted(AUDIO_MIME)}")
        files.append(("audio", (f"audio{i}.{fmt}", data, AUDIO_MIME[fmt])))
    return {"data": {"request": json.dumps(body)}, "files": files}


def _speech_body(input: str, voice: str | None, response_format: str, seed: int | None, kw: dict[str, Any], *,
                 stream: bool) -> dict[str, Any]:
    unknown = sorted(set(kw) - SPEECH_KEYS)
    if unknown:
        raise TypeError(f"unknown speech argument(s) {unknown}; expected some of {sorted(SPEECH_KEYS)}")
    body = {"input": input, "voice": voice, "response_format": response_format, "seed": seed, "stream": stream, **kw}
    return {k: v for k, v in body.items() if v is not None}


def _header_first(chunks: Iterator[bytes], n_header: int) -> Iterator[bytes]:
    """The first ``n_header`` bytes as one piece (nothing when 0), then the rest as it arrives."""
    pieces = iter(chunks)
    buf = b""
    for piece in pieces:
        buf += piece
        if len(buf) >= n_header:
            break
    if len(buf) < n_header:
        raise MStarError(0, f"the audio stream ended after {len(buf)} bytes, inside its {n_header}-byte header")
    if n_header:
        yield buf[:n_header]
    if buf[n_header:]:
        yield buf[n_header:]
    yield from pieces


def _ndjson_lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Complete lines from a byte stream, split on b"\\n" only (never on other Unicode line breaks)."""
    buf = b""
    for piece in chunks:
        buf += piece
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
    if buf.strip():
        yield buf


def _output_data(obj: dict[str, Any]) -> bytes:
    """The bytes of a ``/generate`` output or stream line: its text's UTF-8 for ``metadata.encoding`` "utf-8", else
    base64 decoded (media, and text from servers before the key existed)."""
    data = obj.get("data") or ""
    if (obj.get("metadata") or {}).get("encoding") == "utf-8":
        return data.encode("utf-8")
    return base64.b64decode(data)


def _chunk(line: bytes) -> StreamChunk:
    try:
        obj = json.loads(line.decode("utf-8"))
        modality, data = obj["modality"], _output_data(obj)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise MStarError(0, f"malformed stream line {line[:200]!r}: {exc}") from exc
    text = data.decode("utf-8") if modality == "text" else None
    return StreamChunk(modality=modality, data=data, text=text, metadata=obj.get("metadata") or {})


def _error_message(resp: httpx.Response) -> str:
    """The server's error message from either error format, else the raw body."""
    raw = resp.content.decode("utf-8", errors="replace")
    try:
        err = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return raw.strip() or resp.reason_phrase
    if isinstance(err, dict):
        return str(err.get("message", err))
    if err is not None:
        return str(err)
    return raw.strip() or resp.reason_phrase
