"""mstar_dist SDK: ``MStarClient`` for the native /generate API, the OpenAI chat and completion routes and
/tokenize, with image and audio parts (``image_part``, ``image_url_part``, ``audio_part``) and spoken answers."""

from mstar_dist.client.client import (
    ChatDelta,
    ChatResult,
    Completion,
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

__all__ = ["ChatDelta", "ChatResult", "Completion", "GenerateResult", "Health", "MStarClient", "MStarError", "Output",
           "SpokenAudio", "StreamChunk", "Usage", "audio_part", "image_part", "image_url_part"]
