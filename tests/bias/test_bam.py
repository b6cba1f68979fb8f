import math

import pytest
import torch

import visionpe
from visionpe.bias.alibi2d import alibi_slopes
from visionpe.grid import grid_coords


def _logits(scheme, q, k, grid, prefix=1, layer=0):
    return (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + scheme.attn_bias(
        q, k, scheme.prepare(grid, prefix), layer
    )


@pytest.mark.parametrize("form", ["scale_outside", "scale_inside"])
def test_unit_shape_gives_alibi2d_attention_probabilities(form):
    torch.manual_seed(0)
    bam = visionpe.create_pos_embed("bam", dim=48, num_heads=6, depth=2, form=form)
    alibi = visionpe.create_pos_embed("alibi2d", dim=48, num_heads=6)
    for grid in ((3, 5), (7, 4)):
        n = 1 + math.prod(grid)
        q, k = torch.randn(2, 6, n, 8), torch.randn(2, 6, n, 8)
        torch.testing.assert_close(
            _logits(bam, q, k, grid, layer=1).softmax(-1), _logits(alibi, q, k, grid).softmax(-1), atol=1e-6, rtol=0
        )


@pytest.mark.parametrize("form", ["scale_outside", "scale_inside"])
@pytest.mark.parametrize("distance", ["euclidean", "manhattan", "axis"])
def test_bias_equals_the_formula_pair_by_pair(distance, form):
    torch.manual_seed(0)
    bam = visionpe.create_pos_embed("bam", dim=32, num_heads=4, distance=distance, form=form)
    with torch.no_grad():
        for param in bam.parameters():
            param.add_(0.2 * torch.rand_like(param))
    coords = grid_coords((3, 4))
    delta = (coords[:, None] - coords[None]).abs()
    d = {"euclidean": delta.square().sum(-1).sqrt()[None], "manhattan": delta.sum(-1)[None]}.get(
        distance, delta.permute(2, 0, 1)
    )[:, None]
    beta, sigma, loc = (p[0][..., None, None] for p in (bam.shape, bam.scale, bam.loc))
    mu = torch.sinh(loc) * 2

    def prior(d):
        if form == "scale_outside":
            return -sigma.exp() * ((d + mu).abs() + 1e-5) ** beta
        return -((sigma.exp() * (d + mu).abs() + 1e-5) ** beta)

    q = torch.zeros(1, 4, 13, 8)
    bias = bam.attn_bias(q, q, bam.prepare((3, 4), 1), 0)[0]
    torch.testing.assert_close(bias[:, 1:, 1:], prior(d).sum(0))
    # prefix pairs: the value at distance 0 (a per-head constant)
    torch.testing.assert_close(bias[:, 0, :], prior(torch.zeros(1)).sum(0)[:, 0, 0, None].expand(-1, 13))


def _released_prior(state, seq_len, form):
    """The released AttentionPrior's bias (1, h, L, L) on the signed offsets k - q of a sequence, written from its
    formula: models/bam.py (scale outside the power) and inference_models/bam.py (inside)."""
    positions = torch.arange(seq_len).float()
    offsets = (positions[None, :] - positions[:, None])[None, None]
    shifted = offsets - (state["loc"].exp() - (-state["loc"]).exp())
    if form == "scale_outside":
        return -((shifted.abs() + 1e-5) ** state["shape"]) * state["scale"].exp()
    return -(((shifted * state["scale"].exp()).abs() + 1e-5) ** state["shape"])


@pytest.mark.parametrize("form", ["scale_outside", "scale_inside"])
def test_a_released_prior_gives_the_released_bias_on_every_causal_pair(form):
    # a state dict in the released layout, with learned-looking values: shape, log-scale and location per head
    torch.manual_seed(1)
    heads, length = 4, 9
    state = {
        "shape": 0.5 + 1.5 * torch.rand(1, heads, 1, 1),
        "scale": alibi_slopes(heads).log().reshape(1, heads, 1, 1) + 0.3 * torch.randn(1, heads, 1, 1),
        "loc": 0.4 * torch.randn(1, heads, 1, 1),
    }
    bam = visionpe.create_pos_embed("bam", dim=32, num_heads=heads, depth=3, form=form)
    bam.load_released_prior(state)
    q = torch.zeros(1, heads, length, 8)
    causal = torch.ones(length, length).tril().bool()
    expected = _released_prior(state, length, form)[0]
    for layer in range(3):  # one prior for every block, as released by default
        bias = bam.attn_bias(q, q, bam.prepare((1, length), 0), layer)[0]
        torch.testing.assert_close(bias[:, causal], expected[:, causal])
    # per block: block 1 takes its own prior, the others keep theirs
    per_layer = visionpe.create_pos_embed("bam", dim=32, num_heads=heads, depth=3, form=form, per_layer=True)
    per_layer.load_released_prior(state, layer=1)
    own = per_layer.attn_bias(q, q, per_layer.prepare((1, length), 0), 1)[0]
    torch.testing.assert_close(own[:, causal], expected[:, causal])
    assert not torch.allclose(per_layer.attn_bias(q, q, per_layer.prepare((1, length), 0), 0)[0], own)


def test_the_two_forms_differ_once_the_shape_is_learned():
    state = {
        "shape": torch.full((1, 2, 1, 1), 2.0),
        "scale": torch.full((1, 2, 1, 1), -1.0),
        "loc": torch.zeros(1, 2, 1, 1),
    }
    biases = []
    for form in ("scale_outside", "scale_inside"):
        bam = visionpe.create_pos_embed("bam", dim=16, num_heads=2, form=form)
        bam.load_released_prior(state)
        q = torch.zeros(1, 2, 4, 8)
        biases.append(bam.attn_bias(q, q, bam.prepare((2, 2), 0), 0))
    assert (biases[0] - biases[1]).abs().max() > 0.1


def test_shape_scale_and_location_are_learned_by_default_and_gradients_are_finite():
    bam = visionpe.create_pos_embed("bam", dim=32, num_heads=2, depth=4, shape_init=2.0)
    assert [name for name, _ in bam.named_parameters()] == ["shape", "scale", "loc"]
    assert bam.shape.shape == (1, 1, 2) and (bam.shape == 2.0).all()  # one prior for every block
    torch.testing.assert_close(bam.scale.exp()[0, 0], alibi_slopes(2))
    assert bam.no_weight_decay() == {"shape", "scale", "loc"}
    fixed = visionpe.create_pos_embed("bam", dim=32, num_heads=2, learn_scale=False, learn_loc=False)
    assert [name for name, _ in fixed.named_parameters()] == ["shape"] and fixed.no_weight_decay() == {"shape"}
    assert set(fixed.state_dict()) == set(bam.state_dict()) == {"shape", "scale", "loc"}
    per_layer = visionpe.create_pos_embed("bam", dim=32, num_heads=2, depth=4, per_layer=True)
    assert per_layer.shape.shape == (4, 1, 2)
    q = torch.zeros(1, 2, 13, 8)
    bam.attn_bias(q, q, bam.prepare((3, 4), 1), 3).sum().backward()
    for param in bam.parameters():
        assert torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="shape_init must be a positive finite number"):
        visionpe.create_pos_embed("bam", dim=32, num_heads=2, shape_init=0.0)
    with pytest.raises(TypeError, match="learn_scale must be a bool"):
        visionpe.create_pos_embed("bam", dim=32, num_heads=2, learn_scale="yes")
    with pytest.raises(ValueError, match="distance must be one of"):
        visionpe.create_pos_embed("bam", dim=32, num_heads=2, distance="l3")
    with pytest.raises(ValueError, match="form must be one of"):
        visionpe.create_pos_embed("bam", dim=32, num_heads=2, form="outside")
    bam = visionpe.create_pos_embed("bam", dim=32, num_heads=2, depth=2)
    with pytest.raises(ValueError, match=r"state_dict must hold \['shape', 'scale', 'loc'\], missing \['loc'\]"):
        bam.load_released_prior({"shape": torch.ones(1, 2, 1, 1), "scale": torch.zeros(1, 2, 1, 1)})
    with pytest.raises(ValueError, match=r"state_dict\['scale'\] must hold one value per head \(2\)"):
        bam.load_released_prior({"shape": torch.ones(1, 2, 1, 1), "scale": torch.ones(3), "loc": torch.zeros(2)})
    assert (bam.shape == 1).all()  # nothing written
    with pytest.raises(ValueError, match="layer=1 needs per_layer=True"):
        bam.load_released_prior({name: torch.ones(1, 2, 1, 1) for name in ("shape", "scale", "loc")}, layer=1)
