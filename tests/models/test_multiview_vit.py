"""The multi-view ViT: views in one sequence, within-view schemes per view, camera schemes around attention."""

import pytest
import timm
import torch

import visionpe
from visionpe.camera import CameraState, QKVCameraTransform, RelativeCameraEncoding, look_at, random_rigid
from visionpe.camera.cameras import Cameras
from visionpe.models.multiview_vit import ViewTiledState
from visionpe.registry import register_scheme, unregister_scheme

TINY = dict(img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3)


def cameras(batch=2, views=2, size=(16, 16), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    eyes = torch.randn(batch, views, 3, generator=g)
    eyes = 3 * eyes / eyes.norm(dim=-1, keepdim=True)
    k = torch.tensor([[16.0, 0, size[1] / 2], [0, 16.0, size[0] / 2], [0, 0, 1]]).expand(batch, views, 3, 3)
    return Cameras(look_at(eyes, torch.zeros(batch, views, 3)), k, size).to(dtype)


def mvvit(**kwargs):
    return timm.create_model("visionpe_mvvit_tiny_patch16", **{**TINY, **kwargs}).eval()


@pytest.mark.parametrize("pos_embed", ["learned", "cpe", "rope_axial", "string_cayley"])
def test_one_view_equals_the_single_image_vit_with_the_same_weights(pos_embed):
    torch.manual_seed(0)
    model = mvvit(pos_embed=pos_embed)
    single = timm.create_model(
        "visionpe_vit_tiny_patch16_224", pos_embed=pos_embed, class_token=False, global_pool="avg", **TINY
    ).eval()
    single.load_state_dict(model.state_dict())
    x = torch.randn(2, 1, 3, 16, 16)
    torch.testing.assert_close(model(x, cameras(views=1)), single(x[:, 0]), atol=1e-5, rtol=1e-5)


def test_within_view_rotations_repeat_over_the_views():
    """The tiled rotation equals the scheme prepared on each view's coordinates repeated V times."""
    rope = visionpe.create_pos_embed("rope_mixed", dim=32, num_heads=2)
    coords = rope.coords((2, 3))
    tiled = ViewTiledState(rope.prepare(coords, 0, grid_size=(2, 3)), 3).layer(0)
    repeated = rope.prepare(coords.repeat(3, 1), 0).layer(0)
    qk = torch.randn(2, 4, 2, 18, 16)
    torch.testing.assert_close(tiled.rotate(qk), repeated.rotate(qk))


def test_views_are_exchangeable_without_cameras_and_tokens_are_ordered_by_view():
    torch.manual_seed(0)
    model = mvvit(pos_embed="rope_axial")
    x, cams = torch.randn(2, 3, 3, 16, 16), cameras(views=3)
    swapped = Cameras(cams.w2c.flip(1), cams.intrinsics.flip(1), cams.image_size)
    torch.testing.assert_close(model(x, cams), model(x.flip(1), swapped), atol=1e-5, rtol=1e-5)
    maps = model.forward_view_features(x, cams)
    assert maps.shape == (2, 3, 32, 2, 2)
    tokens = model.forward_features(x, cams)
    torch.testing.assert_close(maps[:, 1].flatten(2).transpose(1, 2), tokens[:, 4:8])
    final, feats = model.forward_intermediates(x, cams, indices=[0, 1])
    torch.testing.assert_close(final, tokens)
    assert [f.shape for f in feats] == [(2, 3, 32, 2, 2)] * 2
    assert model.forward_intermediates(x, cams, indices=1, output_fmt="NLC", intermediates_only=True)[0].shape == (
        2,
        12,
        32,
    )


class _ViewRotation(QKVCameraTransform):
    """Maps q, k, v of each view by R^T, the rotation part of its w2c transposed (per 3 + 1 channels), and the output
    back by R: a relative encoding (logits q^T R_q R_k^T k, unchanged when every R becomes R A), written for these
    tests."""

    def __init__(self, rot: torch.Tensor, tokens: torch.Tensor | None, seen: list) -> None:
        self.rot = rot  # (B, V, 4, 4): the rotation padded with a 1
        seen.append(tokens)

    def transform_qkv(self, q, k, v):
        views = self.rot.shape[1]
        q, k, v = (visionpe.camera.view_blocks_matmul(t, self.rot, views) for t in (q, k, v))
        return q, k, v

    def untransform_output(self, o):
        return visionpe.camera.view_blocks_matmul(o, self.rot.transpose(-1, -2), self.rot.shape[1])


class _ViewRotationState(CameraState):
    def __init__(self, rot, seen):
        self.rot, self.seen = rot, seen

    def layer(self, index, tokens=None):
        return _ViewRotation(self.rot, tokens, self.seen)


@pytest.fixture
def view_rotation_scheme():
    class ViewRotationScheme(RelativeCameraEncoding):
        needs_tokens = True

        def __init__(self, dim, num_heads, depth=1):
            super().__init__()
            self.seen = []

        def prepare(self, cameras, grid_size):
            self.check_cameras(cameras, grid_size)
            rot = torch.zeros_like(cameras.w2c)
            rot[..., :3, :3] = cameras.w2c[..., :3, :3].transpose(-1, -2)
            rot[..., 3, 3] = 1
            return _ViewRotationState(rot, self.seen)

    register_scheme("test_view_rotation")(ViewRotationScheme)
    yield "test_view_rotation"
    unregister_scheme("test_view_rotation")


def test_a_relative_camera_scheme_runs_around_attention_and_is_invariant(view_rotation_scheme):
    torch.manual_seed(0)
    model = mvvit(camera_embed=view_rotation_scheme, pos_embed="rope_axial").double()
    assert view_rotation_scheme in visionpe.list_schemes("camera")
    assert view_rotation_scheme not in visionpe.list_schemes()
    x, cams = torch.randn(2, 2, 3, 16, 16, dtype=torch.float64), cameras(dtype=torch.float64)
    out = model(x, cams)
    seen = model.camera_schemes[view_rotation_scheme].seen
    assert len(seen) == 2 and seen[0].shape == (2, 8, 32)  # one transform per block, given the block's tokens
    world = random_rigid(generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(model(x, cams.transform(world)), out, atol=1e-10, rtol=0)
    one_view_moved = cams.w2c.clone()
    one_view_moved[:, 1] = one_view_moved[:, 1] @ world
    assert not torch.allclose(model(x, Cameras(one_view_moved, cams.intrinsics, cams.image_size)), out, atol=1e-4)
    plain = mvvit(pos_embed="rope_axial").double()
    plain.load_state_dict(model.state_dict())
    assert not torch.allclose(plain(x, cams), out, atol=1e-4)  # the scheme changes the model


def test_gradients_reach_every_parameter():
    model = mvvit(pos_embed="rope_mixed").train()
    model(torch.randn(2, 2, 3, 16, 16), cameras()).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(pos_embed="alibi2d"), "absolute or rotary"),
        (dict(class_token=True), "class_token must be False"),
        (dict(reg_tokens=2), "reg_tokens must be 0"),
        (dict(camera_embed="rope_axial"), "camera_embed here takes camera schemes"),
        (dict(camera_embed="no_such_scheme"), "unknown position scheme"),
        (dict(num_views=0), "num_views"),
    ],
)
def test_bad_configurations(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mvvit(**kwargs)


def test_bad_inputs():
    model = mvvit()
    x = torch.randn(2, 2, 3, 16, 16)
    with pytest.raises(ValueError, match=r"\(B, V\) = \(2, 2\) as the images, got \(B, V\) = \(2, 3\)"):
        model(x, cameras(views=3))
    with pytest.raises(TypeError, match="cameras must be a visionpe.camera.Cameras"):
        model(x, {"w2c": cameras().w2c})
    with pytest.raises(ValueError, match=r"multi-view batch \(B, V, C, H, W\)"):
        model(x[:, 0], cameras())
    with pytest.raises(ValueError, match="image_size must be the images"):
        model(torch.randn(2, 2, 3, 24, 24), cameras())
    with pytest.raises(ValueError, match="features_only"):
        timm.create_model("visionpe_mvvit_tiny_patch16", features_only=True, **TINY)


def test_depth_maps_reach_the_schemes_that_read_them():
    torch.manual_seed(0)
    x, cams = torch.randn(2, 2, 3, 16, 16), cameras()
    depth = 2 + torch.rand(2, 2, 16, 16)
    known = mvvit(camera_embed="rayrope", camera_embed_kwargs={"depth_source": "known"}, embed_dim=48)
    with pytest.raises(ValueError, match="read known depths"):
        known(x, cams)
    out = known(x, cams, depth=depth)
    assert not torch.allclose(out, known(x, cams, depth=depth + 1), atol=1e-5)
    # the patch depths are the means over each patch of the maps
    scheme = known.camera_schemes["rayrope"]
    seen = []
    original = scheme.prepare
    scheme.prepare = lambda cameras, grid, patch_depth=None: (
        seen.append(patch_depth) or original(cameras, grid, patch_depth=patch_depth)
    )
    known(x, cams, depth=depth[:, :, None])
    torch.testing.assert_close(seen[0], depth.unflatten(-1, (2, 8)).unflatten(-3, (2, 8)).mean((-3, -1)).flatten(2))
    ppe = mvvit(camera_embed="3dppe")
    assert not torch.allclose(ppe(x, cams), ppe(x, cams, depth=depth), atol=1e-5)  # given depths replace predictions
    with pytest.raises(ValueError, match="take none"):
        mvvit(camera_embed="gta")(x, cams, depth=depth)
    with pytest.raises(ValueError, match=r"depth must be \(B, V, H, W\)"):
        known(x, cams, depth=depth[:, :1])


def test_camera_embed_refusals_name_camera_embed():
    with pytest.raises(ValueError, match=r"camera_embed lists a scheme twice: \['gta', 'gta'\]"):
        mvvit(camera_embed=["gta", "gta"])
    with pytest.raises(TypeError, match=r"camera_embed must be a scheme name or a non-empty list of names, got 5"):
        mvvit(camera_embed=5)
    with pytest.raises(TypeError, match=r"camera_embed_kwargs must be a dict, got str"):
        mvvit(camera_embed="gta", camera_embed_kwargs="x")


def test_image_checks_show_the_multi_view_batch_given():
    """The images were checked as (B * V, C, H, W): a channels-last batch showed the flattened shape."""
    model = mvvit(camera_embed="gta")
    with pytest.raises(ValueError, match=r"\(B, V, C, H, W\) with .* got \(2, 2, 16, 16, 3\) \(channels last\? x"):
        model(torch.randn(2, 2, 16, 16, 3), cameras())
    with pytest.raises(ValueError, match=r"x must have the model's dtype torch.float32 .*got dtype torch.float64"):
        model(torch.randn(2, 2, 3, 16, 16, dtype=torch.float64), cameras())
    with pytest.raises(TypeError, match=r"x must be a multi-view batch \(B, V, C, H, W\), a tensor, got list"):
        model([[0.0]], cameras())
    with pytest.raises(ValueError, match=r"indices\[0\] must be an int in \[-2, 1\], got 5"):
        model.forward_intermediates(torch.randn(2, 2, 3, 16, 16), cameras(), indices=[5])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts the images itself
        assert model(torch.randn(2, 2, 3, 16, 16, dtype=torch.bfloat16), cameras()).isfinite().all()
