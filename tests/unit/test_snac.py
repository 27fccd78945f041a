"""SNAC decoder (models/snac) against the `snac` package, on random weights saved in the hub layout.

A failure here points to: the decoder math (Snake, residual units, transposed-conv padding, noise draws,
local attention) or the from-codes path if `decode` parity breaks; weight-norm folding or checkpoint name
mapping in models/snac/weights.py if loading fails or parity breaks only for one storage layout; the Orpheus
7-code layout (frames_to_codes / codes_from_tokens) if a round trip or the hand-written frame breaks; the
window slicing of decode_frames if streamed audio stops matching a whole decode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import runpy
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

from models.snac import (
    SNAC_24KHZ, SNAC_TINY, SnacConfig, SnacDecoder, codes_from_tokens, codes_to_frames, decode_frames,
    frames_to_codes, load_snac, save_snac, to_pcm16,
)

snac = pytest.importorskip("snac")

TINY_ATTN = dataclasses.replace(SNAC_TINY, decoder_dim=128, attn_window_size=4, depthwise=False, noise=False)
"""Covers the branches the 24 kHz structure leaves out: local attention, dense convs, no noise."""
ATOL = 1e-5
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """The tensors here are small: with other processes on a 2-core machine, two intra-op threads mostly wait
    on each other (measured under load: 65 s for this module with 2 threads, 12 s with 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def reference_model(config: SnacConfig, seed: int = 0) -> torch.nn.Module:
    """snac.SNAC with every parameter scaled by a random factor, so Snake's alpha is not 1 and the weight-norm
    magnitude g is not |v| (both are at init)."""
    torch.manual_seed(seed)
    model = snac.SNAC(**config.to_json()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 0.2 * torch.randn_like(p))
    return model


def write_checkpoint(model: torch.nn.Module, config: SnacConfig, out: Path, layout: str) -> Path:
    """The reference state_dict as the hub stores it (bin), as safetensors, or with old-torch weight_g/_v names."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config.to_json()))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if layout == "bin":
        torch.save(state, out / "pytorch_model.bin")
    elif layout == "safetensors":
        save_file(state, str(out / "model.safetensors"))
    else:  # "weight_g_v"
        renamed = {k.replace("parametrizations.weight.original0", "weight_g")
                    .replace("parametrizations.weight.original1", "weight_v"): v for k, v in state.items()}
        torch.save(renamed, out / "pytorch_model.bin")
    return out


def random_codes(config: SnacConfig, batch: int, n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, config.codebook_size, (batch, n * config.vq_strides[0] // s), generator=g)
            for s in config.vq_strides]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[torch.nn.Module, SnacDecoder]:
    ref = reference_model(SNAC_TINY)
    return ref, load_snac(write_checkpoint(ref, SNAC_TINY, tmp_path_factory.mktemp("tiny"), "bin"))


def decode_both(ref: torch.nn.Module, ours: SnacDecoder, codes: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Both decodes from the same global RNG state (their noise draws must then agree)."""
    with torch.inference_mode():
        torch.manual_seed(123)
        expected = ref.decode(codes)
        torch.manual_seed(123)
        return ours(codes), expected


@pytest.mark.parametrize("layout", ["bin", "safetensors", "weight_g_v"])
@pytest.mark.parametrize("config", [SNAC_TINY, TINY_ATTN], ids=["tiny", "tiny_attn"])
def test_decode_matches_snac(config, layout, tmp_path):
    ref = reference_model(config)
    ours = load_snac(write_checkpoint(ref, config, tmp_path, layout))
    codes = random_codes(config, batch=2, n=4)
    got, expected = decode_both(ref, ours, codes)
    assert got.shape == (2, 1, 4 * config.frame_samples) == expected.shape
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)


def test_24khz_shapes_match_snac(tmp_path):
    """The real 24 kHz layout loads by name and decodes 2 frames like snac (a few seconds on CPU)."""
    ref = reference_model(SNAC_24KHZ)
    ours = load_snac(write_checkpoint(ref, SNAC_24KHZ, tmp_path, "bin"))
    assert SNAC_24KHZ.frame_samples == 2048
    got, expected = decode_both(ref, ours, random_codes(SNAC_24KHZ, batch=1, n=2))
    assert got.shape == (1, 1, 4096)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)


def test_noise_follows_the_generator_not_the_global_rng(tiny):
    _, ours = tiny
    codes = random_codes(SNAC_TINY, batch=1, n=2)
    state = torch.get_rng_state()
    with torch.inference_mode():
        a = ours(codes, torch.Generator().manual_seed(7))
        b = ours(codes, torch.Generator().manual_seed(7))
        c = ours(codes, torch.Generator().manual_seed(8))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_frame_layout_and_round_trip():
    frames = torch.arange(14).view(2, 7)  # frame 0 = [a, b1, c1, c2, b2, c3, c4] = 0..6
    c0, c1, c2 = frames_to_codes(frames)
    assert c0.tolist() == [[0, 7]]
    assert c1.tolist() == [[1, 4, 8, 11]]
    assert c2.tolist() == [[2, 3, 5, 6, 9, 10, 12, 13]]
    random_frames = torch.randint(0, 4096, (5, 7))
    assert torch.equal(codes_to_frames(frames_to_codes(random_frames)), random_frames)


def test_codes_from_tokens_keeps_complete_frames_and_names_a_bad_position():
    frames = torch.randint(0, 64, (3, 7))
    offset, size = 1000, 64
    tokens = (frames + offset + torch.arange(7) * size).reshape(-1)
    partial = torch.tensor([offset, offset + size])  # 2 tokens of a 4th frame
    assert torch.equal(codes_from_tokens(torch.cat([tokens, partial]), offset, size), frames)
    tokens[9] = offset  # slot 2 of frame 1 holds a slot-0 id
    with pytest.raises(ValueError, match="position 9 .frame 1, slot 2"):
        codes_from_tokens(tokens, offset, size)


@pytest.mark.parametrize("n_new,lookahead", [(1, 0), (4, 0), (2, 1), (1, 2)])
def test_decode_frames_is_the_matching_slice_of_a_whole_decode(tiny, n_new, lookahead):
    _, ours = tiny
    frames = torch.randint(0, SNAC_TINY.codebook_size, (4, 7))
    fs = SNAC_TINY.frame_samples
    audio = decode_frames(ours, frames, n_new, lookahead=lookahead, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        whole = ours(frames_to_codes(frames), torch.Generator().manual_seed(3))[0, 0]
    end = (4 - lookahead) * fs
    assert audio.shape == (n_new * fs,) and audio.dtype == torch.float32
    assert torch.equal(audio, whole[end - n_new * fs:end])


def test_decode_frames_rejects_a_window_that_does_not_fit(tiny):
    with pytest.raises(ValueError, match="n_new=3 and lookahead=2"):
        decode_frames(tiny[1], torch.zeros(4, 7, dtype=torch.long), 3, lookahead=2)


def test_to_pcm16_clamps_scales_and_rounds():
    pcm = to_pcm16(torch.tensor([-2.0, -1.0, 0.25, 0.0, 1.0, 3.0]))
    assert pcm.dtype == torch.int16
    assert pcm.tolist() == [-32767, -32767, 8192, 0, 32767, 32767]


def test_loader_names_a_missing_or_unexpected_tensor(tiny, tmp_path):
    ref, _ = tiny
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    (tmp_path / "config.json").write_text(json.dumps(SNAC_TINY.to_json()))
    missing = {k: v for k, v in state.items() if k != "decoder.model.2.block.0.alpha"}
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 decoder tensors.*decoder\.model\.2\.block\.0\.alpha"):
        load_snac(tmp_path)
    save_file({**state, "decoder.model.9.extra": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected.*decoder\.model\.9\.extra"):
        load_snac(tmp_path)
    half = {k: v for k, v in state.items() if k != "decoder.model.0.parametrizations.weight.original1"}
    save_file(half, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"decoder\.model\.0 has the weight-norm g tensor but not"):
        load_snac(tmp_path)


def test_config_rejects_an_unknown_key():
    with pytest.raises(ValueError, match="unknown key 'hop'"):
        SnacConfig.from_json({**SNAC_TINY.to_json(), "hop": 512})
    assert SnacConfig.from_json(SNAC_24KHZ.to_json()) == SNAC_24KHZ


def test_make_snac_checkpoint_writes_what_load_snac_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["make_snac_checkpoint.py", "--out", str(tmp_path), "--seed", "5"])
    runpy.run_path(str(REPO / "scripts" / "make_snac_checkpoint.py"), run_name="__main__")
    torch.manual_seed(5)
    expected = SnacDecoder(SNAC_TINY).eval()
    loaded = load_snac(tmp_path)
    codes = random_codes(SNAC_TINY, batch=1, n=2)
    with torch.inference_mode():
        got = loaded(codes, torch.Generator().manual_seed(0))
        want = expected(codes, torch.Generator().manual_seed(0))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)


def test_batched_windows_equal_one_window_at_a_time(tiny):
    """The speech codec decodes the chunks of many requests as one batch: each row must be what that request's
    window alone gives, its noise from its own generator."""
    from models.snac.frames import decode_windows

    _, ours = tiny
    windows = torch.randint(0, SNAC_TINY.codebook_size, (3, 4, 7))
    gens = lambda: [torch.Generator().manual_seed(s) for s in (5, 6, 7)]  # noqa: E731
    batched = decode_windows(ours, windows, 1, gens())
    alone = torch.stack([decode_frames(ours, w, 1, generator=g) for w, g in zip(windows, gens())])
    assert batched.shape == (3, SNAC_TINY.frame_samples)
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    # what the README promises of a stream's bytes: the same batch gives the same bytes; another batch changes the
    # order of the convolutions' sums, which can move a PCM16 sample by one step at a rounding edge, never more
    assert torch.equal(to_pcm16(decode_windows(ours, windows, 1, gens())), to_pcm16(batched))
    assert (to_pcm16(batched).int() - to_pcm16(alone).int()).abs().max() <= 1


def test_a_codec_whose_graphs_fail_to_capture_serves_eagerly_and_says_why(tiny, caplog):
    """A capture that fails on some device (a kernel that cannot be captured) must not stop the rank: the eager decode
    gives the same audio."""
    from models.speech.orpheus import SpeechCodec

    _, ours = tiny
    codec = SpeechCodec(ours, audio_offset=0, codebook_size=SNAC_TINY.codebook_size, device=torch.device("cpu"))
    codec.graphs = type("Broken", (), {"capture": lambda self: (_ for _ in ()).throw(RuntimeError("no capture"))})()
    codec.stream = None
    with mock.patch("torch.cuda.stream", lambda s: contextlib.nullcontext()), caplog.at_level("WARNING"):
        codec.warmup()
    assert codec.graphs is None and "could not be captured (RuntimeError: no capture)" in caplog.text
