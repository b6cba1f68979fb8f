"""CPE / PEG: Chu et al., "Conditional Positional Encodings for Vision Transformers", ICLR 2023 (CPVT).

Position Encoding Generator on the patch tokens X (B, C, H, W): X <- DWConv3x3(X) + X (groups = C, stride 1,
zero padding 1, bias; no norm, no activation); prefix tokens pass through. Zero padding is the only source of
absolute position. Placed after block 0 (CPVT default) or after blocks 0..4 ("0-5"), one PEG per position.
Initialisation and weight decay follow the authors' released code (CPVT's Twins, and timm's Twins port): the
depthwise kernel ~ N(0, 2 / fan_out) with fan_out = k * k * C_out / groups = k^2 (std sqrt(2/9) for 3 x 3), the
bias 0, and every PEG parameter, kernel and bias, excluded from weight decay.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch
from torch import nn

from ..base import AbsolutePositionEncoding, check_model_shape
from ..checks import check_int
from ..registry import register_scheme

__all__ = ["PEG", "PositionEncodingGenerator"]


class PositionEncodingGenerator(nn.Module):
    """One PEG: residual depthwise convolution over the patch grid.

    Args:
        dim: channels C.
        kernel_size: odd kernel size (3 in the paper); padding keeps the grid size.

    Kernel ~ N(0, 2 / fan_out), fan_out = kernel_size^2 * C / groups = kernel_size^2 (He's fan-out rule, as the
    released code), bias 0.
    """

    def __init__(self, dim: int, kernel_size: int = 3) -> None:
        super().__init__()
        check_model_shape(dim, 1)
        check_int(kernel_size, "kernel_size", min=1, expected="a positive odd int")
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd int, got {kernel_size!r}")
        self.proj = nn.Conv2d(dim, dim, kernel_size, stride=1, padding=kernel_size // 2, groups=dim, bias=True)
        fan_out = kernel_size * kernel_size  # k * k * out_channels / groups, with groups = out_channels = dim
        nn.init.normal_(self.proj.weight, mean=0.0, std=math.sqrt(2.0 / fan_out))
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor, grid_size: tuple[int, int], num_prefix_tokens: int) -> torch.Tensor:
        """``x`` (B, P + H W, C) -> same shape; the first P tokens are returned unchanged."""
        height, width = grid_size
        prefix, patches = x[:, :num_prefix_tokens], x[:, num_prefix_tokens:]
        grid = patches.transpose(1, 2).unflatten(-1, (height, width))  # (B, C, H, W)
        patches = (self.proj(grid) + grid).flatten(2).transpose(1, 2)
        return torch.cat([prefix, patches], dim=1)


def _block_index(value) -> int | None:
    """``value`` as an int if it is an integer (Python or NumPy int, 0-d integer tensor), not a bool; else None."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


@register_scheme("cpe")
class PEG(AbsolutePositionEncoding):
    """Conditional position encoding, applied after the blocks in ``insert_after``.

    Args:
        dim, num_heads, depth: model shape.
        insert_after: block indices, e.g. ``(0,)`` (default) or ``(0, 1, 2, 3, 4)``, or one index; one PEG each.
            Python or NumPy ints (also a 1-D integer array or tensor); not bools.
        kernel_size: depthwise kernel size (3).

    The model calls the scheme after each listed block with ``after_block`` set, which selects that block's PEG;
    with a single placement ``after_block`` may be omitted.
    """

    ndims = (2,)
    # the convolution mixes each token with its neighbours, later ones included, outside attention
    supports_causal = False

    def __init__(
        self,
        dim: int,
        num_heads: int = 1,
        depth: int = 1,
        insert_after: int | Sequence[int] = (0,),
        kernel_size: int = 3,
    ) -> None:
        super().__init__()
        check_model_shape(dim, num_heads, depth)
        given = insert_after
        if (isinstance(given, torch.Tensor) or type(given).__module__ == "numpy") and getattr(given, "ndim", 0) > 0:
            given = given.tolist()  # a 1-D integer tensor or NumPy array of block indices
        single = _block_index(given)
        if single is not None:
            blocks = (single,)
        elif isinstance(given, (tuple, list, range)):
            blocks = tuple(_block_index(b) for b in given)
        else:
            blocks = None
        if not blocks or any(b is None or not 0 <= b < depth for b in blocks) or list(blocks) != sorted(set(blocks)):
            raise ValueError(
                f"insert_after must be increasing distinct block indices in [0, {depth}), got {insert_after!r}"
            )
        self.insert_after = blocks
        self.dim = dim
        self.pegs = nn.ModuleList(PositionEncodingGenerator(dim, kernel_size) for _ in blocks)

    def forward(
        self,
        x: torch.Tensor,
        grid_size: tuple[int, ...],
        num_prefix_tokens: int,
        after_block: int | None = None,
    ) -> torch.Tensor:
        """``x`` (B, P + H W, C) -> same shape, PEG applied to the patch tokens."""
        grid_size = self.check_tokens(x, grid_size, num_prefix_tokens, self.dim)
        if after_block is None and len(self.pegs) == 1:
            index = 0
        elif after_block in self.insert_after:
            index = self.insert_after.index(after_block)
        else:
            raise ValueError(f"after_block must be one of insert_after={self.insert_after}, got {after_block!r}")
        return self.pegs[index](x, grid_size, num_prefix_tokens)

    def modules_after_blocks(self) -> dict[str, int]:
        """Each PEG runs after its block: ``{"pegs.j": insert_after[j]}``."""
        return {f"pegs.{j}": block for j, block in enumerate(self.insert_after)}

    def no_weight_decay(self) -> set[str]:
        """Every PEG parameter, kernels and biases: the released code (Twins' ``no_weight_decay`` lists every
        ``pos_block`` parameter, as timm's Twins does) keeps the whole generator out of weight decay."""
        return {f"pegs.{name}" for name, _ in self.pegs.named_parameters()}
