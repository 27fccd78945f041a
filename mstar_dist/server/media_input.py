"""Images and audio clips in requests (docs/architecture.md §9): chat content parts and uploaded files become the
raw bytes of ``GenerationParams.media``.

The server does every check that needs no decoding, each a 400 naming the part (``messages[0].content[1]``) and
what to fix: the model takes that kind of input (the backend's ``input_modalities``), how many items
(``media.max_items``), the base64, the declared type (a ``data:`` URL of an ``image/*`` type, an audio ``format``
of ``AUDIO_INPUT_FORMATS``), the bytes of each item (``media.max_item_bytes``) and the URL policy. Pixels and
seconds need decoding: the family checks them in ``preprocess`` against ``GenerationParams.media_limits``.

Image URLs: ``http(s)`` only, only to hosts of ``media.allowed_domains`` (exact names; none by default), fetched
with httpx under ``media.fetch_timeout_s`` for the whole exchange and ``media.max_item_bytes`` for the body; a
redirect is followed only to the same host, at most ``MAX_REDIRECTS`` times. Proxy settings of the environment are
not used: the policy names the hosts the server itself connects to.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
from fastapi import Request
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from mstar_dist.config.deployment import MediaConfig
from mstar_dist.events import AUDIO_INPUT_FORMATS, MediaItem, MediaLimits
from mstar_dist.server.backend import GenerationBackend
from mstar_dist.server.checks import ApiError, inputs_of
from mstar_dist.server.protocol import AudioPart, ChatMessage, ImagePart, TextPart

MAX_REDIRECTS = 3
"""Same-host redirects an image URL may take."""
_KIND_NAMES = {"image": "images", "audio": "audio"}


@dataclass(frozen=True)
class Upload:
    """A file of a ``multipart/form-data`` ``/generate`` body, its type already read from its headers."""

    kind: str
    """"image" or "audio"."""
    data: bytes
    format: str
    """As ``MediaItem.format``: an image's MIME type, an audio clip's format name."""
    source: str
    """``files[i]`` with the file's name, for error messages."""


def media_limits(media: MediaConfig) -> MediaLimits:
    """The limits a family's decoders apply (``GenerationParams.media_limits``)."""
    return MediaLimits(max_item_bytes=media.max_item_bytes, max_image_pixels=media.max_image_pixels,
                       max_audio_seconds=media.max_audio_seconds)


async def gather_media(messages: list[ChatMessage] | None, backend: GenerationBackend, media: MediaConfig,
                       uploads: list[Upload] = ()) -> list[MediaItem]:
    """The request's media items: the parts of ``messages`` in order, then ``uploads`` (added to the last user
    message). Image URLs are fetched concurrently; the first failure cancels the other fetches. ApiError(400) for
    any item the checks above refuse."""
    parts = list(_media_parts(messages or []))
    if not parts and not uploads:
        return []
    for where, kind in [(p[2], p[3]) for p in parts] + [(u.source, u.kind) for u in uploads]:
        _check_taken(backend, kind, where)
    count = len(parts) + len(uploads)
    if count > media.max_items:
        raise ApiError(400, f"the request carries {count} images and audio clips, above media.max_items = "
                            f"{media.max_items}; send at most {media.max_items}")
    attached = _from_uploads(messages, uploads, media) if uploads else []
    tasks = [asyncio.ensure_future(_from_part(i, offset, where, part, media)) for i, offset, where, _, part in parts]
    try:
        return [*await asyncio.gather(*tasks), *attached]
    finally:
        for task in tasks:
            task.cancel()  # the others, when one failed (a no-op for finished ones)
        await asyncio.gather(*tasks, return_exceptions=True)


def _media_parts(messages: list[ChatMessage]) -> Iterator[tuple[int, int, str, str, ImagePart | AudioPart]]:
    """(message index, offset in its text, key path, kind, part) of every image and audio part."""
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        offset = 0
        for j, part in enumerate(message.content):
            if isinstance(part, TextPart):
                offset += len(part.text)
            else:
                kind = "image" if isinstance(part, ImagePart) else "audio"
                yield i, offset, f"messages[{i}].content[{j}]", kind, part


def _check_taken(backend: GenerationBackend, kind: str, where: str) -> None:
    taken = inputs_of(backend)
    if kind not in taken:
        takes = " and ".join(_KIND_NAMES.get(k, k) for k in taken)
        raise ApiError(400, f"{where}: {backend.model_name!r} takes no {_KIND_NAMES[kind]} (it reads {takes} "
                            "only); leave it out", where)


async def _from_part(i: int, offset: int, where: str, part: ImagePart | AudioPart, media: MediaConfig) -> MediaItem:
    if isinstance(part, AudioPart):
        data = decode_base64(part.input_audio.data, f"{where}.input_audio.data", media)
        return MediaItem("audio", data, part.input_audio.format, i, offset, where)
    url = part.image_url.url
    param = f"{where}.image_url.url"
    if url[:5].lower() == "data:":
        mime, data = data_url(url, param, media)
    else:
        mime, data = await fetch_image(url, param, media)
    return MediaItem("image", data, mime, i, offset, where, part.image_url.detail)


def _from_uploads(messages: list[ChatMessage] | None, uploads: list[Upload], media: MediaConfig) -> list[MediaItem]:
    """Files go after the last user message's content, in the order they came."""
    users = [i for i, m in enumerate(messages or []) if m.role == "user"]
    if not users:
        raise ApiError(400, "files are added to the last user message: send 'messages' with a user message "
                            "(not 'prompt') in the 'request' field", "request")
    i = users[-1]
    offset = len(messages[i].text())
    for upload in uploads:
        check_size(len(upload.data), upload.source, upload.kind, media)
    return [MediaItem(u.kind, u.data, u.format, i, offset, u.source) for u in uploads]


# ------------------------------------------------------------------------------------------- inline data


def check_size(n_bytes: int, where: str, kind: str, media: MediaConfig) -> None:
    if n_bytes > media.max_item_bytes:
        what = "image" if kind == "image" else "audio clip"
        raise ApiError(400, f"{where}: the {what} is {n_bytes} bytes, above media.max_item_bytes = "
                            f"{media.max_item_bytes}; send a smaller one", where)
    if n_bytes == 0:
        raise ApiError(400, f"{where}: the {kind} is empty", where)


def decode_base64(text: str, where: str, media: MediaConfig, kind: str = "audio") -> bytes:
    """Standard base64 (line breaks and spaces allowed) -> bytes, within ``media.max_item_bytes``; the size is
    checked before decoding, from the length (a huge item costs no decoding)."""
    if "\n" in text or " " in text or "\r" in text or "\t" in text:
        text = "".join(text.split())
    size = len(text) * 3 // 4 - text[-2:].count("=")  # exact for valid base64, without decoding it
    if size > media.max_item_bytes:
        check_size(size, where, kind, media)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}: not valid base64 (standard alphabet A-Z a-z 0-9 + /, padded with =)",
                       where) from None
    check_size(len(data), where, kind, media)
    return data


def data_url(url: str, where: str, media: MediaConfig) -> tuple[str, bytes]:
    """(MIME type, bytes) of ``data:image/<type>;base64,<data>``."""
    head, comma, payload = url[5:].partition(",")
    if not comma:
        raise ApiError(400, f"{where}: a data URL has a comma before its data: data:image/png;base64,<data>", where)
    fields = [f.strip().lower() for f in head.split(";")]
    mime = fields[0] or "text/plain"
    if not mime.startswith("image/") or mime == "image/":
        raise ApiError(400, f"{where}: the data URL's type {mime!r} is not an image type; send "
                            "data:image/png;base64,... (or image/jpeg, image/webp)", where)
    if "base64" not in fields[1:]:
        raise ApiError(400, f"{where}: the data URL must carry base64: data:{mime};base64,<data>", where)
    return mime, decode_base64(payload, where, media, "image")


# --------------------------------------------------------------------------------------------------- URLs


def allowed_url(url: str, where: str, media: MediaConfig) -> httpx.URL:
    """``url`` parsed, when the policy lets the server fetch it; else a 400 saying how to send the image."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as exc:
        raise ApiError(400, f"{where}: not a URL ({exc}); send data:image/png;base64,<data>", where) from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ApiError(400, f"{where}: {url[:60]!r} is neither a data: URL nor an http(s) URL; send the image "
                            "as data:image/png;base64,<data>", where)
    host = parsed.host.lower()
    if not media.allowed_domains:
        raise ApiError(400, f"{where}: image URLs are off on this server; send the image inline as "
                            "data:image/png;base64,<data>, or start the server with --allowed-media-domains "
                            f"{host} (config key media.allowed_domains)", where)
    if host not in media.allowed_domains:
        raise ApiError(400, f"{where}: host {host!r} is not in media.allowed_domains "
                            f"({', '.join(media.allowed_domains)}); send the image inline as "
                            "data:image/png;base64,<data>", where)
    return parsed


async def fetch_image(url: str, where: str, media: MediaConfig) -> tuple[str, bytes]:
    """(MIME type or "", bytes) of an image URL the policy allows; every failure is a 400 naming the URL."""
    target = allowed_url(url, where, media)
    try:
        return await asyncio.wait_for(_download(target, where, media), media.fetch_timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(400, f"{where}: {url[:200]} did not deliver the image within media.fetch_timeout_s = "
                            f"{media.fetch_timeout_s:g} s", where) from None
    except httpx.HTTPError as exc:
        raise ApiError(400, f"{where}: fetching {url[:200]} failed: {type(exc).__name__}: {exc}", where) from None


async def _download(url: httpx.URL, where: str, media: MediaConfig) -> tuple[str, bytes]:
    host = url.host.lower()
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=media.fetch_timeout_s) as client:
        for _ in range(MAX_REDIRECTS + 1):
            async with client.stream("GET", url, headers={"Accept": "image/*"}) as resp:
                if resp.is_redirect and "location" in resp.headers:
                    url = url.join(resp.headers["location"])
                    if url.scheme not in ("http", "https") or (url.host or "").lower() != host:
                        raise ApiError(400, f"{where}: the image URL redirects to another host ({url.host!r}); "
                                            "only redirects within the same host are followed", where)
                    continue
                return await _image_body(resp, where, media)
    raise ApiError(400, f"{where}: the image URL redirected more than {MAX_REDIRECTS} times", where)


async def _image_body(resp: httpx.Response, where: str, media: MediaConfig) -> tuple[str, bytes]:
    if resp.status_code != 200:
        raise ApiError(400, f"{where}: GET {resp.url} answered HTTP {resp.status_code}", where)
    mime = resp.headers.get("content-type", "").split(";")[0].strip().lower()
    if mime and mime != "application/octet-stream" and not mime.startswith("image/"):
        raise ApiError(400, f"{where}: {resp.url} is {mime!r}, not an image", where)
    length = resp.headers.get("content-length", "")
    if length.isdigit():
        check_size(int(length), where, "image", media)
    body = bytearray()
    async for chunk in resp.aiter_bytes():
        body += chunk
        if len(body) > media.max_item_bytes:
            check_size(len(body), where, "image", media)
    check_size(len(body), where, "image", media)
    return (mime if mime.startswith("image/") else ""), bytes(body)


# ---------------------------------------------------------------------------------------------- multipart

FORM_FIELDS = ("request", "image", "audio")
"""Fields of a multipart ``/generate`` body: ``request`` (the JSON body, as text), then any number of files in
``image`` and ``audio`` fields."""
AUDIO_TYPES = {"audio/wav": "wav", "audio/x-wav": "wav", "audio/wave": "wav", "audio/vnd.wave": "wav",
               "audio/mpeg": "mp3", "audio/mp3": "mp3", "audio/flac": "flac", "audio/x-flac": "flac",
               "audio/ogg": "ogg", "application/ogg": "ogg"}
"""An audio file's Content-Type -> its format name (``AUDIO_INPUT_FORMATS``)."""
EXTENSIONS = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
              ".gif": "image/gif", ".bmp": "image/bmp", ".wav": "wav", ".mp3": "mp3", ".flac": "flac", ".ogg": "ogg"}
"""A file name's extension -> its type, for files sent without one (``application/octet-stream``)."""


async def read_multipart(request: Request, media: MediaConfig, max_part_bytes: int) -> tuple[str, list[Upload]]:
    """The ``request`` field's text and the files of a ``multipart/form-data`` body; a 400 for anything else in it,
    a file whose type says neither an image nor an audio format, or more files than ``media.max_items``."""
    try:
        form = await request.form(max_files=media.max_items, max_fields=len(FORM_FIELDS),
                                  max_part_size=max_part_bytes)
    except (MultiPartException, HTTPException) as exc:
        detail = getattr(exc, "detail", None) or getattr(exc, "message", str(exc))
        hint = f" (media.max_items = {media.max_items})" if "files" in str(detail) else ""
        raise ApiError(400, f"multipart body: {detail}{hint}; send a 'request' field with the JSON body and files "
                            "in 'image' / 'audio' fields") from None
    try:
        unknown = sorted({key for key in form.keys() if key not in FORM_FIELDS})
        if unknown:
            raise ApiError(400, f"multipart field(s) {unknown} are not taken; send {', '.join(FORM_FIELDS)}")
        texts = form.getlist("request")
        if len(texts) != 1 or not isinstance(texts[0], str):
            raise ApiError(400, "a multipart body needs exactly one 'request' field holding the JSON body as text",
                           "request")
        uploads = []
        for key, value in form.multi_items():
            if key != "request":
                uploads.append(await _upload(key, value, f"files[{len(uploads)}]", media))
        return texts[0], uploads
    finally:
        await form.close()


async def _upload(kind: str, value: UploadFile | str, where: str, media: MediaConfig) -> Upload:
    if not isinstance(value, UploadFile):
        raise ApiError(400, f"{where}: the {kind!r} field must be a file", where)
    where = f"{where} ({value.filename!r})" if value.filename else where
    if value.size is not None:
        check_size(value.size, where, kind, media)
    return Upload(kind, await value.read(), _file_format(kind, value, where), where)


def _file_format(kind: str, value: UploadFile, where: str) -> str:
    declared = (value.content_type or "").split(";")[0].strip().lower()
    guessed = EXTENSIONS.get(_extension(value.filename or ""), "")
    if kind == "image":
        for mime in (declared, guessed):
            if mime.startswith("image/") and mime != "image/":
                return mime
        raise ApiError(400, f"{where}: Content-Type {declared or 'none'!r} is not an image type; send the file "
                            "as image/png, image/jpeg or image/webp", where)
    fmt = AUDIO_TYPES.get(declared) or (guessed if guessed in AUDIO_INPUT_FORMATS else None)
    if fmt is None:
        raise ApiError(400, f"{where}: Content-Type {declared or 'none'!r} is not an audio format taken here; send "
                            f"{', '.join(sorted(AUDIO_TYPES))} (formats {', '.join(AUDIO_INPUT_FORMATS)})", where)
    return fmt


def _extension(name: str) -> str:
    dot = name.rfind(".")
    return name[dot:].lower() if dot >= 0 else ""
