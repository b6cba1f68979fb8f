"""RoPE-DHR, BiPE, PPE (with occupancy compression) and Circle-RoPE's image_shift=0."""

import math

import numpy as np
import pytest
import torch

from visionpe.multimodal import (
    MultimodalRotary,
    PPERotary,
    apply_multimodal_rotary,
    bipe_side_index,
    build_allocation,
    get_position_ids,
)

from .helpers import random_batch

TILE = 256  # 16 x 16 merged tokens per InternVL tile: pre-merge grid 32 x 32 with spatial_merge_size 2


def dhr(types, grids, tile_grid=None, **kw):
    pos, delta = get_position_ids("rope_dhr", types, torch.tensor(grids), tile_grid=tile_grid, **kw)
    assert torch.equal(pos[0], pos[1]) and torch.equal(pos[0], pos[2]) and pos.dtype == torch.long
    return pos[0], delta


def official_dhr(x_tiles, y_tiles, bias=0):
    """The released calculate_subimage_indices (16 x 16 tiles), written out with numpy as in the paper's code."""
    out = []
    if x_tiles > 1 or y_tiles > 1:
        w, h = 16 / x_tiles - 1e-6, 16 / y_tiles - 1e-6
        for i in range(x_tiles):
            for j in range(y_tiles):
                ys = np.linspace(j * h, (j + 1) * h, 16)
                xs = np.linspace(i * w, (i + 1) * w, 16)
                out += [int(r) * 16 + int(c) + bias for r in ys for c in xs]
    return out + list(range(bias, bias + 256))


def per_row(types, mask, image, video):
    """Each sample without its padding, with the grids it consumes: (row (1, n), image grids, video grids)."""
    out, image_i, video_i = [], 0, 0
    for b in range(types.shape[0]):
        row = types[b, mask[b].bool()][None]
        grids = []
        for kind, grid, start in ((1, image, image_i), (2, video, video_i)):
            need, taken = int((row == kind).sum()), []
            while need > 0:
                taken.append(grid[start + len(taken)])
                need -= int(taken[-1].prod()) // 4
            grids.append(torch.stack(taken) if taken else None)
        image_i += 0 if grids[0] is None else len(grids[0])
        video_i += 0 if grids[1] is None else len(grids[1])
        out.append((row, *grids))
    return out


# ----------------------------------------------------------------------------------------------------- RoPE-DHR
def test_rope_dhr_two_tiles_side_by_side_golden():
    types = torch.tensor([[0] + [1] * (3 * TILE) + [0]])  # <img> | tile 0, tile 1, thumbnail | </img>
    pos, delta = dhr(types, [[3, 32, 32]], tile_grid=torch.tensor([[2, 1]]))
    ids = (pos[0, 1:-1] - 1).tolist()  # p = 1
    assert ids[:16] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]  # tile 0, row 0
    assert ids[TILE : TILE + 16] == [7, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15]  # tile 1, row 0
    assert ids[16:20] == [16, 16, 17, 17]  # tile 0, row 1
    assert ids[2 * TILE :] == list(range(TILE))  # the thumbnail
    assert pos[0, -1] == 1 + TILE and delta.tolist() == [[1 + TILE + 1 - (3 * TILE + 2)]]


@pytest.mark.parametrize(
    "order, expected",
    [
        ("official", [(0, 119), (112, 247), (7, 127), (119, 255), (0, 255)]),
        ("row_major", [(0, 119), (7, 127), (112, 247), (119, 255), (0, 255)]),
    ],
)
def test_rope_dhr_2x2_first_and_last_id_per_tile(order, expected):
    pos, _ = dhr(torch.ones(1, 5 * TILE, dtype=torch.long), [[5, 32, 32]], [[2, 2]], tile_order=order)
    assert [(int(pos[0, t * TILE]), int(pos[0, (t + 1) * TILE - 1])) for t in range(5)] == expected


@pytest.mark.parametrize("tiles", [(3, 2), (1, 3), (4, 1)])
def test_rope_dhr_equals_the_released_index_function(tiles):
    x, y = tiles
    n = (x * y + 1) * TILE
    types = torch.tensor([[0, 0, 0] + [1] * n + [0]])
    pos, _ = dhr(types, [[x * y + 1, 32, 32]], [[x, y]])
    assert pos[0, 3:-1].tolist() == official_dhr(x, y, bias=3)
    # row_major: tile k (row-major) covers column k % X, row k // X: its first token sits at that corner
    pos, _ = dhr(types, [[x * y + 1, 32, 32]], [[x, y]], tile_order="row_major")
    corners = [pos[0, 3 + k * TILE].item() - 3 for k in range(x * y)]
    w, h = 16 / x - 1e-6, 16 / y - 1e-6
    assert corners == [16 * math.floor((k // x) * h) + math.floor((k % x) * w) for k in range(x * y)]


def test_rope_dhr_untiled_is_arange_and_later_images_start_lower():
    types = torch.tensor([[0] + [1] * 6 + [0, 0]])
    for tile_grid in (None, [[1, 1]]):
        pos, _ = dhr(types, [[1, 4, 6]], tile_grid)
        assert pos[0].tolist() == list(range(9))
    # a 2 x 1 tiled image (3 tiles of 256 tokens), text, an untiled image, text: the second image starts 2 * 256
    # ids lower than under 1-D RoPE (the dense arange), and so does everything after it
    types = torch.tensor([[0] + [1] * (3 * TILE) + [0, 0] + [1] * TILE + [0]])
    pos, delta = dhr(types, [[3, 32, 32], [1, 32, 32]], [[2, 1], [1, 1]])
    second = 1 + 3 * TILE + 2
    assert pos[0, second] == second - 2 * TILE
    assert pos[0, second:].tolist() == list(range(second - 2 * TILE, types.shape[1] - 2 * TILE))
    assert delta.tolist() == [[-2 * TILE]]
    # videos have no tiles: plain 1-D ids
    video, _ = get_position_ids("rope_dhr", torch.tensor([[0] + [2] * 8 + [0]]), None, torch.tensor([[2, 4, 4]]))
    assert video[0, 0].tolist() == list(range(10))


def test_rope_dhr_batched_with_padding_equals_per_row():
    rows = [[0] + [1] * (3 * TILE) + [0], [0, 0] + [1] * (5 * TILE) + [0, 0, 0]]
    grids, tiles = [[3, 32, 32], [5, 32, 32]], [[1, 2], [2, 2]]
    length = max(map(len, rows))
    for padding in ("left", "right"):
        types = torch.zeros(2, length, dtype=torch.long)
        mask = torch.zeros(2, length, dtype=torch.long)
        for b, row in enumerate(rows):
            sl = slice(length - len(row), None) if padding == "left" else slice(0, len(row))
            types[b, sl], mask[b, sl] = torch.tensor(row), 1
        pos, delta = get_position_ids("rope_dhr", types, torch.tensor(grids), attention_mask=mask, tile_grid=tiles)
        for b, row in enumerate(rows):
            single, single_delta = dhr(torch.tensor([row]), [grids[b]], [tiles[b]])
            assert torch.equal(pos[0, b, mask[b].bool()], single[0]) and delta[b] == single_delta[0]


def test_rope_dhr_bad_inputs():
    types = torch.ones(1, 3 * TILE, dtype=torch.long)
    grid = torch.tensor([[3, 32, 32]])
    with pytest.raises(ValueError, match=r"tile_grid\[0\] = \(2, 2\) needs image_grid_thw\[0\] to hold 5 tiles.*t = 3"):
        get_position_ids("rope_dhr", types, grid, tile_grid=[[2, 2]])
    with pytest.raises(ValueError, match=r"tile_grid must have shape \(num_images, 2\) = \(1, 2\).*got \(2, 2\)"):
        get_position_ids("rope_dhr", types, grid, tile_grid=[[2, 1], [1, 1]])
    with pytest.raises(ValueError, match=r"tile_grid\[0\] must be two positive ints.*\[0, 2\]"):
        get_position_ids("rope_dhr", types, grid, tile_grid=[[0, 2]])
    with pytest.raises(TypeError, match="tile_grid must hold integers"):
        get_position_ids("rope_dhr", types, grid, tile_grid=[[2.0, 1.0]])
    with pytest.raises(ValueError, match="tile_order must be one of"):
        get_position_ids("rope_dhr", types, grid, tile_grid=[[2, 1]], tile_order="column")


# --------------------------------------------------------------------------------------------------------- BiPE
SENTENCE = torch.tensor([[5, 6, 869, 7, 8, 13, 9]])  # a b . c d \n e (Llama ids of "." and "\n")


def test_bipe_text_golden():
    types = torch.zeros(1, 7, dtype=torch.long)
    side = bipe_side_index(types, input_ids=SENTENCE)
    assert side.intra.tolist() == [[0, 1, 2, 0, 1, 2, 0]]
    assert side.inter.tolist() == [[0, 0, 0, 1, 1, 1, 2]]
    pos, delta = get_position_ids("bipe", types, input_ids=SENTENCE)
    assert torch.equal(pos, side.inter.expand(3, -1, -1)) and pos.dtype == torch.long
    assert delta.tolist() == [[2 - 7]]  # "e" leaves its sentence open: the next token continues it at 2
    # other separators; no input ids: every text token is its own segment (plain 1-D ids)
    assert bipe_side_index(types, input_ids=SENTENCE, separator_ids=[6]).inter.tolist() == [[0, 0, 1, 1, 1, 1, 1]]
    free = bipe_side_index(types)
    assert free.inter.tolist() == [list(range(7))] and free.intra.tolist() == [[0] * 7]


def test_bipe_images_and_frames_are_segments():
    # a b | 2x3 image | c . | video of 2 frames of 2x2 | d
    types = torch.tensor([[0, 0] + [1] * 6 + [0, 0] + [2] * 8 + [0]])
    ids = torch.tensor([[5, 6] + [0] * 6 + [7, 869] + [0] * 8 + [9]])
    side = bipe_side_index(types, torch.tensor([[1, 4, 6]]), torch.tensor([[2, 4, 4]]), input_ids=ids)
    assert side.inter.tolist() == [[0, 0] + [1] * 6 + [2, 2] + [3] * 4 + [4] * 4 + [5]]
    assert side.intra.tolist() == [[0, 1, *range(6), 0, 1, *range(4), *range(4), 0]]
    assert side.visual_row.tolist() == [[-1, -1, 0, 0, 0, 1, 1, 1, -1, -1] + [0, 0, 1, 1] * 2 + [-1]]
    assert side.visual_col.tolist() == [[-1, -1, 0, 1, 2, 0, 1, 2, -1, -1] + [0, 1, 0, 1] * 2 + [-1]]
    assert side.is_visual.tolist() == [(types[0] > 0).tolist()]
    pos, _ = get_position_ids("bipe", types, torch.tensor([[1, 4, 6]]), torch.tensor([[2, 4, 4]]), input_ids=ids)
    assert torch.equal(pos[0], side.inter)
    # a separator right before the image: the image does not open another segment
    ids[0, 1] = 13
    assert bipe_side_index(types, torch.tensor([[1, 4, 6]]), torch.tensor([[2, 4, 4]]), input_ids=ids).inter[
        0, :3
    ].tolist() == [0, 0, 1]


def test_bipe_intra_clipped_and_padding_invariant():
    long = torch.zeros(1, 1100, dtype=torch.long)
    side = bipe_side_index(long, input_ids=torch.full((1, 1100), 5))
    assert side.intra[0, :1024].tolist() == list(range(1024)) and (side.intra[0, 1024:] == 1023).all()
    assert bipe_side_index(long[:, :9], input_ids=torch.full((1, 9), 5), max_intra=4).intra.tolist() == [
        [0, 1, 2, 3, 3, 3, 3, 3, 3]
    ]
    # left/right padding and a batch give the per-row indices
    for padding in ("left", "right"):
        types, mask, image, video = random_batch(torch.Generator().manual_seed(3), 3, max_videos=1, padding=padding)
        ids = torch.randint(0, 4, types.shape, generator=torch.Generator().manual_seed(4)) + 11  # 13: separator
        batch = bipe_side_index(types, image, video, mask, input_ids=ids)
        pos, delta = get_position_ids("bipe", types, image, video, mask, input_ids=ids)
        assert torch.equal(pos[0], batch.inter)
        for b, (row, *grids) in enumerate(per_row(types, mask, image, video)):
            keep = mask[b].bool()
            one = bipe_side_index(row, *grids, input_ids=ids[b, keep][None])
            assert torch.equal(batch.inter[b, keep], one.inter[0]) and torch.equal(batch.intra[b, keep], one.intra[0])
            _, one_delta = get_position_ids("bipe", row, *grids, input_ids=ids[b, keep][None])
            assert delta[b] == one_delta[0]
            assert (batch.intra[b, ~keep] == 0).all() and (batch.inter[b, ~keep] == 1).all()


def test_bipe_next_id_after_a_separator_and_bad_inputs():
    types = torch.zeros(1, 3, dtype=torch.long)
    _, delta = get_position_ids("bipe", types, input_ids=torch.tensor([[5, 6, 13]]))
    assert delta.tolist() == [[1 - 3]]  # the separator closed the sentence: the next token starts segment 1
    # the next token sits at n_valid + delta, as a one-shot prefill of the longer sequence gives it
    for prompt in ([5, 6, 13], [5, 13, 6]):
        _, delta = get_position_ids("bipe", types, input_ids=torch.tensor([prompt]))
        longer, _ = get_position_ids(
            "bipe", torch.zeros(1, 4, dtype=torch.long), input_ids=torch.tensor([prompt + [7]])
        )
        assert longer[0, 0, -1] == 3 + delta[0, 0]
    with pytest.raises(ValueError, match=r"separator_ids must be a non-empty list or tuple of non-negative int.*13\.0"):
        get_position_ids("bipe", types, input_ids=SENTENCE[:, :3], separator_ids=[13.0])
    with pytest.raises(ValueError, match="separator_ids must be .*got '.'"):
        get_position_ids("bipe", types, input_ids=SENTENCE[:, :3], separator_ids=".")
    with pytest.raises(ValueError, match=r"input_ids must have the shape of token_type_ids \(1, 3\), got \(1, 7\)"):
        get_position_ids("bipe", types, input_ids=SENTENCE)
    with pytest.raises(ValueError, match="input_ids must be a .* integer tensor"):
        get_position_ids("bipe", types, input_ids=SENTENCE[:, :3].float())
    with pytest.raises(ValueError, match="max_intra must be a positive int, got 0"):
        bipe_side_index(types, max_intra=0)


# ---------------------------------------------------------------------------------------------------------- PPE
def test_ppe_singletons_equal_dense_mrope():
    types, mask, image, video = random_batch(torch.Generator().manual_seed(0), batch_size=3, max_videos=2)
    dense, dense_delta = get_position_ids("mrope", types, image, video, mask)
    singletons = torch.arange(types.numel()).view(types.shape)
    for clusters in (None, singletons):
        pos, delta = get_position_ids("ppe", types, image, video, mask, clusters=clusters)
        assert torch.equal(pos, dense) and torch.equal(delta, dense_delta)
        pos, delta = get_position_ids("ppe", types, image, video, mask, clusters=clusters, num_representatives=8)
        assert pos.shape == (24, *types.shape)
        assert torch.equal(pos, dense.repeat_interleave(8, dim=0)) and torch.equal(delta, dense_delta)
    # Qwen2.5-VL's absolute time as the base
    spg = torch.ones(0 if video is None else len(video))
    abs_time, _ = get_position_ids("mrope_abs_time", types, image, video, mask, second_per_grid_ts=spg)
    assert torch.equal(get_position_ids("ppe", types, image, video, mask, second_per_grid_ts=spg)[0], abs_time)


def test_ppe_clusters_batched_with_padding_equal_per_row():
    for padding in ("left", "right"):
        types, mask, image, video = random_batch(torch.Generator().manual_seed(5), 3, max_videos=2, padding=padding)
        gen = torch.Generator().manual_seed(6)
        clusters, weights = torch.randint(0, 4, types.shape, generator=gen), torch.rand(types.shape, generator=gen)
        for kw in ({}, {"representatives": "topk_weight", "weights": weights}, {"occupancy": 3}):
            pos, delta = get_position_ids(
                "ppe", types, image, video, mask, clusters=clusters, num_representatives=3, **kw
            )
            for b, (row, *grids) in enumerate(per_row(types, mask, image, video)):
                keep = mask[b].bool()
                one_kw = {k: (v[b, keep][None] if k == "weights" else v) for k, v in kw.items()}
                one, one_delta = get_position_ids(
                    "ppe", row, *grids, clusters=clusters[b, keep][None], num_representatives=3, **one_kw
                )
                assert torch.equal(pos[:, b, keep], one[:, 0]) and delta[b] == one_delta[0]


def test_ppe_rotary_with_one_representative_is_mrope():
    pos = torch.randint(0, 500, (3, 2, 7))
    cos, sin = PPERotary(64, base=1e4, num_representatives=1, mrope_section=(8, 12, 12))(pos)
    ref_cos, ref_sin = MultimodalRotary(64, base=1e4, allocation="chunked", mrope_section=(8, 12, 12))(pos)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_ppe_split_allocation_index_sets():
    rows = build_allocation("ppe_split", num_pairs=64, num_representatives=8).axis_of()
    assert rows[:16] == [n // 2 for n in range(16)]  # t of representative n // 2
    assert rows[16:40] == [8 + (n - 16) // 3 for n in range(16, 40)]  # h of representative (n - 16) // 3
    assert rows[40:] == [16 + (n - 40) // 3 for n in range(40, 64)]  # w of representative (n - 40) // 3
    # K does not divide the sections: one-pair sections, pair n reads row n mod 3K (K = 32: no w pair at all)
    assert build_allocation("ppe_split", num_pairs=64, num_representatives=32).axis_of() == list(range(64))
    assert build_allocation("ppe_split", num_pairs=64, num_representatives=5).axis_of() == [n % 15 for n in range(64)]
    assert torch.equal(
        build_allocation("ppe_split", num_pairs=64, num_representatives=1).mix,
        build_allocation("chunked", num_pairs=64).mix,
    )
    with pytest.raises(ValueError, match="num_representatives must be a positive int, got 0"):
        build_allocation("ppe_split", num_pairs=64, num_representatives=0)
    with pytest.raises(ValueError, match=r"must be \(P, 3\).*got \(64, 24\).*PPERotary"):
        MultimodalRotary(128, allocation=build_allocation("ppe_split", num_pairs=64, num_representatives=8))


def test_ppe_representatives_last_cycles_and_topk_weight():
    # one 1 x 8 image (pre-merge 2 x 16); cluster 0 = tokens 1, 4, 6; every other token its own cluster
    types = torch.tensor([[0] + [1] * 8 + [0]])
    clusters = torch.tensor([[0, 1, 0, 2, 3, 0, 4, 0, 5, 0]])
    pos, _ = get_position_ids("ppe", types, torch.tensor([[1, 2, 16]]), clusters=clusters, num_representatives=5)
    w_rows = pos[10:15, 0] - 1  # w of the 5 representatives, minus the block start: the member's column
    for token in range(8):  # sequence position 1 + token; cluster 0 holds image tokens 1, 4 and 6
        # members from the highest index down, cycling (n = 3, K = 5); singletons repeat themselves
        expected = [6, 4, 1, 6, 4] if token in (1, 4, 6) else [token] * 5
        assert w_rows[:, 1 + token].tolist() == expected
    weights = torch.tensor([[0, 0, 0.5, 0, 0, 0.9, 0, 0.1, 0, 0]])  # members 1, 4, 6 at positions 2, 5, 7
    pos, _ = get_position_ids(
        "ppe",
        types,
        torch.tensor([[1, 2, 16]]),
        clusters=clusters,
        num_representatives=4,
        representatives="topk_weight",
        weights=weights,
    )
    assert (pos[8:12, 0, 1 + 1] - 1).tolist() == [4, 1, 6, 4]  # weight 0.9, 0.5, 0.1, then cycling


def test_ppe_score_is_the_sum_of_per_subband_scores():
    """<R(p_i) q, R(p_j) k> under the split allocation = sum over sub-bands (axis a, representative r) of the
    rotary score of that band's pairs at positions p[a K + r], written out with complex numbers."""
    k_reps, head_dim, base = 8, 128, 1e4
    types = torch.tensor([[0, 0] + [1] * 12 + [0, 0]])
    gen = torch.Generator().manual_seed(0)
    clusters = torch.randint(0, 3, types.shape, generator=gen)
    pos, _ = get_position_ids("ppe", types, torch.tensor([[1, 6, 8]]), clusters=clusters, num_representatives=k_reps)
    assert not torch.equal(pos[2 * k_reps], pos[3 * k_reps - 1])  # representatives differ (w rows)
    rotary = PPERotary(head_dim, base=base, num_representatives=k_reps)
    cos, sin = rotary(pos)
    q, k = torch.randn(1, 1, 16, head_dim, generator=gen), torch.randn(1, 1, 16, head_dim, generator=gen)
    rq, rk = apply_multimodal_rotary(q, k, cos, sin)
    score = (rq[0, 0] @ rk[0, 0].T).double()
    half = head_dim // 2
    theta = base ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)
    zq = torch.complex(q[0, 0, :, :half].double(), q[0, 0, :, half:].double())  # pair n = channels n, n + D/2
    zk = torch.complex(k[0, 0, :, :half].double(), k[0, 0, :, half:].double())
    expected = torch.zeros(16, 16, dtype=torch.float64)
    bands = [(0, range(0, 16), 2), (1, range(16, 40), 3), (2, range(40, 64), 3)]  # (axis, pairs, sub-band width)
    for axis, pairs, width in bands:
        for r in range(k_reps):
            band = list(pairs)[r * width : (r + 1) * width]
            p = pos[axis * k_reps + r, 0].double()  # representative r's coordinate on this axis
            phase = torch.exp(1j * theta[band] * (p[:, None, None] - p[None, :, None]))
            expected += (zq[:, None, band] * zk[None, :, band].conj() * phase).real.sum(-1)
    torch.testing.assert_close(score, expected, rtol=0, atol=2e-4)
    with pytest.raises(ValueError, match=r"position_ids must be \(3K, B, L\) = \(24, B, L\) for K = 8"):
        rotary(pos[:4])


def test_ppe_occupancy_compresses_the_block():
    types = torch.tensor([[0] + [1] * 64 + [0, 0]])  # an 8 x 8 merged image
    grid = torch.tensor([[1, 16, 16]])
    pos, delta = get_position_ids("ppe", types, grid, occupancy=4)
    assert pos[0, 0].tolist() == [0] + [1 + i // 16 for i in range(64)] + [5, 6] and torch.equal(pos[0], pos[2])
    assert delta.tolist() == [[7 - 67]]
    assert get_position_ids("ppe", types, grid, occupancy=64)[0][0, 0].tolist() == list(range(67))
    one, _ = get_position_ids("ppe", types, grid, occupancy=1)
    assert one[0, 0].tolist() == [0] + [1] * 64 + [2, 3]
    assert torch.equal(
        get_position_ids("ppe", types, grid, occupancy=1000)[0],
        get_position_ids("v2pe", types, grid, delta=1.0)[0].long(),
    )


def test_ppe_bad_inputs():
    types, grid = torch.tensor([[0, 1, 1, 0]]), torch.tensor([[1, 2, 4]])
    with pytest.raises(ValueError, match="num_representatives must be a positive int, got 0"):
        get_position_ids("ppe", types, grid, num_representatives=0)
    with pytest.raises(ValueError, match="representatives must be one of"):
        get_position_ids("ppe", types, grid, representatives="first")
    with pytest.raises(ValueError, match="representatives='topk_weight' needs weights"):
        get_position_ids("ppe", types, grid, clusters=torch.zeros_like(types), representatives="topk_weight")
    with pytest.raises(ValueError, match="weights are read by representatives='topk_weight' only"):
        get_position_ids("ppe", types, grid, clusters=torch.zeros_like(types), weights=torch.ones(1, 4))
    with pytest.raises(ValueError, match="clusters must be a non-negative cluster id.*-1 in sample 0 at position 2"):
        get_position_ids("ppe", types, grid, clusters=torch.tensor([[0, 0, -1, 0]]))
    with pytest.raises(ValueError, match=r"clusters must have the shape of token_type_ids \(1, 4\), got \(4,\)"):
        get_position_ids("ppe", types, grid, clusters=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="occupancy must be a positive int or None, got 0"):
        get_position_ids("ppe", types, grid, occupancy=0)


# ---------------------------------------------------------------------------------------------------- Circle-RoPE
def test_circle_rope_image_shift_zero_places_later_images_as_the_first():
    types = torch.tensor([[0] + [1] * 6 + [0, 0] + [1] * 6 + [0]])
    grids = torch.tensor([[1, 4, 6], [1, 4, 6]])

    def relative(**kw):
        pos, _ = get_position_ids("circle_rope", types, grids, **kw)
        first = pos[:, 0, 1:7] - (pos[:, 0, 0:1] + 1)  # minus each block's start cursor
        second = pos[:, 0, 9:15] - (pos[:, 0, 8:9] + 1)
        return first, second

    first, second = relative(image_shift=0.0)
    torch.testing.assert_close(second, first, rtol=0, atol=1e-12)
    first, second = relative()  # the paper's default: the second image one step further along (1, 1, 1)
    torch.testing.assert_close(second - first, torch.ones_like(first), rtol=0, atol=1e-12)
