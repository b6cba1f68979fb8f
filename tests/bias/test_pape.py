import math
from dataclasses import replace

import pytest
import timm
import torch
import torch.nn.functional as F

import visionpe
from visionpe.attention import PositionContext
from visionpe.grid import grid_coords

GRID = (3, 5)


def _inputs(scheme, grid, prefix=1, batch=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    n = prefix + math.prod(grid)
    q, k = (torch.randn(batch, scheme.num_heads, n, scheme.head_dim, generator=generator) for _ in range(2))
    return q, k, torch.randn(batch, n, scheme.dim, generator=generator)


def _positions(grid, prefix):
    """The positions the bias sees: index coordinates, prefix tokens one step before the first patch."""
    coords = grid_coords(grid)
    return torch.cat((torch.full((prefix, len(grid)), -1.0), coords))


def _explicit_beta(scheme, grid, prefix, tokens, layer):
    """β_ij written pair by pair: (B, h, T, T)."""
    r = _positions(grid, prefix)
    n = r.shape[0]
    if hasattr(scheme, "parabolas"):
        h, p = scheme.num_heads, scheme.parabolas
        w = scheme.position[layer].view(h, p, -1)  # (h, P, D_r)
        ab = (tokens @ scheme.ab[layer].t()).view(tokens.shape[0], n, 2, h, p)
        a, b = F.softplus(ab[:, :, 0]), ab[:, :, 1]  # (B, T, h, P)
    else:
        a = F.softplus(tokens @ scheme.curvature[layer].t())  # (B, T, h)
        s = scheme.scales[layer]
    beta = torch.zeros(tokens.shape[0], scheme.num_heads, n, n)
    for i in range(n):
        for j in range(n):
            delta = r[i] - r[j]
            if hasattr(scheme, "parabolas"):
                proj = w @ delta  # (h, P)
                beta[:, :, i, j] = (-a[:, i] * proj**2 + b[:, i] * proj).sum(-1)
            else:
                beta[:, :, i, j] = -a[:, i] * s**2 * delta.square().sum()
    return beta


def _randomise(scheme, std=0.3):
    with torch.no_grad():
        for param in scheme.parameters():
            param.normal_(0, std)
    return scheme


@pytest.mark.parametrize("name", ["pape", "pape_ri"])
@pytest.mark.parametrize("prefix", [0, 1])
def test_augmented_scores_add_the_explicit_parabolas(name, prefix):
    options = {"parabolas": 8} if name == "pape" else {}
    scheme = visionpe.create_pos_embed(name, dim=32, num_heads=2, depth=2, **options)
    q, k, tokens = _inputs(scheme, GRID, prefix)
    state = scheme.prepare(GRID, prefix)
    q_aug, k_aug = scheme.augment_qk(q, k, state, 1, tokens=tokens)
    assert q_aug.shape[-1] == k_aug.shape[-1] == scheme.augmented_dim and scheme.augmented_dim % 8 == 0
    assert torch.equal(q_aug[..., : scheme.head_dim], q) and torch.equal(k_aug[..., : scheme.head_dim], k)
    beta = _explicit_beta(scheme, GRID, prefix, tokens, 1)
    assert beta.abs().amax() > 1  # the bias is not negligible
    scores = q_aug @ k_aug.transpose(-2, -1)
    torch.testing.assert_close(scores, q @ k.transpose(-2, -1) + beta, atol=1e-5, rtol=1e-5)
    # the explicit bias is β on logits already divided by sqrt(head_dim) (the reference's scale)
    bias = scheme.attn_bias(q, k, state, 1, tokens=tokens)
    torch.testing.assert_close(bias, beta / math.sqrt(scheme.head_dim), atol=1e-5, rtol=1e-5)
    rows = scheme.attn_bias(q[:, :, 2:9], k, state, 1, rows=slice(2, 9), tokens=tokens)
    torch.testing.assert_close(rows, bias[:, :, 2:9])
    assert beta.diagonal(dim1=-2, dim2=-1).abs().amax() == 0
    torch.testing.assert_close(bias.diagonal(dim1=-2, dim2=-1), torch.zeros_like(bias[..., 0]), atol=1e-5, rtol=0)


def test_widths_of_the_augmented_heads():
    # the quadratic form of the offset: 1 + 3 + 2 channels in 2D (the reference's plain version: 3P + 2 = 152)
    widths = {
        ("pape", 2, 8): 72,
        ("pape", 2, 1): 64 + 6,
        ("pape", 3, 1): 64 + 10,
        ("pape_ri", 2, 8): 72,  # the reference's 69, padded
        ("pape_ri", 2, 1): 64 + 4,
        ("pape_ri", 3, 1): 64 + 5,
    }
    for (name, ndim, pad), width in widths.items():
        scheme = visionpe.create_pos_embed(name, dim=768, num_heads=12, ndim=ndim, pad_multiple=pad)
        assert scheme.augmented_dim == width, (name, ndim, pad)
    pape = visionpe.create_pos_embed("pape", dim=768, num_heads=12)
    assert pape.position[0].numel() + pape.ab[0].numel() == 1_200 + 921_600  # per layer, as the paper's ViT-B


@pytest.mark.parametrize("prefix", ["corner", "zero"])
def test_prefix_tokens(prefix):
    scheme = visionpe.create_pos_embed("pape", dim=32, num_heads=2, parabolas=6, prefix=prefix)
    q, k, tokens = _inputs(scheme, GRID, 2)
    bias = scheme.attn_bias(q, k, scheme.prepare(GRID, 2), 0, tokens=tokens)
    beta = _explicit_beta(scheme, GRID, 2, tokens, 0) / math.sqrt(scheme.head_dim)
    if prefix == "corner":  # every prefix token at the corner: a parabolic bias like any token
        torch.testing.assert_close(bias, beta, atol=1e-5, rtol=1e-5)
        assert bias[:, :, 0, 2:].abs().amin() > 0
    else:
        assert (bias[:, :, :2] == 0).all() and (bias[:, :, :, :2] == 0).all()
        torch.testing.assert_close(bias[:, :, 2:, 2:], beta[:, :, 2:, 2:], atol=1e-5, rtol=1e-5)


def _embedded(small, large, offset):
    """Token index in ``large`` of every patch of ``small`` placed with its corner at ``offset``."""
    coords = grid_coords(small).long() + torch.tensor(offset)
    return coords[:, 0] * large[1] + coords[:, 1]


@pytest.mark.parametrize("name", ["pape", "pape_ri"])
def test_patch_logits_depend_on_offsets_only(name):
    # the 3 x 5 grid inside a 5 x 8 grid, same tokens: the patch pairs get the same bias
    options = {"parabolas": 6} if name == "pape" else {}
    scheme = visionpe.create_pos_embed(name, dim=32, num_heads=2, **options)
    q, k, tokens = _inputs(scheme, GRID, 0)
    small = scheme.attn_bias(q, k, scheme.prepare(GRID, 0), 0, tokens=tokens)
    index = _embedded(GRID, (5, 8), (2, 1))
    big_tokens = torch.randn(2, 40, 32).index_copy(1, index, tokens)
    big_q = torch.zeros(2, 2, 40, 16)
    big = scheme.attn_bias(big_q, big_q, scheme.prepare((5, 8), 0), 0, tokens=big_tokens)
    torch.testing.assert_close(big[:, :, index][..., index], small, atol=1e-5, rtol=1e-5)
    # and any shift of the coordinates (prefix tokens included) leaves every logit as it is
    state = scheme.prepare(GRID, 1)
    q, k, tokens = _inputs(scheme, GRID, 1)
    shifted = replace(state, positions=state.positions + torch.tensor([3.25, -7.5]))
    torch.testing.assert_close(
        scheme.attn_bias(q, k, shifted, 0, tokens=tokens),
        scheme.attn_bias(q, k, state, 0, tokens=tokens),
        atol=1e-4,
        rtol=1e-5,
    )


def test_rotation_invariance_of_pape_ri_only():
    # a 90-degree turn: the 3 x 5 grid becomes 5 x 3, patch (y, x) goes to (x, 2 - y), tokens travel with patches
    coords = grid_coords(GRID).long()
    index = coords[:, 1] * 3 + (2 - coords[:, 0])
    for name, invariant in (("pape_ri", True), ("pape", False)):
        scheme = _randomise(visionpe.create_pos_embed(name, dim=32, num_heads=2, depth=1))
        q, k, tokens = _inputs(scheme, GRID, 0)
        bias = scheme.attn_bias(q, k, scheme.prepare(GRID, 0), 0, tokens=tokens)
        turned_tokens = torch.zeros_like(tokens).index_copy(1, index, tokens)
        turned = scheme.attn_bias(q, k, scheme.prepare((5, 3), 0), 0, tokens=turned_tokens)
        turned = turned[:, :, index][..., index]
        assert torch.allclose(turned, bias, atol=1e-4, rtol=1e-5) == invariant, name
    # a general rotation of continuous coordinates (every token, prefix included)
    scheme = _randomise(visionpe.create_pos_embed("pape_ri", dim=32, num_heads=2))
    state = scheme.prepare(GRID, 1)
    angle = torch.tensor(0.7)
    rotation = torch.stack((torch.stack((angle.cos(), -angle.sin())), torch.stack((angle.sin(), angle.cos()))))
    q, k, tokens = _inputs(scheme, GRID, 1)
    rotated = replace(state, positions=state.positions @ rotation.T)
    torch.testing.assert_close(
        scheme.attn_bias(q, k, rotated, 0, tokens=tokens),
        scheme.attn_bias(q, k, state, 0, tokens=tokens),
        atol=1e-5,
        rtol=1e-5,
    )


def test_rotation_scales_are_a_seeded_buffer():
    scheme = visionpe.create_pos_embed("pape_ri", dim=32, num_heads=4, depth=3, ndim=3)
    assert "scales" in dict(scheme.named_buffers()) and "scales" in scheme.state_dict()
    assert scheme.scales.shape == (3, 4) and (scheme.scales.abs() <= 3**-0.5).all()
    again = visionpe.create_pos_embed("pape_ri", dim=32, num_heads=4, depth=3, ndim=3)
    assert torch.equal(again.scales, scheme.scales)
    other = visionpe.create_pos_embed("pape_ri", dim=32, num_heads=4, depth=3, ndim=3, seed=1)
    assert not torch.equal(other.scales, scheme.scales)


def test_video_grid():
    scheme = visionpe.create_pos_embed("pape", dim=32, num_heads=2, parabolas=4, ndim=3)
    grid = (2, 2, 3)
    q, k, tokens = _inputs(scheme, grid, 1)
    state = scheme.prepare(grid, 1)
    q_aug, k_aug = scheme.augment_qk(q, k, state, 0, tokens=tokens)
    beta = _explicit_beta(scheme, grid, 1, tokens, 0)
    torch.testing.assert_close(q_aug @ k_aug.transpose(-2, -1), q @ k.transpose(-2, -1) + beta, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="3D grids"):
        scheme.prepare((3, 5), 1)


@pytest.mark.parametrize("name", ["pape", "pape_ri"])
def test_model_attention_equals_naive_attention_with_the_explicit_bias(name):
    torch.manual_seed(0)
    kwargs = {"parabolas": 6} if name == "pape" else {}
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224",
        pos_embed=name,
        pos_embed_kwargs=kwargs,
        embed_dim=32,
        num_heads=2,
        depth=2,
        img_size=(48, 80),
    ).eval()
    scheme = _randomise(model.pos_schemes[name])
    x = torch.randn(2, 16, 32)  # cls + 3 x 5 patches, the input of block 1's attention
    attn = model.blocks[1].attn
    ctx = PositionContext(bias=[(scheme, scheme.prepare(GRID, 1))])
    with torch.no_grad():
        out = attn(x, pos=ctx)
        q, k, v = attn.qkv(x).view(2, 16, 3, 2, 16).permute(2, 0, 3, 1, 4)
        logits = q @ k.transpose(-2, -1) / math.sqrt(16) + scheme.attn_bias(q, k, ctx.bias[0][1], 1, tokens=x)
        naive = attn.proj((logits.softmax(-1) @ v).transpose(1, 2).reshape(2, 16, 32))
    torch.testing.assert_close(out, naive, atol=1e-5, rtol=1e-5)
    # the whole model through the explicit bias path (augments_qk off) gives the same features
    images = torch.randn(2, 3, 48, 80)
    with torch.no_grad():
        augmented = model.forward_features(images)
        scheme.augments_qk = False
        explicit = model.forward_features(images)
    torch.testing.assert_close(augmented, explicit, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["pape", "pape_ri"])
def test_augmented_heads_run_on_the_flash_kernel(name):
    # the fused kernels take one head width for q, k and v: v gets zero channels to the augmented width, so the
    # attention runs on the flash kernel alone (no N x N attention matrix), with the same outputs and gradients as
    # the explicit bias path
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224", pos_embed=name, embed_dim=32, num_heads=2, depth=2, img_size=(48, 80)
    )
    _randomise(model.pos_schemes[name])
    images = torch.randn(2, 3, 48, 80)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash = model.forward_features(images)
        flash.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.pos_schemes[name].augments_qk = False
    explicit = model.forward_features(images)
    explicit.square().mean().backward()
    torch.testing.assert_close(flash, explicit, atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_gradients_reach_every_parameter_and_stay_fp32_under_autocast():
    scheme = visionpe.create_pos_embed("pape", dim=32, num_heads=2, parabolas=4, depth=2)
    q, k, tokens = _inputs(scheme, GRID, 1)
    q_aug, k_aug = scheme.augment_qk(q, k, scheme.prepare(GRID, 1), 1, tokens=tokens)
    (q_aug @ k_aug.transpose(-2, -1)).sin().sum().backward()
    assert scheme.position.grad[1].abs().amin() > 0 and scheme.ab.grad[1].abs().sum() > 0
    assert (scheme.position.grad[0] == 0).all()  # the other layer's weights are not used
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q_aug, _ = scheme.augment_qk(q.bfloat16(), k.bfloat16(), scheme.prepare(GRID, 1), 1, tokens=tokens)
    assert q_aug.dtype == torch.bfloat16
    reference, _ = scheme.augment_qk(q, k, scheme.prepare(GRID, 1), 1, tokens=tokens)
    # one rounding of fp32 channels (the projection of the tokens runs in bf16 as any linear layer)
    torch.testing.assert_close(q_aug.float(), reference, atol=0.1, rtol=0.03)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="parabolas"):
        visionpe.create_pos_embed("pape", dim=32, num_heads=2, parabolas=0)
    with pytest.raises(ValueError, match="prefix"):
        visionpe.create_pos_embed("pape", dim=32, num_heads=2, prefix="cls")
    with pytest.raises(ValueError, match="ndim"):
        visionpe.create_pos_embed("pape_ri", dim=32, num_heads=2, ndim=1)
    with pytest.raises(ValueError, match="pad_multiple"):
        visionpe.create_pos_embed("pape_ri", dim=32, num_heads=2, pad_multiple=0)
    scheme = visionpe.create_pos_embed("pape", dim=32, num_heads=2, parabolas=4)
    q, k, tokens = _inputs(scheme, GRID, 1)
    state = scheme.prepare(GRID, 1)
    with pytest.raises(ValueError, match="tokens"):
        scheme.augment_qk(q, k, state, 0)
    with pytest.raises(ValueError, match=r"tokens must be a floating-point \(B=2, 16, 32\)"):
        scheme.augment_qk(q, k, state, 0, tokens=tokens[:, 1:])
    with pytest.raises(ValueError, match=r"q must have shape \(B, 2, 16, 16\)"):
        scheme.augment_qk(q[:, :, 1:], k, state, 0, tokens=tokens)
    with pytest.raises(ValueError, match="layer"):
        scheme.augment_qk(q, k, state, 1, tokens=tokens)
