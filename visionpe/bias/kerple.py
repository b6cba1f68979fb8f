"""KERPLE in 2D: Chi et al., "KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation",
NeurIPS 2022 (chijames/KERPLE).

Two conditionally positive definite kernels of the distance d between patches, learned per layer and head:

- ``kerple_log``: b = -r1 log(1 + r2 d), r1 ~ U(0, 2), r2 ~ U(0, 1) at init;
- ``kerple_power``: b = -r1 d^r2, r1 ~ U(0, 1), r2 ~ U(0, 2) at init; with r2 = 1 and r1 the ALiBi slopes it is
  2D ALiBi for every slope of at least 0.01 (the bound below lifts smaller slopes, such as 2^-8, to 0.01).

As in the reference, r1 and r2 are kept at or above 0.01 (and r2 of the power kernel at or below 2) at every
forward; here the bound is applied to the values the forward uses (the parameters themselves are not rewritten),
which gives the same forward. d is the Euclidean, Manhattan or per-axis distance of
:mod:`~visionpe.bias.distance`; the bias depends on the offset only, so it is exactly relative, and a larger grid
recomputes it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..registry import register_scheme
from .distance import DistanceKernelBias

__all__ = ["KerpleLog", "KerplePower"]

_MIN = 0.01  # the reference's lower bound of both parameters
_MAX_POWER = 2.0  # and its upper bound of the power kernel's exponent


@register_scheme("kerple_log")
class KerpleLog(DistanceKernelBias):
    """KERPLE's logarithmic kernel, -r1 log(1 + r2 d), on 2D distances.

    Args:
        dim, num_heads, depth: model shape; one (r1, r2) per block and head (and axis with ``distance="axis"``).
        distance: ``"euclidean"`` (default), ``"manhattan"`` or ``"axis"`` (see :mod:`visionpe.bias.distance`).
    """

    def __init__(self, dim: int, num_heads: int, depth: int = 1, distance: str = "euclidean") -> None:
        super().__init__(dim, num_heads, depth, distance)
        self.scale = nn.Parameter(self.kernel_parameter(uniform=2.0))  # r1 (the reference's bias_p)
        self.rate = nn.Parameter(self.kernel_parameter(uniform=1.0))  # r2 (the reference's bias_a)

    def kernel(self, distances: torch.Tensor, layer: int) -> torch.Tensor:
        r1 = self.layer_parameter(self.scale, layer, distances.dtype).clamp(min=_MIN)
        r2 = self.layer_parameter(self.rate, layer, distances.dtype).clamp(min=_MIN)
        return -r1 * torch.log1p(r2 * distances)


@register_scheme("kerple_power")
class KerplePower(DistanceKernelBias):
    """KERPLE's power kernel, -r1 d^r2, on 2D distances.

    Args:
        dim, num_heads, depth: model shape; one (r1, r2) per block and head (and axis with ``distance="axis"``).
        distance: ``"euclidean"`` (default), ``"manhattan"`` or ``"axis"`` (see :mod:`visionpe.bias.distance`).
    """

    def __init__(self, dim: int, num_heads: int, depth: int = 1, distance: str = "euclidean") -> None:
        super().__init__(dim, num_heads, depth, distance)
        self.scale = nn.Parameter(self.kernel_parameter(uniform=1.0))  # r1 (the reference's bias_a)
        self.power = nn.Parameter(self.kernel_parameter(uniform=2.0))  # r2 (the reference's bias_p)

    def kernel(self, distances: torch.Tensor, layer: int) -> torch.Tensor:
        r1 = self.layer_parameter(self.scale, layer, distances.dtype).clamp(min=_MIN)
        r2 = self.layer_parameter(self.power, layer, distances.dtype).clamp(_MIN, _MAX_POWER)
        # d^r2 at d = 0 is 0, but its gradient in r2 (d^r2 log d) would be 0 * -inf: the zero distances (the
        # diagonal and the prefix pairs) are raised from 1 and masked, so every gradient stays finite
        positive = distances > 0
        powered = torch.where(positive, distances, torch.ones_like(distances)) ** r2
        return -r1 * torch.where(positive, powered, torch.zeros_like(powered))
