"""BAM in 2D: Bianchessi et al., "Bayesian Attention Mechanism: A Probabilistic Framework for Positional Encoding
and Context Length Extrapolation", 2025 (ArthurSBianchessi/BAM).

A generalized-Gaussian prior on where a query attends: b_h = -(|s_h d + mu_h| + 1e-5)^beta_h per layer and head,
with s_h the ALiBi slopes (fixed), the shape beta_h learned from 1 (beta = 1 is ALiBi, beta = 2 a Gaussian
prior) and the location mu_h fixed at 0, the released configuration. d is the distance of
:mod:`~visionpe.bias.distance` (Euclidean by default). The 1e-5 keeps the gradient in beta finite at d = 0; it adds
the same constant to a whole row when beta = 1, so the attention probabilities then equal 2D ALiBi's.
"""

from __future__ import annotations

import torch
from torch import nn

from ..checks import check_bool, check_positive
from ..registry import register_scheme
from .alibi2d import alibi_slopes
from .distance import DistanceKernelBias

__all__ = ["BAM"]

_EPS = 1e-5  # the reference's offset inside the power


@register_scheme("bam")
class BAM(DistanceKernelBias):
    """Generalized-Gaussian attention prior on 2D distances.

    Args:
        dim, num_heads, depth: model shape; one prior per block and head (and axis with ``distance="axis"``).
        distance: ``"euclidean"`` (default), ``"manhattan"`` or ``"axis"`` (see :mod:`visionpe.bias.distance`).
        shape_init: beta at init (1: 2D ALiBi).
        learn_scale, learn_loc: also learn s_h (from the ALiBi slopes) and mu_h (from 0); off in the reference's
            released configuration, where they are fixed buffers.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        distance: str = "euclidean",
        shape_init: float = 1.0,
        learn_scale: bool = False,
        learn_loc: bool = False,
    ) -> None:
        super().__init__(dim, num_heads, depth, distance)
        check_positive(shape_init, "shape_init")
        self.beta = nn.Parameter(self.kernel_parameter(float(shape_init)))
        self.num_heads = num_heads
        # s_h and mu_h are parameters when learned, else fixed buffers, persistent: in the state dict under the same
        # names, so that a checkpoint loads whether they were learned or not
        initial = self._initial_values()
        for name, learn in (
            ("scale", check_bool(learn_scale, "learn_scale")),
            ("loc", check_bool(learn_loc, "learn_loc")),
        ):
            if learn:
                setattr(self, name, nn.Parameter(initial[name]))
            else:
                self.register_buffer(name, initial[name])

    def _initial_values(self) -> dict[str, torch.Tensor]:
        return {"scale": self.kernel_parameter(alibi_slopes(self.num_heads)), "loc": self.kernel_parameter(0.0)}

    def fixed_buffers(self) -> dict[str, torch.Tensor]:
        return {name: value for name, value in self._initial_values().items() if name in self._buffers}

    def kernel(self, distances: torch.Tensor, layer: int) -> torch.Tensor:
        scale = self.layer_parameter(self.scale, layer, distances.dtype)
        loc = self.layer_parameter(self.loc, layer, distances.dtype)
        beta = self.layer_parameter(self.beta, layer, distances.dtype)
        return -(((scale * distances + loc).abs() + _EPS) ** beta)
