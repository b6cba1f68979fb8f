import math

import pytest
import torch

import visionpe
from visionpe.bias.alibi2d import alibi_slopes
from visionpe.grid import grid_coords


def _bias(scheme, grid, prefix=1, layer=0, dtype=torch.float32, heads=None):
    state = scheme.prepare(grid, prefix)
    heads = heads or scheme.num_heads
    n = prefix + math.prod(grid)
    q = torch.zeros(1, heads, n, 8, dtype=dtype)
    return scheme.attn_bias(q, q, state, layer)[0]


def _distances(grid, distance):
    """(A, N, N) distances between the patches of ``grid``, written out per pair."""
    coords = grid_coords(grid)
    delta = (coords[:, None] - coords[None]).abs()
    if distance == "euclidean":
        return delta.square().sum(-1).sqrt()[None]
    if distance == "manhattan":
        return delta.sum(-1)[None]
    return delta.permute(2, 0, 1)


@pytest.mark.parametrize("distance", ["euclidean", "manhattan", "axis"])
def test_log_kernel_equals_the_formula_pair_by_pair(distance):
    scheme = visionpe.create_pos_embed("kerple_log", dim=32, num_heads=4, depth=2, distance=distance)
    bias = _bias(scheme, (3, 5), prefix=1, layer=1)
    d = _distances((3, 5), distance)[:, None]  # (A, 1, N, N)
    r1, r2 = scheme.scale[1].clamp(min=0.01)[..., None, None], scheme.rate[1].clamp(min=0.01)[..., None, None]
    expected = (-r1 * torch.log(1 + r2 * d)).sum(0)
    torch.testing.assert_close(bias[:, 1:, 1:], expected)
    assert (bias[:, 0] == 0).all() and (bias[:, :, 0] == 0).all()  # prefix pairs: distance 0


def test_one_row_grid_equals_the_causal_1d_reference():
    # the reference's log kernel on a sequence: -p log(1 + a (m - n)) for n <= m (tril of the index differences)
    scheme = visionpe.create_pos_embed("kerple_log", dim=32, num_heads=4)
    bias = _bias(scheme, (1, 7), prefix=0)
    m = torch.arange(7)
    diff = torch.tril(m.view(7, 1).repeat(1, 7) + torch.arange(0, -7, -1)).float()
    p, a = scheme.scale[0, 0].clamp(min=0.01), scheme.rate[0, 0].clamp(min=0.01)
    reference = -p[:, None, None] * torch.log(1 + a[:, None, None] * diff)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    torch.testing.assert_close(bias[:, causal], reference[:, causal])


def test_power_kernel_with_unit_exponent_and_alibi_slopes_is_alibi2d():
    # the reference keeps r1 >= 0.01: a head whose ALiBi slope is smaller (here 2^-8) takes 0.01
    kerple = visionpe.create_pos_embed("kerple_power", dim=48, num_heads=6, depth=2)
    slopes = alibi_slopes(6)
    with torch.no_grad():
        kerple.scale.copy_(slopes.expand_as(kerple.scale))
        kerple.power.fill_(1.0)
    alibi = visionpe.create_pos_embed("alibi2d", dim=48, num_heads=6)
    steep = slopes >= 0.01
    assert steep.sum() == 5
    for grid in ((3, 5), (6, 4)):
        ours, theirs = _bias(kerple, grid, layer=1), _bias(alibi, grid, heads=6)
        torch.testing.assert_close(ours[steep], theirs[steep], rtol=0, atol=0)
        torch.testing.assert_close(ours[~steep], theirs[~steep] / slopes[~steep, None, None] * 0.01)


def test_parameters_are_bounded_in_the_forward_without_being_rewritten():
    scheme = visionpe.create_pos_embed("kerple_power", dim=32, num_heads=2)
    with torch.no_grad():
        scheme.scale.fill_(-1.0)
        scheme.power.fill_(5.0)
    bias = _bias(scheme, (2, 3), prefix=0)
    d = _distances((2, 3), "euclidean")[0]
    torch.testing.assert_close(bias, (-0.01 * d**2.0).expand(2, -1, -1))
    assert (scheme.scale == -1).all() and (scheme.power == 5).all()


@pytest.mark.parametrize("name", ["kerple_log", "kerple_power"])
def test_gradients_are_finite_at_zero_distance(name):
    scheme = visionpe.create_pos_embed(name, dim=32, num_heads=2, depth=1, distance="axis")
    _bias(scheme, (3, 4)).sum().backward()
    for param in scheme.parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0


@pytest.mark.parametrize("name", ["kerple_log", "kerple_power"])
def test_exactly_relative_and_recomputed_on_a_larger_grid(name):
    scheme = visionpe.create_pos_embed(name, dim=32, num_heads=2)
    small, large = _bias(scheme, (3, 4), prefix=0), _bias(scheme, (6, 8), prefix=0)
    # the bias of a pair depends on its offset only: the 3 x 4 grid's block inside the 6 x 8 grid, anywhere
    inside = (torch.arange(3)[:, None] * 8 + torch.arange(4)).flatten()
    for shift in (0, 2 * 8 + 3):
        rows = inside + shift
        torch.testing.assert_close(large[:, rows][:, :, rows], small)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="distance must be one of"):
        visionpe.create_pos_embed("kerple_log", dim=32, num_heads=2, distance="cosine")
    scheme = visionpe.create_pos_embed("kerple_power", dim=32, num_heads=2, depth=2)
    with pytest.raises(ValueError, match="supports 2D grids"):
        scheme.prepare((2, 3, 4), 1)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, depth=2\)"):
        _bias(scheme, (2, 3), layer=2)
    state = scheme.prepare((2, 3), 1)
    with pytest.raises(ValueError, match=r"q and k must have shape \(B, 2, 7, head_dim\)"):
        scheme.attn_bias(torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 7, 8), state, 0)
