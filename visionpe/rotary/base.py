"""Base class for rotary schemes whose angle is linear in position: phi_j(p) = sum_a p_a * F[a, j].

Extrapolation-time scaling (SCHEMES.md A13: PI, NTK-aware, YaRN) acts on F per axis, see :mod:`.scaling`.

Memory: cos/sin tables are (heads, N, head_dim) per layer, 6 MB each for ViT-S at 1024 px (N = 4097); all
layers at once would be 300 MB. Schemes with one frequency set for every layer (RoPE-Axial) build their single
table once per forward; schemes with per-layer frequencies (RoPE-Mixed, STRING) keep the coordinates and
frequencies in the state and build each layer's table when that layer applies it, so only one layer's table
(plus those autograd keeps for backward) exists at a time.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..base import RotaryPositionEncoding, check_layer, check_model_shape
from ..grid import COORD_MODES
from .functional import apply_rotary, rotary_angles, rotary_tables, rotate_qkv_pairs_
from .scaling import Extrapolation, scale_frequencies, yarn_attention_factor

__all__ = ["LinearRotary", "LayerAngles"]


@dataclass(frozen=True)
class LayerAngles:
    """Rotary state of a scheme with per-layer frequencies: each layer's cos/sin are built when it applies them.

    ``coords`` (N, ndim) patch coordinates (or (B, 1, N, ndim) per sample: STRING's RGB-D depth), ``freqs``
    (depth | 1, num_heads | 1, ndim, head_dim // 2) frequencies
    after extrapolation scaling, ``mscale`` the YaRN multiplier of the tables; ``LinearRotary.layer_tables``
    builds one layer's tables from it.
    """

    coords: torch.Tensor
    freqs: torch.Tensor
    num_prefix_tokens: int
    mscale: float


class LinearRotary(RotaryPositionEncoding, Extrapolation):
    """Subclasses implement :meth:`frequencies`, returning (depth | 1, num_heads | 1, ndim, head_dim // 2).

    ``prepare`` returns the (1, num_heads | 1, P + N, head_dim) cos/sin tables when one frequency set serves
    every layer, else a :class:`LayerAngles` from which ``apply`` builds the layer's tables (see the module
    docstring for why).
    With ``extrapolation`` set, ``prepare`` rescales the frequencies for the current ``grid_size`` relative to
    the training grid (``grid_size`` at construction); the default ``"none"`` leaves them untouched.
    ``coord_mode`` is one of :data:`~visionpe.grid.COORD_MODES`; ``ref_scaled`` (i * n_train / n, position
    interpolation) is relative to the training grid, so it needs ``grid_size``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int,
        ndim: int,
        coord_mode: str = "index",
        grid_size: Sequence[int] | None = None,
        extrapolation: str = "none",
        yarn_alpha: float = 1.0,
        yarn_beta: float = 32.0,
    ) -> None:
        super().__init__()
        head_dim = check_model_shape(dim, num_heads, depth)
        if ndim not in (2, 3):
            raise ValueError(f"ndim must be 2 or 3, got {ndim!r}")
        if head_dim % 4:
            raise ValueError(f"head_dim must be divisible by 4 for rotary schemes, got head_dim={head_dim}")
        if not isinstance(coord_mode, str) or coord_mode not in COORD_MODES:
            raise ValueError(f"coord_mode must be one of {COORD_MODES}, got {coord_mode!r}")
        if coord_mode == "ref_scaled" and grid_size is None:
            raise ValueError(
                "coord_mode='ref_scaled' (i * n_train / n) needs the training grid: pass grid_size=... "
                "(the model passes it), got grid_size=None"
            )
        self.dim, self.num_heads, self.depth, self.ndim = dim, num_heads, depth, ndim
        self.head_dim, self.coord_mode = head_dim, coord_mode
        if grid_size is not None and len(grid_size) != ndim:
            raise ValueError(f"grid_size must have ndim={ndim} entries, got {tuple(grid_size)}")
        self.init_extrapolation(extrapolation, grid_size, yarn_alpha, yarn_beta)

    @property
    def ndims(self) -> tuple[int, ...]:  # the instance supports exactly the rank it was built for
        return (self.ndim,)

    @abstractmethod
    def frequencies(self) -> torch.Tensor:
        """(depth | 1, num_heads | 1, ndim, head_dim // 2) frequencies, rows in coordinate order."""

    def scaled_frequencies(self, grid_size: Sequence[int] | None = None) -> tuple[torch.Tensor, float]:
        """Frequencies for ``grid_size`` under the extrapolation mode, and the cos/sin multiplier (YaRN)."""
        freqs = self.frequencies()
        factors = self.scale_factors(grid_size)
        if factors is None:
            return freqs, 1.0
        freqs = scale_frequencies(
            freqs, factors, self.extrapolation, self.train_grid_size, self.yarn_alpha, self.yarn_beta
        )
        return freqs, yarn_attention_factor(factors) if self.extrapolation == "yarn" else 1.0

    def prepare(
        self, coords: torch.Tensor, num_prefix_tokens: int = 0, grid_size: tuple[int, ...] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | LayerAngles:
        freqs, mscale = self.scaled_frequencies(grid_size)
        if coords.ndim == 3:  # per-sample positions (B, N, ndim): (B, num_heads | 1, P + N, head_dim) per layer
            return LayerAngles(coords.unsqueeze(1), freqs, num_prefix_tokens, mscale)
        if freqs.shape[0] > 1:
            return LayerAngles(coords, freqs, num_prefix_tokens, mscale)
        return _tables(coords, freqs, num_prefix_tokens, mscale)

    def apply_qkv_(
        self,
        qkv: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor] | LayerAngles,
        layer: int,
        num_heads: int,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """fp32 in eager mode: q and k rotated in place in the fused projection output
        (:func:`~visionpe.rotary.functional.rotate_qkv_pairs_`), per image for per-sample tables and with
        patch dropout's ``keep`` (the kept rows of the tables, as :meth:`apply_kept`); otherwise None
        (:meth:`apply`: the real form for low precision, ONNX export and compiled graphs)."""
        if (
            qkv.dtype != torch.float32
            or torch.compiler.is_compiling()
            or torch.jit.is_tracing()
            or torch.onnx.is_in_onnx_export()
        ):
            return None
        cos, sin = self.layer_tables(state, layer) if keep is None else self.kept_tables(state, layer, keep)
        return rotate_qkv_pairs_(qkv, cos, sin, num_heads)

    def apply_kept(
        self,
        qk: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor] | LayerAngles,
        layer: int,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        """Patch dropout: the kept rows of the cos/sin tables, gathered per sample (:meth:`kept_tables`), rotate
        the kept tokens ``qk`` (..., B, num_heads, K, head_dim) directly (see
        :meth:`~visionpe.base.RotaryPositionEncoding.apply_kept`)."""
        cos, sin = self.kept_tables(state, layer, keep)
        if qk.ndim < 4 or (qk.shape[-4], qk.shape[-2], qk.shape[-1]) != (cos.shape[0], *cos.shape[-2:]):
            raise ValueError(
                f"qk must have shape (..., B={cos.shape[0]}, num_heads, K={cos.shape[-2]}, "
                f"head_dim={cos.shape[-1]}) for keep {tuple(keep.shape)}, got {tuple(qk.shape)}"
            )
        return apply_rotary(qk, cos, sin)

    def kept_tables(
        self, state: tuple[torch.Tensor, torch.Tensor] | LayerAngles, layer: int, keep: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (B, num_heads | 1, K, head_dim) of block ``layer`` at the tokens ``keep`` (B, K) of each sample
        (int64 indices into the P + N tokens of the prepared state)."""
        cos, sin = self.layer_tables(state, layer)
        if not isinstance(keep, torch.Tensor) or keep.ndim != 2 or keep.dtype != torch.int64:
            got = f"{tuple(keep.shape)} {keep.dtype}" if isinstance(keep, torch.Tensor) else type(keep).__name__
            raise ValueError(f"keep must be an int64 (B, K) index of the kept tokens, got {got}")
        if cos.ndim == 3:  # (num_heads | 1, T, head_dim): the rows of each sample's kept tokens
            return tuple(table[:, keep].transpose(0, 1) for table in (cos, sin))
        # per-sample tables (B, num_heads | 1, T, head_dim)
        if len(cos) != len(keep):
            raise ValueError(f"keep has {len(keep)} samples but the per-sample tables have {len(cos)}")
        index = keep[:, None, :, None].expand(-1, cos.shape[1], -1, cos.shape[-1])
        return cos.gather(2, index), sin.gather(2, index)

    def layer_tables(
        self, state: tuple[torch.Tensor, torch.Tensor] | LayerAngles, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (num_heads | 1, P + N, head_dim) of block ``layer`` from a ``prepare`` state
        ((B, num_heads | 1, P + N, head_dim) for per-sample positions)."""
        check_layer(layer, self.depth, type(self).__name__)
        if isinstance(state, LayerAngles):
            freqs = state.freqs[layer if state.freqs.shape[0] > 1 else 0]
            return _tables(state.coords, freqs, state.num_prefix_tokens, state.mscale)
        cos, sin = state
        if cos.shape[0] > 1:
            return cos[layer], sin[layer]
        return cos[0], sin[0]

    def apply(
        self, qk: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | LayerAngles, layer: int
    ) -> torch.Tensor:
        cos, sin = self.layer_tables(state, layer)
        if qk.ndim < 2 or qk.shape[-2] != cos.shape[-2] or qk.shape[-1] != cos.shape[-1]:
            raise ValueError(
                f"qk must have shape (..., P + N = {cos.shape[-2]}, head_dim = {cos.shape[-1]}) to match the "
                f"prepared state (cos/sin {tuple(cos.shape)}), got {tuple(qk.shape)}"
            )
        return apply_rotary(qk, cos, sin)


def _tables(
    coords: torch.Tensor, freqs: torch.Tensor, num_prefix_tokens: int, mscale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (..., P + N, head_dim) for frequencies (..., ndim, head_dim // 2)."""
    cos, sin = rotary_tables(rotary_angles(coords, freqs), num_prefix_tokens)
    if mscale != 1.0:
        # YaRN's temperature: every row (prefix included) so all logits scale alike
        cos, sin = cos * mscale, sin * mscale
    return cos, sin
