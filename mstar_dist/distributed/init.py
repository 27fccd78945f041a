"""Process-group init and teardown for one torchrun rank (docs/architecture.md §2 step 3, §7 hazards).

CPU deployments use gloo alone. CUDA deployments use `cuda:nccl,cpu:gloo`: one process group per set of ranks
with an NCCL backend for CUDA tensors and a gloo backend for host tensors; torch routes each op by the tensor's
device. `device_id` binds the rank to its GPU, which makes NCCL communicators eager (created at group creation,
not on the first op) and lets subgroups be split from the world communicator.

NCCL environment, set before `init_process_group` (the NCCL backend reads it when it is created):
- defaults (`os.environ.setdefault`, so an operator's explicit value wins):
  TORCH_NCCL_ASYNC_ERROR_HANDLING=3: an op that times out or fails tears the process down (skipping the NCCL
  cleanup that can itself hang) instead of stalling forever; torchrun then reports the rank's death.
  TORCH_FR_BUFFER_SIZE (formerly TORCH_NCCL_TRACE_BUFFER_SIZE, still honoured if set) and
  TORCH_NCCL_DUMP_ON_TIMEOUT: the flight recorder keeps the last ops per rank and dumps them (to
  TORCH_FR_DUMP_TEMP_FILE<rank>, default /tmp/nccl_trace_rank_<rank>) when the watchdog fires, so a hang leaves
  a record naming the stuck op.
- forced: NVLink multicast (NVLS) stays off in NCCL, PyTorch symmetric memory and NVSHMEM. On our shared GPU
  hosts a program using multicast can take the host's GPUs out of service for a long time; a value asking for
  it is overwritten with a warning.
"""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

__all__ = [
    "MULTICAST_OFF_ENV",
    "NCCL_ENV_DEFAULTS",
    "backend_for_device",
    "init_distributed",
    "shutdown_distributed",
]

log = logging.getLogger(__name__)

NCCL_ENV_DEFAULTS: dict[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_FR_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}
"""Environment set (if absent) before `init_process_group`; see the module docstring for each reason."""

MULTICAST_OFF_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
"""Environment forced before `init_process_group`: NVLink multicast off everywhere. Never enable it."""


def backend_for_device(device: str) -> str:
    """The process-group backend string for a rank whose compute device is `device` ("cpu" or "cuda:N")."""
    kind = torch.device(device).type
    if kind == "cpu":
        return "gloo"
    if kind == "cuda":
        return "cuda:nccl,cpu:gloo"
    raise ValueError(f"unsupported device {device!r}: expected 'cpu' or 'cuda:<index>'")


def init_distributed(*, global_rank: int, world_size: int, device: str, timeout_s: float) -> None:
    """Join the torchrun world as `global_rank` of `world_size` (rendezvous via MASTER_ADDR/MASTER_PORT).

    Collective over the whole world: blocks until every rank has joined or `timeout_s` passes (then raises).
    `timeout_s` is also the default timeout of every later op on the world group and of subgroups created
    without their own. `device` is "cpu" (gloo only) or "cuda:<local index>" (NCCL + gloo, device bound).
    """
    if world_size < 1 or not 0 <= global_rank < world_size:
        raise ValueError(f"global_rank {global_rank} is not in [0, world_size={world_size})")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if dist.is_initialized():
        raise RuntimeError(
            f"torch.distributed is already initialised (rank {dist.get_rank()} of {dist.get_world_size()})"
        )
    backend = backend_for_device(device)
    _set_nccl_env()
    kwargs: dict = {}
    if backend != "gloo":
        dev = torch.device(device)
        if dev.index is None:
            raise ValueError(f"CUDA device must name its index, e.g. 'cuda:0'; got {device!r}")
        torch.cuda.set_device(dev)
        kwargs["device_id"] = dev
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=global_rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )
    log.debug("rank %d/%d joined with backend %s", global_rank, world_size, backend)


def _set_nccl_env() -> None:
    for key, value in NCCL_ENV_DEFAULTS.items():
        if key == "TORCH_FR_BUFFER_SIZE" and "TORCH_NCCL_TRACE_BUFFER_SIZE" in os.environ:
            continue  # the operator used the old name; do not override it with ours
        os.environ.setdefault(key, value)
    for key, value in MULTICAST_OFF_ENV.items():
        if os.environ.get(key, value) != value:
            log.warning("%s=%s would enable NVLink multicast; forcing %s", key, os.environ[key], value)
        os.environ[key] = value


def shutdown_distributed() -> None:
    """Destroy every process group if initialised. Never raises (it runs in `finally` blocks on the way out);
    failures are logged. Does not block on peers beyond what the backends' destructors do."""
    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown must not mask the original error
        log.warning("destroy_process_group failed", exc_info=True)
