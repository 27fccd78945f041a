"""The speech codec's CUDA graphs (models/snac/graphs.py) on one GPU: a replay must give each window what the eager
batched decode gives it, its noise from its own generator, whatever bucket or number of replays the batch takes. A
failure means served speech on a GPU sounds different from the same request's eager decode."""

from __future__ import annotations

import pytest
import torch

from models.snac import SNAC_24KHZ, SnacDecoder
from models.snac.frames import decode_windows, to_pcm16
from models.snac.graphs import WindowGraphs
from mstar_dist.engine.sampling import seeded

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def decoder():
    torch.manual_seed(0)
    return SnacDecoder(SNAC_24KHZ).cuda().eval().requires_grad_(False)


@pytest.mark.parametrize("rows", [1, 5, 8, 13])
def test_a_replayed_window_is_its_eager_decode(decoder, rows):
    graphs = WindowGraphs(decoder, frames=4, max_rows=8)  # 13 rows: two replays (8 and 5 in the bucket of 8)
    graphs.capture()
    windows = torch.randint(0, SNAC_24KHZ.codebook_size, (rows, 4, 7), device="cuda")
    gens = lambda: [seeded(100 + r, "cuda") for r in range(rows)]  # noqa: E731
    got = graphs.decode(windows, 1, gens())
    with torch.inference_mode():
        want = torch.cat([decode_windows(decoder, windows[i:i + 8], 1, gens()[i:i + 8]) for i in range(0, rows, 8)])
    assert got.shape == (rows, SNAC_24KHZ.frame_samples)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (to_pcm16(got).int() - to_pcm16(want).int()).abs().max() <= 1
    assert not torch.equal(got[0], graphs.decode(windows[:1], 1, [seeded(7, "cuda")])[0])  # the noise is the row's
