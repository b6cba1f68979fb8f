"""Cameras of a multi-view batch: the one convention every camera-aware scheme reads.

Per sample ``b`` and view ``v``:

- ``w2c[b, v]``: the 4x4 world-to-camera transform in the OpenCV convention (x right, y down, z forward, the camera
  looks along +z), ``[[R, t], [0, 0, 0, 1]]`` with R a rotation (orthonormal, det +1); a world point X is at
  ``R X + t`` in the camera's frame;
- ``intrinsics[b, v]``: the 3x3 pinhole matrix in pixels, ``[[fx, s, cx], [0, fy, cy], [0, 0, 1]]`` with
  fx, fy > 0; a camera point (x, y, z), z > 0, lands on pixel ``(fx x / z + s y / z + cx, fy y / z + cy)``;
- ``image_size``: the (H, W) in pixels the intrinsics refer to (every view of a batch has the same size).

Pixel (u, v) = (0, 0) is the top-left corner of the top-left pixel, so pixel ``i`` spans [i, i + 1) and its centre
is i + 0.5. Patch tokens are ordered (view, row, column), the patch of row ``i``, column ``j`` of an (h, w) grid
centred at pixel ((j + 0.5) W / w, (i + 0.5) H / h).

A global rigid motion of the world T (4x4, world -> new world) changes every ``w2c`` into ``w2c @ inv(T)``
(:meth:`Cameras.transform`); relative camera encodings (GTA, RayRoPE, CaPE) do not change under it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import describe
from ..grid import grid_coords, validate_grid_size

__all__ = ["Cameras", "look_at", "random_rigid", "invert_rigid"]

#: tolerance of the rotation checks (R R^T = I, det R = 1) and of the bottom row (0, 0, 0, 1)
RIGID_ATOL = 1e-3


def invert_rigid(m: torch.Tensor) -> torch.Tensor:
    """Inverse of rigid 4x4 transforms ``m`` (..., 4, 4): ``[[R^T, -R^T t], [0, 1]]``, exact without a solve."""
    rot_t = m[..., :3, :3].transpose(-1, -2)
    out = torch.zeros_like(m)
    out[..., :3, :3] = rot_t
    out[..., :3, 3] = -(rot_t @ m[..., :3, 3:4]).squeeze(-1)
    out[..., 3, 3] = 1
    return out


def _check_rigid(m: torch.Tensor, name: str) -> None:
    """ValueError unless every (4, 4) matrix of ``m`` is finite, rigid (orthonormal R, det +1) with bottom row 0001."""
    if not bool(torch.isfinite(m).all()):
        raise ValueError(f"{name} must hold finite values, got NaN or inf")
    m = m.double()
    rot = m[..., :3, :3]
    eye = torch.eye(3, dtype=m.dtype, device=m.device)
    ortho = (rot @ rot.transpose(-1, -2) - eye).abs().amax(dim=(-1, -2))
    det = torch.linalg.det(rot)
    bottom = (m[..., 3, :] - torch.tensor([0.0, 0, 0, 1], dtype=m.dtype, device=m.device)).abs().amax(-1)
    bad = (ortho > RIGID_ATOL) | ((det - 1).abs() > RIGID_ATOL) | (bottom > RIGID_ATOL)
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} must be rigid transforms [[R, t], [0, 0, 0, 1]] with R orthonormal and det R = 1 (within "
            f"{RIGID_ATOL}); {name}{list(index)} has max |R R^T - I| = {float(ortho[index]):.3g}, det R = "
            f"{float(det[index]):.4g} and bottom row {m[index][3].tolist()}"
        )


@dataclass(frozen=True, eq=False)
class Cameras:
    """Per-view cameras of a batch of multi-view images (see the module docstring for the conventions).

    Args:
        w2c: (B, V, 4, 4) world-to-camera rigid transforms (OpenCV axes).
        intrinsics: (B, V, 3, 3) pinhole matrices in pixels (fx, fy > 0, last row (0, 0, 1)).
        image_size: (H, W) in pixels, the image the intrinsics refer to.

    Every field is checked on construction (shapes, finite values, a rigid w2c, positive focal lengths): a
    ValueError or TypeError says which and what was given. Under ``torch.compile`` the value checks are skipped.

    Example:
        >>> import torch
        >>> from visionpe.camera import Cameras, look_at
        >>> w2c = look_at(torch.tensor([[[0.0, 0, -3], [3.0, 0, 0]]]), torch.zeros(1, 2, 3))
        >>> K = torch.tensor([[32.0, 0, 16], [0, 32.0, 16], [0, 0, 1]]).expand(1, 2, 3, 3)
        >>> cams = Cameras(w2c, K, (32, 32))
        >>> cams.batch_size, cams.num_views
        (1, 2)
        >>> torch.allclose(cams.centers[0, 1], torch.tensor([3.0, 0.0, 0.0]))
        True
    """

    w2c: torch.Tensor
    intrinsics: torch.Tensor
    image_size: tuple[int, int]

    def __post_init__(self) -> None:
        for name in ("w2c", "intrinsics"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                raise TypeError(f"{name} must be a floating-point tensor, got {describe(value)}")
        w2c, k = self.w2c, self.intrinsics
        if w2c.ndim != 4 or w2c.shape[-2:] != (4, 4) or w2c.shape[0] == 0 or w2c.shape[1] == 0:
            raise ValueError(f"w2c must be (B, V, 4, 4) with B, V >= 1, got shape {tuple(w2c.shape)}")
        if k.shape != (*w2c.shape[:2], 3, 3):
            raise ValueError(
                f"intrinsics must be (B, V, 3, 3) with the (B, V) of w2c {tuple(w2c.shape[:2])}, got shape "
                f"{tuple(k.shape)}"
            )
        object.__setattr__(self, "image_size", validate_grid_size(self.image_size, "image_size", ndims=(2,)))
        if torch.compiler.is_compiling():
            return
        _check_rigid(w2c, "w2c")
        if not bool(torch.isfinite(k).all()):
            raise ValueError("intrinsics must hold finite values, got NaN or inf")
        focal = torch.stack((k[..., 0, 0], k[..., 1, 1]), -1)
        if bool((focal <= 0).any()):
            index = tuple(int(i) for i in (focal <= 0).any(-1).nonzero()[0])
            raise ValueError(
                f"intrinsics must have positive focal lengths fx = K[0, 0] and fy = K[1, 1]; intrinsics{list(index)} "
                f"has (fx, fy) = {focal[index].tolist()}"
            )
        last = (k[..., 2, :] - torch.tensor([0.0, 0, 1], dtype=k.dtype, device=k.device)).abs().amax()
        if float(last) > RIGID_ATOL or bool((k[..., 1, 0] != 0).any()):
            raise ValueError(
                "intrinsics must be upper-triangular pinhole matrices [[fx, s, cx], [0, fy, cy], [0, 0, 1]], got a "
                "matrix with another last row or a non-zero K[1, 0]"
            )

    # -- shape ------------------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.w2c.shape[0]

    @property
    def num_views(self) -> int:
        return self.w2c.shape[1]

    @property
    def device(self) -> torch.device:
        return self.w2c.device

    def to(self, *args, **kwargs) -> Cameras:
        """The cameras with both tensors moved or cast as ``Tensor.to(*args, **kwargs)``."""
        return Cameras(self.w2c.to(*args, **kwargs), self.intrinsics.to(*args, **kwargs), self.image_size)

    def check_batch(self, batch_size: int, num_views: int, image_size: tuple[int, int] | None = None) -> Cameras:
        """``self`` if it describes ``batch_size`` samples of ``num_views`` views (and images of ``image_size``),
        else a ValueError naming the mismatch."""
        if (self.batch_size, self.num_views) != (batch_size, num_views):
            raise ValueError(
                f"cameras must have one camera per image: (B, V) = ({batch_size}, {num_views}) as the images, got "
                f"(B, V) = ({self.batch_size}, {self.num_views})"
            )
        if image_size is not None and tuple(image_size) != self.image_size:
            raise ValueError(
                f"cameras.image_size must be the images' (H, W) = {tuple(image_size)}, got {self.image_size}"
            )
        return self

    # -- geometry ---------------------------------------------------------------------------------------------
    @property
    def c2w(self) -> torch.Tensor:
        """(B, V, 4, 4) camera-to-world transforms, the exact inverse of ``w2c``."""
        return invert_rigid(self.w2c)

    @property
    def centers(self) -> torch.Tensor:
        """(B, V, 3) camera centres in world coordinates."""
        return self.c2w[..., :3, 3]

    def transform(self, world: torch.Tensor) -> Cameras:
        """The same cameras after the world moves by the rigid ``world`` (4, 4) or (B, 4, 4) (world -> new world):
        ``w2c @ inv(world)``. Relative encodings (GTA, RayRoPE, CaPE) give the same attention for both."""
        if not isinstance(world, torch.Tensor) or world.shape[-2:] != (4, 4) or world.ndim not in (2, 3):
            raise ValueError(f"world must be a (4, 4) or (B, 4, 4) rigid transform, got {describe(world)}")
        _check_rigid(world, "world")
        world = world.to(self.w2c)
        if world.ndim == 3:
            world = world[:, None]
        return Cameras(self.w2c @ invert_rigid(world), self.intrinsics, self.image_size)

    def normalized_intrinsics(self) -> torch.Tensor:
        """(B, V, 3, 3) intrinsics in units of the image size with the principal point relative to the centre:
        fx / W, fy / H, cx / W - 0.5, cy / H - 0.5 (the convention RayRoPE's code takes)."""
        height, width = self.image_size
        scale = torch.tensor([1 / width, 1 / height, 1.0], dtype=self.intrinsics.dtype, device=self.device)
        k = self.intrinsics * scale[:, None]
        shift = torch.tensor([0.5, 0.5, 0.0], dtype=k.dtype, device=k.device)
        k = k.clone()
        k[..., :, 2] = k[..., :, 2] - shift
        return k

    def patch_pixels(self, grid_size: tuple[int, int]) -> torch.Tensor:
        """(N, 2) pixel (u, v) of the centre of each patch of an (h, w) grid over the image, row-major."""
        grid_size = validate_grid_size(grid_size, ndims=(2,))
        yx = grid_coords(grid_size, mode="normalized", device=self.device)
        height, width = self.image_size
        return torch.stack((yx[:, 1] * width, yx[:, 0] * height), -1).to(self.w2c.dtype)

    def rays(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, V, N, 3) world-frame unit directions of the rays through ``pixels`` (N, 2) or (B, V, N, 2)."""
        return torch.nn.functional.normalize(self.unproject(pixels, None) - self.centers[:, :, None], dim=-1)

    def unproject(self, pixels: torch.Tensor, depth: torch.Tensor | None) -> torch.Tensor:
        """(B, V, N, 3) world points at camera depth ``depth`` (B, V, N) (z in the camera frame; None: 1) on the rays
        through ``pixels`` (N, 2) or (B, V, N, 2)."""
        if pixels.ndim == 2:
            pixels = pixels.expand(self.batch_size, self.num_views, -1, -1)
        k = self.intrinsics
        fx, fy, cx, cy, skew = (
            k[..., 0, 0, None],
            k[..., 1, 1, None],
            k[..., 0, 2, None],
            k[..., 1, 2, None],
            k[..., 0, 1, None],
        )
        y = (pixels[..., 1] - cy) / fy
        x = (pixels[..., 0] - cx - skew * y) / fx
        cam = torch.stack((x, y, torch.ones_like(x)), -1)
        if depth is not None:
            cam = cam * depth[..., None]
        c2w = self.c2w
        return cam @ c2w[..., :3, :3].transpose(-1, -2) + c2w[:, :, None, :3, 3]

    def project(self, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pixels (B, V, N, 2) and camera depths (B, V, N) of world ``points`` (B, V, N, 3) (or (B, N, 3): the same
        points seen by every view)."""
        if points.ndim == 3:
            points = points[:, None].expand(-1, self.num_views, -1, -1)
        cam = points @ self.w2c[..., :3, :3].transpose(-1, -2) + self.w2c[:, :, None, :3, 3]
        z = cam[..., 2]
        pix = cam @ self.intrinsics.transpose(-1, -2)
        return pix[..., :2] / z[..., None], z


def look_at(eye: torch.Tensor, target: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """(..., 4, 4) OpenCV world-to-camera transforms of cameras at ``eye`` (..., 3) looking at ``target`` (..., 3).

    The image's up direction (the camera's -y axis) points towards ``up`` (3,), world +y by default; it must not be
    parallel to the viewing direction (ValueError)."""
    for name, value in (("eye", eye), ("target", target)):
        if not isinstance(value, torch.Tensor) or value.shape[-1:] != (3,) or not value.is_floating_point():
            raise ValueError(f"{name} must be a floating-point (..., 3) tensor, got {describe(value)}")
    if up is None:
        up = torch.tensor([0.0, 1.0, 0.0], dtype=eye.dtype, device=eye.device)
    forward = target - eye
    if bool((forward.norm(dim=-1) == 0).any()):
        raise ValueError("eye and target must differ: a camera at its target has no viewing direction")
    z = torch.nn.functional.normalize(forward, dim=-1)
    x = torch.linalg.cross(-up.expand_as(z), z, dim=-1)
    if bool((x.norm(dim=-1) < 1e-6).any()):
        raise ValueError("up must not be parallel to the viewing direction target - eye")
    x = torch.nn.functional.normalize(x, dim=-1)
    y = torch.linalg.cross(z, x, dim=-1)
    rot = torch.stack((x, y, z), -2)  # rows: the camera axes in world coordinates
    out = torch.zeros(*eye.shape[:-1], 4, 4, dtype=eye.dtype, device=eye.device)
    out[..., :3, :3] = rot
    out[..., :3, 3] = -(rot @ eye[..., None]).squeeze(-1)
    out[..., 3, 3] = 1
    return out


def random_rigid(
    shape: tuple[int, ...] = (),
    translation: float = 1.0,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """(*shape, 4, 4) random rigid transforms: a uniformly random rotation (QR of a Gaussian matrix, signs fixed)
    and a translation with N(0, ``translation``^2) entries."""
    g = torch.randn(*shape, 3, 3, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[..., None, :]
    q = torch.where(torch.linalg.det(q)[..., None, None] < 0, -q, q)
    out = torch.zeros(*shape, 4, 4, dtype=torch.float64)
    out[..., :3, :3] = q
    out[..., :3, 3] = translation * torch.randn(*shape, 3, generator=generator, dtype=torch.float64)
    out[..., 3, 3] = 1
    return out.to(dtype)
