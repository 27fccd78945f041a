"""Qwen-Image's flow-matching schedule and Euler step: diffusers' ``FlowMatchEulerDiscreteScheduler`` as the
Qwen-Image pipeline drives it, for the checkpoint's ``scheduler/scheduler_config.json``.

The pipeline asks for ``sigmas = linspace(1, 1/steps, steps)`` and, with ``use_dynamic_shifting``, a shift ``mu``
that grows linearly with the image's token count (``base_image_seq_len`` -> ``base_shift``, ``max_image_seq_len``
-> ``max_shift``); the sigmas are then time-shifted (exponential: e^mu / (e^mu + (1/s - 1)); linear: mu / (mu +
(1/s - 1))) or, without dynamic shifting, shifted by the static ``shift``; ``shift_terminal`` stretches them so the
last one equals it. A final 0 is appended; timesteps are sigmas * num_train_timesteps. The arithmetic follows
diffusers' (float32 numpy after the float64 grid) so the values are bit-equal; the parity tests check it.
Convention: x_sigma = (1 - sigma) x_0 + sigma noise, the model predicts noise - x_0, x_next = x + (sigma_next -
sigma) v.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

_UNSUPPORTED = ("invert_sigmas", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                "stochastic_sampling")


@dataclass(frozen=True)
class FlowMatchSchedule:
    """The settings of scheduler_config.json that shape the schedule (defaults: diffusers')."""

    num_train_timesteps: int = 1000
    """Timesteps are sigmas times this."""
    shift: float = 1.0
    """Static shift (used without dynamic shifting)."""
    use_dynamic_shifting: bool = False
    """Shift by ``mu`` from the image's token count."""
    base_shift: float = 0.5
    """mu at base_image_seq_len tokens."""
    max_shift: float = 1.15
    """mu at max_image_seq_len tokens."""
    base_image_seq_len: int = 256
    """Token count of base_shift."""
    max_image_seq_len: int = 4096
    """Token count of max_shift."""
    shift_terminal: float | None = None
    """When set, the last sigma is stretched to this value."""
    time_shift_type: str = "exponential"
    """"exponential" or "linear"."""

    @classmethod
    def from_config(cls, path: str | Path) -> "FlowMatchSchedule":
        """Read ``scheduler_config.json`` (the file or its directory); ValueError naming an option that is set
        but not implemented here."""
        path = Path(path).expanduser()
        if path.is_dir():
            path = path / "scheduler_config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: not a diffusers scheduler directory")
        config = json.loads(path.read_text())
        bad = {k: config[k] for k in _UNSUPPORTED if config.get(k)}
        if bad:
            raise ValueError(f"{path}: unsupported scheduler options {bad}")
        if config.get("time_shift_type", "exponential") not in ("exponential", "linear"):
            raise ValueError(f"{path}: time_shift_type must be 'exponential' or 'linear', "
                             f"got {config['time_shift_type']!r}")
        return cls(**{k: config[k] for k in cls.__dataclass_fields__ if k in config and config[k] is not None})

    @property
    def min_steps(self) -> int:
        """Fewest steps the schedule is defined for: with ``shift_terminal`` one step divides by zero (diffusers
        returns NaN sigmas there), so two."""
        return 2 if self.shift_terminal else 1

    def mu(self, image_seq_len: int) -> float:
        """The pipeline's ``calculate_shift``: linear in the token count between the two anchors."""
        m = (self.max_shift - self.base_shift) / (self.max_image_seq_len - self.base_image_seq_len)
        b = self.base_shift - m * self.base_image_seq_len
        return image_seq_len * m + b

    def sigmas(self, steps: int, image_seq_len: int) -> torch.Tensor:
        """float32 (steps + 1,): sigma per step, then 0."""
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        if steps < self.min_steps:
            raise ValueError(f"steps must be at least {self.min_steps} for this checkpoint's schedule "
                             f"(shift_terminal stretches the last sigma), got {steps}")
        s = np.array(np.linspace(1.0, 1 / steps, steps)).astype(np.float32)
        if self.use_dynamic_shifting:
            mu = self.mu(image_seq_len)
            if self.time_shift_type == "exponential":
                s = math.exp(mu) / (math.exp(mu) + (1 / s - 1) ** 1.0)
            else:
                s = mu / (mu + (1 / s - 1) ** 1.0)
        else:
            s = self.shift * s / (1 + (self.shift - 1) * s)
        if self.shift_terminal:
            one_minus = 1 - s
            s = 1 - (one_minus / (one_minus[-1] / (1 - self.shift_terminal)))
        return torch.cat([torch.from_numpy(s).to(torch.float32), torch.zeros(1)])

    def timesteps(self, steps: int, image_seq_len: int) -> torch.Tensor:
        """float32 (steps,): the timesteps the pipeline iterates (sigma * num_train_timesteps)."""
        return self.sigmas(steps, image_seq_len)[:-1] * self.num_train_timesteps


def euler_step(velocity: torch.Tensor, sigmas: torch.Tensor, i: int, sample: torch.Tensor) -> torch.Tensor:
    """Step i: sample + (sigmas[i+1] - sigmas[i]) * velocity in float32, cast to the velocity's dtype (diffusers)."""
    dt = sigmas[i + 1] - sigmas[i]
    return (sample.to(torch.float32) + dt * velocity).to(velocity.dtype)


def true_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """The pipeline's true CFG with norm rescale: combine, then give each token the conditional prediction's norm
    (over channels)."""
    comb = uncond + scale * (cond - uncond)
    cond_norm = torch.norm(cond, dim=-1, keepdim=True)
    comb_norm = torch.norm(comb, dim=-1, keepdim=True)
    return comb * (cond_norm / comb_norm)
