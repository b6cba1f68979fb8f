import math

import pytest
import torch

import visionpe
from visionpe.grid import grid_coords


def _logits(scheme, q, k, grid, prefix=1, layer=0):
    return (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + scheme.attn_bias(
        q, k, scheme.prepare(grid, prefix), layer
    )


def test_unit_shape_gives_alibi2d_attention_probabilities():
    torch.manual_seed(0)
    bam = visionpe.create_pos_embed("bam", dim=48, num_heads=6, depth=2)
    alibi = visionpe.create_pos_embed("alibi2d", dim=48, num_heads=6)
    for grid in ((3, 5), (7, 4)):
        n = 1 + math.prod(grid)
        q, k = torch.randn(2, 6, n, 8), torch.randn(2, 6, n, 8)
        torch.testing.assert_close(
            _logits(bam, q, k, grid, layer=1).softmax(-1), _logits(alibi, q, k, grid).softmax(-1), atol=1e-6, rtol=0
        )


@pytest.mark.parametrize("distance", ["euclidean", "manhattan", "axis"])
def test_bias_equals_the_formula_pair_by_pair(distance):
    torch.manual_seed(0)
    bam = visionpe.create_pos_embed("bam", dim=32, num_heads=4, distance=distance, learn_scale=True, learn_loc=True)
    with torch.no_grad():
        for param in bam.parameters():
            param.add_(0.2 * torch.rand_like(param))
    coords = grid_coords((3, 4))
    delta = (coords[:, None] - coords[None]).abs()
    d = {"euclidean": delta.square().sum(-1).sqrt()[None], "manhattan": delta.sum(-1)[None]}.get(
        distance, delta.permute(2, 0, 1)
    )[:, None]
    s, mu, beta = (p[0][..., None, None] for p in (bam.scale, bam.loc, bam.beta))
    expected = (-(((s * d + mu).abs() + 1e-5) ** beta)).sum(0)
    q = torch.zeros(1, 4, 13, 8)
    bias = bam.attn_bias(q, q, bam.prepare((3, 4), 1), 0)[0]
    torch.testing.assert_close(bias[:, 1:, 1:], expected)
    # prefix pairs: the value at distance 0 (a per-head constant)
    zero = (-((mu.abs() + 1e-5) ** beta)).sum(0)[:, 0, 0]
    torch.testing.assert_close(bias[:, 0, :], zero[:, None].expand(-1, 13))


def test_only_the_shape_is_learned_by_default_and_gradients_are_finite():
    bam = visionpe.create_pos_embed("bam", dim=32, num_heads=2, shape_init=2.0)
    assert [name for name, _ in bam.named_parameters()] == ["beta"]
    assert (bam.beta == 2.0).all() and bam.no_weight_decay() == {"beta"}
    assert set(bam.state_dict()) == {"beta", "scale", "loc"}
    learned = visionpe.create_pos_embed("bam", dim=32, num_heads=2, learn_scale=True, learn_loc=True)
    assert learned.no_weight_decay() == {"beta", "scale", "loc"} and set(learned.state_dict()) == set(bam.state_dict())
    q = torch.zeros(1, 2, 13, 8)
    bam.attn_bias(q, q, bam.prepare((3, 4), 1), 0).sum().backward()
    assert torch.isfinite(bam.beta.grad).all() and bam.beta.grad.abs().sum() > 0


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="shape_init must be a positive finite number"):
        visionpe.create_pos_embed("bam", dim=32, num_heads=2, shape_init=0.0)
    with pytest.raises(TypeError, match="learn_scale must be a bool"):
        visionpe.create_pos_embed("bam", dim=32, num_heads=2, learn_scale="yes")
    with pytest.raises(ValueError, match="distance must be one of"):
        visionpe.create_pos_embed("bam", dim=32, num_heads=2, distance="l3")
