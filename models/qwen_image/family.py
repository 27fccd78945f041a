"""Qwen-Image as a model family of graph nodes: the text encoder, the denoiser (one node, or one per guidance
branch plus the guidance step) and the VAE, with true classifier-free guidance.

Walks (one partition):

- ``encode``: ``TEXT(input_ids, neg_ids) -> text, neg_text``: the prompt and the negative prompt through the
  template, each encoded alone (batch 1) with the template's prefix dropped; both kept on the encoder's rank for
  the next walk (persist) and sent once per request to the denoiser ranks when they live elsewhere.
- ``generate``: a Loop of ``steps`` Euler steps over the latents, then ``VAE(latents) -> png`` (emitted). The loop
  body depends on the deployment (:meth:`QwenImage.configure`):
  * **CFG-parallel** when the config places ``DENOISE_COND`` and ``DENOISE_UNCOND``: ``Parallel(DENOISE_COND,
    DENOISE_UNCOND)`` then ``GUIDE``. Each step's latents go from ``GUIDE`` to both branches and the two
    predictions come back: with the branches on their own ranks these are the cut edges that move every step.
  * **sequential CFG** when the config places ``DENOISER``: one node runs both forwards, guides and steps.
  Both run the same arithmetic in the same order (batch-1 forwards, the pipeline's norm-rescaled guidance and
  Euler step), so a pinned request gives the same PNG bytes on either placement.

Latents travel unpacked, (1, z, h, w); the transformer nodes pack them (2x2 patches) for their forward and send
packed predictions (1, h/2 * w/2, 4z). Per-request plan: ``plan = [steps, guidance_scale]`` goes to every loop
node with the first iteration; a node keeps it per request (``release`` frees it). The step index is the loop
iteration. The initial noise is drawn on the conductor from the request's seed, as the pipeline draws it.
Guidance runs when guidance_scale > 1 (the pipeline's ``true_cfg_scale``); the negative prompt defaults to " ".

Request knobs: ``width``, ``height`` (multiples of 2 x the VAE's scale factor, up to ``max_size``), ``steps``,
``guidance_scale`` (0..30), ``negative_prompt``. Weights: the published diffusers layout (models/qwen_image/
weights.py); the default path is prepared on first start with tiny random weights (checkpoint.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from mstar_dist.config.engine import EngineConfig
from mstar_dist.engine.component import Component
from mstar_dist.engine.sampling import seeded
from mstar_dist.events import MediaDelta
from mstar_dist.graph.model import CompositeModel, Layout, RequestState, WalkStep
from mstar_dist.graph.nodes import EMIT_TO_CLIENT, Edge, GraphNode, Loop, Parallel, Section, Sequential
from mstar_dist.graph.walk import NodeCall, NodeResult
from models.qwen_image.checkpoint import DEFAULT_QWEN_IMAGE_DIR

TEXT, DENOISER, COND, UNCOND, GUIDE, VAE = "TEXT", "DENOISER", "DENOISE_COND", "DENOISE_UNCOND", "GUIDE", "VAE"
DENOISE_LOOP = "denoise"
MAX_STEPS = 100
DEFAULT_NEGATIVE_PROMPT = " "
"""The published example's negative prompt when the request gives none."""
MODEL_KWARGS = {"max_size": "largest width/height (default 1664)",
                "default_size": "WIDTHxHEIGHT when a request gives none (default 1328x1328)",
                "default_steps": "steps when a request gives none (default 50)",
                "dtype": "of the three networks (default float32 on CPU, bfloat16 on CUDA)"}


class _PerRequest(Component):
    """A batch-1 component that keeps a little per-request state (``self.state``), freed by ``release``."""

    def __init__(self, name: str, device: str):
        self.name, self.device, self.state = name, torch.device(device), {}
        self.calls = 0

    @torch.inference_mode()
    def run_batch(self, calls: list[NodeCall]) -> list[NodeResult | BaseException | None]:
        out: list[NodeResult | BaseException | None] = []
        for call in calls:  # batch-1 forwards: the bytes of a request do not depend on who shares its step
            try:
                self.calls += 1
                out.append(self.run_one(call))
            except Exception as exc:
                out.append(exc)
        return out

    def run_one(self, call: NodeCall) -> NodeResult:
        raise NotImplementedError

    def mine(self, call: NodeCall) -> dict[str, Any]:
        """This request's state; the plan (and prompt embeddings) arrive with the first iteration."""
        mine = self.state.setdefault(call.request_id, {})
        if "plan" in call.inputs:
            steps, scale = call.inputs.pop("plan").reshape(-1).tolist()
            mine["plan"] = (int(steps), float(scale))
        for key in ("text", "neg_text"):
            if key in call.inputs:
                mine[key] = call.inputs.pop(key).to(self.device)[None]
        return mine

    def release(self, request_id: str) -> None:
        self.state.pop(request_id, None)

    def stats(self) -> dict[str, int]:
        return {f"{self.name.lower()}_calls_total": self.calls}


class Denoise(_PerRequest):
    """``DENOISE_COND`` / ``DENOISE_UNCOND`` (one branch: latents -> packed prediction) or ``DENOISER`` (both
    branches, guidance and the Euler step: latents -> next latents)."""

    def __init__(self, name: str, device: str, model: torch.nn.Module, sigmas_of):
        super().__init__(name, device)
        self.model, self.sigmas_of = model, sigmas_of
        self.dtype = next(model.parameters()).dtype

    def run_one(self, call: NodeCall) -> NodeResult:
        from models.qwen_image.pipeline import pack, velocity

        mine = self.mine(call)
        steps, scale = mine["plan"]
        x = call.inputs["latents"].to(self.device)
        _, _, h, w = x.shape
        packed = pack(x).to(self.dtype)
        sigmas, i = self.sigmas_of(steps, packed.shape[1]), call.iteration
        forward = lambda text: velocity(self.model, packed, sigmas[i], text, h, w)  # noqa: E731
        if self.name == UNCOND:  # without guidance the branch's prediction is not read: send zeros, skip the work
            return NodeResult({"v_uncond": forward(mine["neg_text"]) if scale > 1 else torch.zeros_like(packed)})
        v_cond = forward(mine["text"])
        if self.name == COND:
            return NodeResult({"v_cond": v_cond})
        v_uncond = forward(mine["neg_text"]) if scale > 1 else None
        return NodeResult({"latents": guided_step(v_cond, v_uncond, scale, sigmas, i, x)})


def guided_step(v_cond: torch.Tensor, v_uncond: torch.Tensor | None, scale: float, sigmas: torch.Tensor, i: int,
                latents: torch.Tensor) -> torch.Tensor:
    """The pipeline's step i: norm-rescaled true CFG when scale > 1, then Euler; latents (1, z, h, w) in and out."""
    from models.qwen_image.pipeline import pack, unpack
    from models.qwen_image.scheduler import euler_step, true_cfg

    v = true_cfg(v_cond, v_uncond, scale) if scale > 1 else v_cond
    _, _, h, w = latents.shape
    return unpack(euler_step(v, sigmas, i, pack(latents.float()).to(v.dtype)), h, w)


class Guide(_PerRequest):
    """``GUIDE``: (v_cond, v_uncond, latents) -> next latents."""

    def __init__(self, name: str, device: str, sigmas_of):
        super().__init__(name, device)
        self.sigmas_of = sigmas_of

    def run_one(self, call: NodeCall) -> NodeResult:
        steps, scale = self.mine(call)["plan"]
        x = call.inputs["latents"].to(self.device)
        v_cond = call.inputs["v_cond"].to(self.device)
        sigmas = self.sigmas_of(steps, v_cond.shape[1])
        return NodeResult({"latents": guided_step(v_cond, call.inputs["v_uncond"].to(self.device), scale, sigmas,
                                                  call.iteration, x)})


class VaeNode(_PerRequest):
    """``VAE``: final latents -> the PNG file's bytes (uint8), encoded on this rank, not on the conductor."""

    def __init__(self, name: str, device: str, model: torch.nn.Module):
        super().__init__(name, device)
        self.model = model

    def run_one(self, call: NodeCall) -> NodeResult:
        from models.qwen_image.png import encode_png, to_uint8

        rgb = to_uint8(self.model.decode(call.inputs["latents"].to(self.device))[0])
        return NodeResult({"png": torch.frombuffer(bytearray(encode_png(rgb)), dtype=torch.uint8)})


class TextNode(_PerRequest):
    """``TEXT``: templated prompt ids and negative prompt ids -> their prompt embeddings (prefix dropped)."""

    def __init__(self, name: str, device: str, model: torch.nn.Module):
        super().__init__(name, device)
        self.model = model

    def run_one(self, call: NodeCall) -> NodeResult:
        from models.qwen_image.pipeline import prompt_embeds

        out = {}
        for key, name in (("input_ids", "text"), ("neg_ids", "neg_text")):
            ids = call.inputs[key].to(self.device, torch.long).reshape(1, -1)
            out[name] = prompt_embeds(self.model(ids)[0])
        return NodeResult(out)


class QwenImage(CompositeModel):
    """``model_kwargs``: MODEL_KWARGS."""

    name = "qwen-image"
    output_modality = "image"
    default_weights_dir = DEFAULT_QWEN_IMAGE_DIR

    def __init__(self, weights_dir: str | None, **model_kwargs: Any):
        unknown = set(model_kwargs) - set(MODEL_KWARGS)
        if unknown:
            raise ValueError(f"model_kwargs: unknown keys {sorted(unknown)} (allowed: {sorted(MODEL_KWARGS)})")
        super().__init__(str(Path(weights_dir or DEFAULT_QWEN_IMAGE_DIR).expanduser()), **model_kwargs)
        self.max_size = int(model_kwargs.get("max_size", 1664))
        self.default_size = _parse_size(str(model_kwargs.get("default_size", "1328x1328")), "default_size")
        self.default_steps = int(model_kwargs.get("default_steps", 50))
        self.parallel = False

    def configure(self, layout: Layout, engine: EngineConfig | None = None) -> None:
        super().configure(layout, engine)
        self.parallel = layout.placed(COND) or layout.placed(UNCOND)

    def graphs(self) -> dict[str, Section]:
        encode = GraphNode(TEXT, inputs=("input_ids", "neg_ids"),
                           outputs=(Edge("text", persist=True), Edge("neg_text", persist=True)))
        if self.parallel:
            body: Section = Sequential(
                Parallel(
                    GraphNode(COND, inputs=("latents",), optional_inputs=("text", "plan"),
                              outputs=(Edge("v_cond", GUIDE),)),
                    GraphNode(UNCOND, inputs=("latents",), optional_inputs=("neg_text", "plan"),
                              outputs=(Edge("v_uncond", GUIDE),)),
                ),
                GraphNode(GUIDE, inputs=("v_cond", "v_uncond", "latents"), optional_inputs=("plan",),
                          outputs=(Edge("latents", COND), Edge("latents", UNCOND), Edge("latents", GUIDE),
                                   Edge("latents", VAE))),
            )
        else:
            body = GraphNode(DENOISER, inputs=("latents",), optional_inputs=("text", "neg_text", "plan"),
                             outputs=(Edge("latents", DENOISER), Edge("latents", VAE)))
        generate = Sequential(Loop(body, max_iters=MAX_STEPS, name=DENOISE_LOOP),
                              GraphNode(VAE, inputs=("latents",), outputs=(Edge("png", EMIT_TO_CLIENT),)))
        return {"encode": encode, "generate": generate}

    def prepare_weights(self) -> None:
        from models.qwen_image.checkpoint import write_default_checkpoint
        from models.qwen_image.weights import check_layout

        root = Path(self.weights_dir)
        if not (root / "model_index.json").is_file() and root == Path(DEFAULT_QWEN_IMAGE_DIR).expanduser():
            write_default_checkpoint(root)
        check_layout(root)

    # ---- rank side ----
    def _dtype(self, device: str) -> torch.dtype:
        name = self.model_kwargs.get("dtype") or ("bfloat16" if device.startswith("cuda") else "float32")
        if name not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"model_kwargs.dtype must be float32, bfloat16 or float16, got {name!r}")
        return getattr(torch, str(name))

    def build_component(self, node: str, *, device: str, walks: set[str], engine: EngineConfig | None = None
                        ) -> Component:
        """Every node is a batch-1 module of its own: no engine, so ``engine`` is not read."""
        from models.qwen_image.scheduler import FlowMatchSchedule
        from models.qwen_image.weights import load_text_encoder, load_transformer, load_vae_decoder

        root, dtype = Path(self.weights_dir), self._dtype(device)
        sigmas_of = _memo(FlowMatchSchedule.from_config(root / "scheduler").sigmas)
        if node == TEXT:
            return TextNode(node, device, load_text_encoder(root / "text_encoder", device, dtype))
        if node in (DENOISER, COND, UNCOND):
            return Denoise(node, device, load_transformer(root / "transformer", device, dtype), sigmas_of)
        if node == GUIDE:
            return Guide(node, device, sigmas_of)
        if node == VAE:
            return VaeNode(node, device, load_vae_decoder(root / "vae", device, dtype))
        raise ValueError(f"{self.name}: no component named {node!r}")

    # ---- conductor side ----
    def load_frontend(self) -> None:
        from models.qwen_image.pipeline import load_tokenizer
        from models.qwen_image.scheduler import FlowMatchSchedule

        root = Path(self.weights_dir)
        self.tokenizer = load_tokenizer(root / "tokenizer")
        vae = json.loads((root / "vae" / "config.json").read_text())
        self.z_dim = int(vae.get("z_dim", 16))
        self.latent_factor = 2 ** len(vae.get("temperal_downsample", [False, True, True]))
        self.size_step = 2 * self.latent_factor  # the latents are packed in 2x2 patches
        self.min_steps = FlowMatchSchedule.from_config(root / "scheduler").min_steps
        try:  # the defaults a request without size or steps gets must be valid for this checkpoint
            self._knobs({})
        except ValueError as exc:
            raise ValueError(f"model_kwargs (default_size, default_steps, max_size): {exc}") from None

    def preprocess(self, state: RequestState, prompt: str | None, messages: list[dict] | None) -> None:
        from models.qwen_image.pipeline import prompt_ids

        knobs = self._knobs(state.knobs)
        text = prompt if prompt is not None else "\n".join(m["content"] for m in messages or [] if m["role"] == "user")
        if not text.strip():
            raise ValueError("prompt is empty: describe the image")
        ids, neg = prompt_ids(self.tokenizer, text), prompt_ids(self.tokenizer, knobs.pop("negative_prompt"))
        state.prompt_tokens = len(ids)
        h, w = knobs["height"] // self.latent_factor, knobs["width"] // self.latent_factor
        noise = torch.randn((1, 1, self.z_dim, h, w), generator=seeded(state.seed), dtype=torch.float32)[:, 0]
        state.data.update(knobs, input_ids=torch.tensor(ids, dtype=torch.long),
                          neg_ids=torch.tensor(neg, dtype=torch.long), noise=noise)

    def _knobs(self, given: dict[str, Any]) -> dict[str, Any]:
        known = {"width", "height", "steps", "guidance_scale", "negative_prompt"}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"model_kwargs: unknown knob(s) {unknown} for an image model (known: {sorted(known)})")
        width, height = self.default_size
        knobs = {"width": width, "height": height, "steps": self.default_steps, "guidance_scale": 4.0,
                 "negative_prompt": DEFAULT_NEGATIVE_PROMPT, **given}
        if knobs["negative_prompt"] is None:
            knobs["negative_prompt"] = DEFAULT_NEGATIVE_PROMPT
        if not isinstance(knobs["negative_prompt"], str):
            raise ValueError(f"negative_prompt must be a string, got {knobs['negative_prompt']!r}")
        for name, lo, hi in (("width", self.size_step, self.max_size), ("height", self.size_step, self.max_size),
                             ("steps", self.min_steps, MAX_STEPS), ("guidance_scale", 0.0, 30.0)):
            value = knobs[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not lo <= value <= hi or (name != "guidance_scale" and value != int(value)):
                kind = "a number" if name == "guidance_scale" else "an integer"
                raise ValueError(f"{name} must be {kind} in [{lo}, {hi}], got {value!r}")
        for name in ("width", "height"):
            knobs[name] = int(knobs[name])
            if knobs[name] % self.size_step:
                raise ValueError(f"{name} must be a multiple of {self.size_step} (the VAE's factor "
                                 f"{self.latent_factor} x the 2x2 packing) in [{self.size_step}, {self.max_size}], "
                                 f"got {knobs[name]}")
        knobs["steps"] = int(knobs["steps"])
        return knobs

    def start(self, state: RequestState) -> WalkStep:
        return WalkStep("encode", {"input_ids": state.data.pop("input_ids"), "neg_ids": state.data.pop("neg_ids")})

    def after_walk(self, state: RequestState, walk: str, outputs: dict[str, Any]) -> WalkStep | None:
        if walk != "encode":
            state.finish_reason = "stop"  # the picture is complete (the loop always runs its steps)
            return None
        plan = torch.tensor([state.data["steps"], state.data["guidance_scale"]], dtype=torch.float64)
        inputs = {"latents": state.data.pop("noise"), "text": outputs["text"], "neg_text": outputs["neg_text"],
                  "plan": plan}
        return WalkStep("generate", inputs, loop_limits={DENOISE_LOOP: state.data["steps"]})

    def postprocess(self, state: RequestState, signal: str, values: list[Any]) -> Any:
        return [MediaDelta("image", v.numpy().tobytes(), {"width": state.data["width"], "height": state.data["height"],
                                                          "mime_type": "image/png"}) for v in values]


def _parse_size(value: str, key: str) -> tuple[int, int]:
    w, sep, h = value.partition("x")
    if not sep or not w.isdigit() or not h.isdigit():
        raise ValueError(f"model_kwargs.{key} must be WIDTHxHEIGHT, got {value!r}")
    return int(w), int(h)


def _memo(fn):
    cache: dict = {}

    def get(steps: int, seq_len: int) -> torch.Tensor:
        if (steps, seq_len) not in cache:
            cache[(steps, seq_len)] = fn(steps, seq_len)
        return cache[(steps, seq_len)]

    return get
