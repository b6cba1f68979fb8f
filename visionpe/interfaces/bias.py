"""A bias scheme's per-forward state, and the per-block bias attention asks it for.

Attention holds one :class:`BiasState` per bias scheme (:class:`~visionpe.attention.PositionContext`) and asks each
for its block's :class:`LayerBias`: channels appended to q and k, additive logits for a range of query rows, the
per-offset terms of FlexAttention, a value term from the attention probabilities. Every method has a working default
(nothing added), so attention applies every layer alike and checks no capability flag; a layer says what it needs
(``needs_probs``) and how its logits broadcast (``batch_shared``).

:class:`SchemeBias` is the state of every :class:`~visionpe.base.BiasPositionEncoding`: its scheme and the state its
``prepare`` built, as a ``(scheme, state)`` pair. Its layers turn the scheme's methods (``attn_bias``,
``augment_qk``, ``value_term``, ``fused_bias``) into the interface, and handle patch dropout inside: the full grid's
bias is computed from q and k placed back on it (dropped rows zero) and the kept rows and columns are gathered.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from ..tokens import gather_pairs, gather_tokens, scatter_pairs, scatter_tokens

__all__ = ["BiasState", "LayerBias", "OffsetBias", "OffsetGrid", "SchemeBias", "SchemeLayerBias", "offset_score_mod"]


class OffsetGrid(Protocol):
    """What a per-offset bias term reads of its state (:class:`~visionpe.bias.offsets.OffsetState` is one): a 2D
    ``grid_size`` after ``num_prefix_tokens`` prefix tokens, ``num_tokens`` in all, ``num_offsets`` table entries
    (2H - 1)(2W - 1) (entry K = ``num_offsets`` for pairs with a prefix token), and the entry of every pair."""

    grid_size: tuple[int, int]
    num_prefix_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_offsets(self) -> int: ...

    def offset_index(self, rows: Any, cols: Any) -> torch.Tensor:
        """int32 (R, C) table entry of every (query in ``rows``, key in ``cols``) pair."""
        ...


class LayerBias:
    """One block's bias for one forward. The defaults add nothing; a scheme overrides what it adds."""

    #: :meth:`value_term` reads the attention probabilities, so attention computes them explicitly
    needs_probs: bool = False
    #: :meth:`logits` depend on the positions only and have a batch dimension of 1 (query chunks are then sized for
    #: one sample's bias rather than the batch's)
    batch_shared: bool = True

    def augment_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k (B, heads, T, head_dim) with channels appended, such that q~ . k~ = q . k + sqrt(head_dim) * bias
        (attention keeps the original heads' scale); unchanged by default."""
        return q, k

    def logits(self, q: torch.Tensor, k: torch.Tensor, rows: slice | None = None) -> torch.Tensor | None:
        """Additive logits of the query ``rows`` (all for None) over every key, broadcastable to (B, heads, R, T);
        ``q`` holds those rows only. None: no logits."""
        return None

    def fused_terms(self, q: torch.Tensor, k: torch.Tensor) -> list | None:
        """The logits as per-offset terms (:class:`~visionpe.bias.offsets.OffsetBias`) for FlexAttention's
        ``score_mod``, or None where they are not a function of the grid offset (attention then runs densely)."""
        return None

    def value_term(self, attn: torch.Tensor, rows: slice | None = None) -> torch.Tensor | None:
        """Extra output (B, heads, R, head_dim) from the probabilities ``attn`` (B, heads, R, T) of the query
        ``rows``; None: none."""
        return None


class BiasState(ABC):
    """What a bias scheme builds once per forward for every block."""

    @abstractmethod
    def layer(
        self,
        index: int,
        tokens: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
        num_tokens: int = 0,
    ) -> LayerBias:
        """Block ``index``'s bias. ``tokens`` (B, T, C): the block's normalised input, for biases computed from it.
        ``keep`` (B, K): under patch dropout, the kept tokens' indices in the full sequence of ``num_tokens`` tokens
        the state was built for (q, k, ``tokens`` and the probabilities then hold the kept tokens only)."""


class SchemeBias(NamedTuple):
    """The state of a :class:`~visionpe.base.BiasPositionEncoding`: the scheme and what its ``prepare`` built."""

    scheme: Any
    state: Any

    def layer(
        self,
        index: int,
        tokens: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
        num_tokens: int = 0,
    ) -> SchemeLayerBias:
        return SchemeLayerBias(self.scheme, self.state, index, tokens, keep, num_tokens)


BiasState.register(SchemeBias)


class SchemeLayerBias(LayerBias):
    """A :class:`~visionpe.base.BiasPositionEncoding`'s block ``layer`` through the :class:`LayerBias` interface: the
    scheme's own declarations (``augments_qk``, ``needs_tokens``, ``needs_probs``, ``batch_shared_bias``) are read
    here, once, so attention reads none."""

    def __init__(
        self,
        scheme: Any,
        state: Any,
        layer: int,
        tokens: torch.Tensor | None,
        keep: torch.Tensor | None,
        num_tokens: int,
    ) -> None:
        self.scheme, self.state, self.layer, self.keep, self.num_tokens = scheme, state, layer, keep, num_tokens
        self.needs_probs = scheme.needs_probs
        self.batch_shared = scheme.batch_shared_bias or scheme.augments_qk  # an augmenting scheme has no logits
        self.tokens = tokens if scheme.needs_tokens else None
        if self.tokens is not None and keep is not None:  # the full sequence's tokens, dropped rows zero
            self.tokens = scatter_tokens(self.tokens[:, None], keep, num_tokens)[:, 0]
        self._bound = False  # the state bound to this block's tokens (scheme.bind_tokens), at the first logits

    def _full(self, x: torch.Tensor) -> torch.Tensor:
        return scatter_tokens(x, self.keep, self.num_tokens)

    def augment_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scheme = self.scheme
        if not scheme.augments_qk:
            return q, k
        if self.keep is None:
            return scheme.augment_qk(q, k, self.state, self.layer, tokens=self.tokens)
        q, k = scheme.augment_qk(self._full(q), self._full(k), self.state, self.layer, tokens=self.tokens)
        return gather_tokens(q, self.keep), gather_tokens(k, self.keep)

    def logits(self, q: torch.Tensor, k: torch.Tensor, rows: slice | None = None) -> torch.Tensor | None:
        scheme = self.scheme
        if scheme.augments_qk:  # written into q and k instead
            return None
        extra = {"tokens": self.tokens} if scheme.needs_tokens else {}
        if scheme.needs_tokens and self.tokens is not None and not self._bound:
            # what every chunk of query rows reads of the tokens, computed once for this block
            self.state, self._bound = scheme.bind_tokens(self.state, self.layer, self.tokens), True
        if self.keep is None:
            return scheme.attn_bias(q, k, self.state, self.layer, rows=rows, **extra)
        return gather_pairs(scheme.attn_bias(self._full(q), self._full(k), self.state, self.layer, **extra), self.keep)

    def fused_terms(self, q: torch.Tensor, k: torch.Tensor) -> list | None:
        scheme = self.scheme
        if self.keep is not None or scheme.needs_tokens or scheme.needs_probs or scheme.augments_qk:
            return None
        return scheme.fused_bias(q, k, self.state, self.layer)

    def value_term(self, attn: torch.Tensor, rows: slice | None = None) -> torch.Tensor | None:
        scheme = self.scheme
        if not scheme.needs_probs:
            return None
        if self.keep is None:
            return scheme.value_term(attn, self.state, self.layer, rows=rows)
        full = scatter_pairs(attn, self.keep, self.num_tokens)
        return gather_tokens(scheme.value_term(full, self.state, self.layer), self.keep)


@dataclass
class OffsetBias:
    """A bias term given per grid offset, the form fused attention reads (``score_mod`` of FlexAttention).

    Pair (query i, key j) reads ``values[b, h, r, column[o]]`` where o is the pair's entry in the per-offset table
    of ``state`` (:meth:`OffsetGrid.offset_index`: the offset p_i - p_j, or K for pairs with a prefix token), r is i,
    and ``column`` maps entries to columns of ``values`` (None: column o itself). With ``by_key=True`` the roles of
    the two tokens swap: the pair reads row j at the entry of the offset p_j - p_i (iRPE's query-side term).
    ``values``: (B | 1, h | 1, P + N | 1, C), a size-1 dimension shared.
    """

    state: OffsetGrid
    values: torch.Tensor
    column: torch.Tensor | None = None
    by_key: bool = False

    def dense(self) -> torch.Tensor:
        """The term as a dense (B | 1, h | 1, P + N, P + N) bias (the reference for the fused form; tests)."""
        every = range(self.state.num_tokens)
        index = self.state.offset_index(every, every)
        if self.by_key:
            index = index.transpose(0, 1)
        if self.column is not None:
            index = self.column[index.long()]
        values = self.values.expand(*self.values.shape[:2], self.state.num_tokens, -1)
        rows = torch.arange(self.state.num_tokens, device=index.device)
        rows = rows[None, :] if self.by_key else rows[:, None]  # the row a pair reads: i, or j with by_key
        return values[:, :, rows.expand_as(index), index.long()]


def offset_score_mod(terms: list[OffsetBias]):
    """FlexAttention ``score_mod`` adding every term of ``terms`` (all on one grid) to the attention scores.

    Each pair's table entry comes from the token indices by arithmetic, (y_i - y_j + H - 1)(2W - 1) + x_i - x_j +
    W - 1 on ``index`` coordinates, K for pairs with a prefix token (which come first), so nothing of size (N, N) is
    built; a term reads its ``values`` there.
    """
    if not terms:
        raise ValueError("terms must hold at least one OffsetBias")
    state = terms[0].state
    (height, width), prefix, entries = state.grid_size, state.num_prefix_tokens, state.num_offsets
    for term in terms[1:]:
        if (term.state.grid_size, term.state.num_prefix_tokens) != (state.grid_size, prefix):
            raise ValueError(
                f"every OffsetBias must be on one grid, got grid {term.state.grid_size} with "
                f"{term.state.num_prefix_tokens} prefix tokens and grid {state.grid_size} with {prefix}"
            )

    def entry(i, j):
        pi, pj = (i - prefix).clamp_min(0), (j - prefix).clamp_min(0)
        offset = (pi // width - pj // width + height - 1) * (2 * width - 1) + pi % width - pj % width + width - 1
        return torch.where((i < prefix) | (j < prefix), entries, offset)

    def read(term: OffsetBias, b, h, q_idx, kv_idx):
        row, other = (kv_idx, q_idx) if term.by_key else (q_idx, kv_idx)
        index = entry(row, other)
        if term.column is not None:
            index = term.column[index]
        values = term.values
        return values[
            b if values.shape[0] > 1 else 0,
            h if values.shape[1] > 1 else 0,
            row if values.shape[2] > 1 else 0,
            index,
        ]

    def score_mod(score, b, h, q_idx, kv_idx):
        for term in terms:
            score = score + read(term, b, h, q_idx, kv_idx)
        return score

    return score_mod
