import pytest
import timm
import torch

import visionpe
from visionpe.grid import grid_coords
from visionpe.rotary.rope_axial import RopeAxial
from visionpe.rotary.rope_mixed import RopeMixed
from visionpe.rotary.string_base import BasisRotation
from visionpe.rotary.string_cayley import StringCayley, cayley_orthogonal, fold_string_
from visionpe.rotary.string_circulant import StringCirculant, circulant_generator, circulant_string_fft, fourier_basis

from ..model_checks import check_forward_backward

SCHEMES = ["string_cayley", "string_circulant"]


def _perturbed(name, ndim=2, dim=128, num_heads=2, depth=2):
    scheme = visionpe.create_pos_embed(name, dim=dim, num_heads=num_heads, depth=depth, ndim=ndim)
    with torch.no_grad():
        for p in scheme.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return scheme


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("ndim, grid", [(2, (3, 5)), (3, (2, 3, 4))])
def test_exact_relative_property(name, ndim, grid):
    scheme = _perturbed(name, ndim)
    coords = grid_coords(grid)
    q, k = torch.randn(2, 1, 2, len(coords), 64).unbind(0)
    shift = torch.tensor([3.5, -2.0, 7.25][:ndim])
    scores = scheme.rotate(q, coords, 1) @ scheme.rotate(k, coords, 1).transpose(-1, -2)
    shifted = scheme.rotate(q, coords + shift, 1) @ scheme.rotate(k, coords + shift, 1).transpose(-1, -2)
    assert torch.allclose(scores, shifted, atol=1e-5)
    # and it is a real position encoding: scores depend on the positions
    assert not torch.allclose(scores, q @ k.transpose(-1, -2), atol=1e-2)


@pytest.mark.parametrize("name", SCHEMES)
def test_rotation_is_orthogonal_and_relative(name):
    scheme = _perturbed(name)
    a, b = torch.tensor([[1.0, 2.0]]), torch.tensor([[4.0, -1.0]])
    # R(r) as a matrix: rotate every basis vector (tokens share the position)
    basis = torch.eye(64).expand(1, 2, 64, 64)
    r_a = scheme.rotate(basis, a.expand(64, 2)).transpose(-1, -2)  # columns R e_i
    r_b = scheme.rotate(basis, b.expand(64, 2)).transpose(-1, -2)
    r_diff = scheme.rotate(basis, (b - a).expand(64, 2)).transpose(-1, -2)
    assert torch.allclose(r_a.transpose(-1, -2) @ r_a, torch.eye(64).expand(1, 2, 64, 64), atol=1e-5)
    if name == "string_circulant":  # R(r) = exp(sum r_k L_k) with commuting L_k: R(a)^T R(b) = R(b - a)
        assert torch.allclose(r_a.transpose(-1, -2) @ r_b, r_diff, atol=1e-5)
    else:  # R(r) = RoPE(r) P: R(a)^T R(b) = P^T R(b - a)
        p = scheme.string_basis()[0]
        assert torch.allclose(r_a.transpose(-1, -2) @ r_b, p.transpose(-1, -2) @ r_diff, atol=1e-5)


def test_cayley_orthogonal_equals_explicit_inverse():
    a = torch.randn(3, 16, 16, dtype=torch.float64)
    skew = a - a.transpose(-1, -2)
    eye = torch.eye(16, dtype=torch.float64)
    p = cayley_orthogonal(skew)
    assert torch.allclose(p.double(), (eye - skew) @ torch.linalg.inv(eye + skew), atol=1e-5)
    assert torch.allclose(p.transpose(-1, -2) @ p, eye.float().expand(3, 16, 16), atol=1e-5)


def test_cayley_identity_p_is_rope_axial():
    string = visionpe.create_pos_embed("string_cayley", dim=128, num_heads=2, depth=2)
    rope = RopeAxial(128, 2)
    coords = grid_coords((3, 5))
    x = torch.randn(2, 2, 15, 64)
    assert torch.equal(string.string_basis(), torch.eye(64).expand(2, 2, 64, 64))
    assert torch.allclose(string.rotate(x, coords, 1), rope.rotate(x, coords), atol=1e-6)


def test_circulant_fft_equals_dense_matrix_exp_and_scheme():
    scheme = _perturbed("string_circulant")
    coords = grid_coords((3, 5))
    x = torch.randn(2, 2, 15, 64)
    c = scheme.first_columns[1].detach()  # (heads, ndim, d)
    dense = torch.linalg.matrix_exp(
        torch.einsum("na,haij->hnij", coords.double(), circulant_generator(c.double())).contiguous()
    )
    expected = torch.einsum("hnij,bhnj->bhni", dense, x.double()).float()
    assert torch.allclose(circulant_string_fft(x, coords, c), expected, atol=1e-5)
    assert torch.allclose(scheme.rotate(x, coords, 1), expected, atol=1e-5)
    assert torch.allclose(scheme.rotate_fft(x, coords, 1), expected, atol=1e-5)
    f = fourier_basis(64)
    assert torch.allclose(f @ f.T, torch.eye(64), atol=1e-6)


@pytest.mark.parametrize("name", SCHEMES)
def test_fold_string_keeps_outputs(name):
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224", pos_embed=name, depth=2, embed_dim=64, num_heads=2, dynamic_img_size=True
    ).eval()
    with torch.no_grad():
        for p in model.pos_schemes[name].parameters():
            p.add_(0.05 * torch.randn_like(p))
    images = torch.randn(2, 3, 96, 160)
    with torch.no_grad():
        before = model(images)
        before_feats = model.forward_features(images)
        fold_string_(model)
        assert bool(model.pos_schemes[name].folded)
        after = model(images)
        after_feats = model.forward_features(images)
    assert torch.allclose(before, after, atol=1e-5)
    assert torch.allclose(before_feats, after_feats, atol=1e-5)  # prefix tokens included
    with pytest.raises(ValueError, match="already folded"):
        fold_string_(model)


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("qkv_bias", [True, False])
def test_attention_folds_the_basis_into_the_projection(name, qkv_bias, monkeypatch):
    # every forward multiplies W_q, W_k (and their biases) by P instead of every token's q and k: the same
    # outputs and the same gradients for every parameter as the activation product
    torch.manual_seed(0)
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224",
        pos_embed=name,
        depth=2,
        embed_dim=64,
        num_heads=2,
        qkv_bias=qkv_bias,
        dynamic_img_size=True,
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    images = torch.randn(2, 3, 48, 80)
    params = [p for p in model.parameters() if p.requires_grad]
    folded_bases = []
    project = visionpe.PosAttention.project_qkv

    def spy(self, x, basis=None):
        folded_bases.append(basis is not None)
        return project(self, x, basis)

    monkeypatch.setattr(visionpe.PosAttention, "project_qkv", spy)
    results = []
    for fold in (True, False):
        if not fold:
            # the rotation applies P itself: nothing for attention to fold
            monkeypatch.setattr(BasisRotation, "basis", property(lambda self: None))
            monkeypatch.setattr(BasisRotation, "without_basis", lambda self: self)
        out = model(images)
        results.append((out, torch.autograd.grad(out.square().sum(), params)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results[-1] += (model(images).float(),)
    assert folded_bases == [True, True, True, True, False, False, False, False]
    (out_fold, grads_fold, bf16_fold), (out_apply, grads_apply, bf16_apply) = results
    torch.testing.assert_close(out_fold, out_apply, rtol=1e-4, atol=1e-5)
    for got, expected in zip(grads_fold, grads_apply, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-4)
    assert torch.isfinite(bf16_fold).all() and (bf16_fold - bf16_apply).abs().max() < 0.05


def test_fold_string_rejects_models_without_string_or_with_qk_norm():
    plain = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="rope_axial", depth=1)
    with pytest.raises(ValueError, match="no STRING scheme"):
        fold_string_(plain)
    normed = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="string_cayley", depth=1, qk_norm=True)
    with pytest.raises(ValueError, match="qk_norm"):
        fold_string_(normed)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        fold_string_("model")


@pytest.mark.parametrize("name", SCHEMES)
def test_bad_input(name):
    scheme = visionpe.create_pos_embed(name, dim=128, num_heads=2)
    x = torch.randn(1, 2, 15, 64)
    with pytest.raises(ValueError, match="2 axes, got coords with 3 axes"):
        scheme.rotate(x, grid_coords((1, 3, 5)))
    with pytest.raises(ValueError, match="supports 2D grids"):
        scheme.coords((2, 3, 4))
    with pytest.raises(ValueError, match="coords has 6 rows"):
        scheme.rotate(x, grid_coords((2, 3)))
    with pytest.raises(ValueError, match="base must be positive"):
        visionpe.create_pos_embed(name, dim=128, num_heads=2, base=-1.0)
    with pytest.raises(ValueError, match="extrapolation must be one of"):
        visionpe.create_pos_embed(name, dim=128, num_heads=2, grid_size=(14, 14), extrapolation="bogus")


BAD_SHAPES = [
    ({"dim": 98, "num_heads": 3}, ValueError, "dim must be divisible by num_heads, got dim=98, num_heads=3"),
    ({"num_heads": 0}, ValueError, "num_heads must be .*got 0"),
    ({"num_heads": 2.0}, TypeError, r"num_heads must be .*got float \(2\.0\)"),
    ({"dim": True}, TypeError, r"dim must be .*got bool \(True\)"),
    ({"depth": 0}, ValueError, "depth must be .*got 0"),
    ({"depth": -1}, ValueError, "depth must be .*got -1"),
]


@pytest.mark.parametrize(
    "cls, kwargs, error, match",
    [(cls, *case) for cls in (StringCayley, StringCirculant, RopeAxial, RopeMixed) for case in BAD_SHAPES]
    + [
        (StringCayley, {"dim": 8, "ndim": 3}, ValueError, r"head_dim must be >= 8 for ndim=3 .*got head_dim=4"),
        (StringCirculant, {"dim": 8}, ValueError, r"head_dim must be >= 6 for ndim=2 .*got head_dim=4"),
        (StringCirculant, {"dim": 8, "ndim": 3}, ValueError, r"head_dim must be >= 8 for ndim=3 .*got head_dim=4"),
    ],
)
def test_bad_construction(cls, kwargs, error, match):
    # built directly, not through create_pos_embed (the same check_model_shape, in LinearRotary)
    with pytest.raises(error, match=match):
        cls(**{"dim": 128, "num_heads": 2, **kwargs})


def test_rotate_fft_bad_input():
    scheme = StringCirculant(128, 2, depth=2)
    x = torch.randn(1, 2, 15, 64)
    with pytest.raises(ValueError, match="coords has 6 rows but x has 15 tokens"):
        scheme.rotate_fft(x, grid_coords((2, 3)))
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, depth=2\)"):
        scheme.rotate_fft(x, grid_coords((3, 5)), 2)
    with pytest.raises(ValueError, match="x must be a non-empty"):
        scheme.rotate_fft(torch.randn(1, 2, 15, 32), grid_coords((3, 5)))


@pytest.mark.parametrize("name", ["string_cayley", "string_circulant"])
@pytest.mark.parametrize("size", [(224, 224), (384, 384), (160, 288)])
def test_model_forward_backward(name, size):
    check_forward_backward(name, size)
