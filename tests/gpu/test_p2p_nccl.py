"""P2P transport on two GPUs over NCCL (plus the pair groups' gloo half for host tensors). Skipped without two
CUDA devices. A failure means CUDA edges are unordered with respect to the producing kernels (garbage data),
a sent tensor's memory is reused mid-transfer, a received tensor is read before it lands, host staging crept
in, or a timed-out NCCL pair takes the rank or other pairs down."""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.dist.launcher import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def _setup(rank: int):
    from mstar_dist.distributed.groups import create_pair_groups, warm_pairs
    from mstar_dist.distributed.init import backend_for_device, init_distributed
    from mstar_dist.transport.p2p import P2PTransport

    device = f"cuda:{rank}"
    init_distributed(global_rank=rank, world_size=int(os.environ["WORLD_SIZE"]), device=device, timeout_s=60)
    groups = create_pair_groups([(0, 1), (1, 0)], global_rank=rank, backend=backend_for_device(device),
                                timeout_s=60)
    warm_s = warm_pairs(groups, rank, device)
    return P2PTransport(rank, groups, device), torch.device(device), warm_s


def _cases(device) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(1)
    base = torch.randn(64, 33, generator=g)
    cpu = [base, base.to(torch.bfloat16), base > 0, (base * 100).to(torch.int64),
           torch.arange(9, dtype=torch.int64).to(torch.uint16), torch.tensor(1.5), torch.empty(0, 3), base.t()]
    return [t.to(device) for t in cpu]


def _dtypes_and_order_rank(rank: int) -> dict:
    from mstar_dist.distributed.init import shutdown_distributed

    transport, dev, warm_s = _setup(rank)
    cases = _cases(dev)
    n = 1 << 24  # 64 MiB of float32
    if rank == 0:
        sends = [transport.send(t, dst=1) for t in cases]
        # Ordering: the value is written by a kernel queued behind a ~50 ms sleep on the compute stream. A send
        # not ordered after it would ship stale memory.
        big = torch.zeros(n, device=dev)
        torch.cuda._sleep(50_000_000)
        big.fill_(7.0)
        sends.append(transport.send(big, dst=1))
        # Lifetime: drop our reference and churn the allocator; the transport must keep the block alive.
        del big
        for _ in range(4):
            torch.full((n,), -1.0, device=dev)
        sends.append(transport.send(torch.ones(3, device="cpu"), dst=1))  # host tensor: gloo half
        for tr in sends:
            tr.wait(60)
    else:
        time.sleep(0.3)  # let the producer's sleep kernel and churn run before we receive
        for want in cases:
            got = transport.recv(want.shape, want.dtype, src=0).wait(60)
            assert got.device == dev and got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.cpu(), want.cpu())
        tr = transport.recv((n,), torch.float32, src=0)
        stream = torch.cuda.current_stream(dev)
        all_sevens = (tr.ready_on(stream) == 7.0).all()  # consumed on the compute stream, no host wait first
        assert all_sevens.item()
        assert tr.done() or tr.wait(60) is not None
        host = transport.recv((3,), torch.float32, src=0, device="cpu").wait(60)
        assert host.device.type == "cpu" and torch.equal(host, torch.ones(3))
    stats = transport.stats()
    transport.close()
    shutdown_distributed()
    return {"stats": stats, "warm_s": warm_s}


def test_cuda_edges_are_ordered_kept_alive_and_unstaged():
    out = run_ranks(_dtypes_and_order_rank, 2, timeout_s=180)
    for res in out:
        assert res["stats"]["host_staging_copies"] == 0
        assert res["stats"]["dead_pairs"] == []
    assert out[0]["stats"]["contiguous_copies"] == 1


def _timeout_rank(rank: int) -> str:
    from mstar_dist.distributed.init import shutdown_distributed

    transport, dev, _ = _setup(rank)
    msg = ""
    if rank == 1:
        with pytest.raises(TimeoutError) as exc:
            transport.recv((4,), torch.float32, src=0).wait(1.0)  # rank 0 never sends on 0->1
        msg = str(exc.value)
        assert transport.is_pair_dead(0, 1)
        transport.send(torch.full((5,), 3.0, device=dev), dst=0).wait(30)
    else:
        got = transport.recv((5,), torch.float32, src=1).wait(30)
        assert torch.equal(got.cpu(), torch.full((5,), 3.0))
    transport.close()
    shutdown_distributed()
    return msg


def test_a_timed_out_nccl_pair_is_aborted_and_the_reverse_pair_works():
    out = run_ranks(_timeout_rank, 2, timeout_s=120)
    assert "0->1" in out[1] and "timed out" in out[1]
