"""The camera convention: poses, projection, rigid motions and what bad cameras get."""

import pytest
import torch

from visionpe.camera import Cameras, invert_rigid, look_at, random_rigid


def make_cameras(batch=2, views=3, size=(24, 32), dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    eyes = torch.randn(batch, views, 3, generator=g, dtype=dtype)
    eyes = 3 * eyes / eyes.norm(dim=-1, keepdim=True)
    target = 0.2 * torch.randn(batch, views, 3, generator=g, dtype=dtype)
    k = torch.tensor([[30.0, 0.5, 15.0], [0, 28.0, 11.0], [0, 0, 1]], dtype=dtype)
    return Cameras(look_at(eyes, target), k.expand(batch, views, 3, 3).clone(), size), eyes, target


def test_look_at_places_the_camera_at_eye_and_the_target_on_the_principal_point():
    cams, eyes, target = make_cameras()
    torch.testing.assert_close(cams.centers, eyes)
    pix, depth = cams.project(target[:, :, None])
    torch.testing.assert_close(pix[..., 0, :], cams.intrinsics[..., :2, 2].expand_as(pix[..., 0, :]))
    assert bool((depth > 0).all())


def test_world_up_is_image_up_for_a_level_camera():
    w2c = look_at(torch.tensor([[[0.0, 0.0, -4.0]]]), torch.zeros(1, 1, 3))
    k = torch.tensor([[10.0, 0, 8], [0, 10.0, 8], [0, 0, 1]]).expand(1, 1, 3, 3)
    cams = Cameras(w2c, k, (16, 16))
    pix, _ = cams.project(torch.tensor([[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]]))
    assert pix[0, 0, 0, 1] < 8  # a point above the target is above the image centre (v grows downwards)
    assert pix[0, 0, 1, 0] < 8  # looking along +z with +y up, world +x is on the image's left


def test_unproject_and_project_round_trip():
    cams, _, _ = make_cameras()
    pixels = cams.patch_pixels((3, 4))
    depth = 1 + torch.rand(2, 3, 12, dtype=torch.float64)
    points = cams.unproject(pixels, depth)
    pix, z = cams.project(points)
    torch.testing.assert_close(pix, pixels.expand_as(pix), atol=1e-9, rtol=0)
    torch.testing.assert_close(z, depth)
    rays = cams.rays(pixels)
    torch.testing.assert_close(rays.norm(dim=-1), torch.ones(2, 3, 12, dtype=torch.float64))
    torch.testing.assert_close(
        torch.nn.functional.normalize(points - cams.centers[:, :, None], dim=-1), rays, atol=1e-12, rtol=0
    )


def test_patch_pixels_are_patch_centres_row_major():
    cams, _, _ = make_cameras(size=(24, 32))
    pix = cams.patch_pixels((3, 4))
    assert pix[0].tolist() == [4.0, 4.0]
    assert pix[1].tolist() == [12.0, 4.0]  # next column: u moves by W / w
    assert pix[4].tolist() == [4.0, 12.0]  # next row: v moves by H / h


def test_a_global_rigid_motion_moves_the_centres_and_keeps_relative_poses():
    cams, _, _ = make_cameras()
    world = random_rigid(generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    moved = cams.transform(world)
    torch.testing.assert_close(moved.centers, cams.centers @ world[:3, :3].T + world[:3, 3])
    relative = cams.w2c[:, :, None] @ cams.c2w[:, None]  # w2c_a c2w_b for every pair of views
    torch.testing.assert_close(moved.w2c[:, :, None] @ moved.c2w[:, None], relative)
    per_sample = random_rigid((2,), generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    torch.testing.assert_close(cams.transform(per_sample).centers[1], cams.transform(per_sample[1]).centers[1])


def test_invert_rigid_and_normalized_intrinsics():
    m = random_rigid((5,), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    torch.testing.assert_close(invert_rigid(m), torch.linalg.inv(m))
    cams, _, _ = make_cameras(size=(24, 32))
    k = cams.normalized_intrinsics()[0, 0]
    torch.testing.assert_close(
        k, torch.tensor([[30 / 32, 0.5 / 32, 15 / 32 - 0.5], [0, 28 / 24, 11 / 24 - 0.5], [0, 0, 1]]).double()
    )


def test_random_rigid_is_seeded_and_rigid():
    a = random_rigid((4,), generator=torch.Generator().manual_seed(1))
    b = random_rigid((4,), generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    Cameras(a[None], torch.eye(3).expand(1, 4, 3, 3), (8, 8))  # passes the rigid checks


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda w, k: (w * torch.tensor([2.0, 1, 1, 1])[:, None], k), "orthonormal"),
        (lambda w, k: (w * torch.tensor([-1.0, 1, 1, 1])[:, None], k), "det R = 1"),
        (lambda w, k: (w, k * torch.tensor([0.0, 1, 1])[:, None]), "positive focal"),
        (lambda w, k: (w.index_fill(-1, torch.tensor([3]), float("nan")), k), "finite"),
        (lambda w, k: (w, k[:, :1]), r"\(B, V\) of w2c"),
        (lambda w, k: (w[0], k), r"\(B, V, 4, 4\)"),
    ],
    ids=["scaled-rotation", "reflection", "zero-focal", "nan", "view-count", "rank"],
)
def test_bad_cameras_raise_value_errors_that_say_what_is_wrong(change, match):
    cams, _, _ = make_cameras(dtype=torch.float32)
    w2c, k = change(cams.w2c.clone(), cams.intrinsics.clone())
    with pytest.raises(ValueError, match=match):
        Cameras(w2c, k, (24, 32))


def test_bad_types_and_sizes():
    cams, _, _ = make_cameras(dtype=torch.float32)
    with pytest.raises(TypeError, match="w2c must be a floating-point tensor"):
        Cameras(cams.w2c.long(), cams.intrinsics, (24, 32))
    with pytest.raises(TypeError, match="intrinsics"):
        Cameras(cams.w2c, cams.intrinsics.tolist(), (24, 32))
    with pytest.raises(ValueError, match="image_size"):
        Cameras(cams.w2c, cams.intrinsics, (24, 0))
    with pytest.raises(ValueError, match=r"\(B, V\) = \(2, 2\)"):
        cams.check_batch(2, 2)
    with pytest.raises(ValueError, match="image_size must be the images"):
        cams.check_batch(2, 3, (32, 32))
    with pytest.raises(ValueError, match="world must be"):
        cams.transform(torch.eye(3))
    with pytest.raises(ValueError, match="eye and target must differ"):
        look_at(torch.ones(1, 3), torch.ones(1, 3))
