"""RayRoPE: Wu, Jeon, Chang, Tuzel, Tulsiani, "RayRoPE: Projective Ray Positional Encoding for Multi-view
Attention", arXiv 2601.15275, 2026 (code: Lucas-707/RayRoPE).

A patch is a segment of its camera's ray: from the camera centre to a point at depth d, sampled along ``num_rays``
rays through the patch (by default its top-left corner and the corners one patch to the right and one below). Every
position is expressed in the frame of the **query's** camera c, so each query camera sees the keys at its own
coordinates:

- the key camera's centre in c's frame, ``w2c_c @ c2w_k`` applied to the origin: 3 coordinates;
- per ray, the key's point at depth d projected by c: the unit vector of ``K_c X`` (``X`` the point in c's frame,
  ``K_c`` the intrinsics in units of the image with the principal point relative to the centre) gives 2
  coordinates (its x and y), the point's depth |z| in c (at most 10) a third.

With 3 rays that is 3 + 3 * 3 = 12 coordinates. Each coordinate p gets F = head_dim / 24 frequencies
``w_f = (2 pi / T) * freq_base^f`` (f = 0 .. F-1; T = 4 for the centre, 8 for the directions, 80 for the depths),
angle ``w_f p``; pair j = f * 12 + i of the head (channels j and j + head_dim / 2, the half layout) turns with
coordinate i at frequency f (``encoded_dim`` < head_dim: F = encoded_dim / 24 over the first encoded_dim channels, the
rest unchanged). q is turned by minus its own angles (its positions in its own frame), each key and
value by minus the key's angles in the query's frame, and attention's output by plus the query's angles, so that
q'.k' = q^T R(phi_q - phi_k) k depends only on where the key lies relative to the query camera. A rigid motion of
the world changes no position, so attention is exactly SE(3)-invariant.

Depth. By default a linear head per block reads the block's normalised tokens and predicts (log d, sigma) per token
(shared by the heads and rays): the depth lies in [d1, d2] = [exp(log d - sigma), exp(log d + sigma)] (both
exponents clamped at 3, depths to [0.01, 100]). Over that segment each angle runs from theta1 (at d1) to theta2
(at d2); the encoding replaces cos and sin by their means for an angle uniform on [theta1, theta2],
E[cos] = (sin theta2 - sin theta1) / (theta2 - theta1) and E[sin] = (cos theta1 - cos theta2) / (theta2 - theta1),
and keeps the point values cos theta1, sin theta1 when |theta2 - theta1| <= 0.01 (as the released code; the angle,
not the depth, is taken as uniform). The 2 x 2 blocks are then rotations scaled by at most 1, and the output is
turned back with the query's own blocks, which undo its turn exactly only where the query's angles are points.
Known depths (RGB-D input) replace the prediction for all views or for the first views (``depth_source``); a known
depth has no interval, hence exact rotations (sigma = 0).

Because the keys' coordinates depend on the query's camera, attention runs once per query camera (the queries of
view c against every key turned into c's frame): attention FLOPs as dense attention, encoding work and the turned
keys and values O(V^2 N head_dim) for V views of N patches. Nothing of size N x N x head_dim is built.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..base import check_layer, check_model_shape
from ..checks import check_bool, check_choice, check_float, check_int, check_tensor, describe
from ..registry import register_scheme
from .base import Attend, CameraState, CameraTransform, RelativeCameraEncoding
from .cameras import Cameras, invert_rigid

__all__ = ["RayRoPE", "RayRoPEState", "RayRoPETransform", "expected_cos_sin", "RAY_OFFSETS"]

#: offsets (x, y) of the rays through a patch, in patches from its top-left corner, by ray count (the reference's)
RAY_OFFSETS: dict[int, tuple[tuple[float, float], ...]] = {
    1: ((0.5, 0.5),),
    2: ((0.0, 0.0), (1.0, 1.0)),
    3: ((0.0, 0.0), (1.0, 0.0), (0.0, 1.0)),
}
#: the longest period (coordinate units) of each coordinate group: camera centre, ray directions, depths
MAX_PERIOD_CENTER = 4.0
MAX_PERIOD_DIRECTION = 8.0
MAX_PERIOD_DEPTH = 80.0
#: predicted log depths are clamped from above at this value (depth <= e^3, about 20)
MAX_LOG_DEPTH = 3.0
#: every depth of a ray point is clamped to [MIN_DEPTH, MAX_DEPTH]
MIN_DEPTH = 0.01
MAX_DEPTH = 100.0
#: the depth coordinate of a point in the query camera's frame is clamped to [0, MAX_DEPTH_COORD]
MAX_DEPTH_COORD = 10.0
#: angle intervals at most this wide use the point value instead of the mean over the interval
POINT_THRESHOLD = 1e-2

DEPTH_SOURCES = ("predicted", "known", "known+predicted")


def expected_cos_sin(
    theta1: torch.Tensor, theta2: torch.Tensor, threshold: float = POINT_THRESHOLD
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of cos and sin of an angle uniform on [theta1, theta2] (either order), elementwise.

    E[cos] = (sin theta2 - sin theta1) / (theta2 - theta1), E[sin] = (cos theta1 - cos theta2) / (theta2 - theta1);
    where |theta2 - theta1| <= ``threshold`` the point values cos theta1, sin theta1 (the division would lose
    precision there, and the mean differs from them by at most the width).

    Example:
        >>> c, s = expected_cos_sin(torch.tensor([0.0]), torch.tensor([math.pi]))
        >>> round(c.item(), 6) + 0.0, round(s.item(), 6)
        (0.0, 0.63662)
    """
    delta = theta2 - theta1
    point = delta.abs() <= threshold
    safe = torch.where(point, torch.ones_like(delta), delta)
    cos1, sin1 = theta1.cos(), theta1.sin()
    mean_cos = (theta2.sin() - sin1) / safe
    mean_sin = (cos1 - theta2.cos()) / safe
    return torch.where(point, cos1, mean_cos), torch.where(point, sin1, mean_sin)


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Half layout over the first e = 2 * cos.shape[-1] channels of ``x`` (..., d): pair (j, j + e/2) times
    [[cos, -sin], [sin, cos]] (``inverse``: the transpose); channels e.. d pass unchanged. With mean cos/sin the
    matrix is a rotation scaled down, as in the reference."""
    encoded = 2 * cos.shape[-1]
    rest = x[..., encoded:] if encoded < x.shape[-1] else None
    x1, x2 = x[..., :encoded].chunk(2, dim=-1)
    if inverse:
        parts = (x1 * cos + x2 * sin, x2 * cos - x1 * sin)
    else:
        parts = (x1 * cos - x2 * sin, x1 * sin + x2 * cos)
    return torch.cat(parts if rest is None else (*parts, rest), dim=-1)


@register_scheme("rayrope")
class RayRoPE(RelativeCameraEncoding):
    """RayRoPE (Wu et al., arXiv 2601.15275, 2026): rotary encoding of each patch's ray segment in the query
    camera's projective frame, with a per-block predicted depth and its uncertainty (see the module docstring).

    Args:
        dim, num_heads, depth: model shape. ``head_dim`` must be a multiple of 2 * (3 + 3 * num_rays) (24 with 3
            rays) unless ``encoded_dim`` says otherwise; the turned channels hold F = encoded_dim /
            (2 * (3 + 3 * num_rays)) frequencies per coordinate.
        depth_source: where the depth of each ray point comes from:

            - ``"predicted"`` (default): a linear head per block on the block's normalised tokens predicts
              (log d, sigma) per token (only log d with ``uncertainty=False``);
            - ``"known"``: per-patch depths passed to :meth:`prepare` as ``patch_depth`` (every view), no head;
              positions are points (sigma = 0);
            - ``"known+predicted"``: known depths for the first views (``patch_depth`` (B, V_known, ...)), the
              head's for the others, as the reference's RGB-D setting (context views known, target views not).
        uncertainty: the head predicts sigma besides log d and the encoding averages over the depth interval
            (default); False: sigma = 0, the point encoding at the predicted depth.
        num_rays: rays per patch: 3 (default, offsets (0, 0), (1, 0), (0, 1) patches from its top-left corner),
            2 ((0, 0), (1, 1)) or 1 (the centre).
        freq_base: ratio between successive frequencies of a coordinate (3.0).
        transform_values: turn the values by the keys' angles and the output back by the query's (default True);
            False turns q and k only.
        init_log_depth, init_sigma: the head's initial output (its weight starts at zero): log d = 0 (d = 1) and
            sigma = 3, i.e. the interval [e^-3, e^3] (the reference's defaults).
        encoded_dim: channels of each head that are turned, a multiple of 2 * (3 + 3 * num_rays) up to head_dim
            (``None``: all of head_dim, as the reference); the rest pass through unchanged ([visionpe] for head
            sizes such as 64, which no ray layout divides: ``encoded_dim=48`` turns 48 of 64).

    ``prepare(cameras, grid_size, patch_depth=None)``; ``patch_depth`` is each patch's depth (z in its own camera,
    in the units of the camera translations): (B, V, N) for one depth per patch or (B, V, N, num_rays) for one
    per ray, N = h * w patches in row-major order; (B, V_known, ...) with ``"known+predicted"``.

    Example:
        >>> import torch, visionpe
        >>> from visionpe.camera import Cameras, look_at
        >>> from visionpe.attention import PosAttention, PositionContext
        >>> scheme = visionpe.create_pos_embed("rayrope", dim=48, num_heads=2)
        >>> w2c = look_at(torch.tensor([[[0.0, 0, -3], [3.0, 0, 0]]]), torch.zeros(1, 2, 3))
        >>> K = torch.tensor([[32.0, 0, 16], [0, 32.0, 16], [0, 0, 1]]).expand(1, 2, 3, 3)
        >>> ctx = PositionContext(camera=[(scheme, scheme.prepare(Cameras(w2c, K, (32, 48)), (2, 3)))])
        >>> PosAttention(48, 2)(torch.randn(1, 2 * 6, 48), pos=ctx).shape
        torch.Size([1, 12, 48])
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        depth_source: str = "predicted",
        uncertainty: bool = True,
        num_rays: int = 3,
        freq_base: float = 3.0,
        transform_values: bool = True,
        init_log_depth: float = 0.0,
        init_sigma: float = 3.0,
        encoded_dim: int | None = None,
    ) -> None:
        super().__init__()
        head_dim = check_model_shape(dim, num_heads, depth)
        check_choice(depth_source, "depth_source", DEPTH_SOURCES)
        check_bool(uncertainty, "uncertainty")
        check_int(num_rays, "num_rays", min=1, max=3)
        check_float(freq_base, "freq_base", min=0, min_open=True)
        check_bool(transform_values, "transform_values")
        check_float(init_log_depth, "init_log_depth")
        check_float(init_sigma, "init_sigma")
        self.coord_dim = 3 + 3 * num_rays
        block = 2 * self.coord_dim
        if encoded_dim is None:
            if head_dim % block:
                raise ValueError(
                    f"rayrope needs head_dim = dim / num_heads to be a multiple of 2 * (3 + 3 * num_rays) = {block} "
                    f"(num_rays={num_rays}), got head_dim={head_dim} (dim={dim}, num_heads={num_heads}); "
                    f"encoded_dim={head_dim // block * block or block} turns part of each head"
                )
            encoded_dim = head_dim
        check_int(encoded_dim, "encoded_dim", min=block, max=head_dim, type_expected="an int or None")
        if encoded_dim % block:
            raise ValueError(
                f"encoded_dim must be a multiple of 2 * (3 + 3 * num_rays) = {block} (num_rays={num_rays}) up to "
                f"head_dim={head_dim}, got {encoded_dim}"
            )
        self.encoded_dim = encoded_dim
        self.dim, self.num_heads, self.depth, self.head_dim = dim, num_heads, depth, head_dim
        self.depth_source, self.uncertainty, self.num_rays = depth_source, uncertainty, num_rays
        self.freq_base, self.transform_values = float(freq_base), transform_values
        self.num_freqs = encoded_dim // block
        # the block's tokens are read only where a head predicts depths
        self.needs_tokens = depth_source != "known"
        if self.needs_tokens:
            outputs = 2 if uncertainty else 1
            self.depth_heads = nn.ModuleList(nn.Linear(dim, outputs) for _ in range(depth))
            init = torch.tensor([init_log_depth, init_sigma][:outputs])
            with torch.no_grad():
                for head in self.depth_heads:
                    head.weight.zero_()
                    head.bias.copy_(init)
        else:
            self.depth_heads = None
        self.register_buffer("freqs", self._frequencies(), persistent=False)

    def _frequencies(self) -> torch.Tensor:
        """(F, coord_dim) frequencies, float64: pair f * coord_dim + i turns with coordinate i at frequency f."""
        periods = torch.tensor(
            [MAX_PERIOD_CENTER] * 3 + [MAX_PERIOD_DIRECTION] * (2 * self.num_rays) + [MAX_PERIOD_DEPTH] * self.num_rays,
            dtype=torch.float64,
        )
        ratios = self.freq_base ** torch.arange(self.num_freqs, dtype=torch.float64)
        return (2 * math.pi / periods)[None, :] * ratios[:, None]

    def fixed_buffers(self) -> dict[str, torch.Tensor]:
        # float64 (kept under model.to(bfloat16)): camera coordinates reach large values
        return {"freqs": self._frequencies()}

    @property
    def extra_inputs(self) -> tuple[str, ...]:
        """``("patch_depth",)`` where :meth:`prepare` takes known depths, else empty."""
        return ("patch_depth",) if self.depth_source != "predicted" else ()

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, encoded_dim={self.encoded_dim}, depth_source={self.depth_source!r}, "
            f"uncertainty={self.uncertainty}, num_rays={self.num_rays}, num_freqs={self.num_freqs}, "
            f"freq_base={self.freq_base}, transform_values={self.transform_values}"
        )

    def prepare(
        self, cameras: Cameras, grid_size: tuple[int, int], patch_depth: torch.Tensor | None = None
    ) -> RayRoPEState:
        """Per-forward state: each view's rays, the cameras' relative poses and the known depths.

        Args:
            cameras: the (B, V) cameras.
            grid_size: (h, w) patches per view.
            patch_depth: known depths (see the class docstring); required with ``depth_source`` ``"known"`` and
                ``"known+predicted"``, not taken with ``"predicted"``.
        """
        grid_size = self.check_cameras(cameras, grid_size)
        batch, views = cameras.batch_size, cameras.num_views
        patches = grid_size[0] * grid_size[1]
        known = None
        if self.depth_source == "predicted":
            if patch_depth is not None:
                raise ValueError(
                    "patch_depth is taken with depth_source='known' or 'known+predicted'; this rayrope predicts its "
                    f"depths (depth_source='predicted'), got {describe(patch_depth)}"
                )
        else:
            known = self._check_depth(patch_depth, batch, views, patches)
        return RayRoPEState(self, cameras, grid_size, known)

    def _check_depth(self, depth: torch.Tensor | None, batch: int, views: int, patches: int) -> torch.Tensor:
        """(B, V_known, N, num_rays) depths clamped to [MIN_DEPTH, MAX_DEPTH], from a checked ``patch_depth``."""
        all_views = self.depth_source == "known"
        views_text = f"V = {views}" if all_views else f"V_known <= {views}"
        shape = f"(B, {views_text}, N[, num_rays]) with B = {batch}, N = {patches}, num_rays = {self.num_rays}"
        if depth is None:
            raise ValueError(f"rayrope with depth_source={self.depth_source!r} needs patch_depth {shape}, got None")
        check_tensor(depth, "patch_depth", dtype="floating", expected=f"a floating-point {shape} tensor")
        if depth.ndim == 3:
            depth = depth[..., None].expand(-1, -1, -1, self.num_rays)
        bad = depth.ndim != 4 or depth.shape[0] != batch or depth.shape[2:] != (patches, self.num_rays)
        bad = bad or (depth.shape[1] != views if all_views else not 1 <= depth.shape[1] <= views)
        if bad:
            raise ValueError(f"patch_depth must be {shape}, got shape {tuple(depth.shape)}")
        if not torch.compiler.is_compiling() and not bool((torch.isfinite(depth) & (depth > 0)).all()):
            raise ValueError("patch_depth must hold positive finite depths, got a value <= 0, NaN or inf")
        return depth.clamp(MIN_DEPTH, MAX_DEPTH)

    def predict_depth(self, tokens: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The depth interval (d1, d2), each (B, T), that block ``layer``'s head predicts from ``tokens``
        (B, T, dim): exp(log d -/+ sigma) with the exponents clamped at 3 (sigma = 0 without ``uncertainty``)."""
        if self.depth_heads is None:
            raise ValueError("this rayrope has no depth head (depth_source='known')")
        head = self.depth_heads[layer]
        dtype = torch.promote_types(tokens.dtype, torch.float32)
        with torch.autocast(tokens.device.type, enabled=False):
            raw = F.linear(tokens.to(dtype), head.weight.to(dtype), head.bias.to(dtype))
        if not self.uncertainty:
            near = torch.exp(raw[..., 0].clamp(max=MAX_LOG_DEPTH)).clamp(MIN_DEPTH, MAX_DEPTH)
            return near, near
        log_depth, sigma = raw.unbind(-1)
        near = torch.exp((log_depth - sigma).clamp(max=MAX_LOG_DEPTH)).clamp(MIN_DEPTH, MAX_DEPTH)
        far = torch.exp((log_depth + sigma).clamp(max=MAX_LOG_DEPTH)).clamp(MIN_DEPTH, MAX_DEPTH)
        return near, far


class RayRoPEState(CameraState):
    """What :meth:`RayRoPE.prepare` builds once per forward: per view and ray, the camera-frame direction of the ray
    at z = 1; per pair of views (c, k), ``w2c_c @ c2w_k``; the normalised intrinsics; the known depths."""

    def __init__(
        self, scheme: RayRoPE, cameras: Cameras, grid_size: tuple[int, int], known: torch.Tensor | None
    ) -> None:
        self.scheme = scheme
        self.batch_size, self.num_views = cameras.batch_size, cameras.num_views
        self.grid_size = grid_size
        self.num_patches = grid_size[0] * grid_size[1]
        self.dtype = torch.promote_types(cameras.w2c.dtype, torch.float32)
        device = cameras.device
        with torch.autocast(device.type, enabled=False):
            w2c = cameras.w2c.to(self.dtype)
            k = cameras.normalized_intrinsics().to(self.dtype)
            # relative[b, c, v] = w2c_c @ c2w_v: view v's camera frame -> view c's
            self.relative = w2c[:, :, None] @ invert_rigid(w2c)[:, None]
            self.intrinsics = k
            # ray points (u, v) in units of the image, relative to its centre, (N, R, 2), rows (row, column)
            h, w = grid_size
            rows = torch.arange(h, device=device, dtype=self.dtype)
            cols = torch.arange(w, device=device, dtype=self.dtype)
            offsets = torch.tensor(RAY_OFFSETS[scheme.num_rays], device=device, dtype=self.dtype)  # (R, 2) x, y
            u = (cols[None, :, None] + offsets[:, 0]) / w - 0.5  # (1, w, R)
            v = (rows[:, None, None] + offsets[:, 1]) / h - 0.5  # (h, 1, R)
            u, v = torch.broadcast_tensors(u, v)
            uv = torch.stack((u, v), -1).reshape(self.num_patches, scheme.num_rays, 2)
            # camera-frame direction with z = 1 through each ray point: K^-1 (u, v, 1), (B, V, N, R, 3)
            fx, fy = k[..., 0, 0], k[..., 1, 1]
            skew, cx, cy = k[..., 0, 1], k[..., 0, 2], k[..., 1, 2]
            expand = (slice(None), slice(None), None, None)
            y = (uv[..., 1] - cy[expand]) / fy[expand]
            x = (uv[..., 0] - cx[expand] - skew[expand] * y) / fx[expand]
            self.directions = torch.stack((x, y, torch.ones_like(x)), -1)
        self.known = None if known is None else known.to(device=device, dtype=self.dtype)
        self.freqs = scheme.freqs.to(device=device, dtype=self.dtype)

    def layer(self, index: int, tokens: torch.Tensor | None = None) -> RayRoPETransform:
        """Block ``index``'s transform; ``tokens`` (B, V * N, dim) feed its depth head (all but ``"known"``)."""
        scheme = self.scheme
        check_layer(index, scheme.depth, "rayrope")
        shape = (self.batch_size, self.num_views, self.num_patches, scheme.num_rays)
        if scheme.depth_source == "known":
            near = self.known
            return RayRoPETransform(self, near, near)
        expected = f"(B, V * N, dim) = ({self.batch_size}, {self.num_views * self.num_patches}, {scheme.dim})"
        if tokens is None:
            raise ValueError(
                f"rayrope with depth_source={scheme.depth_source!r} predicts depths from the block's tokens "
                f"{expected}; got tokens=None"
            )
        check_tensor(tokens, "tokens", dtype="floating", expected=f"a floating-point {expected} tensor")
        if tokens.shape != (self.batch_size, self.num_views * self.num_patches, scheme.dim):
            raise ValueError(f"tokens must be {expected}, got shape {tuple(tokens.shape)}")
        near, far = scheme.predict_depth(tokens, index)
        point = far is near
        near = near.to(self.dtype).reshape(shape[:3])[..., None].expand(shape)
        far = near if point else far.to(self.dtype).reshape(shape[:3])[..., None].expand(shape)
        if self.known is not None:  # "known+predicted": the first views' depths are given
            given = self.known.shape[1]
            near = torch.cat((self.known, near[:, given:]), dim=1)
            far = near if point else torch.cat((self.known, far[:, given:]), dim=1)
        return RayRoPETransform(self, near, far)


class RayRoPETransform(CameraTransform):
    """One block's RayRoPE: the depth interval [near, far] of every ray point, (B, V, N, num_rays) each (the same
    tensor where the depths are points), and the attention run once per query camera."""

    def __init__(self, state: RayRoPEState, near: torch.Tensor, far: torch.Tensor) -> None:
        self.state, self.near, self.far = state, near, far

    def coordinates(self, camera: int, depth: torch.Tensor) -> torch.Tensor:
        """(B, V, N, coord_dim) positions of every token in view ``camera``'s frame with ray depths ``depth``
        (B, V, N, R): key camera centre (3), per ray the x, y of the unit vector K_c X (2 R), per ray |z| clamped
        to 10 (R)."""
        state = self.state
        relative = state.relative[:, camera]  # (B, V, 4, 4)
        rot, trans = relative[..., None, :3, :3], relative[..., None, :3, 3]
        points = (depth[..., None] * state.directions) @ rot.transpose(-1, -2) + trans[..., None, :]  # (B,V,N,R,3)
        projected = points @ state.intrinsics[:, camera, None, None].transpose(-1, -2)
        unit = F.normalize(projected, dim=-1)[..., :2].flatten(-2)
        depth_coord = points[..., 2].abs().clamp(max=MAX_DEPTH_COORD)
        center = trans.expand(-1, -1, state.num_patches, -1)
        return torch.cat((center, unit, depth_coord), dim=-1)

    def coefficients(self, camera: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B, V * N, encoded_dim / 2) of every token in view ``camera``'s frame: of the angles at the
        point depth, or their means over the depth interval; float32 (float64 for float64 cameras)."""
        state = self.state
        batch = state.batch_size
        with torch.autocast(state.relative.device.type, enabled=False):
            angles = (self.coordinates(camera, self.near)[..., None, :] * state.freqs).flatten(-2)
            if self.far is self.near:
                cos, sin = angles.cos(), angles.sin()
            else:
                far = (self.coordinates(camera, self.far)[..., None, :] * state.freqs).flatten(-2)
                cos, sin = expected_cos_sin(angles, far)
        return cos.reshape(batch, -1, cos.shape[-1]), sin.reshape(batch, -1, sin.shape[-1])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Attention of q over k and v (each (B, heads, V * N, head_dim)): for each view c, its queries turned by
        minus their angles against every key and value turned by minus the key's angles in c's frame; the output
        turned back by the query's angles."""
        state, scheme = self.state, self.state.scheme
        patches, views = state.num_patches, state.num_views
        expected = (state.batch_size, scheme.num_heads, views * patches, scheme.head_dim)
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor) or x.shape != expected:
                raise ValueError(
                    f"{name} must be (B, heads, V * N, head_dim) = {expected} for rayrope's cameras and grid, got "
                    f"{describe(x)}"
                )
        outputs = []
        for camera in range(views):
            cos, sin = self.coefficients(camera)
            cos, sin = cos.to(q.dtype)[:, None], sin.to(q.dtype)[:, None]  # shared by the heads
            rows = slice(camera * patches, (camera + 1) * patches)
            cos_q, sin_q = cos[:, :, rows], sin[:, :, rows]
            query = _turn(q[:, :, rows], cos_q, sin_q, inverse=True)
            key = _turn(k, cos, sin, inverse=True)
            value = _turn(v, cos, sin, inverse=True) if scheme.transform_values else v
            out = attend(query, key, value)
            outputs.append(_turn(out, cos_q, sin_q, inverse=False) if scheme.transform_values else out)
        return torch.cat(outputs, dim=2)
