"""Load a SNAC checkpoint directory (HF hub layout: config.json + pytorch_model.bin or model.safetensors)
into `SnacDecoder`, and write one in that layout.

The hub checkpoints (`hubertsiuzdak/snac_24khz`) hold the whole codec: the encoder and the quantizers' input
projections are skipped (encoding only), and every convolution is weight-normed, stored as the pair
`<conv>.parametrizations.weight.original0/1` (torch >= 2.1) or `<conv>.weight_g/_v` (older torch); the pair is
folded into one `<conv>.weight` = g * v / |v| (norm over all dims but 0) at load time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.snac.model import SnacConfig, SnacDecoder

_ENCODING_ONLY = re.compile(r"encoder\..+|quantizer\.quantizers\.\d+\.in_proj\..+")
_ROTARY_BUFFER = re.compile(r"decoder\.model\.\d+\.rel_pos\.inv_freq")  # recomputed in LocalAttention
_WEIGHT_NORM = re.compile(r"(?P<conv>.+)\.(?:parametrizations\.weight\.original(?P<new>[01])|weight_(?P<old>[gv]))")


def read_snac_config(weights_dir: str | Path) -> SnacConfig:
    """The directory's config.json as a `SnacConfig`; FileNotFoundError when the directory or file is missing."""
    path = Path(weights_dir).expanduser() / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {weights_dir} is not a SNAC checkpoint directory")
    return SnacConfig.from_json(json.loads(path.read_text()))


def _read_tensors(weights_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, else of pytorch_model.bin, on CPU in their stored dtype."""
    safetensors_path, bin_path = weights_dir / "model.safetensors", weights_dir / "pytorch_model.bin"
    if safetensors_path.is_file():
        with safe_open(str(safetensors_path), framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    if bin_path.is_file():
        return torch.load(bin_path, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{weights_dir} has neither model.safetensors nor pytorch_model.bin")


def _fold(raw: dict[str, torch.Tensor], source: Path) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> decoder tensors under our names (float32): drop encoding-only tensors and fold
    each weight-norm pair. ValueError naming a half pair or a conv stored both folded and as a pair."""
    plain: dict[str, torch.Tensor] = {}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in raw.items():
        if _ENCODING_ONLY.fullmatch(name) or _ROTARY_BUFFER.fullmatch(name):
            continue
        m = _WEIGHT_NORM.fullmatch(name)
        if m is None:
            plain[name] = tensor.float()
        else:
            part = "g" if (m["new"] or m["old"]) in ("0", "g") else "v"  # original0 is g, original1 is v
            pairs.setdefault(m["conv"], {})[part] = tensor.float()
    for conv, parts in pairs.items():
        if len(parts) != 2:
            (have,) = parts
            raise ValueError(f"{source}: {conv} has the weight-norm {have} tensor but not its partner "
                             f"(g: original0 / weight_g, v: original1 / weight_v)")
        if conv + ".weight" in plain:
            raise ValueError(f"{source}: {conv} is stored both as .weight and as a weight-norm pair")
        g, v = parts["g"], parts["v"]
        plain[conv + ".weight"] = v * (g / v.norm(dim=tuple(range(1, v.dim())), keepdim=True))
    return plain


def _check_names_and_shapes(tensors: dict[str, torch.Tensor], model: SnacDecoder, source: Path) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"{source}: checkpoint lacks {len(missing)} decoder tensors, e.g. {missing[:4]} "
                         f"(a conv's .weight may be stored as .parametrizations.weight.original0/1 or .weight_g/_v)")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ValueError(f"{source}: checkpoint has {len(unexpected)} unexpected tensors, e.g. {unexpected[:4]}")
    for name, param in expected.items():
        if tensors[name].shape != param.shape:
            raise ValueError(f"{source}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                             f"config.json implies {tuple(param.shape)}")


def load_snac(weights_dir: str | Path, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> SnacDecoder:
    """Build `SnacDecoder` on meta and assign the checkpoint's decoder tensors (folded in float32, then cast to
    `dtype` on `device`). Returns it in eval mode with grads off.

    FileNotFoundError for a missing config.json or weights file; ValueError naming a missing, unexpected or
    mis-shaped tensor, or a bad config key.
    """
    weights_dir = Path(weights_dir).expanduser()
    config = read_snac_config(weights_dir)
    with torch.device("meta"):
        model = SnacDecoder(config)
    tensors = _fold(_read_tensors(weights_dir), weights_dir)
    _check_names_and_shapes(tensors, model, weights_dir)
    state = {name: t.to(device=device, dtype=dtype) for name, t in tensors.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def save_snac(model: SnacDecoder, out_dir: str | Path) -> Path:
    """Write config.json + model.safetensors in the hub layout (the decoder half: every conv weight as the
    weight-norm pair original0 = |w| per output row, original1 = w). Returns the directory."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    convs = {name for name, m in model.named_modules() if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d))}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        conv, _, leaf = name.rpartition(".")
        if conv in convs and leaf == "weight":
            norm = tensor.norm(dim=tuple(range(1, tensor.dim())), keepdim=True)
            state[f"{conv}.parametrizations.weight.original0"] = norm.contiguous()
            state[f"{conv}.parametrizations.weight.original1"] = tensor.contiguous()
        else:
            state[name] = tensor.contiguous()
    save_file(state, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(model.config.to_json(), indent=2) + "\n")
    return out_dir
