"""mstar_dist SDK: ``MStarClient`` for the native /generate API and the OpenAI chat route."""

from mstar_dist.client.client import (
    ChatResult,
    GenerateResult,
    Health,
    MStarClient,
    MStarError,
    Output,
    StreamChunk,
    Usage,
)

__all__ = ["ChatResult", "GenerateResult", "Health", "MStarClient", "MStarError", "Output", "StreamChunk", "Usage"]
