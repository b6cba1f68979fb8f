"""PI, NTK and YaRN on a diffusion transformer's rotary against their published formulas, on the released models'
axes (Flux: 16, 56, 56 channels with base 10000; HunyuanVideo's time axis: 16 channels with base 256).

PI and NTK-aware scaling are diffusers' own ``get_1d_rotary_pos_embed(..., linear_factor=s)`` and ``ntk_factor =
s^(d / (d - 2))``; YaRN is the paper's ramp over r = L theta / (2 pi) (Peng et al., ICLR 2024, eq. 17-20), written
out here. The released YaRN code ramps over the band index between the floor and ceiling of the same bounds
instead, which moves the bands inside the ramp: the last test shows where the two differ.
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers.models.embeddings import get_1d_rotary_pos_embed

import visionpe
from visionpe.integrations.diffusers import DiffusionRotary

AXES = {"flux": ((16, 56, 56), 10000.0, (1, 64, 64)), "hunyuan_time": ((16, 56, 56), 256.0, (33, 45, 80))}


def rotary(name: str) -> DiffusionRotary:
    dims, theta, train = AXES[name]
    return DiffusionRotary(dims, theta, ("time", "height", "width"), train)


def axis_cos(r: DiffusionRotary, axis: int, grid: tuple[int, ...]) -> torch.Tensor:
    positions = torch.zeros(grid[axis], 3)
    positions[:, axis] = torch.arange(grid[axis], dtype=torch.float32)
    cos, _ = r.cos_sin(positions, grid)
    start = sum(r.axes_dim[:axis])
    return cos[:, start : start + r.axes_dim[axis]]


@pytest.mark.parametrize("name", sorted(AXES))
@pytest.mark.parametrize("scale", [1.5, 2.0, 4.0])
def test_pi_is_diffusers_linear_factor(name, scale):
    r = rotary(name)
    visionpe.set_extrapolation(r, "pi")
    grid = tuple(round(n * scale) for n in r.train_grid_size)
    for axis, (dim, theta) in enumerate(zip(r.axes_dim, r.thetas, strict=True)):
        s = grid[axis] / r.train_grid_size[axis]
        ref, _ = get_1d_rotary_pos_embed(
            dim, torch.arange(grid[axis]).double(), theta, use_real=True, linear_factor=s, freqs_dtype=torch.float64
        )
        torch.testing.assert_close(axis_cos(r, axis, grid), ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", sorted(AXES))
@pytest.mark.parametrize("scale", [1.5, 2.0, 4.0])
def test_ntk_is_the_base_times_s_to_the_d_over_d_minus_2(name, scale):
    r = rotary(name)
    visionpe.set_extrapolation(r, "ntk")
    grid = tuple(round(n * scale) for n in r.train_grid_size)
    for axis, (dim, theta) in enumerate(zip(r.axes_dim, r.thetas, strict=True)):
        s = grid[axis] / r.train_grid_size[axis]
        ref, _ = get_1d_rotary_pos_embed(
            dim,
            torch.arange(grid[axis]).double(),
            theta,
            use_real=True,
            ntk_factor=s ** (dim / (dim - 2)),
            freqs_dtype=torch.float64,
        )
        torch.testing.assert_close(axis_cos(r, axis, grid), ref, atol=1e-6, rtol=0)


def yarn_paper(dim: int, theta: float, length: int, s: float, alpha: float, beta: float) -> torch.Tensor:
    """YaRN's frequencies of one axis as the paper writes them: r_d = L / lambda_d = L theta_d / (2 pi),
    gamma(r) = 0 below alpha, 1 above beta, linear between; theta'_d = (1 - gamma) theta_d / s + gamma theta_d."""
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    r = length * freqs / (2 * math.pi)
    gamma = ((r - alpha) / (beta - alpha)).clamp(0, 1)
    return (1 - gamma) * freqs / s + gamma * freqs


@pytest.mark.parametrize("name", sorted(AXES))
@pytest.mark.parametrize(("alpha", "beta"), [(1.0, 32.0), (0.5, 4.0)])
def test_yarn_is_the_papers_ramp_with_its_attention_factor(name, alpha, beta):
    r = rotary(name)
    visionpe.set_extrapolation(r, "yarn", alpha=alpha, beta=beta)
    grid = tuple(2 * n for n in r.train_grid_size)
    per_axis = r.axis_frequencies(grid)
    for axis, (dim, theta) in enumerate(zip(r.axes_dim, r.thetas, strict=True)):
        freqs, mscale = per_axis[axis]
        expected = yarn_paper(dim, theta, r.train_grid_size[axis], 2.0, alpha, beta)
        torch.testing.assert_close(freqs.double(), expected, atol=1e-12, rtol=1e-12)
        assert mscale == pytest.approx(0.1 * math.log(2.0) + 1.0)


def test_yarn_differs_from_the_released_band_index_ramp_only_inside_the_ramp():
    # the released YaRN code: low = floor(band of beta turns), high = ceil(band of alpha turns), a linear ramp over
    # the band index between them; the paper (and visionpe) ramp over r itself
    dim, theta, length, s, alpha, beta = 56, 10000.0, 64, 2.0, 1.0, 32.0

    def band(turns: float) -> float:
        return dim * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(band(beta)), 0), min(math.ceil(band(alpha)), dim - 1)
    index = torch.arange(dim // 2, dtype=torch.float64)
    extrapolate = 1 - ((index - low) / (high - low)).clamp(0, 1)  # 1: the band keeps its frequency
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    released = freqs / s * (1 - extrapolate) + freqs * extrapolate
    paper = yarn_paper(dim, theta, length, s, alpha, beta)
    outside = (index < low) | (index > high)
    torch.testing.assert_close(paper[outside], released[outside])
    assert not torch.allclose(paper[~outside], released[~outside])
