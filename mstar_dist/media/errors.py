"""The error every bad media input raises. No third-party imports."""

from __future__ import annotations


class MediaError(ValueError):
    """Media the server cannot take: not an image or not audio, corrupt or truncated data, a container that does not
    match the declared format, an unsupported format, or a limit breached.

    The message says what to fix; where a limit was breached it names the limit's parameter and its value, and
    ``limit`` / ``limit_value`` carry them so a server can name its own config key instead.
    """

    def __init__(self, message: str, *, limit: str | None = None, limit_value: int | float | None = None) -> None:
        super().__init__(message)
        self.limit = limit
        """The breached limit's parameter name (``max_bytes``, ``max_pixels``, ``max_seconds``), else None."""
        self.limit_value = limit_value
        """That limit's value, else None."""


def check_size(data: bytes, *, what: str, max_bytes: int) -> None:
    """Raise MediaError when ``data`` is empty or longer than ``max_bytes``; ``what`` names the item ("image")."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    if not data:
        raise MediaError(f"the {what} is empty (0 bytes)")
    if len(data) > max_bytes:
        raise MediaError(f"the {what} is {len(data)} bytes, over the limit max_bytes = {max_bytes}; send a smaller "
                         f"file", limit="max_bytes", limit_value=max_bytes)
