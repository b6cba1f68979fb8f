import io
import math

import pytest
import timm
import torch

import visionpe
from visionpe.grid import grid_coords
from visionpe.rotary.gridpe import simplex_directions

from .helpers import relative_error


def _gridpe(**kw):
    return visionpe.create_pos_embed("gridpe", **{"dim": 64, "num_heads": 2, **kw})


@pytest.mark.parametrize("ndim", [2, 3])
def test_module_directions_form_a_regular_simplex(ndim):
    directions = _gridpe(ndim=ndim).directions  # (modules, ndim + 1, ndim)
    assert directions.shape == (16 // (ndim + 1), ndim + 1, ndim)
    assert directions.sum(1).abs().max() < 1e-6  # each module's directions sum to 0
    gram = directions @ directions.transpose(-1, -2)
    # unit vectors at equal angles: cos = -1/2 (120 degrees) in 2D, -1/3 (tetrahedron) in 3D
    expected = torch.full((ndim + 1, ndim + 1), -1.0 / ndim).fill_diagonal_(1.0)
    assert torch.allclose(gram, expected.expand_as(gram), atol=1e-6)


def test_2d_directions_are_at_phase_plus_thirds_of_a_turn():
    directions = _gridpe().directions
    angles = torch.atan2(directions[..., 0], directions[..., 1])  # columns (y, x): angle from the x axis
    steps = torch.remainder(angles.diff(dim=-1), 2 * math.pi)
    assert torch.allclose(steps, torch.full_like(steps, 2 * math.pi / 3), atol=1e-5)
    assert angles[:, 0].unique().numel() == len(angles)  # one phase per module, drawn, not fixed


@pytest.mark.parametrize("ndim,ratio", [(2, math.sqrt(math.e)), (3, math.e ** (1 / 3))])
def test_magnitudes_are_geometric_with_the_default_ratio(ndim, ratio):
    scheme = _gridpe(ndim=ndim, omega0=0.8)
    freqs = scheme.frequencies()[0, 0]  # (ndim, pairs)
    per_module = ndim + 1
    modules = scheme.num_modules
    norms = freqs.norm(dim=0)[: modules * per_module].view(modules, per_module)
    expected = 0.8 * ratio ** -torch.arange(modules, dtype=torch.float32)
    assert torch.allclose(norms, expected[:, None].expand_as(norms), rtol=1e-5)
    assert torch.allclose(norms[:-1, 0] / norms[1:, 0], torch.full((modules - 1,), ratio), rtol=1e-5)
    # leftover pairs (16 pairs: 1 in 2D, 0 in 3D) do not turn
    assert (freqs[:, modules * per_module :] == 0).all()
    assert scheme.ratio == pytest.approx(ratio)


def test_custom_ratio_and_omega0():
    scheme = _gridpe(omega0=2.0, ratio=3.0)
    norms = scheme.frequencies()[0, 0].norm(dim=0)
    assert torch.allclose(norms[[0, 3, 6]], torch.tensor([2.0, 2.0 / 3, 2.0 / 9]), rtol=1e-5)


@pytest.mark.parametrize("ndim,grid", [(2, (3, 5)), (3, (2, 3, 5))])
def test_relative_invariance(ndim, grid):
    scheme = _gridpe(ndim=ndim)
    shift = torch.tensor([2.0, -5.0, 9.0][:ndim])
    assert relative_error(scheme.rotate, grid_coords(grid), shift, head_dim=32) < 1e-4


def test_rotation_matches_the_naive_formula():
    scheme = _gridpe()
    coords = grid_coords((3, 5))
    x = torch.randn(1, 2, 15, 32)
    out = scheme.rotate(x, coords)
    # pair m of module k turns by omega_k u_km . (x, y): columns of directions are (y, x)
    omega = math.e ** (-0.5 * torch.arange(scheme.num_modules, dtype=torch.float64))
    waves = (scheme.directions.double() * omega[:, None, None]).flatten(0, 1)  # (pairs used, 2)
    angles = torch.zeros(15, 16, dtype=torch.float64)
    angles[:, : len(waves)] = coords.double() @ waves.T
    pairs = x.double().unflatten(-1, (16, 2))
    cos, sin = angles.cos(), angles.sin()
    expected = torch.stack(
        (pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 0] * sin + pairs[..., 1] * cos), -1
    ).flatten(-2)
    assert torch.allclose(out.double(), expected, atol=1e-5)


def test_buffers_are_drawn_once_and_reproducible():
    first, second, other = _gridpe(seed=3), _gridpe(seed=3), _gridpe(seed=4)
    assert torch.equal(first.directions, second.directions)
    assert not torch.allclose(first.directions, other.directions)
    before = first.directions.clone()
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224",
        pos_embed="gridpe",
        pos_embed_kwargs={"seed": 3},
        embed_dim=64,
        depth=1,
        num_heads=2,
        num_classes=3,
        img_size=(48, 80),
    ).train()
    x = torch.randn(1, 3, 48, 80)
    out = [model(x) for _ in range(2)]
    assert torch.equal(out[0], out[1])  # the same frequencies at every forward, for q and k alike
    assert torch.equal(model.pos_schemes["gridpe"].directions, before)
    assert not any(p.requires_grad for p in model.pos_schemes.parameters())
    assert torch.equal(simplex_directions(5, 2, seed=3), before)


def test_state_dict_round_trip():
    source, target = _gridpe(seed=1), _gridpe(seed=2)
    assert "directions" in source.state_dict()
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    target.load_state_dict(torch.load(buffer))
    assert torch.equal(target.directions, source.directions)
    assert torch.equal(target.frequencies(), source.frequencies())


def test_directions_stay_fp32_under_a_low_precision_cast():
    scheme = _gridpe()
    freqs = scheme.frequencies()
    scheme.to(torch.bfloat16)
    assert scheme.directions.dtype == torch.float32
    assert torch.equal(scheme.frequencies(), freqs)


def test_extrapolation_modes_scale_the_frequencies():
    scheme = _gridpe(grid_size=(3, 5), extrapolation="pi")
    freqs, mscale = scheme.scaled_frequencies((6, 5))
    base = scheme.frequencies()
    assert torch.allclose(freqs[..., 0, :], base[..., 0, :] / 2) and torch.equal(freqs[..., 1, :], base[..., 1, :])
    for mode in ("ntk", "yarn"):
        scaled, _ = _gridpe(grid_size=(3, 5), extrapolation=mode).scaled_frequencies((6, 10))
        assert (scaled.abs() <= base.abs() + 1e-7).all() and not torch.allclose(scaled, base)
        assert (scaled[base == 0] == 0).all()  # leftover pairs stay still


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="omega0"):
        _gridpe(omega0=0.0)
    with pytest.raises(ValueError, match="ratio"):
        _gridpe(ratio=1.0)
    with pytest.raises(TypeError, match="seed"):
        _gridpe(seed=1.5)
    with pytest.raises(ValueError, match="seed"):
        _gridpe(seed=-1)
    with pytest.raises(ValueError, match="module"):  # head_dim 4: 2 pairs, a 2D module needs 3
        _gridpe(dim=8, num_heads=2)
    with pytest.raises(ValueError, match="ndim"):
        _gridpe(ndim=4)
