"""Qwen3-Omni's talker: a MoE decoder that turns the thinker's states into codec frames, and its code predictor.

Each talker step predicts codebook 0 of one audio frame (``codec_head``); the code predictor, a small dense decoder,
then fills the frame's other ``num_code_groups - 1`` codebooks one after the other, starting from the talker's last
hidden state. The next talker input is the sum of the frame's codec embeddings plus one text entry (the projected
thinker embedding of the next text token, ``tts_eos`` once the text has ended, ``tts_pad`` after that); HF's
``Qwen3OmniMoeForConditionalGeneration.generate`` is the reference for every input built here.

The decoder's blocks are models/moe's (`Block`: Qwen3 attention with per-head q/k norms, the MoE block with its
sigmoid-gated shared expert, routers through models/moe/routers.py); the code predictor's are the same blocks with
every layer dense. Rotary positions are HF's interleaved multimodal RoPE (`mrope_cos_sin`): text positions (B, T)
or temporal/height/width positions (3, B, T) from the thinker's position rules (rope.py).

Parameter names: ``state_dict()`` and ``load_state_dict()`` speak the published checkpoint's names under
``talker.`` (``model.layers.N.self_attn.q_proj.weight``, ``mlp.experts.E.gate_proj.weight``, ...); inside, every
block keeps models/moe's fused layout (``wqkv``, ``w_gate_up``), translated by state-dict hooks on each block
(`_publish_names`). ``named_parameters()`` shows the fused names. The talker runs on one rank (no TP).

Configuration (`TalkerConfig.from_hf`) reads config.json's ``talker_config`` and the top-level token ids; the small
pieces a serving family needs - prompt cutting (`user_positions`, `assistant_start`), the prefill and per-step
inputs (`prefill_embeds`, `step_embeds`, `TextFeed`), and the sampling defaults (`TalkerSampling`,
`CodecLogitsProcessor`) - live in models/qwen3_omni/talker_io.py.
Shape legend: B rows, T new tokens, H talker hidden, Dt thinker hidden, V codec vocabulary, G codebooks per frame.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.common.linear import Linear
from models.llama.model import RMSNorm
from models.moe.config import MoEConfig
from models.moe.model import Block
from models.moe.routers import probe_router
from mstar_dist.distributed.tp import TPGroup

if TYPE_CHECKING:
    from mstar_dist.engine.kv_cache import AttentionCache

MROPE_SECTION = (24, 20, 20)
"""HF's default multimodal RoPE section (frequencies per temporal, height, width axis) when the config has none."""


@dataclass(frozen=True)
class OmniTokens:
    """Thinker-vocabulary token ids the talker's inputs are cut and built with (top level of config.json, and the
    thinker's placeholder ids)."""

    im_start: int
    """``<|im_start|>`` (``im_start_token_id``): opens every chat turn."""
    user: int
    """The ``user`` role token (``user_token_id``) following ``<|im_start|>``."""
    assistant: int
    """The ``assistant`` role token (``assistant_token_id``)."""
    tts_bos: int
    """``tts_bos_token_id``: its projected embedding opens the talker's text stream."""
    tts_eos: int
    """``tts_eos_token_id``: its projected embedding tells the talker the text has ended."""
    tts_pad: int
    """``tts_pad_token_id``: its projected embedding fills text positions with nothing to say."""
    multimodal: tuple[int, ...]
    """Audio, image and video placeholder ids (``thinker_config``): positions that take the thinker's hidden state
    (``hidden_projection``) rather than its embedding (``text_projection``)."""


@dataclass(frozen=True)
class CodecTokens:
    """Codec-vocabulary ids of the talker's special tokens (``talker_config``)."""

    eos: int
    """``codec_eos_token_id``: ends the speech."""
    pad: int
    """``codec_pad_id``."""
    bos: int
    """``codec_bos_id``."""
    nothink: int
    """``codec_nothink_id``."""
    think_bos: int
    """``codec_think_bos_id``."""
    think_eos: int
    """``codec_think_eos_id``."""


@dataclass(frozen=True)
class TalkerConfig:
    """What the talker and its code predictor are built from: config.json's ``talker_config`` plus the top-level ids."""

    text: MoEConfig
    """The decoder (``talker_config.text_config``): MoE blocks with a shared expert; ``vocab_size`` is the codec
    vocabulary of codebook 0 and the special tokens."""
    mrope_section: tuple[int, int, int]
    """Frequencies of each rotary axis (temporal, height, width); they add up to ``head_dim / 2``."""
    code_predictor: MoEConfig
    """The code predictor's dense decoder (``talker_config.code_predictor_config``; every layer in
    ``mlp_only_layers``); ``vocab_size`` is one residual codebook's size."""
    num_code_groups: int
    """Codebooks per frame (G): codebook 0 from the talker, G - 1 from the code predictor."""
    thinker_hidden_size: int
    """Width Dt of the thinker's embeddings and hidden states, the projections' input."""
    projection_size: int
    """Inner width of ``text_projection`` / ``hidden_projection`` (``text_config.intermediate_size``)."""
    accept_hidden_layer: int
    """Which thinker hidden state feeds the talker's multimodal positions, as an index of HF's ``hidden_states``:
    0 = the input embeddings, i = the output of decoder layer i - 1 (before any deepstack addition)."""
    codec: CodecTokens
    """The codec special tokens."""
    speakers: dict[str, int]
    """Voice name (lower case) -> speaker token id in the codec vocabulary (``speaker_id``)."""
    tokens: OmniTokens
    """Thinker-vocabulary ids (top level of config.json)."""

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> TalkerConfig:
        """Read a Qwen3-Omni config.json dict (its ``talker_config`` and top-level ids); ValueError naming the key for
        what is missing or inconsistent."""
        tc = _get(hf, "talker_config", "config.json")
        text = _moe_config(_get(tc, "text_config", "talker_config"), "talker_config.text_config", dense=False)
        cp = _moe_config(_get(tc, "code_predictor_config", "talker_config"),
                         "talker_config.code_predictor_config", dense=True)
        rope = _rope_dict(tc["text_config"])
        section = tuple(int(s) for s in rope.get("mrope_section", MROPE_SECTION))
        thinker = hf.get("thinker_config") or {}
        ids = {k: hf.get(f"{k}_token_id") for k in ("im_start", "user", "assistant", "tts_bos", "tts_eos", "tts_pad")}
        missing = [f"{k}_token_id" for k, v in ids.items() if v is None]
        if missing:
            raise ValueError(f"config.json: missing keys {missing}")
        placeholders = [thinker.get(k, tc.get(k)) for k in ("audio_token_id", "image_token_id", "video_token_id")]
        multimodal = tuple(int(t) for t in placeholders if t is not None)
        codec = CodecTokens(**{k: int(_get(tc, key, "talker_config")) for k, key in (
            ("eos", "codec_eos_token_id"), ("pad", "codec_pad_id"), ("bos", "codec_bos_id"),
            ("nothink", "codec_nothink_id"), ("think_bos", "codec_think_bos_id"),
            ("think_eos", "codec_think_eos_id"))})
        config = cls(text=text, mrope_section=section, code_predictor=cp,
                     num_code_groups=int(_get(tc, "num_code_groups", "talker_config")),
                     thinker_hidden_size=int(_get(tc, "thinker_hidden_size", "talker_config")),
                     projection_size=int(tc["text_config"]["intermediate_size"]),
                     accept_hidden_layer=int(tc.get("accept_hidden_layer", 18)), codec=codec,
                     speakers={str(k).lower(): int(v) for k, v in (tc.get("speaker_id") or {}).items()},
                     tokens=OmniTokens(**{k: int(v) for k, v in ids.items()}, multimodal=multimodal))
        config._check(tc)
        return config

    def _check(self, tc: dict[str, Any]) -> None:
        """ValueError naming the ``talker_config`` key whose value the architecture cannot run."""
        hd, V = self.text.head_dim, self.text.vocab_size
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != hd // 2:
            raise ValueError(f"talker_config.text_config: mrope_section {list(self.mrope_section)} must be 3 numbers "
                             f"adding up to head_dim / 2 = {hd // 2}")
        cp_groups = tc["code_predictor_config"].get("num_code_groups", self.num_code_groups)
        if self.num_code_groups < 2 or cp_groups != self.num_code_groups:
            raise ValueError(f"talker_config.num_code_groups ({self.num_code_groups}) must be >= 2 and equal "
                             f"code_predictor_config.num_code_groups ({cp_groups})")
        if self.code_predictor.hidden_size != self.text.hidden_size:
            raise ValueError(f"talker_config.code_predictor_config.hidden_size ({self.code_predictor.hidden_size}) "
                             f"must equal text_config.hidden_size ({self.text.hidden_size}): the code predictor reads "
                             f"the talker's hidden state and its embeddings are summed into the talker's input")
        bad = {k: v for k, v in [*vars(self.codec).items(), *self.speakers.items()] if not 0 <= v < V}
        if bad:
            raise ValueError(f"talker_config: codec ids {bad} are outside the codec vocabulary [0, {V})")
        if tc.get("tie_word_embeddings") or tc["text_config"].get("tie_word_embeddings"):
            raise ValueError("talker_config: tie_word_embeddings=true is not supported (codec_head is its own tensor)")

    def speaker_id(self, name: str) -> int:
        """The codec id of voice ``name`` (case-insensitive); ValueError listing the checkpoint's voices."""
        try:
            return self.speakers[name.lower()]
        except KeyError:
            raise ValueError(f"unknown voice {name!r}; this checkpoint's voices: {sorted(self.speakers)}") from None

    @property
    def suppress_tokens(self) -> tuple[int, ...]:
        """Codebook-0 ids the talker never samples (HF's ``generate``: the last 1024 ids of the codec vocabulary, the
        special tokens, except EOS)."""
        V = self.text.vocab_size
        return tuple(i for i in range(max(0, V - 1024), V) if i != self.codec.eos)


def _get(d: dict[str, Any], key: str, where: str) -> Any:
    if not isinstance(d, dict) or key not in d or d[key] is None:
        raise ValueError(f"{where}: missing key {key!r}")
    return d[key]


def _rope_dict(hf: dict[str, Any]) -> dict[str, Any]:
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    return rope if isinstance(rope, dict) else {}


def _moe_config(hf: dict[str, Any], where: str, *, dense: bool) -> MoEConfig:
    """models/moe's config from a talker sub-config: the multimodal RoPE keys read apart (MoEConfig takes plain RoPE);
    ``dense`` makes every layer a dense SwiGLU (the code predictor)."""
    theta = float(hf.get("rope_theta", _rope_dict(hf).get("rope_theta", 10000.0)))
    plain = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters", "rope_theta")}
    plain["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    if dense:
        n = _get(hf, "num_hidden_layers", where)
        plain.update(moe_intermediate_size=_get(hf, "intermediate_size", where), num_experts=1,
                     num_experts_per_tok=1, mlp_only_layers=list(range(n)))
    else:  # HF's talker layer is sparse with a shared expert whatever mlp_only_layers / decoder_sparse_step say
        _get(hf, "shared_expert_intermediate_size", where)
        plain.update(mlp_only_layers=[], decoder_sparse_step=1)
    try:
        return MoEConfig.from_hf(plain)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


# ---- rotary positions -------------------------------------------------------------------------------------------

def mrope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, section: tuple[int, int, int],
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin (B, T, 1, hd) for models/llama's ``apply_rope``, from positions (B, T) or (3, B, T).

    HF's interleaved multimodal RoPE: frequency i rotates by the height position when i % 3 == 1 and
    i < 3 * section[1], by the width position when i % 3 == 2 and i < 3 * section[2], else by the temporal one.
    Text positions (B, T) stand for three equal rows, which is plain RoPE."""
    if positions.dim() == 2:
        positions = positions.unsqueeze(0).expand(3, -1, -1)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=positions.device) / head_dim))
    freqs = positions[..., None].float() * inv_freq  # (3, B, T, hd/2)
    f = freqs[0].clone()
    for axis in (1, 2):
        pick = slice(axis, 3 * section[axis], 3)
        f[..., pick] = freqs[axis, ..., pick]
    cos = torch.cat((f.cos(), f.cos()), dim=-1)
    sin = torch.cat((-f.sin(), f.sin()), dim=-1)
    return cos.to(dtype).unsqueeze(2), sin.to(dtype).unsqueeze(2)


# ---- published parameter names ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Rename:
    """One of our tensors and the published tensors it is made of."""

    ours: str
    theirs: tuple[str, ...]
    split: Callable[[torch.Tensor], list[torch.Tensor]]
    join: Callable[[list[torch.Tensor]], torch.Tensor]


def _same(ours: str, theirs: str) -> _Rename:
    return _Rename(ours, (theirs,), lambda t: [t], lambda parts: parts[0])


def _rows(ours: str, theirs: tuple[str, ...], sizes: tuple[int, ...]) -> _Rename:
    return _Rename(ours, theirs, lambda t: list(t.split(sizes)), torch.cat)


def _swiglu(ours: str, theirs: str, inter: int) -> list[_Rename]:
    return [_rows(ours + "w_gate_up.weight", (theirs + "gate_proj.weight", theirs + "up_proj.weight"), (inter, inter)),
            _same(ours + "w_down.weight", theirs + "down_proj.weight")]


def _block_renames(config: MoEConfig, layer: int) -> list[_Rename]:
    """Our names inside one models/moe ``Block`` -> the published names inside ``model.layers.{layer}``."""
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    out = [_same("attn_norm.weight", "input_layernorm.weight"),
           _same("mlp_norm.weight", "post_attention_layernorm.weight"),
           _rows("attn.wqkv.weight", tuple(f"self_attn.{x}_proj.weight" for x in "qkv"), (q, kv, kv)),
           _same("attn.q_norm.weight", "self_attn.q_norm.weight"),
           _same("attn.k_norm.weight", "self_attn.k_norm.weight"),
           _same("attn.wo.weight", "self_attn.o_proj.weight")]
    if not config.is_sparse(layer):
        return out + _swiglu("mlp.", "mlp.", config.intermediate_size)
    E, inter = config.num_experts, config.moe_intermediate_size
    out.append(_same("mlp.router.weight", "mlp.gate.weight"))
    out.append(_Rename("mlp.experts.w_gate_up",
                       tuple(f"mlp.experts.{e}.{x}_proj.weight" for e in range(E) for x in ("gate", "up")),
                       lambda t: [p for e in range(E) for p in t[e].split(inter)],
                       lambda parts: torch.stack([torch.cat(parts[2 * e:2 * e + 2]) for e in range(E)])))
    out.append(_Rename("mlp.experts.w_down", tuple(f"mlp.experts.{e}.down_proj.weight" for e in range(E)),
                       lambda t: list(t.unbind(0)), torch.stack))
    if config.shared_expert_intermediate_size:
        out += _swiglu("mlp.shared_expert.", "mlp.shared_expert.", config.shared_expert_intermediate_size)
        out.append(_same("mlp.shared_expert_gate.weight", "mlp.shared_expert_gate.weight"))
    return out


def _publish_names(block: nn.Module, renames: list[_Rename]) -> None:
    """Make ``block``'s state dict speak the published names: ``state_dict()`` splits our fused tensors into them
    (independent copies, so a checkpoint writer sees no shared storage), ``load_state_dict()`` fuses them back. A
    state dict that already holds our names loads unchanged."""

    def to_published(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
        for r in renames:
            tensor = state.pop(prefix + r.ours, None)
            if tensor is None:
                continue
            parts = r.split(tensor)
            for name, part in zip(r.theirs, parts):
                state[prefix + name] = part if len(parts) == 1 or part.is_meta else part.clone()

    def from_published(module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
        for r in renames:
            names = [prefix + n for n in r.theirs]
            if all(n in state for n in names):
                state[prefix + r.ours] = r.join([state.pop(n) for n in names])

    block.register_state_dict_post_hook(to_published)
    block.register_load_state_dict_pre_hook(from_published)


def _blocks(config: MoEConfig, router: str | dict | None) -> nn.ModuleList:
    layers = nn.ModuleList(Block(config, i, TPGroup.single(), router) for i in range(config.n_layers))
    for i, layer in enumerate(layers):
        _publish_names(layer, _block_renames(config, i))
    return layers


# ---- the talker ---------------------------------------------------------------------------------------------------

class ResizeMLP(nn.Module):
    """``text_projection`` / ``hidden_projection``: thinker width Dt -> talker width H (fc1, SiLU, fc2, with biases)."""

    def __init__(self, d_in: int, inner: int, d_out: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(d_in, inner)
        self.linear_fc2 = nn.Linear(inner, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerModel(nn.Module):
    """``talker.model``: the MoE blocks, the final norm and the codebook-0 embedding (``codec_embedding``)."""

    def __init__(self, config: TalkerConfig, router: str | dict | None) -> None:
        super().__init__()
        t = config.text
        self.layers = _blocks(t, router)
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        self.codec_embedding = nn.Embedding(t.vocab_size, t.hidden_size)


class Talker(nn.Module):
    """``talker.``: the decoder, ``codec_head``, the two projections and the code predictor. Build on ``meta`` and
    load with ``load_state_dict(published_state, assign=True)``.

    ``router``: the router spec of every MoE block (models/moe/routers.py). For a KV-cache engine: ``forward`` takes
    input embeddings (the engine's ids are the talker's inputs here, built by talker_io), positions and a bound
    ``AttentionCache``; each layer calls ``cache.attend(layer, q, k, v)`` with ``local_kv_heads`` KV heads."""

    pads_are_inert = False
    """A stateful router may count padded tokens: only prompts of one length share a prefill forward."""

    def __init__(self, config: TalkerConfig, router: str | dict | None = None) -> None:
        super().__init__()
        self.config = config
        t = config.text
        self.local_heads, self.local_kv_heads = t.n_heads, t.n_kv_heads
        self.model = TalkerModel(config, router)
        self.codec_head = Linear(t.hidden_size, t.vocab_size)
        self.text_projection = ResizeMLP(config.thinker_hidden_size, config.projection_size, t.hidden_size)
        self.hidden_projection = ResizeMLP(config.thinker_hidden_size, config.projection_size, t.hidden_size)
        self.code_predictor = CodePredictor(config)

    def check_routers(self) -> None:
        """Probe every MoE block's router on a real input (models/moe/routers.py's contract); call once the weights
        are loaded. ValueError naming the layer."""
        t = self.config.text
        weight = self.model.codec_embedding.weight
        for i, layer in enumerate(self.model.layers):
            if layer.sparse:
                probe_router(layer.mlp.router, layer_idx=i, hidden=t.hidden_size, k=t.num_experts_per_tok,
                             num_experts=t.num_experts, device=weight.device, dtype=weight.dtype)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, cache: AttentionCache,
                last_only: bool = False, last_index: torch.Tensor | None = None, *, return_hidden: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """inputs_embeds (B, T, H), positions (B, T) or (3, B, T) -> fp32 codebook-0 logits (B, T, V); (B, 1, V)
        for the last token (``last_only``) or token ``last_index[b]`` of row b. With ``return_hidden`` also the
        final normed hidden states of the same tokens (what the code predictor starts from)."""
        t = self.config.text
        cos, sin = mrope_cos_sin(positions, t.head_dim, t.rope_theta, self.config.mrope_section, inputs_embeds.dtype)
        h, router_states = inputs_embeds, None
        for layer in self.model.layers:
            h, router_states = layer(h, cos, sin, cache, router_states)
        if last_index is not None:
            h = h.gather(1, last_index.view(-1, 1, 1).expand(-1, 1, h.shape[-1]))  # (B, 1, H)
        elif last_only:
            h = h[:, -1:]
        h = self.model.norm(h)
        logits = self.codec_head(h).float()
        return (logits, h) if return_hidden else logits


# ---- the code predictor -------------------------------------------------------------------------------------------

class FrameCache:
    """The code predictor's attention cache for one frame: every row at the same length, keys appended per call (a
    frame is at most G + 1 tokens, so no slots and no preallocation)."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, nh, T, hd), k/v (B, nkv, T, hd) -> (B, nh, T, hd); causal within a first multi-token call."""
        if layer in self.keys:
            if q.shape[2] != 1:
                raise ValueError(f"FrameCache: only a frame's first call may hold several tokens, got {q.shape[2]}")
            k, v = torch.cat((self.keys[layer], k), dim=2), torch.cat((self.values[layer], v), dim=2)
        self.keys[layer], self.values[layer] = k, v
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=True)


class CodePredictorModel(nn.Module):
    """``talker.code_predictor.model``: dense blocks, final norm, one embedding per residual codebook 1..G-1."""

    def __init__(self, config: TalkerConfig) -> None:
        super().__init__()
        c = config.code_predictor
        self.layers = _blocks(c, None)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.codec_embedding = nn.ModuleList(nn.Embedding(c.vocab_size, c.hidden_size)
                                             for _ in range(config.num_code_groups - 1))


class CodePredictor(nn.Module):
    """``talker.code_predictor``: fills a frame's residual codebooks 1..G-1 from the talker's last hidden state and
    the frame's codebook-0 embedding. Head ``lm_head[j - 1]`` predicts codebook j; the embedding of codebook j is
    ``model.codec_embedding[j - 1]``."""

    def __init__(self, config: TalkerConfig) -> None:
        super().__init__()
        self.config = config
        c = config.code_predictor
        self.model = CodePredictorModel(config)
        self.lm_head = nn.ModuleList(Linear(c.hidden_size, c.vocab_size) for _ in range(config.num_code_groups - 1))

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, cache: AttentionCache, group: int
                ) -> torch.Tensor:
        """inputs_embeds (B, T, H), positions (B, T) -> fp32 logits (B, V) of residual codebook ``group`` (1..G-1)
        at the last position."""
        c = self.config.code_predictor
        cos, sin = mrope_cos_sin(positions, c.head_dim, c.rope_theta, (c.head_dim // 2, 0, 0), inputs_embeds.dtype)
        h = inputs_embeds
        for layer in self.model.layers:
            h, _ = layer(h, cos, sin, cache, None)
        return self.lm_head[group - 1](self.model.norm(h[:, -1])).float()

    def residual_codes(self, talker_hidden: torch.Tensor, code0_embed: torch.Tensor,
                       pick: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        """talker_hidden, code0_embed (B, H) -> codes (B, G - 1) of codebooks 1..G-1, as HF's code predictor
        ``generate``: a 2-token prefill [hidden, codebook-0 embedding] predicts codebook 1, then each code's embedding
        predicts the next. ``pick(logits (B, V), group) -> (B,)`` chooses each code (greedy, or sampled with
        ``TalkerSampling.residual``)."""
        B, G = talker_hidden.shape[0], self.config.num_code_groups
        device = talker_hidden.device
        cache = FrameCache()
        x = torch.stack((talker_hidden, code0_embed), dim=1)  # (B, 2, H)
        positions = torch.arange(2, device=device).expand(B, 2)
        codes = []
        for group in range(1, G):
            code = pick(self(x, positions, cache, group), group)  # (B,)
            codes.append(code)
            if group + 1 < G:
                x = self.model.codec_embedding[group - 1](code)[:, None]  # (B, 1, H)
                positions = torch.full((B, 1), group + 1, device=device)
        return torch.stack(codes, dim=1)
