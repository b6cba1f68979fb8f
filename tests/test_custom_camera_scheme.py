"""A new camera scheme is one registered class, and the generic tests cover it without being edited.

``ViewFrames`` below is a throwaway relative camera scheme: each view's q, k and v are mapped by the transpose of its
camera's rotation R (w2c's 3 x 3 block, on every block of 3 + 1 channels) and attention's output back by R, so the
logits read q^T R_q R_k^T k, which a rigid motion of the whole scene leaves unchanged. It is a
:class:`~visionpe.camera.base.RelativeCameraEncoding` whose per-block transform is a
:class:`~visionpe.camera.base.QKVCameraTransform` (the pattern of the scheme written for
tests/models/test_multiview_vit.py). ``tests/conftest.py`` imports this module before any test module is collected,
so the scheme is in the registry (``visionpe.list_schemes("camera")``) when the generic tests build their lists from
it (the contract's pairs in tests/test_contract.py, the fuzzing of the multi-view ViT in
tests/reliability/test_fuzz.py), and removes it when the run ends.
"""

from __future__ import annotations

import pytest
import timm
import torch

import visionpe
from visionpe.base import check_model_shape
from visionpe.camera import CameraState, QKVCameraTransform, RelativeCameraEncoding, look_at, random_rigid
from visionpe.camera.base import view_blocks_matmul
from visionpe.camera.cameras import Cameras
from visionpe.registry import unregister_scheme

NAME = "test_view_frames"

if NAME in visionpe.list_schemes("camera"):  # the module imported a second time (another import path)
    unregister_scheme(NAME)


class _ViewFramesTransform(QKVCameraTransform):
    def __init__(self, frames: torch.Tensor) -> None:
        self.frames = frames  # (B, V, 4, 4): R^T of each view, padded with a 1

    def transform_qkv(self, q, k, v):
        frames = self.frames.to(q.dtype)
        return tuple(view_blocks_matmul(t, frames, frames.shape[1]) for t in (q, k, v))

    def untransform_output(self, o):
        frames = self.frames.to(o.dtype)
        return view_blocks_matmul(o, frames.transpose(-1, -2), frames.shape[1])


class _ViewFramesState(CameraState):
    def __init__(self, frames: torch.Tensor) -> None:
        self.frames = frames

    def layer(self, index, tokens=None):
        return _ViewFramesTransform(self.frames)


@visionpe.register_scheme(NAME)
class ViewFrames(RelativeCameraEncoding):
    """q, k, v of each view in blocks of 3 + 1 channels rotated by R^T (head_dim a multiple of 4); nothing learned."""

    def __init__(self, dim: int, num_heads: int, depth: int = 1) -> None:
        super().__init__()
        head_dim = check_model_shape(dim, num_heads, depth)
        if head_dim % 4:
            raise ValueError(f"head_dim must be a multiple of 4 for {NAME}, got dim={dim} / num_heads={num_heads}")

    def prepare(self, cameras: Cameras, grid_size: tuple[int, int]) -> _ViewFramesState:
        self.check_cameras(cameras, grid_size)
        frames = torch.zeros_like(cameras.w2c)
        frames[..., :3, :3] = cameras.w2c[..., :3, :3].transpose(-1, -2)
        frames[..., 3, 3] = 1
        return _ViewFramesState(frames)


def unregister() -> None:
    """Remove the scheme from the registry (the test run's end)."""
    if NAME in visionpe.list_schemes("camera"):
        unregister_scheme(NAME)


TINY = dict(img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3)


def _cameras(views: int = 3, dtype=torch.float64) -> Cameras:
    g = torch.Generator().manual_seed(0)
    eyes = torch.randn(2, views, 3, generator=g)
    eyes = 3 * eyes / eyes.norm(dim=-1, keepdim=True)
    k = torch.tensor([[16.0, 0, 8], [0, 16.0, 8], [0, 0, 1]]).expand(2, views, 3, 3)
    return Cameras(look_at(eyes, torch.zeros(2, views, 3)), k, (16, 16)).to(dtype)


def test_listed_with_the_camera_schemes_only():
    assert NAME in visionpe.list_schemes("camera") and NAME not in visionpe.list_schemes()
    assert NAME in visionpe.registry.registered_schemes()


def test_the_generic_tests_collected_in_this_run_cover_it():
    from . import conftest

    assert not conftest.uncovered_generic_tests(NAME)


def test_the_world_frame_does_not_matter_and_each_camera_does():
    """The relative property: one rigid motion of every camera leaves the output unchanged; moving one camera alone
    changes it, and the scheme changes the model."""
    torch.manual_seed(0)
    model = timm.create_model("visionpe_mvvit_tiny_patch16", camera_embed=NAME, pos_embed="rope_axial", **TINY)
    model = model.double().eval()
    assert isinstance(model.camera_schemes[NAME], ViewFrames)
    x, cams = torch.randn(2, 3, 3, 16, 16, dtype=torch.float64), _cameras()
    out = model(x, cams)
    world = random_rigid(generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(model(x, cams.transform(world)), out, atol=1e-10, rtol=0)
    one_view_moved = cams.w2c.clone()
    one_view_moved[:, 1] = one_view_moved[:, 1] @ world
    assert not torch.allclose(model(x, Cameras(one_view_moved, cams.intrinsics, cams.image_size)), out, atol=1e-4)
    plain = timm.create_model("visionpe_mvvit_tiny_patch16", pos_embed="rope_axial", **TINY).double().eval()
    plain.load_state_dict(model.state_dict())
    assert not torch.allclose(plain(x, cams), out, atol=1e-4)


def test_trains_under_autocast():
    model = timm.create_model("visionpe_mvvit_tiny_patch16", camera_embed=NAME, **TINY).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(2, 3, 3, 16, 16), _cameras(dtype=torch.float32))
    assert torch.isfinite(out).all()
    out.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_bad_arguments_are_refused_naming_them():
    with pytest.raises(ValueError, match=rf"head_dim must be a multiple of 4 for {NAME}, got dim=30 / num_heads=3"):
        visionpe.create_pos_embed(NAME, dim=30, num_heads=3)
    with pytest.raises(TypeError, match="cameras must be a visionpe.camera.Cameras"):
        visionpe.create_pos_embed(NAME, dim=32, num_heads=2).prepare({"w2c": torch.eye(4)}, (2, 2))
