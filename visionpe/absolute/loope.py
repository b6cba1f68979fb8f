"""LOOPE: Chowdhury, Rahman, Taki, "LOOPE: Learnable Optimal Patch Order in Positional Embeddings for Vision
Transformers", arXiv 2504.14386, 2025.

Each patch gets one scalar position X = X_G + X_C: X_G its 1-based step number along a generalized Hilbert
("Gilbert") curve through the H x W grid, X_C in (-1, 1) a context offset computed from the image. The embedding is
1D sin-cos of that scalar with sin and cos interleaved, E(X)_{2k} = sin(X w_k), E(X)_{2k+1} = cos(X w_k), w_k =
10000^(-2k/C), added to the patch tokens; the class token gets a learned vector (zero at init).

This is what the authors' released code computes (their ``ArtPE`` module, written here anew from reading it; the
tests check the output against an independent re-computation on weights laid out as theirs,
:meth:`LOOPE.load_released_state_dict`). The context term is a small CNN over the image with two coordinate
channels appended (y then x, each ``linspace(-1, 1)`` over the pixels): a convolution with the patch as kernel and
stride to 32 channels, then 32 -> 16 -> 8 -> 4 -> 1 convolutions (kernel 5, padding 2), each of the five followed by
a GELU; then ``BatchNorm2d(1)``, and a bias-free linear map from the H0 W0 values of the map to the H0 W0 patches,
through a sigmoid: X_C = 2 sigmoid(W BN(CNN([image, y, x]))) - 1, per image. In training mode the batch norm uses
the batch's statistics, so an image's positions depend on the other images of its batch, as in the released code.
The released training excludes every parameter of the module from weight decay (its name filter matches
``pos_embed`` in ``pos_embedding.*``), and so does :meth:`LOOPE.no_weight_decay`.

visionpe's additions, none of which changes the output on the released configuration (one class token, a square
grid, the training grid): other grids and image sizes (the CNN runs on any image; its map is resampled to the
training grid before the linear map and the logits back to the grid, so the context only interpolates); non-square
grids, whose curve advances along the longer side first (the released curve always starts along x, which is the
same on a square grid); any channel count and patch size, register tokens (one learned vector per prefix token) or
none (``no_embed_class``); and ``context="learned"``, a learned X_C per patch of the training grid (zero at init,
resampled bicubically on other grids) that needs no image. The paper's Three-Cell Experiment (a probe of how much
relative and absolute position a PE retains) is not provided.

The curve: Jakub Cerveny's generalized Hilbert curve for rectangles of any size ("gilbert", 2019), written here from
its description (:func:`gilbert_curve`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from timm.layers import resample_abs_pos_embed
from torch import nn

from ..base import AbsolutePositionEncoding
from ..checks import check_bool, check_choice, check_int, check_positive
from ..grid import validate_grid_size
from ..registry import register_scheme

__all__ = ["LOOPE", "convert_released_state_dict", "gilbert_curve", "gilbert_index", "sincos_1d"]

_INTERPOLATIONS = ("bicubic", "bilinear", "nearest")
_CONTEXTS = ("image", "learned")
# channels of the context CNN after its patch convolution (the released widths)
_WIDTHS = (32, 16, 8, 4, 1)

# resampling runs eagerly under torch.compile, as for the learned table (inductor fails on the antialiased bicubic
# backward, torch 2.14); the context maps are small
_resample = torch.compiler.disable(resample_abs_pos_embed)


def _sign(v: int) -> int:
    return (v > 0) - (v < 0)


@functools.lru_cache(maxsize=64)
def _curve(height: int, width: int) -> tuple[tuple[int, int], ...]:
    # A rectangle is given by its corner (x, y), its major side (ax, ay) and its minor side (bx, by), each along
    # one axis and possibly negative; the curve enters at the corner.
    # A one-cell-thick rectangle is walked straight. Otherwise, a rectangle much longer than wide (2w > 3h) is cut
    # across its major side into two halves walked in turn; any other one into three: a first part along the minor
    # side (its major and minor sides swapped), the remaining full-length strip, and a last part walked back to the
    # far corner. Halves are rounded so that sub-rectangles longer than 2 have even lengths, which keeps every step
    # between neighbours (a diagonal step is left only where parity forces one).
    cells: list[tuple[int, int]] = []
    pending = [(0, 0, width, 0, 0, height) if width >= height else (0, 0, 0, height, width, 0)]
    while pending:
        x, y, ax, ay, bx, by = pending.pop()
        w, h = abs(ax + ay), abs(bx + by)
        dax, day, dbx, dby = _sign(ax), _sign(ay), _sign(bx), _sign(by)
        if h == 1 or w == 1:
            sx, sy, steps = (dax, day, w) if h == 1 else (dbx, dby, h)
            cells.extend((y + i * sy, x + i * sx) for i in range(steps))
            continue
        ax2, ay2, bx2, by2 = ax // 2, ay // 2, bx // 2, by // 2
        if 2 * w > 3 * h:
            if abs(ax2 + ay2) % 2 and w > 2:
                ax2, ay2 = ax2 + dax, ay2 + day
            parts = [(x, y, ax2, ay2, bx, by), (x + ax2, y + ay2, ax - ax2, ay - ay2, bx, by)]
        else:
            if abs(bx2 + by2) % 2 and h > 2:
                bx2, by2 = bx2 + dbx, by2 + dby
            parts = [
                (x, y, bx2, by2, ax2, ay2),
                (x + bx2, y + by2, ax, ay, bx - bx2, by - by2),
                (x + (ax - dax) + (bx2 - dbx), y + (ay - day) + (by2 - dby), -bx2, -by2, -(ax - ax2), -(ay - ay2)),
            ]
        pending.extend(reversed(parts))  # the first part is walked first
    return tuple(cells)


def gilbert_curve(grid_size: tuple[int, int]) -> list[tuple[int, int]]:
    """The cells (y, x) of an H x W grid in the order of the generalized Hilbert curve.

    The curve starts at (0, 0) and advances along the longer side (x when W >= H). Every cell is visited once, and
    consecutive cells are neighbours (Chebyshev distance 1); they share a side except for at most one diagonal
    step, which parity forces when the longer side is odd and the shorter even.

    Example:
        >>> gilbert_curve((2, 3))
        [(0, 0), (1, 0), (1, 1), (1, 2), (0, 2), (0, 1)]
    """
    height, width = validate_grid_size(grid_size, ndims=(2,))
    return list(_curve(height, width))


def gilbert_index(grid_size: tuple[int, int], device=None) -> torch.Tensor:
    """(H W,) int64 position along :func:`gilbert_curve` of each patch, patches in row-major order, counted from 0
    (LOOPE's X_G is this plus one).

    Example:
        >>> gilbert_index((2, 3))  # row 0: (0,0) (0,1) (0,2); row 1: (1,0) (1,1) (1,2)
        tensor([0, 5, 4, 1, 2, 3])
    """
    height, width = validate_grid_size(grid_size, ndims=(2,))
    rank = [0] * (height * width)
    for step, (y, x) in enumerate(_curve(height, width)):
        rank[y * width + x] = step
    return torch.tensor(rank, dtype=torch.int64, device=device)


def _spectrum(dim: int, temperature: float, device=None) -> torch.Tensor:
    # w_k = exp(2k * -(ln T / dim)) in fp32, the released expression (bit for bit the same frequencies)
    return torch.exp(torch.arange(0, dim, 2, dtype=torch.float32, device=device) * (-math.log(temperature) / dim))


def sincos_1d(
    positions: torch.Tensor, dim: int, temperature: float = 10000.0, interleaved: bool = False
) -> torch.Tensor:
    """(..., dim) sin-cos of scalar positions X (...,), w_k = temperature^(-2k/dim), k < dim / 2, in fp32:
    [sin(X w) || cos(X w)], or with ``interleaved`` sin(X w_k) in channel 2k and cos(X w_k) in channel 2k + 1
    (LOOPE's layout).

    Example:
        >>> sincos_1d(torch.tensor([1.0]), 4).round(decimals=4)
        tensor([[0.8415, 0.0100, 0.5403, 1.0000]])
        >>> sincos_1d(torch.tensor([1.0]), 4, interleaved=True).round(decimals=4)
        tensor([[0.8415, 0.5403, 0.0100, 1.0000]])
    """
    if not isinstance(positions, torch.Tensor) or positions.ndim < 1:
        raise ValueError(f"positions must be a tensor of >= 1 dims, got {getattr(positions, 'shape', type(positions))}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
        raise ValueError(f"dim must be an even int >= 2, got {dim!r}")
    with torch.autocast(positions.device.type, enabled=False):
        angles = positions.float()[..., None] * _spectrum(dim, temperature, positions.device)
        if interleaved:
            return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)
        return torch.cat([angles.sin(), angles.cos()], dim=-1)


def _pair(value, name: str) -> tuple[int, int]:
    pair = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(pair) != 2:
        raise ValueError(f"{name} must be an int or an (H, W) pair, got {value!r}")
    return check_int(pair[0], f"{name}[0]", min=1), check_int(pair[1], f"{name}[1]", min=1)


# the released module's keys (``ArtPE``: its ``art_conv`` Sequential, ``cls_token``) -> this module's; the
# Sequential's GELUs, Flatten and Sigmoid hold no tensors, and its buffers (``cord``, ``wrap_pos_hilbert``,
# ``div_term``) are computed here
_RELEASED_PREFIXES = {
    **{f"art_conv.{i}.": f"context_net.{i}." for i in (0, 2, 4, 6, 8)},
    "art_conv.10.": "context_norm.",
}
_RELEASED_NAMES = {"art_conv.12.weight": "context_weight", "cls_token": "prefix_embed"}
_RELEASED_BUFFERS = ("cord", "wrap_pos_hilbert", "div_term")


def convert_released_state_dict(state_dict: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """The state dict of the authors' released LOOPE module (``ArtPE``) under this module's names.

    The key map: ``art_conv.{0,2,4,6,8}.*`` (the five convolutions) -> ``context_net.{0,2,4,6,8}.*``,
    ``art_conv.10.*`` (the batch norm, running statistics included) -> ``context_norm.*``, ``art_conv.12.weight``
    (the linear map) -> ``context_weight``, ``cls_token`` -> ``prefix_embed``. Their buffers ``cord``,
    ``wrap_pos_hilbert`` and ``div_term`` are left out (this module computes them); other keys raise ValueError.
    ``prefix``: the module's prefix in a larger state dict (``"pos_embedding."`` in their ViT); keys without it are
    ignored. :meth:`LOOPE.load_released_state_dict` converts, checks the buffers against the scheme, and loads.
    """
    out = {}
    for key, value in state_dict.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if name in _RELEASED_BUFFERS:
            continue
        if name in _RELEASED_NAMES:
            out[_RELEASED_NAMES[name]] = value
            continue
        for old, new in _RELEASED_PREFIXES.items():
            if name.startswith(old):
                out[new + name[len(old) :]] = value
                break
        else:
            raise ValueError(f"{key!r} is not a key of the released LOOPE module")
    return out


@register_scheme("loope")
class LOOPE(AbsolutePositionEncoding):
    """Sin-cos of each patch's 1-based Gilbert-curve index plus a context offset (see the module docstring).

    The default ``context="image"`` reads the input image: the model passes it to :meth:`forward` as ``pixels``
    (``requires = {"pixels"}``; ``timm.create_model("visionpe_vit_*")`` does, the entry points that do not are
    refused). Its offsets mix every patch of the image, so it is neither causal nor taken in mixed-resolution batches.
    ``context="learned"`` reads no image and is both, in visionpe's ViT (the other entry points refuse the name
    ``loope`` whatever its options: the class declares what the default needs).

    Args:
        dim: model width (even).
        num_heads, depth: unused (the registry's common signature).
        grid_size: training grid (H0, W0); the model passes its patch grid. The context's linear map (or the learned
            X_C) has H0 W0 entries per side.
        num_prefix_tokens: class and register tokens; each gets a learned vector, zero at init (the released code
            has one class token). The model passes its count.
        no_embed_class: no vectors for the prefix tokens (they pass unchanged).
        context: ``"image"`` (the released context network) or ``"learned"`` (one learned offset per patch).
        patch_size: the model's patch, kernel and stride of the context network's first convolution.
        in_chans: image channels (the context network takes them and two coordinate channels).
        temperature: base of the fixed spectrum (10000).
        interpolation, antialias: how the context is resampled on another grid (bicubic with antialias, as the
            learned table).
    """

    requires = frozenset({"pixels"})
    supports_causal = False
    supports_mixed_resolution = False

    def __init__(
        self,
        dim: int,
        num_heads: int = 1,
        depth: int = 1,
        grid_size: tuple[int, int] = (14, 14),
        num_prefix_tokens: int = 1,
        no_embed_class: bool = False,
        context: str = "image",
        patch_size: int | tuple[int, int] = 16,
        in_chans: int = 3,
        temperature: float = 10000.0,
        interpolation: str = "bicubic",
        antialias: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
            raise ValueError(f"loope needs an even dim >= 2 (sin and cos pairs), got dim={dim!r}")
        self.dim = dim
        self.grid_size = validate_grid_size(grid_size, ndims=(2,))
        self.num_prefix_tokens = check_int(num_prefix_tokens, "num_prefix_tokens", min=0)
        self.no_embed_class = check_bool(no_embed_class, "no_embed_class")
        self.context_source = check_choice(context, "context", _CONTEXTS)
        self.patch_size = _pair(patch_size, "patch_size")
        self.in_chans = check_int(in_chans, "in_chans", min=1)
        self.temperature = check_positive(temperature, "temperature")
        self.interpolation = check_choice(interpolation, "interpolation", _INTERPOLATIONS)
        self.antialias = check_bool(antialias, "antialias")
        num_patches = self.grid_size[0] * self.grid_size[1]
        if self.context_source == "image":
            layers = [nn.Conv2d(self.in_chans + 2, _WIDTHS[0], self.patch_size, self.patch_size), nn.GELU()]
            for width_in, width_out in zip(_WIDTHS, _WIDTHS[1:], strict=False):
                layers += [nn.Conv2d(width_in, width_out, 5, 1, 2), nn.GELU()]
            self.context_net = nn.Sequential(*layers)
            self.context_norm = nn.BatchNorm2d(1)
            # the linear map, W (H0 W0 patches, H0 W0 map values), drawn as nn.Linear draws its weight
            self.context_weight = nn.Parameter(torch.empty(num_patches, num_patches))
            nn.init.kaiming_uniform_(self.context_weight, a=math.sqrt(5))
        else:
            # X_C, one scalar per training patch, stored (1, H0 W0, 1) like a one-channel table for resampling
            self.context = nn.Parameter(torch.zeros(1, num_patches, 1))
            # the learned offsets read no image and mix no patches
            self.requires = frozenset()
            self.supports_causal = True
            self.supports_mixed_resolution = True
        rows = 0 if self.no_embed_class else self.num_prefix_tokens
        self.prefix_embed = nn.Parameter(torch.zeros(rows, dim)) if rows else None

    # -- the context X_C ------------------------------------------------------------------------------------------
    def _resize(self, values: torch.Tensor, old: tuple[int, int], new: tuple[int, int]) -> torch.Tensor:
        """(B, H W) values on grid ``old`` -> (B, H' W') on grid ``new`` (each row resampled as a one-channel table)."""
        out = _resample(
            values.transpose(0, 1)[None],
            new_size=list(new),
            old_size=list(old),
            num_prefix_tokens=0,
            interpolation=self.interpolation,
            antialias=self.antialias,
        )
        return out[0].transpose(0, 1)

    def _check_pixels(self, pixels, grid_size: tuple[int, int]) -> torch.Tensor:
        if pixels is None:
            raise ValueError(
                "loope with context='image' computes its positions from the input image: call it with "
                "pixels=(B, C, H, W) (timm.create_model('visionpe_vit_*') passes them), or build it with "
                "context='learned'"
            )
        if not isinstance(pixels, torch.Tensor) or pixels.ndim != 4 or not pixels.is_floating_point():
            raise ValueError(
                f"pixels must be a floating-point (B, C={self.in_chans}, H, W) tensor, got "
                f"{getattr(pixels, 'shape', type(pixels).__name__)} {getattr(pixels, 'dtype', '')}"
            )
        ph, pw = self.patch_size
        patches = (-(-pixels.shape[2] // ph), -(-pixels.shape[3] // pw))
        if pixels.shape[1] != self.in_chans or pixels.shape[0] == 0 or patches != tuple(grid_size):
            raise ValueError(
                f"pixels must be (B >= 1, C={self.in_chans}, H, W) whose {ph}x{pw} patches form the grid {grid_size}, "
                f"got {tuple(pixels.shape)}"
            )
        return pixels

    def context_map(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 1, H, W) output of the context network (after its batch norm) for images ``pixels`` (B, C, H_px,
        W_px): the image with its y and x coordinates (``linspace(-1, 1)`` over the pixels) appended as channels,
        zero-padded to whole patches as the model's patch embedding pads, then the convolutions."""
        batch, _, height, width = pixels.shape
        ys = torch.linspace(-1, 1, height, dtype=pixels.dtype, device=pixels.device)
        xs = torch.linspace(-1, 1, width, dtype=pixels.dtype, device=pixels.device)
        coords = torch.stack(torch.meshgrid(ys, xs, indexing="ij"))
        inputs = torch.cat([pixels, coords[None].expand(batch, -1, -1, -1)], dim=1)
        pad_h, pad_w = -height % self.patch_size[0], -width % self.patch_size[1]
        if pad_h or pad_w:
            inputs = F.pad(inputs, (0, pad_w, 0, pad_h))
        return self.context_norm(self.context_net(inputs))

    def context_offsets(self, grid_size: tuple[int, int], pixels: torch.Tensor | None = None) -> torch.Tensor:
        """X_C for ``grid_size``: (B, H W) in (-1, 1) from the images ``pixels`` (``context="image"``), or (H W,) the
        learned offsets (``context="learned"``, ``pixels`` unused); resampled through the training grid when the
        grid differs from it."""
        grid_size = self.check_grid(grid_size)
        if self.context_source == "learned":
            context = self.context
            if grid_size != self.grid_size:
                context = _resample(
                    context,
                    new_size=list(grid_size),
                    old_size=list(self.grid_size),
                    num_prefix_tokens=0,
                    interpolation=self.interpolation,
                    antialias=self.antialias,
                )
            return context[0, :, 0]
        values = self.context_map(self._check_pixels(pixels, grid_size)).flatten(1)
        if grid_size == self.grid_size:
            logits = F.linear(values, self.context_weight)
        else:  # the map to the training grid, the linear map there, the logits back to the grid
            logits = F.linear(self._resize(values, grid_size, self.grid_size), self.context_weight)
            logits = self._resize(logits, self.grid_size, grid_size)
        return 2 * torch.sigmoid(logits) - 1

    def positions(self, grid_size: tuple[int, int], pixels: torch.Tensor | None = None, device=None) -> torch.Tensor:
        """X = X_G + X_C, fp32: (B, H W) (``context="image"``) or (H W,) (``"learned"``), patches row-major, X_G the
        1-based curve index."""
        grid_size = self.check_grid(grid_size)
        offsets = self.context_offsets(grid_size, pixels).float()
        index = gilbert_index(grid_size, device=offsets.device if device is None else device) + 1
        return offsets + index

    def table(self, grid_size: tuple[int, int], pixels: torch.Tensor | None = None, device=None) -> torch.Tensor:
        """The embedding E(X) of every patch: (B, H W, dim) (``context="image"``) or (H W, dim) (``"learned"``)."""
        return sincos_1d(self.positions(grid_size, pixels, device), self.dim, self.temperature, interleaved=True)

    def forward(
        self,
        x: torch.Tensor,
        grid_size: tuple[int, ...],
        num_prefix_tokens: int,
        pixels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` (B, num_prefix_tokens + H W, dim) with E(X) added to the patches and each prefix token's vector to
        it; ``pixels`` (B, C, H_px, W_px): the images the tokens were embedded from (``context="image"``)."""
        grid_size = self.check_tokens(x, grid_size, num_prefix_tokens, self.dim)
        if self.prefix_embed is not None and num_prefix_tokens != self.num_prefix_tokens:
            raise ValueError(
                f"loope was built with vectors for {self.num_prefix_tokens} prefix tokens, got {num_prefix_tokens}"
            )
        pe = self.table(grid_size, pixels, x.device).to(x.dtype)
        if pe.ndim == 3 and pe.shape[0] != x.shape[0]:
            raise ValueError(f"pixels hold {pe.shape[0]} images for a batch of {x.shape[0]} token sequences")
        prefix = x[:, :num_prefix_tokens]
        if self.prefix_embed is not None and num_prefix_tokens:
            prefix = prefix + self.prefix_embed.to(x.dtype)
        return torch.cat([prefix, x[:, num_prefix_tokens:] + pe], dim=1)

    # -- other grids, checkpoints, training -----------------------------------------------------------------------
    def _weight_for(self, weight: torch.Tensor, old: tuple[int, int], new: tuple[int, int]) -> torch.Tensor:
        """The linear map on grid ``new`` that equals resampling the map to ``old``, ``weight`` there and resampling
        the logits back (what :meth:`context_offsets` does on ``new``), composed once."""
        eye = torch.eye(new[0] * new[1], device=weight.device)
        composed = self._resize(F.linear(self._resize(eye, new, old), weight.float()), old, new)
        return composed.transpose(0, 1).to(weight.dtype).contiguous()

    def resample_table(self, name: str, value: torch.Tensor) -> torch.Tensor | None:
        """A checkpoint's ``context_weight`` (n^2, n^2) or learned ``context`` (1, n^2, 1) from another (square)
        training grid, brought to this one as :meth:`set_grid_size` does; None for any other name or shape. The
        checkpoint loader (:func:`~visionpe.load_timm_state_dict`, timm's ``pretrained``) calls it."""
        if not isinstance(value, torch.Tensor):
            return None
        if name == "context_weight" and self.context_source == "image" and value.ndim == 2:
            side = math.isqrt(value.shape[1])
            if side * side != value.shape[1] or value.shape[0] != value.shape[1]:
                return None
            with torch.no_grad():
                return self._weight_for(value, (side, side), self.grid_size)
        if name != "context" or self.context_source != "learned" or value.ndim != 3 or value.shape[::2] != (1, 1):
            return None
        side = math.isqrt(value.shape[1])
        if side * side != value.shape[1]:
            return None
        with torch.no_grad():
            out = resample_abs_pos_embed(
                value.float(),
                new_size=list(self.grid_size),
                old_size=[side, side],
                num_prefix_tokens=0,
                interpolation=self.interpolation,
                antialias=self.antialias,
            )
        return out.to(value.dtype)

    def set_grid_size(self, grid_size: tuple[int, ...]) -> None:
        """Bring the context to a new nominal grid (``model.set_input_size``): the learned X_C resampled, or the
        linear map composed with the resampling, so that the scheme computes on that grid what it computed there
        before."""
        grid_size = self.check_grid(grid_size)
        if grid_size == self.grid_size:
            return
        with torch.no_grad():
            if self.context_source == "learned":
                context = self.context_offsets(grid_size)[None, :, None].contiguous()
                self.context = nn.Parameter(context, requires_grad=self.context.requires_grad)
            else:
                weight = self._weight_for(self.context_weight, self.grid_size, grid_size)
                self.context_weight = nn.Parameter(weight, requires_grad=self.context_weight.requires_grad)
        self.grid_size = grid_size

    def load_released_state_dict(self, state_dict: Mapping[str, torch.Tensor], prefix: str = "") -> None:
        """Load the weights of the authors' released LOOPE module (``ArtPE``; ``prefix="pos_embedding."`` for their
        ViT's state dict), key map :func:`convert_released_state_dict`.

        Their buffers are checked against this scheme: ``wrap_pos_hilbert`` must be this grid's 1-based curve
        index, ``div_term`` this width's spectrum and ``cord`` an image of whole patches of this grid; a mismatch, a
        missing or unknown key or a shape that differs raises (ValueError, or torch's RuntimeError for shapes).
        Needs ``context="image"`` and one prefix vector (their class token)."""
        if self.context_source != "image":
            raise ValueError(
                f"the released module computes its context from the image, got context={self.context_source!r}"
            )
        for name in _RELEASED_BUFFERS:
            if prefix + name not in state_dict:
                raise ValueError(f"state_dict has no {prefix + name!r}: not the released LOOPE module's layout")
        index = state_dict[prefix + "wrap_pos_hilbert"]
        expected = (gilbert_index(self.grid_size) + 1).float()[:, None]
        if tuple(index.shape) != tuple(expected.shape) or not torch.equal(index.float().cpu(), expected):
            raise ValueError(
                f"{prefix}wrap_pos_hilbert {tuple(index.shape)} is not the curve index of this scheme's grid "
                f"{self.grid_size}: the module was built for another grid"
            )
        div_term = state_dict[prefix + "div_term"].float().cpu()
        spectrum = _spectrum(self.dim, self.temperature)
        if div_term.shape != (1, self.dim // 2) or not torch.allclose(div_term[0], spectrum):
            raise ValueError(
                f"{prefix}div_term {tuple(div_term.shape)} is not the spectrum of dim={self.dim}, "
                f"temperature={self.temperature}"
            )
        cord = state_dict[prefix + "cord"]
        patches = tuple(n // p for n, p in zip(cord.shape[1:], self.patch_size, strict=False))
        if cord.ndim != 3 or cord.shape[0] != 2 or patches != self.grid_size:
            raise ValueError(
                f"{prefix}cord {tuple(cord.shape)} is not the coordinates of an image of {self.patch_size} patches "
                f"forming this scheme's grid {self.grid_size}"
            )
        self.load_state_dict(convert_released_state_dict(state_dict, prefix))

    def reset_parameters(self) -> None:
        """As :meth:`~visionpe.base.PositionEncoding.reset_parameters`, with the batch norm's running statistics
        back at their start (meta-device initialisation leaves them uninitialised)."""
        super().reset_parameters()
        if self.context_source == "image":
            self.context_norm.reset_running_stats()

    def no_weight_decay(self) -> set[str]:
        """Every parameter (as the released training excludes the module from decay; decay would pull the learned
        offsets back to the curve's positions)."""
        return {name for name, _ in self.named_parameters()}
