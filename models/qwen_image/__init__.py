"""Qwen-Image (text-to-image, MMDiT): the published architecture and diffusers layout.

``transformer`` (the MMDiT denoiser), ``text_encoder`` (Qwen2.5-VL's language model), ``vae`` (the decoder of
the Wan-style VAE), ``scheduler`` (flow-matching schedule with dynamic shifting, Euler step, true CFG with norm
rescale), ``pipeline`` (prompt template, latent packing, the reference loop), ``weights`` (the loader),
``checkpoint`` (a tiny random checkpoint of the published layout), ``png`` and ``family`` (the graph nodes).
Nothing here imports diffusers or transformers; the tests compare against them.
"""
