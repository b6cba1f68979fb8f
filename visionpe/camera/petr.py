"""Absolute 3D position embeddings of multi-view detectors: PETR and 3DPPE.

Both embed where each patch lies in the 3D world frame of :class:`~visionpe.camera.Cameras` and add that embedding
to the patch tokens; the world frame plays the role the lidar/ego frame plays in the papers, so their ``lidar2img``
is ``K @ w2c[:3]`` here and their ``inv(lidar2img) (u d, v d, d, 1)`` is :meth:`Cameras.unproject` at camera depth d.

- **PETR**: Liu, Wang, Zhang, Sun, "PETR: Position Embedding Transformation for Multi-View 3D Object Detection",
  ECCV 2022, arXiv 2203.05625. Each patch centre is lifted to D points along its ray, one per depth bin (uniform,
  or linear-increasing: d_k = d_0 + b k (k + 1) with b = (d_max - d_0) / (D (D + 1))). The points are mapped into
  a scene box (``position_range``) as values in [0, 1], passed through the logit (inverse sigmoid), and the 3 D
  values of a patch go through Linear(3 D -> 4 C), ReLU, Linear(4 C -> C).
- **3DPPE**: Shu et al., "3DPPE: 3D Point Positional Encoding for Transformer-based Multi-Camera 3D Object
  Detection", ICCV 2023, arXiv 2211.14710. Each patch centre is lifted to one point at its depth (predicted from
  the token, or given), mapped into the box and through the logit as in PETR, then encoded by a 3D sin-cos
  embedding (:func:`pos2posemb3d`, axes in the order y, x, z) and Linear(3 F -> C), ReLU, Linear(C -> C).

Neither is invariant to a rigid motion of the world: the embedding of a patch depends on where the world frame
is, so moving every camera by the same T changes it. What holds instead is equivariance of the points: under
``cameras.transform(T)`` every lifted point X becomes T X (:meth:`PETR.points`, :meth:`ThreeDPPE.points`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ..checks import check_bool, check_choice, check_float, check_int, check_positive, describe, is_number
from ..registry import register_scheme
from .base import AbsoluteCameraEncoding
from .cameras import Cameras

__all__ = [
    "PETR",
    "ThreeDPPE",
    "NUSCENES_POSITION_RANGE",
    "check_position_range",
    "depth_bins",
    "inverse_sigmoid",
    "lift_patches",
    "normalize_points",
    "pos2posemb3d",
]

#: the scene box (x_min, y_min, z_min, x_max, y_max, z_max) in metres of the released nuScenes configurations
NUSCENES_POSITION_RANGE = (-61.2, -61.2, -10.0, 61.2, 61.2, 10.0)

#: the floor of the logit's arguments and of a depth (the released code's ``eps``)
EPS = 1e-5


def check_position_range(value: Sequence[float], name: str = "position_range") -> tuple[float, ...]:
    """``value`` as a tuple (x_min, y_min, z_min, x_max, y_max, z_max) of six finite numbers with min < max on every
    axis; TypeError or ValueError naming ``name`` otherwise.

    Example:
        >>> check_position_range([-2, -2, -1, 2, 2, 1])
        (-2.0, -2.0, -1.0, 2.0, 2.0, 1.0)
    """
    expected = "a sequence of six numbers (x_min, y_min, z_min, x_max, y_max, z_max)"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not all(is_number(v) for v in value):
        raise TypeError(f"{name} must be {expected}, got {describe(value)}")
    if len(value) != 6 or not all(math.isfinite(v) for v in value):
        raise ValueError(f"{name} must be {expected}, all finite, got {list(value)}")
    box = tuple(float(v) for v in value)
    if not all(box[a] < box[a + 3] for a in range(3)):
        raise ValueError(f"{name} must have min < max on every axis (x_min < x_max, ...), got {list(value)}")
    return box


def depth_bins(
    num_bins: int,
    depth_start: float,
    depth_max: float,
    mode: str = "lid",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """(num_bins,) camera depths of PETR's frustum points, k = 0 .. D - 1 with D = ``num_bins``:

    - ``uniform``: d_k = d_0 + k (d_max - d_0) / D (the last bin stops one step short of d_max);
    - ``lid`` (linear-increasing discretisation): d_k = d_0 + b k (k + 1) with b = (d_max - d_0) / (D (D + 1)),
      bins that widen with depth.

    Example:
        >>> depth_bins(3, 1.0, 13.0, "lid").tolist()
        [1.0, 3.0, 7.0]
        >>> depth_bins(3, 1.0, 13.0, "uniform").tolist()
        [1.0, 5.0, 9.0]
    """
    check_int(num_bins, "num_bins", min=1)
    check_positive(depth_start, "depth_start")
    check_float(
        depth_max, "depth_max", min=depth_start, min_open=True, expected=f"a number > depth_start={depth_start}"
    )
    check_choice(mode, "bins", ("uniform", "lid"))
    k = torch.arange(num_bins, dtype=torch.float64)
    if mode == "lid":
        bins = depth_start + (depth_max - depth_start) / (num_bins * (num_bins + 1)) * k * (k + 1)
    else:
        bins = depth_start + (depth_max - depth_start) / num_bins * k
    return bins.to(dtype=dtype, device=device)


def inverse_sigmoid(x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """The logit log(x / (1 - x)) of ``x`` clamped to [0, 1], each of x and 1 - x floored at ``eps``, so values
    outside the box saturate at about +-11.5 instead of becoming NaN."""
    x = x.clamp(0, 1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


def normalize_points(points: torch.Tensor, position_range: Sequence[float]) -> torch.Tensor:
    """World points (..., 3) as fractions of the box ``position_range`` (x_min, y_min, z_min, x_max, y_max, z_max):
    (p - min) / (max - min) per axis, 0 and 1 on the box's faces."""
    box = torch.tensor(position_range, dtype=points.dtype, device=points.device)
    return (points - box[:3]) / (box[3:] - box[:3])


def pos2posemb3d(
    points: torch.Tensor, num_pos_feats: int = 128, temperature: float = 10000.0, scale: float = 2 * math.pi
) -> torch.Tensor:
    """3D sin-cos embedding (..., 3) -> (..., 3 F), F = ``num_pos_feats`` (even), as in PETR's and 3DPPE's code.

    Per axis a with value p (times ``scale``), feature j < F is sin(p / T^(2 floor(j / 2) / F)) for even j and the
    cosine of the same angle for odd j (sin and cos interleaved, pairs sharing a frequency), T = ``temperature``.
    The three blocks are concatenated in the order y, x, z (columns 1, 0, 2 of ``points``).

    Example:
        >>> point = torch.tensor([0.0, 0.125, 0.0], dtype=torch.float64)  # (x, y, z)
        >>> pos2posemb3d(point, num_pos_feats=2).round(decimals=4).tolist()
        [0.7071, 0.7071, 0.0, 1.0, 0.0, 1.0]
    """
    check_int(num_pos_feats, "num_pos_feats", min=2)
    if num_pos_feats % 2:
        raise ValueError(f"num_pos_feats must be even (sin and cos pairs), got {num_pos_feats}")
    check_positive(temperature, "temperature")
    j = torch.arange(num_pos_feats, dtype=points.dtype, device=points.device)
    freqs = temperature ** (-2 * torch.div(j, 2, rounding_mode="floor") / num_pos_feats)
    angles = points[..., None] * scale * freqs  # (..., 3, F)
    emb = torch.stack((angles[..., 0::2].sin(), angles[..., 1::2].cos()), dim=-1).flatten(-2)
    return torch.cat((emb[..., 1, :], emb[..., 0, :], emb[..., 2, :]), dim=-1)


def _geometry_cameras(cameras: Cameras, device: torch.device | None = None) -> Cameras:
    """``cameras`` on ``device`` (None: theirs) in fp32 unless they are fp32 or fp64 already (the lifting never runs
    in half precision); the same object when nothing changes, so the checks of a new :class:`Cameras` are skipped."""
    device = cameras.device if device is None else device
    dtype = cameras.w2c.dtype if cameras.w2c.dtype in (torch.float32, torch.float64) else torch.float32
    if cameras.device == device and cameras.w2c.dtype == dtype and cameras.intrinsics.dtype == dtype:
        return cameras
    return cameras.to(device=device, dtype=dtype)


def lift_patches(cameras: Cameras, grid_size: tuple[int, int], depth: torch.Tensor) -> torch.Tensor:
    """World points on the rays through the patch centres of an (h, w) grid (:meth:`Cameras.patch_pixels`).

    ``depth`` holds camera depths (z in the camera frame): (D,) bins shared by every patch gives (B, V, N, D, 3),
    one point per bin; (B, V, N) one depth per patch gives (B, V, N, 3). The points are
    ``inv(K @ w2c[:3]) (u d, v d, d, 1)``, computed by :meth:`Cameras.unproject`.
    """
    pixels = cameras.patch_pixels(grid_size)  # (N, 2)
    depth = depth.to(cameras.w2c.dtype)
    if depth.ndim == 1:
        num = pixels.shape[0]
        bins = depth.shape[0]
        flat = depth.repeat(num).expand(cameras.batch_size, cameras.num_views, -1)
        points = cameras.unproject(pixels.repeat_interleave(bins, dim=0), flat)
        return points.unflatten(2, (num, bins))
    return cameras.unproject(pixels, depth)


class _BoxEmbedding(AbsoluteCameraEncoding):
    """Shared options of PETR and 3DPPE: the scene box, the depth range and what happens outside the box."""

    def _init_box(
        self,
        dim: int,
        depth_start: float,
        depth_max: float | None,
        position_range: Sequence[float],
        mask_outside: bool,
    ) -> None:
        check_int(dim, "dim", min=1)
        self.dim = dim
        self.position_range = check_position_range(position_range)
        self.depth_start = check_positive(depth_start, "depth_start")
        if depth_max is None:
            depth_max = self.position_range[3]
        self.depth_max = check_float(
            depth_max,
            "depth_max",
            min=self.depth_start,
            min_open=True,
            expected=f"a number > depth_start={self.depth_start} (None: x_max of position_range)",
        )
        self.mask_outside = check_bool(mask_outside, "mask_outside")

    def _finish(self, x: torch.Tensor, pe: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
        """x + pe (B, V, N, C), with the embedding of patches ``outside`` the box zeroed when ``mask_outside``."""
        if self.mask_outside:
            pe = pe.masked_fill(outside[..., None], 0)
        return x + pe.flatten(1, 2).to(x.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, position_range={self.position_range}, depth=[{self.depth_start}, {self.depth_max}]"


@register_scheme("petr")
class PETR(_BoxEmbedding):
    """PETR's 3D position embedding (Liu, Wang, Zhang, Sun, ECCV 2022, arXiv 2203.05625), added to the tokens.

    Each patch centre (u, v) of view v is lifted to D world points X_k = inv(K_v [R_v | t_v]) (u d_k, v d_k, d_k, 1)
    at the depth bins d_k (:func:`depth_bins`); each point becomes s = logit((X - box_min) / (box_max - box_min)),
    and the 3 D values of the patch (bin-major, x y z within a bin, as the released 1x1 convolution reads them)
    go through Linear(3 D -> r C), ReLU, Linear(r C -> C). The result is added to the patch's token.

    Args:
        dim: token width C.
        num_heads, depth: the model's shape (unused; every scheme takes them).
        num_bins: D, depth bins per patch (64 in the paper).
        bins: ``"lid"`` (linear-increasing, the released configurations) or ``"uniform"``.
        depth_start: d_0, the first bin's depth (1 in the paper), in world units.
        depth_max: the depth the bins run towards; None (default) takes x_max of ``position_range`` (61.2 for the
            nuScenes box), as the released code does.
        position_range: the scene box (x_min, y_min, z_min, x_max, y_max, z_max) in world units. The default is the
            released nuScenes box in metres; set it to the extent of your scenes, since points outside it all
            saturate to the same logit.
        mlp_ratio: r, the hidden width of the MLP in multiples of C (4 in the paper).
        mask_outside: the released code computes a mask of patches whose frustum leaves the box (more than D / 2
            of the 3 D normalised values outside [0, 1]) and then discards it, so every patch gets its embedding;
            that is the default (False). True zeroes the embedding of those patches instead (the library's option).

    The released code takes the pixel of each stride cell's top-left corner (i * pad / n); the library lifts the
    patch centre, the pixel convention of every camera scheme here (:meth:`Cameras.patch_pixels`). In the
    released detector the embedding is the key position of the decoder's cross-attention; in a ViT it is added
    to the patch tokens once, before the blocks.

    Example:
        >>> import torch, visionpe
        >>> from visionpe.camera import Cameras, look_at
        >>> cams = Cameras(look_at(torch.tensor([[[0.0, 0, -3], [3, 0, 0]]]), torch.zeros(1, 2, 3)),
        ...                torch.tensor([[32.0, 0, 16], [0, 32, 16], [0, 0, 1]]).expand(1, 2, 3, 3), (32, 48))
        >>> pe = visionpe.create_pos_embed("petr", dim=32, num_heads=2, num_bins=8,
        ...                                position_range=(-4, -4, -4, 4, 4, 4))
        >>> pe(torch.zeros(1, 2 * 2 * 3, 32), cams, (2, 3)).shape
        torch.Size([1, 12, 32])
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 1,
        depth: int = 1,
        num_bins: int = 64,
        bins: str = "lid",
        depth_start: float = 1.0,
        depth_max: float | None = None,
        position_range: Sequence[float] = NUSCENES_POSITION_RANGE,
        mlp_ratio: float = 4.0,
        mask_outside: bool = False,
    ) -> None:
        super().__init__()
        self._init_box(dim, depth_start, depth_max, position_range, mask_outside)
        self.num_bins = check_int(num_bins, "num_bins", min=1)
        self.bins = check_choice(bins, "bins", ("uniform", "lid"))
        check_positive(mlp_ratio, "mlp_ratio")
        hidden = max(1, round(dim * mlp_ratio))
        self.mlp = nn.Sequential(nn.Linear(3 * num_bins, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def points(self, cameras: Cameras, grid_size: tuple[int, int]) -> torch.Tensor:
        """(B, V, N, D, 3) world points of every patch's depth bins (fp32, or fp64 for fp64 cameras)."""
        grid_size = self.check_cameras(cameras, grid_size)
        cameras = _geometry_cameras(cameras)
        with torch.autocast(cameras.device.type, enabled=False):
            bins = depth_bins(
                self.num_bins, self.depth_start, self.depth_max, self.bins, cameras.w2c.dtype, cameras.device
            )
            return lift_patches(cameras, grid_size, bins)

    def outside_mask(self, cameras: Cameras, grid_size: tuple[int, int]) -> torch.Tensor:
        """(B, V, N) bool: the patches whose frustum leaves the box, more than D / 2 of their 3 D normalised
        coordinates outside [0, 1] (the released code's mask)."""
        normalized = normalize_points(self.points(cameras, grid_size), self.position_range)
        return self._outside(normalized)

    def _outside(self, normalized: torch.Tensor) -> torch.Tensor:
        return ((normalized < 0) | (normalized > 1)).flatten(-2).sum(-1) > self.num_bins * 0.5

    def embedding(self, cameras: Cameras, grid_size: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The (B, V, N, C) embedding of every patch and the (B, V, N) :meth:`outside_mask`."""
        normalized = normalize_points(self.points(cameras, grid_size), self.position_range)
        with torch.autocast(normalized.device.type, enabled=False):
            features = inverse_sigmoid(normalized).flatten(-2)  # (B, V, N, D * 3), bin-major
        weight = self.mlp[0].weight
        if not torch.is_autocast_enabled(weight.device.type):
            features = features.to(weight.dtype)
        return self.mlp(features), self._outside(normalized)

    def forward(self, x: torch.Tensor, cameras: Cameras, grid_size: tuple[int, int]) -> torch.Tensor:
        """``x`` (B, V * N, C), tokens ordered (view, row, column) -> ``x`` plus each patch's PETR embedding."""
        grid_size = self.check_tokens(x, cameras, grid_size, self.dim)
        pe, outside = self.embedding(_geometry_cameras(cameras, x.device), grid_size)
        return self._finish(x, pe, outside)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_bins={self.num_bins}, bins={self.bins!r}, mask_outside={self.mask_outside}"


@register_scheme("3dppe")
class ThreeDPPE(_BoxEmbedding):
    """3DPPE's 3D point position embedding (Shu et al., ICCV 2023, arXiv 2211.14710), added to the tokens.

    Each patch centre (u, v) of view v is lifted to one world point X = inv(K_v [R_v | t_v]) (u d, v d, d, 1) at
    its depth d; X becomes s = logit((X - box_min) / (box_max - box_min)) as in PETR, then
    Linear(3 F -> C), ReLU, Linear(C -> C) of the sin-cos embedding :func:`pos2posemb3d` (s) (F per axis,
    y, x, z order). The result is added to the patch's token.

    The depth d is given to :meth:`forward` (``depth=``, e.g. from lidar or a depth network) or predicted from the
    patch's token. The paper predicts it with a separate depth network on the backbone features, trained with
    lidar supervision; the library's reading is a linear head on the token with the paper's readout:

    - ``depth_head="hybrid"`` (the released best configuration): the head gives D logits and one direct value;
      d = sigma(lambda) d_direct + (1 - sigma(lambda)) sum_k softmax(logits)_k c_k, with lambda learned (initialised
      to 1e-4) and c_k D uniform bin centres from ``depth_start`` to ``depth_max`` inclusive;
    - ``depth_head="expectation"``: the softmax expectation alone.

    Depths are floored at 1e-5 before lifting (the released code floors only the pixel scaling, which lifts a
    negative depth behind the camera).

    Args:
        dim: token width C (divisible by 4 with the default ``num_pos_feats``).
        num_heads, depth: the model's shape (unused; every scheme takes them).
        depth_head: ``"hybrid"`` or ``"expectation"``, how a depth is predicted when none is given.
        num_bins: D, the depth classes of the head (16 in the released best configuration, at least 2).
        depth_start, depth_max: the range of the depth classes; ``depth_max`` None (default) takes x_max of
            ``position_range``, as the released code does.
        position_range: the scene box (x_min, y_min, z_min, x_max, y_max, z_max) in world units; the default is
            the released nuScenes box in metres; set it to the extent of your scenes.
        num_pos_feats: F, sin-cos features per axis (even); None (default) takes C / 2, so 3 F = 3 C / 2 as in the
            released code (C = 256, F = 128).
        temperature: the sin-cos base (10000).
        mask_outside: the released code masks a patch whose point leaves the box on any axis and then discards the
            mask; False (default) keeps every embedding, True zeroes those patches' (the library's option).

    Example:
        >>> import torch, visionpe
        >>> from visionpe.camera import Cameras, look_at
        >>> cams = Cameras(look_at(torch.tensor([[[0.0, 0, -3], [3, 0, 0]]]), torch.zeros(1, 2, 3)),
        ...                torch.tensor([[32.0, 0, 16], [0, 32, 16], [0, 0, 1]]).expand(1, 2, 3, 3), (32, 48))
        >>> pe = visionpe.create_pos_embed("3dppe", dim=32, num_heads=2, position_range=(-4, -4, -4, 4, 4, 4))
        >>> x = torch.zeros(1, 2 * 2 * 3, 32)
        >>> pe(x, cams, (2, 3)).shape, pe(x, cams, (2, 3), depth=torch.full((1, 2, 6), 3.0)).shape
        (torch.Size([1, 12, 32]), torch.Size([1, 12, 32]))
    """

    optional_inputs = frozenset({"patch_depth"})  # known depths when given, else predicted

    def __init__(
        self,
        dim: int,
        num_heads: int = 1,
        depth: int = 1,
        depth_head: str = "hybrid",
        num_bins: int = 16,
        depth_start: float = 1.0,
        depth_max: float | None = None,
        position_range: Sequence[float] = NUSCENES_POSITION_RANGE,
        num_pos_feats: int | None = None,
        temperature: float = 10000.0,
        mask_outside: bool = False,
    ) -> None:
        super().__init__()
        self._init_box(dim, depth_start, depth_max, position_range, mask_outside)
        self.depth_head_mode = check_choice(depth_head, "depth_head", ("hybrid", "expectation"))
        self.num_bins = check_int(num_bins, "num_bins", min=2)
        if num_pos_feats is None:
            if dim % 4:
                raise ValueError(
                    f"3dppe needs dim divisible by 4 for num_pos_feats=None (dim / 2 even features per axis), got "
                    f"dim={dim}; pass an even num_pos_feats"
                )
            num_pos_feats = dim // 2
        check_int(num_pos_feats, "num_pos_feats", min=2)
        if num_pos_feats % 2:
            raise ValueError(f"num_pos_feats must be even (sin and cos pairs), got {num_pos_feats}")
        self.num_pos_feats = num_pos_feats
        self.temperature = check_positive(temperature, "temperature")
        hybrid = self.depth_head_mode == "hybrid"
        self.depth_head = nn.Linear(dim, num_bins + int(hybrid))
        self.fuse_lambda = nn.Parameter(torch.tensor(1e-4)) if hybrid else None
        self.mlp = nn.Sequential(nn.Linear(3 * num_pos_feats, dim), nn.ReLU(), nn.Linear(dim, dim))

    def predict_depth(self, x: torch.Tensor, num_views: int) -> torch.Tensor:
        """(B, V, N) depths of the patches predicted from their tokens ``x`` (B, V * N, C), in fp32 (fp64 for fp64
        tokens)."""
        check_int(num_views, "num_views", min=1)
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[-1] != self.dim or x.shape[1] % num_views:
            raise ValueError(f"x must be a (B, V * N, C={self.dim}) tensor with V={num_views}, got {describe(x)}")
        out = self.depth_head(x)
        out = out.to(torch.promote_types(out.dtype, torch.float32)).unflatten(1, (num_views, -1))
        logits = out[..., : self.num_bins]
        with torch.autocast(out.device.type, enabled=False):
            centres = torch.linspace(
                self.depth_start, self.depth_max, self.num_bins, dtype=out.dtype, device=out.device
            )
            expected = logits.softmax(-1) @ centres
            if self.fuse_lambda is None:
                return expected
            alpha = torch.sigmoid(self.fuse_lambda.to(out.dtype))
            return alpha * out[..., self.num_bins] + (1 - alpha) * expected

    def check_depth(self, depth: torch.Tensor, cameras: Cameras, grid_size: tuple[int, int]) -> torch.Tensor:
        """``depth`` (B, V, N) or (B, V, h, w) of positive, finite camera depths as (B, V, N); TypeError or
        ValueError naming ``depth`` otherwise."""
        batch, views, tokens = cameras.batch_size, cameras.num_views, grid_size[0] * grid_size[1]
        expected = f"(B, V, N) = ({batch}, {views}, {tokens}) or (B, V, h, w) = ({batch}, {views}, {grid_size[0]}, "
        expected += f"{grid_size[1]})"
        if not isinstance(depth, torch.Tensor) or not depth.is_floating_point():
            raise TypeError(f"depth must be a floating-point {expected} tensor of camera depths, got {describe(depth)}")
        if depth.shape == (batch, views, *grid_size):
            depth = depth.flatten(2)
        if depth.shape != (batch, views, tokens):
            raise ValueError(f"depth must be {expected} for the cameras and grid, got shape {tuple(depth.shape)}")
        if not torch.compiler.is_compiling() and not bool(((depth > 0) & torch.isfinite(depth)).all()):
            raise ValueError("depth must hold positive, finite camera depths, got a value <= 0, NaN or inf")
        return depth

    def points(self, cameras: Cameras, grid_size: tuple[int, int], depth: torch.Tensor) -> torch.Tensor:
        """(B, V, N, 3) world points of the patch centres at camera depths ``depth`` (B, V, N) or (B, V, h, w)
        (fp32, or fp64 for fp64 cameras)."""
        grid_size = self.check_cameras(cameras, grid_size)
        depth = self.check_depth(depth, cameras, grid_size)
        return self._points(cameras, grid_size, depth)

    def _points(self, cameras: Cameras, grid_size: tuple[int, int], depth: torch.Tensor) -> torch.Tensor:
        cameras = _geometry_cameras(cameras)
        with torch.autocast(cameras.device.type, enabled=False):
            return lift_patches(cameras, grid_size, depth.to(cameras.w2c.dtype).clamp(min=EPS))

    def embedding(
        self, cameras: Cameras, grid_size: tuple[int, int], depth: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (B, V, N, C) embedding of the patches at camera depths ``depth`` (B, V, N) and the (B, V, N) mask of
        points outside the box on any axis."""
        normalized = normalize_points(self._points(cameras, grid_size, depth), self.position_range)
        with torch.autocast(normalized.device.type, enabled=False):
            features = pos2posemb3d(inverse_sigmoid(normalized), self.num_pos_feats, self.temperature)
        weight = self.mlp[0].weight
        if not torch.is_autocast_enabled(weight.device.type):
            features = features.to(weight.dtype)
        return self.mlp(features), ((normalized < 0) | (normalized > 1)).any(-1)

    def forward(
        self, x: torch.Tensor, cameras: Cameras, grid_size: tuple[int, int], depth: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x`` (B, V * N, C), tokens ordered (view, row, column) -> ``x`` plus each patch's 3DPPE embedding.

        ``depth`` (B, V, N) or (B, V, h, w): known camera depths of the patch centres (positive); None (default)
        predicts them from ``x`` (:meth:`predict_depth`)."""
        grid_size = self.check_tokens(x, cameras, grid_size, self.dim)
        cameras = _geometry_cameras(cameras, x.device)
        if depth is None:
            depth = self.predict_depth(x, cameras.num_views)
        else:
            depth = self.check_depth(depth, cameras, grid_size).to(x.device)
        pe, outside = self.embedding(cameras, grid_size, depth)
        return self._finish(x, pe, outside)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, depth_head={self.depth_head_mode!r}, num_bins={self.num_bins}, "
            f"num_pos_feats={self.num_pos_feats}, mask_outside={self.mask_outside}"
        )
