"""RayRoPE: SE(3) invariance, the point limit of the depth interval, equality with an explicit per-query-camera
reference, gradients into the depth head, and argument checks."""

from __future__ import annotations

import math

import pytest
import torch

import visionpe
from visionpe.attention import PosAttention, PositionContext
from visionpe.camera import Cameras, look_at, random_rigid
from visionpe.camera.rayrope import expected_cos_sin

GRID = (2, 3)
IMAGE = (32, 48)  # (H, W)
PATCHES = GRID[0] * GRID[1]
LOG2 = math.log(2.0)
# rays through a patch, (x, y) in patches from its top-left corner, by ray count
OFFSETS = {1: [(0.5, 0.5)], 2: [(0.0, 0.0), (1.0, 1.0)], 3: [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0)]}


def make_cameras(batch: int, views: int, dtype=torch.float64, seed: int = 0) -> Cameras:
    """Cameras on a ring of radius ~3 looking near the origin, with different intrinsics (one with skew)."""
    g = torch.Generator().manual_seed(seed)
    angle = torch.rand(batch, views, generator=g, dtype=torch.float64) * 2 * math.pi
    height = torch.randn(batch, views, generator=g, dtype=torch.float64) * 0.5
    eye = torch.stack((3 * angle.cos(), height, 3 * angle.sin()), -1)
    target = torch.randn(batch, views, 3, generator=g, dtype=torch.float64) * 0.3
    k = torch.zeros(batch, views, 3, 3, dtype=torch.float64)
    k[..., 0, 0] = 40 + 10 * torch.rand(batch, views, generator=g, dtype=torch.float64)
    k[..., 1, 1] = 36 + 10 * torch.rand(batch, views, generator=g, dtype=torch.float64)
    k[..., 0, 2] = 24 + 3 * torch.randn(batch, views, generator=g, dtype=torch.float64)
    k[..., 1, 2] = 16 + 3 * torch.randn(batch, views, generator=g, dtype=torch.float64)
    k[..., 0, 1] = 0.0
    k[:, 0, 0, 1] = 1.5  # skew in the first view
    k[..., 2, 2] = 1
    return Cameras(look_at(eye, target).to(dtype), k.to(dtype), IMAGE)


def build(dim=48, heads=2, dtype=torch.float64, seed=0, **opts):
    torch.manual_seed(seed)
    scheme = visionpe.create_pos_embed("rayrope", dim=dim, num_heads=heads, **opts).to(dtype)
    attn = PosAttention(dim, heads).to(dtype)
    return scheme, attn


def randomize_heads(scheme, scale=0.3, bias=(LOG2, 0.5)):
    with torch.no_grad():
        for head in scheme.depth_heads:
            head.weight.normal_(0, scale)
            head.bias.copy_(torch.tensor(bias[: head.bias.numel()]))


def run(scheme, attn, cameras, x, **prepare):
    ctx = PositionContext(camera=[(scheme, scheme.prepare(cameras, GRID, **prepare))])
    return attn(x, pos=ctx)


def uniform_mean(fn, theta1: torch.Tensor, theta2: torch.Tensor, points: int = 1001) -> torch.Tensor:
    """Mean of ``fn`` over [theta1, theta2] elementwise, by Simpson's rule on ``points`` (odd) nodes."""
    weights = torch.ones(points, dtype=torch.float64)
    weights[1:-1:2], weights[2:-1:2] = 4.0, 2.0
    nodes = theta1[..., None] + (theta2 - theta1)[..., None] * torch.linspace(0, 1, points, dtype=torch.float64)
    return (fn(nodes) * weights).sum(-1) / (3 * (points - 1))


def test_expected_cos_sin_is_the_mean_and_tends_to_the_point_value():
    theta1 = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64)
    for width in (0.8, 0.2, 0.05, 0.02):
        theta2 = theta1 + width
        cos, sin = expected_cos_sin(theta1, theta2)
        torch.testing.assert_close(cos, uniform_mean(torch.cos, theta1, theta2), atol=1e-12, rtol=0)
        torch.testing.assert_close(sin, uniform_mean(torch.sin, theta1, theta2), atol=1e-12, rtol=0)
        # the mean of an interval of width w is the midpoint's value times sinc(w / 2): within w^2 / 24 of it
        mid = theta1 + width / 2
        assert (cos - mid.cos()).abs().max() <= width**2 / 24 + 1e-12
        assert (sin - mid.sin()).abs().max() <= width**2 / 24 + 1e-12
    # the same either way round; below the threshold, the point value at theta1
    torch.testing.assert_close(expected_cos_sin(theta1 + 0.5, theta1), expected_cos_sin(theta1, theta1 + 0.5))
    cos, sin = expected_cos_sin(theta1, theta1 + 0.005)
    assert torch.equal(cos, theta1.cos()) and torch.equal(sin, theta1.sin())


@pytest.mark.parametrize(
    ("dtype", "tol", "opts"),
    [
        (torch.float64, 1e-5, {}),
        (torch.float32, 1e-4, {}),
        (torch.float64, 1e-5, {"depth_source": "known"}),
        (torch.float64, 1e-5, {"num_rays": 1, "transform_values": False}),
        (torch.float32, 1e-4, {"num_rays": 2, "uncertainty": False}),
        (torch.float64, 1e-5, {"encoded_dim": 24, "dim": 64}),
    ],
)
def test_se3_invariance_with_fixed_raw_depths(dtype, tol, opts):
    opts = dict(opts)
    rays = opts.get("num_rays", 3)
    dim = opts.pop("dim", 2 * 2 * (3 + 3 * rays))  # 2 heads of the smallest head_dim by default
    scheme, attn = build(dim=dim, dtype=dtype, **opts)
    views = 3
    cameras = make_cameras(2, views, dtype)
    x = torch.randn(2, views * PATCHES, dim, dtype=dtype)
    prepare = {}
    if opts.get("depth_source") == "known":
        prepare["patch_depth"] = 0.5 + 4 * torch.rand(2, views, PATCHES, dtype=dtype)
    else:
        randomize_heads(scheme)  # the head sees the same tokens, so its raw depths are fixed
    out = run(scheme, attn, cameras, x, **prepare)
    moved = cameras.transform(random_rigid((2,), translation=2.0, generator=torch.Generator().manual_seed(1)))
    torch.testing.assert_close(run(scheme, attn, moved, x, **prepare), out, atol=tol, rtol=0)
    # control: moving one camera alone changes the output
    w2c = cameras.w2c.clone()
    w2c[:, 1] = w2c[:, 1] @ random_rigid((), translation=0.3, generator=torch.Generator().manual_seed(2), dtype=dtype)
    perturbed = Cameras(w2c, cameras.intrinsics, IMAGE)
    assert (run(scheme, attn, perturbed, x, **prepare) - out).abs().max() > 100 * tol


def test_small_sigma_is_the_point_encoding():
    views = 2
    cameras = make_cameras(1, views)
    x = torch.randn(1, views * PATCHES, 48, dtype=torch.float64)
    _, attn = build()
    known = visionpe.create_pos_embed("rayrope", dim=48, num_heads=2, depth_source="known").double()
    point = run(known, attn, cameras, x, patch_depth=torch.full((1, views, PATCHES), 2.0, dtype=torch.float64))

    def predicted(sigma=None):  # the head's bias set in float64: log d = log 2, sigma (None: no uncertainty)
        scheme = visionpe.create_pos_embed("rayrope", dim=48, num_heads=2, uncertainty=sigma is not None).double()
        with torch.no_grad():
            scheme.depth_heads[0].bias.copy_(
                torch.tensor([LOG2] if sigma is None else [LOG2, sigma], dtype=torch.float64)
            )
        return scheme

    errors = [(run(predicted(s), attn, cameras, x) - point).abs().max().item() for s in (0.3, 0.03, 1e-8)]
    assert errors[0] > errors[1] > errors[2] and errors[0] > 1e-3
    assert errors[-1] < 1e-7
    # without uncertainty the predicted depth is a point: the same encoding as that depth known
    torch.testing.assert_close(run(predicted(), attn, cameras, x), point, atol=1e-12, rtol=0)


def test_known_depths_of_the_first_views_and_predicted_for_the_rest():
    views = 3
    cameras = make_cameras(2, views, seed=3)
    x = torch.randn(2, views * PATCHES, 48, dtype=torch.float64)
    given = 0.5 + 3 * torch.rand(2, 2, PATCHES, 3, dtype=torch.float64)  # one depth per ray
    mixed, attn = build(depth_source="known+predicted", uncertainty=False)  # predicts d = e^0 = 1
    known = visionpe.create_pos_embed("rayrope", dim=48, num_heads=2, depth_source="known").double()
    full = torch.cat((given, torch.ones(2, 1, PATCHES, 3, dtype=torch.float64)), dim=1)
    torch.testing.assert_close(
        run(mixed, attn, cameras, x, patch_depth=given),
        run(known, attn, cameras, x, patch_depth=full),
        atol=1e-12,
        rtol=0,
    )


def reference_attention(attn, x, cameras, near, far, head_dim, num_rays, freq_base, transform_values, encoded):
    """Explicit RayRoPE attention: for each query camera, every token's 3 + 3R coordinates from world points,
    (2 x 2) rotation blocks per pair with cos/sin averaged numerically over the depth interval, and one softmax per
    query camera over all keys."""
    batch, tokens, dim = x.shape
    heads = dim // head_dim
    views = cameras.num_views
    (h, w), (height, width) = GRID, IMAGE
    coord_dim = 3 + 3 * num_rays
    num_freqs = encoded // (2 * coord_dim)
    half = encoded // 2
    freqs = []
    for period in [4.0] * 3 + [8.0] * (2 * num_rays) + [80.0] * num_rays:
        low, high = math.log(2 * math.pi / period), math.log(2 * math.pi / (period / freq_base ** (num_freqs - 1)))
        freqs.append(torch.exp(torch.linspace(low, high, num_freqs, dtype=torch.float64)))
    freqs = torch.stack(freqs, 1)  # (F, coord_dim): pair f * coord_dim + i
    to_unit = torch.tensor([[1 / width, 0, -0.5], [0, 1 / height, -0.5], [0, 0, 1]], dtype=torch.float64)

    def coords(b, c, token, depths):
        view, n = divmod(token, PATCHES)
        i, j = divmod(n, w)
        w2c_c = cameras.w2c[b, c]
        c2w_v = torch.linalg.inv(cameras.w2c[b, view])
        values = (w2c_c @ c2w_v[:, 3])[:3].tolist()
        units, zs = [], []
        for r, (ox, oy) in enumerate(OFFSETS[num_rays]):
            pixel = torch.tensor([(j + ox) * width / w, (i + oy) * height / h, 1.0], dtype=torch.float64)
            cam = depths[r] * torch.linalg.inv(cameras.intrinsics[b, view]) @ pixel
            world = c2w_v @ torch.cat((cam, torch.ones(1, dtype=torch.float64)))
            in_c = (w2c_c @ world)[:3]
            projected = to_unit @ cameras.intrinsics[b, c] @ in_c
            units += (projected[:2] / projected.norm()).tolist()
            zs.append(min(abs(float(in_c[2])), 10.0))
        return torch.tensor(values + units + zs, dtype=torch.float64)

    # angles at both ends of every token's depth interval, in every query camera's frame: (B, C, T, half)
    theta1, theta2 = (
        torch.stack(
            [
                torch.stack(
                    [
                        torch.stack(
                            [
                                (freqs * coords(b, c, t, depth[b, t // PATCHES, t % PATCHES])).flatten()
                                for t in range(tokens)
                            ]
                        )
                        for c in range(views)
                    ]
                )
                for b in range(batch)
            ]
        )
        for depth in (near, far)
    )
    point = (theta2 - theta1).abs() <= 1e-2
    cos = torch.where(point, theta1.cos(), uniform_mean(torch.cos, theta1, theta2))
    sin = torch.where(point, theta1.sin(), uniform_mean(torch.sin, theta1, theta2))
    # the forward turn R of pair (p, p + half): [[cos, -sin], [sin, cos]]; q, k, v are turned by R^T
    turn = torch.eye(head_dim, dtype=torch.float64).repeat(batch, views, tokens, 1, 1)  # channels >= encoded: 1
    idx = torch.arange(half)
    turn[..., idx, idx], turn[..., idx, idx + half] = cos, -sin
    turn[..., idx + half, idx], turn[..., idx + half, idx + half] = sin, cos

    qkv = attn.qkv(x).reshape(batch, tokens, 3, heads, head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (B, T, heads, d)
    out = torch.zeros(batch, tokens, heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        for c in range(views):
            rows = slice(c * PATCHES, (c + 1) * PATCHES)
            mats = turn[b, c]  # (T, d, d)
            keys = torch.einsum("thd,tde->the", k[b], mats)  # (R^T k) as a row vector
            values = torch.einsum("thd,tde->the", v[b], mats) if transform_values else v[b]
            queries = torch.einsum("thd,tde->the", q[b, rows], mats[rows])
            logits = torch.einsum("qhd,khd->hqk", queries, keys) / math.sqrt(head_dim)
            mixed = torch.einsum("hqk,khd->qhd", logits.softmax(-1), values)
            out[b, rows] = torch.einsum("qhe,qde->qhd", mixed, mats[rows]) if transform_values else mixed
    return attn.proj(out.reshape(batch, tokens, dim))


@pytest.mark.parametrize(
    ("transform_values", "dim", "encoded_dim"),
    [(True, 96, None), (False, 96, None), (True, 64, 24)],  # head_dim 48: two frequencies per coordinate
)
def test_equals_an_explicit_reference(transform_values, dim, encoded_dim):
    views, freq_base = 2, 2.5
    opts = {"freq_base": freq_base, "transform_values": transform_values, "encoded_dim": encoded_dim}
    scheme, attn = build(dim=dim, seed=4, **opts)
    randomize_heads(scheme, scale=0.4, bias=(LOG2, 0.3))
    cameras = make_cameras(2, views, seed=5)
    x = torch.randn(2, views * PATCHES, dim, dtype=torch.float64)
    with torch.no_grad():
        got = run(scheme, attn, cameras, x)
        raw = x @ scheme.depth_heads[0].weight.T + scheme.depth_heads[0].bias
        near = torch.exp((raw[..., 0] - raw[..., 1]).clamp(max=3)).clamp(0.01, 100)
        far = torch.exp((raw[..., 0] + raw[..., 1]).clamp(max=3)).clamp(0.01, 100)
        shape = (2, views, PATCHES, 1)
        near, far = near.reshape(shape).expand(-1, -1, -1, 3), far.reshape(shape).expand(-1, -1, -1, 3)
        head_dim = dim // 2
        want = reference_attention(
            attn, x, cameras, near, far, head_dim, 3, freq_base, transform_values, encoded_dim or head_dim
        )
    torch.testing.assert_close(got, want, atol=1e-7, rtol=0)


def test_gradients_reach_the_depth_head():
    scheme, attn = build(dtype=torch.float32)  # the head at its initial state: zero weight
    cameras = make_cameras(2, 2, torch.float32)
    x = torch.randn(2, 2 * PATCHES, 48, requires_grad=True)
    (run(scheme, attn, cameras, x) * torch.randn(2, 2 * PATCHES, 48)).sum().backward()
    head = scheme.depth_heads[0]
    for grad in (head.weight.grad, head.bias.grad, x.grad):
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().max() > 0
    assert head.bias.grad[1].abs() > 0  # sigma is learned too


def test_runs_under_autocast_with_fp32_positions():
    scheme, attn = build(dtype=torch.float32)
    randomize_heads(scheme)
    cameras = make_cameras(1, 2, torch.float32)
    x = torch.randn(1, 2 * PATCHES, 48)
    want = run(scheme, attn, cameras, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run(scheme, attn, cameras, x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)


def test_bad_input():
    with pytest.raises(ValueError, match="head_dim"):
        visionpe.create_pos_embed("rayrope", dim=64, num_heads=2)  # head_dim 32, not a multiple of 24
    with pytest.raises(ValueError, match="head_dim"):
        visionpe.create_pos_embed("rayrope", dim=48, num_heads=2, num_rays=2)  # needs a multiple of 18
    with pytest.raises(ValueError, match="encoded_dim"):
        visionpe.create_pos_embed("rayrope", dim=64, num_heads=2, encoded_dim=30)  # not a multiple of 24
    with pytest.raises(ValueError, match="encoded_dim"):
        visionpe.create_pos_embed("rayrope", dim=64, num_heads=2, encoded_dim=48)  # more than head_dim 32
    with pytest.raises(ValueError, match="unknown option"):
        visionpe.create_pos_embed("rayrope", dim=48, num_heads=2, max_period=4)
    with pytest.raises(ValueError, match="depth_source"):
        visionpe.create_pos_embed("rayrope", dim=48, num_heads=2, depth_source="lidar")
    with pytest.raises(ValueError, match="num_rays"):
        visionpe.create_pos_embed("rayrope", dim=48, num_heads=2, num_rays=4)
    with pytest.raises(TypeError, match="uncertainty"):
        visionpe.create_pos_embed("rayrope", dim=48, num_heads=2, uncertainty=1)
    with pytest.raises(ValueError, match="freq_base"):
        visionpe.create_pos_embed("rayrope", dim=48, num_heads=2, freq_base=0)

    cameras = make_cameras(1, 2, torch.float32)
    predicted = visionpe.create_pos_embed("rayrope", dim=48, num_heads=2)
    with pytest.raises(TypeError, match="Cameras"):
        predicted.prepare({"w2c": cameras.w2c}, GRID)
    with pytest.raises(ValueError, match="patch_depth"):
        predicted.prepare(cameras, GRID, patch_depth=torch.ones(1, 2, PATCHES))
    state = predicted.prepare(cameras, GRID)
    with pytest.raises(ValueError, match="tokens"):
        state.layer(0)
    with pytest.raises(ValueError, match="tokens"):
        state.layer(0, torch.randn(1, PATCHES, 48))  # one view's tokens for two cameras
    with pytest.raises(ValueError, match="layer"):
        state.layer(1, torch.randn(1, 2 * PATCHES, 48))

    known = visionpe.create_pos_embed("rayrope", dim=48, num_heads=2, depth_source="known")
    assert not known.needs_tokens and predicted.needs_tokens and known.extra_inputs == ("patch_depth",)
    with pytest.raises(ValueError, match="patch_depth"):
        known.prepare(cameras, GRID)
    with pytest.raises(ValueError, match="patch_depth"):
        known.prepare(cameras, GRID, patch_depth=torch.ones(1, 1, PATCHES))  # every view needs depths
    with pytest.raises(ValueError, match="positive"):
        known.prepare(cameras, GRID, patch_depth=torch.zeros(1, 2, PATCHES))
    with pytest.raises(TypeError, match="patch_depth"):
        known.prepare(cameras, GRID, patch_depth=torch.ones(1, 2, PATCHES, dtype=torch.int64))
    with pytest.raises(ValueError, match="q must be"):
        state = known.prepare(cameras, GRID, patch_depth=torch.ones(1, 2, PATCHES))
        q = torch.randn(1, 2, PATCHES, 24)  # one view's queries
        state.layer(0).attend(q, q, q, lambda q, k, v: v)
