"""mstar_dist SDK: ``MStarClient`` for the native /generate API and the OpenAI chat route, with image and audio parts
(``image_part``, ``image_url_part``, ``audio_part``) and spoken answers."""

from mstar_dist.client.client import (
    ChatDelta,
    ChatResult,
    GenerateResult,
    Health,
    MStarClient,
    MStarError,
    Output,
    SpokenAudio,
    StreamChunk,
    Usage,
    audio_part,
    image_part,
    image_url_part,
)

__all__ = ["ChatDelta", "ChatResult", "GenerateResult", "Health", "MStarClient", "MStarError", "Output", "SpokenAudio",
           "StreamChunk", "Usage", "audio_part", "image_part", "image_url_part"]
