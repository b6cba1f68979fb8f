"""PaPE and PaPE-RI: Øhrstrøm et al., "Where to Attend: A Principled Vision-Centric Position Encoding with
Parabolas", arXiv 2602.01418, 2026 (DTU-PAS/parabolic-position-encoding).

Every query token places P parabolas over the offsets Δ = p_i - p_j to the keys, with a curvature and a slope that
it reads from its own content (the block's normalised input x̂_i):

- **PaPE** (``pape``): u = W_pos p with W_pos a learned (hP, D_r) map per layer, a_i = softplus(W_a x̂_i) and
  b_i = W_b x̂_i (one (2hP, C) map per layer), and
  β_ij = Σ_p [ -a_ip (w_p·Δ)² + b_ip (w_p·Δ) ].
- **PaPE-RI** (``pape_ri``), the rotation-invariant variant: a fixed scale s_h ~ U(±D_r^-1/2) per head,
  a_i = softplus(W_a x̂_i) (one (h, C) map per layer) and β_ij = -a_ih s_h² ||Δ||².

As in the reference, the logits are (q_i·k_j + β_ij) / sqrt(d) with d the head width. β is never built as an
(N, N) map: it is a dot product of channels appended to q and k. Summed over the parabolas, PaPE's β is a quadratic
form in the offset, β_ij = -Δᵀ M_i Δ + g_i·Δ with M_i = Σ_p a_ip w_p w_pᵀ (D_r x D_r) and g_i = Σ_p b_ip w_p, so
with r the positions

- PaPE: q~ = [q, g_i·r_i - r_iᵀ M_i r_i, -M_i (its D_r(D_r + 1)/2 distinct entries, off-diagonal doubled),
  2 M_i r_i - g_i] and k~ = [k, 1, r_j r_jᵀ (the same entries), r_j]: d + 6 channels in 2D (d + 10 in 3D);
- PaPE-RI: with v = s_h r, q~ = [q, -a_i ||v_i||², -a_i, 2 a_i v_i], k~ = [k, 1, ||v_j||², v_j] (d + D_r + 2),

so q~_i·k~_j = q_i·k_j + β_ij and attention (SDPA) runs with the scale 1/sqrt(d) of the original heads. This is the
form of the reference's fused kernel (``pape_efficient.py``: d + D_r² + 2 D_r + 2 channels); its plain version appends
every parabola instead, [q, Σ -a u², a, 2 a⊙u, Σ b u, b] against [k, 1, -u², u, 1, -u] with u = W_pos r
(d + 3P + 2 = 216 channels for d = 64, P = 50): the same β at three times the width of the attention. Widths are
padded with zero channels to a multiple of 8 (``pad_multiple``), as in the reference, so fused GPU kernels that need
aligned widths apply; the padding changes nothing else.

β depends on the offset only, so the logits of patch pairs are exactly invariant to a shift of the coordinates, and
PaPE-RI's also to a rotation; β_ii = 0. Neither is symmetric (a and b belong to the query).

Positions [visionpe]: ``index`` coordinates (y, x) or (t, y, x), not the reference's 1-based (col, row), which
only permutes the columns of W_pos; the reference's ``normalize=True`` divides (col, row) by (rows, cols), the axes
swapped, and is not reproduced. Prefix tokens (cls, registers): ``prefix="corner"`` places them one step before the
first patch on every axis, the reference's cls at the origin of its 1-based frame, so the cls token receives a
parabolic bias like any token; ``prefix="zero"`` gives their rows and columns zero bias instead. The coordinates are
centred on the patch grid before they enter the channels: β depends on offsets only, so this changes no logit, but
it halves the size of r and so the rounding of the expanded squares in half precision. M, g and the channels are
computed in fp32 (autocast off) and rounded once to the dtype of q; the content projection W_ab x̂ runs in the
activations' precision, as any linear layer.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..base import BiasPositionEncoding, check_layer, check_model_shape
from ..checks import check_block_tokens, check_choice, check_int
from ..grid import grid_coords
from ..registry import register_scheme
from .offsets import query_rows

__all__ = ["PaPE", "PaPERI", "ParabolicState", "PREFIX_MODES"]

PREFIX_MODES = ("corner", "zero")


@dataclass
class ParabolicState:
    """Per-forward state of PaPE / PaPE-RI: ``positions``, fp32 (P + N, D_r), the prefix tokens' first, centred on
    the patch grid; ``prefix_zero``: prefix rows and columns get zero bias (``prefix="zero"``)."""

    grid_size: tuple[int, ...]
    num_prefix_tokens: int
    positions: torch.Tensor
    prefix_zero: bool

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


class _ParabolicBias(BiasPositionEncoding):
    """Shared machinery: positions, argument checks, the appended channels and the explicit bias."""

    needs_tokens = True
    augments_qk = True
    grid_ranks = (2, 3)

    def __init__(self, dim: int, num_heads: int, depth: int, ndim: int, prefix: str, pad_multiple: int) -> None:
        super().__init__()
        self.head_dim = check_model_shape(dim, num_heads, depth)
        self.dim, self.num_heads, self.depth = dim, num_heads, depth
        self.ndim = check_choice(ndim, "ndim", (2, 3))
        self.prefix = check_choice(prefix, "prefix", PREFIX_MODES)
        self.pad_multiple = check_int(pad_multiple, "pad_multiple", min=1)

    @property
    def ndims(self) -> tuple[int, ...]:  # the instance supports exactly the rank it was built for
        return (self.ndim,)

    @property
    @abstractmethod
    def extra_channels(self) -> int:
        """Channels appended to q and k before padding."""

    @property
    def augmented_dim(self) -> int:
        """Width of q~ and k~: head_dim + the extra channels, padded to a multiple of ``pad_multiple``."""
        width = self.head_dim + self.extra_channels
        return -(-width // self.pad_multiple) * self.pad_multiple

    def prepare(self, grid_size: tuple[int, ...], num_prefix_tokens: int, device=None) -> ParabolicState:
        """Centred ``index`` positions of the prefix tokens and patches, fp32 (P + N, D_r)."""
        grid_size = self.check_grid(grid_size)
        check_int(num_prefix_tokens, "num_prefix_tokens", min=0)
        center = torch.tensor([(n - 1) / 2 for n in grid_size], device=device)
        patches = grid_coords(grid_size, mode="index", device=device) - center
        # the reference's cls token sits at the origin of the 1-based frame: index -1 on every axis
        prefix = (-1.0 - center).expand(num_prefix_tokens, -1)
        positions = torch.cat((prefix, patches))
        return ParabolicState(grid_size, num_prefix_tokens, positions, self.prefix == "zero")

    def _check(
        self, q: torch.Tensor, k: torch.Tensor, state: ParabolicState, layer: int, tokens: torch.Tensor | None, rows
    ) -> range:
        name = type(self).__name__
        check_layer(layer, self.depth, name)
        if not isinstance(state, ParabolicState):
            raise TypeError(f"state must be the ParabolicState of {name}.prepare, got {type(state).__name__}")
        n = state.num_tokens
        picked = query_rows(rows, n)
        for arg, x, count in (("q", q, len(picked)), ("k", k, n)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{arg} must be a tensor, got {type(x).__name__}")
            if x.ndim != 4 or x.shape[1:] != (self.num_heads, count, self.head_dim):
                raise ValueError(
                    f"{arg} must have shape (B, {self.num_heads}, {count}, {self.head_dim}) for this grid, got "
                    f"{tuple(x.shape)}"
                )
        check_block_tokens(tokens, name, n, self.dim, batch=k.shape[0])
        return picked

    def channels(self, state: ParabolicState, layer: int, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 extra channels of every token: for queries (B, h, P + N, E) and for keys (1, h | 1, P + N, E), with
        q-channels_i · k-channels_j = β_ij (zero rows and columns for the prefix under ``prefix="zero"``)."""
        check_layer(layer, self.depth, type(self).__name__)
        # the content projection runs in the activations' precision, as any linear layer; positions, the quadratic
        # forms and the channels in fp32
        projected = F.linear(tokens, self.content_weight(layer))
        with torch.autocast(tokens.device.type, enabled=False):
            q_extra, k_extra = self._channels(state.positions.to(tokens.device), layer, projected.float())
        if state.prefix_zero and state.num_prefix_tokens:
            keep = torch.ones(state.num_tokens, 1, device=q_extra.device)
            keep[: state.num_prefix_tokens] = 0
            q_extra, k_extra = q_extra * keep, k_extra * keep
        return q_extra, k_extra

    @abstractmethod
    def content_weight(self, layer: int) -> torch.Tensor:
        """The (features, C) map of block ``layer`` from the normalised tokens to the curvatures (and slopes)."""

    @abstractmethod
    def _channels(
        self, positions: torch.Tensor, layer: int, projected: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (query, key) channels from fp32 ``positions`` (T, D_r) and the projected tokens (B, T, features)."""

    def augment_qk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        state: ParabolicState,
        layer: int,
        tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q~ and k~ (B, h, P + N, :attr:`augmented_dim`) in the dtype of q: q~_i·k~_j = q_i·k_j + β_ij."""
        self._check(q, k, state, layer, tokens, None)
        q_extra, k_extra = self.channels(state, layer, tokens)
        pad = self.augmented_dim - self.head_dim - self.extra_channels
        q_extra = F.pad(q_extra, (0, pad)).to(q.dtype)
        k_extra = F.pad(k_extra, (0, pad)).to(k.dtype).expand(*k.shape[:2], -1, -1)
        return torch.cat((q, q_extra), -1), torch.cat((k, k_extra), -1)

    def attn_bias(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        state: ParabolicState,
        layer: int,
        rows: slice | None = None,
        tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The same bias as an explicit logit term, β / sqrt(head_dim), (B, h, R, P + N) in the dtype of q, for the
        query ``rows`` (all for None). Attention does not call it (the bias goes through :meth:`augment_qk`); it is
        the reference for tests and for attention code without the q/k hook. Computed from the fp32 channels as
        matrix products, so nothing of size (R, N, P) is built."""
        picked = self._check(q, k, state, layer, tokens, rows)
        q_extra, k_extra = self.channels(state, layer, tokens)
        with torch.autocast(q.device.type, enabled=False):
            beta = q_extra[:, :, picked.start : picked.stop] @ k_extra.transpose(-2, -1)
        return (beta / math.sqrt(self.head_dim)).to(q.dtype)


@register_scheme("pape")
class PaPE(_ParabolicBias):
    """Parabolic position encoding: P learned parabolas per head over the offset, with curvature and slope read
    from the query's content; per layer.

    Args:
        dim, num_heads, depth: model shape; one (W_pos, W_ab) pair per block.
        parabolas: P, parabolas per head (50 in the paper).
        ndim: 2 (images) or 3 (video, (t, y, x)); the model passes it.
        prefix: ``"corner"`` (reference: prefix tokens one step before the first patch on every axis, with a
            parabolic bias like any token) or ``"zero"`` (zero bias rows and columns).
        pad_multiple: q~ and k~ are zero-padded to a multiple of this width (8, as the reference; 1: no padding).

    Parameters per layer: W_pos (hP, D_r), initialised U(±D_r^-1/2), and W_ab (2hP, C), U(±C^-1/2), the
    reference's ``nn.Linear`` defaults without bias: for ViT-B, 921,600 + 1,200.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        parabolas: int = 50,
        ndim: int = 2,
        prefix: str = "corner",
        pad_multiple: int = 8,
    ) -> None:
        super().__init__(dim, num_heads, depth, ndim, prefix, pad_multiple)
        self.parabolas = check_int(parabolas, "parabolas", min=1)
        features = num_heads * self.parabolas
        # the reference's layouts: position.weight (hP, D_r) and ab.weight (2hP, C), a first, then b
        self.position = nn.Parameter(torch.empty(depth, features, ndim).uniform_(-(ndim**-0.5), ndim**-0.5))
        self.ab = nn.Parameter(torch.empty(depth, 2 * features, dim).uniform_(-(dim**-0.5), dim**-0.5))

    @property
    def extra_channels(self) -> int:
        return 1 + self.ndim * (self.ndim + 1) // 2 + self.ndim

    def content_weight(self, layer: int) -> torch.Tensor:
        return self.ab[layer]

    def no_weight_decay(self) -> set[str]:
        """W_pos, which sets the directions and scales of the parabolas as learned frequencies do; W_ab decays, as
        any linear layer of the tokens."""
        return {"position"}

    def quadratic_forms(self, layer: int, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 M (B, h, T, D_r, D_r) and g (B, h, T, D_r) of every query token from its projected content
        (B, T, 2hP): β_ij = -Δᵀ M_i Δ + g_i·Δ."""
        h, p = self.num_heads, self.parabolas
        w = self.position[layer].float().view(h, p, self.ndim)  # w_p of every head
        ab = projected.unflatten(-1, (2, h, p))  # (B, T, 2, h, P): a first, then b
        a, b = F.softplus(ab[:, :, 0]), ab[:, :, 1]
        curvature = torch.einsum("bthp,hpk,hpl->bhtkl", a, w, w)
        slope = torch.einsum("bthp,hpk->bhtk", b, w)
        return curvature, slope

    def _channels(
        self, positions: torch.Tensor, layer: int, projected: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        curvature, slope = self.quadratic_forms(layer, projected)
        r = positions  # (T, D_r)
        mr = (curvature @ r[:, :, None]).squeeze(-1)  # M_i r_i: (B, h, T, D_r)
        rows, cols = torch.triu_indices(self.ndim, self.ndim, device=r.device)
        # the distinct entries of the symmetric M, off-diagonal ones counted twice
        entries = curvature[..., rows, cols] * torch.where(rows == cols, 1.0, 2.0)
        constant = (slope * r).sum(-1, keepdim=True) - (mr * r).sum(-1, keepdim=True)
        q_extra = torch.cat((constant, -entries, 2 * mr - slope), -1)
        k_extra = torch.cat((torch.ones_like(r[:, :1]), r[:, rows] * r[:, cols], r), -1)
        return q_extra, k_extra[None, None]


@register_scheme("pape_ri")
class PaPERI(_ParabolicBias):
    """Rotation-invariant PaPE: one isotropic parabola per head, -a_ih s_h² ||Δ||², whose curvature a is read from
    the query's content; per layer.

    Args:
        dim, num_heads, depth: model shape; one W_a per block.
        ndim: 2 (images) or 3 (video, (t, y, x)); the model passes it.
        prefix: ``"corner"`` (reference) or ``"zero"``, as for :class:`PaPE`.
        pad_multiple: q~ and k~ are zero-padded to a multiple of this width (8, as the reference; 1: no padding).
        seed: seed of the fixed per-head scales s_h ~ U(±D_r^-1/2) (a buffer, saved with the model; the reference
            draws them from the global generator).

    Parameters per layer: W_a (h, C), initialised U(±C^-1/2) (the reference's ``nn.Linear`` default, no bias).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        ndim: int = 2,
        prefix: str = "corner",
        pad_multiple: int = 8,
        seed: int = 0,
    ) -> None:
        super().__init__(dim, num_heads, depth, ndim, prefix, pad_multiple)
        self.seed = check_int(seed, "seed", min=0)
        self.register_buffer("scales", self._scales())
        self.curvature = nn.Parameter(torch.empty(depth, num_heads, dim).uniform_(-(dim**-0.5), dim**-0.5))

    def _scales(self) -> torch.Tensor:
        """(depth, num_heads) fixed scales drawn once from a generator seeded by ``seed``."""
        generator = torch.Generator().manual_seed(self.seed)
        bound = self.ndim**-0.5
        return (2 * torch.rand(self.depth, self.num_heads, generator=generator) - 1) * bound

    def fixed_buffers(self) -> dict[str, torch.Tensor]:
        # persistent: the drawn scales are state a checkpoint keeps, whatever a later torch's generator draws
        return {"scales": self._scales()}

    @property
    def extra_channels(self) -> int:
        return self.ndim + 2

    def content_weight(self, layer: int) -> torch.Tensor:
        return self.curvature[layer]

    def _channels(
        self, positions: torch.Tensor, layer: int, projected: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        v = (positions * self.scales[layer].float()[:, None, None])[None]  # s_h r: (1, h, T, D_r)
        a = F.softplus(projected).transpose(1, 2)[..., None]  # (B, h, T, 1)
        square = v.square().sum(-1, keepdim=True)
        # -a_i ||v_i - v_j||^2 = -a_i ||v_i||^2 - a_i ||v_j||^2 + 2 a_i v_i . v_j
        q_extra = torch.cat((-a * square, -a, 2 * a * v), -1)
        k_extra = torch.cat((torch.ones_like(square), square, v), -1)
        return q_extra, k_extra
