"""Equality with transformers' own rope index (continuation="spatial_extent", pads 0, deltas vs valid length)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from visionpe.multimodal import get_position_ids

from .helpers import hf_rope_index, random_batch

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel  # noqa: E402
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel  # noqa: E402

V5 = dict(continuation="spatial_extent", pad_value=0, delta_convention="valid")


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 100_000), videos=st.integers(0, 2))
def test_mrope_equals_qwen2vl_get_rope_index(seed, videos):
    gen = torch.Generator().manual_seed(seed)
    types, mask, image, video = random_batch(gen, batch_size=4, max_images=3, max_videos=videos)
    ref_pos, ref_delta = hf_rope_index(Qwen2VLModel)(types, types, image, video, attention_mask=mask)
    pos, delta = get_position_ids("mrope", types, image, video, mask, **V5)
    assert torch.equal(pos, ref_pos) and torch.equal(delta, ref_delta)
    if video is None:  # images: the original rule and the 5.x rule agree on every id
        legacy, _ = get_position_ids("mrope", types, image, video, mask, pad_value=0)
        assert torch.equal(legacy, ref_pos)


@pytest.mark.parametrize("spg", [0.5, 1.0, 0.25, 2 / 3])
def test_abs_time_equals_qwen25vl_rule(spg):
    gen = torch.Generator().manual_seed(int(spg * 1000))
    types, mask, image, video = random_batch(gen, batch_size=4, max_images=2, max_videos=2)
    if video is None:
        types, mask, image, video = random_batch(torch.Generator().manual_seed(7), 4, 2, 2)
    spg_ts = torch.full((len(video),), spg)
    ref_pos, ref_delta = hf_rope_index(Qwen2_5_VLModel, tokens_per_second=2)(
        types, types, image, video, second_per_grid_ts=spg_ts, attention_mask=mask
    )
    pos, delta = get_position_ids(
        "mrope_abs_time", types, image, video, mask, second_per_grid_ts=spg_ts, tokens_per_second=2, **V5
    )
    assert torch.equal(pos, ref_pos) and torch.equal(delta, ref_delta)


def _long_video_batch(spg_values):
    """Left-padded rows of text, one 60-grid video (2x2 merged to 1 token per grid) and text, one per spg."""
    rows = [[0] * (2 + b) + [2] * 60 + [0] * 3 for b in range(len(spg_values))]
    length = max(len(r) for r in rows)
    types = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(types)
    for b, row in enumerate(rows):
        types[b, length - len(row) :] = torch.tensor(row)
        mask[b, length - len(row) :] = 1
    return types, mask, torch.tensor([[60, 2, 2]] * len(rows))


@pytest.mark.parametrize("tps", [2, 4])
@pytest.mark.parametrize("fps", [25, 30, 24, 2, 2 / 0.7, 4, 15, 29.97])
def test_abs_time_float32_rounding_equals_qwen25vl(fps, tps):
    # The processor's second_per_grid_ts = temporal_patch_size / fps as a float32 tensor; transformers multiplies
    # in float32, and at fps 25 (spg 0.08) frame 25 lands on 4 * tps / 2 exactly (a float64 product floors 1 lower).
    spg = torch.tensor([2 / fps, 2 / fps], dtype=torch.float32)
    types, mask, video = _long_video_batch(spg.tolist())
    ref_pos, ref_delta = hf_rope_index(Qwen2_5_VLModel, tokens_per_second=tps)(
        types, types, None, video, second_per_grid_ts=spg, attention_mask=mask
    )
    pos, delta = get_position_ids(
        "mrope_abs_time", types, None, video, mask, second_per_grid_ts=spg, tokens_per_second=tps, **V5
    )
    assert torch.equal(pos, ref_pos) and torch.equal(delta, ref_delta)


@pytest.mark.parametrize("as_list", [False, True])
def test_abs_time_spg_values_equal_qwen25vl(as_list):
    values = [0.08, 0.7, 0.5, 1 / 15, 2 / 30, 2 / 24, 2 / 2.5]
    spg = values if as_list else torch.tensor(values)
    types, mask, video = _long_video_batch(values)
    ref_pos, ref_delta = hf_rope_index(Qwen2_5_VLModel, tokens_per_second=2)(
        types, types, None, video, second_per_grid_ts=spg, attention_mask=mask
    )
    pos, delta = get_position_ids(
        "mrope_abs_time", types, None, video, mask, second_per_grid_ts=spg, tokens_per_second=2, **V5
    )
    assert torch.equal(pos, ref_pos) and torch.equal(delta, ref_delta)
    if not as_list:  # the cases the float64 product got wrong: spg 0.08 at frame 25, spg 0.7 at frame 5
        for row, frame, expected in ((0, 25, 4), (1, 5, 7)):
            start = int((mask[row] == 0).sum()) + 2 + row  # first video token of the row
            assert pos[0, row, start + frame] - pos[0, row, start] == expected
