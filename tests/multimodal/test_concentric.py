"""CCA and PyPE: concentric ids and intra-block masks; Circle-RoPE's AGE ids per layer."""

import pytest
import torch

from visionpe.multimodal import (
    cca_attention_mask,
    concentric_levels,
    get_multimodal_scheme,
    get_position_ids,
    pype_attention_mask,
    pype_num_levels,
)

from .helpers import random_batch


def naive_levels(height, width):
    return [[min(i, j, height - 1 - i, width - 1 - j) for j in range(width)] for i in range(height)]


def image_row(prefix, height, width, suffix):
    """Token types of one sample: ``prefix`` text, a merged ``height`` x ``width`` image, ``suffix`` text."""
    return [0] * prefix + [1] * (height * width) + [0] * suffix


def visible(mask):
    return mask[:, 0] == 0


def naive_mask(types, mask, pos):
    """(B, L, L) bool from the rule written out: causal, except inside one visual run where pos(k) <= pos(q); padded
    keys hidden. ``pos`` (B, L) are the design's 1-D ids (a visual run is one block: random_batch separates blocks)."""
    batch, length = types.shape
    out = torch.zeros(batch, length, length, dtype=torch.bool)
    for b in range(batch):
        run, runs, previous = -1, [], 0
        for i in range(length):
            visual = bool(mask[b, i]) and int(types[b, i]) > 0
            if visual and previous == 0:
                run += 1
            runs.append(run if visual else -1)
            previous = int(types[b, i]) if mask[b, i] else previous
        for q in range(length):
            for k in range(length):
                if not mask[b, k]:
                    continue
                if runs[q] >= 0 and runs[q] == runs[k]:
                    out[b, q, k] = bool(pos[b, k] <= pos[b, q])
                else:
                    out[b, q, k] = k <= q
    return out


def test_cca_4x4_example_ids_and_mask():
    assert concentric_levels(4, 4).tolist() == naive_levels(4, 4) == [[0, 0, 0, 0], [0, 1, 1, 0], [0, 1, 1, 0], [0] * 4]
    types = torch.tensor([image_row(3, 4, 4, 2)])  # T T <vs> | 4 x 4 | <ve> T
    grid = torch.tensor([[1, 8, 8]])
    pos, delta = get_position_ids("cca", types, grid)
    levels = torch.tensor(naive_levels(4, 4)).flatten()
    assert (pos == pos[0]).all()  # one row broadcast
    assert pos[0, 0, :3].tolist() == [0, 1, 2] and torch.equal(pos[0, 0, 3:19], 3 + levels)
    assert pos[0, 0, 19:].tolist() == [5, 6] and delta.tolist() == [[7 - 21]]
    block = visible(cca_attention_mask(types, grid))[0, 3:19, 3:19]
    outer = levels == 0
    assert block[outer][:, outer].all() and not block[outer][:, ~outer].any()  # the 12 outer tokens see each other
    assert block[~outer].all()  # the 4 inner tokens see all 16


def test_cca_24x24_ring_histogram_and_occupancy():
    assert torch.bincount(concentric_levels(24, 24).flatten()).tolist() == [92 - 8 * r for r in range(12)]
    types = torch.tensor([image_row(5, 24, 24, 3)])
    pos, delta = get_position_ids("cca", types, torch.tensor([[1, 48, 48]]))
    visual = pos[0, 0, 5:581]
    assert torch.bincount(visual - 5).tolist() == [92 - 8 * r for r in range(12)]
    assert pos[0, 0, 581:].tolist() == [17, 18, 19]  # s + 12 + m: the image occupies 12 positions
    assert delta.item() == 20 - types.shape[1]  # decode at past_len - 576 + 12


@pytest.mark.parametrize("height, width", [(1, 5), (3, 5), (5, 3), (4, 7), (6, 2), (5, 5), (2, 9)])
def test_cca_non_square_grids_use_the_ring_rule(height, width):
    types = torch.tensor([image_row(2, height, width, 2)])
    pos, _ = get_position_ids("cca", types, torch.tensor([[1, 2 * height, 2 * width]]))
    rings = (min(height, width) + 1) // 2
    assert pos[0, 0, 2:-2].tolist() == [2 + c for row in naive_levels(height, width) for c in row]
    assert pos[0, 0, -2:].tolist() == [2 + rings, 3 + rings]
    assert concentric_levels(height, width).tolist() == naive_levels(height, width)


@pytest.mark.parametrize("padding", ["left", "right"])
def test_cca_mask_is_causal_outside_blocks_and_concentric_inside(padding):
    types, mask, image, video = random_batch(torch.Generator().manual_seed(3), 3, max_videos=1, padding=padding)
    pos, _ = get_position_ids("cca", types, image, video, mask)
    out = cca_attention_mask(types, image, video, mask, dtype=torch.bfloat16)
    assert out.shape == (3, 1, types.shape[1], types.shape[1]) and out.dtype == torch.bfloat16
    assert set(out.unique().tolist()) == {0.0, torch.finfo(torch.bfloat16).min}
    expected = naive_mask(types, mask, pos[0])
    assert torch.equal(visible(out), expected)
    # and the plain causal mask (keys valid) wherever a query or a key is text
    text = (types == 0)[:, :, None] | (types == 0)[:, None, :]
    causal = torch.ones_like(expected).tril() & mask.bool()[:, None, :]
    assert torch.equal(visible(out)[text], causal[text])
    assert not torch.equal(visible(out), causal)


def test_cca_video_frames_follow_each_other():
    # [visionpe] a video's frame t sits at s + t K + c; inside the block k is visible to q iff pos(k) <= pos(q)
    types = torch.tensor([[0] + [2] * 18 + [0]])  # a (2, 6, 6) video: two 3 x 3 frames, K = 2
    pos, _ = get_position_ids("cca", types, None, torch.tensor([[2, 6, 6]]))
    frame = [1 + c for row in naive_levels(3, 3) for c in row]
    assert pos[0, 0].tolist() == [0] + frame + [f + 2 for f in frame] + [5]
    seen = visible(cca_attention_mask(types, None, torch.tensor([[2, 6, 6]])))[0]
    assert seen[10:19, 1:10].all()  # the second frame sees the whole first one
    assert not seen[1:10, 10:19].any()  # and not the other way round


def test_cca_two_samples_with_different_offsets_equal_two_single_runs():
    # the released code resets its per-sample ids inside the batch loop (only the last sample's survive, only sample 0
    # gets the concentric mask); here every sample gets its own ids and mask
    rows = [image_row(35, 4, 6, 3), image_row(40, 3, 5, 2)]
    grids = torch.tensor([[1, 8, 12], [1, 6, 10]])
    length = max(map(len, rows))
    types = torch.zeros(2, length, dtype=torch.long)
    mask = torch.zeros_like(types)
    for b, row in enumerate(rows):
        types[b, length - len(row) :] = torch.tensor(row)
        mask[b, length - len(row) :] = 1
    pos, delta = get_position_ids("cca", types, grids, attention_mask=mask)
    out = cca_attention_mask(types, grids, attention_mask=mask)
    for b, row in enumerate(rows):
        single_pos, single_delta = get_position_ids("cca", torch.tensor([row]), grids[b : b + 1])
        single = cca_attention_mask(torch.tensor([row]), grids[b : b + 1])
        keep = mask[b].bool()
        assert torch.equal(pos[:, b, keep], single_pos[:, 0]) and torch.equal(delta[b], single_delta[0])
        assert torch.equal(out[b, 0][keep][:, keep], single[0, 0])
        assert (out[b, 0][:, ~keep] == torch.finfo(torch.float32).min).all()  # padded keys hidden from every query


def test_text_only_rows_get_the_causal_mask():
    types = torch.tensor([image_row(1, 2, 3, 1), [0] * 8])
    mask = torch.tensor([[1] * 8, [0, 0, 0] + [1] * 5])
    out = visible(cca_attention_mask(types, torch.tensor([[1, 4, 6]]), attention_mask=mask))
    assert torch.equal(out[1], torch.ones(8, 8, dtype=torch.bool).tril() & mask[1].bool())
    pos, _ = get_position_ids("cca", torch.zeros(2, 6, dtype=torch.long))
    assert torch.equal(pos, torch.arange(6).expand(3, 2, -1))


def test_hostile_inputs_name_the_argument():
    types = torch.tensor([image_row(1, 2, 2, 1)])
    with pytest.raises(ValueError, match=r"image_grid_thw\[0\] = \(1, 4, 3\) must be positive with h and w divisible"):
        cca_attention_mask(types, torch.tensor([[1, 4, 3]]))
    with pytest.raises(ValueError, match=r"image_grid_thw\[0\] = \(1, 0, 4\) must be positive"):
        cca_attention_mask(types, torch.tensor([[1, 0, 4]]))
    with pytest.raises(ValueError, match=r"image_grid_thw must have shape \(num, 3\)"):
        cca_attention_mask(types, torch.tensor([4, 4]))
    with pytest.raises(TypeError, match="image_grid_thw must hold integers"):
        pype_attention_mask(types, torch.tensor([[1.0, 4.0, 4.0]]))
    with pytest.raises(ValueError, match=r"image_grid_thw\[0\] = \(1, 4, 6\) needs 6 image tokens"):
        cca_attention_mask(types, torch.tensor([[1, 4, 6]]))
    with pytest.raises(ValueError, match="dtype must be a floating point torch.dtype, got torch.int64"):
        cca_attention_mask(types, torch.tensor([[1, 4, 4]]), dtype=torch.long)
    with pytest.raises(TypeError, match="dtype must be a floating point torch.dtype"):
        cca_attention_mask(types, torch.tensor([[1, 4, 4]]), dtype="float32")
    with pytest.raises(ValueError, match="height must be a positive int, got 0"):
        concentric_levels(0, 3)
    with pytest.raises(ValueError, match="interval must be a positive int"):
        get_position_ids("pype", types, torch.tensor([[1, 4, 4]]), interval=0)
    with pytest.raises(ValueError, match="layer must be a non-negative int, got -1"):
        pype_attention_mask(types, torch.tensor([[1, 4, 4]]), layer=-1, interval=2)
    with pytest.raises(ValueError, match="pype needs interval= .* to place layer 3"):
        get_position_ids("pype", types, torch.tensor([[1, 4, 4]]), layer=3)
    with pytest.raises(ValueError, match="cca got unknown option"):
        get_position_ids("cca", types, torch.tensor([[1, 4, 4]]), interval=2)


def test_pype_layer_0_is_cca_in_ids_and_mask():
    types, mask, image, video = random_batch(torch.Generator().manual_seed(5), 4, max_videos=1)
    cca = get_position_ids("cca", types, image, video, mask)
    for options in ({}, {"interval": 3, "layer": 0}):
        pype = get_position_ids("pype", types, image, video, mask, **options)
        assert all(torch.equal(a, b) for a, b in zip(pype, cca, strict=True))
    expected = cca_attention_mask(types, image, video, mask)
    assert torch.equal(pype_attention_mask(types, image, video, mask, layer=0, interval=2), expected)


def test_pype_24x24_schedule_with_interval_2():
    types = torch.tensor([image_row(4, 24, 24, 2)])
    grid = torch.tensor([[1, 48, 48]])
    levels = concentric_levels(24, 24).flatten()
    for layer in range(0, 30):
        rings = max(12 - layer // 2, 1)
        assert pype_num_levels(24, 24, layer, 2) == rings
        pos, delta = get_position_ids("pype", types, grid, interval=2, layer=layer)
        assert torch.equal(pos[0, 0, 4:580], 4 + levels.clamp(max=rings - 1))
        assert pos[0, 0, 580:].tolist() == [4 + rings, 5 + rings]
        assert delta.item() == types.shape[1] - 576 + rings - types.shape[1]  # decode at past_len - N + K(l)


def test_pype_6x6_example_with_interval_1():
    types = torch.tensor([image_row(1, 6, 6, 1)])
    grid = torch.tensor([[1, 12, 12]])
    ids = [get_position_ids("pype", types, grid, interval=1, layer=layer)[0][0, 0] for layer in range(4)]
    assert (ids[0][1:37] - 1).view(6, 6).tolist()[:3] == [[0] * 6, [0, 1, 1, 1, 1, 0], [0, 1, 2, 2, 1, 0]]
    assert torch.equal(ids[1][1:37] - 1, (ids[0][1:37] - 1).clamp(max=1))  # the centre merged into ring 1
    assert (ids[2][1:37] == 1).all() and torch.equal(ids[3], ids[2])
    assert [int(i[-1]) for i in ids] == [4, 3, 2, 2]  # text after: s + 3, s + 2, s + 1 (s = 1)
    everything = visible(pype_attention_mask(types, grid, layer=2, interval=1))[0, 1:37, 1:37]
    assert everything.all()  # K = 1: the visual tokens see each other
    ring = visible(pype_attention_mask(types, grid, layer=1, interval=1))[0, 1:37, 1:37]
    assert torch.equal(ring, naive_mask(types, torch.ones_like(types), ids[1][None])[0, 1:37, 1:37])


def test_registry_properties_of_the_layered_and_masked_schemes():
    cca, pype, circle = (get_multimodal_scheme(name) for name in ("cca", "pype", "circle_rope"))
    assert cca.block_mask and pype.block_mask and not circle.block_mask
    assert cca.layer_of is None and cca.allocation == pype.allocation == "single_axis"
    assert pype.required_options == ("interval",)
    assert [pype.layer_of(layer, {"interval": 2}) for layer in range(6)] == [0, 0, 2, 2, 4, 4]
    with pytest.raises(ValueError, match="pype needs interval="):
        pype.layer_of(1, {})
    assert [circle.layer_of(layer, {"age": True}) for layer in range(4)] == [0, 1, 0, 1]
    assert [circle.layer_of(layer, {}) for layer in range(4)] == [0, 0, 0, 0]


def test_circle_rope_age_alternates_circle_and_mrope_ids():
    types = torch.tensor([[0, 0] + [1] * 6 + [0, 0] + [1] * 4 + [0]])
    grids = torch.tensor([[1, 4, 6], [1, 4, 4]])
    circle, _ = get_position_ids("circle_rope", types, grids)
    mrope, _ = get_position_ids("mrope", types, grids)
    for layer in range(4):
        pos, _ = get_position_ids("circle_rope", types, grids, age=True, layer=layer)
        assert torch.equal(pos, mrope.to(pos.dtype) if layer % 2 else circle)
        assert torch.equal(get_position_ids("circle_rope", types, grids, layer=layer)[0], circle)  # without AGE
    with pytest.raises(TypeError, match="age must be a bool"):
        get_position_ids("circle_rope", types, grids, age=1)
