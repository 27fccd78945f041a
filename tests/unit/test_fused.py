"""The fused pointwise kernels of a decoder block (models/common/fused.py) against the torch ops they replace, a Llama
forward with them against one without, and the choice of them in ``LlamaChat``. The kernels run on CUDA, or on the CPU
under Triton's interpreter (``TRITON_INTERPRET=1`` with Triton installed); without either their cases skip and the
validation cases still run. A failure means a fused forward computes other logits than the model's own ops: a norm
over the wrong sum, a residual stream that loses an add, heads rotated by the wrong half, SwiGLU's halves swapped."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.common import fused
from models.llama.model import Llama, apply_rope
from mstar_dist.engine.kv_cache import StaticKVCache
from tests.unit.test_graph_decode import eager_step, graph_mode_step, run
from tests.unit.test_kv_cache import CFG

DEVICES = [d for d in ("cpu", "cuda") if (d == "cpu" or torch.cuda.is_available()) and fused.available(d)]
needs_kernels = pytest.mark.skipif(not DEVICES, reason="needs Triton on CUDA (or its interpreter on the CPU)")
CASES = [(d, dt) for d in DEVICES for dt in ((torch.float32,) if d == "cpu" else (torch.float32, torch.bfloat16))]


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """fp32: the same up to rounding; bf16: at most one bf16 step apart (an fp32 exp or sqrt rounding differently)."""
    if dtype == torch.float32:
        return torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    return torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2)


@needs_kernels
@pytest.mark.parametrize("device,dtype", CASES)
def test_add_rms_norm_is_the_add_then_the_norm(device, dtype):
    """A hidden size that is not a power of two (SmolLM2's 576): the sum and the normed sum of every row."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 576, device=device, dtype=dtype)
    residual = torch.randn(3, 5, 576, device=device, dtype=dtype)
    weight = torch.randn(576, device=device, dtype=dtype)
    out, summed = fused.add_rms_norm(x, residual, weight, 1e-5)
    want_sum = x + residual
    assert torch.equal(summed, want_sum)  # the residual stream itself is exact
    assert close(out, F.rms_norm(want_sum, (576,), weight, 1e-5), dtype)
    assert out.shape == summed.shape == x.shape


@needs_kernels
@pytest.mark.parametrize("device,dtype", CASES)
def test_silu_mul_takes_gate_then_up(device, dtype):
    """An intermediate size spanning two programs, the second partly masked (1500 = 1024 + 476)."""
    torch.manual_seed(0)
    gate_up = torch.randn(4, 3, 3000, device=device, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    got = fused.silu_mul(gate_up)
    assert got.shape == (4, 3, 1500)
    assert close(got, F.silu(gate) * up, dtype)


@needs_kernels
@pytest.mark.parametrize("device,dtype", CASES)
def test_rope_rotates_a_view_of_the_projection_like_apply_rope(device, dtype):
    """Queries and keys as the attention hands them over: the first heads of each token's QKV projection (a strided
    view), rotated by each token's own position."""
    torch.manual_seed(0)
    B, T, nh, nkv, hd = 2, 7, 6, 2, 64
    qkv = torch.randn(B, T, nh + 2 * nkv, hd, device=device, dtype=dtype)
    table = torch.randn(32, hd, device=device, dtype=dtype)
    positions = torch.randint(0, 32, (B, T), device=device)
    cos, sin = table[positions].unsqueeze(2), table.flip(0)[positions].unsqueeze(2)
    x = qkv[:, :, :nh + nkv]
    got = fused.rope(x, cos, sin)
    assert got.shape == x.shape and got.is_contiguous()
    assert close(got, apply_rope(x, cos, sin), dtype)


@needs_kernels
def test_rope_refuses_heads_it_cannot_walk():
    device = DEVICES[0]
    x = torch.randn(1, 2, 3, 48, device=device)  # 48 is not a power of two
    table = torch.randn(1, 2, 1, 48, device=device)
    with pytest.raises(ValueError, match="power-of-two"):
        fused.rope(x, table, table)


def models(device: str, dtype: torch.dtype = torch.float32) -> tuple[Llama, Llama]:
    """The same random model twice, the second with the fused kernels."""
    torch.manual_seed(0)
    plain = Llama(CFG).to(device, dtype).eval().requires_grad_(False)
    plain.init_rope_tables()
    fast = Llama(CFG).to(device, dtype).eval().requires_grad_(False)
    fast.load_state_dict(plain.state_dict())
    fast.init_rope_tables()
    fast.fuse_pointwise()
    return plain, fast


def cache(device: str, dtype: torch.dtype = torch.float32, kernel: bool = False) -> StaticKVCache:
    return StaticKVCache(CFG.n_layers, CFG.n_kv_heads, CFG.head_dim, max_slots=6, max_seq_len=64, dtype=dtype,
                         device=device, decode_kernel=kernel)


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_a_fused_forward_decodes_like_the_plain_one(device):
    """Three rows of different lengths prefilled and decoded greedily, eagerly and in graph mode (the path CUDA-graph
    steps take): the same logits with the fused kernels as without."""
    plain, fast = models(device)
    want = run(plain, c := cache(device), [5, 9, 3], 6, eager_step(plain, c))
    got = run(fast, c := cache(device), [5, 9, 3], 6, eager_step(fast, c))
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    graph = run(fast, c := cache(device), [5, 9, 3], 6, graph_mode_step(fast, c))
    assert torch.allclose(graph, want, atol=1e-4), (graph - want).abs().max()


@needs_kernels
@pytest.mark.parametrize("device", DEVICES)
def test_a_fused_forward_keeps_the_padded_prefill_contract(device):
    """Right-padded rows of a batched prefill read their logits at their own last token: the fused path returns the
    un-normed residual stream like the plain one, so ``last_index`` and the final norm still apply."""
    plain, fast = models(device)
    ids = torch.randint(0, CFG.vocab_size, (2, 8), device=device)
    positions = torch.arange(8, device=device).expand(2, 8)
    last = torch.tensor([7, 4], device=device)
    out = []
    for model in (plain, fast):
        c = cache(device)
        c.bind([c.alloc(), c.alloc()], [0, 0], 8)
        out.append(model(ids, positions, c, last_index=last))
    assert out[1].shape == (2, 1, CFG.vocab_size)
    assert torch.allclose(out[1], out[0], atol=1e-4), (out[1] - out[0]).abs().max()
    short = ids[:1, :3], positions[:1, :3]
    assert torch.allclose(fast.hidden_states(*short, _bound(device, 3)), plain.hidden_states(*short, _bound(device, 3)),
                          atol=1e-4)


def _bound(device: str, length: int) -> StaticKVCache:
    c = cache(device)
    c.bind([c.alloc()], [0], length)
    return c


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not fused.available("cuda"), reason="needs Triton on CUDA")
def test_bf16_greedy_decode_in_captured_graphs_matches_the_plain_model():
    """The serving path on a GPU: bf16 weights, decode steps captured in CUDA graphs with the in-place attention
    kernel. The fused model picks the same greedy tokens as the plain one and its logits stay within bf16 rounding."""
    from mstar_dist.engine.cuda_graphs import DecodeGraphs

    plain, fast = models("cuda", torch.bfloat16)
    tokens = []
    for model in (plain, fast):
        c = cache("cuda", torch.bfloat16, kernel=True)
        graphs = DecodeGraphs(model, c, scratch_slot=c.alloc(), max_batch=4)
        graphs.capture()
        logits = run(model, c, [5, 9, 3], 8, lambda t, n, s: graphs.logits(t, n, s))
        tokens.append(logits.argmax(-1))
    assert torch.equal(tokens[0], tokens[1])


def test_the_engine_config_validates_fused_pointwise(monkeypatch):
    """``engine.fused_pointwise``: an unknown value, or triton where it cannot run or for a model without a fused
    path, is a ValueError naming the key; auto fuses on CUDA only (never under the CPU interpreter, which is there
    for tests), torch never."""
    from mstar_dist.config.engine import EngineConfig

    with pytest.raises(ValueError, match=r"fused_pointwise = 'inductor': must be one of auto \| triton \| torch"):
        EngineConfig(fused_pointwise="inductor")
    plain = Llama(CFG)
    monkeypatch.setattr(fused, "available", lambda device: False)
    with pytest.raises(ValueError, match="engine.fused_pointwise: triton needs Triton on a CUDA device"):
        fused.wanted("triton", "cpu", plain)
    with pytest.raises(ValueError, match="engine.fused_pointwise: triton, but the Module model"):
        fused.wanted("triton", "cuda", torch.nn.Module())
    monkeypatch.setattr(fused, "available", lambda device: True)
    assert fused.wanted("triton", "cpu", plain) is True
    assert fused.wanted("auto", "cpu", plain) is False  # auto: CUDA only
    assert fused.wanted("auto", "cuda:0", plain) is True
    assert fused.wanted("auto", "cuda:0", torch.nn.Module()) is False  # a model without a fused path
    assert fused.wanted("torch", "cuda:0", plain) is False
