"""GTA: Miyato, Jaeger, Welling, Geiger, "GTA: A Geometry-Aware Attention Mechanism for Multi-View Transformers",
ICLR 2024 (arXiv 2310.10375; code autonomousvision/gta).

Each token carries a group element: its view's camera as an element of SE(3) and its patch position as rotations
of SO(2). Attention compares and averages the tokens after mapping them all into one common frame, so that the
query of token i only ever sees the keys and values of token j through the relative transform ``g_i^-1 g_j``.

Per head, the channels are split into three consecutive parts (the order of the reference code):

- ``triv``: the remaining channels, left unchanged;
- ``se3``: 4-vectors. View v's element is ``g_v = E_v^-1`` (E_v its world-to-camera matrix) with the translation
  multiplied by a learned per-block scalar ``trans_coeff`` (0.01 at init; with it, ``g_v = [[R^T, -c R^T t],
  [0, 1]]`` for ``E_v = [[R, t], [0, 1]]``, the camera of a world scaled by c). Attention takes
  ``q' = g_q^-T q``, ``k' = g_k k``, ``v' = g_k v`` and maps its output back by ``g_q^-1``; hence
  ``q'.k' = q^T g_q^-1 g_k k`` and ``out_i = g_i^-1 sum_j a_ij g_j v_j``;
- ``so2``: pairs of channels. With M = so2_channels / 4 frequencies ``f_m = 2^m / 2^M`` (m = 1 .. M, the
  highest 1) and each image axis a (rows, then columns), the pair (m, a) of a token at normalised patch position
  u (in [0, 1)^2) turns by ``2 pi max_freq_a f_m u_a``; q, k and v turn by their token's angle, the output back
  by the query's. The logits then depend on ``u_k - u_q`` only.

Moving the world by any rigid motion T changes every ``E_v`` into ``E_v T^-1``, hence every ``g_v`` into
``T g_v`` (with T's translation scaled by c), which cancels in ``g_i^-1 g_j``: GTA is exactly SE(3)-invariant.
The reference's SO(3) (Wigner-D) and T(2) parts, its squared-distance (``euclid``) variant and its per-pixel ray
rotations are not implemented here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ..base import check_layer, check_model_shape
from ..checks import check_bool, check_float, check_int, describe, is_number
from ..grid import grid_coords
from ..registry import register_scheme
from .base import CameraState, QKVCameraTransform, RelativeCameraEncoding, view_blocks_matmul
from .cameras import Cameras

__all__ = ["GTA", "GTAState", "GTATransform", "so2_frequencies"]


def so2_frequencies(num_freqs: int) -> torch.Tensor:
    """The reference's SO(2) frequencies ``2^m / 2^M`` for m = 1 .. M = ``num_freqs`` (fp32, the highest 1).

    Example:
        >>> so2_frequencies(3)
        tensor([0.2500, 0.5000, 1.0000])
    """
    check_int(num_freqs, "num_freqs", min=1)
    return 2.0 ** torch.arange(1.0, num_freqs + 1.0) / 2.0**num_freqs


def check_qkv_shape(tensors: dict[str, torch.Tensor], batch: int, heads: int, tokens: int, head_dim: int, name: str):
    """ValueError/TypeError unless every tensor is a floating-point (batch, heads, tokens, head_dim) tensor."""
    expected = (batch, heads, tokens, head_dim)
    for arg, x in tensors.items():
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{arg} must be a floating-point (B, heads, V * N, head_dim) tensor, got {describe(x)}")
        if tuple(x.shape) != expected:
            raise ValueError(
                f"{arg} must have shape (B, heads, V * N, head_dim) = {expected} for {name}'s cameras and grid, got "
                f"{tuple(x.shape)}"
            )


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_views: int) -> torch.Tensor:
    """Turn every channel pair (x0, x1) of x (B, heads, V * N, 2P) by the token's angle: (x0 cos - x1 sin,
    x0 sin + x1 cos), with ``cos``/``sin`` (N, P) shared by all views."""
    batch, heads, tokens, channels = x.shape
    pairs = x.reshape(batch, heads, num_views, tokens // num_views, channels // 2, 2)
    x0, x1 = pairs.unbind(-1)
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1)
    return out.reshape(batch, heads, tokens, channels)


class GTATransform(QKVCameraTransform):
    """One block's GTA maps: the per-view 4x4 matrices of the SE(3) part and the per-patch angles of the SO(2) part
    (see :mod:`visionpe.camera.gta`)."""

    def __init__(self, state: GTAState, se3: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
        self.state = state
        # column-vector matrices (B, V, 4, 4) for q (g^-T), k and v (g), and the output (g^-1)
        self.se3 = se3

    def _parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        triv, se3 = self.state.triv_channels, self.state.se3_channels
        return x[..., :triv], x[..., triv : triv + se3], x[..., triv + se3 :]

    def _map(self, x: torch.Tensor, se3_mat: torch.Tensor | None, inverse: bool) -> torch.Tensor:
        triv, se3, so2 = self._parts(x)
        views = self.state.num_views
        if se3_mat is not None:
            se3 = view_blocks_matmul(se3, se3_mat.to(x.dtype), views)
        if so2.shape[-1]:
            sin = self.state.sin.to(x.dtype)
            so2 = _rotate_pairs(so2, self.state.cos.to(x.dtype), -sin if inverse else sin, views)
        return torch.cat((triv, se3, so2), -1)

    def transform_qkv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.state
        check_qkv_shape({"q": q, "k": k, "v": v}, s.batch_size, s.num_heads, s.num_tokens, s.head_dim, "gta")
        q_mat, kv_mat, _ = self.se3 if self.se3 is not None else (None, None, None)
        q = self._map(q, q_mat, inverse=False)
        k = self._map(k, kv_mat, inverse=False)
        if s.transform_values:
            v = self._map(v, kv_mat, inverse=False)
        return q, k, v

    def untransform_output(self, o: torch.Tensor) -> torch.Tensor:
        s = self.state
        if not s.transform_values:
            return o
        check_qkv_shape({"o": o}, s.batch_size, s.num_heads, s.num_tokens, s.head_dim, "gta")
        return self._map(o, self.se3[2] if self.se3 is not None else None, inverse=True)


class GTAState(CameraState):
    """What :meth:`GTA.prepare` builds once per forward: each view's rotation and translation (fp32 or wider) and the
    SO(2) cos/sin of every patch; :meth:`layer` assembles a block's matrices with its ``trans_coeff``."""

    def __init__(
        self,
        scheme: GTA,
        rotation: torch.Tensor | None,
        translation: torch.Tensor | None,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        batch_size: int,
        num_views: int,
        num_patches: int,
    ) -> None:
        self.scheme = scheme
        self.rotation, self.translation = rotation, translation  # (B, V, 3, 3), (B, V, 3) of w2c
        self.cos, self.sin = cos, sin  # (N, so2_channels // 2)
        self.batch_size, self.num_views, self.num_patches = batch_size, num_views, num_patches
        self.num_tokens = num_views * num_patches
        self.num_heads, self.head_dim = scheme.num_heads, scheme.head_dim
        self.triv_channels, self.se3_channels = scheme.triv_channels, scheme.se3_channels
        self.transform_values = scheme.transform_values

    def layer(self, index: int, tokens: torch.Tensor | None = None) -> GTATransform:
        check_layer(index, self.scheme.depth, "gta")
        if self.rotation is None:
            return GTATransform(self, None)
        rot = self.rotation
        with torch.autocast(rot.device.type, enabled=False):
            # E with the translation scaled (the camera of a world scaled by c) and its exact inverse g
            trans = self.translation * self.scheme.trans_coeff[index].to(rot.dtype)
            e = _rigid(rot, trans)
            g = _rigid(rot.transpose(-1, -2), -(rot.transpose(-1, -2) @ trans[..., None]).squeeze(-1))
        return GTATransform(self, (e.transpose(-1, -2), g, e))


def _rigid(rot: torch.Tensor, trans: torch.Tensor) -> torch.Tensor:
    """(..., 4, 4) ``[[rot, trans], [0, 0, 0, 1]]``, differentiable in both."""
    top = torch.cat((rot, trans[..., None]), -1)
    bottom = torch.zeros_like(top[..., :1, :])
    bottom[..., 0, 3] = 1
    return torch.cat((top, bottom), -2)


@register_scheme("gta")
class GTA(RelativeCameraEncoding):
    """GTA (Miyato et al., ICLR 2024): q, k, v and the output mapped by each token's camera (SE(3)) and patch
    position (SO(2)) so that attention sees only relative transforms (see :mod:`visionpe.camera.gta`).

    Args:
        dim, num_heads, depth: model shape; ``head_dim = dim // num_heads`` channels per head.
        se3_channels: channels per head acted on by the camera's 4x4 matrix (a multiple of 4). Default: half of
            head_dim rounded down to a multiple of 4 (32 of 64 in the reference's CLEVR-TR model).
        so2_channels: channels per head turned by the patch position (a multiple of 4: one pair per frequency and
            image axis, so so2_channels / 4 frequencies). Default: as ``se3_channels``. The head_dim - se3 - so2
            remaining channels come first and are left unchanged.
        max_freq: the highest SO(2) frequency in turns per image height/width, one number or (rows, columns);
            1 in the reference.
        trans_coeff: initial value of the learned per-block scale of the camera translation (0.01 in the
            reference); it must be positive.
        transform_values: map v by the keys' transforms and the output back by the query's (the reference's
            ``v_transform``, default True); False changes q and k only.

    Raises ValueError when the channel counts are not multiples of 4 or do not fit ``head_dim``, or when both are 0.

    Example:
        >>> import torch, visionpe
        >>> from visionpe.camera import Cameras, look_at
        >>> gta = visionpe.create_pos_embed("gta", dim=64, num_heads=2, depth=2)
        >>> (gta.triv_channels, gta.se3_channels, gta.so2_channels)
        (0, 16, 16)
        >>> eyes = torch.tensor([[[0.0, 0, -3], [3.0, 0, 0]]])
        >>> K = torch.tensor([[32.0, 0, 16], [0, 32.0, 16], [0, 0, 1]]).expand(1, 2, 3, 3)
        >>> state = gta.prepare(Cameras(look_at(eyes, torch.zeros(1, 2, 3)), K, (32, 32)), (2, 3))
        >>> q = k = v = torch.randn(1, 2, 2 * 6, 32)
        >>> [t.shape for t in state.layer(1).transform_qkv(q, k, v)] == [q.shape] * 3
        True
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        se3_channels: int | None = None,
        so2_channels: int | None = None,
        max_freq: float | Sequence[float] = 1.0,
        trans_coeff: float = 0.01,
        transform_values: bool = True,
    ) -> None:
        super().__init__()
        head_dim = check_model_shape(dim, num_heads, depth)
        default = head_dim // 2 // 4 * 4
        se3 = default if se3_channels is None else check_int(se3_channels, "se3_channels", min=0)
        so2 = default if so2_channels is None else check_int(so2_channels, "so2_channels", min=0)
        for name, value in (("se3_channels", se3), ("so2_channels", so2)):
            if value % 4:
                raise ValueError(f"{name} must be a multiple of 4, got {value}")
        if se3 + so2 > head_dim:
            raise ValueError(
                f"se3_channels + so2_channels must fit head_dim = dim // num_heads = {head_dim}, got {se3} + {so2} = "
                f"{se3 + so2}"
            )
        if se3 + so2 == 0:
            raise ValueError(
                f"gta needs se3_channels or so2_channels > 0 (head_dim = {head_dim}: the default split needs at "
                f"least 8), got se3_channels={se3}, so2_channels={so2}"
            )
        if is_number(max_freq):
            freqs = (check_float(max_freq, "max_freq", min=0, min_open=True),) * 2
        elif isinstance(max_freq, Sequence) and not isinstance(max_freq, str) and len(max_freq) == 2:
            freqs = tuple(check_float(f, f"max_freq[{i}]", min=0, min_open=True) for i, f in enumerate(max_freq))
        else:
            raise TypeError(
                f"max_freq must be a positive number or a (rows, columns) pair of them, got {describe(max_freq)}"
            )
        trans_coeff = check_float(trans_coeff, "trans_coeff", min=0, min_open=True)
        self.dim, self.num_heads, self.depth, self.head_dim = dim, num_heads, depth, head_dim
        self.se3_channels, self.so2_channels = se3, so2
        self.triv_channels = head_dim - se3 - so2
        self.num_so2_freqs = so2 // 4
        self.max_freq = freqs
        self.transform_values = check_bool(transform_values, "transform_values")
        # one learned scale per block, as the reference's per-attention-layer parameter (none without an SE(3) part)
        self.trans_coeff = nn.Parameter(torch.full((depth,), trans_coeff)) if se3 else None

    def no_weight_decay(self) -> set[str]:
        """``trans_coeff``: a scale of the geometry, which weight decay would pull towards ignoring translation."""
        return {"trans_coeff"} if self.trans_coeff is not None else set()

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, triv={self.triv_channels}, se3={self.se3_channels}, so2={self.so2_channels}, "
            f"max_freq={self.max_freq}, transform_values={self.transform_values}"
        )

    def so2_angles(
        self, grid_size: tuple[int, int], device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """(N, so2_channels // 2) angles of the SO(2) pairs of each patch of ``grid_size`` (fp32, or ``dtype`` if
        wider): pair ``2 m + a`` (frequency m, axis a: 0 rows, 1 columns) turns by ``2 pi max_freq_a f_m u_a``, u the
        normalised patch centre ((i + 0.5) / h, (j + 0.5) / w)."""
        grid_size = self.check_grid(grid_size)
        if not self.so2_channels:
            raise ValueError("so2_angles needs an SO(2) part; this gta has so2_channels=0")
        dtype = torch.promote_types(dtype, torch.float32)
        # normalised patch centres (rows, columns), as grid_coords(mode="normalized") but in ``dtype`` throughout
        index = grid_coords(grid_size, device=device).to(dtype)
        u = (index + 0.5) / torch.tensor(grid_size, dtype=dtype, device=index.device)  # (N, 2)
        freqs = so2_frequencies(self.num_so2_freqs).to(u)
        scale = torch.tensor(self.max_freq, dtype=dtype, device=u.device)
        angles = 2 * math.pi * freqs[:, None] * scale[None, :] * u[:, None, :]  # (N, M, 2)
        return angles.reshape(u.shape[0], -1)

    def prepare(self, cameras: Cameras, grid_size: tuple[int, int]) -> GTAState:
        grid_size = self.check_cameras(cameras, grid_size)
        w2c = cameras.w2c
        dtype = torch.promote_types(w2c.dtype, torch.float32)
        with torch.autocast(w2c.device.type, enabled=False):
            rotation = translation = cos = sin = None
            if self.se3_channels:
                w2c = w2c.to(dtype)
                rotation, translation = w2c[..., :3, :3], w2c[..., :3, 3]
            if self.so2_channels:
                angles = self.so2_angles(grid_size, w2c.device, dtype)
                cos, sin = angles.cos(), angles.sin()
        return GTAState(
            self, rotation, translation, cos, sin, cameras.batch_size, cameras.num_views, grid_size[0] * grid_size[1]
        )
