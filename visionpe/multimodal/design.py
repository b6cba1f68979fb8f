"""Position design: token types, visual grids and timing -> multimodal position ids.

The decomposition follows Huang et al., "Revisiting Multimodal Positional Encoding in Vision-Language
Models" (ICLR 2026): a scheme is a *position design* (this module and the per-scheme files) followed by a
*frequency allocation* (:mod:`visionpe.multimodal.allocation`).

Every design here shares one vectorised skeleton. Text advances a cursor by 1 per token (or by the design's
``text_advance``: BiPE's text advances only after a separator); visual block ``g``
(one row of a grid tensor) advances it by ``advance[g]``. With ``cursor`` the exclusive cumulative sum of these
increments along the sequence, a text token sits at ``cursor`` on every row and a visual token at
``cursor + local`` (rows the design anchors) or at ``local`` (rows it does not, e.g. MRoPE-I's spatial
reset). A design therefore only supplies ``local`` (rows, N) for the N visual tokens and ``advance`` per block.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property
from itertools import accumulate

import torch

from ..checks import check_int, check_tensor

__all__ = ["VisualLayout", "DesignOutput", "parse_layout", "assemble_positions", "block_max", "block_max_plus_one"]

_MODALITY = {1: ("image", "image_grid_thw"), 2: ("video", "video_grid_thw")}


class VisualLayout:
    """Where every visual token sits and which grid it belongs to (all tensors on the input's device).

    Per sample: ``valid`` and ``pad`` (B, L) masks, ``num_valid`` (B,), ``is_text`` (B, L) valid text tokens.
    Per token (N visual tokens, in (batch, position) order): ``flat`` (N,) = batch * L + position, with
    ``batch`` and ``seq`` its two parts; ``block`` (N,) id of its grid (images numbered first, then videos);
    ``index`` (N,) its flat index t*H'*W' + i*W' + j inside the merged grid and ``frame``, ``row``, ``col``
    (N,) its (t, i, j). Per block (G blocks): ``block_thw`` (G, 3) merged (T, H', W'); ``block_first`` and
    ``block_last`` (G,) its first and last token (indices into the N tokens); ``block_is_video``,
    ``block_sample``, ``block_start`` (position of its first token), ``block_video`` (row in
    ``video_grid_thw``, -1 for images). Derived fields are computed on first use.
    """

    def __init__(
        self,
        valid: torch.Tensor,
        num_valid: torch.Tensor,
        is_text: torch.Tensor,
        flat: torch.Tensor,
        block: torch.Tensor,
        index: torch.Tensor,
        block_thw: torch.Tensor,
        block_first: torch.Tensor,
        block_last: torch.Tensor,
        num_images: int,
        single_frame: bool = False,
    ) -> None:
        self.valid, self.num_valid, self.is_text = valid, num_valid, is_text
        self.flat, self.block, self.index = flat, block, index
        self.block_thw, self.block_first, self.block_last = block_thw, block_first, block_last
        self.num_images = num_images
        self._single_frame = single_frame  # every block has T = 1: frame is 0, row and col need one division

    @cached_property
    def pad(self) -> torch.Tensor:
        return ~self.valid

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.block_thw.shape[0]

    @cached_property
    def batch(self) -> torch.Tensor:
        return self.flat // self.valid.shape[1]

    @cached_property
    def seq(self) -> torch.Tensor:
        return self.flat % self.valid.shape[1]

    @cached_property
    def _frame_row_col(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Two integer divisions instead of five: q = index // W' = t * H' + i; one when every block has T = 1.
        width = self.block_thw[:, 2].index_select(0, self.block)
        q = self.index // width
        col = self.index - q * width
        if self._single_frame:
            return torch.zeros_like(q), q, col
        height = self.block_thw[:, 1].index_select(0, self.block)
        frame = q // height
        return frame, q - frame * height, col

    @property
    def frame(self) -> torch.Tensor:
        return self._frame_row_col[0]

    @property
    def row(self) -> torch.Tensor:
        return self._frame_row_col[1]

    @property
    def col(self) -> torch.Tensor:
        return self._frame_row_col[2]

    @cached_property
    def block_is_video(self) -> torch.Tensor:
        return torch.arange(self.num_blocks, device=self.flat.device) >= self.num_images

    @cached_property
    def block_video(self) -> torch.Tensor:
        ids = torch.arange(self.num_blocks, device=self.flat.device) - self.num_images
        return ids.masked_fill(ids < 0, -1)

    @cached_property
    def block_first_flat(self) -> torch.Tensor:
        """(G,) flat index (b * L + l) of each block's first token."""
        return self.flat.index_select(0, self.block_first)

    @cached_property
    def block_last_flat(self) -> torch.Tensor:
        """(G,) flat index of each block's last token."""
        return self.flat.index_select(0, self.block_last)

    @cached_property
    def block_sample(self) -> torch.Tensor:
        return self.block_first_flat // self.valid.shape[1]

    @cached_property
    def block_start(self) -> torch.Tensor:
        return self.block_first_flat % self.valid.shape[1]

    def block_ordinal(self) -> torch.Tensor:
        """(G,) rank of each block inside its sample, in order of appearance (images and videos together)."""
        starts = torch.zeros_like(self.valid, dtype=torch.long)
        starts[self.block_sample, self.block_start] = 1
        return (starts.cumsum(1) - 1)[self.block_sample, self.block_start]

    def per_token(self, block_values: torch.Tensor) -> torch.Tensor:
        """Broadcast a per-block tensor (G, ...) to the visual tokens (N, ...)."""
        return block_values.index_select(0, self.block)


@dataclass(frozen=True)
class DesignOutput:
    """What a position design returns.

    ``local`` (R, N) offsets of the visual tokens and ``advance`` (G,) cursor advance per block, int64 or
    float64. ``anchored``: per row, whether it adds the block's start cursor. ``delta_rows``: the rows whose
    maximum + 1 may lift the next decoding position above the final cursor (a video's time row under
    transformers 5.x's continuation). ``integer``: whether the ids are integral (returned as int64; else float64).
    ``text_advance``: (B, L) cursor advance of each text token, or None for 1 per text token (every design but
    BiPE, whose text advances only after a separator); entries at visual and padded tokens are ignored.
    ``block_top``: optional (G,) maximum of ``local`` over the ``delta_rows`` (all anchored) and the block's tokens,
    when the design knows it without a pass over the tokens; the deltas then need no pass over the visual tokens.
    """

    local: torch.Tensor
    advance: torch.Tensor
    anchored: tuple[bool, ...] = (True, True, True)
    delta_rows: tuple[int, ...] = (0, 1, 2)
    integer: bool = True
    text_advance: torch.Tensor | None = None
    block_top: torch.Tensor | None = None


def block_max(layout: VisualLayout, local: torch.Tensor) -> torch.Tensor:
    """(G,) max over rows and tokens of each block's ``local`` (R, N) (0 for a block without tokens)."""
    out = torch.zeros(layout.num_blocks, dtype=local.dtype, device=local.device)
    if local.numel():
        out = out.scatter_reduce(0, layout.block, local.amax(0), reduce="amax", include_self=False)
    return out


def block_max_plus_one(layout: VisualLayout, local: torch.Tensor) -> torch.Tensor:
    """(G,) max over rows and tokens of each block's ``local`` (R, N), plus one: the original Qwen2-VL rule."""
    return block_max(layout, local) + 1


def _check_grid(grid: torch.Tensor | None, name: str, spatial_merge_size: int, device: torch.device):
    if grid is None:
        return torch.zeros(0, 3, dtype=torch.long, device=device)
    if not isinstance(grid, torch.Tensor):
        try:
            grid = torch.as_tensor(grid)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"{name} must be a (num, 3) integer tensor, got {type(grid).__name__}") from err
    if grid.ndim != 2 or grid.shape[1] != 3:
        raise ValueError(f"{name} must have shape (num, 3) with rows (t, h, w), got {tuple(grid.shape)}")
    if grid.is_floating_point() or grid.is_complex() or grid.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {grid.dtype}")
    return grid.to(device=device, dtype=torch.long)


@cache
def _merge_divisor(spatial_merge_size: int, device: torch.device) -> torch.Tensor:
    """(3,) divisors (1, m, m) of a (t, h, w) row; shared, never written to."""
    return torch.tensor([1, spatial_merge_size, spatial_merge_size], dtype=torch.long, device=device)


def _check_grid_values(
    image: torch.Tensor, video: torch.Tensor, spatial_merge_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both grids as one (G, 3) tensor and its merged (T, H', W'); a row that is not positive or not divisible
    raises ValueError."""
    grids = torch.cat([image, video]) if len(video) else image
    divisor = _merge_divisor(spatial_merge_size, grids.device)
    merged = grids // divisor
    # Positive with h and w divisible by m exactly when every merged entry is >= 1 and scales back to the row.
    if grids.numel() and (int(merged.amin()) < 1 or not torch.equal(merged * divisor, grids)):
        bad = (grids <= 0).any(1) | (grids[:, 1:] % spatial_merge_size != 0).any(1)
        g = int(bad.nonzero()[0])
        name, row = ("image_grid_thw", g) if g < len(image) else ("video_grid_thw", g - len(image))
        raise ValueError(
            f"{name}[{row}] = {tuple(grids[g].tolist())} must be positive with h and w divisible by "
            f"spatial_merge_size={spatial_merge_size}"
        )
    return grids, merged


def _run_length(types: torch.Tensor, valid: torch.Tensor, start: int) -> int:
    """Tokens of ``types[start]``'s type from ``start`` on, before another valid type interrupts them."""
    kind, count = int(types[start]), 0
    for value, keep in zip(types[start:].tolist(), valid[start:].tolist(), strict=True):
        if keep and value != kind:
            break
        count += int(keep)
    return count


def parse_layout(
    token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    spatial_merge_size: int,
) -> VisualLayout:
    """Validate the inputs and assign every visual token to its grid, for the whole batch at once.

    Args:
        token_type_ids: (B, L) 0 text, 1 image, 2 video.
        image_grid_thw, video_grid_thw: (num, 3) pre-merge (t, h, w), in order of appearance across the batch.
        attention_mask: (B, L) 1 for tokens, 0 for padding (left or right), or None.
        spatial_merge_size: m; the LLM sees T * (h/m) * (w/m) tokens per grid.

    Grids are consumed in order, each by the next ``T*H'*W'`` tokens of its modality; a grid whose tokens are
    not one consecutive run of one sample raises ValueError naming the grid and the sample.
    """
    check_tensor(token_type_ids, "token_type_ids", expected="a (B, L) tensor")
    if token_type_ids.ndim != 2 or token_type_ids.is_floating_point() or token_type_ids.is_complex():
        raise ValueError(
            f"token_type_ids must be a (B, L) integer tensor, got shape {tuple(token_type_ids.shape)} "
            f"and dtype {token_type_ids.dtype}"
        )
    if 0 in token_type_ids.shape:
        raise ValueError(
            f"token_type_ids must hold at least one sample and one token, got shape {tuple(token_type_ids.shape)}"
        )
    check_int(spatial_merge_size, "spatial_merge_size", min=1)
    device = token_type_ids.device
    types = token_type_ids if token_type_ids.dtype == torch.long else token_type_ids.long()
    # Full reductions (min(), max()): on some CPUs int64 amin() takes several times as long as min() on (B, L).
    lowest, highest = int(types.min()), int(types.max())
    if lowest < 0 or highest > 2:
        b, l = ((types < 0) | (types > 2)).nonzero()[0].tolist()
        raise ValueError(
            f"token_type_ids must be 0 (text), 1 (image) or 2 (video); sample {b} has {int(types[b, l])} "
            f"at position {l}"
        )
    batch_size, seq_len = types.shape
    if attention_mask is None:
        valid = torch.ones_like(types, dtype=torch.bool)
        num_valid = torch.full((batch_size,), seq_len, dtype=torch.long, device=device)
        visual = types.bool()  # types are 0, 1 or 2
    else:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != types.shape:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask
            raise ValueError(
                f"attention_mask must be a (B, L) tensor like token_type_ids {tuple(types.shape)}, got {shape}"
            )
        if attention_mask.dtype == torch.bool:
            binary = True
        elif attention_mask.is_floating_point() or attention_mask.is_complex():
            binary = not ((attention_mask != 0) & (attention_mask != 1)).any()  # NaN included
        else:  # integers: their minimum and maximum tell 0/1 apart from anything else
            binary = int(attention_mask.min()) >= 0 and int(attention_mask.max()) <= 1
        if not binary:
            not_binary = (attention_mask != 0) & (attention_mask != 1)
            b, l = not_binary.nonzero()[0].tolist()
            raise ValueError(
                f"attention_mask must hold 1 (token) or 0 (padding), got {attention_mask[b, l].item()} in sample {b} "
                f"at position {l}"
            )
        valid = attention_mask.to(device=device, dtype=torch.bool)
        # A 0/1 integer mask sums faster than its bool copy.
        num_valid = valid if attention_mask.is_floating_point() or attention_mask.is_complex() else attention_mask
        num_valid = num_valid.sum(1).to(device=device, dtype=torch.long)
        if int(num_valid.amin()) == 0:
            b = int((num_valid == 0).nonzero()[0])
            raise ValueError(
                f"attention_mask marks every token of sample {b} as padding; each sample needs at least one token"
            )
        visual = types.bool().logical_and_(valid)
    image = _check_grid(image_grid_thw, "image_grid_thw", spatial_merge_size, device)
    video = _check_grid(video_grid_thw, "video_grid_thw", spatial_merge_size, device)
    # Flat (b * L + l) indices: 1-D gathers are much cheaper than 2-D advanced indexing.
    flat = visual.view(-1).nonzero().squeeze(1)
    num_tokens = len(flat)
    # One stream of visual tokens: all image tokens (in batch order), then all video tokens, consumed by the
    # image grids followed by the video grids.
    grids, merged = _check_grid_values(image, video, spatial_merge_size)
    counts = merged.prod(1)
    ends = counts.cumsum(0)
    starts = ends - counts
    num_images = len(image)
    single_frame = False
    arange = torch.arange(num_tokens, device=device)
    if len(video) == 0 and highest < 2:
        # Images only (the common case): the stream is the token order itself.
        expected, frames = (ends[-1:].tolist() or [0]), merged[:, 0].amax().tolist() if len(merged) else 1
        if num_tokens != expected[0]:
            masked = types.masked_fill(~valid, -1)
            _raise_count_error(
                masked,
                flat,
                arange >= 0,
                counts.tolist(),
                image,
                video,
                image_grid_thw,
                video_grid_thw,
                spatial_merge_size,
            )
        single_frame = frames == 1
        stream, first, last = arange, starts, ends - 1
    else:
        counts_list = counts.tolist()
        is_image = types.view(-1).index_select(0, flat) == 1
        num_image_tokens = int(is_image.sum())
        expected = (sum(counts_list[:num_images]), sum(counts_list[num_images:]))
        if (num_image_tokens, num_tokens - num_image_tokens) != expected:
            masked = types.masked_fill(~valid, -1)
            _raise_count_error(
                masked, flat, is_image, counts_list, image, video, image_grid_thw, video_grid_thw, spatial_merge_size
            )
        image_rank = is_image.cumsum(0) - 1
        stream = torch.where(is_image, image_rank, arange - image_rank - 1 + num_image_tokens)
        token_of = torch.empty_like(stream)
        token_of[stream] = arange
        first, last = token_of.index_select(0, starts), token_of.index_select(0, ends - 1)
    if single_frame or len(video) == 0:
        # The stream is the token order: block g holds tokens starts[g]..ends[g] - 1.
        block = torch.repeat_interleave(torch.arange(len(counts), device=device), counts, output_size=num_tokens)
    else:
        block = torch.searchsorted(ends, stream, right=True)
    index = stream - starts.index_select(0, block)
    # A grid must be one consecutive run of one sample. Quick test: its first and last tokens sit in one row,
    # count - 1 slots apart. Only when that fails (a mask with holes) compare ranks among valid tokens.
    first_flat, last_flat = flat.index_select(0, first), flat.index_select(0, last)
    consecutive = torch.equal(last_flat - first_flat, counts - 1) and torch.equal(
        first_flat // seq_len, last_flat // seq_len
    )
    split = None
    if not consecutive:
        rank = valid.cumsum(1).view(-1)
        key = rank.index_select(0, flat) + (flat // seq_len) * (seq_len + 1)
        split = key.index_select(0, last) - key.index_select(0, first) != counts - 1
    if split is not None and split.any():
        g = int(split.nonzero()[0])
        modality = 1 if g < num_images else 2
        name, arg = _MODALITY[modality]
        b, l = divmod(int(flat[first[g]]), seq_len)
        row = g if modality == 1 else g - num_images
        masked = types.masked_fill(~valid, -1)
        raise ValueError(
            f"{arg}[{row}] = {tuple((image if modality == 1 else video)[row].tolist())} "
            f"needs {int(counts[g])} consecutive {name} tokens from position {l} of sample {b}, but that run of "
            f"{name} tokens ends after {_run_length(masked[b], valid[b], l)}"
        )
    is_text = valid.logical_xor(visual)  # visual tokens are valid ones
    layout = VisualLayout(
        valid, num_valid, is_text, flat, block, index, merged, first, last, num_images, single_frame=single_frame
    )
    layout.block_first_flat, layout.block_last_flat = first_flat, last_flat
    return layout


def _raise_count_error(types, flat, is_image, counts, image, video, image_given, video_given, merge) -> None:
    """ValueError naming the grid and the sample where a modality's tokens and grids stop matching."""
    seq_len = types.shape[1]
    num_images = len(image)
    for modality, grid, grid_counts, selected, given in (
        (1, image, counts[:num_images], is_image, image_given),
        (2, video, counts[num_images:], ~is_image, video_given),
    ):
        name, arg = _MODALITY[modality]
        positions = flat[selected].tolist()
        total, num_tokens = sum(grid_counts), len(positions)
        if num_tokens > total:
            b, l = divmod(positions[total], seq_len)
            if not len(grid):
                raise ValueError(
                    f"sample {b} has {name} tokens (token type {modality}) from position {l}, but {arg} is "
                    f"{'None' if given is None else 'empty'}"
                )
            raise ValueError(
                f"sample {b} has {name} tokens from position {l} that no row of {arg} covers: {arg} has "
                f"{len(grid)} grids for {total} tokens, token_type_ids has {num_tokens} {name} tokens"
            )
        if num_tokens < total:
            ends = list(accumulate(grid_counts))
            g = next(i for i, end in enumerate(ends) if end > num_tokens)
            count = grid_counts[g]
            start = ends[g] - count
            have = num_tokens - start
            where = f"sample {positions[start] // seq_len}" if have else "the batch"
            raise ValueError(
                f"{arg}[{g}] = {tuple(grid[g].tolist())} needs {count} {name} tokens "
                f"(t * h/{merge} * w/{merge}), but {where} has only {have} left "
                f"({num_tokens} {name} tokens in all, {arg} needs {total})"
            )


def assemble_positions(
    layout: VisualLayout,
    design: DesignOutput,
    *,
    pad_value: float,
    delta_convention: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Place text and visual tokens on the cursor and compute the decoding deltas.

    Returns:
        position_ids (R, B, L), int64 if ``design.integer`` else float64 (fractional steps of 2^-8 are exact in
        fp32 only below 2^16; in fp64 they stay distinct far beyond the 1M-token contexts of V2PE, Ge et al. 2024);
        padded slots hold ``pad_value``.
        rope_deltas (B, 1): next position minus the number of valid tokens (``"valid"``, transformers 5.x:
        decode at cumsum(mask) - 1 + delta) or minus the padded length (``"padded"``, legacy: decode at
        cache_position + delta). Same dtype as position_ids.
    """
    valid = layout.valid
    batch_size, seq_len = valid.shape
    # Integral designs run in int64 end to end; the others in float64, also returned as float64.
    integer = design.integer and float(pad_value).is_integer()
    dtype = torch.long if integer else torch.float64

    def cast(values: torch.Tensor) -> torch.Tensor:
        return values.round().long() if integer and values.is_floating_point() else values.to(dtype)

    local, advance = cast(design.local), cast(design.advance)
    # Cursor increments: 1 per valid text token (or the design's text advance), the block's advance at its last
    # visual token, 0 at the other visual tokens and at padding.
    if integer and design.text_advance is None:
        # Integral ids with one position per text token: the running sum starts at -1, so that it *is* the
        # cursor at every text token (no second pass for the exclusive sum), and it runs in int32 when the ids
        # stay far below 2^31 (half the memory traffic over the (B, L) batch).
        small = abs(pad_value) < 2**30 and seq_len + (int(advance.abs().sum()) if len(advance) else 0) < 2**30
        inc = layout.is_text.to(torch.int32 if small else dtype)
        inc[:, 0] -= 1
        inc.view(-1).index_add_(0, layout.block_last_flat, advance.to(inc.dtype))
        cursor = inc.cumsum(1, dtype=inc.dtype)
        next_position = cursor[:, -1].to(dtype) + 1
        # A block's start: the sum before its last token, where the block's whole advance is added.
        block_start = cursor.view(-1).index_select(0, layout.block_last_flat).to(dtype) + 1 - advance
        start = layout.per_token(block_start)
    else:
        inc = layout.is_text.to(dtype)
        if design.text_advance is not None:
            inc = inc * design.text_advance.to(dtype)
        inc.view(-1).index_copy_(0, layout.block_last_flat, advance)
        total = inc.cumsum(1)
        next_position = total[:, -1].clone()
        cursor = total.sub_(inc)
        start = cursor.view(-1).index_select(0, layout.flat)
        block_start = None
    anchored = list(design.anchored)
    num_rows = local.shape[0]
    # Designs with one id broadcast to every row (1-D ids: V2PE, CCA, PyPE...) place one row and copy it.
    one_row = num_rows > 1 and local.stride(0) == 0 and all(anchored)
    if one_row:
        values = start + local[0]
    elif all(anchored):
        values = start + local
    else:
        values = torch.stack([start + local[r] if anchor else local[r] for r, anchor in enumerate(anchored)])
    # Next decoding position: the cursor after the last token, or one past a visual position above it (a
    # video's time row under the "spatial_extent" rule). The running sum's last entry, not ``inc.sum(1)``: a sum
    # reduces fractional advances (Circle-RoPE) in another order, so a padded row's delta differed from the same
    # row alone in the last bit.
    if values.numel():
        if design.block_top is not None and all(anchored[r] for r in design.delta_rows):
            # Per block: start + max(local) + 1, which is the maximum of start + local + 1 (rounding is monotonic).
            if block_start is None:
                block_start = cursor.view(-1).index_select(0, layout.block_first_flat)
            top = block_start + cast(design.block_top) + 1
            next_position = next_position.scatter_reduce(0, layout.block_sample, top, reduce="amax")
        else:
            if one_row:
                rows = values + 1
            else:
                rows = values if len(design.delta_rows) == num_rows else values[list(design.delta_rows)]
                rows = rows.amax(0) + 1
            next_position = next_position.scatter_reduce(0, layout.batch, rows, reduce="amax")
    reference = layout.num_valid if delta_convention == "valid" else seq_len
    deltas = (next_position - reference)[:, None]
    pad = int(pad_value) if integer else float(pad_value)
    # Row 0 is written in place (text at the cursor, pads at pad_value, and for one-row designs the visual ids),
    # then copied to the other rows: the (R, B, L) output is written once.
    positions = torch.empty(num_rows, batch_size * seq_len, dtype=dtype, device=valid.device)
    first = positions[0]
    if cursor.dtype == dtype:
        torch.where(valid.view(-1), cursor.view(-1), cursor.new_full((), pad), out=first)
    else:  # an int32 cursor
        first.copy_(torch.where(valid.view(-1), cursor.view(-1), cursor.new_full((), pad)))
    if one_row:
        first.index_copy_(0, layout.flat, values)
        positions[1:] = first
    else:
        positions[1:] = first
        positions.index_copy_(1, layout.flat, values)
    positions = positions.view(num_rows, batch_size, seq_len)
    return positions, deltas
