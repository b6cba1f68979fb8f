import pytest
import torch
from timm.layers import RotaryEmbeddingCat, apply_rot_embed_cat

import visionpe
from visionpe.grid import grid_coords
from visionpe.rotary.rope_axial import axial_frequencies

from .helpers import relative_error


@pytest.mark.parametrize("ndim,grid", [(2, (3, 5)), (3, (2, 3, 5))])
def test_relative_property_non_square(ndim, grid):
    rope = visionpe.create_pos_embed("rope_axial", dim=128, num_heads=2, ndim=ndim)
    coords = grid_coords(grid)
    shift = torch.tensor([3.0, -7.0, 11.0][:ndim])
    assert relative_error(rope.rotate, coords, shift, head_dim=64) < 1e-5 * 64


def test_matches_timm_rotary_embedding_cat_xy_and_not_ij():
    head_dim, grid = 64, (3, 5)
    rope = visionpe.create_pos_embed("rope_axial", dim=head_dim * 2, num_heads=2)
    x = torch.randn(2, 2, 15, head_dim)
    ours = rope.rotate(x, grid_coords(grid))
    timm_xy = RotaryEmbeddingCat(dim=head_dim, temperature=100, in_pixels=False, grid_indexing="xy")
    assert torch.allclose(ours, apply_rot_embed_cat(x, timm_xy.get_embed(grid)), atol=1e-5)
    timm_ij = RotaryEmbeddingCat(dim=head_dim, temperature=100, in_pixels=False, grid_indexing="ij")
    assert not torch.allclose(ours, apply_rot_embed_cat(x, timm_ij.get_embed(grid)), atol=1e-3)


def test_x_shift_changes_only_x_pairs():
    rope = visionpe.create_pos_embed("rope_axial", dim=64, num_heads=1)
    x = torch.randn(1, 1, 1, 64)
    base = rope.rotate(x, torch.tensor([[2.0, 3.0]]))
    moved = rope.rotate(x, torch.tensor([[2.0, 4.0]]))  # x (column) + 1
    changed = (base - moved).abs().reshape(32, 2).sum(-1) > 1e-6
    assert changed[:16].all() and not changed[16:].any()  # pairs [0, d/4) read x


def test_frequencies_formula():
    freqs = axial_frequencies(64, 100.0, (16, 16))
    theta = 100.0 ** (-4 * torch.arange(16) / 64)
    assert torch.allclose(freqs[1, :16], theta) and torch.allclose(freqs[0, 16:], theta)
    assert (freqs[1, 16:] == 0).all() and (freqs[0, :16] == 0).all()


def test_3d_default_split_and_2d_error():
    rope = visionpe.create_pos_embed("rope_axial", dim=128, num_heads=2, ndim=3)
    assert rope.axis_pairs == (12, 12, 8)
    rope2d = visionpe.create_pos_embed("rope_axial", dim=128, num_heads=2)
    with pytest.raises(ValueError, match="3 axes"):
        rope2d.rotate(torch.randn(1, 2, 4, 64), grid_coords((1, 2, 2)))


def test_prefix_rows_are_identity():
    rope = visionpe.create_pos_embed("rope_axial", dim=64, num_heads=1)
    state = rope.prepare(grid_coords((2, 3)) + 1, num_prefix_tokens=2)
    cos, sin = state.cos, state.sin
    assert cos.shape[-2] == 8
    assert (cos[..., :2, :] == 1).all() and (sin[..., :2, :] == 0).all()


def test_bad_input():
    rope = visionpe.create_pos_embed("rope_axial", dim=64, num_heads=1)
    with pytest.raises(ValueError, match="rows but x has"):
        rope.rotate(torch.randn(1, 1, 5, 64), grid_coords((2, 3)))
    with pytest.raises(ValueError, match="finite"):
        rope.rotate(torch.randn(1, 1, 1, 64), torch.tensor([[float("nan"), 0.0]]))
    with pytest.raises(ValueError, match="axis_pairs"):
        visionpe.create_pos_embed("rope_axial", dim=64, num_heads=1, axis_pairs=(10, 10))


def test_fp32_fast_path_matches_real_form_with_gradients():
    from visionpe.rotary.functional import apply_rotary, rotary_tables

    angles = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64).permute(0, 2, 1, 3).transpose(1, 2)  # non-contiguous
    grads = []
    for dtype in (torch.float32, torch.float64):  # fp32: complex product; fp64: cos/sin form
        a = angles.detach().to(dtype).requires_grad_(True)
        out = apply_rotary(x.to(dtype), *rotary_tables(a))
        out.backward(torch.ones_like(out))
        grads.append((out.double(), a.grad.double()))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-5)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-4)


@pytest.mark.parametrize(
    "axis_pairs, error, match",
    [
        ((16.5, 15.5), TypeError, r"axis_pairs\[0\] must be a positive int, got float \(16\.5\)"),
        ((16, 16.0), TypeError, r"axis_pairs\[1\] must be a positive int, got float \(16\.0\)"),
        ((True, 31), TypeError, r"axis_pairs\[0\] must be a positive int, got bool \(True\)"),
        ((0, 32), ValueError, r"axis_pairs\[0\] must be a positive int, got 0"),
        ((40, -8), ValueError, r"axis_pairs\[1\] must be a positive int, got -8"),
        ("16,16", TypeError, r"axis_pairs must be a tuple of ints, got str"),
    ],
)
def test_axis_pairs_must_be_positive_ints(axis_pairs, error, match):
    with pytest.raises(error, match=match):
        visionpe.create_pos_embed("rope_axial", dim=128, num_heads=2, axis_pairs=axis_pairs)
    with pytest.raises(error, match=match):
        axial_frequencies(64, 100.0, axis_pairs)


def test_axis_pairs_accept_integer_types():
    import numpy as np

    for pairs in ([16, 16], (np.int64(16), 16), np.array([16, 16]), torch.tensor([16, 16])):
        rope = visionpe.create_pos_embed("rope_axial", dim=128, num_heads=2, axis_pairs=pairs)
        assert rope.axis_pairs == (16, 16) and all(type(n) is int for n in rope.axis_pairs)


# -- coord_mode: checked at construction; ref_scaled is position interpolation to the training grid ---------------

LINEAR = ["rope_axial", "rope_mixed", "string_cayley", "string_circulant"]


@pytest.mark.parametrize("name", LINEAR)
def test_coord_mode_is_checked_at_construction(name):
    for bad in ("bogus", "Index", None, 0):
        with pytest.raises(ValueError, match=r"coord_mode must be one of \('index', .*'ref_scaled'\), got "):
            visionpe.create_pos_embed(name, dim=64, num_heads=2, coord_mode=bad)
    with pytest.raises(ValueError, match=r"coord_mode='ref_scaled' .*needs the training grid.*got grid_size=None"):
        visionpe.create_pos_embed(name, dim=64, num_heads=2, coord_mode="ref_scaled")


@pytest.mark.parametrize("name", LINEAR)
def test_ref_scaled_interpolates_to_the_training_grid(name):
    import timm

    scheme = visionpe.create_pos_embed(name, dim=64, num_heads=2, coord_mode="ref_scaled", grid_size=(3, 5))
    torch.testing.assert_close(scheme.coords((3, 5)), grid_coords((3, 5)))  # i at the training grid
    expected = grid_coords((6, 8)) * torch.tensor([3 / 6, 5 / 8])  # i * n_train / n
    torch.testing.assert_close(scheme.coords((6, 8)), expected)
    # a model built with it runs (the model passes its grid as the training grid)
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224",
        pos_embed=name,
        depth=1,
        embed_dim=64,
        num_heads=2,
        img_size=48,
        patch_size=16,
        dynamic_img_size=True,
        pos_embed_kwargs={"coord_mode": "ref_scaled"},
    )
    assert model.pos_schemes[name].train_grid_size == (3, 3)
    assert torch.isfinite(model(torch.randn(1, 3, 96, 64))).all()  # dynamic size: a 6 x 4 grid


def test_ref_scaled_matches_pi_on_a_larger_grid():
    # PI divides the frequencies of an axis by s_a = n / n_train; ref_scaled divides its positions: the same angles
    pi = visionpe.create_pos_embed("rope_axial", dim=128, num_heads=2, grid_size=(3, 5), extrapolation="pi")
    ref = visionpe.create_pos_embed("rope_axial", dim=128, num_heads=2, grid_size=(3, 5), coord_mode="ref_scaled")
    x = torch.randn(1, 2, 56, 64)
    expected = pi.rotate(x, pi.coords((7, 8)), grid_size=(7, 8))
    torch.testing.assert_close(ref.rotate(x, ref.coords((7, 8))), expected, atol=1e-5, rtol=1e-5)


# -- layer and token count of apply ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", LINEAR)
def test_apply_checks_layer_and_token_count(name):
    scheme = visionpe.create_pos_embed(name, dim=64, num_heads=2, depth=2)
    qk = torch.randn(2, 1, 2, 1 + 15, 32)
    state = scheme.prepare(grid_coords((3, 5)), 1)
    for layer in (2, -1, 1.0, True):
        with pytest.raises(ValueError, match=rf"layer must be an int in \[0, depth=2\) for \w+, got {layer!r}"):
            scheme.apply(qk, state, layer)
    with pytest.raises(
        ValueError, match=r"qk must have shape \(\.\.\., P \+ N = 16, head_dim = 32\).*got \(2, 1, 2, 11"
    ):
        scheme.apply(qk[..., :11, :], state, 1)
    assert scheme.apply(qk, state, 1).shape == qk.shape


def test_coord_offset_grid_inferred_for_extrapolation():
    """rotate() without grid_size reads the grid off index coordinates; with coord_offset the offset is taken off
    first, so the scaling matches the model path that passes the grid."""
    rope = visionpe.create_pos_embed(
        "rope_axial", dim=32, num_heads=2, coord_offset=1.0, grid_size=(3, 5), extrapolation="pi"
    )
    coords = rope.coords((6, 10))
    x = torch.randn(2, 2, 60, 16)
    torch.testing.assert_close(rope.rotate(x, coords), rope.rotate(x, coords, grid_size=(6, 10)))
    assert not torch.allclose(rope.rotate(x, coords), rope.rotate(x, coords, grid_size=(7, 11)))
