"""FIRE in 2D: Li et al., "Functional Interpolation for Relative Positions Improves Long Context Transformers",
ICLR 2024 (arXiv 2310.04418).

FIRE biases a (query i, key j) pair by a small learned function of the distance, normalised by how far the query can
see: b_h(i, j) = MLP_h( ψ(d_ij) / (ψ(max(D_i, L)) + 1e-6) ), with ψ(x) = log(|c x| + 1) (c learned, from 0.1), a
threshold L = |ℓ L0| (ℓ learned, from 1) that keeps short contexts from being stretched, and an MLP 1 -> 32 -> ReLU
-> heads. In the paper's causal 1D setting d_ij = i - j and D_i = i, the distance to the farthest key a query sees,
and L0 = 512 for a training length of 2048.

2D reading [visionpe]:

- d_ij is the Euclidean distance between patches (``distance="euclidean"``, default), the Manhattan distance
  (``"manhattan"``) or, with ``"axis"``, |dy| and |dx| through separate FIREs (own c, ℓ and MLP) whose biases add.
- D_i is the distance from patch i to the farthest patch of the grid under that distance (``normalizer="farthest"``,
  default): every normalised distance lies in [0, 1] on any grid, as in 1D. ``normalizer="origin"`` takes the
  distance from the first patch instead, the literal reading of D_i = i (on a 1 x W grid with causal pairs it is the
  paper's rule exactly).
- L0 is a quarter of the largest distance on the training grid (``grid_size``, which the model passes), as 512 is
  for 2048; with 512 itself no ViT grid would ever be normalised. It is a buffer saved with the model.
- ``signed=True`` feeds the MLP the two signed per-axis ratios sign(Δa) ψ(|Δa|) / (ψ(max(D_i, L)) + 1e-6) of the
  offset Δ = p_i - p_j (a = y, x; an MLP 2 -> 32 -> heads; with ``"axis"`` one signed ratio per axis), so the bias
  can tell directions apart; unsigned, it is symmetric in Δ up to the normaliser.
- One FIRE (c, ℓ, MLP) per block [reading]: the paper does not say whether layers share it.
- Pairs involving a prefix token (cls, registers) get zero bias.

FIRE is not exactly relative: D_i depends on where the query is. The per-forward state is the per-offset table of
:mod:`~visionpe.bias.offsets` (nothing of size (N, N) is kept); each block evaluates ψ per offset, gathers the query
rows asked for (all of them, or one chunk when attention runs in query chunks) and runs the MLP on them, in fp32.
Rows are evaluated in pieces whose (rows, N, 32) hidden layer stays within ``hidden_chunk_bytes``; when autograd
records the bias, each piece is checkpointed (its hidden layer recomputed in the backward) so training at large
grids keeps only the (h, N, N) bias, as every bias scheme does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..base import BiasPositionEncoding, check_layer, check_model_shape
from ..checks import check_bool, check_choice, check_float, check_int, check_positive
from ..grid import validate_grid_size
from ..registry import register_scheme
from .distance import DISTANCES, axis_distances
from .offsets import OffsetState, gather_offsets, offset_state, query_rows

__all__ = ["FIRE", "FIRE_NORMALIZERS", "FireState"]

FIRE_NORMALIZERS = ("farthest", "origin")
_EPS = 1e-6  # the appendix code's constant in the denominator


@dataclass
class FireState(OffsetState):
    """:class:`~visionpe.bias.offsets.OffsetState` with ``values``: fp32 (A, I, K + 1) distances per grid offset that
    ψ is applied to (A groups of I MLP inputs: signed per-axis offsets with ``signed``, else distances), 0 in the
    prefix entry K; and ``normalizers``: fp32 (A, N), D_i of every patch."""

    values: torch.Tensor | None = None
    normalizers: torch.Tensor | None = None


@register_scheme("fire")
class FIRE(BiasPositionEncoding):
    """FIRE's learned, progressively normalised function of the 2D distance, per block.

    Args:
        dim, num_heads, depth: model shape; one FIRE (c, ℓ, MLP) per block.
        grid_size: the training grid (H0, W0), which sets L0 (a quarter of its largest distance); the model passes
            its patch grid.
        distance: ``"euclidean"`` (default), ``"manhattan"`` or ``"axis"`` (a FIRE per axis, summed).
        signed: feed the signed per-axis ratios instead of the distance ratio (direction-aware).
        normalizer: ``"farthest"`` (default; D_i = distance to the farthest patch) or ``"origin"`` (distance to the
            first patch, the literal 1D reading).
        mlp_width: hidden width of the MLP (32 in the paper).
        init_c: c at init (0.1). init_threshold: ℓ at init (1).
    """

    ndims = (2,)
    # torch.onnx's decomposition of an attention with a bias computed from parameters fails on a view (torch 2.14)
    onnx_refusal = "torch.onnx fails to decompose the attention with a bias computed from parameters"
    batch_shared_bias = True  # a function of the positions only
    #: grids up to this many tokens cache their full (N, N) offset index per forward (4 MB at 1024 tokens)
    full_state_max_tokens: int = 1024
    #: query rows are evaluated in pieces whose fp32 (rows, N, mlp_width) hidden layer fits this many bytes
    hidden_chunk_bytes: int = 16 * 2**20

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        grid_size: Sequence[int] = (14, 14),
        distance: str = "euclidean",
        signed: bool = False,
        normalizer: str = "farthest",
        mlp_width: int = 32,
        init_c: float = 0.1,
        init_threshold: float = 1.0,
    ) -> None:
        super().__init__()
        check_model_shape(dim, num_heads, depth)
        self.num_heads, self.depth = num_heads, depth
        self.grid_size = validate_grid_size(grid_size, ndims=(2,))
        self.distance = check_choice(distance, "distance", DISTANCES)
        self.signed = check_bool(signed, "signed")
        self.normalizer = check_choice(normalizer, "normalizer", FIRE_NORMALIZERS)
        width = check_int(mlp_width, "mlp_width", min=1)
        init_c = check_positive(init_c, "init_c")
        init_threshold = check_float(init_threshold, "init_threshold")
        self.num_groups = 2 if distance == "axis" else 1
        self.num_inputs = 2 if signed and distance != "axis" else 1
        groups, inputs = self.num_groups, self.num_inputs
        self.c = nn.Parameter(torch.full((depth, groups), init_c))
        self.threshold = nn.Parameter(torch.full((depth, groups), init_threshold))  # ℓ
        self.register_buffer("base_threshold", self._largest_distances(self.grid_size) / 4)  # L0, (A,)
        # the MLP of every block and group, initialised as nn.Linear: U(±fan_in^-1/2) for weights and biases
        bound1, bound2 = inputs**-0.5, width**-0.5
        self.fc1_weight = nn.Parameter(torch.empty(depth, groups, width, inputs).uniform_(-bound1, bound1))
        self.fc1_bias = nn.Parameter(torch.empty(depth, groups, width).uniform_(-bound1, bound1))
        self.fc2_weight = nn.Parameter(torch.empty(depth, groups, num_heads, width).uniform_(-bound2, bound2))
        self.fc2_bias = nn.Parameter(torch.empty(depth, groups, num_heads).uniform_(-bound2, bound2))

    def fixed_buffers(self) -> dict[str, torch.Tensor]:
        # persistent: L0 of the training grid is state a checkpoint keeps (the model evaluated at another grid
        # normalises with the distances it was trained with)
        return {"base_threshold": self._largest_distances(self.grid_size) / 4}

    def _largest_distances(self, grid_size: tuple[int, int]) -> torch.Tensor:
        """fp32 (A,): the largest distance between two patches of ``grid_size`` (per axis for ``"axis"``)."""
        height, width = grid_size[0] - 1, grid_size[1] - 1
        if self.distance == "euclidean":
            return torch.tensor([math.hypot(height, width)])
        if self.distance == "manhattan":
            return torch.tensor([float(height + width)])
        return torch.tensor([float(height), float(width)])

    # -- per-forward state -----------------------------------------------------------------------------------
    def prepare(self, grid_size: tuple[int, ...], num_prefix_tokens: int, device=None) -> FireState:
        """Per-offset distances and per-patch normalisers for the current grid (and the full offset index when the
        grid is small)."""
        base = offset_state(self.check_grid(grid_size), num_prefix_tokens, device, self.full_state_max_tokens)
        if self.signed:
            dy, dx = (d.flatten() for d in base.offsets())
            signed = torch.stack((dy, dx))
            signed = torch.cat((signed, signed.new_zeros(2, 1)), 1)  # the prefix entry
            values = signed[:, None] if self.distance == "axis" else signed[None]
        else:
            values = axis_distances(base, self.distance)[:, None]
        normalizers = self._normalizers(base.grid_size, device)
        return FireState(base.grid_size, base.num_prefix_tokens, base.device, base.index, values, normalizers)

    def _normalizers(self, grid_size: tuple[int, int], device) -> torch.Tensor:
        """fp32 (A, N): D_i of every patch, from the farthest patch (``"farthest"``) or the first one (``"origin"``)."""
        height, width = grid_size
        y = torch.arange(height, device=device, dtype=torch.float32)[:, None].expand(height, width).flatten()
        x = torch.arange(width, device=device, dtype=torch.float32)[None, :].expand(height, width).flatten()
        if self.normalizer == "farthest":  # the farthest patch is a corner, on every axis independently
            y, x = torch.maximum(y, height - 1 - y), torch.maximum(x, width - 1 - x)
        if self.distance == "euclidean":
            return y.square().add(x.square()).sqrt()[None]
        if self.distance == "manhattan":
            return (y + x)[None]
        return torch.stack((y, x))

    # -- the bias ---------------------------------------------------------------------------------------------
    def thresholds(self, layer: int) -> torch.Tensor:
        """fp32 (A,): L = |ℓ L0| of block ``layer``."""
        check_layer(layer, self.depth, type(self).__name__)
        return (self.threshold[layer].float() * self.base_threshold.float()).abs()

    def _psi(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """ψ(x) = log(|c x| + 1), signed by x: sign(x) ψ(|x|) (x >= 0 for distances); c broadcasts against x."""
        return torch.log1p((c * x).abs()) * x.sign()

    def normalized_distances(self, state: FireState, layer: int, rows: slice | None = None) -> torch.Tensor:
        """The MLP inputs of block ``layer``: fp32 (A, I, R, N) for the patch query rows among ``rows`` (all rows
        for None) and every patch key (prefix tokens get no bias and no input). |value| <= 1 with the default
        ``normalizer="farthest"``."""
        picked = query_rows(rows, state.num_tokens)
        p = state.num_prefix_tokens
        with torch.autocast(state.values.device.type, enabled=False):
            return self._ratios(state, layer, max(picked.start, p), max(picked.stop, p))

    def _ratios(self, state: FireState, layer: int, start: int, stop: int) -> torch.Tensor:
        """fp32 (A, I, R, N) inputs for the patch query rows [start, stop) (token indices, all >= P)."""
        c = self.c[layer].float()
        numerators = self._psi(state.values, c[:, None, None])  # (A, I, K + 1)
        p, n = state.num_prefix_tokens, state.num_tokens
        index = state.offset_index(range(start, stop), range(p, n))  # (R, N)
        normalizers = state.normalizers[:, start - p : stop - p]  # (A, R)
        scale = self._psi(torch.maximum(normalizers, self.thresholds(layer)[:, None]), c[:, None]) + _EPS
        return gather_offsets(numerators, index) / scale[:, None, :, None]

    def _patch_bias(self, state: FireState, layer: int, start: int, stop: int) -> torch.Tensor:
        """fp32 (h, R, N) bias of the patch query rows [start, stop) over the patch keys."""
        ratios = self._ratios(state, layer, start, stop).permute(0, 2, 3, 1)  # (A, R, N, I)
        weight1 = self.fc1_weight[layer].float().transpose(-2, -1)[:, None]  # (A, 1, I, W)
        hidden = F.relu(ratios @ weight1 + self.fc1_bias[layer].float()[:, None, None])  # (A, R, N, W)
        out = torch.einsum("arnw,ahw->hrn", hidden, self.fc2_weight[layer].float())
        return out + self.fc2_bias[layer].float().sum(0)[:, None, None]

    def attn_bias(
        self, q: torch.Tensor, k: torch.Tensor, state: FireState, layer: int, rows: slice | None = None
    ) -> torch.Tensor:
        """FIRE's bias, ``(1, h, R, P + N)`` in the dtype of q; R = P + N or the query ``rows``."""
        check_layer(layer, self.depth, type(self).__name__)
        if not isinstance(state, FireState):
            raise TypeError(f"state must be the FireState of FIRE.prepare, got {type(state).__name__}")
        n, p = state.num_tokens, state.num_prefix_tokens
        picked = query_rows(rows, n)
        if q.shape[-2] != len(picked) or k.shape[-2] != n or q.shape[1] != self.num_heads:
            raise ValueError(
                f"q and k must have shape (B, {self.num_heads}, {len(picked)}, head_dim) and "
                f"(B, {self.num_heads}, {n}, head_dim) for this grid, got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        start, stop = max(picked.start, p), max(picked.stop, p)
        with torch.autocast(q.device.type, enabled=False):
            step = max(1, self.hidden_chunk_bytes // (self.num_groups * (n - p) * self.fc1_weight.shape[2] * 4))
            recorded = torch.is_grad_enabled() and any(param.requires_grad for param in self.parameters())
            pieces = []
            for begin in range(start, stop, step):
                end = min(begin + step, stop)
                if recorded and end - begin < stop - start:  # recompute each piece's hidden layer in the backward
                    pieces.append(checkpoint(self._patch_bias, state, layer, begin, end, use_reentrant=False))
                else:
                    pieces.append(self._patch_bias(state, layer, begin, end))
            bias = torch.cat(pieces, 1) if pieces else q.new_zeros(self.num_heads, 0, n - p, dtype=torch.float32)
        # prefix rows and columns: zero
        bias = F.pad(bias, (p, 0, len(picked) - (stop - start), 0))
        return bias.to(q.dtype)[None]

    def no_weight_decay(self) -> set[str]:
        """c and ℓ, which set the shape of ψ and the threshold (scalars, as ALiBi's slopes), and the MLP's biases;
        the MLP's weights decay, as those of any layer."""
        return {"c", "threshold", "fc1_bias", "fc2_bias"}
