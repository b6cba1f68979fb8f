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
    cos, sin = rope.prepare(grid_coords((2, 3)) + 1, num_prefix_tokens=2)
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
