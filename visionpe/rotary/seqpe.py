"""SeqPE: Li et al., "SeqPE: Transformer with Sequential Position Encoding", arXiv 2506.13277, 2025.

A patch at (y, x) is written as a sequence of decimal digits, each axis left-padded with zeros to ``max_digits``,
row first: (2, 3) -> [0, 2, 0, 3] with two digits per axis. A small causal transformer (GPT-2 style, pre-LN) reads
the digits and a learned summary token appended last; the summary's output, projected to the model width C, is the
position vector e(p). Each block l turns it into two multipliers, (pe_q, pe_k) = W_l e(p) + b_l (a Linear(C, 2C)
split per head), and multiplies them into q and k elementwise: q_i <- q_i * pe_q(p_i), k_j <- k_j * pe_k(p_j). This
is a q/k *modulation*, not a rotation: it does not preserve norms and the scores are not a function of the offset
alone. The scheme has kind "rotary" because it enters attention through q and k, by the typed rotary interface
(:mod:`visionpe.interfaces.rotary`). Prefix tokens (cls, registers) get a learned ``cls_token_pos_embed`` in place of
e(p), which goes through the same per-block Linear.

Two training losses shape the position vectors (:meth:`SeqPE.auxiliary_losses`, added to cross-entropy with
weight 0.1 each by :class:`visionpe.training.Classifier`):

- ``seqpe_ct`` (contrastive): pivots and candidates drawn from the ``side x side`` grid of ``pe_max_position``
  positions; the label is the candidate nearest to the pivot in squared Euclidean distance, the logits the dot
  products e(pivot) . e(candidate), and the loss their cross-entropy.
- ``seqpe_tr`` (out-of-distribution transfer): a window of the training grid's size placed where the training grid
  never is (origin y >= H0 or x >= W0) should have the similarity structure of the training grid itself:
  symmetric KL between softmax(S S^T) of the window's vectors S and the detached softmax(T T^T) of the same
  offsets on the training grid T, per attention head.

A larger grid at evaluation encodes its new integers directly ("extend"); a grid whose indices need more digits
than ``max_digits`` raises a ValueError. The PE network runs once per forward on the grid's digit sequences, not
per image, and its output is cached per grid in evaluation mode (dropout is off there, so it is deterministic).

Where the released code (ghrua/seqpe, ``image_seqpe``) and this module differ, the docstrings say so and mark the
library's reading.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

import torch
import torch.nn.functional as F
from timm.layers import GELUTanh, Mlp, trunc_normal_
from timm.models.vision_transformer import Block
from torch import nn

from ..base import RotaryPositionEncoding, check_layer, check_model_shape
from ..checks import check_float, check_int
from ..grid import validate_grid_size
from ..interfaces.rotary import LayerRotation, RotaryState
from ..registry import register_scheme
from ..tokens import gather_tokens

__all__ = ["SeqPE", "SeqPEEncoder", "SeqPEState", "SeqPEModulation", "pos2seq", "max_digits_for", "contrastive_batch"]

_DEFAULT_TRAIN_GRID = (14, 14)  # 224 px at patch 16, when the model does not say
_SHIFT_SEED = 0  # the pre-drawn shift origins come from this seed, so every run (and a resumed one) has the same ones
_CACHE_SIZE = 8  # grids whose position vectors are kept in evaluation mode
#: positions the PE network encodes at once when autograd does not record it (1024 px ViT-S: 4,096 patches)
_ENCODE_CHUNK = 512


def max_digits_for(pe_max_position: int) -> int:
    """Digits per axis for ``pe_max_position`` positions on a square grid: len(str(floor(sqrt(n)) - 1)).

    Example:
        >>> max_digits_for(10000)  # a 100 x 100 grid: indices 0..99
        2
    """
    check_int(pe_max_position, "pe_max_position", min=4)
    return len(str(math.isqrt(pe_max_position) - 1))


def pos2seq(positions: torch.Tensor, max_digits: int) -> torch.Tensor:
    """Decimal digits of integer positions (..., ndim), each axis left-padded with zeros to ``max_digits``, axes in
    order (row first): (..., ndim * max_digits) int64. The reference's ``PeUtils.pos2seq`` per axis, concatenated.

    Pads are real zeros (the reference's ``mask_padding=False``): 7 and 07 are the same sequence.

    Example:
        >>> pos2seq(torch.tensor([[2, 3], [12, 0]]), 2).tolist()
        [[0, 2, 0, 3], [1, 2, 0, 0]]
    """
    check_int(max_digits, "max_digits", min=1)
    if not isinstance(positions, torch.Tensor) or positions.ndim < 1:
        raise TypeError(f"positions must be a (..., ndim) tensor of integer positions, got {type(positions).__name__}")
    positions = positions.long()
    powers = 10 ** torch.arange(max_digits - 1, -1, -1, device=positions.device)  # most significant first
    return torch.div(positions[..., None], powers, rounding_mode="floor").remainder(10).flatten(-2)


def _gpt2_mlp(*, drop: float, **kwargs) -> Mlp:
    """GPT-2's MLP: dropout after the output projection only (timm's Mlp would also drop after the activation)."""
    return Mlp(drop=(0.0, drop), **kwargs)


class SeqPEEncoder(nn.Module):
    """The PE network: digit sequences (M, L) -> position vectors (M, out_dim).

    Embedding of digit t at slot s of axis a: ``digit[t] + slot[s] + axis[a]``; a learned summary token is appended
    last (without slot or axis embedding). Then ``depth`` GPT-2 blocks (timm :class:`~timm.models.vision_transformer.
    Block` with a causal mask: pre-LN, MLP 4D with GELU's tanh approximation, dropout ``dropout`` on both residual
    branches, none on the attention weights as in the reference recipe), a final LayerNorm, and Linear(D, out_dim) of
    the summary token's output. Every Linear, embedding and token is initialised trunc-normal(0.02), biases zero.
    """

    def __init__(
        self,
        out_dim: int,
        num_digits: int,
        max_digits: int,
        embed_dim: int = 384,
        num_heads: int = 6,
        depth: int = 2,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        check_model_shape(embed_dim, num_heads, depth)
        check_int(out_dim, "out_dim", min=1)
        check_int(max_digits, "max_digits", min=1)
        check_int(num_digits, "num_digits", min=max_digits)
        if num_digits % max_digits:
            raise ValueError(f"num_digits must be a multiple of max_digits={max_digits}, got {num_digits}")
        check_float(dropout, "dropout", min=0, max=1, max_open=True)
        self.num_digits, self.max_digits = num_digits, max_digits
        self.digit_embed = nn.Embedding(10, embed_dim)
        self.slot_embed = nn.Parameter(torch.zeros(num_digits, embed_dim))
        self.axis_embed = nn.Parameter(torch.zeros(num_digits // max_digits, embed_dim))
        self.summary_token = nn.Parameter(torch.zeros(embed_dim))
        self.blocks = nn.ModuleList(
            Block(
                embed_dim,
                num_heads,
                mlp_ratio=4.0,
                qkv_bias=True,
                proj_drop=dropout,
                attn_drop=0.0,
                act_layer=GELUTanh,
                norm_layer=nn.LayerNorm,
                mlp_layer=_gpt2_mlp,
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(embed_dim)
        self.proj = nn.Linear(embed_dim, out_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        for param in (self.digit_embed.weight, self.slot_embed, self.axis_embed, self.summary_token):
            trunc_normal_(param, std=0.02)

    def forward(self, digits: torch.Tensor) -> torch.Tensor:
        """``digits`` (M, num_digits) int64 in [0, 9] -> (M, out_dim)."""
        if digits.ndim != 2 or digits.shape[1] != self.num_digits:
            raise ValueError(f"digits must have shape (M, {self.num_digits}), got {tuple(digits.shape)}")
        axis = self.axis_embed.repeat_interleave(self.max_digits, dim=0)  # slot s belongs to axis s // max_digits
        x = self.digit_embed(digits) + (self.slot_embed + axis)
        x = torch.cat((x, self.summary_token.expand(x.shape[0], 1, -1)), dim=1)
        for block in self.blocks:
            x = block(x, is_causal=True)
        return self.proj(self.norm(x[:, -1]))


class SeqPEModulation(LayerRotation):
    """One block's q/k modulation: q and k multiplied elementwise by per-token multipliers (not a rotation).

    ``table`` (2, W, heads, T, head_dim): pe_q and pe_k of the T = prefix + patch tokens for W position windows
    (W = 1 normally; the training-time shift gives image b the window b mod W).
    """

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.num_tokens = table.shape[-2]

    def _per_image(self, batch: int) -> torch.Tensor:
        """(2, B | 1, heads, T, head_dim): the window of each image."""
        windows = self.table.shape[1]
        if windows == 1:
            return self.table
        return self.table[:, torch.arange(batch, device=self.table.device) % windows]

    def rotate(self, qk: torch.Tensor) -> torch.Tensor:
        """``qk`` (2, B, heads, T, head_dim), q and k stacked in front: q * pe_q, k * pe_k; (2, B, ..., heads, T,
        head_dim) with axes between the batch and the heads (the views of a multi-view model) modulates each alike.
        A tensor without the stacked axis, (B, heads, T, head_dim), is modulated as queries
        (``RotaryPositionEncoding.rotate``)."""
        if qk.ndim == 4:
            return qk * self._per_image(qk.shape[0])[0].to(qk.dtype)
        if qk.ndim < 5 or qk.shape[0] != 2:
            raise ValueError(
                "qk must be q and k stacked as (2, B, ..., heads, T, head_dim) or one (B, heads, T, head_dim) "
                f"tensor, got shape {tuple(qk.shape)}"
            )
        table = self._per_image(qk.shape[1])
        table = table.reshape(*table.shape[:2], *(1,) * (qk.ndim - 5), *table.shape[2:])
        return qk * table.to(qk.dtype)

    def rotate_kept(self, qk: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Patch dropout: the rows of the multipliers that each image kept, ``keep`` (B, K), gathered."""
        table = self._per_image(keep.shape[0]).expand(2, keep.shape[0], *self.table.shape[2:])
        kept = gather_tokens(table, keep).to(qk.dtype)
        return qk * (kept if qk.ndim == 5 else kept[0])


@dataclass(frozen=True)
class SeqPEState(RotaryState):
    """What :meth:`SeqPE.prepare` builds once per forward: the position vectors of the patches and prefix tokens
    (W, T, C); each block's :class:`SeqPEModulation` is its Linear(C, 2C) of them, split per head."""

    coords: torch.Tensor  #: (N, 2) the patches' (y, x) positions
    vectors: torch.Tensor  #: (W, prefix + N, C) position vectors (W windows, 1 unless shifted in training)
    weight: torch.Tensor  #: (depth, 2C, C) the blocks' Linear(C, 2C) weights
    bias: torch.Tensor  #: (depth, 2C) and biases
    num_heads: int

    def layer(self, index: int) -> SeqPEModulation:
        check_layer(index, self.weight.shape[0], "SeqPE")
        return SeqPEModulation(_modulation_table(self.vectors, self.weight[index], self.bias[index], self.num_heads))


def _modulation_table(vectors: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(2, W, heads, T, head_dim) multipliers W e + b of position vectors (W, T, C), in the weights' dtype without
    autocast."""
    with torch.autocast(vectors.device.type, enabled=False):
        table = F.linear(vectors.to(weight.dtype), weight, bias)  # (W, T, 2C)
    windows, tokens = table.shape[:2]
    return table.view(windows, tokens, 2, num_heads, -1).permute(2, 0, 3, 1, 4)


@register_scheme("seqpe")
class SeqPE(RotaryPositionEncoding):
    """Sequential position encoding: digit sequences -> a causal transformer -> per-block q/k multipliers.

    Args:
        dim, num_heads, depth: model shape (one Linear(dim, 2 dim) per block).
        embed_dim: D, width of the PE network (384).
        encoder_heads: its attention heads (6).
        encoder_depth: its blocks (2).
        dropout: its residual dropout (0.1; the reference uses 0.3 for ViT-B).
        pe_max_position: positions of the square grid the PE is trained on (10000: 100 x 100), which sets
            ``max_digits`` = len(str(floor(sqrt(pe_max_position)) - 1)) digits per axis (2).
        grid_size: the training grid (H0, W0), which the model passes; (14, 14) when not given [visionpe]. The
            transfer loss and the shift use it.
        contrastive_weight, transfer_weight: weights of ``seqpe_ct`` and ``seqpe_tr`` in the training loss (0.1, 0.1;
            0 turns a loss off).
        contrastive_pivots, contrastive_candidates: pivots per step and candidates per pivot (32, 64).
        transfer_windows, transfer_offsets: out-of-distribution windows per step and offsets per window (32, 64;
            the offsets are capped at H0 W0).
        shift_prob: probability per training forward of the shift augmentation (0.1): the training grid's patches
            take the positions of ``shift_windows`` (32) windows placed at origins from ``shift_origins`` (320)
            pre-drawn ones, image b the window b mod 32. Training mode and the training grid only; evaluation
            never shifts.

    The module docstring gives the formula; :meth:`auxiliary_losses` the losses.
    """

    #: options that make a training forward deterministic (no dropout in the PE network, no shift): training
    #: forwards otherwise differ from call to call by design
    deterministic_options: ClassVar[Mapping[str, float]] = MappingProxyType({"dropout": 0.0, "shift_prob": 0.0})
    #: positions are read as integer digits: a coordinate augmentation (jitter, scaling) has nothing to act on
    consumes_coords: ClassVar[bool] = False
    ndims = (2,)
    coord_mode = "index"
    auxiliary_loss_weights: dict[str, float]

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        embed_dim: int = 384,
        encoder_heads: int = 6,
        encoder_depth: int = 2,
        dropout: float = 0.1,
        pe_max_position: int = 10000,
        grid_size: Sequence[int] | None = None,
        contrastive_weight: float = 0.1,
        transfer_weight: float = 0.1,
        contrastive_pivots: int = 32,
        contrastive_candidates: int = 64,
        transfer_windows: int = 32,
        transfer_offsets: int = 64,
        shift_prob: float = 0.1,
        shift_windows: int = 32,
        shift_origins: int = 320,
    ) -> None:
        super().__init__()
        self.head_dim = check_model_shape(dim, num_heads, depth)
        for arg, value in (
            ("embed_dim", embed_dim),
            ("encoder_heads", encoder_heads),
            ("encoder_depth", encoder_depth),
        ):
            check_int(value, arg, min=1)
        if embed_dim % encoder_heads:
            raise ValueError(
                f"embed_dim must be divisible by encoder_heads, got embed_dim={embed_dim}, "
                f"encoder_heads={encoder_heads}"
            )
        self.dim, self.num_heads, self.depth = dim, num_heads, depth
        self.max_digits = max_digits_for(pe_max_position)
        self.pe_max_position = pe_max_position
        self.side = math.isqrt(pe_max_position)  # the contrastive and transfer positions lie in [0, side)^2
        for name, value in (("contrastive_weight", contrastive_weight), ("transfer_weight", transfer_weight)):
            check_float(value, name, min=0)
        self.auxiliary_loss_weights = {"seqpe_ct": float(contrastive_weight), "seqpe_tr": float(transfer_weight)}
        self.contrastive_pivots = check_int(contrastive_pivots, "contrastive_pivots", min=1)
        self.contrastive_candidates = check_int(contrastive_candidates, "contrastive_candidates", min=1)
        if contrastive_candidates >= self.side**2:
            raise ValueError(
                f"contrastive_candidates must be below the {self.side**2} positions of the pe_max_position grid "
                f"(pe_max_position={pe_max_position}), got {contrastive_candidates}"
            )
        self.transfer_windows = check_int(transfer_windows, "transfer_windows", min=1)
        self.transfer_offsets = check_int(transfer_offsets, "transfer_offsets", min=2)
        self.shift_prob = check_float(shift_prob, "shift_prob", min=0, max=1)
        self.shift_windows = check_int(shift_windows, "shift_windows", min=1)
        self.shift_origins = check_int(shift_origins, "shift_origins", min=1)
        if shift_windows > shift_origins:
            raise ValueError(
                f"shift_windows must be <= shift_origins={shift_origins} (windows are drawn from the pre-drawn "
                f"origins), got {shift_windows}"
            )
        self.encoder = SeqPEEncoder(
            dim, 2 * self.max_digits, self.max_digits, embed_dim, encoder_heads, encoder_depth, dropout
        )
        # the blocks' Linear(C, 2C) maps, one tensor for all blocks (as the per-layer tables of the other schemes)
        self.qk_weight = nn.Parameter(trunc_normal_(torch.empty(depth, 2 * dim, dim), std=0.02))
        self.qk_bias = nn.Parameter(torch.zeros(depth, 2 * dim))
        self.cls_token_pos_embed = nn.Parameter(trunc_normal_(torch.zeros(dim), std=0.02))
        self.train_grid_size = _DEFAULT_TRAIN_GRID
        self.set_grid_size(_DEFAULT_TRAIN_GRID if grid_size is None else grid_size)
        self._cache: OrderedDict = OrderedDict()
        self._shifted = False  # whether the last training forward was shifted (the transfer loss skips that step)

    # -- grids and digits -------------------------------------------------------------------------------------------
    def set_grid_size(self, grid_size: tuple[int, ...]) -> None:
        """The training grid (the model's nominal grid): the transfer loss's in-distribution grid and the shift's
        window. Raises if its indices need more than ``max_digits`` digits."""
        self.train_grid_size = self._check_digits(self.check_grid(grid_size), "grid_size")
        self.register_buffer("shift_origin_table", self._shift_origin_table(), persistent=False)

    def _shift_origin_table(self) -> torch.Tensor:
        """(shift_origins, 2) int64 origins (oy, ox) in [0, side - H0] x [0, side - W0] of the training grid, the
        reference's shift windows, drawn once per grid from a fixed seed [visionpe]: every run, and a run resumed
        from a checkpoint, shifts to the same windows."""
        height, width = self.train_grid_size
        ny, nx = max(self.side - height + 1, 1), max(self.side - width + 1, 1)
        order = torch.randperm(ny * nx, generator=torch.Generator().manual_seed(_SHIFT_SEED))[: self.shift_origins]
        return torch.stack((order // nx, order % nx), 1)

    def fixed_buffers(self) -> dict[str, torch.Tensor]:
        return {"shift_origin_table": self._shift_origin_table()}

    def _check_digits(self, grid_size: tuple[int, ...], name: str) -> tuple[int, ...]:
        largest = max(grid_size) - 1
        if largest >= 10**self.max_digits:
            raise ValueError(
                f"{name} {tuple(grid_size)} has index {largest}, which needs {len(str(largest))} digits, but "
                f"SeqPE writes max_digits={self.max_digits} digits per axis (pe_max_position={self.pe_max_position}): "
                f"expected a grid of at most {10**self.max_digits} patches per side; raise pe_max_position"
            )
        return tuple(grid_size)

    def _check_positions(self, coords: torch.Tensor) -> None:
        """Eager check that ``coords`` are non-negative integers of at most ``max_digits`` digits."""
        if torch.compiler.is_compiling() or torch.jit.is_tracing() or coords.numel() == 0:
            return
        if not bool((coords == coords.round()).all()) or bool((coords < 0).any()):
            raise ValueError("coords must be non-negative integer 'index' positions for SeqPE, got other values")
        largest = int(coords.max())
        if largest >= 10**self.max_digits:
            raise ValueError(
                f"coords hold index {largest}, which needs {len(str(largest))} digits, but SeqPE writes "
                f"max_digits={self.max_digits} digits per axis (pe_max_position={self.pe_max_position}): expected "
                f"indices below {10**self.max_digits}"
            )

    def encode(self, positions: torch.Tensor) -> torch.Tensor:
        """Position vectors e(p) (..., C) of integer positions (..., 2), by the PE network (its dropout is active in
        training mode), without autocast."""
        digits = pos2seq(positions, self.max_digits)
        flat = digits.reshape(-1, digits.shape[-1])
        with torch.autocast(flat.device.type, enabled=False):
            if torch.is_grad_enabled() or flat.shape[0] <= _ENCODE_CHUNK:
                vectors = self.encoder(flat)
            else:  # no autograd: a few positions at a time, so the MLP's activations of every position never coexist
                vectors = torch.cat([self.encoder(chunk) for chunk in flat.split(_ENCODE_CHUNK)])
        return vectors.reshape(*positions.shape[:-1], -1)

    # -- forward ----------------------------------------------------------------------------------------------------
    def _cache_key(self, coords: torch.Tensor, grid_size: tuple[int, ...] | None) -> tuple:
        params = tuple((p.data_ptr(), p._version) for p in self.encoder.parameters())
        return (grid_size, tuple(coords.shape), coords.device, params)

    def _patch_vectors(self, coords: torch.Tensor, grid_size: tuple[int, ...] | None) -> torch.Tensor:
        """(W, N, C): e(p) of the patches (W = 1), or of ``shift_windows`` shifted windows in a shifted training
        forward; cached per grid in evaluation mode without autograd."""
        self._shifted = False
        if self.training:
            if (
                self.shift_prob > 0
                and grid_size is not None
                and tuple(grid_size) == self.train_grid_size
                and float(torch.rand(())) < self.shift_prob
            ):
                self._shifted = True
                pick = torch.randperm(self.shift_origin_table.shape[0])[: self.shift_windows]
                origins = self.shift_origin_table[pick].to(coords.device, coords.dtype)  # (W, 2)
                return self.encode(coords[None] + origins[:, None])
            return self.encode(coords)[None]
        caching = not (torch.is_grad_enabled() or torch.compiler.is_compiling() or torch.jit.is_tracing())
        if not caching:
            return self.encode(coords)[None]
        key = self._cache_key(coords, grid_size)
        hit = self._cache.get(key)
        if hit is not None and torch.equal(hit[0], coords):
            self._cache.move_to_end(key)
            return hit[1]
        vectors = self.encode(coords)[None]
        self._cache[key] = (coords.clone(), vectors)
        while len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return vectors

    def prepare(
        self, coords: torch.Tensor, num_prefix_tokens: int = 0, grid_size: tuple[int, ...] | None = None
    ) -> SeqPEState:
        """Position vectors of the ``num_prefix_tokens`` prefix tokens (``cls_token_pos_embed``) and of the patches
        at ``coords`` (N, 2) integer (y, x) indices; ValueError for a ``grid_size`` (or coordinates) beyond
        ``max_digits`` digits per axis."""
        if grid_size is not None:
            grid_size = self._check_digits(validate_grid_size(grid_size, ndims=(2,)), "grid_size")
        self._check_positions(coords)
        vectors = self._patch_vectors(coords.float(), grid_size)
        if num_prefix_tokens:
            prefix = self.cls_token_pos_embed.to(vectors.dtype).expand(vectors.shape[0], num_prefix_tokens, -1)
            vectors = torch.cat((prefix, vectors), dim=1)
        return SeqPEState(coords, vectors, self.qk_weight, self.qk_bias, self.num_heads)

    def rotations(self, coords: torch.Tensor, layer: int) -> torch.Tensor:
        """(2, heads, N, head_dim) multipliers (pe_q, pe_k) of block ``layer`` at the positions ``coords`` (N, 2),
        in the weights' dtype (fp32) whatever the autocast: what this modulation multiplies q and k with, where the
        rotary schemes have per-token rotations (LieRE's ``rotations``)."""
        check_layer(layer, self.depth, type(self).__name__)
        self._check_positions(coords)
        vectors = self.encode(coords)[None]
        return _modulation_table(vectors, self.qk_weight[layer], self.qk_bias[layer], self.num_heads)[:, 0]

    def no_weight_decay(self) -> set[str]:
        """The PE network, ``cls_token_pos_embed`` and the per-block biases: the reference trains the PE model without
        weight decay (``seqpe_decay 0``) and keeps ``cls_token_pos_embed`` out of it; the per-block Linear weights
        (``qk_weight``) decay as the model's other weights."""
        return {f"encoder.{name}" for name, _ in self.encoder.named_parameters()} | {"cls_token_pos_embed", "qk_bias"}

    # -- training losses --------------------------------------------------------------------------------------------
    def auxiliary_losses(self, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """The training losses of the position vectors, unweighted, by name (their weights are
        :attr:`auxiliary_loss_weights`; a term of weight 0 is not computed):

        - ``seqpe_ct``: contrastive. ``contrastive_pivots`` pivots, ``contrastive_candidates`` candidates each
          (:func:`contrastive_batch`), logits e(pivot) . e(candidate), cross-entropy against the nearest candidate.
        - ``seqpe_tr``: transfer. ``transfer_windows`` windows of the training grid's size at origins with
          y >= H0 or x >= W0 (inside the ``side x side`` grid), ``transfer_offsets`` offsets o of each; with S the
          vectors of origin + o and T those of o (detached), split per attention head,
          KL(softmax(T T^T) || softmax(S S^T)) + KL(softmax(S S^T) || softmax(T T^T)), averaged over every entry of
          the n x n matrices as the reference's ``kl_div`` (its default 'mean': the per-row KL divided by n).
          Skipped after a shifted forward (the reference transfers only on unshifted steps).

        One PE network call computes every vector (dropout active in training mode, as in the reference, which
        feeds them with the main positions through one call). ``generator`` drives the sampling (the global RNG
        when None; dropout always uses the global RNG).
        """
        device = self.cls_token_pos_embed.device
        want_ct = self.auxiliary_loss_weights["seqpe_ct"] > 0
        want_tr = self.auxiliary_loss_weights["seqpe_tr"] > 0 and not (self.training and self._shifted)
        groups: list[torch.Tensor] = []
        if want_ct:
            pivots, candidates, labels = contrastive_batch(
                self.contrastive_pivots,
                self.contrastive_candidates,
                self.side,
                self.max_digits,
                generator=generator,
            )
            groups += [pivots, candidates.flatten(0, 1)]
        if want_tr:
            teacher, student, offsets = self._transfer_positions(generator)
            groups += [teacher, student.flatten(0, 1)]
        if not groups:
            return {}
        sizes = [g.shape[0] for g in groups]
        vectors = self.encode(torch.cat(groups).to(device)).split(sizes)
        losses = {}
        if want_ct:
            pivot, cand = vectors[0], vectors[1].view(*candidates.shape[:2], -1)
            logits = torch.einsum("pc,pkc->pk", pivot, cand)
            losses["seqpe_ct"] = F.cross_entropy(logits, labels.to(device))
        if want_tr:
            grid, student = vectors[-2], vectors[-1].view(*offsets.shape, -1)
            teacher = grid.detach()[offsets.to(device)]  # (windows, n, C)
            losses["seqpe_tr"] = _symmetric_kl(student, teacher, self.num_heads)
        return losses

    def _transfer_positions(self, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the training grid's positions (H0 W0, 2), the students' positions (windows, n, 2), the offsets' flat
        indices into the training grid (windows, n))."""
        height, width = self.train_grid_size
        ny, nx = self.side - height, self.side - width  # origins in [0, side - H0) x [0, side - W0), as the reference
        oy, ox = torch.meshgrid(torch.arange(max(ny, 0)), torch.arange(max(nx, 0)), indexing="ij")
        valid = (oy >= height) | (ox >= width)
        origins = torch.stack((oy[valid], ox[valid]), 1)
        if origins.shape[0] == 0:
            raise ValueError(
                f"the transfer loss needs windows of the training grid {self.train_grid_size} outside it (origin y >= "
                f"{height} or x >= {width}) within the {self.side} x {self.side} grid of pe_max_position="
                f"{self.pe_max_position}, and there is none: expected pe_max_position >= "
                f"{(2 * max(height, width) + 1) ** 2}, or transfer_weight=0"
            )
        cells = height * width
        count = min(self.transfer_offsets, cells)
        picked = origins[torch.randint(origins.shape[0], (self.transfer_windows,), generator=generator)]
        offsets = torch.rand(self.transfer_windows, cells, generator=generator).argsort(1)[:, :count]
        grid = torch.stack(torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij"), -1).flatten(0, 1)
        student = picked[:, None] + grid[offsets]
        return grid, student, offsets


def _symmetric_kl(student: torch.Tensor, teacher: torch.Tensor, num_heads: int) -> torch.Tensor:
    """KL(P_T || P_S) + KL(P_S || P_T), P = softmax of the per-head self-similarity of (windows, n, C) vectors,
    averaged over every entry (torch's kl_div 'mean'); gradients reach the student only."""
    windows, n, _ = student.shape
    heads_s = student.view(windows, n, num_heads, -1).transpose(1, 2)
    heads_t = teacher.view(windows, n, num_heads, -1).transpose(1, 2)
    log_s = F.log_softmax(heads_s @ heads_s.transpose(-1, -2), dim=-1)
    log_t = F.log_softmax(heads_t @ heads_t.transpose(-1, -2), dim=-1).detach()
    return (log_t.exp() * (log_t - log_s)).mean() + (log_s.exp() * (log_s - log_t)).mean()


# -- contrastive sampling ---------------------------------------------------------------------------------------------
_MODE_PROBS = (0.5, 0.3, 0.2)  # uniform candidates / with digit-edit hard negatives / from a local window
_HARD_RATIO = 0.2  # hard negatives per pivot: 20% of the candidates (12 of 64)
_LOCAL_SIDE = 14  # the reference's window side, sqrt(196), widened to sqrt(5 candidates) when that is larger


def contrastive_batch(
    num_pivots: int,
    num_candidates: int,
    side: int,
    max_digits: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pivots (P, 2), candidates (P, K, 2) and labels (P,) for the contrastive loss, on the ``side x side`` grid.

    Pivots are uniform. Each pivot's candidates follow one of three recipes (probabilities 0.5 / 0.3 / 0.2, the
    reference's ``method_ratio``): K distinct uniform positions; up to ``0.2 K`` digit-edit hard negatives first,
    then uniform ones; or K positions from a local window of side max(14, sqrt(5 K)) (17 for K = 64) at a uniform
    origin, then uniform ones. Duplicates and the pivot itself are dropped, keeping the first K. The label is the
    index of the candidate nearest to the pivot in squared Euclidean distance (the first on ties).

    Hard negatives [reading]: the pivot's padded digit string (both axes, 2 max_digits digits) after 1 to 3 random
    edits (replace a digit, exchange two, insert a digit dropping the first, delete one prepending a 0), read back
    as (y, x); kept when on the grid and strictly farther from the pivot than its nearest uniform candidate (the
    reference's ``min_square_dist``), so they look alike in digits without being the answer. The reference edits
    the unpadded concatenated number and splits it at a random point.
    """
    for name, value in (("num_pivots", num_pivots), ("num_candidates", num_candidates), ("side", side)):
        check_int(value, name, min=1)
    check_int(max_digits, "max_digits", min=1)
    if num_candidates >= side * side:
        raise ValueError(f"num_candidates must be below side * side = {side * side}, got {num_candidates}")
    cells = side * side
    pivots = torch.randint(cells, (num_pivots,), generator=generator)
    weights = torch.ones(num_pivots, cells)
    weights[torch.arange(num_pivots), pivots] = 0  # uniform candidates exclude the pivot
    uniform = torch.multinomial(weights, num_candidates, replacement=False, generator=generator)
    modes = torch.multinomial(torch.tensor(_MODE_PROBS), num_pivots, replacement=True, generator=generator)
    # local windows for every pivot (used by the local rows): K of the window's cells, at a uniform origin
    window = min(max(_LOCAL_SIDE, math.isqrt(5 * num_candidates)), side)
    origin = torch.randint(side - window + 1, (num_pivots, 2), generator=generator)
    count = min(num_candidates, window * window)
    local = torch.rand(num_pivots, window * window, generator=generator).argsort(1)[:, :count]
    local = (origin[:, :1] + local // window) * side + origin[:, 1:] + local % window
    n_hard = int(num_candidates * _HARD_RATIO)
    special = torch.full((num_pivots, max(count, n_hard)), -1, dtype=torch.long)
    special[modes == 2, :count] = local[modes == 2]
    if n_hard and bool((modes == 1).any()):
        rng = random.Random(int(torch.randint(2**62, (), generator=generator)))
        py, px = pivots // side, pivots % side
        nearest = ((uniform // side - py[:, None]) ** 2 + (uniform % side - px[:, None]) ** 2).amin(1)
        for row in (modes == 1).nonzero().flatten().tolist():
            hard = _hard_negatives((int(py[row]), int(px[row])), n_hard, side, max_digits, int(nearest[row]), rng)
            special[row, : len(hard)] = torch.tensor([y * side + x for y, x in hard], dtype=torch.long)
    ids = torch.cat((special, uniform), 1)
    candidates = _first_distinct(ids, pivots, num_candidates)
    cand_yx = torch.stack((candidates // side, candidates % side), -1)
    pivot_yx = torch.stack((pivots // side, pivots % side), -1)
    labels = ((cand_yx - pivot_yx[:, None]) ** 2).sum(-1).argmin(1)
    return pivot_yx, cand_yx, labels


def _first_distinct(ids: torch.Tensor, pivots: torch.Tensor, count: int) -> torch.Tensor:
    """Per row of ``ids`` (P, L) (-1: empty), the first ``count`` entries that are neither the row's pivot nor seen
    earlier in the row."""
    rows, length = ids.shape
    key = torch.arange(rows)[:, None] * (ids.max() + 2) + ids + 1  # distinct per row
    _, inverse = torch.unique(key.flatten(), return_inverse=True)
    position = torch.arange(rows * length)
    first = torch.full((int(inverse.max()) + 1,), rows * length).scatter_reduce(0, inverse, position, "amin")
    valid = (first[inverse] == position).view(rows, length) & (ids >= 0) & (ids != pivots[:, None])
    order = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices[:, :count]
    return ids.gather(1, order)


def _hard_negatives(
    pivot: tuple[int, int], count: int, side: int, max_digits: int, nearest: int, rng: random.Random
) -> list[tuple[int, int]]:
    """Up to ``count`` digit edits of ``pivot`` on the grid, strictly farther from it than ``nearest`` (a squared
    distance); see :func:`contrastive_batch`."""
    start = [int(d) for d in f"{pivot[0]:0{max_digits}d}{pivot[1]:0{max_digits}d}"]
    found = []
    for _ in range(count):
        digits = list(start)
        for _ in range(rng.randint(1, 3)):
            op, a, b = rng.randrange(4), rng.randrange(len(digits)), rng.randrange(len(digits))
            if op == 0:  # replace a digit by another
                digits[a] = (digits[a] + rng.randint(1, 9)) % 10
            elif op == 1:  # exchange two digits
                digits[a], digits[b] = digits[b], digits[a]
            elif op == 2:  # insert a digit at b, the leading one drops out
                digits = digits[1:]
                digits.insert(b, rng.randrange(10))
            else:  # delete a digit, a zero comes in front
                del digits[a]
                digits.insert(0, 0)
        y = int("".join(map(str, digits[:max_digits])))
        x = int("".join(map(str, digits[max_digits:])))
        if y < side and x < side and (y - pivot[0]) ** 2 + (x - pivot[1]) ** 2 > nearest:
            found.append((y, x))
    return found
