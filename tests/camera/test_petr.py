"""PETR and 3DPPE: the lifted points, their equivariance, the bins, the sin-cos order and the embeddings."""

import math

import pytest
import timm
import torch

import visionpe
from visionpe.camera import Cameras, look_at, random_rigid
from visionpe.camera.petr import PETR, ThreeDPPE, depth_bins, pos2posemb3d

GRID = (2, 3)  # non-square: an x/y swap shows
BOX = (-4.0, -3.0, -5.0, 5.0, 4.0, 3.0)  # a small scene box, unequal on every axis


def make_cameras(batch=2, views=2, size=(24, 36), dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    eyes = torch.randn(batch, views, 3, generator=g, dtype=dtype)
    eyes = 3 * eyes / eyes.norm(dim=-1, keepdim=True)
    target = 0.3 * torch.randn(batch, views, 3, generator=g, dtype=dtype)
    k = torch.tensor([[30.0, 0.4, 17.0], [0, 27.0, 12.5], [0, 0, 1]], dtype=dtype)
    return Cameras(look_at(eyes, target), k.expand(batch, views, 3, 3).clone(), size)


def naive_world_point(cameras, b, v, u_pix, v_pix, d):
    """The released code's lifting: inv(lidar2img) (u d, v d, d, 1) with lidar2img = [[K, 0], [0, 1]] @ w2c."""
    k4 = torch.eye(4, dtype=torch.float64)
    k4[:3, :3] = cameras.intrinsics[b, v].double()
    lidar2img = k4 @ cameras.w2c[b, v].double()
    hom = torch.tensor([u_pix * d, v_pix * d, d, 1.0], dtype=torch.float64)
    return (torch.linalg.inv(lidar2img) @ hom)[:3]


def naive_logit(p):
    p = min(max(p, 0.0), 1.0)
    return math.log(max(p, 1e-5) / max(1 - p, 1e-5))


def naive_normalized(point, box):
    return [(float(point[a]) - box[a]) / (box[a + 3] - box[a]) for a in range(3)]


def patch_centre(i, j, grid, size):
    return (j + 0.5) * size[1] / grid[1], (i + 0.5) * size[0] / grid[0]


def naive_mlp(seq, features):
    w1, b1, w2, b2 = seq[0].weight.double(), seq[0].bias.double(), seq[2].weight.double(), seq[2].bias.double()
    return torch.relu(features @ w1.T + b1) @ w2.T + b2


# -- geometry -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_petr_points_reproject_to_the_patch_centres_at_the_bin_depths(dtype):
    cams = make_cameras(dtype=dtype)
    pe = PETR(32, num_bins=5, position_range=BOX)
    points = pe.points(cams, GRID)  # (B, V, N, D, 3)
    assert points.shape == (2, 2, 6, 5, 3) and points.dtype == dtype
    pix, z = cams.project(points.flatten(2, 3))
    expected = cams.patch_pixels(GRID).repeat_interleave(5, 0).expand_as(pix)
    torch.testing.assert_close(pix, expected, atol=1e-4, rtol=0)
    bins = depth_bins(5, 1.0, BOX[3], "lid", dtype=dtype)
    torch.testing.assert_close(z, bins.repeat(6).expand_as(z), atol=1e-4, rtol=1e-5)


def test_petr_points_equal_the_released_inverse_lidar2img_formula():
    cams = make_cameras(size=(20, 45))
    pe = PETR(32, num_bins=3, bins="uniform", depth_start=0.5, depth_max=6.5, position_range=BOX)
    points = pe.points(cams, GRID)
    bins = [0.5, 2.5, 4.5]  # uniform: 0.5 + k (6.5 - 0.5) / 3
    for b in range(2):
        for v in range(2):
            for n in range(6):
                u_pix, v_pix = patch_centre(n // 3, n % 3, GRID, (20, 45))
                for k, d in enumerate(bins):
                    expected = naive_world_point(cams, b, v, u_pix, v_pix, d)
                    torch.testing.assert_close(points[b, v, n, k], expected, atol=1e-9, rtol=0)


def test_3dppe_points_reproject_to_the_patch_centres_at_their_depths():
    cams = make_cameras(dtype=torch.float32)
    pe = ThreeDPPE(32, position_range=BOX)
    depth = 0.5 + 3 * torch.rand(2, 2, 6)
    pix, z = cams.project(pe.points(cams, GRID, depth))
    torch.testing.assert_close(pix, cams.patch_pixels(GRID).expand_as(pix), atol=1e-4, rtol=0)
    torch.testing.assert_close(z, depth, atol=1e-4, rtol=1e-5)
    # (B, V, h, w) depth maps are read row-major like the tokens
    torch.testing.assert_close(pe.points(cams, GRID, depth.unflatten(2, GRID)), pe.points(cams, GRID, depth))


def test_points_move_with_the_world():
    """Equivariance: cameras.transform(T) (w2c @ inv(T)) lifts every patch to T X instead of X."""
    cams = make_cameras()
    world = random_rigid((), translation=2.0, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    moved = cams.transform(world)
    rot, shift = world[:3, :3], world[:3, 3]
    petr = PETR(32, num_bins=4, position_range=BOX)
    torch.testing.assert_close(petr.points(moved, GRID), petr.points(cams, GRID) @ rot.T + shift, atol=1e-5, rtol=0)
    ppe = ThreeDPPE(32, position_range=BOX)
    depth = 1 + torch.rand(2, 2, 6, dtype=torch.float64)
    torch.testing.assert_close(
        ppe.points(moved, GRID, depth), ppe.points(cams, GRID, depth) @ rot.T + shift, atol=1e-5, rtol=0
    )


# -- bins and sin-cos ---------------------------------------------------------------------------------------------
def test_golden_depth_bins():
    # LID, D = 4, d0 = 1, d_max = 21: b = 20 / (4 * 5) = 1, d_k = 1 + k (k + 1)
    assert depth_bins(4, 1.0, 21.0, "lid").tolist() == [1.0, 3.0, 7.0, 13.0]
    # D = 3, d0 = 2, d_max = 14: b = 12 / 12 = 1 -> 2, 4, 8
    assert depth_bins(3, 2.0, 14.0, "lid", dtype=torch.float64).tolist() == [2.0, 4.0, 8.0]
    # uniform, D = 4: step (21 - 1) / 4 = 5, the last bin one step short of d_max
    assert depth_bins(4, 1.0, 21.0, "uniform").tolist() == [1.0, 6.0, 11.0, 16.0]
    # the released default, D = 64 over [1, 61.2]: the last LID bin is 1 + 60.2 * 63 / 65
    last = depth_bins(64, 1.0, 61.2, "lid", dtype=torch.float64)[-1].item()
    assert last == pytest.approx(1 + 60.2 * 63 / 65, abs=1e-12)
    # PETR's depth_max defaults to x_max of the box, as the released code
    pe = PETR(32, num_bins=4, position_range=(-2, -2, -2, 21, 2, 2))
    _, z = make_cameras().project(pe.points(make_cameras(), GRID).flatten(2, 3))
    torch.testing.assert_close(z[0, 0, :4], torch.tensor([1.0, 3.0, 7.0, 13.0], dtype=torch.float64))


def test_pos2posemb3d_is_y_x_z_with_interleaved_sin_cos():
    points = torch.tensor([[0.3, -1.2, 0.7], [2.0, 0.1, -0.4]], dtype=torch.float64)
    feats, temperature = 6, 100.0
    out = pos2posemb3d(points, feats, temperature)
    assert out.shape == (2, 18)
    for r in range(2):
        expected = []
        for axis in (1, 0, 2):  # y, x, z
            for j in range(feats):
                angle = 2 * math.pi * points[r, axis].item() / temperature ** (2 * (j // 2) / feats)
                expected.append(math.sin(angle) if j % 2 == 0 else math.cos(angle))
        torch.testing.assert_close(out[r], torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)


# -- embeddings against naive computations ----------------------------------------------------------------------
def test_petr_forward_equals_a_naive_computation():
    torch.manual_seed(0)
    cams = make_cameras(size=(20, 45))
    pe = PETR(16, num_bins=3, depth_start=1.0, depth_max=13.0, position_range=BOX, mlp_ratio=2).double()
    bins = [1.0, 3.0, 7.0]  # LID: b = 12 / 12
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    out = pe(x, cams, GRID)
    for b in range(2):
        for v in range(2):
            for n in range(6):
                u_pix, v_pix = patch_centre(n // 3, n % 3, GRID, (20, 45))
                feats = []
                for d in bins:  # bin-major, x y z within a bin
                    point = naive_world_point(cams, b, v, u_pix, v_pix, d)
                    feats += [naive_logit(p) for p in naive_normalized(point, BOX)]
                expected = x[b, v * 6 + n] + naive_mlp(pe.mlp, torch.tensor(feats, dtype=torch.float64))
                torch.testing.assert_close(out[b, v * 6 + n], expected, atol=1e-9, rtol=1e-9)


def test_3dppe_with_known_depth_equals_a_naive_computation():
    torch.manual_seed(0)
    cams = make_cameras(size=(20, 45))
    pe = ThreeDPPE(16, num_pos_feats=4, temperature=50.0, position_range=BOX).double()
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    depth = 0.5 + 4 * torch.rand(2, 2, 6, dtype=torch.float64)
    out = pe(x, cams, GRID, depth=depth)
    for b in range(2):
        for v in range(2):
            for n in range(6):
                u_pix, v_pix = patch_centre(n // 3, n % 3, GRID, (20, 45))
                point = naive_world_point(cams, b, v, u_pix, v_pix, depth[b, v, n].item())
                s = [naive_logit(p) for p in naive_normalized(point, BOX)]
                feats = []
                for axis in (1, 0, 2):
                    for j in range(4):
                        angle = 2 * math.pi * s[axis] / 50.0 ** (2 * (j // 2) / 4)
                        feats.append(math.sin(angle) if j % 2 == 0 else math.cos(angle))
                expected = x[b, v * 6 + n] + naive_mlp(pe.mlp, torch.tensor(feats, dtype=torch.float64))
                torch.testing.assert_close(out[b, v * 6 + n], expected, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("head", ["hybrid", "expectation"])
def test_3dppe_predicted_depth_is_the_head_readout(head):
    torch.manual_seed(0)
    cams = make_cameras(dtype=torch.float32)
    pe = ThreeDPPE(16, depth_head=head, num_bins=4, depth_start=1.0, depth_max=7.0, position_range=BOX)
    if pe.fuse_lambda is not None:
        with torch.no_grad():
            pe.fuse_lambda.fill_(0.7)
    x = torch.randn(2, 12, 16)
    out = pe.depth_head(x).unflatten(1, (2, 6))
    expected = out[..., :4].softmax(-1) @ torch.tensor([1.0, 3.0, 5.0, 7.0])  # bin centres from 1 to 7 inclusive
    if head == "hybrid":
        alpha = torch.sigmoid(torch.tensor(0.7))
        expected = alpha * out[..., 4] + (1 - alpha) * expected
    depth = pe.predict_depth(x, 2)
    torch.testing.assert_close(depth, expected)
    # forward without depth is forward with the predicted depth, and training reaches the depth head
    torch.testing.assert_close(pe(x, cams, GRID), pe(x, cams, GRID, depth=depth.detach().clamp(min=1e-5)))
    pe(x, cams, GRID).sum().backward()
    assert pe.depth_head.weight.grad is not None and pe.depth_head.weight.grad.abs().sum() > 0


# -- not invariant ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["petr", "3dppe"])
def test_absolute_embedding_changes_with_the_world_but_not_with_the_world_and_box_together(name):
    """Unlike the relative camera schemes, a global rigid motion changes the embedding; it is absolute in the
    world frame, so translating the world and the box by the same vector leaves it unchanged."""
    torch.manual_seed(0)
    cams = make_cameras()
    opts = {"depth_max": BOX[3], **({"num_bins": 4} if name == "petr" else {})}  # bins independent of the box
    pe = visionpe.create_pos_embed(name, dim=16, num_heads=2, position_range=BOX, **opts).double()
    x = torch.zeros(2, 12, 16, dtype=torch.float64)
    extra = {"depth": torch.full((2, 2, 6), 2.5, dtype=torch.float64)} if name == "3dppe" else {}
    base = pe(x, cams, GRID, **extra)
    rotated = random_rigid((), translation=0.0, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert (pe(x, cams.transform(rotated), GRID, **extra) - base).abs().max() > 1e-2
    shift = torch.tensor([0.7, -0.4, 0.3], dtype=torch.float64)
    world = torch.eye(4, dtype=torch.float64)
    world[:3, 3] = shift
    assert (pe(x, cams.transform(world), GRID, **extra) - base).abs().max() > 1e-2
    moved_box = tuple(c + shift[i % 3].item() for i, c in enumerate(BOX))
    pe_moved = visionpe.create_pos_embed(name, dim=16, num_heads=2, position_range=moved_box, **opts).double()
    pe_moved.load_state_dict(pe.state_dict())
    torch.testing.assert_close(pe_moved(x, cams.transform(world), GRID, **extra), base, atol=1e-9, rtol=1e-9)


def test_mask_outside_zeroes_the_patches_whose_points_leave_the_box():
    torch.manual_seed(0)
    cams = make_cameras(dtype=torch.float32)
    box = (-1.0, -1.0, -1.0, 1.0, 1.0, 1.0)
    pe = PETR(16, num_bins=4, depth_start=2.0, depth_max=4.0, position_range=box)
    points = pe.points(cams, GRID)
    normalized = (points - torch.tensor(box[:3])) / 2
    naive = ((normalized < 0) | (normalized > 1)).flatten(-2).sum(-1) > 2  # more than D / 2 of the 3 D values
    mask = pe.outside_mask(cams, GRID)
    torch.testing.assert_close(mask, naive)
    assert mask.any() and not mask.all()
    x = torch.randn(2, 12, 16)
    kept = pe(x, cams, GRID)  # the released behaviour: every patch keeps its embedding
    assert ((kept - x).flatten(0, 1).abs().sum(-1) > 0).all()
    masked = PETR(16, num_bins=4, depth_start=2.0, depth_max=4.0, position_range=box, mask_outside=True)
    masked.load_state_dict(pe.state_dict())
    out = masked(x, cams, GRID)
    flat = mask.flatten(1)
    torch.testing.assert_close(out[flat], x[flat])
    torch.testing.assert_close(out[~flat], kept[~flat])


# -- model and dtype ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["petr", "3dppe"])
def test_in_the_multiview_vit_with_autocast(name):
    torch.manual_seed(0)
    opts = {"position_range": BOX, **({"num_bins": 4} if name == "petr" else {})}
    model = timm.create_model(
        "visionpe_mvvit_tiny_patch16",
        img_size=16,
        patch_size=8,
        embed_dim=32,
        depth=1,
        num_heads=2,
        num_classes=3,
        camera_embed=name,
        camera_embed_kwargs=opts,
    )
    cams = make_cameras(size=(16, 16), dtype=torch.float32)
    x = torch.randn(2, 2, 3, 16, 16)
    model(x, cams).sum().backward()
    scheme = model.camera_schemes[name]
    assert scheme.mlp[0].weight.grad.abs().sum() > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        points = scheme.points(cams, (2, 2)) if name == "petr" else scheme.points(cams, (2, 2), torch.ones(2, 2, 4))
        out = model(x, cams)
    assert points.dtype == torch.float32 and bool(torch.isfinite(out).all())


# -- bad input ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["petr", "3dppe"])
def test_bad_forward_input(name):
    pe = visionpe.create_pos_embed(name, dim=16, num_heads=2, position_range=BOX)
    cams = make_cameras(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"x must be \(B, V \* N, C\)"):
        pe(torch.zeros(2, 11, 16), cams, GRID)
    with pytest.raises(TypeError, match="cameras must be a visionpe.camera.Cameras"):
        pe(torch.zeros(2, 12, 16), cams.w2c, GRID)
    with pytest.raises(TypeError, match="x must be a floating-point"):
        pe(torch.zeros(2, 12, 16, dtype=torch.long), cams, GRID)


def test_bad_depth_for_3dppe():
    pe = ThreeDPPE(16, position_range=BOX)
    cams, x = make_cameras(dtype=torch.float32), torch.zeros(2, 12, 16)
    with pytest.raises(ValueError, match=r"depth must be \(B, V, N\) = \(2, 2, 6\)"):
        pe(x, cams, GRID, depth=torch.ones(2, 2, 5))
    with pytest.raises(ValueError, match="positive, finite"):
        pe(x, cams, GRID, depth=-torch.ones(2, 2, 6))
    with pytest.raises(ValueError, match="positive, finite"):
        pe(x, cams, GRID, depth=torch.full((2, 2, 6), float("nan")))
    with pytest.raises(TypeError, match="depth must be a floating-point"):
        pe(x, cams, GRID, depth=torch.ones(2, 2, 6, dtype=torch.long))


@pytest.mark.parametrize(
    ("name", "opts", "error", "match"),
    [
        ("petr", {"num_bins": 0}, ValueError, "num_bins must be a positive int, got 0"),
        ("petr", {"num_bins": 2.0}, TypeError, "num_bins"),
        ("petr", {"bins": "log"}, ValueError, "bins must be one of"),
        ("petr", {"position_range": (-1, -1, -1, 1, 1)}, ValueError, "position_range must be a sequence of six"),
        ("petr", {"position_range": (1, -1, -1, -1, 1, 1)}, ValueError, "min < max on every axis"),
        ("petr", {"position_range": "nuscenes"}, TypeError, "position_range must be a sequence of six"),
        ("petr", {"position_range": (-1, -1, -1, 1, 1, float("inf"))}, ValueError, "all finite"),
        ("petr", {"depth_start": 0.0}, ValueError, "depth_start"),
        ("petr", {"depth_max": 0.5}, ValueError, "depth_max must be a number > depth_start=1.0"),
        ("petr", {"mlp_ratio": -1}, ValueError, "mlp_ratio"),
        ("petr", {"mask_outside": 1}, TypeError, "mask_outside must be a bool"),
        ("petr", {"num_bin": 4}, ValueError, r"petr got unknown option\(s\) \['num_bin'\]"),
        ("3dppe", {"num_bins": 1}, ValueError, "num_bins must be an int >= 2"),
        ("3dppe", {"depth_head": "direct"}, ValueError, "depth_head must be one of"),
        ("3dppe", {"num_pos_feats": 5}, ValueError, "num_pos_feats must be even"),
        ("3dppe", {"temperature": 0.0}, ValueError, "temperature"),
        ("3dppe", {"bins": "lid"}, ValueError, r"3dppe got unknown option\(s\) \['bins'\]"),
    ],
)
def test_bad_options(name, opts, error, match):
    with pytest.raises(error, match=match):
        visionpe.create_pos_embed(name, dim=16, num_heads=2, **opts)


def test_3dppe_width_must_split_into_sin_cos_pairs():
    with pytest.raises(ValueError, match="dim divisible by 4"):
        visionpe.create_pos_embed("3dppe", dim=18, num_heads=2)
    assert visionpe.create_pos_embed("3dppe", dim=18, num_heads=2, num_pos_feats=6).mlp[0].in_features == 18


def test_registered_as_camera_schemes():
    assert {"petr", "3dppe"} <= set(visionpe.list_schemes("camera"))
    for name in ("petr", "3dppe"):
        pe = visionpe.create_pos_embed(name, dim=16, num_heads=2)
        assert pe.kind == "camera" and pe.applies_to == "tokens"
        assert pe.position_range == (-61.2, -61.2, -10.0, 61.2, 61.2, 10.0) and pe.depth_max == 61.2
