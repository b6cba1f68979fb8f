"""STRING on RGB-D images (Schenck et al., ICML 2025): r = (z, y, x), z a learned linear function of each patch's
mean depth."""

import pytest
import timm
import torch

import visionpe
from visionpe.rotary.string_cayley import StringCayley
from visionpe.rotary.string_circulant import StringCirculant

from ..model_checks import random_keep

NAMES = ["string_cayley", "string_circulant"]
SMALL = dict(img_size=(48, 80), embed_dim=64, depth=2, num_heads=2, num_classes=5)


def _model(name, **kw):
    torch.manual_seed(0)
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224", pos_embed=name, pos_embed_kwargs={"depth_coords": True}, **{**SMALL, **kw}
    )
    with torch.no_grad():  # P away from the identity, z away from the raw depth
        for param in model.pos_schemes.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def _depth(batch=2, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 1, 48, 80, generator=gen) * 3


def test_depth_positions_are_the_projected_mean_depth_and_the_grid():
    scheme = StringCayley(64, 2, depth_coords=True)
    with torch.no_grad():
        scheme.depth_proj.weight.fill_(2.0)
        scheme.depth_proj.bias.fill_(-1.0)
    coords = scheme.coords((2, 3))
    depth = torch.arange(12.0).view(2, 6)
    pos = scheme.depth_positions(coords, depth)
    assert pos.shape == (2, 6, 3)
    torch.testing.assert_close(pos[..., 0], 2 * depth - 1)
    torch.testing.assert_close(pos[..., 1:], coords.expand(2, -1, -1))
    assert scheme.ndims == (2,) and scheme.ndim == 3  # a 2D image grid, rotated in 3 axes


def test_model_pools_the_depth_map_per_patch():
    model = _model("string_cayley")
    depth = _depth()
    seen = []
    original = model.pos_schemes["string_cayley"].depth_positions
    model.pos_schemes["string_cayley"].depth_positions = lambda c, d: seen.append(d) or original(c, d)
    model(torch.randn(2, 3, 48, 80), depth=depth)
    expected = depth.view(2, 3, 16, 5, 16).mean((2, 4)).flatten(1)  # 16 x 16 patches, row-major
    torch.testing.assert_close(seen[0], expected)
    seen.clear()
    model(torch.randn(2, 3, 48, 80), depth=depth[:, 0])  # (B, H, W) is taken as well
    torch.testing.assert_close(seen[0], expected)


@pytest.mark.parametrize("name", NAMES)
def test_a_constant_depth_shift_leaves_a_prefix_free_model_unchanged(name):
    # exactly relative in z as in (y, x); with a cls token the unrotated prefix would see the shift
    model = _model(name, class_token=False, global_pool="avg").eval()
    with torch.no_grad():  # sharper attention than at init, so that positions show in the output
        for block in model.blocks:
            block.attn.qkv.weight.mul_(10)
    x, depth = torch.randn(2, 3, 48, 80), _depth()
    out = model.forward_features(x, depth=depth)
    torch.testing.assert_close(model.forward_features(x, depth=depth + 2.5), out, atol=1e-5, rtol=1e-5)
    assert (model.forward_features(x, depth=depth * 4) - out).abs().max() > 1e-3  # relative depth matters


@pytest.mark.parametrize("name", NAMES)
def test_batched_depth_equals_one_image_at_a_time(name):
    model = _model(name).eval()
    x, depth = torch.randn(3, 3, 48, 80), _depth(3)
    out = model(x, depth=depth)
    for i in range(3):
        torch.testing.assert_close(model(x[i : i + 1], depth=depth[i : i + 1]), out[i : i + 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme_cls", [StringCayley, StringCirculant])
def test_per_sample_state_rotates_as_rotate_does(scheme_cls):
    torch.manual_seed(0)
    scheme = scheme_cls(64, 2, depth=2, depth_coords=True)
    with torch.no_grad():
        for param in scheme.parameters():
            param.add_(0.1 * torch.randn_like(param))
    pos = scheme.depth_positions(scheme.coords((3, 5)), torch.rand(2, 15) * 4)
    state = scheme.prepare(pos, num_prefix_tokens=1)
    qk = torch.randn(2, 2, 2, 16, 32)
    for layer in (0, 1):
        out = scheme.apply(qk, state, layer)
        for b in range(2):
            # patch tokens: R(r) x, the public rotation at the (z, y, x) positions of sample b
            # (Circulant-STRING's apply leaves out its fixed output basis Q^T, which cancels in q . k)
            got = out[:, b, :, 1:]
            out_basis = scheme.rotation_output_basis()
            got = got if out_basis is None else got @ out_basis
            torch.testing.assert_close(got, scheme.rotate(qk[:, b, :, 1:], pos[b].detach(), layer))
    # the in-place fused path (P folded into the projection) rotates each image by its own tables too
    qkv = torch.randn(2 * 16, 3 * 64)
    rotation = state.layer(0).without_basis()
    q, k, _ = rotation.rotate_qkv(qkv.clone(), 2, 2)
    expected = rotation.rotate(qkv.view(2, 16, 3, 2, 32)[:, :, :2].permute(2, 0, 3, 1, 4))
    torch.testing.assert_close(torch.stack((q, k)), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_depth_model_trains_in_fp32_and_bf16_with_gradients_to_the_depth_layer(name):
    model = _model(name).train()
    x, depth = torch.randn(2, 3, 48, 80), _depth()
    model(x, depth=depth).square().mean().backward()
    proj = model.pos_schemes[name].depth_proj
    assert proj.weight.grad.abs().sum() > 0 and proj.bias.grad is not None
    # a position parameter: kept out of weight decay, as the frequencies and P are
    assert {f"pos_schemes.{name}.depth_proj.weight", f"pos_schemes.{name}.depth_proj.bias"} <= model.no_weight_decay()
    for param in model.pos_schemes.parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all()
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, depth=depth)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    out.float().square().mean().backward()
    assert torch.isfinite(proj.weight.grad).all()


def test_patch_dropout_with_depth_gathers_each_samples_tables():
    from visionpe.tokens import gather_tokens, scatter_tokens

    torch.manual_seed(0)
    scheme = StringCayley(64, 2, depth=2, depth_coords=True)
    pos = scheme.depth_positions(scheme.coords((3, 5)), torch.rand(3, 15) * 4)
    state = scheme.prepare(pos, num_prefix_tokens=1)
    keep = random_keep()
    qk = torch.randn(2, 3, 2, 8, 32)
    fast = state.layer(1).rotate_kept(qk, keep)
    slow = gather_tokens(scheme.apply(scatter_tokens(qk, keep, 16), state, 1), keep)
    torch.testing.assert_close(fast, slow, atol=1e-6, rtol=1e-5)
    model = _model("string_cayley", patch_drop_rate=0.5).train()
    out = model(torch.randn(2, 3, 48, 80), depth=_depth())
    assert out.shape == (2, 5) and torch.isfinite(out).all()


def test_folded_cayley_with_depth_equals_unfolded():
    model = _model("string_cayley").eval()
    x, depth = torch.randn(2, 3, 48, 80), _depth()
    out = model(x, depth=depth)
    visionpe.fold_string_(model)
    torch.testing.assert_close(model(x, depth=depth), out, atol=1e-5, rtol=1e-5)


def test_bad_depth_input():
    model = _model("string_cayley")
    x = torch.randn(2, 3, 48, 80)
    with pytest.raises(ValueError, match=r"call it with depth=\(B, 1, H, W\).*got depth=None"):
        model(x)
    with pytest.raises(ValueError, match=r"depth must be \(B, 1, H, W\) or \(B, H, W\) matching the images"):
        model(x, depth=torch.rand(2, 1, 48, 64))
    with pytest.raises(ValueError, match=r"depth must be \(B, 1, H, W\)"):
        model(x, depth=torch.rand(1, 1, 48, 80))
    with pytest.raises(TypeError, match="depth must be a floating-point tensor"):
        model(x, depth=torch.ones(2, 1, 48, 80, dtype=torch.long))
    with pytest.raises(ValueError, match="patch_depth must be finite"):
        model(x, depth=torch.full((2, 1, 48, 80), float("nan")))
    plain = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="string_cayley", **SMALL)
    with pytest.raises(ValueError, match=r"depth= is read by STRING with depth_coords=True only"):
        plain(x, depth=_depth())


def test_bad_depth_construction():
    with pytest.raises(ValueError, match="depth_coords=True adds a depth axis to 2D image grids"):
        StringCayley(64, 2, ndim=3, depth_coords=True)
    with pytest.raises(ValueError, match="needs extrapolation='none'"):
        StringCirculant(64, 2, grid_size=(3, 5), extrapolation="ntk", depth_coords=True)
    with pytest.raises(TypeError, match="depth_coords must be a bool"):
        StringCayley(64, 2, depth_coords="yes")
    scheme = StringCayley(64, 2, grid_size=(3, 5), depth_coords=True)
    with pytest.raises(ValueError, match="depth_coords=True has no extrapolation mode"):
        scheme.set_extrapolation("pi", train_grid_size=(3, 5))
    with pytest.raises(ValueError, match=r"needs \(z, y, x\) positions from depth_positions"):
        scheme.prepare(scheme.coords((3, 5)))
    with pytest.raises(ValueError, match=r"patch_depth must be a floating-point \(B, N=15\)"):
        scheme.depth_positions(scheme.coords((3, 5)), torch.rand(2, 14))
    with pytest.raises(ValueError, match="was built without depth_coords=True"):
        StringCayley(64, 2).depth_positions(torch.zeros(15, 2), torch.rand(2, 15))


def test_depth_model_compiles_to_one_graph():
    # fullgraph: the depth checks that read values (finiteness) are eager-only, the pooling and tables traceable
    model = _model("string_cayley").eval()
    x, depth = torch.randn(2, 3, 48, 80), _depth()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, depth=depth), model(x, depth=depth), atol=1e-5, rtol=1e-5)
