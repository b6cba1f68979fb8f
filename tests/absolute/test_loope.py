"""LOOPE: 1D sin-cos of X = X_G + X_C, X_G the patch's index along the generalized Hilbert (Gilbert) curve."""

from __future__ import annotations

import math

import pytest
import timm
import torch

import visionpe
from visionpe.absolute.loope import gilbert_curve, gilbert_index

SIZES = [(3, 5), (5, 3), (4, 7), (7, 4), (6, 9), (9, 6), (2, 5), (5, 2), (1, 6), (6, 1), (8, 8), (7, 7), (3, 10)]


@pytest.mark.parametrize("grid_size", SIZES)
def test_curve_visits_every_cell_once_through_neighbours(grid_size):
    height, width = grid_size
    cells = gilbert_curve(grid_size)
    assert sorted(cells) == [(y, x) for y in range(height) for x in range(width)]
    assert cells[0] == (0, 0)
    steps = [(abs(y1 - y0), abs(x1 - x0)) for (y0, x0), (y1, x1) in zip(cells, cells[1:], strict=False)]
    assert all(max(step) == 1 for step in steps)  # Chebyshev distance 1
    # what the curve guarantees beyond that: sides shared except for at most one diagonal step, and a diagonal
    # only where parity forces it (the longer side odd, the shorter even)
    diagonals = steps.count((1, 1))
    longer, shorter = max(grid_size), min(grid_size)
    assert diagonals <= (1 if longer % 2 and not shorter % 2 else 0)
    # X_G inverts the order: patch y * W + x gets its step number
    rank = gilbert_index(grid_size)
    assert [int(rank[y * width + x]) for y, x in cells] == list(range(height * width))


def test_some_odd_by_even_grid_takes_its_diagonal_step():
    cells = gilbert_curve((4, 7))  # W = 7 odd (the longer side), H = 4 even: no path of side steps ends there
    steps = [(abs(y1 - y0), abs(x1 - x0)) for (y0, x0), (y1, x1) in zip(cells, cells[1:], strict=False)]
    assert steps.count((1, 1)) == 1


def naive_sincos(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """[sin(X w_k) for k] + [cos(X w_k) for k], w_k = 10000^(-2k/dim), one position at a time in float64."""
    w = [10000.0 ** (-2 * k / dim) for k in range(dim // 2)]
    rows = [[math.sin(p * wk) for wk in w] + [math.cos(p * wk) for wk in w] for p in positions.tolist()]
    return torch.tensor(rows, dtype=torch.float32)


def test_with_zero_context_it_is_the_sincos_of_the_curve_index():
    pe = visionpe.create_pos_embed("loope", dim=16, num_heads=2, grid_size=(3, 5))
    assert torch.equal(pe.context, torch.zeros(1, 15, 1))  # zero init
    x = torch.randn(2, 1 + 15, 16)
    out = pe(x, (3, 5), 1)
    assert torch.equal(out[:, :1], x[:, :1])  # the prefix row is zero
    expected = naive_sincos(gilbert_index((3, 5)).float(), 16)
    torch.testing.assert_close(out[:, 1:] - x[:, 1:], expected.expand(2, -1, -1), rtol=0, atol=1e-5)
    # another grid: the curve is recomputed there (the zero context stays zero)
    y = torch.randn(1, 1 + 24, 16)
    expected = naive_sincos(gilbert_index((4, 6)).float(), 16)
    torch.testing.assert_close(pe(y, (4, 6), 1)[:, 1:] - y[:, 1:], expected[None], rtol=0, atol=1e-5)


def test_context_shifts_the_positions_and_is_trained_without_decay():
    pe = visionpe.create_pos_embed("loope", dim=16, num_heads=2, grid_size=(3, 5))
    with torch.no_grad():
        pe.context.copy_(torch.linspace(-0.5, 0.5, 15).view(1, 15, 1))
    positions = gilbert_index((3, 5)).float() + torch.linspace(-0.5, 0.5, 15)
    torch.testing.assert_close(pe.table((3, 5)), naive_sincos(positions, 16), rtol=0, atol=1e-5)
    x = torch.randn(2, 1 + 15, 16)
    pe(x, (3, 5), 1).square().sum().backward()
    assert pe.context.grad is not None and pe.context.grad.abs().sum() > 0
    pe.context.grad = None
    pe(torch.randn(1, 1 + 28, 16), (4, 7), 1).square().sum().backward()  # through the bicubic resampling
    assert pe.context.grad.abs().sum() > 0
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="loope", depth=1, img_size=(48, 80))
    assert "pos_schemes.loope.context" in model.no_weight_decay()
    assert model.pos_schemes["loope"].context.shape == (1, 15, 1)


def test_context_is_resampled_like_the_learned_table():
    pe = visionpe.create_pos_embed("loope", dim=16, num_heads=2, grid_size=(3, 5))
    learned = visionpe.create_pos_embed("learned", dim=1, num_heads=1, grid_size=(3, 5), num_prefix_tokens=0)
    with torch.no_grad():
        pe.context.normal_()
        learned.pos_embed.copy_(pe.context)
    torch.testing.assert_close(pe.context_offsets((6, 8)), learned.resampled((6, 8))[0, :, 0], rtol=0, atol=0)
    pe.set_grid_size((6, 8))  # the model's set_input_size
    assert pe.grid_size == (6, 8) and pe.context.shape == (1, 48, 1)
    torch.testing.assert_close(pe.context[0, :, 0], learned.resampled((6, 8))[0, :, 0], rtol=0, atol=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"loope needs an even dim >= 2 .*got dim=15"):
        visionpe.create_pos_embed("loope", dim=15, num_heads=1)
    with pytest.raises(ValueError, match=r"interpolation must be one of"):
        visionpe.create_pos_embed("loope", dim=16, num_heads=1, interpolation="area")
    with pytest.raises(ValueError, match=r"grid_size\[1\] must be positive, got 0"):
        gilbert_curve((3, 0))
    with pytest.raises(ValueError, match=r"grid_size must have 2 entries"):
        gilbert_index((2, 3, 4))
