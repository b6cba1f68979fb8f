"""HARoPE: q' = R(r) M q, k' = R(r) M^-T k with M = U diag(s) V^T per layer and head, against explicit formulas."""

import math

import pytest
import timm
import torch

import visionpe
from visionpe.grid import grid_coords
from visionpe.rotary.harope import HARoPE, fold_harope_, harope_matrices
from visionpe.rotary.rope_axial import RopeAxial

GRID = (3, 5)  # non-square: an x/y swap shows
IMAGE = (48, 80)  # GRID at patch 16
SMALL = dict(depth=2, embed_dim=64, num_heads=2, num_classes=4, dynamic_img_size=True)  # head_dim 32


def _perturb_(scheme, scale=0.3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in scheme.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return scheme


def _model(pos_embed="harope", **kw):
    torch.manual_seed(0)
    return timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=pos_embed, **{**SMALL, **kw})


def _naive_frequencies(head_dim, base, row_first):
    """(2, head_dim // 2) rows (y, x): a quarter of the channels (d/4 pairs) per axis, theta_n = base^(-4n/d)."""
    quarter = head_dim // 4
    theta = torch.tensor([base ** (-4 * n / head_dim) for n in range(quarter)], dtype=torch.float64)
    freqs = torch.zeros(2, head_dim // 2, dtype=torch.float64)
    first, second = (0, 1) if row_first else (1, 0)  # which coordinate column the first d/4 pairs read
    freqs[first, :quarter], freqs[second, quarter:] = theta, theta
    return freqs


def _naive_rope_matrices(coords, freqs):
    """(N, d, d) block-diagonal rotations: pair j (channels 2j, 2j+1) turns by sum_a r_a F[a, j]."""
    angles = coords.double() @ freqs  # (N, d/2)
    n, pairs = angles.shape
    rot = torch.zeros(n, 2 * pairs, 2 * pairs, dtype=torch.float64)
    for j in range(pairs):
        c, s = angles[:, j].cos(), angles[:, j].sin()
        rot[:, 2 * j, 2 * j], rot[:, 2 * j, 2 * j + 1] = c, -s
        rot[:, 2 * j + 1, 2 * j], rot[:, 2 * j + 1, 2 * j + 1] = s, c
    return rot


def _naive_maps(scheme, layer):
    """M and M^-T (num_heads, d, d) in float64, M^-T as the explicit inverse transposed."""
    a_u, a_v = scheme.A_u[layer].detach().double(), scheme.A_v[layer].detach().double()
    u = torch.linalg.matrix_exp((a_u - a_u.mT) / 2)
    v = torch.linalg.matrix_exp((a_v - a_v.mT) / 2)
    s = torch.log1p(scheme.sigma[layer].detach().double().exp()) + 1e-6  # softplus
    m = u @ torch.diag_embed(s) @ v.mT
    return m, torch.linalg.inv(m).mT


def _naive_rotate(x, coords, rot_freqs, basis):
    """R(r) B x for x (B, heads, N, d), B (heads, d, d): explicit matrices, float64."""
    rot = _naive_rope_matrices(coords, rot_freqs)
    return torch.einsum("nij,hjk,bhnk->bhni", rot, basis, x.double())


@pytest.mark.parametrize("base", [10000.0, 100.0])
def test_at_init_rotate_equals_rope_axial(base):
    harope = HARoPE(64, 2, depth=2, base=base)
    rope = RopeAxial(64, 2, base=base)
    coords = grid_coords(GRID)
    x = torch.randn(2, 2, len(coords), 32)
    expected = rope.rotate(x, coords)
    for layer in (0, 1):
        for key in (False, True):
            torch.testing.assert_close(harope.rotate(x, coords, layer, key=key), expected, rtol=1e-5, atol=1e-5)
    # and through the scheme interface: both rows of the stacked q/k
    state = harope.prepare(coords)
    torch.testing.assert_close(harope.apply(torch.stack((x, x)), state, 1), torch.stack((expected, expected)))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_at_init_model_equals_rope_axial_model(qk_norm):
    model = _model(qk_norm=qk_norm).eval()
    rope = _model("rope_axial", qk_norm=qk_norm, pos_embed_kwargs={"base": 10000.0}).eval()
    # the same weights: rope_axial has no position parameters or persistent buffers
    weights = {k: v for k, v in model.state_dict().items() if not k.startswith("pos_schemes.")}
    rope.load_state_dict(weights)
    images = torch.randn(2, 3, *IMAGE)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(images), rope.forward_features(images), rtol=1e-5, atol=1e-5)
        # the maps matter once they move from the identity
        _perturb_(model.pos_schemes["harope"])
        assert not torch.allclose(model.forward_features(images), rope.forward_features(images), atol=1e-3)


@pytest.mark.parametrize("pair_order", ["xy", "yx"])
def test_rotate_equals_explicit_formula(pair_order):
    scheme = _perturb_(HARoPE(64, 2, depth=2, pair_order=pair_order))
    coords = grid_coords(GRID)
    x = torch.randn(2, 2, len(coords), 32)
    # "yx": the reference's layout, the first d/4 pairs read the row
    freqs = _naive_frequencies(32, 10000.0, row_first=pair_order == "yx")
    for layer in (0, 1):
        m, m_inv_t = _naive_maps(scheme, layer)
        for key, basis in ((False, m), (True, m_inv_t)):
            expected = _naive_rotate(x, coords, freqs, basis).float()
            torch.testing.assert_close(scheme.rotate(x, coords, layer, key=key), expected, rtol=1e-4, atol=1e-5)


def test_pair_orders_differ_by_a_channel_permutation():
    xy, yx = HARoPE(64, 2), HARoPE(64, 2, pair_order="yx")
    coords = grid_coords(GRID)
    x = torch.randn(1, 2, len(coords), 32)
    # swap the x and y halves of the pairs: yx's rotation is xy's in permuted channels
    perm = torch.arange(32).roll(16)
    torch.testing.assert_close(yx.rotate(x, coords), xy.rotate(x[..., perm], coords)[..., perm.argsort()])
    assert not torch.allclose(yx.rotate(x, coords), xy.rotate(x, coords), atol=1e-3)


def test_maps_match_explicit_svd_form_and_inverse():
    scheme = _perturb_(HARoPE(64, 2, depth=2))
    bases = scheme.qk_bases()
    assert bases.shape == (2, 2, 2, 32, 32) and bases.dtype == torch.float32
    eye = torch.eye(32).expand(2, 32, 32)
    for layer in (0, 1):
        m, m_inv_t = _naive_maps(scheme, layer)
        torch.testing.assert_close(bases[layer, 0], m.float(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(bases[layer, 1], m_inv_t.float(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(bases[layer, 0].mT @ bases[layer, 1], eye, rtol=0, atol=1e-5)  # M^T M^-T = I
    # the init: s = softplus(softplus^-1(1)) + 1e-6
    m, m_inv_t = harope_matrices(torch.zeros(3, 3), torch.zeros(3, 3), torch.full((3,), math.log(math.e - 1)))
    torch.testing.assert_close(m, torch.eye(3) * (1 + 1e-6))
    torch.testing.assert_close(m_inv_t, torch.eye(3) / (1 + 1e-6))


@pytest.mark.parametrize("ndim, grid, shift", [(2, GRID, [3.5, -2.0]), (3, (2, 3, 4), [1.0, 2.5, -4.0])])
def test_exactly_relative_with_learned_maps(ndim, grid, shift):
    scheme = _perturb_(HARoPE(64, 2, depth=2, ndim=ndim))
    coords = grid_coords(grid)
    q, k = torch.randn(2, 1, 2, len(coords), 32).unbind(0)

    def logits(c):
        return scheme.rotate(q, c, 1) @ scheme.rotate(k, c, 1, key=True).mT

    scores = logits(coords)
    torch.testing.assert_close(logits(coords + torch.tensor(shift)), scores, rtol=1e-4, atol=1e-4)
    # at equal positions the logit is q . k (M^T M^-T = I); elsewhere the positions matter
    same = torch.einsum("bhnd,bhnd->bhn", q, k)
    torch.testing.assert_close(scores.diagonal(dim1=-2, dim2=-1), same, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(scores, q @ k.mT, atol=1e-2)


def _attention_by_hand(model, tokens, qk_norm):
    """Block 0's attention output for ``tokens`` (B, 1 + N, C): q' = R M q, k' = R M^-T k (after q/k norm), cls
    token not rotated, explicit rotation matrices and softmax."""
    attn, scheme = model.blocks[0].attn, model.pos_schemes["harope"]
    b, t, _ = tokens.shape
    q, k, v = attn.qkv(tokens).reshape(b, t, 3, 2, 32).permute(2, 0, 3, 1, 4)
    if qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    m, m_inv_t = _naive_maps(scheme, 0)
    freqs = _naive_frequencies(32, 10000.0, row_first=False)
    coords = torch.cat((torch.zeros(1, 2), grid_coords(GRID)))  # the cls token: angle 0
    q, k = _naive_rotate(q, coords, freqs, m), _naive_rotate(k, coords, freqs, m_inv_t)
    probs = (q @ k.mT / math.sqrt(32)).softmax(-1)
    out = (probs @ v.double()).float().transpose(1, 2).reshape(b, t, 64)
    return attn.proj(out)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_equals_explicit_formula(qk_norm):
    # without q/k norm attention folds (M, M^-T) into the projection per forward; with it, M acts on the normalised
    # q and k (the reference's order)
    model = _model(qk_norm=qk_norm).eval()
    _perturb_(model.pos_schemes)
    if qk_norm:  # the norms' affine parameters too
        _perturb_(model.blocks[0].attn.q_norm, 0.1), _perturb_(model.blocks[0].attn.k_norm, 0.1, seed=1)
    ctx = model.position_context(GRID, torch.device("cpu"))
    tokens = torch.randn(2, 1 + math.prod(GRID), 64)
    with torch.no_grad():
        got = model.blocks[0].attn(tokens, pos=ctx)
        torch.testing.assert_close(got, _attention_by_hand(model, tokens, qk_norm), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_gradient_reaches_every_parameter(qk_norm):
    model = _model(qk_norm=qk_norm)
    scheme = model.pos_schemes["harope"]
    model(torch.randn(2, 3, *IMAGE)).square().sum().backward()
    for name in ("A_u", "A_v", "sigma"):
        grad = getattr(scheme, name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad[0].abs().sum() > 0, name
    # block 1 is the last to reach the logits, so both layers' maps get a gradient
    assert scheme.sigma.grad[1].abs().sum() > 0
    assert {"pos_schemes.harope.A_u", "pos_schemes.harope.A_v", "pos_schemes.harope.sigma"} <= model.no_weight_decay()
    per_layer = sum(p[0].numel() for p in scheme.parameters())
    assert per_layer == 2 * (2 * 32**2 + 32)  # h (2 d^2 + d)


def test_fold_keeps_outputs():
    model = _model().eval()
    assert model.blocks[0].attn.qkv.bias is not None  # the biases fold too
    _perturb_(model.pos_schemes["harope"])
    scheme = model.pos_schemes["harope"]
    images = torch.randn(2, 3, *IMAGE)
    with torch.no_grad():
        before, feats = model(images), model.forward_features(images)
        assert fold_harope_(model) is model
        assert scheme.is_folded and bool(scheme.folded)
        ctx = model.position_context(GRID, torch.device("cpu"))
        assert ctx.rotation(0).basis is None  # only the RoPE tables are left
        torch.testing.assert_close(model(images), before, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.forward_features(images), feats, rtol=1e-5, atol=1e-5)  # cls included
        # the flag travels with the checkpoint
        fresh = _model().eval()
        fresh.load_state_dict(model.state_dict())
        assert fresh.pos_schemes["harope"].is_folded
        torch.testing.assert_close(fresh(images), before, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="already folded"):
        fold_harope_(model)


def test_fold_refusals():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        fold_harope_("model")
    with pytest.raises(ValueError, match="no HARoPE scheme"):
        fold_harope_(_model("rope_axial", depth=1))
    with pytest.raises(ValueError, match="qk_norm=False"):
        fold_harope_(_model(depth=1, qk_norm=True))
    with pytest.raises(ValueError, match=r"first rotary scheme .*found RopeAxial before it"):
        fold_harope_(_model(["rope_axial", "harope"], depth=1))


def test_extrapolation_scales_the_inner_rope():
    harope = HARoPE(64, 2, grid_size=(3, 5), extrapolation="ntk")
    rope = RopeAxial(64, 2, base=10000.0, grid_size=(3, 5), extrapolation="ntk")
    coords = grid_coords((6, 7))
    x = torch.randn(1, 2, len(coords), 32)
    torch.testing.assert_close(harope.rotate(x, coords), rope.rotate(x, coords), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(harope.rotate(x, coords), RopeAxial(64, 2, base=10000.0).rotate(x, coords), atol=1e-3)


def test_low_precision_keeps_fp32_frequencies():
    scheme = HARoPE(64, 2).to(torch.bfloat16)
    assert scheme.freqs.dtype == torch.float32 and scheme.A_u.dtype == torch.bfloat16
    assert scheme.qk_bases().dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"base": -1.0}, ValueError, "base must be positive"),
        ({"pair_order": "xx"}, ValueError, r"pair_order must be one of \('xy', 'yx'\), got 'xx'"),
        ({"axis_pairs": (8, 8, 0)}, ValueError, r"axis_pairs\[2\] must be a positive int"),
        ({"axis_pairs": (4, 12, 0)[:2], "ndim": 3}, ValueError, "axis_pairs must have 3 entries for ndim=3"),
        ({"axis_pairs": (4, 8)}, ValueError, "axis_pairs must sum to head_dim // 2 = 16"),
        ({"ndim": 4}, ValueError, "ndim must be 2 or 3, got 4"),
        ({"dim": 72, "num_heads": 4}, ValueError, "head_dim must be divisible by 4"),
        ({"extrapolation": "bogus", "grid_size": (3, 5)}, ValueError, "extrapolation must be one of"),
    ],
)
def test_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        HARoPE(**{"dim": 64, "num_heads": 2, **kwargs})


def test_bad_input():
    scheme = HARoPE(64, 2, depth=2)
    x, coords = torch.randn(1, 2, 15, 32), grid_coords(GRID)
    with pytest.raises(TypeError, match=r"key must be a bool, got int \(1\)"):
        scheme.rotate(x, coords, key=1)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, depth=2\)"):
        scheme.rotate(x, coords, 2)
    with pytest.raises(ValueError, match=r"qk must stack q and k in front, .*got \(1, 2, 15, 32\)"):
        scheme.apply(x, scheme.prepare(coords), 0)
    with pytest.raises(ValueError, match=r"sigma \(\.\.\., d\) of the same d"):
        harope_matrices(torch.zeros(2, 4, 4), torch.zeros(2, 4, 4), torch.zeros(2, 3))
    with pytest.raises(TypeError, match="a_u must be a floating-point tensor"):
        harope_matrices(torch.zeros(4, 4, dtype=torch.long), torch.zeros(4, 4), torch.zeros(4))


def test_registered():
    scheme = visionpe.create_pos_embed("harope", dim=64, num_heads=2, depth=3)
    assert isinstance(scheme, HARoPE) and scheme.A_u.shape == (3, 2, 32, 32) and scheme.sigma.shape == (3, 2, 32)
