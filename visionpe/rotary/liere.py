"""LieRE: Ostmeier et al., "LieRE: Lie Rotational Positional Encodings", ICML 2025 (StanfordMIMI/LieRE).

R(p) = exp(sum_i p_i A_i), A_i = U_i - U_i^T with U_i = triu(raw_i, 1), in b x b diagonal blocks (LieRE_b;
b = 8 is the paper's best, b = head_dim is dense), learned per layer and head; q' = R q, k' = R k.
Not exactly relative for b >= 3 with two or more axes (the A_i do not commute); b = 2 recovers RoPE-Mixed.
Positions are integer patch indices (`index`); prefix tokens are not rotated [visionpe].
Init raw ~ U[0, 1) * 2 pi as the reference, which feeds positions in [0, 1] over the training grid; with integer
positions the same rotations need raw ~ U[0, 1) * 2 pi / (n0 - 1), the default ``init_scale`` [visionpe].

Released code (StanfordMIMI/LieRE), for its checkpoints: its transformer loop overwrites the per-layer transforms
with layer 0's slice on the first layer, so a model trained with ``rotary_embedding_per_layer=True`` computes with
layer 0's generators in every layer (its later layers' generators are never used); visionpe's per-layer generators
are used as the paper describes, and :func:`~visionpe.models.official.convert_liere_state_dict` copies layer 0's
generators to every layer to reproduce a released checkpoint. Its block size (``generator_dim``) defaults to 64,
which its CIFAR-100 recipe keeps (dense generators for 64-wide heads, LieRE_64), and which its released ImageNet
configs do not set either; the paper's best block, b = 8, is visionpe's default.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ..base import check_layer
from ..registry import register_scheme
from .expm import skew_from_params
from .lie_base import LieBlockRotary

__all__ = ["LieRE"]


@register_scheme("liere")
class LieRE(LieBlockRotary):
    """Learned Lie-algebra rotations in b x b blocks per layer and head.

    Args:
        dim, num_heads, depth: model shape; generators per block and head.
        block_size: b (2, 4, 8, ..., head_dim); 8 by default (the paper's best; the released code's default is 64).
        ndim: 2 for images (y, x), 3 for video (t, y, x).
        init_scale: raw ~ U[0, 1) * init_scale; None: 2 pi / (n0 - 1), n0 the largest training grid side
            (2 pi / 13 when the grid is unknown).
        grid_size: training grid (the model passes it).
        extrapolation: ``none`` or ``pi`` (positions divided by test / train grid per axis); with ``block_size=2``
            (RoPE-Mixed with learned rates) also ``ntk`` and ``yarn``.
        rotate_values: rotary value embeddings (RoVE): v_j -> R(p_j) v_j and o_i -> R(p_i)^T o_i
            (:mod:`visionpe.rotary.lie_base`); only approximately relative for b >= 3 (the generators do not
            commute). False by default.

    Parameters: depth * num_heads * ndim * (head_dim / b) * b (b - 1) / 2.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        block_size: int = 8,
        ndim: int = 2,
        init_scale: float | None = None,
        grid_size: Sequence[int] | None = None,
        extrapolation: str = "none",
        rotate_values: bool = False,
    ) -> None:
        super().__init__(dim, num_heads, depth, block_size, ndim, grid_size, extrapolation, rotate_values)
        if init_scale is None:
            side = max(self.train_grid_size) if self.train_grid_size is not None else 14
            init_scale = 2 * math.pi / max(side - 1, 1)
        if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale >= 0):
            raise ValueError(f"init_scale must be a finite non-negative number, got {init_scale!r}")
        count = block_size * (block_size - 1) // 2
        self.init_scale = float(init_scale)
        self.generator_params = nn.Parameter(torch.rand(depth, num_heads, self.num_blocks, ndim, count) * init_scale)

    def generators(self, layer: int) -> torch.Tensor:
        check_layer(layer, self.depth, type(self).__name__)
        raw = self.generator_params[layer if self.generator_params.shape[0] > 1 else 0]
        return skew_from_params(raw, self.block_size)

    def layer_generators(self) -> torch.Tensor:
        return skew_from_params(self.generator_params, self.block_size)
