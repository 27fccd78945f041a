"""Reading YAML into typed values with the key path in every error.

`ConfigError` is the one error type for deployment-file mistakes: a `ValueError` whose message names the
full key path (``node_groups[1].tp_size``), the value found and, when known, the file. Dataclass
``__post_init__`` checks raise it with a path relative to the object; the parser re-roots it with
`ConfigError.under` so the user sees the path from the top of the file.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any


class ConfigError(ValueError):
    """A user-facing mistake in a deployment config: names the key path, the value and the file."""

    def __init__(self, key: str, problem: str, value_repr: str | None = None, source: str | None = None) -> None:
        self.key = key
        self.problem = problem
        self.value_repr = value_repr
        self.source = source
        super().__init__(self._message())

    def _message(self) -> str:
        where = f"{self.source}: " if self.source else ""
        if not self.key:
            return f"{where}{self.problem}"
        shown = "" if self.value_repr is None else f" = {self.value_repr}"
        return f"{where}{self.key}{shown}: {self.problem}"

    def under(self, prefix: str, source: str | None = None) -> ConfigError:
        """This error with `prefix` put in front of its key path and `source` (the file) attached."""
        return ConfigError(join(prefix, self.key), self.problem, self.value_repr, source or self.source)

    def __reduce__(self):  # keeps the error picklable (it may travel to rank 0 inside LOAD_FAILED)
        return (type(self), (self.key, self.problem, self.value_repr, self.source))


def join(prefix: str, key: str | int) -> str:
    """Key path join: ``join("node_groups", 1) == "node_groups[1]"``, ``join("a", "b") == "a.b"``."""
    if isinstance(key, int):
        return f"{prefix}[{key}]"
    if not prefix:
        return key
    if not key:
        return prefix
    return f"{prefix}{key}" if key.startswith("[") else f"{prefix}.{key}"


def fail(key: str, value: Any, problem: str) -> ConfigError:
    """A `ConfigError` for `value` found at `key` (relative path; the parser adds the rest)."""
    return ConfigError(key, problem, repr(value))


def read_mapping(value: Any, key: str) -> Mapping[str, Any]:
    """`value` as a mapping with string keys."""
    if not isinstance(value, Mapping):
        raise fail(key, value, f"must be a mapping, got {type(value).__name__}")
    for k in value:
        if not isinstance(k, str):
            raise fail(join(key, str(k)), k, f"keys must be strings, got {type(k).__name__}")
    return value


def check_keys(value: Any, key: str, *, required: Iterable[str], optional: Iterable[str] = ()) -> Mapping[str, Any]:
    """`value` as a mapping that has every `required` key and no key outside `required` + `optional`."""
    data = read_mapping(value, key)
    required, optional = tuple(required), tuple(optional)
    allowed = required + optional
    for k in data:
        if k not in allowed:
            close = difflib.get_close_matches(k, allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(join(key, k), f"unknown key {k!r} ({hint}allowed here: {', '.join(sorted(allowed))})")
    missing = [k for k in required if k not in data]
    if missing:
        what = f"mapping {key!r}" if key else "the top level"
        raise ConfigError(join(key, missing[0]), f"missing required key in {what} (required: {', '.join(required)})")
    return data


def read_int(value: Any, key: str, *, minimum: int = 1, maximum: int | None = None) -> int:
    """`value` as an int in ``minimum..maximum`` (a bool is not an int here)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(key, value, f"must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise fail(key, value, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise fail(key, value, f"must be <= {maximum}, got {value}")
    return value


def read_positive_float(value: Any, key: str) -> float:
    """`value` (int or float) as a finite float > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(key, value, f"must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise fail(key, value, f"must be a finite number > 0, got {value}")
    return float(value)


def read_float(value: Any, key: str, *, minimum: float = 0.0) -> float:
    """`value` (int or float, not a bool) as a finite float >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(key, value, f"must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < minimum:
        raise fail(key, value, f"must be a finite number >= {minimum:g}, got {value}")
    return float(value)


def read_bool(value: Any, key: str) -> bool:
    """`value` as a bool (YAML ``true``/``false``; 0, 1 and strings are not bools here)."""
    if not isinstance(value, bool):
        raise fail(key, value, f"must be true or false, got {type(value).__name__}")
    return value


def read_str(value: Any, key: str) -> str:
    """`value` as a non-empty string."""
    if not isinstance(value, str):
        raise fail(key, value, f"must be a string, got {type(value).__name__}")
    if not value:
        raise fail(key, value, "must not be empty")
    return value


def read_choice(value: Any, key: str, choices: Iterable[str]) -> str:
    """`value` as one of `choices`."""
    choices = tuple(choices)
    if read_str(value, key) not in choices:
        raise fail(key, value, f"must be one of {' | '.join(choices)}")
    return value


def read_list(value: Any, key: str) -> tuple[Any, ...]:
    """`value` (a list or tuple) as a non-empty tuple."""
    if not isinstance(value, (list, tuple)):
        raise fail(key, value, f"must be a list, got {type(value).__name__}")
    if not value:
        raise fail(key, list(value), "must not be empty")
    return tuple(value)


def read_unique_strs(value: Any, key: str) -> tuple[str, ...]:
    """`value` as a non-empty tuple of distinct non-empty strings."""
    items = tuple(read_str(v, join(key, i)) for i, v in enumerate(read_list(value, key)))
    _check_unique(items, key)
    return items


def read_unique_ints(value: Any, key: str, *, minimum: int = 0) -> tuple[int, ...]:
    """`value` as a non-empty tuple of distinct ints >= `minimum`."""
    items = tuple(read_int(v, join(key, i), minimum=minimum) for i, v in enumerate(read_list(value, key)))
    _check_unique(items, key)
    return items


def _check_unique(items: tuple[Any, ...], key: str) -> None:
    seen: dict[Any, int] = {}
    for i, item in enumerate(items):
        if item in seen:
            raise fail(key, list(items), f"{item!r} is listed twice (at [{seen[item]}] and [{i}])")
        seen[item] = i
