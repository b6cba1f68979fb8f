"""RoPE-DHR: rotary positions for dynamic high-resolution tiles that reuse the thumbnail's ids.

Liu, Su, Zhu, Wang, Dai, "CoMemo: LVLMs Need Image Context with Image Memory", ICML 2025, arXiv 2506.06279
(LALBJ/CoMemo).

An InternVL-style image is cut into X columns x Y rows of tiles and, when X * Y > 1, followed by a thumbnail of
the whole image; every tile and the thumbnail give H' x W' tokens (16 x 16 in InternVL). With p the id of the
block's first token:

- thumbnail token (r, c) -> p + W' r + c (the raster ids of one tile);
- token (r, c) of tile (i, j) (column i, row j) -> p + W' floor(y_r) + floor(x_c), where
  x_c = linspace(i w, (i + 1) w, W')[c], y_r = linspace(j h, (j + 1) h, H')[r], w = W'/X - 1e-6,
  h = H'/Y - 1e-6: each tile token takes the id of the thumbnail token that covers the same part of the image;
- the next text sits at p + H' W', so an image uses H' W' ids whatever its tile count, and a later image starts
  H' W' ids per earlier tile lower than under 1-D RoPE.

With X = Y = 1 (no thumbnail) the ids are the arange. Ids are integers, one row broadcast to (t, h, w).

Layout convention of this library: an image's row of ``image_grid_thw`` is (T, h, w) with T = X Y + 1 tiles of
h x w pre-merge patches (the X Y tiles in the order the processor emits them, row-major, then the thumbnail),
or T = 1 for an untiled image; ``tile_grid`` gives each image's (X, Y). Blocks without a tile grid (videos, or
every block when ``tile_grid`` is None) get plain 1-D ids (a video's frames are untiled images one after the
other), which is this library's reading: the paper covers tiled images only.

Where the released code and the paper differ, the code is followed (``tile_order="official"``): its loop
``for i in range(X): for j in range(Y)`` enumerates tiles column-major while the tiles arrive row-major, so for
X, Y > 1 a tile receives the ids of another tile's region (the top-right tile gets the bottom-left ids);
``tile_order="row_major"`` matches each tile with its own region. The 1e-6 shrink, also kept, starts every tile
after the first one column (row) early: tile 1 of X = 2 begins at id 7, not 8.
"""

from __future__ import annotations

import torch

from ..checks import check_choice
from .design import DesignOutput, VisualLayout

__all__ = ["TILE_ORDERS", "rope_dhr_design"]

TILE_ORDERS = ("official", "row_major")
_SHRINK = 1e-6  # the released code's margin on the tile width and height


def _check_tile_grid(tile_grid, layout: VisualLayout) -> torch.Tensor:
    """(num_images, 2) int64 (X, Y) per image; ValueError/TypeError naming ``tile_grid`` otherwise."""
    num_images = layout.num_images
    device = layout.block_thw.device
    if not isinstance(tile_grid, torch.Tensor):
        try:
            tile_grid = torch.as_tensor(tile_grid)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(
                f"tile_grid must be a (num_images, 2) integer tensor of (X columns, Y rows), got "
                f"{type(tile_grid).__name__}"
            ) from err
    if tile_grid.is_floating_point() or tile_grid.is_complex() or tile_grid.dtype == torch.bool:
        raise TypeError(f"tile_grid must hold integers (X columns, Y rows), got dtype {tile_grid.dtype}")
    if tile_grid.ndim != 2 or tile_grid.shape != (num_images, 2):
        raise ValueError(
            f"tile_grid must have shape (num_images, 2) = ({num_images}, 2), one (X columns, Y rows) per row of "
            f"image_grid_thw, got {tuple(tile_grid.shape)}"
        )
    tile_grid = tile_grid.to(device=device, dtype=torch.long)
    if tile_grid.numel() and tile_grid.amin() < 1:
        g = int((tile_grid < 1).any(1).nonzero()[0])
        raise ValueError(f"tile_grid[{g}] must be two positive ints (X columns, Y rows), got {tile_grid[g].tolist()}")
    tiles = tile_grid.prod(1)
    expected = torch.where(tiles > 1, tiles + 1, torch.ones_like(tiles))
    given = layout.block_thw[:num_images, 0]
    if (expected != given).any():
        g = int((expected != given).nonzero()[0])
        x, y = tile_grid[g].tolist()
        height, width = layout.block_thw[g, 1:].tolist()
        raise ValueError(
            f"tile_grid[{g}] = ({x}, {y}) needs image_grid_thw[{g}] to hold {int(expected[g])} tiles of "
            f"{height}x{width} merged tokens (X*Y tiles plus the thumbnail when X*Y > 1) as its t, i.e. "
            f"{int(expected[g]) * height * width} image tokens, got t = {int(given[g])} "
            f"({int(given[g]) * height * width} tokens)"
        )
    return tile_grid


def _linspace_floor(start: torch.Tensor, stop: torch.Tensor, index: torch.Tensor, num: torch.Tensor) -> torch.Tensor:
    """floor(numpy.linspace(start, stop, num)[index]) in float64, elementwise (numpy's rule: start + index * step,
    the last entry exactly ``stop``)."""
    step = (stop - start) / (num - 1).clamp(min=1).double()
    value = torch.where(index == num - 1, stop, start + index.double() * step)
    return value.floor().long()


def rope_dhr_design(
    layout: VisualLayout, *, tile_grid: torch.Tensor | None = None, tile_order: str = "official"
) -> DesignOutput:
    """RoPE-DHR ids (see the module docstring for the rule and the layout convention).

    Args:
        tile_grid: (num_images, 2) (X columns, Y rows) of each image, InternVL's ``target_aspect_ratio``, in the
            order of ``image_grid_thw``; image g then needs t = X*Y + 1 in ``image_grid_thw[g]`` (X*Y tiles and
            the thumbnail) or t = 1 when X = Y = 1. None: every block gets plain 1-D ids.
        tile_order: ``"official"`` (default; the released code's column-major enumeration, for checkpoint
            compatibility) or ``"row_major"`` (each tile gets the ids of its own region).
    """
    check_choice(tile_order, "tile_order", TILE_ORDERS)
    height = layout.per_token(layout.block_thw[:, 1])
    width = layout.per_token(layout.block_thw[:, 2])
    # Untiled blocks: the raster index inside the block, i.e. plain 1-D ids.
    local = layout.index.clone()
    if tile_grid is not None:
        grid = _check_tile_grid(tile_grid, layout)
        per_block = torch.ones(layout.num_blocks, 2, dtype=torch.long, device=grid.device)
        per_block[: layout.num_images] = grid
        cols, rows = layout.per_token(per_block[:, 0]), layout.per_token(per_block[:, 1])
        tiles = cols * rows
        slot = layout.frame
        tiled = (tiles > 1) & (slot < tiles)  # tile tokens; the thumbnail (slot == tiles) keeps its raster ids
        if tile_order == "official":
            col_i, row_j = slot // rows, slot % rows
        else:
            col_i, row_j = slot % cols, slot // cols
        tile_w = width.double() / cols - _SHRINK
        tile_h = height.double() / rows - _SHRINK
        x = _linspace_floor(col_i * tile_w, (col_i + 1) * tile_w, layout.col, width)
        y = _linspace_floor(row_j * tile_h, (row_j + 1) * tile_h, layout.row, height)
        thumbnail = layout.row * width + layout.col
        local = torch.where(tiled, y * width + x, torch.where(tiles > 1, thumbnail, local))
        advance = torch.where(per_block.prod(1) > 1, layout.block_thw[:, 1] * layout.block_thw[:, 2], 0)
    else:
        advance = torch.zeros(layout.num_blocks, dtype=torch.long, device=local.device)
    # Untiled blocks advance by their token count; tiled images by one tile's (the thumbnail's) H' W'.
    advance = torch.where(advance > 0, advance, layout.block_thw.prod(1))
    # The largest id is the last raster id: the thumbnail's (tiled) or the last token's (untiled).
    return DesignOutput(local=local.expand(3, -1), advance=advance, block_top=advance - 1)
