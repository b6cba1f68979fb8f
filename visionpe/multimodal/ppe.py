"""PPE: positional preservation embedding for token compression, and position-occupancy compression.

Huang, Jiang, Zheng, Hu, Han, Chen, "PPE: Positional Preservation Embedding for Token Compression in Multimodal
Large Language Models", ICLR 2026, arXiv 2510.22936 (MouxiaoHuang/PPE).

When visual tokens are merged (Chat-UniVi's DPC-kNN clustering in the paper, before the LLM or at cascade layers
inside it), a merged token keeps the 3-D M-RoPE ids of K of its cluster's members, its *representatives*. Its ids
are rows (3K, B, L) ordered (t_1..t_K, h_1..h_K, w_1..w_K), and the split allocation
(:func:`~visionpe.multimodal.allocation.ppe_split_allocation`) cuts every M-RoPE section into K sub-bands, sub-band
k reading representative k: the attention score is the sum over sub-bands of M-RoPE scores, each taken at its own
representative's position. Text repeats its id K times. The base ids are the dense ones (Qwen2-VL's, or
Qwen2.5-VL's absolute time with ``second_per_grid_ts``), so text keeps its dense ids and the compressed block
still spans its original positions.

Contract here: the ids are computed on the dense (uncompressed) sequence, every member of a cluster carrying its
cluster's K representatives, so that the merged token takes the column of any of its members (merging inside the
LLM keeps the dense ids of the earlier layers). ``clusters`` (B, L) gives each visual token its cluster id;
clusters are local to a visual block (image or video). Without it every token is its own cluster, which is dense
M-RoPE.

Representatives. The released ``select_pos_topk`` sorts the (cluster, weight) columns independently, so weights
play no part: it takes a cluster's members from the highest original index down, cycling when the cluster has
fewer than K members (3 members, K = 5 -> members 2, 1, 0, 2, 1); ``representatives="last"`` (default) reproduces
it. The paper speaks of K positions of the merged tokens; ``"topk_weight"`` is the library's reading of that
intent: the K members of highest ``weights`` (ties: lower index first), cycling likewise.

Occupancy compression (``occupancy=O``, the library's reading of "4096 positions -> 64 or 1"): the block's base
ids become 1-D raster ids floor(index * O / N) on all three rows, for a block of N tokens, and the next text sits
O positions after the block start (O is capped at N); O = N is plain 1-D RoPE, O = 1 puts the whole block on one
position. Representatives then pick among these ids.

The released code uses K = 8 (``ppe_k``). The library's default is K = 1, so that the ids stay (3, B, L) and work
wherever M-RoPE ids do (the Qwen-VL adapter, :class:`~visionpe.multimodal.MultimodalRotary`); K > 1 gives
(3K, B, L) ids, which :class:`~visionpe.multimodal.ppe_rotary.PPERotary` turns into cos/sin tables.
"""

from __future__ import annotations

import torch

from ..checks import check_choice, check_int, check_tensor
from .design import DesignOutput, VisualLayout
from .mrope import mrope_abs_time_design, mrope_design

__all__ = ["PPE_REPRESENTATIVES", "ppe_design"]

PPE_REPRESENTATIVES = ("last", "topk_weight")


def _per_visual_token(value: torch.Tensor, layout: VisualLayout, name: str, dtype: str, expected: str) -> torch.Tensor:
    """A (B, L) tensor option read at the N visual tokens."""
    check_tensor(value, name, dtype=dtype, expected=expected)
    if value.shape != layout.valid.shape:
        raise ValueError(
            f"{name} must have the shape of token_type_ids {tuple(layout.valid.shape)}, got {tuple(value.shape)}"
        )
    return value.to(layout.valid.device).reshape(-1).index_select(0, layout.flat)


def _base_ids(
    layout: VisualLayout,
    occupancy: int | None,
    second_per_grid_ts: torch.Tensor | list[float] | None,
    tokens_per_second: float,
    continuation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(3, N) local ids, (G,) advances and (G,) largest local id (or None) of the dense (or occupancy-compressed)
    design."""
    if occupancy is not None:
        check_int(occupancy, "occupancy", min=1, expected="a positive int or None")
        count = layout.block_thw.prod(1)
        used = count.clamp(max=occupancy)
        local = layout.index * layout.per_token(used) // layout.per_token(count)
        return local.expand(3, -1), used, (count - 1) * used // count
    if second_per_grid_ts is not None:
        base = mrope_abs_time_design(
            layout,
            second_per_grid_ts=second_per_grid_ts,
            tokens_per_second=tokens_per_second,
            continuation=continuation,
        )
    else:
        base = mrope_design(layout, continuation=continuation)
    top = None if base.block_top is None else base.block_top.round().long()
    return base.local.round().long(), base.advance.round().long(), top


def _representatives(
    layout: VisualLayout,
    clusters: torch.Tensor,
    weights: torch.Tensor | None,
    num_representatives: int,
    representatives: str,
) -> torch.Tensor:
    """(K, N) index (into the N visual tokens) of each token's cluster's k-th representative."""
    cluster = _per_visual_token(
        clusters, layout, "clusters", "integer", "a (B, L) integer tensor of cluster ids"
    ).long()
    if cluster.numel() and cluster.amin() < 0:
        n = int((cluster < 0).nonzero()[0])
        b, l = divmod(int(layout.flat[n]), layout.valid.shape[1])
        raise ValueError(
            f"clusters must be a non-negative cluster id at every visual token, got {int(cluster[n])} in sample {b} "
            f"at position {l}"
        )
    tokens = torch.arange(cluster.numel(), device=cluster.device)
    # Clusters are local to a block: the key (block, cluster id) names one cluster.
    key = layout.block * (int(cluster.max()) + 1 if cluster.numel() else 1) + cluster
    if representatives == "topk_weight":
        weight = _per_visual_token(weights, layout, "weights", "floating", "a (B, L) floating point tensor")
        if not torch.isfinite(weight).all():
            raise ValueError("weights must be finite at every visual token, got NaN or inf")
        by_weight = torch.sort(weight.double(), descending=True, stable=True).indices
        order = by_weight.index_select(0, torch.sort(key.index_select(0, by_weight), stable=True).indices)
    else:
        order = torch.sort(key, stable=True).indices  # members in increasing original index
    _, counts = torch.unique_consecutive(key.index_select(0, order), return_counts=True)
    starts = counts.cumsum(0) - counts
    group = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    slot_of = torch.empty_like(tokens)
    slot_of[order] = tokens
    token_group = group.index_select(0, slot_of)
    size, start = counts.index_select(0, token_group), starts.index_select(0, token_group)
    k = torch.arange(num_representatives, device=cluster.device)[:, None]
    if representatives == "last":
        offset = (size - 1 - k) % size  # the highest original index first, cycling
    else:
        offset = k % size  # the highest weight first, cycling
    return order.index_select(0, (start + offset).reshape(-1)).view(num_representatives, -1)


def ppe_design(
    layout: VisualLayout,
    *,
    clusters: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    num_representatives: int = 1,
    representatives: str = "last",
    occupancy: int | None = None,
    second_per_grid_ts: torch.Tensor | list[float] | None = None,
    tokens_per_second: float = 2.0,
    continuation: str = "max_plus_one",
) -> DesignOutput:
    """PPE ids (3K, B, L) on the dense sequence (see the module docstring).

    Args:
        clusters: (B, L) cluster id of every visual token (non-negative; local to its image or video; entries at
            text and padding are ignored). None: every visual token is its own cluster.
        weights: (B, L) floating point member weights, used (and required) by ``representatives="topk_weight"``.
        num_representatives: K >= 1 positions kept per token (8 released; 1 by default here, see above).
        representatives: ``"last"`` (the released code) or ``"topk_weight"`` (the library's reading of the paper).
        occupancy: None (dense ids, as released) or O >= 1: each block takes at most O positions (library's
            reading).
        second_per_grid_ts, tokens_per_second: Qwen2.5-VL absolute time for videos
            (:func:`~visionpe.multimodal.mrope.mrope_abs_time_design`); None: Qwen2-VL's frame index.
        continuation: text after a block, as M-RoPE's ``continuation``.
    """
    check_int(num_representatives, "num_representatives", min=1)
    check_choice(representatives, "representatives", PPE_REPRESENTATIVES)
    if representatives == "topk_weight" and weights is None:
        raise ValueError("representatives='topk_weight' needs weights, a (B, L) tensor of member weights; got None")
    if representatives == "last" and weights is not None:
        raise ValueError(
            "weights are read by representatives='topk_weight' only; representatives='last' (the released code) "
            "ignores them, so they must be None"
        )
    if clusters is None and weights is not None:
        raise ValueError("weights need clusters: without clusters every visual token is its own cluster")
    local, advance, top = _base_ids(layout, occupancy, second_per_grid_ts, tokens_per_second, continuation)
    k = num_representatives
    if clusters is None:
        rows = local.repeat_interleave(k, dim=0)
    else:
        picks = _representatives(layout, clusters, weights, k, representatives)  # (K, N)
        rows = local[:, picks].reshape(3 * k, -1)  # (3, K, N) -> rows t_1..t_K, h_1..h_K, w_1..w_K
        top = None  # the representatives need not include the block's largest id
    return DesignOutput(
        local=rows, advance=advance, anchored=(True,) * (3 * k), delta_rows=tuple(range(3 * k)), block_top=top
    )
