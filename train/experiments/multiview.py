"""Synthetic multi-view scenes whose labels need the cameras, drawn on the fly in torch.

A scene holds ``num_objects`` balls of distinct colours (a random permutation of the first ``num_objects`` of
:data:`COLOURS` per scene). Camera 0 looks from a random azimuth, elevation and distance towards a point near the
origin; the balls are placed from it: each at a uniform random pixel of the central part of view 0 and,
independently of that pixel, at a uniform random depth around the origin's. Every other camera looks towards its
own point near the origin from 30-150 degrees of azimuth to the left or right of camera 0, at its own random
elevation and distance. Each camera is also turned by a uniform random angle about its optical axis (roll), so
that no image direction means the same in every view. All cameras share known pinhole intrinsics.

Each view is rendered as anti-aliased disks of one **fixed pixel radius whatever the depth**, drawn far to near
(painter's order) on black. Scenes are redrawn until every disk is inside every image and no two disks touch in any
view, so no view shows an occlusion: each image is a function of the projected centres alone.

Two labels, each ``num_objects`` balanced classes (chance ``1 / num_objects``) by the symmetry between colours:

- ``"match"`` (default): the views after the first are **monochrome** (every ball the same grey); the label is the
  colour of the ball that is leftmost in view 1. View 1 shows which disk is leftmost but not its colour; view 0
  shows the colours but not where camera 1 is. The label needs the correspondence between the views, and with
  balls of one look in view 1 that correspondence is geometric: a ball's disk in view 1 lies on its epipolar line,
  the image of its ray from camera 0, which the cameras' relative pose and intrinsics give. Scenes where the
  leftmost disk is within ``margin`` pixels of another ball's epipolar segment (its ray over the depths balls can
  have), or of the second leftmost disk's column, are redrawn, so the geometry decides every label.
- ``"nearest"``: every view in colour; the label is the colour of the ball nearest to camera 0 (the smallest depth).
  One view never shows depth here (constant disk size, no occlusion, and depths drawn independently of view 0's
  pixels); two views with their relative pose give it by triangulation.

Both labels depend on the scene and the cameras' placement relative to each other only, so moving the whole world
by a rigid motion (every ``w2c`` becomes ``w2c @ inv(T)``, :meth:`MultiViewTask.move_world`) changes neither the
images nor the label. Camera encodings that are relative (GTA, RayRoPE, CaPE) give the same output for the moved
cameras; absolute ones (PETR, 3DPPE) see 3D positions they were never trained on.

Everything is vectorised in torch and drawn from a ``torch.Generator``: the same seed gives the same scenes.

Example:
    >>> task = MultiViewTask(img_size=32)
    >>> batch = task.sample(8, torch.Generator().manual_seed(0))
    >>> batch.images.shape, batch.labels.shape, batch.cameras.num_views
    (torch.Size([8, 2, 3, 32, 32]), torch.Size([8]), 2)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from visionpe.camera import Cameras, look_at, random_rigid
from visionpe.checks import check_choice, check_float, check_instance, check_int, describe

__all__ = ["COLOURS", "COLOUR_NAMES", "GREY", "LABELS", "MultiViewBatch", "MultiViewTask"]

COLOUR_NAMES = ("red", "green", "blue", "yellow", "magenta", "cyan")
#: RGB in [0, 1] of each ball's colour, one row per class
COLOURS = torch.tensor(
    [[1.0, 0.15, 0.15], [0.15, 0.85, 0.15], [0.25, 0.4, 1.0], [0.95, 0.85, 0.1], [0.9, 0.2, 0.9], [0.1, 0.85, 0.9]]
)
#: the colour of every ball in a monochrome view
GREY = torch.tensor([0.8, 0.8, 0.8])
LABELS = ("match", "nearest")


class MultiViewBatch(NamedTuple):
    """One batch of the task: ``images`` (B, V, 3, H, W) in [-1, 1] (black -1), their ``cameras``, ``labels`` (B,)
    int64 colour indices, the balls' world centres ``points`` (B, K, 3) and their ``colours`` (B, K) (indices into
    :data:`COLOURS`, a random permutation per scene)."""

    images: torch.Tensor
    cameras: Cameras
    labels: torch.Tensor
    points: torch.Tensor
    colours: torch.Tensor


def _check_range(value, name: str, low: float, high: float | None = None) -> tuple[float, float]:
    """``value`` as a (lo, hi) pair of floats with low <= lo <= hi (<= high)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{name} must be a (low, high) pair of numbers, got {describe(value)}")
    lo = check_float(value[0], f"{name}[0]", min=low, max=high)
    hi = check_float(value[1], f"{name}[1]", min=low, max=high)
    if lo > hi:
        raise ValueError(f"{name} must be (low, high) with low <= high, got {tuple(value)}")
    return lo, hi


@dataclass(frozen=True)
class MultiViewTask:
    """The scene distribution, the renderer and the label (see the module docstring).

    Args:
        label: ``"match"`` (the colour of the leftmost ball of the monochrome view 1) or ``"nearest"`` (the colour
            of the ball nearest to camera 0).
        num_objects: balls per scene, each of its own colour; also the number of classes (2 to 6).
        num_views: cameras per scene (>= 2).
        img_size: side of the square images in pixels.
        focal: focal length in units of ``img_size``; the principal point is the image centre.
        disk_radius: radius of every disk in pixels, the same at any depth.
        distance: range of the cameras' distances to the origin (uniform).
        elevation: range of the cameras' elevations in degrees (uniform; world +y is up).
        azimuth_offset: range of the azimuth, in degrees, of each camera after the first from camera 0 (uniform, to
            the left or the right with equal chance).
        roll: each camera turns about its optical axis by a uniform angle in [-roll, roll] degrees.
        target_jitter: each camera looks at a uniform random point of the cube [-target_jitter, target_jitter]^3
            rather than at the origin, so that image centres do not show the same point in every view.
        spread: the balls' pixels in view 0 are uniform in the central square of ``spread * img_size`` pixels.
        depth_range: the balls' depths in camera 0 are uniform within ``depth_range`` of the origin's depth.
        min_separation: smallest distance in pixels between two disk centres in any view; closer scenes are redrawn.
            The default, ``2 * disk_radius + 1``, keeps disks from touching; 0 keeps every scene (disks then
            occlude each other in painter's order).
        margin: scenes whose label is decided by a hair are redrawn: ``"match"``: the leftmost disk of view 1 less
            than ``margin`` pixels from another ball's epipolar segment or from the second leftmost disk's column;
            ``"nearest"``: the nearest and the second nearest ball less than ``margin / (focal * img_size)`` times
            camera 0's distance apart in depth (the depth step that moves a disk of a camera at right angles by
            about ``margin`` pixels).
    """

    label: str = "match"
    num_objects: int = 3
    num_views: int = 2
    img_size: int = 32
    focal: float = 1.0
    disk_radius: float = 2.5
    distance: tuple[float, float] = (5.0, 6.0)
    elevation: tuple[float, float] = (-30.0, 30.0)
    azimuth_offset: tuple[float, float] = (30.0, 150.0)
    roll: float = 180.0
    target_jitter: float = 0.8
    spread: float = 0.5
    depth_range: float = 1.0
    min_separation: float | None = None
    margin: float = 1.0

    def __post_init__(self) -> None:
        check_choice(self.label, "label", LABELS)
        check_int(self.num_objects, "num_objects", min=2, max=len(COLOURS))
        check_int(self.num_views, "num_views", min=2)
        check_int(self.img_size, "img_size", min=8)
        check_float(self.focal, "focal", min=0, min_open=True)
        check_float(self.disk_radius, "disk_radius", min=0, min_open=True)
        object.__setattr__(self, "distance", _check_range(self.distance, "distance", 0.0))
        object.__setattr__(self, "elevation", _check_range(self.elevation, "elevation", -80.0, 80.0))
        object.__setattr__(self, "azimuth_offset", _check_range(self.azimuth_offset, "azimuth_offset", 0.0, 180.0))
        check_float(self.roll, "roll", min=0, max=180)
        check_float(self.target_jitter, "target_jitter", min=0)
        check_float(self.spread, "spread", min=0, max=1, min_open=True)
        check_float(self.depth_range, "depth_range", min=0, min_open=True)
        if self.depth_range >= self.distance[0]:
            raise ValueError(
                f"depth_range must be below the smallest camera distance {self.distance[0]} (balls in front of "
                f"camera 0), got {self.depth_range}"
            )
        if self.min_separation is None:
            object.__setattr__(self, "min_separation", 2 * self.disk_radius + 1)
        check_float(self.min_separation, "min_separation", min=0)
        check_float(self.margin, "margin", min=0)

    @property
    def num_classes(self) -> int:
        return self.num_objects

    @property
    def chance(self) -> float:
        """Accuracy of a constant guess, in %: the classes are balanced."""
        return 100.0 / self.num_objects

    @property
    def focal_px(self) -> float:
        return self.focal * self.img_size

    # -- scenes ---------------------------------------------------------------------------------------------------
    def intrinsics(self, batch_size: int) -> torch.Tensor:
        """(B, V, 3, 3) pinhole matrices: focal ``focal * img_size`` pixels, principal point at the image centre."""
        f, c = self.focal_px, self.img_size / 2
        k = torch.tensor([[f, 0.0, c], [0.0, f, c], [0.0, 0.0, 1.0]])
        return k.expand(batch_size, self.num_views, 3, 3).clone()

    def _draw(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``n`` candidate scenes before the redraw rules: ball centres (n, K, 3), w2c (n, V, 4, 4) and the balls'
        depths in camera 0 (n, K)."""
        shape = (n, self.num_views)
        # camera 0 anywhere around the scene, each other camera some way to its left or right
        lo, hi = (math.radians(a) for a in self.azimuth_offset)
        offset = lo + (hi - lo) * torch.rand(shape, generator=generator)
        offset = offset * (torch.randint(0, 2, shape, generator=generator) * 2 - 1)
        offset[:, 0] = 0
        azimuth = 2 * math.pi * torch.rand(n, 1, generator=generator) + offset
        lo, hi = (math.radians(e) for e in self.elevation)
        elevation = lo + (hi - lo) * torch.rand(shape, generator=generator)
        radius = self.distance[0] + (self.distance[1] - self.distance[0]) * torch.rand(shape, generator=generator)
        eye = radius[..., None] * torch.stack(
            (elevation.cos() * azimuth.sin(), elevation.sin(), elevation.cos() * azimuth.cos()), -1
        )
        target = self.target_jitter * (2 * torch.rand(*shape, 3, generator=generator) - 1)
        w2c = look_at(eye, target)
        if self.roll > 0:  # turn each camera about its optical axis (z): rows x, y of its rotation mixed
            angle = math.radians(self.roll) * (2 * torch.rand(shape, generator=generator) - 1)
            turn = torch.eye(4).repeat(*shape, 1, 1)
            turn[..., 0, 0], turn[..., 0, 1] = angle.cos(), -angle.sin()
            turn[..., 1, 0], turn[..., 1, 1] = angle.sin(), angle.cos()
            w2c = turn @ w2c
        # the balls, placed from camera 0: a pixel, then a depth drawn independently of it
        half = self.spread * self.img_size / 2
        pixels = self.img_size / 2 + half * (2 * torch.rand(n, self.num_objects, 2, generator=generator) - 1)
        depth = radius[:, :1] + self.depth_range * (2 * torch.rand(n, self.num_objects, generator=generator) - 1)
        points = self._lift(pixels, depth, w2c[:, 0])
        return points, w2c, depth

    def _lift(self, pixels: torch.Tensor, depth: torch.Tensor, w2c: torch.Tensor) -> torch.Tensor:
        """(n, ..., 3) world points at camera depth ``depth`` (n, ...) on the rays through ``pixels`` (n, ..., 2) of
        the cameras ``w2c`` (n, 4, 4)."""
        rays = torch.cat(((pixels - self.img_size / 2) / self.focal_px, torch.ones_like(pixels[..., :1])), -1)
        rot, trans = w2c[:, :3, :3], w2c[:, :3, 3]
        shape = rays.shape
        cam = (rays * depth[..., None]).reshape(shape[0], -1, 3)
        return ((cam - trans[:, None]) @ rot).reshape(shape)  # R^T (x_cam - t), as row vectors

    def _pixels(self, points: torch.Tensor, w2c: torch.Tensor) -> torch.Tensor:
        """(n, V, M, 2) pixel of each point (n, M, 3) in each view (every camera has the same intrinsics)."""
        cam = points[:, None] @ w2c[..., :3, :3].transpose(-1, -2) + w2c[:, :, None, :3, 3]
        return self.focal_px * cam[..., :2] / cam[..., 2:] + self.img_size / 2

    def _keep(self, points: torch.Tensor, w2c: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """(n,) bool: the scenes whose disks are all inside every image and apart by ``min_separation``, and whose
        label is decided by ``margin``."""
        pixels = self._pixels(points, w2c)  # (n, V, K, 2)
        inside = self.disk_radius + 1
        keep = ((pixels >= inside) & (pixels <= self.img_size - inside)).flatten(1).all(1)
        if self.min_separation > 0:
            apart = (pixels[:, :, :, None] - pixels[:, :, None]).norm(dim=-1) + torch.eye(self.num_objects) * 1e9
            keep &= apart.flatten(1).amin(1) >= self.min_separation
        if self.margin > 0:
            if self.label == "match":
                order = pixels[:, 1, :, 0].argsort(dim=-1)
                first, second = pixels[:, 1, :, 0].gather(1, order[:, :2]).unbind(-1)
                keep &= (second - first >= self.margin) & (self._epipolar_gap(pixels, w2c, order[:, 0]) >= self.margin)
            else:
                first, second = depth.sort(dim=-1).values[:, :2].unbind(-1)
                keep &= second - first >= self.margin / self.focal_px * w2c[:, 0, :3, 3].norm(dim=-1)
        return keep

    def _epipolar_gap(self, pixels: torch.Tensor, w2c: torch.Tensor, ball: torch.Tensor) -> torch.Tensor:
        """(n,) the distance in view 1 between the disk of ``ball`` (n,) and the image of any other ball's ray of
        view 0 over the depths balls can have (the part of its epipolar line that could hold it): how far the ball
        is from being mistaken for another. A 3D segment in front of a camera projects to the 2D segment between its
        ends' projections."""
        n, others = pixels.shape[0], self.num_objects - 1
        rest = torch.arange(self.num_objects).expand(n, -1)
        rest = rest[rest != ball[:, None]].reshape(n, others)  # the other balls
        centre = w2c[:, 0, :3, 3].norm(dim=-1)  # camera 0's distance to the origin: the balls' mean depth
        depth = torch.stack((centre - self.depth_range, centre + self.depth_range), -1)  # (n, 2)
        starts = pixels[:, 0].gather(1, rest[..., None].expand(-1, -1, 2))  # (n, K - 1, 2) in view 0
        ends = self._lift(starts[:, :, None].expand(-1, -1, 2, -1), depth[:, None].expand(-1, others, -1), w2c[:, 0])
        seen = self._pixels(ends.reshape(n, -1, 3), w2c[:, 1:2])[:, 0].unflatten(1, (others, 2))  # (n, K - 1, 2, 2)
        a, b = seen[..., 0, :], seen[..., 1, :]
        p = pixels[:, 1].gather(1, ball[:, None, None].expand(-1, 1, 2))  # (n, 1, 2): the ball in view 1
        t = (((p - a) * (b - a)).sum(-1) / (b - a).square().sum(-1).clamp_min(1e-12)).clamp(0, 1)
        return (a + t[..., None] * (b - a) - p).norm(dim=-1).amin(1)

    def scenes(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, Cameras, torch.Tensor]:
        """``batch_size`` scenes that pass the redraw rules: ball centres (B, K, 3), their cameras and the balls'
        colours (B, K) (a random permutation of the first K colours per scene)."""
        check_int(batch_size, "batch_size", min=1)
        check_instance(generator, "generator", torch.Generator, expected="a torch.Generator")
        points, w2c, found = [], [], 0
        for _ in range(100):
            p, w, d = self._draw(4 * batch_size, generator)
            keep = self._keep(p, w, d)
            points.append(p[keep])
            w2c.append(w[keep])
            found += int(keep.sum())
            if found >= batch_size:
                break
        else:
            raise ValueError(
                f"fewer than {batch_size} scenes passed min_separation={self.min_separation} and margin="
                f"{self.margin} in 100 draws of {4 * batch_size}; lower them, the disk radius or the number of objects"
            )
        cams = Cameras(torch.cat(w2c)[:batch_size], self.intrinsics(batch_size), (self.img_size, self.img_size))
        colours = torch.rand(batch_size, self.num_objects, generator=generator).argsort(dim=-1)
        return torch.cat(points)[:batch_size], cams, colours

    # -- labels and images ----------------------------------------------------------------------------------------
    def labels(self, points: torch.Tensor, cameras: Cameras, colours: torch.Tensor) -> torch.Tensor:
        """(B,) int64 colour index: of the leftmost ball of view 1 (``"match"``) or of the ball nearest to camera 0
        (``"nearest"``, the smallest depth). Neither changes when the world moves rigidly under both the points and
        the cameras."""
        pixels, depth = cameras.project(points)
        ball = pixels[:, 1, :, 0].argmin(dim=-1) if self.label == "match" else depth[:, 0].argmin(dim=-1)
        return colours.gather(1, ball[:, None])[:, 0]

    def render(self, points: torch.Tensor, cameras: Cameras, colours: torch.Tensor) -> torch.Tensor:
        """(B, V, 3, H, W) images in [-1, 1]: every ball a disk of ``disk_radius`` pixels around its projected centre,
        with a one-pixel linear edge (anti-aliasing), in its colour (view 0, and every view of ``"nearest"``) or grey
        (:data:`GREY`, the other views of ``"match"``), drawn far to near over black (-1)."""
        size = self.img_size
        pixels, depth = cameras.project(points)  # (B, V, K, 2), (B, V, K)
        centre = torch.arange(size, dtype=pixels.dtype) + 0.5
        du = centre.view(1, 1, 1, 1, size) - pixels[..., 0, None, None]
        dv = centre.view(1, 1, 1, size, 1) - pixels[..., 1, None, None]
        alpha = (self.disk_radius + 0.5 - torch.hypot(du, dv)).clamp(0, 1)  # (B, V, K, H, W)
        rgb = COLOURS[colours][:, None].repeat(1, self.num_views, 1, 1)  # (B, V, K, 3)
        if self.label == "match":
            rgb[:, 1:] = GREY
        order = depth.argsort(dim=-1, descending=True)  # far first
        alpha = alpha.gather(2, order[..., None, None].expand_as(alpha))
        rgb = rgb.gather(2, order[..., None].expand_as(rgb))
        image = torch.zeros(*alpha.shape[:2], 3, size, size, dtype=alpha.dtype)
        for k in range(self.num_objects):
            a = alpha[:, :, k, None]
            image = image * (1 - a) + a * rgb[:, :, k, :, None, None]
        return image * 2 - 1

    def sample(self, batch_size: int, generator: torch.Generator) -> MultiViewBatch:
        """``batch_size`` fresh scenes: images, cameras, labels, ball centres and colours."""
        points, cameras, colours = self.scenes(batch_size, generator)
        images = self.render(points, cameras, colours)
        return MultiViewBatch(images, cameras, self.labels(points, cameras, colours), points, colours)

    @staticmethod
    def move_world(cameras: Cameras, generator: torch.Generator, translation: float = 5.0) -> Cameras:
        """The same cameras after one random rigid motion of the world per sample: a uniformly random rotation and a
        translation with N(0, ``translation``^2) entries (:func:`~visionpe.camera.random_rigid`). The images and
        labels of a batch stay valid for them."""
        check_instance(cameras, "cameras", Cameras, expected="a visionpe.camera.Cameras")
        check_float(translation, "translation", min=0)
        world = random_rigid((cameras.batch_size,), translation=translation, generator=generator)
        return cameras.transform(world.to(cameras.w2c.dtype))
