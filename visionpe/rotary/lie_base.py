"""Shared machinery of the Lie-group rotary schemes (LieRE, ComRoPE): R(p) = exp(sum_a p_a A_a) in b x b blocks.

``prepare`` keeps the (possibly PI-scaled) coordinates and sets up, once per forward, what every layer's
exponentials share (:meth:`LieBlockRotary.rotation_plan`: the word tables of all layers and the norms that set
their squaring counts); ``apply`` exponentiates the layer's generators for all tokens (never per image: positions
are shared by the batch), by default with the series of :class:`~visionpe.rotary.expm.LayerExponentials` in
:attr:`LieBlockRotary.series_dtype` (fp32 for LieRE, as the paper; fp64 for ComRoPE, whose exact relative property
fp32 squarings break), and rotates q and k per block with one batched product
(:func:`~visionpe.rotary.block_rotation.apply_block_rotation`). ComRoPE overrides :meth:`LieBlockRotary.rotation_plan`
with its cheaper commuting form (one exponential per distinct coordinate). Without autograd (inference), ``apply``
builds and applies the rotations a chunk of tokens at a time, so a layer's (h, N, m, b, b) stack and its fp64
series never exist whole.
Extrapolation: PI divides the coordinates. NTK and YaRN rescale frequencies, which LieRE's rotations have only
with 2 x 2 blocks (RoPE-Mixed with learned rates, :meth:`LieBlockRotary.scaled_generators`); for b >= 3 its
generators do not commute, so no basis turns every token's exponent into a set of planar rotations, and LieRE takes
PI only. ComRoPE's generators commute, and its subclasses rescale the eigenfrequencies of each block
(:meth:`rotation_plan` receives the per-axis factors); YaRN's multiplier scales the rotated q and k (:class:`LieState`).
Each block gets a :class:`BlockRotation` from the state (:mod:`visionpe.interfaces.rotary`).
Rotary value embeddings (``rotate_values=True``; García-Castellanos, Weiler, Bekkers, "RoVE: Rotary Value Embeddings
Attention for Relative Position-dependent Value Pathways", arXiv 2606.11275): v_j -> R(p_j) v_j before attention
and o_i -> R(p_i)^T o_i after it (the rotations are orthogonal: the inverse is the transpose), without YaRN's
multiplier. o_i = sum_j a_ij R(p_i)^T R(p_j) v_j, which is sum_j a_ij R(p_j - p_i) v_j where the generators commute
(ComRoPE, LieRE with 2 x 2 blocks or one axis) and only approximately so for LieRE's larger blocks.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..base import RotaryPositionEncoding, check_layer, check_model_shape
from ..checks import check_bool, is_int
from ..grid import validate_grid_size
from ..interfaces.rotary import IdentityRotation, LayerRotation, RotaryState
from ..tokens import gather_tokens, scatter_tokens
from .block_rotation import TokenRotations, apply_block_rotation
from .expm import LayerExponentials, block_skew_expm
from .scaling import SCALING_MODES, Extrapolation, yarn_attention_factor

__all__ = ["LieBlockRotary", "LieState", "BlockRotation"]

_CHUNK_TOKENS = 512  # tokens rotated at a time without autograd: bounds the (h, n, m, b, b) rotations in memory


class BlockRotation(LayerRotation):
    """One block's Lie-group rotation: ``rotations`` of the tokens after ``num_prefix_tokens`` unrotated ones,
    times YaRN's multiplier ``mscale`` (every token, the prefix too, as RoPE's tables). With ``rotate_values`` the
    values and attention's output are rotated too (by R and R^T, without ``mscale``)."""

    def __init__(
        self, rotations: TokenRotations, num_prefix_tokens: int, mscale: float = 1.0, rotate_values: bool = False
    ) -> None:
        self.rotations, self.num_prefix_tokens, self.mscale = rotations, num_prefix_tokens, mscale
        self.num_tokens = num_prefix_tokens + rotations.num_tokens
        self.values = rotate_values
        self._stack: torch.Tensor | None = None  # every token's rotations, built once for v and o (with autograd)

    def rotate(self, qk: torch.Tensor) -> torch.Tensor:
        out = self._rotate_blocks(qk)
        return out if self.mscale == 1.0 else out * self.mscale

    def rotate_values(self, v: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """R(p_j) v_j (``keep``: patch dropout's kept tokens, rotated on the full sequence and gathered back)."""
        return self._value_rotation(v, keep, transpose=False) if self.values else v

    def unrotate_output(self, o: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """R(p_i)^T o_i, the inverse rotation by the queries' positions."""
        return self._value_rotation(o, keep, transpose=True) if self.values else o

    def _value_rotation(self, x: torch.Tensor, keep: torch.Tensor | None, transpose: bool) -> torch.Tensor:
        if x.ndim != 4:
            raise ValueError(f"the values / attention output must be (B, num_heads, T, head_dim), got {tuple(x.shape)}")
        if keep is None:
            return self._rotate_blocks(x, transpose, cache=True)
        full = self._rotate_blocks(scatter_tokens(x, keep, self.num_tokens), transpose, cache=True)
        return gather_tokens(full, keep)

    def _rotate_blocks(self, qk: torch.Tensor, transpose: bool = False, cache: bool = False) -> torch.Tensor:
        """R x per block (R^T x with ``transpose``); ``cache``: keep every token's rotations for the next call."""
        num_prefix_tokens, tokens = self.num_prefix_tokens, self.rotations.num_tokens

        def chunk(start: int, stop: int) -> torch.Tensor:
            rot = self.rotations(start, stop)
            return rot.transpose(-1, -2) if transpose else rot

        if torch.is_grad_enabled():
            if not cache:
                return apply_block_rotation(qk, chunk(0, tokens), num_prefix_tokens)
            if self._stack is None:
                self._stack = self.rotations(0, tokens)
            rot = self._stack.transpose(-1, -2) if transpose else self._stack
            return apply_block_rotation(qk, rot, num_prefix_tokens)
        # no autograd: build and apply the rotations a chunk of tokens at a time, so the (h, N, m, b, b) stack of
        # the layer (and its fp64 series) never exists whole; the prefix is copied, not rotated by identities
        if qk.shape[-2] != num_prefix_tokens + tokens:  # let apply_block_rotation raise its shape error
            return apply_block_rotation(qk, chunk(0, tokens), num_prefix_tokens)
        if tokens <= _CHUNK_TOKENS and not num_prefix_tokens:
            return apply_block_rotation(qk, chunk(0, tokens))
        out = torch.empty_like(qk)
        out[..., :num_prefix_tokens, :] = qk[..., :num_prefix_tokens, :]
        for start in range(0, tokens, _CHUNK_TOKENS):
            stop = min(start + _CHUNK_TOKENS, tokens)
            rows = slice(num_prefix_tokens + start, num_prefix_tokens + stop)
            out[..., rows, :] = apply_block_rotation(qk[..., rows, :], chunk(start, stop))
        return out

    def rotate_qkv(
        self, qkv: torch.Tensor, batch: int, num_heads: int, keep: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """With autograd in eager mode: q and k rotated in place in the projection output
        (:meth:`~visionpe.rotary.block_rotation.TokenRotations.rotate_qkv_`), whose backward needs only the rotated
        vectors, then cut from it. Otherwise the default: without autograd :meth:`rotate` goes a chunk of tokens at
        a time, and a compiled or traced graph, YaRN's multiplier and patch dropout (``keep``, rotated on the full
        grid) take the out-of-place form."""
        if (
            keep is not None
            or not torch.is_grad_enabled()
            or torch.compiler.is_compiling()
            or torch.jit.is_tracing()
            or self.mscale != 1.0
        ):
            return super().rotate_qkv(qkv, batch, num_heads, keep)
        qkv = self.rotations.rotate_qkv_(qkv, num_heads, self.num_prefix_tokens, self.num_tokens)
        return IdentityRotation().rotate_qkv(qkv, batch, num_heads)


@dataclass(frozen=True)
class LieState(RotaryState):
    """What :meth:`LieBlockRotary.prepare` sets up for one forward."""

    coords: torch.Tensor  #: (N, ndim) positions of the rotated tokens (PI already applied)
    num_prefix_tokens: int  #: leading tokens left unrotated
    plan: Callable[[int], TokenRotations]  #: :meth:`LieBlockRotary.rotation_plan`: block -> its rotations
    mscale: float = 1.0  #: YaRN's multiplier of the rotated q and k (every token, the prefix too, as RoPE's tables)
    depth: int | None = None
    scheme: str = "LieBlockRotary"
    rotate_values: bool = False  #: rotary value embeddings: the blocks rotate v and o too

    def layer(self, index: int) -> BlockRotation:
        check_layer(index, self.depth, self.scheme)
        return BlockRotation(self.plan(index), self.num_prefix_tokens, self.mscale, self.rotate_values)


class LieBlockRotary(RotaryPositionEncoding, Extrapolation):
    """Base class: subclasses implement :meth:`generators` -> (num_heads | 1, head_dim // b, ndim, b, b)."""

    grid_ranks = (2, 3)

    @property
    def supported_extrapolation(self) -> tuple[str, ...]:
        """PI always; NTK and YaRN with 2 x 2 blocks, whose rates are frequencies (:meth:`scaled_generators`)."""
        return SCALING_MODES if self.block_size == 2 else ("none", "pi")

    #: working precision of the default per-token exponential (:meth:`rotations`); the result is fp32 either way
    series_dtype: torch.dtype = torch.float32

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int,
        block_size: int,
        ndim: int,
        grid_size: Sequence[int] | None,
        extrapolation: str,
        rotate_values: bool = False,
    ) -> None:
        super().__init__()
        head_dim = check_model_shape(dim, num_heads, depth)
        self.rotate_values = check_bool(rotate_values, "rotate_values")
        if not is_int(block_size) or block_size < 2 or head_dim % block_size:
            raise ValueError(f"block_size must be >= 2 and divide head_dim={head_dim}, got block_size={block_size}")
        if ndim not in (2, 3):
            raise ValueError(f"ndim must be 2 or 3, got {ndim!r}")
        if is_int(grid_size):  # the same size on every axis, as timm takes img_size=224
            grid_size = (grid_size,) * ndim
        if isinstance(grid_size, (tuple, list)) and len(grid_size) != ndim:
            raise ValueError(f"grid_size must have ndim={ndim} entries, got {tuple(grid_size)}")
        if grid_size is not None:
            grid_size = validate_grid_size(grid_size, "grid_size", ndims=(ndim,))
        self.dim, self.num_heads, self.depth, self.ndim = dim, num_heads, depth, ndim
        self.head_dim, self.block_size, self.num_blocks = head_dim, block_size, head_dim // block_size
        self.init_extrapolation(extrapolation, grid_size)

    @property
    def ndims(self) -> tuple[int, ...]:
        return (self.ndim,)

    def no_weight_decay(self) -> set[str]:
        """Every learned generator parameter (LieRE's, ComRoPE's blocks and LD multipliers): they set the rotation
        rates, the role RoPE-Mixed's learned frequencies play (which its reference keeps out of weight decay), and
        weight decay would pull them towards the identity rotation."""
        return {name for name, _ in self.named_parameters(recurse=False)}

    @abstractmethod
    def generators(self, layer: int) -> torch.Tensor:
        """(num_heads | 1, num_blocks, ndim, b, b) skew-symmetric generators of block ``layer``."""

    def layer_generators(self) -> torch.Tensor:
        """(L, num_heads | 1, num_blocks, ndim, b, b) generators of every layer (L = depth, or 1 when shared)."""
        return torch.stack([self.generators(layer) for layer in range(self.depth)])

    def prefix_coords(self, num_prefix_tokens: int, coords: torch.Tensor) -> torch.Tensor | None:
        """Coordinates of rotated prefix tokens, or None: prefix tokens get the identity."""
        return None

    def prepare(
        self, coords: torch.Tensor, num_prefix_tokens: int = 0, grid_size: tuple[int, ...] | None = None
    ) -> LieState:
        """(coordinates, prefix tokens left unrotated, :meth:`rotation_plan` of the coordinates, YaRN multiplier)."""
        coords = coords.float()
        factors = self.scale_factors(grid_size)
        if factors is not None and self.extrapolation == "pi":  # p_a -> p_a / s_a
            coords, factors = coords / torch.tensor(factors, device=coords.device), None
        prefix = self.prefix_coords(num_prefix_tokens, coords) if num_prefix_tokens else None
        if prefix is not None:
            coords, num_prefix_tokens = torch.cat((prefix, coords)), 0
        name, values = type(self).__name__, self.rotate_values
        if factors is None:
            return LieState(coords, num_prefix_tokens, self.rotation_plan(coords), 1.0, self.depth, name, values)
        # NTK / YaRN: the generators' frequencies are rescaled (schemes whose generators have them)
        mscale = yarn_attention_factor(factors) if self.extrapolation == "yarn" else 1.0
        plan = self.rotation_plan(coords, factors)
        return LieState(coords, num_prefix_tokens, plan, mscale, self.depth, name, values)

    def rotations(self, coords: torch.Tensor, layer: int) -> torch.Tensor:
        """(num_heads | 1, N, num_blocks, b, b) fp32 rotations of block ``layer`` at ``coords`` (N, ndim)."""
        check_layer(layer, self.depth, type(self).__name__)
        return block_skew_expm(self.generators(layer), coords, self.series_dtype)

    def rotation_chunks(self, coords: torch.Tensor, layer: int) -> TokenRotations:
        """``fn(start, stop)``: ``self.rotations(coords, layer)[:, start:stop]``, built for those tokens only."""
        check_layer(layer, self.depth, type(self).__name__)
        return LayerExponentials(self.generators(layer).unsqueeze(0), coords, self.series_dtype).layer(0)

    def rotation_plan(
        self, coords: torch.Tensor, factors: Sequence[float] | None = None
    ) -> Callable[[int], TokenRotations]:
        """``plan(layer)`` is layer ``layer``'s :class:`~visionpe.rotary.block_rotation.TokenRotations` at
        ``coords``; built once per forward (in :meth:`prepare`), it sets up what every layer needs at once: the word
        tables of all layers' series and the norms that set their squaring counts
        (:class:`~visionpe.rotary.expm.LayerExponentials`). ``factors``: per-axis NTK / YaRN factors; the
        generators' rates are rescaled (:meth:`scaled_generators`, 2 x 2 blocks only).
        """
        generators = self.layer_generators()
        if factors is not None:
            generators = self.scaled_generators(generators, factors)
        return LayerExponentials(generators, coords, self.series_dtype).layer

    def scaled_generators(self, generators: torch.Tensor, factors: Sequence[float]) -> torch.Tensor:
        """``generators`` (..., m, ndim, 2, 2) with every rate rescaled by the NTK or YaRN rule of the current mode.

        A 2 x 2 skew block is a rate times the quarter turn, so its exponent sum_a p_a A_a turns the pair by
        sum_a p_a A_a[1, 0]: RoPE-Mixed with learned frequencies, rescaled per axis by
        :func:`~visionpe.rotary.scaling.scale_frequencies` (NTK's band index per axis over the head's pairs, as
        for RoPE-Mixed). The factor is a constant of the backward, as it is for RoPE-Mixed's learned frequencies.
        """
        if generators.shape[-1] != 2:
            raise ValueError(
                f"{type(self).__name__} with {generators.shape[-1]} x {generators.shape[-1]} blocks has no "
                "frequencies to rescale (its generators do not commute): extrapolation 'pi' only"
            )
        ratio = self.frequency_multipliers(generators[..., 1, 0].transpose(-1, -2), factors)  # (..., ndim, m)
        return generators * ratio.transpose(-1, -2)[..., None, None]
