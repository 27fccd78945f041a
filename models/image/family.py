"""Text-to-image with classifier-free guidance, BAGEL shape: an LLM prefill conditions a flow-matching denoiser,
a VAE-style decoder makes the picture.

Walks (one partition):

- ``encode``: ``TEXT(input_ids) -> text`` — the LLM's last hidden states over the prompt, kept on its rank for
  the next walk (persist).
- ``generate``: a Loop of ``steps`` Euler steps over the latents, then ``VAE(latents) -> png`` (emitted). The loop
  body depends on the deployment (:meth:`configure`):
  * **CFG-parallel** when the config places ``DENOISE_COND`` and ``DENOISE_UNCOND``: ``Parallel(DENOISE_COND,
    DENOISE_UNCOND)`` then ``GUIDE``. Each step's latents go from ``GUIDE`` to both branches and the two
    velocities come back: with the branches on their own ranks these are the cut edges that move every step
    (device to device on GPUs), and both branch forwards run at once.
  * **sequential CFG** when the config places ``DENOISER``: one node runs the conditional and the unconditional
    forward, combines them and steps.
  Both run exactly the same arithmetic in the same order (batch-1 forwards, fp32 guidance and step), so a pinned
  request gives the same PNG bytes on either placement.

Per-request plan: ``plan = [steps, guidance_scale]`` goes to every node that needs it with the first iteration
(like the KV cache of a decode); a node keeps what it needs per request (``release`` frees it). The step index is
the loop iteration. The initial noise is drawn on the conductor from the request's seed.

Request knobs: ``width``, ``height`` (multiples of the latent factor x patch, 16..``max_size``), ``steps``
(1..100), ``guidance_scale`` (0..30). Weights: a diffusers-like directory (``transformer/``, ``vae/``,
``scheduler/``) plus ``text_encoder/`` (a Llama HF directory with its tokenizer); the default path is prepared on
first start with tiny random weights (``models/image/checkpoint.py``).
"""

from __future__ import annotations

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

TEXT, DENOISER, COND, UNCOND, GUIDE, VAE = "TEXT", "DENOISER", "DENOISE_COND", "DENOISE_UNCOND", "GUIDE", "VAE"
DENOISE_LOOP = "denoise"
MAX_STEPS = 100
DEFAULT_IMAGE_DIR = "~/.cache/mstar_dist/bagel-tiny"
KNOBS = {"width": (16, None), "height": (16, None), "steps": (1, MAX_STEPS), "guidance_scale": (0.0, 30.0)}


class _PerRequest(Component):
    """A component that keeps a little per-request state (``self.state``), freed by ``release``."""

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

    def plan(self, call: NodeCall) -> tuple[int, float]:
        if "plan" in call.inputs:
            steps, scale = call.inputs.pop("plan").reshape(-1).tolist()
            self.state.setdefault(call.request_id, {})["plan"] = (int(steps), float(scale))
        return self.state[call.request_id]["plan"]

    def release(self, request_id: str) -> None:
        self.state.pop(request_id, None)

    def stats(self) -> dict[str, int]:
        return {f"{self.name.lower()}_calls_total": self.calls}


class Denoise(_PerRequest):
    """``DENOISE_COND`` / ``DENOISE_UNCOND`` (one branch: latents -> velocity) or ``DENOISER`` (both branches,
    guidance and the Euler step: latents -> next latents)."""

    def __init__(self, name: str, device: str, model: torch.nn.Module, sigmas_of):
        super().__init__(name, device)
        self.model, self.sigmas_of = model, sigmas_of

    def run_one(self, call: NodeCall) -> NodeResult:
        steps, scale = self.plan(call)
        mine = self.state[call.request_id]
        if "text" in call.inputs:
            text = call.inputs.pop("text").to(self.device)
            mine["ctx"] = self.model.prepare_text(text[None], None, batch=1)
        sigmas = self.sigmas_of(steps)
        i = call.iteration
        x = call.inputs["latents"].to(self.device)
        t = float(sigmas[i]) * 1000.0
        if self.name == UNCOND:
            return NodeResult({"v_uncond": self._velocity(x, t, None)})
        v_cond = self._velocity(x, t, mine["ctx"])
        if self.name == COND:
            return NodeResult({"v_cond": v_cond})
        v = guide(v_cond, self._velocity(x, t, None), scale)
        return NodeResult({"latents": euler(v, sigmas[i], sigmas[i + 1], x)})

    def _velocity(self, x: torch.Tensor, t: float, ctx) -> torch.Tensor:
        if ctx is None:
            ctx = self.model.prepare_text(None, None, batch=1)
        return self.model.denoise(x, t, *ctx).float()


class Guide(_PerRequest):
    """``GUIDE``: (v_cond, v_uncond, latents) -> next latents, fp32."""

    def __init__(self, name: str, device: str, sigmas_of):
        super().__init__(name, device)
        self.sigmas_of = sigmas_of

    def run_one(self, call: NodeCall) -> NodeResult:
        steps, scale = self.plan(call)
        sigmas, i = self.sigmas_of(steps), call.iteration
        v = guide(call.inputs["v_cond"].to(self.device), call.inputs["v_uncond"].to(self.device), scale)
        return NodeResult({"latents": euler(v, sigmas[i], sigmas[i + 1], call.inputs["latents"].to(self.device))})


def guide(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    from models.image.scheduler import cfg_combine

    return cfg_combine(v_cond.float(), v_uncond.float(), scale)


def euler(v: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    from models.image.scheduler import FlowMatchEuler

    return FlowMatchEuler.step(v, float(sigma), float(sigma_next), x.float())


class VaeNode(_PerRequest):
    """``VAE``: final latents -> the PNG file's bytes (uint8), encoded on this rank, not on the conductor."""

    def __init__(self, name: str, device: str, model: torch.nn.Module):
        super().__init__(name, device)
        self.model = model

    def run_one(self, call: NodeCall) -> NodeResult:
        from models.image.png import encode_png, to_uint8

        x = call.inputs["latents"].to(self.device, next(self.model.parameters()).dtype)
        rgb = to_uint8(self.model.decode(x)[0])
        return NodeResult({"png": torch.frombuffer(bytearray(encode_png(rgb)), dtype=torch.uint8)})


class TextEncoder(_PerRequest):
    """``TEXT``: prompt ids -> the LLM's final hidden states (T, d), fp32 (an LLM prefill without sampling)."""

    def __init__(self, name: str, device: str, weights_dir: str):
        from mstar_dist.engine.kv_cache import StaticKVCache
        from models.llama.weights import load_llama

        super().__init__(name, device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model, cfg = load_llama(weights_dir, device=device, dtype=dtype)
        self.cache = StaticKVCache(n_layers=cfg.n_layers, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                                   max_slots=1, max_seq_len=cfg.max_position_embeddings, dtype=dtype, device=device)

    def run_one(self, call: NodeCall) -> NodeResult:
        ids = call.inputs["input_ids"].to(self.device, torch.long).reshape(1, -1)
        n = ids.shape[1]
        slot = self.cache.alloc()
        try:
            self.cache.bind([slot], [0], n)
            h = self.model.hidden_states(ids, torch.arange(n, device=self.device)[None], self.cache)
        finally:
            self.cache.free(slot)
        return NodeResult({"text": h[0].float()})


class BagelImage(CompositeModel):
    """``model_kwargs``: ``max_size`` (largest width/height, default 1024), ``dtype`` of the denoiser and VAE
    (default float32 on CPU, bfloat16 on CUDA)."""

    name = "bagel"
    output_modality = "image"

    def __init__(self, weights_dir: str | None, **model_kwargs: Any):
        unknown = set(model_kwargs) - {"max_size", "dtype"}
        if unknown:
            raise ValueError(f"model_kwargs: unknown keys {sorted(unknown)} (allowed: max_size, dtype)")
        super().__init__(str(Path(weights_dir or DEFAULT_IMAGE_DIR).expanduser()), **model_kwargs)
        self.max_size = int(model_kwargs.get("max_size", 1024))
        self.parallel = False

    def configure(self, layout: Layout, engine: EngineConfig | None = None) -> None:
        super().configure(layout, engine)
        self.parallel = layout.placed(COND) or layout.placed(UNCOND)

    def graphs(self) -> dict[str, Section]:
        encode = GraphNode(TEXT, inputs=("input_ids",), outputs=(Edge("text", persist=True),))
        if self.parallel:
            body: Section = Sequential(
                Parallel(
                    GraphNode(COND, inputs=("latents",), optional_inputs=("text", "plan"),
                              outputs=(Edge("v_cond", GUIDE),)),
                    GraphNode(UNCOND, inputs=("latents",), optional_inputs=("plan",),
                              outputs=(Edge("v_uncond", GUIDE),)),
                ),
                GraphNode(GUIDE, inputs=("v_cond", "v_uncond", "latents"), optional_inputs=("plan",),
                          outputs=(Edge("latents", COND), Edge("latents", UNCOND), Edge("latents", GUIDE),
                                   Edge("latents", VAE))),
            )
        else:
            body = GraphNode(DENOISER, inputs=("latents",), optional_inputs=("text", "plan"),
                             outputs=(Edge("latents", DENOISER), Edge("latents", VAE)))
        generate = Sequential(Loop(body, max_iters=MAX_STEPS, name=DENOISE_LOOP),
                              GraphNode(VAE, inputs=("latents",), outputs=(Edge("png", EMIT_TO_CLIENT),)))
        return {"encode": encode, "generate": generate}

    def prepare_weights(self) -> None:
        if (Path(self.weights_dir) / "transformer").is_dir():
            return
        if Path(self.weights_dir) != Path(DEFAULT_IMAGE_DIR).expanduser():
            raise FileNotFoundError(f"weights: {self.weights_dir} is not an image checkpoint directory (only the "
                                    f"default {DEFAULT_IMAGE_DIR} is prepared automatically)")
        from models.image.checkpoint import write_tiny_image_family

        write_tiny_image_family(Path(self.weights_dir))

    # ---- rank side ----
    def _dtype(self, device: str) -> torch.dtype:
        name = self.model_kwargs.get("dtype") or ("bfloat16" if device.startswith("cuda") else "float32")
        return getattr(torch, str(name))

    def build_component(self, node: str, *, device: str, walks: set[str], engine: EngineConfig | None = None
                        ) -> Component:
        """Every node is a batch-1 module of its own: no engine, so ``engine`` is not read."""
        from models.image.scheduler import FlowMatchEuler
        from models.image.weights import load_denoiser, load_vae_decoder

        root = Path(self.weights_dir)
        scheduler = FlowMatchEuler.from_config(root / "scheduler")
        sigmas_of = _memo(scheduler.sigmas)
        if node == TEXT:
            return TextEncoder(node, device, str(root / "text_encoder"))
        if node in (DENOISER, COND, UNCOND):
            return Denoise(node, device, load_denoiser(root / "transformer", device, self._dtype(device)), sigmas_of)
        if node == GUIDE:
            return Guide(node, device, sigmas_of)
        if node == VAE:
            return VaeNode(node, device, load_vae_decoder(root / "vae", device, self._dtype(device)))
        raise ValueError(f"{self.name}: no component named {node!r}")

    # ---- conductor side ----
    def load_frontend(self) -> None:
        import json

        from models.llama.tokenizer import ChatTokenizer

        root = Path(self.weights_dir)
        self.tokenizer = ChatTokenizer(root / "text_encoder")
        vae = json.loads((root / "vae" / "config.json").read_text())
        den = json.loads((root / "transformer" / "config.json").read_text())
        self.latent_channels = int(vae["latent_channels"])
        self.latent_factor = 2 ** (len(vae["block_out_channels"]) - 1)
        self.size_step = self.latent_factor * int(den["patch_size"])

    def preprocess(self, state: RequestState, prompt: str | None, messages: list[dict] | None) -> None:
        knobs = self._knobs(state.knobs)
        text = prompt if prompt is not None else "\n".join(m["content"] for m in messages or [] if m["role"] == "user")
        ids = self.tokenizer.encode(text)
        if not ids:
            raise ValueError("prompt is empty after tokenization: describe the image")
        state.prompt_tokens = len(ids)
        h, w = knobs["height"] // self.latent_factor, knobs["width"] // self.latent_factor
        gen = seeded(state.seed)
        state.data.update(knobs, input_ids=torch.tensor(ids, dtype=torch.long),
                          noise=torch.randn((1, self.latent_channels, h, w), generator=gen))

    def _knobs(self, given: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(given) - set(KNOBS))
        if unknown:
            raise ValueError(f"model_kwargs: unknown knob(s) {unknown} for an image model (known: {sorted(KNOBS)})")
        knobs = {"width": 64, "height": 64, "steps": 8, "guidance_scale": 4.0, **given}
        for name, (lo, hi) in KNOBS.items():
            value, hi = knobs[name], hi if hi is not None else self.max_size
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not lo <= value <= hi or (name != "guidance_scale" and value != int(value)):
                kind = "a number" if name == "guidance_scale" else "an integer"
                raise ValueError(f"{name} must be {kind} in [{lo}, {hi}], got {value!r}")
        for name in ("width", "height"):
            knobs[name] = int(knobs[name])
            if knobs[name] % self.size_step:
                raise ValueError(f"{name} must be a multiple of {self.size_step} (latent factor x patch size), "
                                 f"got {knobs[name]}")
        knobs["steps"] = int(knobs["steps"])
        return knobs

    def start(self, state: RequestState) -> WalkStep:
        return WalkStep("encode", {"input_ids": state.data.pop("input_ids")})

    def after_walk(self, state: RequestState, walk: str, outputs: dict[str, Any]) -> WalkStep | None:
        if walk != "encode":
            state.finish_reason = "stop"  # the picture is complete (the loop always runs its steps)
            return None
        plan = torch.tensor([state.data["steps"], state.data["guidance_scale"]], dtype=torch.float64)
        inputs = {"latents": state.data.pop("noise"), "text": outputs["text"], "plan": plan}
        return WalkStep("generate", inputs, loop_limits={DENOISE_LOOP: state.data["steps"]})

    def postprocess(self, state: RequestState, signal: str, values: list[Any]) -> Any:
        return [MediaDelta("image", v.numpy().tobytes(), {"width": state.data["width"], "height": state.data["height"],
                                                          "mime_type": "image/png"}) for v in values]


def _memo(fn):
    cache: dict = {}

    def get(steps: int) -> torch.Tensor:
        if steps not in cache:
            cache[steps] = fn(steps)
        return cache[steps]

    return get
