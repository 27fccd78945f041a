"""Media the server reads and writes, model-agnostic and without torch (numpy, Pillow, soundfile, soxr).

- ``wav``: the WAV container written around a model's PCM16 output.
- ``image``: ``decode_image`` (PNG, JPEG, WebP bytes -> an RGB array), with the byte and pixel limits checked before
  any pixel is decoded.
- ``audio``: ``decode_audio`` (WAV, MP3, FLAC, OGG bytes -> mono float32 at a target rate), ``resample``.
- ``errors``: ``MediaError``, the one error bad input raises (a ValueError: the server answers it with a 400).
- ``sniff``: a container's kind from its first bytes, so a message can say what the data is.

What a model does with decoded media (resizing to its patch grid, log-mel features) belongs to the model's family.
The package's ``__init__`` imports nothing, so the WAV writer costs no image or audio library at import.
"""
