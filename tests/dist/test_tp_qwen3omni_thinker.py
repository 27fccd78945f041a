"""The Qwen3-Omni thinker with tensor parallelism on real processes over gloo: a TP2 shard per rank == the whole model.

One world of 3 ranks: ranks 1 and 2 form the TP group, rank 0 (outside it) runs the unsharded reference, so a layer
that reduced over the world instead of its group would hang or mis-sum. Each rank reads only its shard of a
checkpoint written by the published names (``thinker.`` prefix, per-expert tensors) through models/common's
sharded loader and the thinker's ``checkpoint_sources``, then runs a multimodal prefill (input embeddings, M-RoPE
positions, deepstack) and decode steps at offset positions through a StaticKVCache sized by ``local_kv_heads``.

A failure points to: the shards a rank cuts (q/k/v rows, o_proj columns, each expert's gate/up rows and down
columns) or the fused experts after loading if TP2 logits differ from TP1; a missing or doubled all-reduce if the
count is not two per layer per forward (attention, and ONE per MoE block); a non-replicated router or residual
stream if the two TP ranks disagree.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.dist.launcher import run_ranks
from tests.unit.test_qwen3omni_thinker import TINY_THINKER

PROMPT_LEN, DECODE_STEPS, OFFSET = 12, 3, -4
VISUAL = range(3, 7)
"""The prompt positions whose embeddings are an "image" with deepstack features."""
ATOL = 2e-5


def write_checkpoint(out: Path) -> Path:
    """A random thinker checkpoint by the published names (norms around 1, weights N(0, 0.08))."""
    from models.qwen3_omni.thinker import Qwen3OmniThinker, ThinkerConfig

    with torch.device("meta"):
        model = Qwen3OmniThinker(ThinkerConfig.from_hf(TINY_THINKER))
    gen = torch.Generator().manual_seed(0)
    tensors = {"thinker." + n: (1 + 0.1 * torch.randn(t.shape, generator=gen)) if "norm" in n
               else 0.08 * torch.randn(t.shape, generator=gen) for n, t in model.state_dict().items()}
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model-00001-of-00001.safetensors"))
    return out


def inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    T = PROMPT_LEN + DECODE_STEPS
    axes = torch.stack([torch.arange(PROMPT_LEN)] * 3)
    axes[1, VISUAL.start:VISUAL.stop] = torch.tensor([3, 3, 4, 4])  # a 2 x 2 "image": rows and columns
    axes[2, VISUAL.start:VISUAL.stop] = torch.tensor([3, 4, 3, 4])
    mask = torch.zeros(1, PROMPT_LEN, dtype=torch.bool)
    mask[0, VISUAL.start:VISUAL.stop] = True
    return {"tokens": torch.randint(2000, (T,), generator=gen), "embeds": torch.randn(1, PROMPT_LEN, 64, generator=gen),
            "positions": axes[:, None], "deepstack": torch.randn(2, len(VISUAL), 64, generator=gen), "mask": mask}


def _count_all_reduces() -> list[int]:
    """Count dist.all_reduce calls in this rank process from now on (only this test's child process is patched)."""
    import torch.distributed as dist

    counter = [0]
    real = dist.all_reduce

    def counting(*args, **kwargs):
        counter[0] += 1
        return real(*args, **kwargs)

    dist.all_reduce = counting
    return counter


def _load(weights_dir: str, tp):
    from models.common.checkpoint import SafetensorsDir, load_sharded_state
    from models.qwen3_omni.thinker import Qwen3OmniThinker, ThinkerConfig

    with torch.device("meta"):
        model = Qwen3OmniThinker(ThinkerConfig.from_hf(TINY_THINKER), tp=tp)
    with SafetensorsDir(Path(weights_dir)) as ckpt:
        state = load_sharded_state(model, model.checkpoint_sources(), ckpt, device="cpu", dtype=torch.float32,
                                   source=Path(weights_dir))
    model.load_state_dict(state, strict=True, assign=True)
    model.finish_load()
    return model.eval()


def _drive(model, x: dict) -> torch.Tensor:
    """The multimodal prefill's last logits, then each decode step's: (1 + DECODE_STEPS, V)."""
    from mstar_dist.engine.kv_cache import StaticKVCache

    cache = StaticKVCache(n_layers=2, n_kv_heads=model.local_kv_heads, head_dim=16, max_slots=1, max_seq_len=32)
    slot = cache.alloc()
    out = []
    with torch.inference_mode():
        cache.bind([slot], [0], PROMPT_LEN)
        out.append(model(x["tokens"][None, :PROMPT_LEN], x["positions"], cache, last_only=True,
                         inputs_embeds=x["embeds"], deepstack=x["deepstack"], visual_mask=x["mask"])[0, -1])
        for pos in range(PROMPT_LEN, PROMPT_LEN + DECODE_STEPS):
            cache.bind([slot], [pos], 1)
            out.append(model(x["tokens"][None, pos:pos + 1], torch.tensor([[pos + OFFSET]]), cache,
                             last_only=True)[0, -1])
    return torch.stack(out)


def _rank(rank: int, weights_dir: str, x: dict) -> dict:
    from mstar_dist.distributed.groups import create_tp_groups
    from mstar_dist.distributed.init import init_distributed, shutdown_distributed
    from mstar_dist.distributed.tp import TPGroup

    torch.set_num_threads(1)
    init_distributed(global_rank=rank, world_size=int(os.environ["WORLD_SIZE"]), device="cpu", timeout_s=30)
    try:
        groups = create_tp_groups([[1, 2]], global_rank=rank, backend="gloo", timeout_s=30)
        tp = TPGroup.single() if rank == 0 else TPGroup.from_process_group(groups[(1, 2)].group)
        model = _load(weights_dir, tp)
        counter = _count_all_reduces()
        logits = _drive(model, x)
        return {"logits": logits.numpy(), "reduces": counter[0], "tp_rank": tp.rank,
                "kv_heads": model.local_kv_heads}
    finally:
        shutdown_distributed()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    weights = write_checkpoint(tmp_path_factory.mktemp("thinker_tp") / "ckpt")
    return run_ranks(_rank, 3, timeout_s=90, args=(str(weights), inputs()))


def test_thinker_tp2_logits_equal_tp1_with_one_all_reduce_per_block(results) -> None:
    ref = torch.from_numpy(results[0]["logits"])
    assert [r["tp_rank"] for r in results[1:]] == [0, 1] and [r["kv_heads"] for r in results] == [2, 1, 1]
    for r in results[1:]:
        torch.testing.assert_close(torch.from_numpy(r["logits"]), ref, atol=ATOL, rtol=0)
        assert r["reduces"] == 2 * 2 * (1 + DECODE_STEPS)  # attention + MoE block, per layer, per forward
    assert (results[1]["logits"] == results[2]["logits"]).all()  # the group's ranks agree exactly
