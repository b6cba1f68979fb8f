"""LeRoPE-style learned RoPE frequencies on RoPE-Axial's axis split.

Reference: only an abstract was found, of language-model work (52M to 2.5B parameters) that learns "a scalar per
frequency, treating frequencies as learnable parameters rather than hyperparameters", and reports that RoPE needs
3.4% more compute to match it at the largest scale. The title, arXiv id and code were not located, so the
construction below is the library's reading of that abstract for 2D/3D grids.

Rule: pairs are split between the axes as in RoPE-Axial (pairs [0, n_x) read x, the next n_y read y[, the last n_t
read t]), and pair n of axis a turns by p_a * theta_{a,n} with theta_{a,n} = exp(l_{a,n}). The log-frequencies l
are learned, initialised at log base^(-n / n_a) (RoPE-Axial's frequencies, base 100), one set shared by every layer
and head (``share="model"``) or one set per layer (``share="layer"``). The parametrisation in logs keeps every
frequency positive and lets slow and fast bands move by the same relative amount. It is RoPE-Mixed with the
direction of each pair frozen on its axis: exactly relative, and PI, NTK and YaRN apply to the learned frequencies
as to RoPE-Axial's. The log-frequencies are kept out of weight decay (decay would pull every frequency towards 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..checks import check_choice
from ..registry import register_scheme
from .base import LinearRotary
from .frequencies import axial_frequencies, check_axis_pairs, check_base, default_axis_pairs

__all__ = ["RopeLearned", "SHARE_MODES"]

SHARE_MODES = ("model", "layer")


@register_scheme("rope_learned")
class RopeLearned(LinearRotary):
    """Axial 2D/3D RoPE with learned log-frequencies theta_{a,n} = exp(l_{a,n}).

    Args:
        dim: model width; num_heads: heads (they share the frequencies); depth: blocks.
        base: base of the initial frequencies base^(-n / n_a), RoPE-Axial's (100).
        ndim: 2 for images (y, x), 3 for video (t, y, x).
        axis_pairs: pairs per axis in order x, y[, t], as RoPE-Axial; default (d/4, d/4) in 2D, d/8 pairs for t
            in 3D.
        share: ``"model"`` (default): one set of frequencies for every layer; ``"layer"``: one set per layer.
        coord_mode, grid_size, extrapolation, yarn_alpha, yarn_beta, rotate_values: the shared rotary options, by
            keyword (:class:`~visionpe.rotary.base.RotaryOptions`: integer patch positions as RoPE-Axial, no
            extrapolation); the extrapolation modes apply to the learned frequencies.

    Parameters: ``log_freqs`` of shape (1 | depth, head_dim // 2), each pair's log-frequency on its own axis.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        base: float = 100.0,
        ndim: int = 2,
        axis_pairs: Sequence[int] | None = None,
        share: str = "model",
        **options: Any,
    ) -> None:
        super().__init__(dim, num_heads, depth, ndim, options=self.rotary_options(options))
        self.share = check_choice(share, "share", SHARE_MODES)
        axis_pairs = check_axis_pairs(default_axis_pairs(self.head_dim, ndim) if axis_pairs is None else axis_pairs)
        if len(axis_pairs) != ndim:
            raise ValueError(f"axis_pairs must have {ndim} entries for ndim={ndim}, got {tuple(axis_pairs)}")
        self.base, self.axis_pairs = check_base(base), tuple(axis_pairs)
        freqs = axial_frequencies(self.head_dim, self.base, self.axis_pairs)  # (ndim, pairs), one non-zero per column
        # which axis each pair reads: a fixed 0/1 mask in coordinate order, rows (y, x) or (t, y, x)
        self.register_buffer("axis_mask", self._axis_mask(), persistent=False)
        log_freqs = freqs.double().sum(0).log()  # each pair's own frequency: base^(-n / n_a) on its axis
        sets = depth if self.share == "layer" else 1
        self.log_freqs = nn.Parameter(log_freqs.float().expand(sets, -1).clone())

    def _axis_mask(self) -> torch.Tensor:
        return (axial_frequencies(self.head_dim, self.base, self.axis_pairs) > 0).float()

    def fixed_buffers(self) -> dict[str, torch.Tensor]:
        return {"axis_mask": self._axis_mask()}

    def frequencies(self) -> torch.Tensor:
        # (1 | depth, 1, ndim, pairs): exp(l) on each pair's axis, 0 on the others
        with torch.autocast(self.log_freqs.device.type, enabled=False):  # fp32 even after model.to(bfloat16)
            theta = self.log_freqs.float().exp()
            return theta[:, None, None, :] * self.axis_mask.float()[None, None]

    def no_weight_decay(self) -> set[str]:
        return {"log_freqs"}
