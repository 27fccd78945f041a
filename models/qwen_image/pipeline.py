"""What diffusers' ``QwenImagePipeline`` does around the three networks: the prompt template and the prefix it
drops, latent packing, the initial noise, and the reference loop that the graph nodes split across ranks.

Prompts are read through PROMPT_TEMPLATE; the text encoder's hidden states of the template's first DROP_IDX
tokens (the system turn and ``<|im_start|>user\\n``) are dropped, and at most MAX_SEQUENCE_LENGTH remain. The
latents are (1, z, h, w) with h, w = pixels / vae_scale_factor; the transformer reads them packed in 2x2 patches:
(1, h/2 * w/2, 4z).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from models.qwen_image.scheduler import FlowMatchSchedule, euler_step, true_cfg

PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
"""The published pipeline's ``prompt_template_encode``."""
DROP_IDX = 34
"""The pipeline's ``prompt_template_encode_start_idx``: tokens of the template before the prompt."""
TOKENIZER_MAX_LENGTH = 1024
"""Prompt tokens the pipeline keeps after the prefix (it truncates the templated text to this + DROP_IDX)."""
MAX_SEQUENCE_LENGTH = 512
"""Embeddings the pipeline passes to the transformer (``max_sequence_length``'s default)."""


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer as a ``tokenizers.Tokenizer``: ``tokenizer.json`` when present, else the
    published ``vocab.json`` + ``merges.txt`` with Qwen2's pipeline and the added tokens of tokenizer_config.json."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    from models.qwen3_omni.checkpoint import PRETOKENIZE_REGEX

    path = Path(path).expanduser()
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    if not (path / "vocab.json").is_file() or not (path / "merges.txt").is_file():
        raise FileNotFoundError(f"{path}: neither tokenizer.json nor vocab.json + merges.txt")
    tok = Tokenizer(models.BPE.from_file(str(path / "vocab.json"), str(path / "merges.txt")))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    config = json.loads((path / "tokenizer_config.json").read_text())
    added = sorted(config.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0]))
    for _, t in added:
        token = AddedToken(t["content"], special=t.get("special", False), normalized=False)
        tok.add_special_tokens([token]) if t.get("special") else tok.add_tokens([token])
    return tok


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The templated prompt's ids, truncated as the pipeline's tokenizer call truncates."""
    ids = tokenizer.encode(PROMPT_TEMPLATE.format(prompt), add_special_tokens=False).ids
    return ids[:TOKENIZER_MAX_LENGTH + DROP_IDX]


def prompt_embeds(hidden: torch.Tensor) -> torch.Tensor:
    """(T, d) hidden states of the templated prompt -> the embeddings the transformer reads."""
    return hidden[DROP_IDX:][:MAX_SEQUENCE_LENGTH]


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, z, h, w) -> (B, h/2 * w/2, 4z), each token a 2x2 patch (channel-major within the patch)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h/2 * w/2, 4z) -> (B, z, h, w): the inverse of :func:`pack`."""
    b, _, c4 = tokens.shape
    x = tokens.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, h, w)


def initial_noise(generator: torch.Generator, z_dim: int, h: int, w: int) -> torch.Tensor:
    """Packed N(0, 1) latents, drawn as the pipeline draws them ((1, 1, z, h, w) on the CPU generator)."""
    noise = torch.randn((1, 1, z_dim, h, w), generator=generator, dtype=torch.float32)
    return pack(noise[:, 0])


@dataclass
class Networks:
    """The three loaded networks and the schedule (what :func:`generate` needs)."""

    text_encoder: torch.nn.Module
    """Prompt ids -> hidden states."""
    transformer: torch.nn.Module
    """The denoiser."""
    vae: torch.nn.Module
    """The decoder."""
    schedule: FlowMatchSchedule
    """scheduler_config.json."""


def velocity(transformer: torch.nn.Module, latents: torch.Tensor, sigma: torch.Tensor, text: torch.Tensor,
             h: int, w: int) -> torch.Tensor:
    """One transformer forward at noise level ``sigma`` (the pipeline feeds timestep / 1000)."""
    t = (sigma * 1000).expand(latents.shape[0]).to(latents.dtype) / 1000
    return transformer(latents, t, text, h // 2, w // 2)


@torch.inference_mode()
def generate(nets: Networks, cond_ids: list[int], neg_ids: list[int], noise: torch.Tensor, h: int, w: int,
             steps: int, scale: float) -> torch.Tensor:
    """The whole pipeline on one device, batch 1: RGB (1, 3, H, W) in [-1, 1]. CFG runs when scale > 1."""
    dev = next(nets.transformer.parameters()).device
    encode = lambda ids: prompt_embeds(nets.text_encoder(torch.tensor([ids], device=dev))[0])[None]  # noqa: E731
    cond, neg = encode(cond_ids), encode(neg_ids)
    sigmas = nets.schedule.sigmas(steps, noise.shape[1])
    x = noise.to(dev)
    for i in range(steps):
        v = velocity(nets.transformer, x, sigmas[i], cond, h, w)
        if scale > 1:
            v = true_cfg(v, velocity(nets.transformer, x, sigmas[i], neg, h, w), scale)
        x = euler_step(v, sigmas, i, x)
    return nets.vae.decode(unpack(x, h, w))
