"""GTA: exact SE(3) invariance, the per-token formula written out, plain attention for equal cameras, and SO(2) logits
that depend on patch offsets only."""

import math

import pytest
import timm
import torch

import visionpe
from visionpe.attention import PosAttention, PositionContext
from visionpe.camera import Cameras, look_at, random_rigid

GRID = (2, 3)  # non-square: a swap of the two image axes shows
DIM, HEADS = 32, 2  # head_dim 16


def make_cameras(batch=2, views=3, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    eyes = torch.randn(batch, views, 3, generator=g, dtype=torch.float64)
    eyes = 3 * eyes / eyes.norm(dim=-1, keepdim=True)
    target = 0.3 * torch.randn(batch, views, 3, generator=g, dtype=torch.float64)
    k = torch.tensor([[30.0, 0, 18], [0, 30.0, 12], [0, 0, 1]], dtype=torch.float64).expand(batch, views, 3, 3)
    return Cameras(look_at(eyes, target), k.clone(), (24, 36)).to(dtype)


def gta(**opts):
    opts = {"dim": DIM, "num_heads": HEADS, "depth": 2, **opts}
    return visionpe.create_pos_embed("gta", **opts)


def qkv(cams, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (cams.batch_size, HEADS, cams.num_views * GRID[0] * GRID[1], DIM // HEADS)
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for _ in range(3)]


def logits(scheme, cams, q, k, v, layer=0):
    q, k, _ = scheme.prepare(cams, GRID).layer(layer).transform_qkv(q, k, v)
    return q @ k.transpose(-1, -2)


def attention(scheme, cams, x, seed=0):
    torch.manual_seed(seed)
    attn = PosAttention(DIM, HEADS, qkv_bias=True).to(x.dtype).eval()
    attn.layer = 1
    return attn(x, pos=PositionContext(camera=[(scheme, scheme.prepare(cams, GRID))]))


def perturb_one_view(cams, seed=5):
    w2c = cams.w2c.clone()
    w2c[:, 1] = w2c[:, 1] @ random_rigid(generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(w2c)
    return Cameras(w2c, cams.intrinsics, cams.image_size)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-5), (torch.float32, 1e-4)])
@pytest.mark.parametrize("opts", [{}, {"se3_channels": 8, "so2_channels": 4, "max_freq": (1.0, 0.5)}])
def test_logits_and_outputs_are_invariant_to_a_rigid_motion_of_the_world(dtype, tol, opts):
    scheme = gta(**opts).to(dtype)
    with torch.no_grad():
        scheme.trans_coeff.copy_(torch.tensor([0.3, 0.7]))  # translations that matter (0.01 at init)
    cams = make_cameras(dtype=dtype)
    world = random_rigid(generator=torch.Generator().manual_seed(2), dtype=dtype)
    moved = cams.transform(world)
    q, k, v = qkv(cams, dtype)
    for layer in (0, 1):
        torch.testing.assert_close(
            logits(scheme, moved, q, k, v, layer), logits(scheme, cams, q, k, v, layer), atol=tol, rtol=0
        )
    x = torch.randn(2, 3 * 6, DIM, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
    out = attention(scheme, cams, x)
    torch.testing.assert_close(attention(scheme, moved, x), out, atol=tol, rtol=0)
    # control: moving one camera alone changes both
    other = perturb_one_view(cams)
    assert (logits(scheme, other, q, k, v) - logits(scheme, cams, q, k, v)).abs().max() > 100 * tol
    assert (attention(scheme, other, x) - out).abs().max() > 100 * tol


def naive_token_matrices(scheme, cams, layer):
    """Explicit (B, V * N, head_dim, head_dim) matrices of every token for q, k/v and the output, block by block."""
    d, triv, se3 = scheme.head_dim, scheme.triv_channels, scheme.se3_channels
    num_freqs = scheme.so2_channels // 4
    h, w = GRID
    batch, views = cams.batch_size, cams.num_views
    eye = torch.eye(d, dtype=torch.float64)
    mats = {name: eye.repeat(batch, views * h * w, 1, 1) for name in ("q", "kv", "out")}
    coeff = float(scheme.trans_coeff[layer].detach()) if se3 else 0.0
    for b in range(batch):
        for view in range(views):
            e = cams.w2c[b, view].double().clone()
            e[:3, 3] *= coeff  # the camera's translation scaled by trans_coeff
            g = torch.linalg.inv(e)
            for n in range(h * w):
                t = view * h * w + n
                u = ((n // w + 0.5) / h, (n % w + 0.5) / w)
                for blk in range(se3 // 4):
                    s = slice(triv + 4 * blk, triv + 4 * blk + 4)
                    mats["q"][b, t, s, s] = e.T  # (g^-1)^T
                    mats["kv"][b, t, s, s] = g
                    mats["out"][b, t, s, s] = e  # g^-1
                for m in range(1, num_freqs + 1):
                    for axis in range(2):
                        theta = 2 * math.pi * scheme.max_freq[axis] * 2**m / 2**num_freqs * u[axis]
                        rot = torch.tensor(
                            [[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]],
                            dtype=torch.float64,
                        )
                        start = triv + se3 + 2 * (2 * (m - 1) + axis)
                        s = slice(start, start + 2)
                        mats["q"][b, t, s, s] = rot
                        mats["kv"][b, t, s, s] = rot
                        mats["out"][b, t, s, s] = rot.T
    return mats


@pytest.mark.parametrize(
    "opts",
    [{}, {"se3_channels": 8, "so2_channels": 4, "max_freq": (1.0, 0.5)}, {"se3_channels": 4, "so2_channels": 8}],
)
def test_the_transform_equals_the_per_token_formula(opts):
    scheme = gta(**opts).double()
    with torch.no_grad():
        scheme.trans_coeff.copy_(torch.tensor([0.5, 2.0]))
    cams = make_cameras()
    q, k, v = qkv(cams, torch.float64)
    for layer in (0, 1):
        transform = scheme.prepare(cams, GRID).layer(layer)
        mats = naive_token_matrices(scheme, cams, layer)
        apply = lambda m, x: torch.einsum("btij,bhtj->bhti", m, x)  # noqa: E731
        got = transform.transform_qkv(q, k, v)
        for out, expected in zip(got, (apply(mats["q"], q), apply(mats["kv"], k), apply(mats["kv"], v)), strict=True):
            torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
        torch.testing.assert_close(transform.untransform_output(v), apply(mats["out"], v), atol=1e-10, rtol=0)


def test_the_so2_frequencies_are_the_references():
    torch.testing.assert_close(visionpe.camera.gta.so2_frequencies(4), torch.tensor([1 / 8, 1 / 4, 1 / 2, 1.0]))
    scheme = gta(dim=64, num_heads=2)  # head_dim 32: 16 + 16, M = 4
    assert (scheme.triv_channels, scheme.se3_channels, scheme.so2_channels, scheme.num_so2_freqs) == (0, 16, 16, 4)
    angles = scheme.so2_angles(GRID)
    assert angles.shape == (6, 8)
    # the last patch (row 1 of 2, column 2 of 3): highest frequency (m = M, pairs 6 and 7) turns by 2 pi u
    torch.testing.assert_close(angles[5, 6:], 2 * math.pi * torch.tensor([0.75, 5 / 6]))


def test_se3_only_with_identical_cameras_is_plain_attention():
    scheme = gta(so2_channels=0).double()
    assert (scheme.triv_channels, scheme.se3_channels) == (8, 8)
    with torch.no_grad():
        scheme.trans_coeff.fill_(1.0)
    cams = make_cameras(views=3)
    same = cams.w2c[:, :1].expand(-1, 3, -1, -1).clone()
    cams = Cameras(same, cams.intrinsics, cams.image_size)
    x = torch.randn(2, 18, DIM, dtype=torch.float64)
    torch.manual_seed(0)
    attn = PosAttention(DIM, HEADS, qkv_bias=True).double().eval()
    plain = attn(x)
    torch.testing.assert_close(attn(x, pos=PositionContext(camera=[(scheme, scheme.prepare(cams, GRID))])), plain)
    # the transform itself is not the identity: equal cameras cancel only between query and key
    q, k, v = qkv(cams, torch.float64)
    assert not torch.allclose(scheme.prepare(cams, GRID).layer(0).transform_qkv(q, k, v)[1], k)
    # control: different cameras change the output
    moved = perturb_one_view(cams)
    out = attn(x, pos=PositionContext(camera=[(scheme, scheme.prepare(moved, GRID))]))
    assert (out - plain).abs().max() > 1e-3


def test_so2_only_logits_depend_on_the_patch_offset_only():
    scheme = gta(se3_channels=0, so2_channels=8, max_freq=(1.0, 0.7)).double()
    cams = make_cameras(batch=1, views=2)
    g = torch.Generator().manual_seed(0)
    # one query and one key vector for every token: any change of the logit comes from the positions
    q = torch.randn(1, HEADS, 1, 16, generator=g, dtype=torch.float64).expand(-1, -1, 12, -1)
    k = torch.randn(1, HEADS, 1, 16, generator=g, dtype=torch.float64).expand(-1, -1, 12, -1)
    scores = logits(scheme, cams, q, k, k)[0]  # (heads, 12, 12)
    rows, cols = torch.arange(12) % 6 // 3, torch.arange(12) % 3
    offset = torch.stack((rows[None] - rows[:, None], cols[None] - cols[:, None]), -1)  # (12, 12, 2): u_k - u_q
    by_offset = {}
    for i in range(12):
        for j in range(12):
            by_offset.setdefault(tuple(offset[i, j].tolist()), []).append(scores[:, i, j])
    assert len(by_offset) == 15
    for values in by_offset.values():
        for value in values[1:]:
            torch.testing.assert_close(value, values[0], atol=1e-12, rtol=0)
    firsts = torch.stack([values[0] for values in by_offset.values()])
    assert (firsts - firsts[0]).abs().max() > 1e-2  # and the offsets do change it
    # the patch position is all there is: every view of the same patch scores the same
    torch.testing.assert_close(scores[:, :6, :6], scores[:, 6:, 6:])


def test_without_value_transform_only_q_and_k_change():
    with_v, without_v = gta().double(), gta(transform_values=False).double()
    cams = make_cameras()
    q, k, v = qkv(cams, torch.float64)
    a = with_v.prepare(cams, GRID).layer(0)
    b = without_v.prepare(cams, GRID).layer(0)
    qa, ka, va = a.transform_qkv(q, k, v)
    qb, kb, vb = b.transform_qkv(q, k, v)
    torch.testing.assert_close((qa, ka), (qb, kb))
    assert vb is v and b.untransform_output(v) is v
    assert not torch.allclose(va, v)
    torch.testing.assert_close(a.untransform_output(va), v)  # the output map inverts the value map per view


def test_trans_coeff_is_learned_per_block_and_kept_out_of_weight_decay():
    scheme = gta()
    assert scheme.trans_coeff.shape == (2,) and torch.all(scheme.trans_coeff == 0.01)
    assert scheme.no_weight_decay() == {"trans_coeff"}
    assert gta(se3_channels=0).trans_coeff is None and not list(gta(se3_channels=0).parameters())
    cams = make_cameras(dtype=torch.float32)
    x = torch.randn(2, 18, DIM, requires_grad=True)
    attention(scheme, cams, x).square().sum().backward()
    assert scheme.trans_coeff.grad[1] != 0 and scheme.trans_coeff.grad[0] == 0  # attention.layer = 1


def test_prepare_under_autocast_keeps_fp32_tables():
    scheme = gta()
    cams = make_cameras(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = scheme.prepare(cams, GRID)
        transform = state.layer(0)
        x = torch.randn(2, 18, DIM)
        out = attention(scheme, cams, x)
    assert state.cos.dtype == state.rotation.dtype == transform.se3[0].dtype == torch.float32
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), attention(scheme, cams, x), atol=0.1, rtol=0.1)


def test_in_the_multiview_vit_the_model_is_invariant():
    torch.manual_seed(0)
    model = timm.create_model(
        "visionpe_mvvit_tiny_patch16",
        camera_embed="gta",
        camera_embed_kwargs={"trans_coeff": 0.5},
        pos_embed="rope_axial",
        img_size=(16, 24),
        patch_size=8,
        embed_dim=32,
        depth=2,
        num_heads=2,
        num_classes=3,
    ).eval()
    model.double()
    cams = make_cameras(views=2)
    cams = Cameras(cams.w2c, cams.intrinsics, (16, 24))
    x = torch.randn(2, 2, 3, 16, 24, dtype=torch.float64)
    out = model.forward_features(x, cams)
    world = random_rigid(generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(model.forward_features(x, cams.transform(world)), out, atol=1e-10, rtol=0)
    assert not torch.allclose(model.forward_features(x, perturb_one_view(cams)), out, atol=1e-3)
    model(x, cams).sum().backward()
    assert model.camera_schemes["gta"].trans_coeff.grad.abs().min() > 0


@pytest.mark.parametrize(
    "opts, error, match",
    [
        ({"se3_channels": 6}, ValueError, "se3_channels must be a multiple of 4, got 6"),
        ({"so2_channels": 2}, ValueError, "so2_channels must be a multiple of 4, got 2"),
        (
            {"se3_channels": 12, "so2_channels": 8},
            ValueError,
            "must fit head_dim = dim // num_heads = 16, got 12 \\+ 8",
        ),
        ({"se3_channels": 0, "so2_channels": 0}, ValueError, "needs se3_channels or so2_channels > 0"),
        ({"dim": 8, "num_heads": 2}, ValueError, "head_dim = 4: the default split needs at least 8"),
        ({"se3_channels": -4}, ValueError, "se3_channels must be a non-negative int, got -4"),
        ({"se3_channels": 4.0}, TypeError, "se3_channels must be a non-negative int, got float"),
        ({"max_freq": 0}, ValueError, "max_freq must be a positive finite number, got 0"),
        ({"max_freq": (1.0, -1.0)}, ValueError, "max_freq\\[1\\] must be a positive finite number, got -1.0"),
        ({"max_freq": "1"}, TypeError, "max_freq must be a positive number or a \\(rows, columns\\) pair"),
        ({"trans_coeff": 0.0}, ValueError, "trans_coeff must be a positive finite number, got 0.0"),
        ({"transform_values": 1}, TypeError, "transform_values must be a bool, got int"),
        ({"so2_freqs": 4}, ValueError, "gta got unknown option\\(s\\) \\['so2_freqs'\\]"),
    ],
)
def test_bad_options_are_named(opts, error, match):
    with pytest.raises(error, match=match):
        gta(**opts)


def test_bad_inputs_are_named():
    scheme = gta()
    cams = make_cameras(dtype=torch.float32)
    with pytest.raises(TypeError, match="cameras must be a visionpe.camera.Cameras, got dict"):
        scheme.prepare({"w2c": cams.w2c}, GRID)
    with pytest.raises(ValueError, match="supports 2D grids"):
        scheme.prepare(cams, (2, 3, 4))
    state = scheme.prepare(cams, GRID)
    with pytest.raises(ValueError, match="layer must be an int in \\[0, depth=2\\)"):
        state.layer(2)
    q = torch.randn(2, HEADS, 18, 16)
    with pytest.raises(ValueError, match="k must have shape \\(B, heads, V \\* N, head_dim\\) = \\(2, 2, 18, 16\\)"):
        state.layer(0).transform_qkv(q, q[:, :, :12], q)
    with pytest.raises(TypeError, match="v must be a floating-point"):
        state.layer(0).transform_qkv(q, q, q.long())
