"""Qwen3-Omni's code2wav (models/qwen3_omni/code2wav.py) against transformers' Qwen3OmniMoeCode2Wav on a tiny random
config (fp32, CPU): parameter names, the one-shot waveform, and the streaming chunked decode against HF's
``chunked_decode``.

A failure points to: the module tree (names) if the state dicts differ; the frame-rate transformer (sliding-window
mask, RoPE, layer scales) if the pre-transformer output differs; the causal (transposed) convolutions, ConvNeXt or
SnakeBeta if only the waveform differs; `Code2WavStream` / the `LeftContext` policy (chunk bounds, context dropped,
the final chunk) if one-shot matches but the chunked audio or the chunk counts do not.
"""

from __future__ import annotations

import pytest
import torch

from models.qwen3_omni.code2wav import SAMPLE_RATE, Code2Wav, Code2WavConfig, Code2WavStream

transformers = pytest.importorskip("transformers")
omni = pytest.importorskip("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe")
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_intraop_thread")

Q, CODES = 4, 64
ATOL = 1e-5


def tiny_hf_config(sliding_window: int = 8) -> Qwen3OmniMoeCode2WavConfig:
    """Hidden 32, 2 transformer layers, 4 codebooks of 64 codes, upsampling 2*2 then 4*3: 48 samples a frame."""
    return Qwen3OmniMoeCode2WavConfig(codebook_size=CODES, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, sliding_window=sliding_window,
                                      num_quantizers=Q, upsample_rates=[4, 3], upsampling_ratios=[2, 2],
                                      decoder_dim=32)


def pair(sliding_window: int = 8) -> tuple[torch.nn.Module, Code2Wav]:
    torch.manual_seed(0)
    hc = tiny_hf_config(sliding_window)
    hf = omni.Qwen3OmniMoeCode2Wav(hc).eval()
    with torch.no_grad():  # a waveform well inside (-1, 1): the clamp hides nothing
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(("alpha", "beta")):
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith(("scale", "gamma")):
                p.copy_(0.1 + 0.05 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
        hf.decoder[-1].conv.weight.mul_(10)
    with torch.device("meta"):
        ours = Code2Wav(Code2WavConfig.from_hf(hc.to_dict()))
    ours.load_state_dict(hf.state_dict(), assign=True, strict=True)
    ours.init_buffers()
    return hf, ours.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def models():
    return pair()


def codes_of(frames: int, seed: int = 1, rows: int = 1) -> torch.Tensor:
    return torch.randint(0, CODES, (rows, Q, frames), generator=torch.Generator().manual_seed(seed))


def test_the_state_dict_is_the_published_layout(models):
    hf, ours = models
    ref = hf.state_dict()
    assert list(ours.state_dict()) == list(ref)  # the same names in the same order
    assert all(t.shape == ref[name].shape for name, t in ours.state_dict().items())


def test_the_waveform_matches_hf(models):
    hf, ours = models
    codes = codes_of(60, rows=2)
    with torch.no_grad():
        ref = hf(codes)
        got = ours(codes)
    assert got.shape == ref.shape == (2, 1, ours.samples(60))
    assert 0.05 < ref.abs().max() < 0.99  # a real signal, not clamped
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("frames, chunk, left_context", [(130, 25, 25), (50, 25, 25), (30, 7, 5), (23, 10, 0),
                                                         (3, 25, 25)])
def test_the_streamed_chunks_are_hfs_chunked_decode(models, frames, chunk, left_context):
    hf, ours = models
    codes = codes_of(frames)
    with torch.no_grad():
        ref = hf.chunked_decode(codes, chunk_size=chunk, left_context_size=left_context)
    stream = Code2WavStream(ours, chunk=chunk, left_context=left_context)
    out = []
    for t in range(frames):  # frames one at a time, as the talker makes them
        out += stream.push(codes[..., t:t + 1])
    out += stream.finish()
    assert [final for _, final in out] == [False] * (frames // chunk) + [True]
    assert (out[-1][0].shape[-1] == 0) == (frames % chunk == 0)  # the final chunk is empty when nothing is left
    torch.testing.assert_close(torch.cat([audio for audio, _ in out], dim=-1), ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.chunked_decode(codes, chunk, left_context), ref, atol=ATOL, rtol=0)


def test_chunks_equal_the_one_shot_decode_where_their_context_covers_the_window():
    """Chunk k's audio sits at samples [k * chunk * 48, ...) of a one-shot decode. With the attention window (8)
    inside the left context (25) every chunk equals it; with the published ratio (window 72 > context 25) the chunks
    after the second see fewer frames than the one-shot decode and differ slightly."""
    for window, exact_chunks in ((8, 6), (72, 2)):
        _, ours = pair(window)
        codes = codes_of(130)
        stream = Code2WavStream(ours, chunk=25, left_context=25)
        chunks = [audio for audio, _ in stream.push(codes) + stream.finish()]
        with torch.no_grad():
            one = ours(codes)
        peak = one.abs().max()
        for k, audio in enumerate(chunks):
            start = k * 25 * ours.total_upsample
            assert start + audio.shape[-1] <= one.shape[-1]
            diff = (audio - one[..., start:start + audio.shape[-1]]).abs().max()
            assert diff < (1e-6 if k < exact_chunks else 0.1 * peak), (window, k, float(diff), float(peak))


def test_a_stream_that_never_got_a_frame_ends_with_one_empty_final_chunk(models):
    _, ours = models
    out = Code2WavStream(ours).finish()
    assert len(out) == 1 and out[0][1] and out[0][0].shape[-1] == 0


def test_the_published_code2wav_config_is_read():
    config = Code2WavConfig.from_hf({
        "codebook_size": 2048, "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
        "num_key_value_heads": 16, "intermediate_size": 3072, "sliding_window": 72, "num_quantizers": 16,
        "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "decoder_dim": 1536, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 10000, "rope_type": "default"}, "codebook_dim": 512})
    assert config.total_upsample == 1920 and SAMPLE_RATE / config.total_upsample == 12.5
    assert config.head_dim == 64 and config.n_kv_heads == 16
    with pytest.raises(ValueError, match="code2wav_config: missing key 'decoder_dim'"):
        Code2WavConfig.from_hf({**tiny_hf_config().to_dict(), "decoder_dim": None})


def test_codes_of_the_wrong_shape_are_refused(models):
    _, ours = models
    with pytest.raises(ValueError, match=r"codes must be \(B, 4, frames\)"):
        ours(torch.zeros(1, 3, 5, dtype=torch.long))
