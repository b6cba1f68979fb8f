"""Cayley-STRING: Schenck et al., "Learning the RoPEs: Better 2D and 3D Position Encodings with STRING", ICML 2025.

R(r) = RoPE(r) P with P = (I - S)(I + S)^-1, S = A - A^T: one learned orthogonal matrix per layer and head,
shared by q, k and every token, and RoPE(r) with learned frequencies phi_j = sum_k r_k theta_{k,j}. Exactly
relative: R(r_i)^T R(r_j) = P^T RoPE(r_j - r_i) P. Init S = 0, theta = axial RoPE (base 100): exactly RoPE-Axial.

P multiplies every token, prefix tokens included (only RoPE skips them): that is what makes
:func:`fold_string_` exact, since folding P into W_q and W_k transforms every token's q and k.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..base import check_layer, check_rotate_input
from ..registry import register_scheme
from .base import LinearRotary
from .rope_axial import axial_frequencies, check_base
from .skew_exp import skew_from_params

__all__ = ["StringBase", "StringCayley", "cayley_orthogonal", "fold_string_"]


def cayley_orthogonal(skew: torch.Tensor) -> torch.Tensor:
    """P = (I - S)(I + S)^-1 for skew-symmetric S (..., d, d), in fp32; (I - S) and (I + S)^-1 commute.

    Example:
        >>> cayley_orthogonal(torch.zeros(2, 2))
        tensor([[1., 0.],
                [0., 1.]])
    """
    if skew.ndim < 2 or skew.shape[-1] != skew.shape[-2]:
        raise ValueError(f"skew must have shape (..., d, d), got {tuple(skew.shape)}")
    with torch.autocast(skew.device.type, enabled=False):
        skew = skew.float()
        eye = torch.eye(skew.shape[-1], device=skew.device)
        # I + S is invertible for every skew S (eigenvalues 1 + i lambda): solve_ex skips linalg.solve's error
        # check, which on a GPU reads a status back from the device (a sync in every forward)
        return torch.linalg.solve_ex(eye + skew, eye - skew)[0]


def _layer_basis(basis: torch.Tensor, layer: int) -> torch.Tensor:
    """P of block ``layer`` from :meth:`StringBase.string_basis` (depth | 1, ...): one P shared by every layer or
    one per layer."""
    return basis[layer] if basis.shape[0] > 1 else basis[0]


def _times_basis(x: torch.Tensor, basis: torch.Tensor, layer: int) -> torch.Tensor:
    """P x for every token of ``x`` (..., head_dim), with P of block ``layer`` (:func:`_layer_basis`)."""
    return x @ _layer_basis(basis, layer).to(x.dtype).transpose(-1, -2)


class StringBase(LinearRotary):
    """STRING as RoPE(r) times a fixed-per-forward orthogonal basis change ``string_basis()``.

    ``apply`` returns RoPE(r) P x for every token (prefix tokens get P only); once :func:`fold_string_` has
    moved P into the q/k projections, ``apply`` is plain RoPE. ``rotate`` always returns R(r) x.
    """

    depth_coords: bool = False  # set by the constructor (read while LinearRotary's sets up extrapolation)

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
        depth_coords: bool = False,
    ) -> None:
        if not isinstance(depth_coords, bool):
            raise TypeError(f"depth_coords must be a bool, got {type(depth_coords).__name__} ({depth_coords!r})")
        if depth_coords:
            # RGB-D (SCHEMES.md A8): r = (z, y, x) on a 2D image grid, z from each patch's mean depth
            if ndim != 2:
                raise ValueError(f"depth_coords=True adds a depth axis to 2D image grids (ndim=2), got ndim={ndim}")
            if extrapolation != "none" or coord_mode == "ref_scaled":
                raise ValueError(
                    "depth_coords=True rotates by learned depth positions, which no grid ratio scales: it needs "
                    f"extrapolation='none' and a coord_mode other than 'ref_scaled', got extrapolation="
                    f"{extrapolation!r}, coord_mode={coord_mode!r}"
                )
            ndim, grid_size = 3, None
        super().__init__(dim, num_heads, depth, ndim, coord_mode, grid_size, extrapolation, yarn_alpha, yarn_beta)
        self.depth_coords = depth_coords
        if depth_coords:
            # the learnable linear layer of A8 on the mean-pooled depth, starting at z = depth
            self.depth_proj = nn.Linear(1, 1)
            with torch.no_grad():
                self.depth_proj.weight.fill_(1.0)
                self.depth_proj.bias.zero_()
        # the buffer keeps the flag in checkpoints; forward reads the Python copy, so that torch.export and
        # torch.compile see no data-dependent branch
        self.register_buffer("folded", torch.zeros((), dtype=torch.bool))
        self.is_folded = False

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.is_folded = bool(self.folded)

    @property
    def ndims(self) -> tuple[int, ...]:
        """Grid ranks: 2 (the image grid) with ``depth_coords``, whose positions have a third axis, else ndim."""
        return (2,) if self.depth_coords else (self.ndim,)

    @property
    def coord_ndims(self) -> tuple[int, ...]:
        """Columns of the positions ``rotate`` takes: (z, y, x) with ``depth_coords``, one more than the grid's."""
        return (self.ndim,)

    def extrapolation_refusal(self, mode: str, train_grid_size: tuple[int, ...] | None = None) -> str | None:
        if self.depth_coords and mode != "none":
            name = type(self).__name__
            return f"{name} with depth_coords=True has no extrapolation mode (its z is learned), got {mode!r}"
        return super().extrapolation_refusal(mode, train_grid_size)

    def depth_positions(self, coords: torch.Tensor, patch_depth: torch.Tensor) -> torch.Tensor:
        """(B, N, 3) positions (z, y, x) of RGB-D patches: z = w d + b (``depth_proj``, learned) of each patch's
        mean depth d, ``patch_depth`` (B, N), and (y, x) the grid ``coords`` (N, 2) (SCHEMES.md A8).

        Example:
            >>> s = StringCayley(32, 2, depth_coords=True)
            >>> s.depth_positions(s.coords((1, 2)), torch.tensor([[0.5, 2.0]]))
            tensor([[[0.5000, 0.0000, 0.0000],
                     [2.0000, 0.0000, 1.0000]]], grad_fn=<CatBackward0>)
        """
        if not self.depth_coords:
            raise ValueError(f"{type(self).__name__} was built without depth_coords=True: it takes no depth")
        if not isinstance(patch_depth, torch.Tensor) or not isinstance(coords, torch.Tensor):
            raise TypeError("coords and patch_depth must be tensors")
        if coords.ndim != 2 or coords.shape[1] != 2:
            raise ValueError(f"coords must be (N, 2) image grid positions (y, x), got {tuple(coords.shape)}")
        if patch_depth.ndim != 2 or patch_depth.shape[1] != coords.shape[0] or not patch_depth.is_floating_point():
            raise ValueError(
                f"patch_depth must be a floating-point (B, N={coords.shape[0]}) tensor of mean patch depths, got "
                f"{tuple(patch_depth.shape)} {patch_depth.dtype}"
            )
        # (a data-dependent check: eager only, so that a compiled model keeps one graph)
        if not torch.compiler.is_compiling() and not bool(torch.isfinite(patch_depth).all()):
            raise ValueError("patch_depth must be finite (fill missing depth before the model)")
        with torch.autocast(patch_depth.device.type, enabled=False):  # positions stay fp32
            z = self.depth_proj(patch_depth.float().unsqueeze(-1))
            return torch.cat((z, coords.to(z).expand(len(z), -1, -1)), -1)

    def no_weight_decay(self) -> set[str]:
        """The depth layer (decay would pull z towards a constant, i.e. 2D STRING); subclasses add their own."""
        return {"depth_proj.weight", "depth_proj.bias"} if self.depth_coords else set()

    def string_basis(self) -> torch.Tensor:
        """(depth | 1, num_heads | 1, head_dim, head_dim) orthogonal P, applied before RoPE."""
        raise RuntimeError(f"{type(self).__name__} must define string_basis()")

    def rotation_output_basis(self) -> torch.Tensor | None:
        """Orthogonal matrix Q with R(r) = Q^T RoPE(r) P, or None when Q = I (``rotate`` applies Q^T)."""
        return None

    def prepare(self, coords: torch.Tensor, num_prefix_tokens: int = 0, grid_size: tuple[int, ...] | None = None):
        """(RoPE state of :meth:`LinearRotary.prepare`, P for every layer or None once folded).

        With ``depth_coords``, ``coords`` are the (B, N, 3) or (N, 3) positions of :meth:`depth_positions`.
        """
        if self.depth_coords and coords.shape[-1] != 3:
            raise ValueError(
                f"{type(self).__name__} with depth_coords=True needs (z, y, x) positions from depth_positions(...), "
                f"got coords of shape {tuple(coords.shape)} (a model passes them when called with depth=...)"
            )
        rotary = super().prepare(coords, num_prefix_tokens, grid_size)
        basis = None if self.is_folded else self.string_basis()
        return rotary, basis

    def apply(self, qk: torch.Tensor, state, layer: int) -> torch.Tensor:
        check_layer(layer, self.depth, type(self).__name__)
        rotary, basis = state
        if basis is not None:
            qk = _times_basis(qk, basis, layer)
        return super().apply(qk, rotary, layer)

    def apply_kept(self, qk: torch.Tensor, state, layer: int, keep: torch.Tensor) -> torch.Tensor:
        check_layer(layer, self.depth, type(self).__name__)
        rotary, basis = state  # P acts on each token alone: applied to the kept tokens, then their RoPE rows
        if basis is not None:
            qk = _times_basis(qk, basis, layer)
        return super().apply_kept(qk, rotary, layer, keep)

    def apply_qkv_(
        self, qkv: torch.Tensor, state, layer: int, num_heads: int, keep: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        rotary, basis = state
        if basis is not None:  # P not folded into the projection (attention folds it when it can)
            return None
        return super().apply_qkv_(qkv, rotary, layer, num_heads, keep)

    def projection_basis(self, state, layer: int) -> tuple[torch.Tensor, tuple] | None:
        check_layer(layer, self.depth, type(self).__name__)
        rotary, basis = state
        if basis is None:  # folded for good (fold_string_)
            return None
        return _layer_basis(basis, layer), (rotary, None)

    def rotate(
        self, x: torch.Tensor, coords: torch.Tensor, layer: int = 0, grid_size: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """R(r) x for ``x`` (B, num_heads, N, head_dim) at ``coords`` (N, ndim), folded or not; ``grid_size`` as in
        :meth:`~visionpe.base.RotaryPositionEncoding.rotate` (the grid the extrapolation mode scales against)."""
        coords = check_rotate_input(self, x, coords, layer)
        rotary = LinearRotary.prepare(self, coords, 0, grid_size=self.rotation_grid_size(coords, grid_size))
        out = LinearRotary.apply(self, _times_basis(x, self.string_basis(), layer), rotary, layer)
        out_basis = self.rotation_output_basis()
        return out if out_basis is None else out @ out_basis.to(x.dtype)


@register_scheme("string_cayley")
class StringCayley(StringBase):
    """Cayley-STRING for 2D (y, x) or 3D coordinates.

    Args:
        dim, num_heads, depth: model shape; one P and one frequency set per block and head.
        base: base of the axial RoPE frequencies the learned frequencies start from (100, as RoPE-Axial).
        ndim: 2 for images, 3 for (t, y, x) video or (z, y, x) RGB-D positions passed to ``rotate``.
        learn_frequencies: learn theta (the paper learns all angle frequencies) or keep axial RoPE's.
        coord_mode: grid convention (``index``).
        grid_size, extrapolation, yarn_alpha, yarn_beta: training grid and A13 scaling of the RoPE part.
        depth_coords: RGB-D (SCHEMES.md A8): on a 2D image grid, rotate by r = (z, y, x) with z a learned linear
            function of each patch's mean depth (:meth:`~StringBase.depth_positions`); the model then takes
            ``depth=`` (B, 1, H, W). Needs ``ndim=2`` (the model's) and ``extrapolation='none'``.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int = 1,
        base: float = 100.0,
        ndim: int = 2,
        learn_frequencies: bool = True,
        coord_mode: str = "index",
        grid_size: Sequence[int] | None = None,
        extrapolation: str = "none",
        yarn_alpha: float = 1.0,
        yarn_beta: float = 32.0,
        depth_coords: bool = False,
    ) -> None:
        super().__init__(
            dim, num_heads, depth, ndim, coord_mode, grid_size, extrapolation, yarn_alpha, yarn_beta, depth_coords
        )
        ndim = self.ndim  # 3 with depth_coords: (z, y, x)
        check_base(base)
        if ndim == 3 and self.head_dim < 8:  # the t axis gets head_dim // 8 frequency pairs
            raise ValueError(
                f"head_dim must be >= 8 for ndim=3 (a frequency pair per axis), got head_dim={self.head_dim}"
            )
        pairs = self.head_dim // 2
        n_t = pairs // 4 if ndim == 3 else 0
        n_x = (pairs - n_t) // 2
        axis_pairs = (n_x, pairs - n_t - n_x) + ((n_t,) if ndim == 3 else ())
        freqs = axial_frequencies(self.head_dim, base, axis_pairs).expand(depth, num_heads, ndim, pairs).clone()
        self.freqs = nn.Parameter(freqs, requires_grad=learn_frequencies)
        # S = A - A^T from the strictly upper entries of A: d (d - 1) / 2 numbers per layer and head
        count = self.head_dim * (self.head_dim - 1) // 2
        self.skew_params = nn.Parameter(torch.zeros(depth, num_heads, count))
        self.base = float(base)

    def frequencies(self) -> torch.Tensor:
        return self.freqs

    def string_basis(self) -> torch.Tensor:
        return cayley_orthogonal(skew_from_params(self.skew_params, self.head_dim))

    def no_weight_decay(self) -> set[str]:
        """The frequencies and the skew parameters of P (decay would pull P towards the identity, i.e. RoPE)."""
        return super().no_weight_decay() | {"freqs", "skew_params"}


def fold_string_(model: nn.Module) -> nn.Module:
    """Fold every STRING scheme's orthogonal P into the q and k projections of ``model``, in place.

    W_q -> P W_q and W_k -> P W_k per head (biases alike); the schemes then apply RoPE only, so inference
    costs what RoPE costs and the outputs are unchanged (to fp32 rounding). Returns ``model``.

    Raises ValueError when the model has no STRING scheme, is already folded, or normalises q/k after the
    projection (qk_norm): P would then no longer commute with the normalisation.
    """
    from ..attention import PosAttention

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    schemes = [m for m in model.modules() if isinstance(m, StringBase)]
    if not schemes:
        raise ValueError(f"{type(model).__name__} has no STRING scheme (string_cayley or string_circulant) to fold")
    if len(schemes) > 1:
        raise ValueError(f"fold_string_ folds one STRING scheme per model, found {len(schemes)}")
    scheme = schemes[0]
    if scheme.is_folded:
        raise ValueError(f"{type(scheme).__name__} is already folded into the q/k projections")
    attentions = [m for m in model.modules() if isinstance(m, PosAttention)]
    if not attentions:
        raise ValueError(f"{type(model).__name__} has no PosAttention whose q/k projections could take P")
    with torch.no_grad():
        basis = scheme.string_basis()
        for attn in attentions:
            if not (isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity)):
                raise ValueError("fold_string_ needs q/k without normalisation (qk_norm=False): P does not commute")
            heads, head_dim = attn.num_heads, attn.head_dim
            if (heads, head_dim) != (scheme.num_heads, scheme.head_dim):
                raise ValueError(
                    f"attention has {heads} heads of {head_dim} channels, the scheme {scheme.num_heads} of "
                    f"{scheme.head_dim}"
                )
            weight, bias = attn.fold_qk_basis(_layer_basis(basis, attn.layer))
            attn.qkv.weight.copy_(weight)
            if bias is not None:
                attn.qkv.bias.copy_(bias)
        scheme.folded.fill_(True)
        scheme.is_folded = True
    return model
