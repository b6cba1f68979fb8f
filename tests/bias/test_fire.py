import math

import pytest
import torch

import visionpe
from visionpe.grid import grid_coords

GRID = (3, 5)


def _fire(**kwargs):
    torch.manual_seed(0)
    scheme = visionpe.create_pos_embed("fire", dim=32, num_heads=2, depth=2, **kwargs)
    with torch.no_grad():  # move c and the threshold away from their init, so that they matter
        scheme.c.copy_(torch.tensor([0.1, 0.3])[:, None].expand_as(scheme.c))
        scheme.threshold.copy_(torch.tensor([1.0, 1.3])[:, None].expand_as(scheme.threshold))
    return scheme


def _bias(scheme, grid, prefix=1, layer=1, rows=None):
    state = scheme.prepare(grid, prefix)
    n = prefix + math.prod(grid)
    q = torch.zeros(1, 2, n if rows is None else len(range(n)[rows]), 8)
    return scheme.attn_bias(q, torch.zeros(1, 2, n, 8), state, layer, rows=rows)[0]


def _mlp(scheme, layer, group, x):
    """The block's MLP of one group on inputs x (..., I): (..., h)."""
    hidden = torch.relu(x @ scheme.fc1_weight[layer, group].T + scheme.fc1_bias[layer, group])
    return hidden @ scheme.fc2_weight[layer, group].T + scheme.fc2_bias[layer, group]


def _psi(x, c):
    return torch.log(torch.abs(c * x) + 1)


def _explicit(scheme, grid, layer):
    """The 2D rule pair by pair, with D_i found by searching every patch: (h, N, N)."""
    coords = grid_coords(grid)
    n = len(coords)
    out = torch.zeros(scheme.num_heads, n, n)

    def dist(d, a):
        if scheme.distance == "euclidean":
            return d.norm()
        if scheme.distance == "manhattan":
            return d.abs().sum()
        return d[a].abs()

    for a in range(scheme.num_groups):
        c = scheme.c[layer, a]
        threshold = abs(scheme.threshold[layer, a] * scheme.base_threshold[a])
        for i in range(n):
            if scheme.normalizer == "farthest":  # searched over every patch
                far = max(dist(coords[i] - coords[m], a) for m in range(n))
            else:
                far = dist(coords[i] - coords[0], a)
            denominator = _psi(torch.maximum(far, threshold), c) + 1e-6
            for j in range(n):
                delta = coords[i] - coords[j]
                if scheme.signed:
                    parts = [delta[a]] if scheme.distance == "axis" else [delta[0], delta[1]]
                    x = torch.stack([torch.sign(p) * _psi(p, c) for p in parts]) / denominator
                else:
                    x = (_psi(dist(delta, a), c) / denominator)[None]
                out[:, i, j] += _mlp(scheme, layer, a, x)
    return out


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"distance": "manhattan"},
        {"distance": "axis"},
        {"signed": True},
        {"distance": "axis", "signed": True},
        {"normalizer": "origin"},
    ],
    ids=str,
)
def test_bias_equals_the_rule_pair_by_pair(kwargs):
    scheme = _fire(grid_size=(8, 10), **kwargs)  # a smaller grid than the training one: the threshold binds
    with torch.no_grad():
        bias = _bias(scheme, GRID)
        torch.testing.assert_close(bias[:, 1:, 1:], _explicit(scheme, GRID, 1), atol=1e-5, rtol=1e-5)
    assert (bias[:, 0] == 0).all() and (bias[:, :, 0] == 0).all()  # prefix rows and columns


def test_threshold_is_a_quarter_of_the_training_grid():
    assert visionpe.create_pos_embed("fire", dim=32, num_heads=2, grid_size=(7, 9)).base_threshold.item() == 2.5
    manhattan = visionpe.create_pos_embed("fire", dim=32, num_heads=2, grid_size=(7, 9), distance="manhattan")
    assert manhattan.base_threshold.item() == 3.5
    axis = visionpe.create_pos_embed("fire", dim=32, num_heads=2, grid_size=(7, 9), distance="axis")
    assert axis.base_threshold.tolist() == [1.5, 2.0]
    assert "base_threshold" in axis.state_dict()  # the training grid's, kept with the model


@pytest.mark.parametrize("kwargs", [{}, {"distance": "manhattan"}, {"distance": "axis"}, {"signed": True}], ids=str)
@pytest.mark.parametrize("grid", [(3, 5), (6, 4), (1, 7)])
def test_normalised_distances_are_at_most_one(kwargs, grid):
    scheme = _fire(grid_size=(4, 4), **kwargs)
    for layer in (0, 1):
        ratios = scheme.normalized_distances(scheme.prepare(grid, 1), layer)
        assert ratios.shape[-2:] == (math.prod(grid), math.prod(grid))
        assert ratios.abs().amax() <= 1
    if not scheme.signed:  # the farthest patch reaches 1 on a grid larger than the threshold
        big = scheme.normalized_distances(scheme.prepare((9, 9), 0), 0)
        torch.testing.assert_close(big.abs().amax(), torch.tensor(1.0), atol=1e-5, rtol=0)


def test_one_row_grid_with_causal_pairs_equals_the_appendix_code():
    # the paper's appendix code on a sequence of length 9: positions 0..8, normaliser max(i, L), L = |l L0|
    scheme = _fire(grid_size=(1, 9), normalizer="origin")
    layer = 1
    c, multiplier, base = scheme.c[layer, 0], scheme.threshold[layer, 0], scheme.base_threshold[0]
    with torch.no_grad():
        positions = torch.arange(9.0)
        relative = positions[:, None] - positions[None, :]
        threshold = torch.abs(multiplier * base)
        normalizer = torch.max(positions, threshold)[:, None]
        relative = torch.log(torch.abs(c * relative) + 1)
        normalizer = torch.log(torch.abs(c * normalizer) + 1)
        reference = _mlp(scheme, layer, 0, (relative / (normalizer + 1e-6))[..., None]).permute(2, 0, 1)
        bias = _bias(scheme, (1, 9), prefix=0, layer=layer)
    assert threshold > 2  # the threshold binds for the first queries
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    torch.testing.assert_close(bias[:, causal], reference[:, causal], atol=1e-6, rtol=1e-5)
    # the default normaliser is the farthest patch of the whole row: the same rule with max(i, W - 1 - i)
    default = _fire(grid_size=(1, 9))
    with torch.no_grad():
        far = torch.maximum(positions, 8 - positions)
        normalizer = torch.log(torch.abs(c * torch.max(far, threshold)) + 1)[:, None]
        reference = _mlp(default, layer, 0, (relative / (normalizer + 1e-6))[..., None]).permute(2, 0, 1)
        torch.testing.assert_close(_bias(default, (1, 9), prefix=0, layer=layer), reference, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("prefix", [0, 2])
def test_chunked_rows_and_pieces_equal_the_full_bias(prefix):
    scheme = _fire(signed=True)
    n = prefix + 15
    with torch.no_grad():
        full = _bias(scheme, GRID, prefix)
        chunks = torch.cat([_bias(scheme, GRID, prefix, rows=slice(s, s + 4)) for s in range(0, n, 4)], 1)
    # to float rounding: the MLP's matmuls over fewer rows may take another kernel (another summation order)
    torch.testing.assert_close(chunks, full, atol=1e-6, rtol=1e-6)
    # pieces of the hidden layer (3 rows each), checkpointed when autograd records them: the same bias and gradients
    weights = torch.randn(full.shape)
    (_bias(scheme, GRID, prefix) * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in scheme.named_parameters()}
    scheme.zero_grad()
    scheme.hidden_chunk_bytes = 3 * 15 * 32 * 4  # rows x keys x width x fp32
    pieces = _bias(scheme, GRID, prefix)
    torch.testing.assert_close(pieces, full, atol=1e-6, rtol=1e-6)
    (pieces * weights).sum().backward()
    for name, p in scheme.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], atol=1e-6, rtol=1e-5, msg=name)


def test_gradients_reach_c_threshold_and_mlp():
    scheme = _fire(grid_size=(8, 10))  # the 3 x 5 grid is smaller than the training one: the threshold binds
    (_bias(scheme, GRID).sin().sum()).backward()
    for name, param in scheme.named_parameters():
        assert param.grad[1].abs().sum() > 0, name  # the block asked for
        assert (param.grad[0] == 0).all(), name  # one FIRE per block


def test_bias_is_fp32_then_rounded_under_autocast():
    scheme = _fire()
    state = scheme.prepare(GRID, 1)
    q = torch.zeros(1, 2, 16, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bias = scheme.attn_bias(q, q, state, 1)
    assert bias.dtype == torch.bfloat16
    assert torch.equal(bias, scheme.attn_bias(q.float(), q.float(), state, 1).bfloat16())


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="distance"):
        visionpe.create_pos_embed("fire", dim=32, num_heads=2, distance="cosine")
    with pytest.raises(ValueError, match="normalizer"):
        visionpe.create_pos_embed("fire", dim=32, num_heads=2, normalizer="query")
    with pytest.raises(TypeError, match="signed"):
        visionpe.create_pos_embed("fire", dim=32, num_heads=2, signed=1)
    with pytest.raises(ValueError, match="init_c"):
        visionpe.create_pos_embed("fire", dim=32, num_heads=2, init_c=0.0)
    with pytest.raises(ValueError, match="grid_size"):
        visionpe.create_pos_embed("fire", dim=32, num_heads=2, grid_size=(2, 3, 4))
    scheme = visionpe.create_pos_embed("fire", dim=32, num_heads=2)
    q = torch.zeros(1, 2, 16, 8)
    with pytest.raises(ValueError, match="layer"):
        scheme.attn_bias(q, q, scheme.prepare(GRID, 1), 1)
    with pytest.raises(ValueError, match=r"q and k must have shape \(B, 2, 16, head_dim\)"):
        scheme.attn_bias(q[:, :, 1:], q, scheme.prepare(GRID, 1), 0)
