import pytest
import torch

from visionpe.grid import grid_coords, prefix_mask


def test_modes_on_non_square_grid():
    idx = grid_coords((2, 3))
    assert idx.shape == (6, 2) and idx[4].tolist() == [1.0, 1.0] and idx[2].tolist() == [0.0, 2.0]
    assert grid_coords((2, 3), "centered")[:, 1].unique().tolist() == [-1.0, 0.0, 1.0]
    assert torch.allclose(grid_coords((2, 4), "normalized")[:4, 1], torch.tensor([0.125, 0.375, 0.625, 0.875]))
    ref = grid_coords((4, 6), "ref_scaled", ref_grid_size=(2, 3))
    assert ref[:, 0].max() == 1.5 and ref[:, 1].max() == 2.5


def test_3d_row_major():
    c = grid_coords((2, 2, 3))
    assert c.shape == (12, 3) and c[7].tolist() == [1.0, 0.0, 1.0]


def test_prefix_mask():
    assert prefix_mask(2, 3).tolist() == [True, True, False, False, False]


@pytest.mark.parametrize(
    "args,match",
    [
        (((2,),), "2 or 3 entries"),
        (((2, 0),), "positive"),
        (((2, 2.5),), "must be an int"),
        (((2, 2), "bogus"), "mode must be one of"),
        (((2, 2), "ref_scaled"), "ref_grid_size"),
    ],
)
def test_bad_input(args, match):
    with pytest.raises((ValueError, TypeError), match=match):
        grid_coords(*args)
