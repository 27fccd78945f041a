"""FlowMatchEuler against diffusers' FlowMatchEulerDiscreteScheduler (static shift).

A failure here points to models/image/scheduler.py: the schedule's arithmetic (float32 table vs float64
grid, the double shift at the low end), the Euler step's sign or dtype, or the config reader.
"""

from __future__ import annotations

import json

import pytest
import torch

from models.image.scheduler import FlowMatchEuler, cfg_combine

diffusers = pytest.importorskip("diffusers")


def _reference(steps: int, shift: float):
    sched = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    sched.set_timesteps(steps)
    return sched


@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("steps", [1, 4, 28])
def test_schedule_equals_diffusers(steps: int, shift: float) -> None:
    ref = _reference(steps, shift)
    ours = FlowMatchEuler(num_train_timesteps=1000, shift=shift)
    sigmas, timesteps = ours.sigmas(steps), ours.timesteps(steps)
    assert sigmas.dtype == timesteps.dtype == torch.float32
    assert sigmas.shape == (steps + 1,) and sigmas[-1] == 0
    assert torch.equal(sigmas, ref.sigmas)
    assert torch.equal(timesteps, ref.timesteps)


@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("steps", [1, 4, 28])
def test_euler_steps_equal_diffusers(steps: int, shift: float) -> None:
    ref = _reference(steps, shift)
    ours = FlowMatchEuler(shift=shift)
    sigmas = ours.sigmas(steps)
    g = torch.Generator().manual_seed(steps)
    x_ref = x_ours = torch.randn(2, 4, 8, 8, generator=g)
    for i, t in enumerate(ref.timesteps[:4]):
        v = torch.randn(2, 4, 8, 8, generator=g)
        x_ref = ref.step(v, t, x_ref).prev_sample
        x_ours = ours.step(v, sigmas[i].item(), sigmas[i + 1].item(), x_ours)
        assert torch.equal(x_ours, x_ref), f"step {i}"


def test_step_takes_per_sample_sigmas_and_keeps_sample_dtype() -> None:
    x = torch.randn(2, 4, 4, 4)
    v = torch.randn(2, 4, 4, 4, dtype=torch.bfloat16)
    out = FlowMatchEuler.step(v, torch.tensor([1.0, 0.5]), torch.tensor([0.75, 0.5]), x)
    assert out.dtype == torch.float32
    assert torch.equal(out[0], x[0] - 0.25 * v[0].float())
    assert torch.equal(out[1], x[1])


def test_cfg_combine() -> None:
    c, u = torch.tensor([2.0, -1.0]), torch.tensor([1.0, 1.0])
    assert torch.equal(cfg_combine(c, u, 1.0), c)
    assert torch.equal(cfg_combine(c, u, 0.0), u)
    assert torch.equal(cfg_combine(c, u, 4.0), torch.tensor([5.0, -7.0]))


def test_reads_diffusers_config(tmp_path) -> None:
    diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0).save_config(tmp_path)
    ours = FlowMatchEuler.from_config(tmp_path)
    assert (ours.num_train_timesteps, ours.shift) == (1000, 3.0)
    assert torch.equal(ours.sigmas(28), _reference(28, 3.0).sigmas)


def test_rejects_unsupported_options(tmp_path) -> None:
    (tmp_path / "scheduler_config.json").write_text(json.dumps({"shift": 3.0, "use_dynamic_shifting": True}))
    with pytest.raises(ValueError, match="use_dynamic_shifting"):
        FlowMatchEuler.from_config(tmp_path)
