import pytest
import torch

from visionpe.checks import (
    ArgumentTypeError,
    check_block_tokens,
    check_bool,
    check_choice,
    check_float,
    check_instance,
    check_tensor,
)
from visionpe.grid import grid_coords, prefix_mask, validate_count, validate_positive


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


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: validate_count(True, "count"), ArgumentTypeError, r"non-negative int, got bool \(True\)"),
        (lambda: validate_count(-2, "count"), ValueError, r"count must be a non-negative int, got -2"),
        (lambda: validate_positive("1", "ratio"), ArgumentTypeError, r"ratio must be a positive .*, got str"),
        (lambda: validate_positive(float("nan"), "ratio"), ValueError, r"positive finite number, got nan"),
        (lambda: check_float(361, "fov", min=0, max=360, min_open=True), ValueError, r"number in \(0, 360\]"),
        (lambda: check_choice([1], "mode", ("a", "b")), ValueError, r"mode must be one of \('a', 'b'\), got \[1\]"),
        (lambda: check_tensor([1.0], "x", dtype="real"), ArgumentTypeError, r"x must be a real .* tensor, got list"),
        (lambda: check_tensor(torch.ones(2).bool(), "x", dtype="integer"), TypeError, r"got dtype torch.bool"),
        (lambda: check_instance(True, "n", int, expected="an int"), ArgumentTypeError, r"n must be an int, got bool"),
        (lambda: check_block_tokens(None, "Cable", 5, 8), ValueError, r"Cable computes .* tokens=\(B, 5, 8\)"),
        (lambda: check_block_tokens([0.0], "PaPE", 5, 8), TypeError, r"tokens must be a tensor, got list"),
        (
            lambda: check_block_tokens(torch.zeros(2, 5, 8), "PaPE", 5, 8, batch=3),
            ValueError,
            r"tokens must be a floating-point \(B=3, 5, 8\) tensor, got shape \(2, 5, 8\)",
        ),
        (
            lambda: check_block_tokens(torch.zeros(2, 5, 8, dtype=torch.long), "PaPE", 5, 8),
            ValueError,
            r"floating-point \(B=B, 5, 8\) tensor, got shape \(2, 5, 8\) and dtype torch.int64",
        ),
    ],
)
def test_argument_checks(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_wrong_type_is_a_type_error_that_code_catching_value_error_also_catches():
    assert issubclass(ArgumentTypeError, TypeError) and issubclass(ArgumentTypeError, ValueError)
    for bad in (2.0, "3", None, True):
        with pytest.raises(TypeError):
            validate_count(bad)
        with pytest.raises(ValueError):
            validate_count(bad)
    assert validate_count(0) == 0 and validate_positive(3, "ratio") == 3.0 and check_bool(False, "flag") is False
