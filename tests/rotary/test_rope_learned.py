import math

import pytest
import timm
import torch

import visionpe
from visionpe.grid import grid_coords

from .helpers import relative_error


@pytest.mark.parametrize("ndim,grid", [(2, (3, 5)), (3, (2, 3, 5))])
def test_equals_rope_axial_at_init(ndim, grid):
    learned = visionpe.create_pos_embed("rope_learned", dim=128, num_heads=2, depth=2, ndim=ndim)
    axial = visionpe.create_pos_embed("rope_axial", dim=128, num_heads=2, depth=2, ndim=ndim)
    assert torch.allclose(learned.frequencies(), axial.frequencies(), rtol=1e-6, atol=0)
    x = torch.randn(2, 2, math.prod(grid), 64)
    coords = grid_coords(grid)
    for layer in range(2):
        assert torch.allclose(learned.rotate(x, coords, layer), axial.rotate(x, coords, layer), atol=1e-6)


def test_custom_axis_pairs_and_base_follow_rope_axial():
    opts = dict(dim=64, num_heads=2, base=10000.0, axis_pairs=(6, 10))
    learned = visionpe.create_pos_embed("rope_learned", **opts)
    axial = visionpe.create_pos_embed("rope_axial", **opts)
    assert torch.allclose(learned.frequencies(), axial.frequencies(), rtol=1e-6, atol=0)
    # the log-frequency of pair n of axis a is -n / n_a * log(base)
    expected = torch.cat([-torch.arange(n) / n * math.log(10000.0) for n in (6, 10)])
    assert torch.allclose(learned.log_freqs[0], expected, atol=1e-5)


@pytest.mark.parametrize("ndim,grid", [(2, (3, 5)), (3, (2, 3, 5))])
def test_relative_invariance_with_random_log_frequencies(ndim, grid):
    rope = visionpe.create_pos_embed("rope_learned", dim=64, num_heads=2, depth=2, ndim=ndim, share="layer")
    with torch.no_grad():
        rope.log_freqs.normal_(-1.0, 1.0)
    shift = torch.tensor([3.0, -4.0, 7.0][:ndim])
    for layer in range(2):
        assert relative_error(rope.rotate, grid_coords(grid), shift, head_dim=32, layer=layer) < 1e-4


def test_each_pair_reads_one_axis_with_positive_frequency():
    rope = visionpe.create_pos_embed("rope_learned", dim=64, num_heads=2)
    with torch.no_grad():
        rope.log_freqs.normal_()
    freqs = rope.frequencies()[0, 0]  # (ndim, pairs)
    assert ((freqs > 0).sum(0) == 1).all()
    # pairs [0, 8) read x (column 1), pairs [8, 16) read y (column 0)
    assert (freqs[1, :8] > 0).all() and (freqs[0, 8:] > 0).all()
    assert torch.allclose(freqs.sum(0), rope.log_freqs[0].exp())


def test_gradient_reaches_log_frequencies_through_the_model():
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224",
        pos_embed="rope_learned",
        embed_dim=32,
        depth=2,
        num_heads=2,
        num_classes=3,
        img_size=(48, 80),
    )
    model(torch.randn(2, 3, 48, 80)).square().sum().backward()
    grad = model.pos_schemes["rope_learned"].log_freqs.grad
    assert grad is not None and grad.shape == (1, 8) and grad.abs().sum() > 0
    assert "pos_schemes.rope_learned.log_freqs" in model.no_weight_decay()


def test_share_layer_gives_one_set_per_layer():
    model_wide = visionpe.create_pos_embed("rope_learned", dim=64, num_heads=2, depth=3)
    per_layer = visionpe.create_pos_embed("rope_learned", dim=64, num_heads=2, depth=3, share="layer")
    assert model_wide.log_freqs.shape == (1, 16) and per_layer.log_freqs.shape == (3, 16)
    with torch.no_grad():
        per_layer.log_freqs[1] -= 1.0  # layer 1 turns e times slower
    coords, x = grid_coords((3, 5)), torch.randn(1, 2, 15, 32)
    assert torch.allclose(per_layer.rotate(x, coords, 0), model_wide.rotate(x, coords, 0), atol=1e-6)
    assert torch.allclose(per_layer.rotate(x, coords, 2), model_wide.rotate(x, coords, 2), atol=1e-6)
    assert not torch.allclose(per_layer.rotate(x, coords, 1), model_wide.rotate(x, coords, 1), atol=1e-3)
    assert torch.allclose(per_layer.frequencies()[1], model_wide.frequencies()[0] / math.e, rtol=1e-5)


def test_extrapolation_scales_the_learned_frequencies_like_rope_axial():
    opts = dict(dim=64, num_heads=2, grid_size=(3, 5))
    for mode in ("pi", "ntk", "yarn"):
        learned = visionpe.create_pos_embed("rope_learned", extrapolation=mode, **opts)
        axial = visionpe.create_pos_embed("rope_axial", extrapolation=mode, **opts)
        (f_learned, m_learned), (f_axial, m_axial) = (
            learned.scaled_frequencies((6, 9)),
            axial.scaled_frequencies((6, 9)),
        )
        assert torch.allclose(f_learned, f_axial, rtol=1e-5, atol=0) and m_learned == m_axial
        assert not torch.allclose(f_learned, learned.frequencies())  # the larger grid did scale them


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="share"):
        visionpe.create_pos_embed("rope_learned", dim=64, num_heads=2, share="head")
    with pytest.raises(ValueError, match="axis_pairs"):
        visionpe.create_pos_embed("rope_learned", dim=64, num_heads=2, axis_pairs=(8, 8, 0))
    with pytest.raises(ValueError, match="base"):
        visionpe.create_pos_embed("rope_learned", dim=64, num_heads=2, base=-1.0)
    with pytest.raises(TypeError, match="rotate_values"):
        visionpe.create_pos_embed("rope_learned", dim=64, num_heads=2, rotate_values=1)
