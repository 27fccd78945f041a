"""Flow-matching Euler sampling: the noise schedule, one Euler step, and classifier-free guidance.

Equal to diffusers' `FlowMatchEulerDiscreteScheduler` with static `shift` (SD3's setting) and its other
options at their defaults. Convention (rectified flow): x_sigma = (1 - sigma) * x_0 + sigma * noise, the
model predicts the velocity v = noise - x_0, and sampling walks sigma from 1 down to 0:
x_next = x + (sigma_next - sigma) * v.

The schedule reproduces diffusers' arithmetic step for step (float32 training table, float64 inference
grid, float32 result), so the values are bit-equal to `scheduler.sigmas` / `scheduler.timesteps`. Note
that diffusers shifts the low end twice (the training table's sigma_min is already shifted before the
inference grid is shifted again); we copy that, since equality is the point.
"""

from __future__ import annotations

import json
from pathlib import Path
import numpy as np
import torch

# Options of diffusers' scheduler that change the schedule. All are off when falsy (diffusers tests them
# with `if`), and we accept them only off.
_OFF_OPTIONS = ("use_dynamic_shifting", "invert_sigmas", "shift_terminal", "use_karras_sigmas",
                "use_exponential_sigmas", "use_beta_sigmas", "stochastic_sampling")


class FlowMatchEuler:
    """The sigma/timestep schedule of a flow-matching model; stateless apart from its two numbers."""

    def __init__(self, num_train_timesteps: int = 1000, shift: float = 1.0) -> None:
        if not isinstance(num_train_timesteps, int) or num_train_timesteps < 2:
            raise ValueError(f"num_train_timesteps must be an int >= 2, got {num_train_timesteps!r}")
        if not shift > 0:
            raise ValueError(f"shift must be > 0, got {shift!r}")
        self.num_train_timesteps = num_train_timesteps
        self.shift = float(shift)
        # The training table's ends, computed in float32 exactly as diffusers' __init__ does.
        ends = torch.tensor([num_train_timesteps, 1], dtype=torch.float32) / num_train_timesteps
        ends = self.shift * ends / (1 + (self.shift - 1) * ends)
        self._sigma_max, self._sigma_min = ends[0].item(), ends[1].item()

    @classmethod
    def from_config(cls, path: str | Path) -> "FlowMatchEuler":
        """Read a diffusers `scheduler_config.json` (file, or the directory holding it).

        ValueError for a config that asks for behaviour we do not implement (dynamic shifting, Karras
        sigmas, ...), naming the options.
        """
        path = Path(path).expanduser()
        if path.is_dir():
            path = path / "scheduler_config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: not a diffusers scheduler directory")
        config = json.loads(path.read_text())
        unsupported = {k: config[k] for k in _OFF_OPTIONS if config.get(k)}
        if unsupported:
            raise ValueError(f"{path}: FlowMatchEuler implements static shift only; unsupported "
                             f"options {unsupported}")
        return cls(num_train_timesteps=int(config.get("num_train_timesteps", 1000)),
                   shift=float(config.get("shift", 1.0)))

    def sigmas(self, steps: int) -> torch.Tensor:
        """float32 (steps + 1,): the noise levels from ~1 down, then a final 0 (sample at step i has sigmas[i])."""
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        n = self.num_train_timesteps
        grid = np.linspace(self._sigma_max * n, self._sigma_min * n, steps) / n  # float64, as diffusers
        shifted = self.shift * grid / (1 + (self.shift - 1) * grid)
        sigmas = torch.from_numpy(shifted).to(torch.float32)
        return torch.cat([sigmas, torch.zeros(1)])

    def timesteps(self, steps: int) -> torch.Tensor:
        """float32 (steps,): the model's time input per step, sigma * num_train_timesteps (in [0, 1000])."""
        return self.sigmas(steps)[:-1] * self.num_train_timesteps

    @staticmethod
    def step(velocity: torch.Tensor, sigma: float | torch.Tensor, sigma_next: float | torch.Tensor,
             sample: torch.Tensor) -> torch.Tensor:
        """One Euler step: sample + (sigma_next - sigma) * velocity, computed in float32.

        sigma/sigma_next: Python floats, 0-d tensors, or (B,) tensors (one per sample). The result has
        the sample's dtype (diffusers returns the velocity's; keeping fp32 latents fp32 under a bf16
        model loses nothing and equals diffusers when both are fp32).
        """
        dt = _as_sigma(sigma_next, sample) - _as_sigma(sigma, sample)
        return (sample.float() + dt * velocity.float()).to(sample.dtype)


def _as_sigma(sigma: float | torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """float32 sigma on the sample's device, shaped to broadcast over (B, ...)."""
    s = torch.as_tensor(sigma, dtype=torch.float32, device=sample.device)
    if s.ndim == 1:
        s = s.view(-1, *([1] * (sample.ndim - 1)))
    return s


def cfg_combine(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance: v_uncond + scale * (v_cond - v_uncond) (diffusers' pipelines' formula).

    scale 1 returns v_cond (up to rounding); scale 0 returns v_uncond.
    """
    return v_uncond + scale * (v_cond - v_uncond)
