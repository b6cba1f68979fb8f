"""``get_position_ids``: multimodal position ids for a batch, for any registered scheme.

Huang et al., "Revisiting Multimodal Positional Encoding in Vision-Language Models", ICLR 2026: the ids are
the position-design half of a scheme; :class:`~visionpe.multimodal.MultimodalRotary` is the allocation half.

Packed rows (``cu_seqlens=``): several samples concatenated in one row of batch size 1, as padding-free training
feeds them to FlashAttention's varlen kernels (Dao, "FlashAttention-2: Faster Attention with Better Parallelism and
Work Partitioning", ICLR 2024). Each sample gets the ids it would get alone, restarted from 0, and an extra first
row, a plain arange restarting at 0 per sample, which transformers' Qwen-VL text models read to find the sample
boundaries (block-diagonal causal mask for SDPA and eager, ``cu_seqlens`` for FlashAttention-2) while rows 1-3
drive the rotary (docs/packing.md).
"""

from __future__ import annotations

from typing import Any

import torch

from ..checks import check_choice, check_float, check_tensor
from .design import assemble_positions, parse_layout
from .registry import MultimodalScheme, get_multimodal_scheme

__all__ = ["get_position_ids", "DELTA_CONVENTIONS"]

DELTA_CONVENTIONS = ("valid", "padded")


def get_position_ids(
    scheme: str,
    token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    spatial_merge_size: int = 2,
    pad_value: float = 1,
    delta_convention: str = "valid",
    cu_seqlens: torch.Tensor | None = None,
    **scheme_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids and decoding deltas for a batch of interleaved text, images and videos.

    Vectorised over the batch: the only Python loop runs over the two modalities.

    Args:
        scheme: a name from :func:`list_multimodal_schemes` (``mrope``, ``mrope_abs_time``, ``v2pe``...).
        token_type_ids: (B, L) 0 text, 1 image, 2 video (transformers' ``mm_token_type_ids``).
        image_grid_thw: (num_images, 3) pre-merge (t, h, w) rows, in order of appearance across the batch.
        video_grid_thw: (num_videos, 3) likewise for videos.
        attention_mask: (B, L) 1 for tokens, 0 for padding; left and right padding both work.
        spatial_merge_size: m; a grid (t, h, w) covers t * (h/m) * (w/m) tokens.
        pad_value: value written at padded slots (1, as legacy Hugging Face code; transformers 5.x uses 0).
        delta_convention: ``"valid"`` (transformers 5.x): delta = next - n_valid, decode at
            cumsum(mask) - 1 + delta; ``"padded"`` (legacy): delta = next - L, decode at cache_position + delta.
        cu_seqlens: None, or for a packed row (B = 1, S samples concatenated without padding) the (S + 1,)
            integer tensor of sample boundaries as FlashAttention's varlen functions take them: 0, then the
            cumulative sample lengths, ending at L. Every sample must hold its visual blocks whole (a grid cannot
            straddle a boundary) and ``attention_mask`` must be None or all ones. Per-sample options then take one
            value per sample ((S,) or (S, K) tensors) and per-token options (PPE's ``clusters``, BiPE's
            ``input_ids``...) the packed row's (1, L) shape. See Returns.
        **scheme_kwargs: the scheme's own options, e.g. ``continuation="spatial_extent"`` (M-RoPE family),
            ``delta=0.25`` (V2PE), ``second_per_grid_ts=...`` (Qwen2.5-VL time), ``spatial_reset=True``.

    Returns:
        position_ids: (3, B, L) rows (t, h, w); int64, or float64 for schemes with fractional positions
            (v2pe, videorope, hope, circle_rope, mrope_abs_time with ``fractional_time=True``, a non-integer
            ``pad_value``): fp32 would merge V2PE's 1/256 steps above 2^16 (Ge et al., V2PE, 2024), fp64 keeps them
            distinct at 1M tokens. :class:`~visionpe.multimodal.MultimodalRotary` takes their angles in fp64.
            With ``cu_seqlens``: (1 + R, 1, L), R the scheme's rows (3, or 3K for PPE with K representatives):
            row 0 is 0, 1, 2, ... restarting at every sample (integral also when the dtype is float64), rows 1..R
            each sample's own ids as if it were alone, restarted from 0. This is the (4, 1, L) layout that
            transformers' Qwen2-VL, Qwen2.5-VL and Qwen3-VL text models take with ``attention_mask=None``.
        rope_deltas: (B, 1), same dtype; the next decoding position minus the reference length above. With
            ``cu_seqlens``: (S, 1), one per sample, each as for the sample alone.

    Raises:
        ValueError: for an unknown scheme or option or inconsistent inputs; with ``cu_seqlens``, also when it is
            not a 1-D integer tensor starting at 0, strictly increasing and ending at L, when B != 1, when
            ``attention_mask`` marks padding, or when a visual block straddles a sample boundary.

    Example:
        >>> tt = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]])
        >>> pos, delta = get_position_ids("mrope", tt, image_grid_thw=torch.tensor([[1, 4, 6]]))
        >>> pos[:, 0].tolist()
        [[0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7], [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7], [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]]
        >>> delta.tolist()
        [[-3]]

        The same sample packed after a two-token text sample:

        >>> packed = torch.cat([torch.zeros(1, 2, dtype=torch.long), tt], 1)
        >>> pos, delta = get_position_ids(
        ...     "mrope", packed, image_grid_thw=torch.tensor([[1, 4, 6]]), cu_seqlens=torch.tensor([0, 2, 13])
        ... )
        >>> pos[:, 0].tolist()[0], pos[:, 0].tolist()[2]
        ([0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [0, 1, 0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7])
        >>> delta.tolist()
        [[0], [-3]]
    """
    entry = get_multimodal_scheme(scheme)
    check_choice(delta_convention, "delta_convention", DELTA_CONVENTIONS)
    check_float(pad_value, "pad_value", expected="finite (it becomes a rotary position)", type_expected="a number")
    entry.check_options(scheme_kwargs)
    if cu_seqlens is not None:
        return _packed_position_ids(
            entry,
            token_type_ids,
            image_grid_thw,
            video_grid_thw,
            attention_mask,
            cu_seqlens,
            spatial_merge_size=spatial_merge_size,
            pad_value=pad_value,
            delta_convention=delta_convention,
            scheme_kwargs=scheme_kwargs,
        )
    layout = parse_layout(token_type_ids, image_grid_thw, video_grid_thw, attention_mask, spatial_merge_size)
    design = entry.design(layout, **scheme_kwargs)
    return assemble_positions(layout, design, pad_value=pad_value, delta_convention=delta_convention)


def check_cu_seqlens(cu_seqlens: Any, length: int, device: torch.device | None = None) -> torch.Tensor:
    """``cu_seqlens`` as an int64 tensor on ``device`` after checking it describes a packed row of ``length`` tokens.

    ValueError (a TypeError too for a non-tensor or a non-integer dtype) naming ``cu_seqlens`` unless it is a 1-D
    integer tensor of at least two entries that starts at 0, increases strictly (no empty sample) and ends at
    ``length``.
    """
    expected = "a 1-D integer tensor of sample boundaries (0, cumulative lengths..., L), as FlashAttention takes"
    check_tensor(cu_seqlens, "cu_seqlens", dtype="integer", expected=expected)
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be {expected}, with at least 2 entries; got shape {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    first, last = int(cu[0]), int(cu[-1])
    if first != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {first} (cu_seqlens = {cu.tolist()})")
    lengths = cu.diff()
    if (lengths <= 0).any():
        i = int((lengths <= 0).nonzero()[0])
        raise ValueError(
            f"cu_seqlens must increase strictly (every sample holds at least one token), got "
            f"cu_seqlens[{i}] = {int(cu[i])} then cu_seqlens[{i + 1}] = {int(cu[i + 1])}"
        )
    if last != length:
        raise ValueError(f"cu_seqlens must end at the packed row's length L = {length}, got {last}")
    return cu


def packed_segments(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For checked boundaries (S + 1,): each token's sample (L,), its offset inside it (L,), and the longest sample.

    Token l of the packed row sits at (sample, offset) of an (S, longest) right-padded batch; ``sample * longest +
    offset`` is its flat index there.
    """
    length = int(cu_seqlens[-1])
    positions = torch.arange(length, device=cu_seqlens.device)
    sample = torch.searchsorted(cu_seqlens[1:], positions, right=True)
    offset = positions - cu_seqlens.index_select(0, sample)
    return sample, offset, int(cu_seqlens.diff().max())


def _scatter_rows(values: torch.Tensor, flat: torch.Tensor, num_samples: int, longest: int) -> torch.Tensor:
    """(1, L) -> (S, longest): the packed row's entries at ``flat``, zeros (False) at the padding."""
    out = values.new_zeros(num_samples * longest)
    out.index_copy_(0, flat, values.reshape(-1))
    return out.view(num_samples, longest)


def _packed_position_ids(
    entry: MultimodalScheme,
    token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    cu_seqlens: Any,
    *,
    spatial_merge_size: int,
    pad_value: float,
    delta_convention: str,
    scheme_kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``get_position_ids`` for a packed row: the samples are laid out as a right-padded (S, longest) batch,
    which the ordinary vectorised path handles in one call, and read back at the packed positions.

    A design can read anything about its sample (block ranks, separators, the sample's own options), so running it
    on the samples as a batch gives each sample exactly its stand-alone ids with no rule of the design restated
    here. Cost: O(S * longest) instead of O(L), at most S times the packed row.
    """
    check_tensor(token_type_ids, "token_type_ids", expected="a (1, L) tensor (one packed row)")
    if token_type_ids.ndim != 2 or token_type_ids.shape[0] != 1:
        raise ValueError(
            "token_type_ids must be one packed row of shape (1, L) when cu_seqlens is given, got shape "
            f"{tuple(token_type_ids.shape)}"
        )
    device = token_type_ids.device
    length = token_type_ids.shape[1]
    cu = check_cu_seqlens(cu_seqlens, length, device)
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != token_type_ids.shape:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask
            raise ValueError(f"attention_mask must be None or a (1, {length}) tensor of ones, got {shape}")
        if (attention_mask != 1).any():
            l = int((attention_mask[0] != 1).nonzero()[0])
            raise ValueError(
                f"attention_mask must be None or all ones with cu_seqlens (a packed row has no padding), got "
                f"{attention_mask[0, l].item()} at position {l}"
            )
    sample, offset, longest = packed_segments(cu)
    num_samples = cu.numel() - 1
    flat = sample * longest + offset
    types = _scatter_rows(token_type_ids, flat, num_samples, longest)
    mask = _scatter_rows(torch.ones_like(token_type_ids, dtype=torch.long), flat, num_samples, longest)
    options = {
        name: _scatter_rows(value, flat, num_samples, longest)
        if isinstance(value, torch.Tensor) and value.shape == token_type_ids.shape
        else value
        for name, value in scheme_kwargs.items()
    }
    layout = parse_layout(types, image_grid_thw, video_grid_thw, mask, spatial_merge_size)
    design = entry.design(layout, **options)
    positions, deltas = assemble_positions(layout, design, pad_value=pad_value, delta_convention=delta_convention)
    rows = positions.reshape(positions.shape[0], -1).index_select(1, flat)
    restart = offset.to(rows.dtype)[None]
    return torch.cat([restart, rows])[:, None], deltas
