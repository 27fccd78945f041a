"""Model zoo: registry key (the deployment's ``model:``) -> model family class."""

from __future__ import annotations


def get_model_class(name: str):
    from models.llama.chat import LlamaChat, SmolLM2Chat

    registry = {"llama": LlamaChat, "smollm2": SmolLM2Chat}
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"model: unknown model {name!r} (known: {sorted(registry)})") from None
