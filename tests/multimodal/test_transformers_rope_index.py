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
