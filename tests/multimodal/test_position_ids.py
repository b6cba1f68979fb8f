import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from visionpe.multimodal import get_position_ids, list_multimodal_schemes, sample_hope_scale, sample_v2pe_delta

from .helpers import IMAGES_ONLY, NEEDS_TIME, max_videos, random_batch, video_options

IMAGE_SEQ = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]])  # T T <vs> | 2x3 image | <ve> T
IMAGE_GRID = torch.tensor([[1, 4, 6]])
VIDEO_SEQ = torch.tensor([[0, 0] + [2] * 12 + [0, 0]])  # T T | (3, 4, 4) video | T T
VIDEO_GRID = torch.tensor([[3, 4, 4]])
ALL_SCHEMES = list_multimodal_schemes()


def rows(scheme, types=IMAGE_SEQ, image=IMAGE_GRID, video=None, **kw):
    pos, delta = get_position_ids(scheme, types, image, video, **kw)
    return pos[:, 0].tolist(), delta.tolist()


def test_mrope_worked_example_b1():
    pos, delta = rows("mrope")
    assert pos == [
        [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7],
        [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7],
        [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7],
    ]
    assert delta == [[-3]]


def test_mrope_video_docstring_case():
    types = torch.tensor([[2] * 12 + [0] * 5])
    pos, _ = rows("mrope", types, None, torch.tensor([[3, 4, 4]]))
    assert pos[0] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 4, 5, 6, 7]


def test_abs_time_example_b2_and_continuations_b3():
    pos, _ = rows("mrope_abs_time", VIDEO_SEQ, None, VIDEO_GRID, second_per_grid_ts=[1.0])
    assert pos == [
        [0, 1, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6, 7, 8],
        [0, 1, 2, 2, 3, 3, 2, 2, 3, 3, 2, 2, 3, 3, 7, 8],
        [0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 7, 8],
    ]
    pos, _ = rows(
        "mrope_abs_time", VIDEO_SEQ, None, VIDEO_GRID, second_per_grid_ts=[1.0], continuation="spatial_extent"
    )
    assert [r[-2:] for r in pos] == [[4, 5]] * 3
    legacy, _ = rows("mrope", VIDEO_SEQ, None, VIDEO_GRID)
    v5, _ = rows("mrope", VIDEO_SEQ, None, VIDEO_GRID, continuation="spatial_extent")
    assert legacy[0][-2:] == [5, 6] and v5[0][-2:] == [4, 5]


def test_abs_time_fractional_interval_does_not_collapse():
    # fps 4: spg = 0.5, tps = 2 -> offsets 0, 1, 2 (an int cast of spg would give 0, 0, 0).
    pos, _ = rows("mrope_abs_time", VIDEO_SEQ, None, VIDEO_GRID, second_per_grid_ts=[0.5])
    assert pos[0][2:14] == [2] * 4 + [3] * 4 + [4] * 4
    frac, _ = rows("mrope_abs_time", VIDEO_SEQ, None, VIDEO_GRID, second_per_grid_ts=[0.25], fractional_time=True)
    assert frac[0][2:14] == [2.0] * 4 + [2.5] * 4 + [3.0] * 4
    trunc, _ = rows("mrope_abs_time", VIDEO_SEQ, None, VIDEO_GRID, second_per_grid_ts=[0.25])
    assert trunc[0][2:14] == [2] * 8 + [3] * 4


def test_abs_time_requires_timing_for_videos():
    with pytest.raises(ValueError, match="second_per_grid_ts"):
        get_position_ids("mrope_abs_time", VIDEO_SEQ, video_grid_thw=VIDEO_GRID)


def test_spatial_reset_example_b4():
    pos, _ = rows("mrope_interleaved", spatial_reset=True)
    assert pos == [
        [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7],
        [0, 1, 2, 0, 0, 0, 1, 1, 1, 6, 7],
        [0, 1, 2, 0, 1, 2, 0, 1, 2, 6, 7],
    ]
    assert rows("mrope_interleaved")[0] == rows("mrope")[0]


@pytest.mark.parametrize(
    "delta, expected",
    [
        (1.0, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),
        (0.5, [0, 1, 2, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6, 7]),
        (0.25, [0, 1, 2, 2.25, 2.5, 2.75, 3.0, 3.25, 3.5, 5, 6]),
    ],
)
def test_v2pe_worked_example_b6(delta, expected):
    pos, _ = rows("v2pe", delta=delta)
    assert pos == [expected] * 3


def test_v2pe_per_sample_delta_and_sampler():
    types = IMAGE_SEQ.repeat(2, 1)
    pos, _ = get_position_ids("v2pe", types, IMAGE_GRID.repeat(2, 1), delta=torch.tensor([1.0, 0.25]))
    assert pos[0, 0, -1] == 10 and pos[0, 1, -1] == 6
    draws = sample_v2pe_delta(64, generator=torch.Generator().manual_seed(0))
    assert set(draws.tolist()) <= {1 / 2**k for k in range(9)} and len(set(draws.tolist())) > 3
    assert set(sample_hope_scale(32, torch.Generator().manual_seed(0)).tolist()) <= {0.5, 0.75, 1.0, 1.25, 1.5}


TWO_IMAGES = torch.tensor([[0, 0] + [1] * 6 + [0] + [1] * 6 + [0]])  # T T | 2x3 image | T | 2x3 image | T


def test_v2pe_delta_per_image_b6():
    # the paper draws delta per image: a (B, K) tensor gives the k-th image of each sample its own step
    grids = IMAGE_GRID.repeat(2, 1)
    pos, _ = get_position_ids("v2pe", TWO_IMAGES, grids, delta=torch.tensor([[1.0, 0.25]]))
    assert pos[0, 0].tolist() == [0, 1, *range(2, 8), 8, 8.25, 8.5, 8.75, 9.0, 9.25, 9.5, 11]
    for delta in (0.5, 0.25):  # equal columns are the per-sample value; columns past a sample's images are unused
        same, _ = get_position_ids("v2pe", TWO_IMAGES, grids, delta=torch.tensor([[delta, delta, -1.0]]))
        assert torch.equal(same, get_position_ids("v2pe", TWO_IMAGES, grids, delta=delta)[0])
    with pytest.raises(ValueError, match=r"delta as a \(B, K\) tensor needs a column per visual block.*2 blocks"):
        get_position_ids("v2pe", TWO_IMAGES, grids, delta=torch.tensor([[0.5]]))
    with pytest.raises(ValueError, match="delta must be positive and finite"):
        get_position_ids("v2pe", TWO_IMAGES, grids, delta=torch.tensor([[0.5, 0.0]]))
    with pytest.raises(ValueError, match=r"delta must be a number, a \(1,\) tensor or a \(1, K\) tensor, got \(2, 2\)"):
        get_position_ids("v2pe", TWO_IMAGES, grids, delta=torch.ones(2, 2))


def test_hope_gamma_per_visual_span_b9():
    # two videos in one sample with their own gamma: each one's frames step by its own value
    types = torch.tensor([[0, 0] + [2] * 12 + [0] + [2] * 12 + [0]])
    pos, _ = get_position_ids("hope", types, None, VIDEO_GRID.repeat(2, 1), temporal_scale=torch.tensor([[1.0, 2.0]]))
    t = pos[0, 0].tolist()
    assert t[2:14:4] == [2.0, 3.0, 4.0] and t[15:27:4] == [t[15], t[15] + 2.0, t[15] + 4.0]


def test_samplers_draw_per_block_keeping_the_first_column():
    per_sample = sample_v2pe_delta(16, torch.Generator().manual_seed(1))
    per_block = sample_v2pe_delta(16, torch.Generator().manual_seed(1), num_blocks=5)
    assert per_block.shape == (16, 5) and torch.equal(per_block[:, 0], per_sample)
    assert all(len(set(row.tolist())) > 1 for row in per_block[:4])  # not one value repeated along a sample
    gammas = sample_hope_scale(8, torch.Generator().manual_seed(0), num_blocks=3)
    assert gammas.shape == (8, 3) and set(gammas.flatten().tolist()) <= {0.5, 0.75, 1.0, 1.25, 1.5}
    with pytest.raises(ValueError, match="num_blocks must be a positive int or None, got 0"):
        sample_v2pe_delta(4, num_blocks=0)


def test_vrope_example_b7():
    pos, _ = rows("vrope")
    t, h, w = (torch.tensor(r) for r in pos)
    variants = torch.stack([t, h, w, h + w - t], 1)[3:9].tolist()
    assert variants == [[3, 5, 4, 6], [4, 4, 5, 5], [5, 3, 6, 4], [4, 6, 3, 5], [5, 5, 4, 4], [6, 4, 5, 3]]
    assert pos[0][-2:] == [7, 8]


def test_videorope_examples_b8():
    pos, delta = rows("videorope")
    assert pos == [
        [0, 1, 2, 3, 3, 3, 3, 3, 3, 4, 5],
        [0, 1, 2, 3, 3, 3, 4, 4, 4, 4, 5],
        [0, 1, 2, 2, 3, 4, 2, 3, 4, 4, 5],
    ]
    assert delta == [[-5.0]]
    pos, _ = rows("videorope", VIDEO_SEQ, None, VIDEO_GRID)
    assert pos[0][2:] == [2] * 4 + [4] * 4 + [6] * 4 + [7, 8]
    assert pos[1][2:14] == [2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]
    assert pos[2][2:14] == [2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7]
    assert rows("hope", VIDEO_SEQ, None, VIDEO_GRID, temporal_scale=2.0)[0] == pos


def test_circle_rope_text_is_equidistant_from_image_tokens():
    types = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0]])
    pos, _ = get_position_ids("circle_rope", types, torch.tensor([[1, 4, 6], [1, 4, 4]]))
    points = pos[:, 0].T.double()
    for text in (0, 1, 8, 9, 14):
        for block in (slice(2, 8), slice(10, 14)):
            dist = (points[block] - points[text]).norm(dim=1)
            assert torch.allclose(dist, dist[0].expand_as(dist), atol=1e-4)
    consumed = pos[0, 0, 8] - pos[0, 0, 1] - 1
    assert consumed <= 10 * (2 / 3) ** 0.5 + 1 + 1e-4
    with pytest.raises(ValueError, match="images only"):
        get_position_ids("circle_rope", VIDEO_SEQ, video_grid_thw=VIDEO_GRID)


@pytest.mark.parametrize(
    "scheme, kw, image, video",
    [
        ("mrope", {}, 3, 3),
        ("mrope_abs_time", {"second_per_grid_ts": [1.0]}, 3, 5),
        ("mrope", {"continuation": "spatial_extent"}, 3, 2),
        ("v2pe", {"delta": 0.25}, 2, 3),
        ("vrope", {}, 4, 9),
        ("videorope", {}, 1, 5),
        ("mrope_interleaved", {"spatial_reset": True}, 4, 4),
    ],
)
def test_positions_consumed_per_block_b11(scheme, kw, image, video):
    img = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0]])
    vid = torch.tensor([[0] + [2] * 12 + [0]])
    pos_i, _ = get_position_ids(
        scheme, img, torch.tensor([[1, 4, 6]]), **{k: v for k, v in kw.items() if k != "second_per_grid_ts"}
    )
    pos_v, _ = get_position_ids(scheme, vid, None, torch.tensor([[3, 4, 4]]), **kw)
    extra = 1 if kw.get("spatial_reset") else 0  # MRoPE-I's spatial reset counts the <ve> token inside the block
    assert pos_i[0, 0, -1] - pos_i[0, 0, 0] - 1 + extra == image
    assert pos_v[0, 0, -1] - pos_v[0, 0, 0] - 1 + extra == video


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_text_only_reduces_to_1d(scheme):
    types = torch.zeros(3, 7, dtype=torch.long)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, :2] = 0
    mask[2, 5:] = 0
    pos, delta = get_position_ids(scheme, types, attention_mask=mask)
    expected = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)
    assert torch.equal(pos.long(), expected.expand(3, -1, -1)) and (pos == pos.long()).all()
    assert delta.flatten().tolist() == [0, 0, 0]


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_what_each_design_does_with_videos_is_what_the_tests_assume(scheme):
    """tests/multimodal/helpers.py lists the designs that raise on a video and those that need the timing of videos:
    each does, and every other design places a video without options."""
    types, grid = torch.tensor([[0, 2, 2, 2, 2, 0]]), torch.tensor([[2, 2, 4]])
    if scheme in IMAGES_ONLY:
        with pytest.raises(ValueError, match="video"):
            get_position_ids(scheme, types, video_grid_thw=grid)
        return
    if scheme in NEEDS_TIME:
        with pytest.raises(ValueError, match="second_per_grid_ts"):
            get_position_ids(scheme, types, video_grid_thw=grid)
    pos, _ = get_position_ids(scheme, types, video_grid_thw=grid, **video_options(scheme, 1))
    assert pos.shape == (3, 1, 6)


def _kwargs(scheme, video_count):
    return video_options(scheme, video_count)


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_left_padding_invariance_batched_equals_per_row_and_decode(scheme):
    gen = torch.Generator().manual_seed(zlib.crc32(scheme.encode()) % 1000)  # hash() of a str differs per process
    types, mask, image, video = random_batch(gen, batch_size=4, max_videos=max_videos(scheme))
    n_video = 0 if video is None else len(video)
    pos, delta = get_position_ids(scheme, types, image, video, mask, **_kwargs(scheme, n_video))
    # Per row, without padding: same valid positions and same deltas.
    image_i = video_i = 0
    for b in range(types.shape[0]):
        keep = mask[b].bool()
        row = types[b, keep][None]
        n_img, n_vid = int((row == 1).sum()), int((row == 2).sum())
        img_rows, vid_rows = [], []
        while n_img > 0:
            g = image[image_i]
            img_rows.append(g)
            n_img -= int(g.prod()) // 4
            image_i += 1
        while n_vid > 0:
            g = video[video_i]
            vid_rows.append(g)
            n_vid -= int(g.prod()) // 4
            video_i += 1
        kw = _kwargs(scheme, len(vid_rows))
        single, single_delta = get_position_ids(
            scheme, row, torch.stack(img_rows) if img_rows else None, torch.stack(vid_rows) if vid_rows else None, **kw
        )
        assert torch.equal(pos[:, b, keep], single[:, 0])
        assert torch.equal(delta[b], single_delta[0])
        assert (pos[:, b, ~keep] == 1).all()
    # One more text token: its position is cumsum(mask) - 1 + delta ("valid") or L + delta ("padded").
    longer = torch.cat([types, torch.zeros_like(types[:, :1])], 1)
    longer_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    kw = _kwargs(scheme, n_video)
    after, _ = get_position_ids(scheme, longer, image, video, longer_mask, **kw)
    close = dict(rtol=0, atol=1e-4)
    torch.testing.assert_close(after[:, :, -1], (mask.sum(1, keepdim=True) + delta).T.expand(3, -1), **close)
    _, padded = get_position_ids(scheme, types, image, video, mask, delta_convention="padded", **kw)
    torch.testing.assert_close(after[:, :, -1], (types.shape[1] + padded).T.expand(3, -1), **close)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), scheme=st.sampled_from(ALL_SCHEMES), padding=st.sampled_from(["left", "right"]))
def test_text_positions_strictly_increase(seed, scheme, padding):
    gen = torch.Generator().manual_seed(seed)
    types, mask, image, video = random_batch(gen, batch_size=3, max_videos=max_videos(scheme), padding=padding)
    kw = _kwargs(scheme, 0 if video is None else len(video))
    pos, _ = get_position_ids(scheme, types, image, video, mask, **kw)
    for b in range(types.shape[0]):
        text = pos[0, b, (types[b] == 0) & mask[b].bool()]
        assert (text[1:] > text[:-1]).all()


def test_pad_value_and_right_padding():
    types = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0, 0, 0]])
    pos, delta = get_position_ids("mrope", types, IMAGE_GRID, attention_mask=mask, pad_value=-7)
    assert pos[:, 1, 3:].eq(-7).all() and pos[0, 1, :3].tolist() == [0, 1, 2]
    assert pos[1, 0].tolist() == [0, 1, 1, 1, 2, 2, 2, 4, 5] and delta.flatten().tolist() == [6 - 9, 0]


def test_bad_inputs_name_sample_and_grid():
    with pytest.raises(ValueError, match=r"image_grid_thw\[0\].*needs 6 .*sample 0 has only 5"):
        get_position_ids("mrope", torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 0]]), IMAGE_GRID)
    missing = r"sample 1 has image tokens \(token type 1\) from position 3, but image_grid_thw is None"
    with pytest.raises(ValueError, match=missing):
        # a video grid given for image tokens
        get_position_ids("mrope", torch.cat([IMAGE_SEQ * 0, IMAGE_SEQ]), video_grid_thw=torch.tensor([[1, 4, 6]]))
    with pytest.raises(ValueError, match=r"video_grid_thw\[0\] = \(1, 4, 5\).*divisible by spatial_merge_size=2"):
        get_position_ids("mrope", IMAGE_SEQ * 2, video_grid_thw=torch.tensor([[1, 4, 5]]))
    with pytest.raises(
        ValueError,
        match=r"image_grid_thw\[1\] = \(1, 2, 4\) needs 2 consecutive image tokens "
        r"from position 2 of sample 0, but that run of image tokens ends after 1",
    ):
        types = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0]])
        get_position_ids("mrope", types, torch.tensor([[1, 2, 2], [1, 2, 4], [1, 2, 2]]))
    with pytest.raises(ValueError, match=r"sample 1 has image tokens from position 2 that no row"):
        get_position_ids("mrope", torch.tensor([[0, 1, 0], [0, 0, 1]]), torch.tensor([[1, 2, 2]]))
    with pytest.raises(ValueError, match="unknown multimodal scheme 'rope9d'.*mrope"):
        get_position_ids("rope9d", IMAGE_SEQ, IMAGE_GRID)
    with pytest.raises(ValueError, match=r"v2pe got unknown option\(s\) \['gamma'\]"):
        get_position_ids("v2pe", IMAGE_SEQ, IMAGE_GRID, gamma=2)
    with pytest.raises(ValueError, match="continuation must be one of"):
        get_position_ids("mrope", IMAGE_SEQ, IMAGE_GRID, continuation="max")
    with pytest.raises(ValueError, match="token_type_ids must be 0"):
        get_position_ids("mrope", IMAGE_SEQ * 3)
    with pytest.raises(ValueError, match="delta must be positive"):
        get_position_ids("v2pe", IMAGE_SEQ, IMAGE_GRID, delta=0.0)


def test_mask_with_holes_matches_compacted_sequence():
    types = torch.tensor([[0, 0, 0, 1, 1, 0, 1, 1, 1, 1, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1]])
    pos, delta = get_position_ids("mrope", types, IMAGE_GRID, attention_mask=mask)
    ref, ref_delta = get_position_ids("mrope", types[:, mask[0].bool()], IMAGE_GRID)
    assert torch.equal(pos[:, :, mask[0].bool()], ref) and torch.equal(delta, ref_delta)
    with pytest.raises(ValueError, match=r"image_grid_thw\[0\].*from position 3 of sample 0, .*ends after 2"):
        get_position_ids("mrope", types, IMAGE_GRID, attention_mask=torch.ones_like(mask))
