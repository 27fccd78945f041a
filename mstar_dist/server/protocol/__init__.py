"""HTTP protocol types: the OpenAI routes we serve (chat completions, completions, speech, image generations), the
native ``/generate``, and ``/tokenize`` / ``/detokenize``; one module per concern, every public name importable from
here.

Requests are strict (``"5"`` is not an int, ``"yes"`` is not a bool) and reject unknown keys at every level with a 400
naming the key and the closest known one (``base``); keys OpenAI clients routinely send that change nothing are
accepted and ignored, features that are not implemented are a 400 saying so. ``base``: the request base class,
usage, errors; ``messages``: chat messages and content parts; ``sampling``: the sampling fields, vLLM's extra
parameters and structured outputs; ``chat``, ``completions``, ``media``, ``native``, ``tokens``: each route's types.
"""

from mstar_dist.server.protocol.base import (
    PARAM_CTX, UNKNOWN_FIELD, Body, ErrorInfo, ErrorResponse, Unsupported, Usage, key_error, key_problem,
    reject_unknown,
)
from mstar_dist.server.protocol.chat import (
    CHAT_AUDIO_FORMATS, CHAT_UNSUPPORTED, OPENAI_CHAT_IGNORED, VLLM_UNSUPPORTED, AssistantMessage, AudioOutput,
    ChatAudio, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChoiceLogprobs,
    ChunkChoice, ChunkDelta, ModelCard, ModelList, StreamOptions, TokenLogprobEntry, TopLogprob,
)
from mstar_dist.server.protocol.completions import (
    COMPLETION_IGNORED, COMPLETION_UNSUPPORTED, DEFAULT_MAX_TOKENS, PROMPTS_MAX, CompletionChoice, CompletionLogprobs,
    CompletionRequest, CompletionResponse,
)
from mstar_dist.server.protocol.media import (
    SIZE_PATTERN, SPEECH_FORMATS, ImageData, ImageGenerationRequest, ImagesResponse, SpeechRequest,
)
from mstar_dist.server.protocol.messages import (
    IMAGE_DETAILS, MESSAGE_IGNORED, PART_TYPES, AudioPart, ChatMessage, ContentPart, ImagePart, ImageURL, InputAudio,
    TextPart, normalize_messages, part_problem,
)
from mstar_dist.server.protocol.native import (
    MEDIA_ENCODING, NATIVE_UNSUPPORTED, TEXT_ENCODING, GenerateOutput, GenerateRequest, GenerateResponse, ModelKwargs,
    StreamLine,
)
from mstar_dist.server.protocol.sampling import (
    GUIDED_FIELDS, LOGPROBS_MAX, N_MAX, TOKEN_ID_MAX, TOP_K_MAX, ExtraSampling, JsonSchemaFormat, ResponseFormat,
    Sampling, SamplingKnobs, StructuredOutputs,
)
from mstar_dist.server.protocol.tokens import (
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
)

__all__ = [
    "PARAM_CTX", "UNKNOWN_FIELD", "Body", "ErrorInfo", "ErrorResponse", "Unsupported", "Usage", "key_error",
    "key_problem", "reject_unknown",
    "CHAT_AUDIO_FORMATS", "CHAT_UNSUPPORTED", "OPENAI_CHAT_IGNORED", "VLLM_UNSUPPORTED", "AssistantMessage",
    "AudioOutput", "ChatAudio", "ChatChoice", "ChatCompletionChunk", "ChatCompletionRequest", "ChatCompletionResponse",
    "ChoiceLogprobs", "ChunkChoice", "ChunkDelta", "ModelCard", "ModelList", "StreamOptions", "TokenLogprobEntry",
    "TopLogprob",
    "COMPLETION_IGNORED", "COMPLETION_UNSUPPORTED", "DEFAULT_MAX_TOKENS", "PROMPTS_MAX", "CompletionChoice",
    "CompletionLogprobs", "CompletionRequest", "CompletionResponse",
    "SIZE_PATTERN", "SPEECH_FORMATS", "ImageData", "ImageGenerationRequest", "ImagesResponse", "SpeechRequest",
    "IMAGE_DETAILS", "MESSAGE_IGNORED", "PART_TYPES", "AudioPart", "ChatMessage", "ContentPart", "ImagePart",
    "ImageURL", "InputAudio", "TextPart", "normalize_messages", "part_problem",
    "MEDIA_ENCODING", "NATIVE_UNSUPPORTED", "TEXT_ENCODING", "GenerateOutput", "GenerateRequest", "GenerateResponse",
    "ModelKwargs", "StreamLine",
    "GUIDED_FIELDS", "LOGPROBS_MAX", "N_MAX", "TOKEN_ID_MAX", "TOP_K_MAX", "ExtraSampling", "JsonSchemaFormat",
    "ResponseFormat", "Sampling", "SamplingKnobs", "StructuredOutputs",
    "DetokenizeRequest", "DetokenizeResponse", "TokenizeRequest", "TokenizeResponse",
]
