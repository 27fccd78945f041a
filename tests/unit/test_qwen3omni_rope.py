"""M-RoPE position ids of Qwen3-Omni prompts (models/qwen3_omni/rope.py): tables, errors, and transformers' parity.

A failure points to: the image grid's order (row-major merged patches: t, then rows, then columns) or where the
next text position starts after a span (the span's largest position + 1) if a table differs; the audio encoder's
output length (``audio_token_count``) if only prompts with audio differ from transformers' ``get_rope_index``; the
front end's import of torch if the import test fails (rope.py must stay pure: it runs per request there).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from models.qwen3_omni.rope import RopeTokens, audio_token_count, decode_position, image_token_count, rope_index
from tests.unit.test_qwen3omni_thinker import AUDIO_END, TINY_THINKER, TOKENS, VISION_END, prompt_ids

SPEC = RopeTokens.from_hf(TINY_THINKER)
VS, IMG, AS, AUD = (TOKENS[k] for k in ("vision_start_token_id", "image_token_id", "audio_start_token_id",
                                        "audio_token_id"))


def test_importing_rope_loads_no_torch() -> None:
    code = "import sys, models.qwen3_omni.rope; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_text_only_positions_count_from_zero_on_every_axis() -> None:
    positions, delta = rope_index([5, 6, 7, 8], SPEC)
    assert positions.tolist() == [[0, 1, 2, 3]] * 3 and delta == 0
    assert decode_position(4, delta) == 4


def test_an_image_is_a_grid_of_merged_patches_and_text_resumes_after_its_largest_position() -> None:
    ids = [9, VS, *[IMG] * 6, VISION_END, 10]  # grid (1, 4, 6) merged 2 x 2: 2 rows of 3
    positions, delta = rope_index(ids, SPEC, image_grids=[(1, 4, 6)])
    assert positions.tolist() == [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
                                  [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
                                  [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]]
    assert delta == 7 - len(ids)  # positions end at 6 for 10 tokens
    assert decode_position(len(ids), delta) == 7


def test_frames_of_a_grid_step_by_position_id_per_seconds() -> None:
    ids = [VS, *[IMG] * 2, VISION_END]  # grid (2, 2, 2): two frames of one merged patch
    positions, _ = rope_index(ids, SPEC, image_grids=[(2, 2, 2)])
    assert positions[:, 1:3].tolist() == [[1, 1 + 13], [1, 1], [1, 1]] and positions[:, 3].tolist() == [15] * 3


def test_audio_counts_on_like_text_with_the_encoders_length() -> None:
    n = audio_token_count(180)
    assert [audio_token_count(f) for f in (1, 2, 99, 100, 101, 180, 200)] == [1, 1, 13, 13, 14, 23, 26] and n == 23
    ids = [3, AS, *[AUD] * n, AUDIO_END]
    positions, delta = rope_index(ids, SPEC, audio_lengths=[180])
    assert positions.tolist() == [list(range(len(ids)))] * 3 and delta == 0


def test_placeholders_that_do_not_match_the_media_are_value_errors() -> None:
    image = [VS, *[IMG] * 6, VISION_END]
    cases = [
        (image, {}, "more image spans"),
        (image, {"image_grids": [(1, 4, 4)]}, "has 6 placeholder tokens where the input needs 4"),
        (image, {"image_grids": [(1, 4, 8)]}, "has 6 placeholder tokens where the input needs 8"),
        ([1, 2], {"image_grids": [(1, 2, 2)]}, "spans for 0 of 1 images"),
        ([AS, *[AUD] * 3, 7], {"audio_lengths": [180]}, "audio 0: the prompt has 3"),
        ([1, IMG, 2], {}, "not inside an image or audio span"),
        ([VS, TOKENS["video_token_id"], 2], {}, "video"),
        ([VS, *[IMG] * 2], {"image_grids": [(1, 3, 2)]}, "multiples of spatial_merge_size \\(2\\)"),
    ]
    for ids, media, message in cases:
        with pytest.raises(ValueError, match=message):
            rope_index(ids, SPEC, **media)
    with pytest.raises(ValueError, match="thinker_config.vision_start_token_id"):
        RopeTokens.from_hf({k: v for k, v in TINY_THINKER.items() if k != "vision_start_token_id"})
    assert image_token_count((1, 4, 6)) == 6


CASES = {  # name -> (parts, image grids, audio feature lengths)
    "text": ([7], [], []),
    "image": ([3, ("image", (1, 4, 6)), 5], [(1, 4, 6)], []),
    "two_images": ([2, ("image", (1, 6, 4)), 1, ("image", (1, 2, 8)), 4], [(1, 6, 4), (1, 2, 8)], []),
    "audio": ([4, ("audio", 230), 2], [], [230]),
    "image_audio": ([2, ("image", (1, 4, 4)), 3, ("audio", 99), 3], [(1, 4, 4)], [99]),
    "audio_two_images": ([("audio", 101), ("image", (2, 4, 6)), 1, ("image", (1, 8, 2))],
                         [(2, 4, 6), (1, 8, 2)], [101]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_positions_and_delta_match_transformers_get_rope_index(case: str) -> None:
    transformers = pytest.importorskip("transformers")
    import torch
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerForConditionalGeneration, _get_feat_extract_output_lengths,
    )

    parts, grids, audio = CASES[case]
    model = Qwen3OmniMoeThinkerForConditionalGeneration(transformers.Qwen3OmniMoeThinkerConfig(**TINY_THINKER))
    ids = prompt_ids(parts, seed=len(case))
    expect, expect_delta = model.get_rope_index(
        torch.tensor([ids]), image_grid_thw=torch.tensor(grids) if grids else None,
        attention_mask=torch.ones(1, len(ids), dtype=torch.long), audio_seqlens=torch.tensor(audio) if audio else None)
    positions, delta = rope_index(ids, SPEC, image_grids=grids, audio_lengths=audio)
    assert np.array_equal(positions, expect[:, 0].long().numpy()) and delta == int(expect_delta)
    lengths = torch.arange(1, 1000)
    assert [audio_token_count(n) for n in range(1, 1000)] == _get_feat_extract_output_lengths(lengths, 50).tolist()
