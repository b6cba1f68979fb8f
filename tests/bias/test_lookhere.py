import math
import re

import pytest
import timm
import torch

import visionpe  # noqa: F401  (registers the models)
from visionpe.bias.lookhere import LookHere, lookhere_fov_masks, lookhere_heads


def test_head_layout_and_slopes_vit_b():
    directions, slopes = lookhere_heads(12)
    assert directions[:8] == [0.0, 90.0, 180.0, 270.0, 45.0, 135.0, 225.0, 315.0]
    assert directions[8:] == [None] * 4
    assert slopes == [0.5] * 4 + [0.25] * 4 + [1 / 2, 1 / 8, 1 / 32, 1 / 128]
    assert lookhere_heads(12, undirected_slopes="released")[1][8:] == [1 / 4, 1 / 16, 1 / 64, 1 / 256]
    lh = LookHere(768, 12, depth=12)
    torch.testing.assert_close(lh.layer_slopes, torch.linspace(1.5, 0.5, 12))


@pytest.mark.parametrize(
    "variant, fov, views", [("180", 180.0, [0, 2]), ("90", 90.0, [0, 1, 2, 3]), ("45", 45.0, list(range(8)))]
)
def test_fields_of_view_cover_every_key(variant, fov, views):
    directions, _ = lookhere_heads(12, variant)
    masks = lookhere_fov_masks((5, 7), [directions[h] for h in views], fov)
    assert masks.any(0).all()  # every key is seen from every query by some view
    assert masks.diagonal(dim1=1, dim2=2).all()  # a token always sees itself
    assert not masks.all(dim=(1, 2)).any()  # directed views are not full


def test_field_of_view_directions_on_non_square_grid():
    # grid (3, 5); query at row 1, col 2 (token 7); y points down
    right, down = lookhere_fov_masks((3, 5), [0.0, 90.0], 90.0)
    query = 7
    assert right[query].reshape(3, 5)[1, 4] and not right[query].reshape(3, 5)[1, 0]
    assert down[query].reshape(3, 5)[2, 2] and not down[query].reshape(3, 5)[0, 2]
    # LH-90 quadrant boundaries are the diagonals, and boundary rays are included in both neighbours
    assert right[query].reshape(3, 5)[2, 3] and down[query].reshape(3, 5)[2, 3]


def _released_masks(grid: tuple[int, int]) -> dict[str, list[torch.Tensor]]:
    """The released code's directed views as closed sets of offsets (dx, dy) = p_j - p_i, y down, boundary rays
    included: half-planes, the 90-degree triangles around an axis, and their intersections (corners, eighths), in
    visionpe's default head order (right, down, left, up; then down-right, down-left, up-left, up-right)."""
    rows, cols = grid
    y, x = torch.arange(rows * cols) // cols, torch.arange(rows * cols) % cols
    dy, dx = y[None] - y[:, None], x[None] - x[:, None]
    half = {"right": dx >= 0, "down": dy >= 0, "left": dx <= 0, "up": dy <= 0}
    tri = {"right": dy.abs() <= dx, "down": dx.abs() <= dy, "left": dy.abs() <= -dx, "up": dx.abs() <= -dy}
    axes, corners = (
        ("right", "down", "left", "up"),
        (("down", "right"), ("down", "left"), ("up", "left"), ("up", "right")),
    )
    return {
        "180": [half[a] for a in axes] + [tri[a] | tri[b] for a, b in corners],  # halves, then diagonals
        "90": [tri[a] for a in axes] + [half[a] & half[b] for a, b in corners],  # triangles, then corners
        # each LH-90 triangle cut in two along its axis: -22.5 / 22.5 around right, 67.5 / 112.5 around down, ...
        "45": [
            tri["right"] & half["up"],
            tri["right"] & half["down"],
            tri["down"] & half["right"],
            tri["down"] & half["left"],
            tri["left"] & half["down"],
            tri["left"] & half["up"],
            tri["up"] & half["left"],
            tri["up"] & half["right"],
        ],
    }


@pytest.mark.parametrize("variant, fov", [("180", 180.0), ("90", 90.0), ("45", 45.0)])
def test_default_views_are_the_released_masks_boundaries_included(variant, fov):
    grid = (5, 7)  # non-square, so that every ray crosses cells at several offsets
    directions, _ = lookhere_heads(12, variant)
    masks = lookhere_fov_masks(grid, directions[:8], fov)
    for head, expected in enumerate(_released_masks(grid)[variant]):
        assert torch.equal(masks[head], expected), (variant, head, directions[head])


def test_bias_values_prefix_and_undirected_heads():
    lh = LookHere(72, 6, depth=4, global_slope=0.8)
    state = lh.prepare((4, 6), 1)
    q = torch.zeros(1, 6, 25, 12)
    bias = lh.attn_bias(q, q, state, layer=2)[0]
    assert bias.shape == (6, 25, 25)
    assert (bias[:, 0, :] == 0).all() and (bias[:, :, 0] == 0).all()
    directions, slopes = lookhere_heads(6)
    for h, direction in enumerate(directions):
        if direction is None:
            assert torch.isfinite(bias[h]).all()
        else:
            assert torch.isinf(bias[h]).any()
    # head 0 looks right: from (0, 0) to (0, 3) the penalty is s_g * s_l(2) * s_h * 3
    s_l = torch.linspace(1.5, 0.5, 4)[2]
    torch.testing.assert_close(bias[0, 1, 1 + 3], -0.8 * s_l * slopes[0] * 3)
    assert bias[0, 1 + 3, 1] == float("-inf")  # looking left is outside its view
    lh.global_slope = 0.5  # test-time knob
    torch.testing.assert_close(lh.attn_bias(q, q, state, 2)[0, 0, 1, 4], -0.5 * s_l * slopes[0] * 3)


def test_state_is_linear_in_tokens_at_large_grids_bias_in_activation_dtype():
    lh = LookHere(384, 6, depth=12)
    n = 32 * 32 + 1
    state = lh.prepare((32, 32), 1)  # above full_state_max_tokens: one value per head and grid offset
    assert state.index is None and state.penalty.shape == (6, 63 * 63 + 1)
    assert state.penalty.dtype == torch.float32
    small = lh.prepare((8, 8), 1)  # small grids also cache the (N, N) offset index
    assert small.index.shape == (65, 65) and small.index.dtype == torch.int32
    assert all(b.numel() <= 12 for b in lh.buffers())  # nothing precomputed per resolution
    q = torch.zeros(1, 6, n, 64, dtype=torch.bfloat16)
    assert lh.attn_bias(q, q, state, 3).dtype == torch.bfloat16


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="variant"):
        LookHere(36, 3, variant="30")
    with pytest.raises(ValueError, match="global_slope"):
        LookHere(36, 3, global_slope=0.0)
    with pytest.raises(ValueError, match="undirected_slopes"):
        LookHere(36, 3, undirected_slopes="other")
    lh = LookHere(36, 3)
    with pytest.raises(ValueError, match="2D grids"):
        lh.prepare((2, 3, 4), 1)
    state = lh.prepare((3, 4), 1)
    with pytest.raises(ValueError, match="q and k must have shape"):
        lh.attn_bias(torch.zeros(1, 3, 12, 12), torch.zeros(1, 3, 12, 12), state, 0)
    with pytest.raises(ValueError, match="fov"):
        lookhere_fov_masks((3, 4), [0.0], 0.0)
    for depth in (0, -1, 2.5, True, "2"):
        with pytest.raises(
            (TypeError, ValueError), match=rf"depth must be a positive int, got .*{re.escape(repr(depth))}"
        ):
            LookHere(36, 3, depth=depth)


@pytest.mark.parametrize("size", [(224, 224), (384, 384), (160, 224)])
@pytest.mark.parametrize("bf16", [False, True])
def test_model_forward_backward(size, bf16):
    torch.manual_seed(0)
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224",
        pos_embed="lookhere",
        dynamic_img_size=True,
        depth=2,
        pos_embed_kwargs={"variant": "90"},
    )
    x = torch.randn(1, 3, *size, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(x)
    assert out.shape == (1, 1000) and torch.isfinite(out).all()
    out.float().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert not list(model.pos_schemes.parameters())  # nothing learned


def test_checkpoint_head_layout_overrides_the_defaults():
    """A released checkpoint's own head order and slopes: per-head directions and s_h given explicitly."""
    q = torch.zeros(1, 12, 13, 8)
    default = LookHere(96, 12, variant="90")
    state = default.prepare((3, 4), 1)
    # LH-90 as trained with s_h = 1/2 for all eight directed heads (the default gives 1/4 to the intercardinal ones)
    slopes = [0.5] * 8 + default.head_slopes[8:].tolist()
    half = LookHere(96, 12, variant="90", head_slopes=slopes)
    assert half.directions == default.directions
    ref, got = default.attn_bias(q, q, state, 0), half.attn_bias(q, q, state, 0)
    torch.testing.assert_close(got[:, :4], ref[:, :4])
    finite = torch.isfinite(ref[:, 4:8])
    assert torch.equal(finite, torch.isfinite(got[:, 4:8]))
    torch.testing.assert_close(got[:, 4:8][finite], 2 * ref[:, 4:8][finite])
    # another head order: the same views and slopes, permuted
    order = [3, 2, 1, 0, 7, 6, 5, 4, 8, 9, 10, 11]
    permuted = LookHere(
        96,
        12,
        variant="90",
        directions=[default.directions[h] for h in order],
        head_slopes=[float(default.head_slopes[h]) for h in order],
    )
    torch.testing.assert_close(permuted.attn_bias(q, q, permuted.prepare((3, 4), 1), 0), ref[:, order])
    for kwargs, match in (
        ({"directions": [0.0] * 11}, "directions must list one angle"),
        ({"directions": [0.0] * 11 + ["up"]}, "directions must be a list of angles"),
        ({"head_slopes": [0.5] * 13}, "head_slopes must list one slope per head"),
        ({"head_slopes": [0.5] * 11 + [0.0]}, r"head_slopes\[11\] must be a positive finite number"),
    ):
        with pytest.raises(ValueError, match=match):
            LookHere(96, 12, variant="90", **kwargs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_directions_are_refused(bad):
    # audit: NaN hid every patch from the head (itself included); inf gave "math domain error"
    for h in (0, 5):
        directions = [0.0] * 6
        directions[h] = bad
        with pytest.raises(ValueError, match=rf"directions\[{h}\] must be a finite angle in degrees .*got {bad!r}"):
            LookHere(48, 6, directions=directions)
        with pytest.raises(ValueError, match=rf"directions\[{h}\] must be a finite angle"):
            lookhere_fov_masks((3, 5), directions, fov=90.0)


@pytest.mark.parametrize("fov", [45.0, 90.0, 180.0, 270.0])
def test_a_token_always_sees_itself_whatever_the_view_test_gives(fov):
    """The paper's field of view: FOV_h(i) = {j : j = i or angle(p_j - p_i, u_h) <= FOV/2}. j = i is in by
    definition, not through the angle test (0 >= 0), which a NaN direction fails; the half-plane branch needs the
    term like the sectors."""
    from visionpe.bias.lookhere import _fov_mask, _offsets

    dy, dx = _offsets((3, 5), None)
    mask = _fov_mask(dy, dx, float("nan"), fov)
    assert mask.diagonal().all()


def test_half_plane_views_are_unchanged_by_the_self_term():
    # the released LH-180 masks: every finite direction already sees offset 0, nothing else moves
    directions = [0.0, 90.0, 180.0, 270.0, 45.0, 135.0, 225.0, 315.0, 30.0, -1e3]
    masks = lookhere_fov_masks((4, 6), directions, fov=180.0)
    y, x = torch.meshgrid(torch.arange(4.0), torch.arange(6.0), indexing="ij")
    dy = y.flatten()[None, :] - y.flatten()[:, None]
    dx = x.flatten()[None, :] - x.flatten()[:, None]
    for h, d in enumerate(directions):
        ux, uy = math.cos(math.radians(d)), math.sin(math.radians(d))
        expected = (dx * ux + dy * uy >= -1e-9) | ((dx == 0) & (dy == 0))
        assert torch.equal(masks[h], expected), d


@pytest.mark.parametrize("layer", [2.5, 1.0, True, None, "0", -1, 4])
def test_attn_bias_layer_must_be_an_int_in_range(layer):
    lh = LookHere(48, 6, depth=4)
    q = torch.zeros(1, 6, 16, 8)
    with pytest.raises(
        ValueError, match=rf"layer must be an int in \[0, depth=4\) for LookHere, got {re.escape(repr(layer))}"
    ):
        lh.attn_bias(q, q, lh.prepare((3, 5), 1), layer)
