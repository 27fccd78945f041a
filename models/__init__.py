"""Model zoo: registry key (the deployment's ``model:``) -> model family class.

A key of the form ``package.module:ClassName`` imports a model family from outside the zoo (a user's own
package, or the test model family under ``tests/``).
"""

from __future__ import annotations

import importlib


def load_object(path: str):
    """The object a ``package.module:Name`` path names (ImportError or AttributeError when there is none)."""
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def get_model_class(name: str):
    if ":" in name:
        try:
            return load_object(name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"model: cannot load {name!r} ({type(exc).__name__}: {exc})") from None
    from models.llama.chat import LlamaChat, SmolLM2Chat
    from models.moe.chat import MoEChat
    from models.qwen3_omni.family import Qwen3Omni
    from models.qwen_image.family import QwenImage
    from models.speech.orpheus import OrpheusSpeech

    registry = {"llama": LlamaChat, "smollm2": SmolLM2Chat, "orpheus": OrpheusSpeech, "qwen-image": QwenImage,
                "qwen3_moe": MoEChat, "qwen3_omni": Qwen3Omni}
    try:
        return registry[name]
    except KeyError:
        raise ValueError(
            f"model: unknown model {name!r} (known: {sorted(registry)}, or 'package.module:ClassName')"
        ) from None
