"""HARoPE: Li et al., "Head-wise Adaptive Rotary Positional Encoding for Fine-Grained Image Generation",
arXiv 2510.10489, 2025 (code: Studentxll/HARoPE).

Axial RoPE R(r) after a learned linear map per layer and head, M = U diag(s) V^T, with U = exp((A_u - A_u^T) / 2),
V = exp((A_v - A_v^T) / 2) and s = softplus(sigma) + 1e-6: q' = R(r) M q and k' = R(r) M^-T k, where
M^-T = U diag(1 / s) V^T needs no inverse. The logit q'.k' = q^T M^T R(r_j - r_i) M^-T k depends on r_j - r_i only
(exactly relative) and equals q.k at equal positions. Init A_u = A_v = 0, sigma = softplus^-1(1): M = (1 + 1e-6) I,
so HARoPE starts as axial RoPE (base 10000).

The released attention multiplies ``q @ M.T`` and ``k @ M_inv`` (M_inv = V diag(1 / s) U^T), i.e. M q and M^-T k;
its comment calls the query side "P^T q", which is not what it computes. The library follows the code.

The library's readings:

- Inner RoPE: interleaved pairs, theta_n = base^(-4n/d); the reference gives its first d/4 pairs to the row and the
  rest to the column. ``pair_order="xy"`` (default) lays the pairs out as ``rope_axial`` does (x first), so that at
  init HARoPE is exactly ``rope_axial(base=10000)``; ``pair_order="yx"`` is the reference's layout. The two differ by
  a fixed permutation of the channels, which the q/k projections absorb.
- Prefix tokens: M and M^-T act on every token (so they fold into W_q and W_k), only patches are rotated.
- Video (``ndim=3``) splits the pairs between (x, y, t) as ``rope_axial`` does.
- With q/k normalisation, M acts on the normalised q and k (as in the reference); otherwise attention folds M and
  M^-T into the q/k projection on every forward, and :func:`fold_harope_` writes them into the weights for good.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import PosAttention
from ..base import RotaryPositionEncoding, check_rotate_input
from ..checks import check_bool, check_choice
from ..interfaces.rotary import LayerRotation, RotaryState
from ..registry import register_scheme
from .base import LinearRotary
from .frequencies import axial_frequencies, check_axis_pairs, check_base, default_axis_pairs

__all__ = ["HARoPE", "HARoPEState", "QKBasisRotation", "harope_matrices", "fold_harope_"]

PAIR_ORDERS = ("xy", "yx")
_SIGMA_INIT = math.log(math.expm1(1.0))  # softplus^-1(1) = 0.5413
_EPS = 1e-6  # added to softplus(sigma), as the reference does


def harope_matrices(
    a_u: torch.Tensor, a_v: torch.Tensor, sigma: torch.Tensor, eps: float = _EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """M = U diag(s) V^T and M^-T = U diag(1 / s) V^T in fp32 (autocast off), from raw ``a_u``, ``a_v`` (..., d, d)
    and ``sigma`` (..., d): U = exp((A_u - A_u^T) / 2), V = exp((A_v - A_v^T) / 2), s = softplus(sigma) + eps.

    Example:
        >>> m, m_inv_t = harope_matrices(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2))
        >>> m.diagonal(), (m.T @ m_inv_t).round(decimals=4)
        (tensor([0.6931, 0.6931]), tensor([[1., 0.],
                [0., 1.]]))
    """
    for name, value in (("a_u", a_u), ("a_v", a_v), ("sigma", sigma)):
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            got = f"dtype {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise TypeError(f"{name} must be a floating-point tensor, got {got}")
    if a_u.ndim < 2 or a_u.shape[-1] != a_u.shape[-2] or a_v.shape != a_u.shape or sigma.shape != a_u.shape[:-1]:
        raise ValueError(
            f"a_u and a_v must be (..., d, d) and sigma (..., d) of the same d and leading dims, got a_u "
            f"{tuple(a_u.shape)}, a_v {tuple(a_v.shape)}, sigma {tuple(sigma.shape)}"
        )
    with torch.autocast(a_u.device.type, enabled=False):
        a_u, a_v, sigma = a_u.float(), a_v.float(), sigma.float()
        u = torch.linalg.matrix_exp(0.5 * (a_u - a_u.transpose(-1, -2)))
        v_t = torch.linalg.matrix_exp(0.5 * (a_v - a_v.transpose(-1, -2))).transpose(-1, -2)
        s = (F.softplus(sigma) + eps).unsqueeze(-1)
        # diag(s) V^T scales the rows of V^T
        return u @ (s * v_t), u @ (v_t / s)


def _times_qk_basis(qk: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """M q and M^-T k for ``qk`` (..., 2, B, num_heads, T, head_dim) and ``basis`` (2, num_heads, head_dim,
    head_dim)."""
    if qk.ndim < 5 or qk.shape[-5] != 2 or qk.shape[-1] != basis.shape[-1]:
        raise ValueError(
            f"qk must stack q and k in front, (..., 2, B, num_heads, T, head_dim={basis.shape[-1]}): HARoPE "
            f"multiplies q by M and k by M^-T, got {tuple(qk.shape)}"
        )
    return qk @ basis.to(qk.dtype).transpose(-1, -2).unsqueeze(1)


class QKBasisRotation(LayerRotation):
    """One block's rotation with a basis per side: M on q, M^-T on k (``basis`` (2, num_heads, head_dim, head_dim)),
    then the inner rotation (the RoPE tables). Attention folds ``basis`` into the q/k projection when it can."""

    def __init__(self, basis: torch.Tensor, inner: LayerRotation) -> None:
        self._basis, self.inner, self.num_tokens = basis, inner, inner.num_tokens

    @property
    def basis(self) -> torch.Tensor:
        return self._basis

    def without_basis(self) -> LayerRotation:
        return self.inner

    def rotate(self, qk: torch.Tensor) -> torch.Tensor:
        return self.inner.rotate(_times_qk_basis(qk, self._basis))

    def rotate_kept(self, qk: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        # M acts on each token alone: applied to the kept tokens, then their RoPE rows
        return self.inner.rotate_kept(_times_qk_basis(qk, self._basis), keep)


class HARoPEState(RotaryState):
    """HARoPE's per-forward state: the RoPE state and (M, M^-T) of every layer (``bases`` (depth, 2, num_heads,
    head_dim, head_dim); None once :func:`fold_harope_` moved them into the projections)."""

    def __init__(self, rotary: RotaryState, bases: torch.Tensor | None) -> None:
        self.rotary, self.bases = rotary, bases

    def layer(self, index: int) -> LayerRotation:
        inner = self.rotary.layer(index)  # checks the index
        return inner if self.bases is None else QKBasisRotation(self.bases[index], inner)


def _pair_frequencies(head_dim: int, base: float, axis_pairs: tuple[int, ...], pair_order: str) -> torch.Tensor:
    """(ndim, head_dim // 2) axial frequencies, rows in coordinate order; pair blocks x, y[, t] (``xy``, as
    ``rope_axial``) or in coordinate order [t,] y, x (``yx``, the reference's layout)."""
    freqs = axial_frequencies(head_dim, base, axis_pairs)
    if pair_order == "yx":
        freqs = torch.cat(freqs.split(list(axis_pairs), dim=1)[::-1], dim=1)
    return freqs


@register_scheme("harope")
class HARoPE(LinearRotary):
    """Axial RoPE after a learned SVD-parametrised map per layer and head: q' = R(r) M q, k' = R(r) M^-T k.

    Args:
        dim, num_heads, depth: model shape; one (A_u, A_v, sigma) per block and head.
        base: base of the inner axial RoPE, theta_n = base^(-4n/d) (10000, the reference's).
        ndim: 2 for images (y, x), 3 for video (t, y, x).
        axis_pairs: rotary pairs per axis in order x, y[, t]; default (d/4, d/4) in 2D, as ``rope_axial``.
        pair_order: ``"xy"`` (the x pairs first, ``rope_axial``'s layout) or ``"yx"`` (the row pairs first, the
            reference's layout); see the module docstring.
        coord_mode, grid_size, extrapolation, yarn_alpha, yarn_beta: the shared rotary options, by keyword
            (:class:`~visionpe.rotary.base.RotaryOptions`: integer patch positions as the reference, no
            extrapolation); the extrapolation modes apply to the inner RoPE (M does not depend on position). No
            ``rotate_values``: M acts on q and k only.

    Parameters: depth * num_heads * (2 head_dim^2 + head_dim), kept out of weight decay. Each forward takes
    2 * depth * num_heads head_dim x head_dim matrix exponentials (fp32).
    """

    onnx_refusal = "torch.linalg.matrix_exp (its U and V) has no ONNX translation; fold_harope_ first"

    per_token_tables = False  # a learned basis change before the tables
    # M acts on q and k only: no rotary value embeddings
    shared_options = tuple(n for n in LinearRotary.shared_options if n != "rotate_values")

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        base: float = 10000.0,
        ndim: int = 2,
        axis_pairs: Sequence[int] | None = None,
        pair_order: str = "xy",
        **options: Any,
    ) -> None:
        super().__init__(dim, num_heads, depth, ndim, options=self.rotary_options(options))
        axis_pairs = check_axis_pairs(default_axis_pairs(self.head_dim, ndim) if axis_pairs is None else axis_pairs)
        if len(axis_pairs) != ndim:
            raise ValueError(f"axis_pairs must have {ndim} entries for ndim={ndim}, got {tuple(axis_pairs)}")
        self.base, self.axis_pairs = check_base(base), axis_pairs
        self.pair_order = check_choice(pair_order, "pair_order", PAIR_ORDERS)
        self.register_buffer("freqs", self._inner_frequencies(), persistent=False)
        d = self.head_dim
        self.A_u = nn.Parameter(torch.zeros(depth, num_heads, d, d))
        self.A_v = nn.Parameter(torch.zeros(depth, num_heads, d, d))
        self.sigma = nn.Parameter(torch.full((depth, num_heads, d), _SIGMA_INIT))
        # the buffer keeps the flag in checkpoints; forward reads the Python copy (no data-dependent branch for
        # torch.export and torch.compile)
        self.register_buffer("folded", torch.zeros((), dtype=torch.bool))
        self.is_folded = False

    def _inner_frequencies(self) -> torch.Tensor:
        return _pair_frequencies(self.head_dim, self.base, self.axis_pairs, self.pair_order)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.is_folded = bool(self.folded)

    def fixed_buffers(self) -> dict[str, torch.Tensor]:
        # the frequencies stay fp32 under model.to(bfloat16), as rope_axial's (angles grow with position); the
        # persistent flag is state (whether the checkpoint holds folded bases), False at initialisation
        return {"freqs": self._inner_frequencies(), "folded": torch.zeros((), dtype=torch.bool)}

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.is_folded = False

    def frequencies(self) -> torch.Tensor:
        return self.freqs[None, None]

    def no_weight_decay(self) -> set[str]:
        return {"A_u", "A_v", "sigma"}

    def qk_bases(self) -> torch.Tensor:
        """(depth, 2, num_heads, head_dim, head_dim) fp32: M and M^-T of every block and head."""
        return torch.stack(harope_matrices(self.A_u, self.A_v, self.sigma), dim=1)

    def prepare(
        self, coords: torch.Tensor, num_prefix_tokens: int = 0, grid_size: tuple[int, ...] | None = None
    ) -> HARoPEState:
        """RoPE state of :meth:`LinearRotary.prepare` and M, M^-T of every layer (none once folded)."""
        rotary = super().prepare(coords, num_prefix_tokens, grid_size)
        return HARoPEState(rotary, None if self.is_folded else self.qk_bases())

    def rotate(
        self,
        x: torch.Tensor,
        coords: torch.Tensor,
        layer: int = 0,
        grid_size: tuple[int, ...] | None = None,
        *,
        key: bool = False,
    ) -> torch.Tensor:
        """R(r) M x (queries) or, with ``key=True``, R(r) M^-T x (keys), for ``x`` (B, num_heads, N, head_dim) at
        ``coords`` (N, ndim), folded or not; ``grid_size`` as in
        :meth:`~visionpe.base.RotaryPositionEncoding.rotate`."""
        check_bool(key, "key")
        coords = check_rotate_input(self, x, coords, layer)
        rotary = LinearRotary.prepare(self, coords, 0, grid_size=self.rotation_grid_size(coords, grid_size))
        basis = harope_matrices(self.A_u[layer], self.A_v[layer], self.sigma[layer])[int(key)]
        return rotary.layer(layer).rotate(x @ basis.to(x.dtype).transpose(-1, -2))


def fold_harope_(model: nn.Module) -> nn.Module:
    """Fold every block's HARoPE maps into its q and k projections, in place: W_q -> blockdiag(M_h) W_q and
    W_k -> blockdiag(M_h^-T) W_k (biases alike). The scheme then applies axial RoPE only, so inference costs what
    RoPE costs and the outputs are unchanged (to fp32 rounding). Returns ``model``.

    Raises ValueError when the model has no HARoPE scheme, is already folded, has another rotary scheme before it,
    or normalises q/k after the projection (qk_norm): M would then not commute with the normalisation.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    schemes = [m for m in model.modules() if isinstance(m, HARoPE)]
    if not schemes:
        raise ValueError(f"{type(model).__name__} has no HARoPE scheme (harope) to fold")
    if len(schemes) > 1:
        raise ValueError(f"fold_harope_ folds one HARoPE scheme per model, found {len(schemes)}")
    scheme = schemes[0]
    if scheme.is_folded:
        raise ValueError(f"{type(scheme).__name__} is already folded into the q/k projections")
    first = next(m for m in model.modules() if isinstance(m, RotaryPositionEncoding))
    if first is not scheme:
        raise ValueError(
            f"fold_harope_ needs HARoPE to be the model's first rotary scheme (M acts before every rotation), "
            f"found {type(first).__name__} before it"
        )
    attentions = [m for m in model.modules() if isinstance(m, PosAttention)]
    if not attentions:
        raise ValueError(f"{type(model).__name__} has no PosAttention whose q/k projections could take M")
    for attn in attentions:
        if not (isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity)):
            raise ValueError("fold_harope_ needs q/k without normalisation (qk_norm=False): M does not commute")
        if type(attn.qkv) is not nn.Linear:
            raise ValueError(f"fold_harope_ needs nn.Linear q/k/v projections, got {type(attn.qkv).__name__}")
        if (attn.num_heads, attn.head_dim) != (scheme.num_heads, scheme.head_dim):
            raise ValueError(
                f"attention has {attn.num_heads} heads of {attn.head_dim} channels, the scheme {scheme.num_heads} "
                f"of {scheme.head_dim}"
            )
    with torch.no_grad():
        bases = scheme.qk_bases()
        for attn in attentions:
            weight, bias = attn.fold_qk_basis(bases[attn.layer])
            attn.qkv.weight.copy_(weight)
            if bias is not None:
                attn.qkv.bias.copy_(bias)
        scheme.folded.fill_(True)
        scheme.is_folded = True
    return model
