"""Qwen3-Omni (the architecture of the published ``Qwen3-Omni-30B-A3B-Instruct``): a MoE thinker that reads text,
images and audio, a MoE talker that turns the thinker's states into codec frames, and code2wav, which streams
24 kHz audio from them. Parameter names follow the published checkpoint (``thinker.``, ``talker.``, ``code2wav.``).
"""
