"""Splitting a sequence's tokens, ids, coordinates and masks across P sequence-parallel ranks, and joining them back.

A sequence of ``num_tokens`` tokens (one image's prefix and patches, a video, or several samples packed in one row
with ``cu_seqlens``) is cut into P shards along the token dimension:

- ``"contiguous"``: rank r holds tokens [r N / P, (r + 1) N / P);
- ``"zigzag"``: the sequence is cut into 2P chunks and rank r holds chunks r and 2P - 1 - r, so that with causal
  attention every rank has the same number of (query, key) pairs to compute (ring attention's load balance).

:func:`shard_sequence` returns a :class:`SequenceShard`: the global indices of the tokens a rank holds, in its local
order, and, for a packed row, the samples seen globally and locally. Every per-token tensor is cut with
:func:`shard_tensor` along its token dimension, whatever comes before it: activations (B, N, C), coordinates (N, 2),
masks (B, N), M-RoPE's (3, B, N) ids or the packed (4, 1, N) ids. :func:`merge_shards` puts the P shards back in
the original order (the inverse, in one process); :func:`~visionpe.parallel.collectives.gather_sequence` does the
same across the ranks of a process group.

A position is a property of the global token: a rank rotates its tokens by their own global positions and builds
a bias block from the global coordinates of its queries and of the keys it receives, so a shard is encoded exactly
as the same tokens in the unsharded sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_choice, check_instance, check_int, check_tensor

__all__ = ["LAYOUTS", "SequenceShard", "merge_shards", "shard_indices", "shard_sequence", "shard_tensor"]

LAYOUTS = ("contiguous", "zigzag")


def _check_split(num_tokens: int, world_size: int, layout: str) -> None:
    check_int(num_tokens, "num_tokens", min=1)
    check_int(world_size, "world_size", min=1)
    check_choice(layout, "layout", LAYOUTS)
    parts = world_size if layout == "contiguous" else 2 * world_size
    if num_tokens % parts:
        what = "world_size" if layout == "contiguous" else "2 * world_size (zigzag cuts 2P chunks)"
        raise ValueError(
            f"num_tokens must be divisible by {what} = {parts} for layout={layout!r}, got num_tokens={num_tokens}; "
            "pad the sequence to a multiple (padding tokens in a sample of their own with cu_seqlens)"
        )


def shard_indices(num_tokens: int, world_size: int, rank: int, layout: str = "contiguous") -> torch.Tensor:
    """int64 (num_tokens / world_size,) global indices of the tokens rank ``rank`` holds, in its local order.

    Args:
        num_tokens: length N of the full sequence.
        world_size: number P of sequence-parallel ranks; P (contiguous) or 2P (zigzag) must divide N.
        rank: the rank, in [0, P).
        layout: ``"contiguous"`` or ``"zigzag"`` (chunks r and 2P - 1 - r of 2P).

    Example:
        >>> shard_indices(8, 2, 0, "zigzag").tolist()
        [0, 1, 6, 7]
    """
    _check_split(num_tokens, world_size, layout)
    check_int(rank, "rank", min=0, max=world_size - 1)
    if layout == "contiguous":
        size = num_tokens // world_size
        return torch.arange(rank * size, (rank + 1) * size)
    size = num_tokens // (2 * world_size)
    first, second = rank, 2 * world_size - 1 - rank
    return torch.cat((torch.arange(first * size, (first + 1) * size), torch.arange(second * size, (second + 1) * size)))


def _check_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    check_tensor(cu_seqlens, "cu_seqlens", dtype="integer")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            "cu_seqlens must be 1-D with the start of every packed sample and the total length, (S + 1,), "
            f"got shape {tuple(cu_seqlens.shape)}"
        )
    values = cu_seqlens.detach().cpu().long()
    if values[0] != 0 or values[-1] != num_tokens or bool((values[1:] <= values[:-1]).any()):
        raise ValueError(
            f"cu_seqlens must rise strictly from 0 to num_tokens={num_tokens} (every sample non-empty), "
            f"got {values.tolist()}"
        )
    return values


@dataclass(frozen=True)
class SequenceShard:
    """What rank ``rank`` of ``world_size`` holds of a sequence of ``num_tokens`` tokens cut by ``layout``.

    Attributes:
        rank, world_size, num_tokens, layout: as given to :func:`shard_sequence`.
        index: int64 (N / P,) global indices of the local tokens, in local order.
        cu_seqlens: int64 (S + 1,) global boundaries of the packed samples (None: one sample).
        local_cu_seqlens: int64 boundaries of the runs of local tokens that are consecutive in the sequence and in
            one sample: the rank's local view of the packed samples (varlen kernels over the local tokens take it);
            None without ``cu_seqlens``.
        segment_ids: int64 (N,) the packed sample of every global token (zeros for one sample).
    """

    rank: int
    world_size: int
    num_tokens: int
    layout: str
    index: torch.Tensor
    cu_seqlens: torch.Tensor | None
    local_cu_seqlens: torch.Tensor | None
    segment_ids: torch.Tensor

    @property
    def local_tokens(self) -> int:
        """N / P, the tokens each rank holds."""
        return self.num_tokens // self.world_size

    def indices_of(self, rank: int) -> torch.Tensor:
        """The global indices rank ``rank`` of the same split holds (what arrives from it in a ring or a gather)."""
        return shard_indices(self.num_tokens, self.world_size, rank, self.layout)

    @property
    def gathered_order(self) -> torch.Tensor:
        """int64 (N,) global index of each token when the shards of ranks 0..P-1 are concatenated."""
        return torch.cat([self.indices_of(r) for r in range(self.world_size)])

    @property
    def local_segment_ids(self) -> torch.Tensor:
        """int64 (N / P,) the packed sample of every local token."""
        return self.segment_ids[self.index]

    def to(self, device: torch.device | str) -> SequenceShard:
        """The same shard with its tensors on ``device``."""
        move = {
            name: None if getattr(self, name) is None else getattr(self, name).to(device)
            for name in ("index", "cu_seqlens", "local_cu_seqlens", "segment_ids")
        }
        return SequenceShard(self.rank, self.world_size, self.num_tokens, self.layout, **move)


def shard_sequence(
    num_tokens: int,
    world_size: int,
    rank: int,
    layout: str = "contiguous",
    cu_seqlens: torch.Tensor | None = None,
) -> SequenceShard:
    """The :class:`SequenceShard` of rank ``rank``: its global token indices and its view of the packed samples.

    Args:
        num_tokens: length N of the full (packed) sequence.
        world_size: number P of sequence-parallel ranks.
        rank: this rank, in [0, P).
        layout: ``"contiguous"`` or ``"zigzag"``.
        cu_seqlens: int (S + 1,) cumulative lengths of the samples packed in the row (0, ..., N), or None.

    Example:
        >>> shard = shard_sequence(8, 2, 1, "zigzag", cu_seqlens=torch.tensor([0, 3, 8]))
        >>> shard.index.tolist(), shard.local_cu_seqlens.tolist()
        ([2, 3, 4, 5], [0, 1, 4])
    """
    index = shard_indices(num_tokens, world_size, rank, layout)
    if cu_seqlens is None:
        return SequenceShard(rank, world_size, num_tokens, layout, index, None, None, torch.zeros(num_tokens).long())
    bounds = _check_cu_seqlens(cu_seqlens, num_tokens)
    lengths = bounds[1:] - bounds[:-1]
    segments = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    local = segments[index]
    # a new local run where the sample changes or the next local token is not the next global one (zigzag's seam)
    breaks = (local[1:] != local[:-1]) | (index[1:] != index[:-1] + 1)
    starts = torch.cat((torch.zeros(1).long(), torch.nonzero(breaks).flatten() + 1, torch.tensor([index.numel()])))
    return SequenceShard(rank, world_size, num_tokens, layout, index, bounds, starts, segments)


def _check_dim(x: torch.Tensor, dim: int, name: str) -> int:
    if x.ndim == 0:
        raise ValueError(f"{name} must have a token dimension, got a 0-d tensor")
    check_int(dim, "dim", min=-x.ndim, max=x.ndim - 1)
    return dim % x.ndim


def shard_tensor(x: torch.Tensor, shard: SequenceShard, dim: int = -1) -> torch.Tensor:
    """The local tokens of ``x`` along its token dimension ``dim`` (differentiable: the gradient of the other ranks'
    tokens is zero here).

    ``dim=-1`` for ids and masks ((B, N), M-RoPE's (3, B, N), packed (4, 1, N)); ``dim=1`` for activations (B, N, C);
    ``dim=0`` for coordinates (N, 2).

    Example:
        >>> shard = shard_sequence(4, 2, 1)
        >>> shard_tensor(torch.arange(12).view(3, 1, 4), shard).flatten().tolist()
        [2, 3, 6, 7, 10, 11]
    """
    check_tensor(x, "x")
    check_instance(shard, "shard", SequenceShard, expected="a visionpe.parallel.SequenceShard")
    dim = _check_dim(x, dim, "x")
    if x.shape[dim] != shard.num_tokens:
        raise ValueError(
            f"x must have the shard's num_tokens={shard.num_tokens} along dim={dim}, got shape {tuple(x.shape)}"
        )
    return x.index_select(dim, shard.index.to(x.device))


def merge_shards(pieces: list[torch.Tensor] | tuple[torch.Tensor, ...], layout: str = "contiguous", dim: int = -1):
    """The inverse of :func:`shard_tensor` in one process: the shards of ranks 0..P-1 (``pieces``, in rank order)
    back in the original token order along ``dim``.

    Example:
        >>> pieces = [torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5])]
        >>> merge_shards(pieces, "zigzag").tolist()
        [0, 1, 2, 3, 4, 5, 6, 7]
    """
    check_instance(pieces, "pieces", (list, tuple), expected="a list of the ranks' shards (tensors)")
    if not pieces:
        raise ValueError("pieces must hold one shard per rank, got none")
    for r, piece in enumerate(pieces):
        check_tensor(piece, f"pieces[{r}]")
    first = pieces[0]
    dim = _check_dim(first, dim, "pieces[0]")
    if any(p.shape != first.shape for p in pieces):
        raise ValueError(f"pieces must all have one shape, got {[tuple(p.shape) for p in pieces]}")
    world_size, num_tokens = len(pieces), first.shape[dim] * len(pieces)
    order = torch.cat([shard_indices(num_tokens, world_size, r, layout) for r in range(world_size)])
    return torch.cat(list(pieces), dim).index_select(dim, torch.argsort(order).to(first.device))
