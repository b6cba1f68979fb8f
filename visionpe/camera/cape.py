"""CaPE, the camera positional encoding of EscherNet: Kong, Liu, Lyu, Taher, Qi, Davison, "EscherNet: A Generative Model
for Scalable View Synthesis", CVPR 2024 (arXiv 2402.03908; code kxhit/EscherNet).

CaPE writes each view's camera pose into its tokens' queries and keys, so that the dot product of a query of view
i with a key of view j depends on the two poses only through their relative transform. Values and the attention
output are left unchanged. Two variants:

- ``"6dof"`` (default): each head's channels are cut into 4-blocks, read as row vectors, and multiplied by a 4x4
  matrix of the view's pose P (its world-to-camera matrix, the translation optionally scaled):
  ``q_b <- q_b P_i^-T`` and ``k_b <- k_b P_j``. Each block then contributes
  ``q_b P_i^-T P_j^T k_b^T = q_b (P_j P_i^-1)^T k_b^T`` to the logit: only ``P_j P_i^-1 = w2c_j c2w_i`` enters,
  which a rigid motion of the world (every P becoming ``P T^-1``) leaves unchanged. There is one "frequency": the
  rotation enters the logit linearly and the translation too, so large translations give large logits
  (``translation_scale`` shrinks them, exactly invariantly).
- ``"4dof"``: for object-centric cameras looking at the world origin. Each view's camera centre gives
  (polar angle from the polar axis, azimuth around it, log radius mapped to [0, pi], 0): the radius r is clamped
  to ``radius_range`` = (r0, r1) and mapped to ``pi (log r - log r0) / (log r1 - log r0)``. Each of the four angles
  is repeated over a quarter of the head's channels, and q and k are rotated in consecutive pairs by them
  (interleaved RoPE with a single frequency): the logits depend on the differences of the four values, hence are
  unchanged when the world turns around the polar axis through the origin (a common azimuth offset).

In the reference code both variants act on the channel vector of all heads together. For 6DoF this is the same as
acting on each head (4-blocks never cross heads when head_dim is a multiple of 4). For 4DoF it gives each quarter of
the *heads* one angle; this library follows the per-head reading (every head sees all four angles), which keeps
heads interchangeable. The reference's 4DoF polar axis is world +z (Objaverse); ``polar_axis`` picks another.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..base import check_layer, check_model_shape
from ..checks import check_choice, check_float, describe
from ..registry import register_scheme
from .base import CameraState, QKVCameraTransform, RelativeCameraEncoding, view_blocks_matmul
from .cameras import Cameras, invert_rigid
from .gta import check_qkv_shape

__all__ = ["CaPE", "CaPEState", "CaPETransform", "cape_4dof_pose"]

#: the reference's Objaverse camera distances, mapped to log-radius angles 0 .. pi
DEFAULT_RADIUS_RANGE = (1.5, 2.2)
_AXES = {"x": (1, 2, 0), "y": (2, 0, 1), "z": (0, 1, 2)}  # right-handed (a, b, polar) coordinate order


def cape_4dof_pose(
    centers: torch.Tensor, radius_range: tuple[float, float] = DEFAULT_RADIUS_RANGE, polar_axis: str = "z"
) -> torch.Tensor:
    """(..., 4) CaPE 4DoF poses of camera centres ``centers`` (..., 3) in world coordinates: (polar angle from
    ``polar_axis``, azimuth around it in (-pi, pi], log radius scaled to [0, pi] over ``radius_range``, 0).

    Example:
        >>> pose = cape_4dof_pose(torch.tensor([[0.0, 2.2, 0.0]]))
        >>> torch.allclose(pose, torch.tensor([[math.pi / 2, math.pi / 2, math.pi, 0.0]]))
        True
    """
    if not isinstance(centers, torch.Tensor) or not centers.is_floating_point() or centers.shape[-1:] != (3,):
        raise ValueError(f"centers must be a floating-point (..., 3) tensor, got {describe(centers)}")
    check_choice(polar_axis, "polar_axis", tuple(_AXES))
    low, high = _check_radius_range(radius_range)
    a, b, c = (centers[..., i] for i in _AXES[polar_axis])
    planar = torch.sqrt(a * a + b * b)
    polar = torch.atan2(planar, c)
    azimuth = torch.atan2(b, a)
    radius = torch.sqrt(planar * planar + c * c).clamp(low, high)
    scaled = (radius.log() - math.log(low)) / (math.log(high) - math.log(low)) * math.pi
    return torch.stack((polar, azimuth, scaled, torch.zeros_like(scaled)), -1)


def _check_radius_range(value) -> tuple[float, float]:
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != 2:
        raise TypeError(f"radius_range must be a (min, max) pair of positive numbers, got {describe(value)}")
    low = check_float(value[0], "radius_range[0]", min=0, min_open=True)
    high = check_float(value[1], "radius_range[1]", min=0, min_open=True)
    if not low < high:
        raise ValueError(f"radius_range must be (min, max) with min < max, got {tuple(value)}")
    return low, high


class CaPETransform(QKVCameraTransform):
    """CaPE's map of q and k (v and the output unchanged): per-view 4x4 matrices (6DoF) or per-view angles (4DoF)."""

    def __init__(self, state: CaPEState) -> None:
        self.state = state

    def transform_qkv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.state
        check_qkv_shape({"q": q, "k": k, "v": v}, s.batch_size, s.num_heads, s.num_tokens, s.head_dim, "cape")
        if s.mode == "6dof":
            q = view_blocks_matmul(q, s.q_mats.to(q.dtype), s.num_views)
            k = view_blocks_matmul(k, s.k_mats.to(k.dtype), s.num_views)
            return q, k, v
        return self._rotate(q), self._rotate(k), v

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        s = self.state
        batch, heads, tokens, channels = x.shape
        pairs = x.reshape(batch, heads, s.num_views, s.num_patches, channels // 2, 2)
        cos, sin = s.cos.to(x.dtype), s.sin.to(x.dtype)  # (B, 1, V, 1, head_dim // 2)
        x0, x1 = pairs.unbind(-1)
        return torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), -1).reshape(batch, heads, tokens, channels)


class CaPEState(CameraState):
    """What :meth:`CaPE.prepare` builds once per forward (every block uses the same maps)."""

    def __init__(self, scheme: CaPE, cameras: Cameras, num_patches: int, **tables: torch.Tensor) -> None:
        self.depth, self.mode = scheme.depth, scheme.mode
        self.num_heads, self.head_dim = scheme.num_heads, scheme.head_dim
        self.batch_size, self.num_views, self.num_patches = cameras.batch_size, cameras.num_views, num_patches
        self.num_tokens = self.num_views * num_patches
        # 6dof: q_mats = P^-1 and k_mats = P^T, (B, V, 4, 4) column-vector forms of the row-vector maps P^-T and P;
        # 4dof: cos, sin (B, 1, V, 1, head_dim // 2) of each channel pair's angle
        self.q_mats = tables.get("q_mats")
        self.k_mats = tables.get("k_mats")
        self.cos = tables.get("cos")
        self.sin = tables.get("sin")
        self._transform = CaPETransform(self)

    def layer(self, index: int, tokens: torch.Tensor | None = None) -> CaPETransform:
        check_layer(index, self.depth, "cape")
        return self._transform


@register_scheme("cape")
class CaPE(RelativeCameraEncoding):
    """EscherNet's camera positional encoding (Kong et al., CVPR 2024) on q and k (see :mod:`visionpe.camera.cape`).

    Args:
        dim, num_heads, depth: model shape; every block uses the same maps (CaPE has no parameters).
        mode: ``"6dof"`` (default; head_dim a multiple of 4): q and k of view v multiplied in 4-blocks by P_v^-T and
            P_v, P_v its world-to-camera matrix; exactly invariant to rigid motions of the world. ``"4dof"``
            (head_dim a multiple of 8): q and k rotated by the polar angle, azimuth and log radius of the camera
            centre; invariant to turning the world around the polar axis.
        translation_scale: 6DoF only: the factor on the translation of P (1, the reference's, by default). A
            smaller one (e.g. 1 / scene radius) keeps the logits of large scenes in range.
        radius_range: 4DoF only: the (min, max) camera distance mapped to log-radius angles 0 .. pi; distances are
            clamped to it. Default (1.5, 2.2), the reference's Objaverse range.
        polar_axis: 4DoF only: the world axis ``"x"``, ``"y"`` or ``"z"`` (default, the reference's) the polar angle
            is measured from and the azimuth turns around.

    Example:
        >>> import visionpe
        >>> cape = visionpe.create_pos_embed("cape", dim=64, num_heads=2)
        >>> cape.mode
        '6dof'
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        mode: str = "6dof",
        translation_scale: float | None = None,
        radius_range: tuple[float, float] | None = None,
        polar_axis: str | None = None,
    ) -> None:
        super().__init__()
        head_dim = check_model_shape(dim, num_heads, depth)
        mode = check_choice(mode, "mode", ("6dof", "4dof"))
        multiple = 4 if mode == "6dof" else 8
        if head_dim % multiple:
            raise ValueError(
                f"cape with mode={mode!r} needs head_dim = dim // num_heads to be a multiple of {multiple} "
                f"({'4-blocks' if mode == '6dof' else 'channel pairs in each quarter'}), got dim={dim}, "
                f"num_heads={num_heads}, head_dim={head_dim}"
            )
        wrong = [
            name
            for name, value, own in (
                ("translation_scale", translation_scale, "6dof"),
                ("radius_range", radius_range, "4dof"),
                ("polar_axis", polar_axis, "4dof"),
            )
            if value is not None and mode != own
        ]
        if wrong:
            raise ValueError(f"{wrong} apply to the other mode and must be None with mode={mode!r}")
        self.dim, self.num_heads, self.depth, self.head_dim, self.mode = dim, num_heads, depth, head_dim, mode
        self.translation_scale = (
            1.0
            if translation_scale is None
            else check_float(translation_scale, "translation_scale", min=0, min_open=True)
        )
        self.radius_range = _check_radius_range(DEFAULT_RADIUS_RANGE if radius_range is None else radius_range)
        self.polar_axis = check_choice("z" if polar_axis is None else polar_axis, "polar_axis", tuple(_AXES))

    def extra_repr(self) -> str:
        if self.mode == "6dof":
            return f"mode='6dof', head_dim={self.head_dim}, translation_scale={self.translation_scale}"
        return (
            f"mode='4dof', head_dim={self.head_dim}, radius_range={self.radius_range}, polar_axis={self.polar_axis!r}"
        )

    def prepare(self, cameras: Cameras, grid_size: tuple[int, int]) -> CaPEState:
        grid_size = self.check_cameras(cameras, grid_size)
        num_patches = grid_size[0] * grid_size[1]
        w2c = cameras.w2c
        dtype = torch.promote_types(w2c.dtype, torch.float32)
        with torch.autocast(w2c.device.type, enabled=False):
            w2c = w2c.to(dtype)
            if self.mode == "6dof":
                pose = w2c.clone()
                pose[..., :3, 3] = pose[..., :3, 3] * self.translation_scale
                return CaPEState(self, cameras, num_patches, q_mats=invert_rigid(pose), k_mats=pose.transpose(-1, -2))
            centers = invert_rigid(w2c)[..., :3, 3]
            pose = cape_4dof_pose(centers, self.radius_range, self.polar_axis)  # (B, V, 4)
            angles = pose.repeat_interleave(self.head_dim // 8, dim=-1)  # one angle per pair, a quarter each
            angles = angles[:, None, :, None]  # (B, 1, V, 1, head_dim // 2)
            return CaPEState(self, cameras, num_patches, cos=angles.cos(), sin=angles.sin())
