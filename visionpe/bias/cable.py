"""Cable in 2D: Veisi, Amirzadeh, Mansourian, "Context-aware Biases for Length Extrapolation", arXiv 2503.08067,
2025 (axiomlab/Cable).

In 1D, every token t reads a step s_t = softplus(w_h·x̂_t + c_h) > 0 per head from its own content (the block's
normalised input x̂), and the bias of query i over key j is -|U_i - U_j| with U = cumsum(s): ALiBi whose distance
is measured in learned, content-dependent steps (the reference writes it as b_i - b_j with b = -cumsum(s) under its
causal mask).

2D reading [visionpe]:

- ``order="axis"`` (default): a step per axis, s^y and s^x, from one Linear(C, 2h) per block. u^x of a patch is the
  sum of the s^x steps from the left edge of its row to it, u^y the sum of the s^y steps from the top edge of its
  column (the first patch of a row or column takes no step: u = 0 on the left and top edges), and
  b_h(i, j) = -|u^x_i - u^x_j| - |u^y_i - u^y_j|: a Manhattan distance in coordinates that the content stretches.
  With every step 1 it is -(|dx| + |dy|).
- ``order="raster"``: the literal 1D rule over the raster order of the patches (one Linear(C, h)); a row break then
  counts as one step, so vertical neighbours are W steps apart.

On a 1 x W grid both readings are the reference's rule (the first token's step cancels in every difference).
Prefix tokens (cls, registers) take no step and get zero bias rows and columns. The steps use the block's own
weights (one Linear per block, initialised N(0, 0.02) with zero bias, as the reference) and are summed in fp32.
The bias is added to logits q·k / sqrt(d): the released code omits the 1/sqrt(d) scale (it divides q and k by
sqrt(C / n_embd) = 1), the library keeps the standard scale.

Cable is not translation-invariant: the bias depends on the content between (and beside) the two patches. With patch
dropout, a dropped patch is seen as a zero token (its step is softplus(c_h)), since its content never reaches the
block. Memory: the per-token sums are O(N); each block builds the (B, h, R, N) bias of the query rows it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..base import BiasPositionEncoding, check_layer, check_model_shape
from ..checks import check_block_tokens, check_choice, check_int
from ..grid import validate_grid_size
from ..registry import register_scheme
from .offsets import query_rows

__all__ = ["CABLE_ORDERS", "Cable", "CableState"]

CABLE_ORDERS = ("axis", "raster")


@dataclass
class CableState:
    """Per-forward state of Cable: the grid and the number of prefix tokens (the steps come from each block's
    tokens). :meth:`Cable.bind_tokens` adds one block's summed steps (``sums``, of ``layer`` and ``tokens``), which
    every chunk of query rows of that block then reads instead of summing them again."""

    grid_size: tuple[int, int]
    num_prefix_tokens: int
    layer: int | None = None
    tokens: torch.Tensor | None = field(default=None, repr=False, compare=False)
    sums: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.grid_size[0] * self.grid_size[1]


@register_scheme("cable")
class Cable(BiasPositionEncoding):
    """Context-aware ALiBi: distances counted in steps read from the tokens, per block.

    Args:
        dim, num_heads, depth: model shape; one Linear(C, 2h) (``"axis"``) or Linear(C, h) (``"raster"``) per
            block.
        order: ``"axis"`` (default: per-axis steps and sums) or ``"raster"`` (the 1D rule over the raster order).
    """

    ndims = (2,)
    # torch.onnx's decomposition of an attention with a bias computed from parameters fails on a view (torch 2.14)
    onnx_refusal = "torch.onnx fails to decompose the attention with a bias computed from parameters"
    needs_tokens = True

    def __init__(self, dim: int, num_heads: int, depth: int = 1, order: str = "axis") -> None:
        super().__init__()
        check_model_shape(dim, num_heads, depth)
        self.dim, self.num_heads, self.depth = dim, num_heads, depth
        self.order = check_choice(order, "order", CABLE_ORDERS)
        self.num_axes = 2 if order == "axis" else 1
        # rows (y heads, then x heads) for "axis"; the reference's init: N(0, 0.02) weights, zero bias
        self.weight = nn.Parameter(torch.randn(depth, self.num_axes * num_heads, dim) * 0.02)
        self.bias = nn.Parameter(torch.zeros(depth, self.num_axes * num_heads))

    def prepare(self, grid_size: tuple[int, ...], num_prefix_tokens: int, device=None) -> CableState:
        """The grid and the prefix count (nothing is precomputed: the steps come from the tokens)."""
        grid_size = validate_grid_size(self.check_grid(grid_size), ndims=(2,))
        return CableState(grid_size, check_int(num_prefix_tokens, "num_prefix_tokens", min=0))

    def positions(self, state: CableState, layer: int, tokens: torch.Tensor) -> torch.Tensor:
        """fp32 (B, A, h, N): the summed steps of every patch, (u^y, u^x) for ``"axis"``, (U,) for ``"raster"``."""
        check_layer(layer, self.depth, type(self).__name__)
        height, width = state.grid_size
        patches = tokens[:, state.num_prefix_tokens :]
        # the projection in the activations' precision, as any linear layer; softplus and the sums in fp32
        projected = F.linear(patches, self.weight[layer], self.bias[layer])
        with torch.autocast(tokens.device.type, enabled=False):
            steps = F.softplus(projected.float()).unflatten(-1, (self.num_axes, self.num_heads))  # (B, N, A, h)
            if self.order == "raster":
                # the first patch takes no step (it cancels in every difference, as in the reference)
                u = steps.cumsum(1) - steps[:, :1]
                return u.permute(0, 2, 3, 1)
            steps = steps.unflatten(1, (height, width))  # (B, H, W, 2, h)
            u_y = steps[..., 0, :].cumsum(1) - steps[:, :1, :, 0, :]  # along the column, 0 on the top edge
            u_x = steps[..., 1, :].cumsum(2) - steps[:, :, :1, 1, :]  # along the row, 0 on the left edge
            return torch.stack((u_y, u_x), 1).flatten(2, 3).transpose(2, 3)  # (B, 2, h, N)

    def attn_bias(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        state: CableState,
        layer: int,
        rows: slice | None = None,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Cable's bias, ``(B, h, R, P + N)`` in the dtype of q; R = P + N or the query ``rows``; ``tokens``: the
        block's normalised input (B, P + N, C), every token."""
        if not isinstance(state, CableState):
            raise TypeError(f"state must be the CableState of Cable.prepare, got {type(state).__name__}")
        n, p = state.num_tokens, state.num_prefix_tokens
        picked = query_rows(rows, n)
        if q.shape[-2] != len(picked) or k.shape[-2] != n or q.shape[1] != self.num_heads:
            raise ValueError(
                f"q and k must have shape (B, {self.num_heads}, {len(picked)}, head_dim) and "
                f"(B, {self.num_heads}, {n}, head_dim) for this grid, got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        check_block_tokens(tokens, "Cable", n, self.dim, batch=k.shape[0])
        bound = state.sums is not None and state.layer == layer and state.tokens is tokens
        u = state.sums if bound else self.positions(state, layer, tokens)  # (B, A, h, N)
        start, stop = max(picked.start, p), max(picked.stop, p)
        with torch.autocast(q.device.type, enabled=False):
            if torch.is_grad_enabled() and u.requires_grad:
                queries = u[..., start - p : stop - p, None]  # (B, A, h, R, 1)
                bias = -(queries[:, 0] - u[:, 0, :, None, :]).abs()  # (B, h, R, N)
                for axis in range(1, self.num_axes):
                    bias = bias - (queries[:, axis] - u[:, axis, :, None, :]).abs()
            else:
                # without autograd, one kernel instead of three passes over (B, h, R, N): the same sums of |offsets|
                # (for one or two axes the same additions, so the same bits); training keeps the expression above,
                # whose backward is elementwise
                points = u.permute(0, 2, 3, 1)  # (B, h, N, A)
                bias = torch.cdist(points[:, :, start - p : stop - p], points, p=1).neg_()
        if p:  # prefix rows and columns: zero
            bias = F.pad(bias, (p, 0, len(picked) - (stop - start), 0))
        return bias.to(q.dtype)

    def bind_tokens(self, state: CableState, layer: int, tokens: torch.Tensor) -> CableState:
        """``state`` with block ``layer``'s summed steps of ``tokens`` (:meth:`positions`), computed once for the
        chunks of query rows that attention asks for at large sizes; :meth:`attn_bias` reads them when called with
        this layer and this very tensor, and sums again otherwise."""
        if not isinstance(state, CableState):
            raise TypeError(f"state must be the CableState of Cable.prepare, got {type(state).__name__}")
        check_block_tokens(tokens, "Cable", state.num_tokens, self.dim)
        return replace(state, layer=layer, tokens=tokens, sums=self.positions(state, layer, tokens))

    def no_weight_decay(self) -> set[str]:
        """The steps' bias, as any layer's bias; the weights decay, as the reference's optimiser decays them."""
        return {"bias"}
