"""The runtime's one door into the model zoo: ``models``' registry, never a family's modules (docs/architecture.md
§1). ``models`` itself imports no torch, so an intake process can build a family's prompt encoder through it."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

log = logging.getLogger(__name__)


def model_class(name: str) -> type:
    """The family class of the deployment's ``model:`` key (ValueError naming the key when there is none)."""
    from models import get_model_class

    return get_model_class(name)


def load_prompt_encoder(spec: list | tuple | None) -> Any:
    """Build the family's prompt encoder from its ``("package.module:Factory", kwargs)`` (``prompt_encoder``); None
    for none, or when it cannot be built here (the conductor then tokenizes, as with one HTTP process)."""
    if spec is None:
        return None
    from models import load_object

    path, kwargs = spec
    try:
        encoder = load_object(path)(**kwargs)
        with contextlib.suppress(Exception):  # a first call pays for lazily built tables, not a client's request
            encoder.encode_prompt(None, [{"role": "user", "content": "warm-up"}])
        return encoder
    except Exception as exc:
        log.warning("intake: cannot build the prompt encoder %s (%s: %s); the conductor tokenizes instead", path,
                    type(exc).__name__, exc)
        return None
