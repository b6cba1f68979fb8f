import math

import pytest
import torch

import visionpe
from visionpe.absolute.sincos import sincos_2d
from visionpe.grid import grid_coords


def test_dot_product_depends_only_on_offset():
    dim = 32
    coords = grid_coords((3, 5))
    e = sincos_2d(coords, dim)
    omega = 10000.0 ** (-torch.arange(dim // 4) / (dim // 4))
    delta = coords[:, None, :] - coords[None, :, :]
    expected = (torch.cos(delta[..., 1:2] * omega) + torch.cos(delta[..., 0:1] * omega)).sum(-1)
    assert torch.allclose(e @ e.T, expected, atol=1e-4)


def test_first_half_encodes_the_column():
    e = sincos_2d(torch.tensor([[0.0, 1.0]]), 8)  # (y, x) = (0, 1)
    expected = [math.sin(1), math.sin(0.01), math.cos(1), math.cos(0.01), 0, 0, 1, 1]
    assert torch.allclose(e[0], torch.tensor(expected), atol=1e-6)


def test_prefix_rows_zero_and_resize_modes():
    pe = visionpe.create_pos_embed("sincos", dim=16, num_heads=1, grid_size=(2, 2))
    x = torch.zeros(1, 1 + 9, 16)
    out = pe(x, (3, 3), 1)
    assert (out[:, 0] == 0).all()
    assert torch.allclose(out[0, 1:], sincos_2d(grid_coords((3, 3)), 16))
    interp = visionpe.create_pos_embed("sincos", dim=16, num_heads=1, grid_size=(2, 2), resize="interpolate")
    assert not torch.allclose(interp(x, (3, 3), 1), out)
    with pytest.raises(ValueError, match="resize"):
        visionpe.create_pos_embed("sincos", dim=16, num_heads=1, resize="bogus")
