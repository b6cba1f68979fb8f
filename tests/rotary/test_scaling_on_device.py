"""The extrapolation modes with the grid given as a tensor (read off a model's ids on their device): the same
frequencies as with the grid given as ints, an axis at or below its training length left exactly alone, and no
graph break under torch.compile."""

from __future__ import annotations

import pytest
import torch

from visionpe.rotary.rope_axial import axial_frequencies
from visionpe.rotary.rope_mixed import RopeMixed
from visionpe.rotary.scaling import (
    axis_scale_factors,
    riflex_frequencies,
    scale_frequencies,
    yarn_attention_factor,
)

TRAIN = (8, 6)
GRIDS = [(8, 6), (16, 6), (5, 12), (24, 18), (9, 7)]


def mixed_frequencies() -> torch.Tensor:
    # RoPE-Mixed's learned spectrum (pairs that turn with both axes), (depth, heads, 2, P)
    return RopeMixed(64, 4, depth=2).frequencies().detach()


@pytest.mark.parametrize("grid", GRIDS)
def test_factors_and_yarn_multiplier_equal_the_int_grid(grid):
    on_device = axis_scale_factors(torch.tensor(grid), TRAIN)
    assert on_device.dtype == torch.float64
    assert on_device.tolist() == list(axis_scale_factors(grid, TRAIN))
    assert float(yarn_attention_factor(on_device)) == pytest.approx(
        yarn_attention_factor(axis_scale_factors(grid, TRAIN)), rel=1e-15
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "mode, spectrum",
    [(m, s) for m in ("pi", "ntk", "yarn", "riflex") for s in ("axial", "mixed") if (m, s) != ("riflex", "mixed")],
)
@pytest.mark.parametrize("grid", GRIDS)
def test_scaled_frequencies_equal_the_int_grid(grid, mode, spectrum, dtype):
    # bit for bit (riflex needs an axial spectrum, so it runs on RoPE-Axial's only)
    freqs = axial_frequencies(32, 100.0, (8, 8)) if spectrum == "axial" else mixed_frequencies()
    freqs = freqs.to(dtype)
    expected = scale_frequencies(freqs, axis_scale_factors(grid, TRAIN), mode, TRAIN)
    got = scale_frequencies(freqs, axis_scale_factors(torch.tensor(grid), TRAIN), mode, TRAIN)
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)
    if grid == TRAIN:  # no axis longer than its training length: the frequencies exactly as they were
        assert torch.equal(got, freqs)


@pytest.mark.parametrize("riflex_k", [None, (2, 0), (1, 3)])
@pytest.mark.parametrize("grid", GRIDS)
def test_riflex_band_edit_equals_the_int_grid(grid, riflex_k):
    freqs = axial_frequencies(32, 10.0, (8, 8)).double()
    expected = riflex_frequencies(freqs, grid, TRAIN, riflex_k)
    got = riflex_frequencies(freqs, torch.tensor(grid), TRAIN, riflex_k)
    assert torch.equal(got, expected)


def test_a_grid_tensor_of_another_shape_or_kind_is_refused():
    freqs = axial_frequencies(32, 100.0, (8, 8))
    with pytest.raises(ValueError, match=r"grid_size must be a \(ndim,\) tensor.*got shape \(1, 2\)"):
        axis_scale_factors(torch.tensor([[16, 6]]), TRAIN)
    with pytest.raises(ValueError, match=r"train_grid_size"):
        axis_scale_factors(torch.tensor([16, 6, 4]), TRAIN)
    with pytest.raises(TypeError, match=r"grid_size must be a real tensor.*torch.bool"):
        axis_scale_factors(torch.tensor([True, False]), TRAIN)
    with pytest.raises(
        ValueError, match=r"factors must be a \(2,\) tensor of scale factors per axis, got shape \(3,\)"
    ):
        scale_frequencies(freqs, torch.ones(3, dtype=torch.float64), "pi", TRAIN)
    with pytest.raises(ValueError, match=r"grid_size must be a \(2,\) tensor.*got shape \(3,\)"):
        riflex_frequencies(freqs, torch.tensor([16, 6, 4]), TRAIN)


@pytest.mark.parametrize("mode", ["pi", "ntk", "yarn", "riflex"])
def test_the_modes_trace_without_a_graph_break(mode):
    freqs = axial_frequencies(32, 100.0, (8, 8)).double()

    def adjusted(grid: torch.Tensor) -> torch.Tensor:
        factors = axis_scale_factors(grid, TRAIN)
        return scale_frequencies(freqs, factors, mode, TRAIN) * yarn_attention_factor(factors)

    grid = torch.tensor([16.0, 6.0])
    explanation = torch._dynamo.explain(adjusted)(grid)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    torch._dynamo.reset()
