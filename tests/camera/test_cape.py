"""CaPE: the 6DoF row-vector formula written out, scores that see only relative poses, exact SE(3) invariance, and the
4DoF angles with their azimuth invariance."""

import math

import pytest
import timm
import torch

import visionpe
from visionpe.attention import PosAttention, PositionContext
from visionpe.camera import Cameras, look_at, random_rigid
from visionpe.camera.cape import cape_4dof_pose

GRID = (2, 3)  # non-square
DIM, HEADS = 32, 2  # head_dim 16


def make_cameras(batch=2, views=3, dtype=torch.float64, seed=0, radius=(1.6, 2.1)):
    """Cameras around the origin at distances in ``radius`` (inside CaPE 4DoF's default range), looking near it."""
    g = torch.Generator().manual_seed(seed)
    eyes = torch.randn(batch, views, 3, generator=g, dtype=torch.float64)
    dist = radius[0] + (radius[1] - radius[0]) * torch.rand(batch, views, 1, generator=g, dtype=torch.float64)
    eyes = dist * eyes / eyes.norm(dim=-1, keepdim=True)
    target = 0.2 * torch.randn(batch, views, 3, generator=g, dtype=torch.float64)
    k = torch.tensor([[30.0, 0, 18], [0, 30.0, 12], [0, 0, 1]], dtype=torch.float64).expand(batch, views, 3, 3)
    return Cameras(look_at(eyes, target), k.clone(), (24, 36)).to(dtype)


def cape(**opts):
    return visionpe.create_pos_embed("cape", **{"dim": DIM, "num_heads": HEADS, "depth": 2, **opts})


def qkv(cams, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (cams.batch_size, HEADS, cams.num_views * GRID[0] * GRID[1], DIM // HEADS)
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for _ in range(3)]


def logits(scheme, cams, q, k, v):
    q, k, _ = scheme.prepare(cams, GRID).layer(1).transform_qkv(q, k, v)
    return q @ k.transpose(-1, -2)


def attention(scheme, cams, x):
    torch.manual_seed(0)
    attn = PosAttention(DIM, HEADS, qkv_bias=True).to(x.dtype).eval()
    return attn(x, pos=PositionContext(camera=[(scheme, scheme.prepare(cams, GRID))]))


def with_w2c(cams, w2c):
    return Cameras(w2c, cams.intrinsics, cams.image_size)


def perturb_one_view(cams, seed=5):
    w2c = cams.w2c.clone()
    w2c[:, 1] = w2c[:, 1] @ random_rigid(generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(w2c)
    return with_w2c(cams, w2c)


def token_poses(poses):
    """(B, V, ...) per-view values -> (B, V * N, ...) per token, tokens ordered (view, patch)."""
    return poses.repeat_interleave(GRID[0] * GRID[1], dim=1)


# -- 6DoF ------------------------------------------------------------------------------------------------------------


def naive_6dof(q, k, w2c, scale=1.0):
    """The official row-vector form, token by token: each 4-block q_b -> q_b P^-T, k_b -> k_b P (P = w2c)."""
    p = w2c.double().clone()
    p[..., :3, 3] *= scale
    p = token_poses(p)  # (B, T, 4, 4)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    for b in range(q.shape[0]):
        for t in range(q.shape[2]):
            p_inv_t = torch.linalg.inv(p[b, t]).T
            for blk in range(q.shape[-1] // 4):
                s = slice(4 * blk, 4 * blk + 4)
                q_out[b, :, t, s] = q[b, :, t, s] @ p_inv_t
                k_out[b, :, t, s] = k[b, :, t, s] @ p[b, t]
    return q_out, k_out


@pytest.mark.parametrize("scale", [None, 0.25])
def test_6dof_equals_the_row_vector_formula_and_leaves_v_alone(scale):
    scheme = cape(translation_scale=scale).double()
    cams = make_cameras()
    q, k, v = qkv(cams, torch.float64)
    transform = scheme.prepare(cams, GRID).layer(0)
    q2, k2, v2 = transform.transform_qkv(q, k, v)
    expected = naive_6dof(q, k, cams.w2c, 1.0 if scale is None else scale)
    torch.testing.assert_close((q2, k2), expected, atol=1e-10, rtol=0)
    assert v2 is v and transform.untransform_output(v) is v


def test_6dof_scores_see_only_the_relative_pose():
    scheme = cape().double()
    cams = make_cameras()
    q, k, v = qkv(cams, torch.float64)
    scores = logits(scheme, cams, q, k, v)
    # written with the relative pose only: sum over blocks of q_b (P_k P_q^-1)^T k_b^T
    p = token_poses(cams.w2c)
    rel = p[:, None] @ torch.linalg.inv(p)[:, :, None]  # (B, Tq, Tk, 4, 4): P_k P_q^-1
    qb, kb = q.unflatten(-1, (-1, 4)), k.unflatten(-1, (-1, 4))  # (B, H, T, blocks, 4)
    expected = torch.einsum("bhicx,bijyx,bhjcy->bhij", qb, rel, kb)
    torch.testing.assert_close(scores, expected, atol=1e-10, rtol=0)
    # control: the transpose flipped (q_b P_q^-1, k_b P_k^T) is not this score
    flipped = torch.einsum("bhicx,bijxy,bhjcy->bhij", qb, rel, kb)
    assert (flipped - scores).abs().max() > 1e-2


def random_pose_delta(batch, seed):
    """A random rigid 4x4 per sample from Euler-like angles and a translation, as the reference's self-check draws."""
    g = torch.Generator().manual_seed(seed)
    angles, shift = torch.rand(batch, 3, generator=g, dtype=torch.float64) * 2, torch.rand(batch, 3, generator=g)
    delta = torch.eye(4, dtype=torch.float64).repeat(batch, 1, 1)
    for axis in range(3):
        c, s = angles[:, axis].cos(), angles[:, axis].sin()
        rot = torch.eye(4, dtype=torch.float64).repeat(batch, 1, 1)
        i, j = [a for a in range(3) if a != axis]
        rot[:, i, i], rot[:, i, j], rot[:, j, i], rot[:, j, j] = c, -s, s, c
        delta = delta @ rot
    delta[:, :3, 3] = shift.double()
    return delta


def test_6dof_a_common_pose_delta_leaves_scores_equal():
    scheme = cape().double()
    cams = make_cameras()
    q, k, v = qkv(cams, torch.float64)
    scores = logits(scheme, cams, q, k, v)
    delta = random_pose_delta(2, seed=3)[:, None]  # one delta per sample, shared by its views
    torch.testing.assert_close(logits(scheme, with_w2c(cams, cams.w2c @ delta), q, k, v), scores, atol=1e-10, rtol=0)
    # control: a delta per view is not common and changes the scores
    per_view = random_pose_delta(6, seed=4).view(2, 3, 4, 4)
    assert (logits(scheme, with_w2c(cams, cams.w2c @ per_view), q, k, v) - scores).abs().max() > 1e-2


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-5), (torch.float32, 1e-4)])
def test_6dof_logits_and_outputs_are_invariant_to_a_rigid_motion_of_the_world(dtype, tol):
    scheme = cape().to(dtype)
    cams = make_cameras(dtype=dtype)
    moved = cams.transform(random_rigid(generator=torch.Generator().manual_seed(2), dtype=dtype))
    q, k, v = qkv(cams, dtype)
    torch.testing.assert_close(logits(scheme, moved, q, k, v), logits(scheme, cams, q, k, v), atol=tol, rtol=0)
    x = torch.randn(2, 18, DIM, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
    out = attention(scheme, cams, x)
    torch.testing.assert_close(attention(scheme, moved, x), out, atol=tol, rtol=0)
    other = perturb_one_view(cams)
    assert (logits(scheme, other, q, k, v) - logits(scheme, cams, q, k, v)).abs().max() > 100 * tol
    assert (attention(scheme, other, x) - out).abs().max() > 100 * tol


# -- 4DoF ------------------------------------------------------------------------------------------------------------


def naive_4dof_pose(w2c, low=1.5, high=2.2):
    """(polar from +z, azimuth, log radius in [0, pi], 0) of each camera centre, one camera at a time."""
    out = torch.zeros(*w2c.shape[:2], 4, dtype=torch.float64)
    for b in range(w2c.shape[0]):
        for v in range(w2c.shape[1]):
            rot, t = w2c[b, v, :3, :3].double(), w2c[b, v, :3, 3].double()
            x, y, z = (-rot.T @ t).tolist()
            r = math.sqrt(x * x + y * y + z * z)
            clamped = min(max(r, low), high)
            scaled = (math.log(clamped) - math.log(low)) / (math.log(high) - math.log(low)) * math.pi
            out[b, v] = torch.tensor([math.acos(z / r), math.atan2(y, x), scaled, 0.0], dtype=torch.float64)
    return out


def naive_4dof(x, poses):
    """The official form: each pose value over a quarter of the channels, ``x cos m + rotate_every_two(x) sin m``."""
    d = x.shape[-1]
    m = token_poses(poses).repeat_interleave(d // 4, dim=-1)[:, None]  # (B, 1, T, d)
    pairs = x.unflatten(-1, (-1, 2))
    every_two = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
    return x * m.cos() + every_two * m.sin()


def test_4dof_poses_match_the_spherical_formula():
    cams = make_cameras()
    torch.testing.assert_close(cape_4dof_pose(cams.centers), naive_4dof_pose(cams.w2c))
    # distances outside the range are clamped to its ends
    far = cape_4dof_pose(torch.tensor([[0.0, 0.0, 5.0], [0.0, -1.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(far[:, 2], torch.tensor([math.pi, 0.0], dtype=torch.float64))
    torch.testing.assert_close(far[1, :2], torch.tensor([math.pi / 2, -math.pi / 2], dtype=torch.float64))


def test_4dof_equals_the_official_interleaved_form():
    scheme = cape(mode="4dof").double()
    cams = make_cameras()
    q, k, v = qkv(cams, torch.float64)
    transform = scheme.prepare(cams, GRID).layer(0)
    q2, k2, v2 = transform.transform_qkv(q, k, v)
    poses = naive_4dof_pose(cams.w2c)
    torch.testing.assert_close((q2, k2), (naive_4dof(q, poses), naive_4dof(k, poses)), atol=1e-10, rtol=0)
    assert v2 is v and transform.untransform_output(v) is v


def turn_about(axis, angle):
    c, s = math.cos(angle), math.sin(angle)
    i, j = [a for a in range(3) if a != axis]
    world = torch.eye(4, dtype=torch.float64)
    world[i, i], world[i, j], world[j, i], world[j, j] = c, -s, s, c
    return world


@pytest.mark.parametrize("angle", [0.7, 2.9, -2.5])  # 2.9 and -2.5 wrap some azimuths past +-pi
def test_4dof_is_invariant_to_a_common_azimuth_offset(angle):
    scheme = cape(mode="4dof").double()
    cams = make_cameras()
    q, k, v = qkv(cams, torch.float64)
    scores = logits(scheme, cams, q, k, v)
    x = torch.randn(2, 18, DIM, dtype=torch.float64)
    out = attention(scheme, cams, x)
    turned = cams.transform(turn_about(2, angle))  # the world turns around +z, the polar axis
    torch.testing.assert_close(logits(scheme, turned, q, k, v), scores, atol=1e-10, rtol=0)
    torch.testing.assert_close(attention(scheme, turned, x), out, atol=1e-10, rtol=0)
    # control: a turn around another axis changes the polar angles
    tilted = cams.transform(turn_about(0, angle))
    assert (logits(scheme, tilted, q, k, v) - scores).abs().max() > 1e-2


def test_4dof_polar_axis_is_a_relabelling_of_the_world_axes():
    cams = make_cameras()
    q, k, v = qkv(cams, torch.float64)
    # world' = (y, z, x): the z axis of the world becomes the y axis of world'
    relabel = torch.zeros(4, 4, dtype=torch.float64)
    relabel[0, 1] = relabel[1, 2] = relabel[2, 0] = relabel[3, 3] = 1
    z_scores = logits(cape(mode="4dof").double(), cams, q, k, v)
    y_scores = logits(cape(mode="4dof", polar_axis="y").double(), cams.transform(relabel), q, k, v)
    torch.testing.assert_close(y_scores, z_scores, atol=1e-10, rtol=0)
    assert not torch.allclose(logits(cape(mode="4dof").double(), cams.transform(relabel), q, k, v), z_scores)


# -- both --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["6dof", "4dof"])
def test_in_the_multiview_vit(mode):
    torch.manual_seed(0)
    model = timm.create_model(
        "visionpe_mvvit_tiny_patch16",
        camera_embed="cape",
        camera_embed_kwargs={"mode": mode},
        img_size=(16, 24),
        patch_size=8,
        embed_dim=32,
        depth=2,
        num_heads=2,
        num_classes=3,
    ).eval()
    model.double()
    assert not list(model.camera_schemes.parameters())
    with torch.no_grad():  # larger q and k than at init: CaPE acts on the logits only, which are then near 0
        for block in model.blocks:
            block.attn.qkv.weight.mul_(10)
    cams = make_cameras(views=2)
    cams = Cameras(cams.w2c, cams.intrinsics, (16, 24))
    x = torch.randn(2, 2, 3, 16, 24, dtype=torch.float64)
    out = model.forward_features(x, cams)
    world = (
        turn_about(2, 1.1)
        if mode == "4dof"
        else random_rigid(generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    )
    torch.testing.assert_close(model.forward_features(x, cams.transform(world.double())), out, atol=1e-10, rtol=0)
    assert not torch.allclose(model.forward_features(x, perturb_one_view(cams)), out, atol=1e-3)


@pytest.mark.parametrize("mode", ["6dof", "4dof"])
def test_prepare_under_autocast_keeps_fp32_tables(mode):
    scheme = cape(mode=mode)
    cams = make_cameras(dtype=torch.float32)
    x = torch.randn(2, 18, DIM)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = scheme.prepare(cams, GRID)
        out = attention(scheme, cams, x)
    assert (state.q_mats if mode == "6dof" else state.cos).dtype == torch.float32
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), attention(scheme, cams, x), atol=0.1, rtol=0.1)


@pytest.mark.parametrize(
    "opts, error, match",
    [
        (
            {"dim": 30, "num_heads": 3},
            ValueError,
            "mode='6dof' needs head_dim = dim // num_heads to be a multiple of 4",
        ),
        ({"dim": 24, "num_heads": 2, "mode": "4dof"}, ValueError, "multiple of 8 .* head_dim=12"),
        ({"mode": "3dof"}, ValueError, "mode must be one of \\('6dof', '4dof'\\), got '3dof'"),
        ({"translation_scale": 0.0}, ValueError, "translation_scale must be a positive finite number, got 0.0"),
        ({"translation_scale": "1"}, TypeError, "translation_scale must be a positive finite number, got str"),
        ({"mode": "4dof", "translation_scale": 0.5}, ValueError, "\\['translation_scale'\\] apply to the other mode"),
        ({"radius_range": (1.0, 2.0)}, ValueError, "\\['radius_range'\\] apply to the other mode"),
        (
            {"mode": "4dof", "radius_range": (2.0, 1.0)},
            ValueError,
            "radius_range must be \\(min, max\\) with min < max",
        ),
        ({"mode": "4dof", "radius_range": (0.0, 1.0)}, ValueError, "radius_range\\[0\\] must be a positive"),
        ({"mode": "4dof", "radius_range": 2.0}, TypeError, "radius_range must be a \\(min, max\\) pair"),
        ({"mode": "4dof", "polar_axis": "w"}, ValueError, "polar_axis must be one of \\('x', 'y', 'z'\\), got 'w'"),
        ({"heads": 2}, ValueError, "cape got unknown option\\(s\\) \\['heads'\\]"),
    ],
)
def test_bad_options_are_named(opts, error, match):
    with pytest.raises(error, match=match):
        cape(**opts)


@pytest.mark.parametrize("mode", ["6dof", "4dof"])
def test_bad_inputs_are_named(mode):
    scheme = cape(mode=mode)
    cams = make_cameras(dtype=torch.float32)
    with pytest.raises(TypeError, match="cameras must be a visionpe.camera.Cameras, got Tensor"):
        scheme.prepare(cams.w2c, GRID)
    state = scheme.prepare(cams, GRID)
    with pytest.raises(ValueError, match="layer must be an int in \\[0, depth=2\\)"):
        state.layer(-1)
    q = torch.randn(2, HEADS, 18, 16)
    with pytest.raises(ValueError, match="q must have shape \\(B, heads, V \\* N, head_dim\\) = \\(2, 2, 18, 16\\)"):
        state.layer(0).transform_qkv(q[..., :8], q, q)
    with pytest.raises(ValueError, match="centers must be a floating-point \\(..., 3\\) tensor"):
        cape_4dof_pose(torch.zeros(2, 4))
