"""Mixed-resolution (NaFlex) batches: the model-side steps shared by :class:`~visionpe.models.vit.VisionPEViT` and the
NaFlexVit that :func:`~visionpe.integrations.timm_swap.apply_position_scheme` converts.

A batch in timm's NaFlex layout is ``patches`` (B, N, P*P*C), ``patch_coord`` (B, N, 2) and ``patch_valid`` (B, N),
as a dict (timm's ``NaFlexCollator``) or as three tensors; each sample is a grid of its own size, its patches first
in raster order, padding after (:func:`~visionpe.grid.mixed_grid`). The model then

1. embeds the patches (:func:`embed_patches`: the patch embedding's convolution applied to each flattened patch);
2. applies each absolute scheme group by group, to the valid tokens of the samples sharing a grid, at that grid
   (:func:`apply_per_grid`): a learned table is resampled once per grid, CPE's PEG convolves each image on its own
   grid;
3. builds the position context (:func:`build_mixed_position_context`): rotary schemes with per-token cos/sin
   tables get per-sample coordinates, each image's at its own grid, and attention runs once over the padded batch
   with the padding keys masked; with any other scheme in attention, one context per distinct grid, which the
   attention runs group by group (:class:`~visionpe.attention.GridGroup`);
4. pools over the valid tokens only (:func:`pool_valid`).

So an image's outputs in a mixed batch are those of the image alone, for every scheme.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from timm.models.naflexvit import create_attention_mask, global_pool_naflex
from torch import nn

from ..attention import GridGroup, PositionContext
from ..checks import describe
from ..grid import MixedGrid, mixed_grid, validate_count
from .context import build_position_context

__all__ = [
    "NAFLEX_KEYS",
    "apply_per_grid",
    "build_mixed_position_context",
    "embed_patches",
    "naflex_inputs",
    "pool_valid",
]

#: the keys of a NaFlex batch dict (timm's ``NaFlexCollator``) the models read; ``seq_len`` is ignored
NAFLEX_KEYS = ("patches", "patch_coord", "patch_valid")


def naflex_inputs(
    x: torch.Tensor | Mapping[str, Any],
    patch_coord: torch.Tensor | None = None,
    patch_valid: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    unflattened: bool = False,
) -> tuple[torch.Tensor, MixedGrid] | None:
    """``(patches, layout)`` of a NaFlex batch given as a dict (timm's ``NaFlexCollator``: ``patches``,
    ``patch_coord``, ``patch_valid``; its entries take priority over the arguments, as in timm's ``NaFlexVit``) or as
    ``patches`` with ``patch_coord`` and ``patch_valid``; None for an ordinary batch (a tensor without
    ``patch_coord``). ``unflattened``: also take patches (B, N, Ph, Pw, C) (or (B, N, C, Ph, Pw)), which timm's
    NaFlexVit embeds with a variable patch size.

    Raises:
        TypeError: ``patches`` is not a floating-point tensor.
        ValueError: a dict without ``patches``, ``patch_coord`` without ``patch_valid`` (or the reverse), patches
            that are not (B, N, D) with the coordinates' B and N, an ``attn_mask`` (the padding mask comes from
            ``patch_valid``), or what :func:`~visionpe.grid.mixed_grid` refuses.

    Example:
        >>> batch = {"patches": torch.zeros(2, 3, 48), "patch_coord": torch.zeros(2, 3, 2, dtype=torch.long),
        ...          "patch_valid": torch.tensor([[True, False, False], [True, False, False]])}
        >>> patches, layout = naflex_inputs(batch)
        >>> layout.grid_sizes
        ((1, 1), (1, 1))
    """
    if isinstance(x, Mapping):
        if "patches" not in x:
            raise ValueError(f"a NaFlex batch dict must hold 'patches' (B, N, P*P*C), got keys {sorted(x)}")
        patches = x["patches"]
        patch_coord = x.get("patch_coord", patch_coord)
        patch_valid = x.get("patch_valid", patch_valid)
        attn_mask = x.get("attn_mask", attn_mask)
    elif patch_coord is None and patch_valid is None:
        return None
    else:
        patches = x
    if patch_coord is None or patch_valid is None:
        missing = "patch_coord" if patch_coord is None else "patch_valid"
        raise ValueError(f"a NaFlex batch needs patch_coord (B, N, 2) and patch_valid (B, N), got {missing}=None")
    if attn_mask is not None:
        raise ValueError(
            "a NaFlex batch masks its padding from patch_valid (attention runs per grid on the valid tokens); "
            f"attn_mask is not taken with it, got {describe(attn_mask)}"
        )
    layout = mixed_grid(patch_coord, patch_valid)
    if not isinstance(patches, torch.Tensor) or not patches.is_floating_point():
        raise TypeError(f"patches must be a floating-point (B, N, P*P*C) tensor, got {describe(patches)}")
    ranks = (3, 5) if unflattened else (3,)
    if patches.ndim not in ranks or tuple(patches.shape[:2]) != (layout.batch_size, layout.num_patches):
        shape = "(B, N, P*P*C)" + (" or (B, N, Ph, Pw, C)" if unflattened else "")
        raise ValueError(
            f"patches must have shape {shape} with (B, N) = ({layout.batch_size}, {layout.num_patches}), as "
            f"patch_coord, got shape {tuple(patches.shape)}"
        )
    return patches, layout


def embed_patches(proj: nn.Conv2d, patches: torch.Tensor, channels_last: bool = True) -> torch.Tensor:
    """Flattened patches (B, N, ph * pw * C) -> (B, N, dim) through a patch embedding's convolution ``proj``
    (kernel = stride = the patch): each patch is one (C, ph, pw) image, so a patch embeds as it does inside its image.

    ``channels_last``: the layout of each flattened patch, (ph, pw, C) (timm's NaFlex default) or (C, ph, pw).

    Example:
        >>> proj = nn.Conv2d(3, 8, 4, stride=4)
        >>> embed_patches(proj, torch.zeros(2, 5, 48)).shape
        torch.Size([2, 5, 8])
    """
    if not isinstance(proj, nn.Conv2d):
        raise TypeError(f"proj must be the patch embedding's torch.nn.Conv2d, got {describe(proj)}")
    (ph, pw), channels = proj.kernel_size, proj.in_channels
    if tuple(proj.stride) != (ph, pw):
        raise ValueError(f"proj must have stride equal to its kernel (a patch embedding), got {proj}")
    if not isinstance(patches, torch.Tensor) or patches.ndim != 3 or patches.shape[2] != ph * pw * channels:
        shape = tuple(patches.shape) if isinstance(patches, torch.Tensor) else describe(patches)
        raise ValueError(
            f"patches must be (B, N, {ph}*{pw}*{channels} = {ph * pw * channels}) for {ph}x{pw} patches of {channels} "
            f"channels, got {shape}"
        )
    B, N, _ = patches.shape
    if channels_last:
        images = patches.reshape(B * N, ph, pw, channels).permute(0, 3, 1, 2)
    else:
        images = patches.reshape(B * N, channels, ph, pw)
    return proj(images.contiguous()).reshape(B, N, -1)


def _group_rows(layout: MixedGrid, num_prefix_tokens: int) -> list[tuple[tuple[int, ...], torch.Tensor, int]]:
    """(grid, sample indices, valid tokens incl. prefix) of each group of the layout."""
    return [(grid, index, num_prefix_tokens + layout.lengths[int(index[0])]) for grid, index in layout.groups]


def apply_per_grid(
    fn: Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor],
    x: torch.Tensor,
    layout: MixedGrid,
    num_prefix_tokens: int,
) -> torch.Tensor:
    """``fn(tokens, grid_size)`` applied to each group of samples sharing a grid, on their valid tokens only
    (``num_prefix_tokens`` + the grid's patches), and written back; padding rows are left as they are.

    ``x`` (B, num_prefix_tokens + N, C); ``fn`` maps (b, num_prefix_tokens + H W, C) tokens at ``grid_size`` to the
    same shape (an absolute scheme's forward). A batch with one grid and no padding calls ``fn`` once on ``x``.
    """
    if not callable(fn):
        raise TypeError(f"fn must be a callable (tokens, grid_size) -> tokens, got {describe(fn)}")
    if not isinstance(layout, MixedGrid):
        raise TypeError(f"layout must be a visionpe.grid.MixedGrid (from mixed_grid), got {describe(layout)}")
    validate_count(num_prefix_tokens, "num_prefix_tokens")
    expected = (layout.batch_size, num_prefix_tokens + layout.num_patches)
    if not isinstance(x, torch.Tensor) or x.ndim != 3 or tuple(x.shape[:2]) != expected:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else describe(x)
        raise ValueError(
            f"x must be (B, P + N, C) = ({layout.batch_size}, {num_prefix_tokens} + {layout.num_patches}, C) for the "
            f"layout, got {shape}"
        )
    if layout.is_uniform:
        return fn(x, layout.groups[0][0])
    out = x
    for grid, index, length in _group_rows(layout, num_prefix_tokens):
        rows = fn(x[index, :length], grid)
        tokens = torch.arange(length, device=x.device)[:, None]
        out = out.index_put((index, tokens), rows.transpose(0, 1))
    return out


def _per_token_rotary(scheme: nn.Module, grids: list[tuple[int, ...]]) -> bool:
    """Whether ``scheme`` gives a mixed batch the same rotation through per-token tables as grid by grid: a scheme
    that rotates by cos/sin of coordinates times frequencies (``per_token_tables``, the
    :class:`~visionpe.rotary.base.LinearRotary` family without a basis change) whose frequencies and table
    multiplier are the same at every grid of the batch (no extrapolation mode, or one that leaves these grids
    alone); its coordinates, which may depend on the grid, are built per grid."""
    if not scheme.per_token_tables:
        return False
    first_freqs, first_scale = scheme.scaled_frequencies(grids[0])
    for grid in grids[1:]:
        freqs, scale = scheme.scaled_frequencies(grid)
        if scale != first_scale or not torch.equal(freqs, first_freqs):
            return False
    return True


def _key_mask(layout: MixedGrid, num_prefix_tokens: int) -> torch.Tensor:
    """(B, 1, 1, P + N) bool, True on the keys a token may attend to: the prefix tokens and the valid patches."""
    valid = layout.patch_valid
    prefix = valid.new_ones(valid.shape[0], num_prefix_tokens)
    return torch.cat((prefix, valid), dim=1)[:, None, None, :]


def build_mixed_position_context(
    schemes: Iterable[nn.Module], num_prefix_tokens: int, layout: MixedGrid, device: torch.device
) -> PositionContext:
    """The :class:`~visionpe.attention.PositionContext` of a mixed-resolution batch, in one of two forms:

    - one padded attention: when the schemes in attention are all rotary schemes with per-token cos/sin tables
      whose frequencies are the same at every grid of the batch (``rope_axial``, ``rope_mixed``, ``rope_dinov3``,
      ``rope_learned``, ``gridpe`` without an extrapolation mode), or there are none (absolute schemes only): each
      rotary state is prepared from per-sample coordinates (B, N, ndim), each sample's built in the scheme's own mode
      at its own grid, and ``attn_mask`` masks the padding keys (padding queries attend to the valid keys, so every
      softmax stays finite);
    - grid by grid otherwise (bias schemes, LieRE, ComRoPE, STRING, SeqPE, extrapolation modes that scale per grid):
      one :func:`~visionpe.models.context.build_position_context` per distinct grid, as
      :class:`~visionpe.attention.GridGroup` entries of ``groups``; attention runs each group on its valid tokens.

    Either gives each image the positions it has alone.

    Raises:
        TypeError: ``layout`` is not a :class:`~visionpe.grid.MixedGrid`.
        ValueError: a scheme that reads per-sample inputs beyond the patches (STRING's ``patch_depth``), which a
            NaFlex batch does not carry.
    """
    if not isinstance(layout, MixedGrid):
        raise TypeError(f"layout must be a visionpe.grid.MixedGrid (from mixed_grid), got {describe(layout)}")
    validate_count(num_prefix_tokens, "num_prefix_tokens")
    schemes = list(schemes)
    for scheme in schemes:
        if scheme.extra_inputs:
            raise ValueError(
                f"{type(scheme).__name__} reads {scheme.extra_inputs} from the model, which a mixed-resolution "
                "batch does not carry; use it with ordinary (B, C, H, W) batches"
            )
    grids = [grid for grid, _ in layout.groups]
    in_attention = [s for s in schemes if s.kind in ("rotary", "bias")]
    if not all(s.kind == "rotary" and _per_token_rotary(s, grids) for s in in_attention):
        groups = [
            GridGroup(grid, index, length, build_position_context(schemes, num_prefix_tokens, grid, device))
            for grid, index, length in _group_rows(layout, num_prefix_tokens)
        ]
        return PositionContext(groups=groups)
    ctx = PositionContext(attn_mask=None if layout.is_uniform else _key_mask(layout, num_prefix_tokens).to(device))
    batch, num_patches = layout.batch_size, layout.num_patches
    for scheme in in_attention:
        coords = None
        for grid, index in layout.groups:
            rows = scheme.model_coords(grid, device)  # (H W, ndim), in the scheme's mode at this grid
            if coords is None:
                coords = rows.new_zeros(batch, num_patches, rows.shape[-1])
            positions = torch.arange(rows.shape[0], device=rows.device)[:, None]
            coords = coords.index_put((index.to(rows.device), positions), rows[:, None].expand(-1, len(index), -1))
        ctx.rotary.append(scheme.prepare(coords, num_prefix_tokens, grid_size=grids[0]))
    return ctx


def pool_valid(
    model: nn.Module, x: torch.Tensor, patch_valid: torch.Tensor, pool_type: str | None = None
) -> torch.Tensor:
    """timm's pooling of a ViT-like ``model`` (``attn_pool``, ``global_pool``, ``num_prefix_tokens``,
    ``pool_include_prefix``) over the valid tokens of each sample of a mixed-resolution batch, as timm's NaFlexVit
    pools: ``avg`` / ``max`` / ``avgmax`` over the valid patches (prefix tokens with ``pool_include_prefix``), ``token``
    the class token, ``map`` attention pooling with the padding keys masked; ``""`` returns the tokens as they are.

    ``x`` (B, num_prefix_tokens + N, C) tokens; ``patch_valid`` (B, N) bool, True on real patches.
    """
    if not isinstance(patch_valid, torch.Tensor) or patch_valid.dtype != torch.bool or patch_valid.ndim != 2:
        raise TypeError(f"patch_valid must be a (B, N) bool tensor, got {describe(patch_valid)}")
    prefix = model.num_prefix_tokens
    include_prefix = bool(getattr(model, "pool_include_prefix", False))
    if getattr(model, "attn_pool", None) is not None:
        mask = create_attention_mask(
            patch_valid,
            num_prefix_tokens=prefix if include_prefix else 0,
            symmetric=False,
            q_len=1,
            dtype=x.dtype,
        )
        return model.attn_pool(x if include_prefix else x[:, prefix:], attn_mask=mask)
    pool_type = model.global_pool if pool_type is None else pool_type
    return global_pool_naflex(
        x, patch_valid, pool_type=pool_type, num_prefix_tokens=prefix, reduce_include_prefix=include_prefix
    )
