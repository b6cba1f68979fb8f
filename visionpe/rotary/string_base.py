"""The STRING family (Schenck et al., "Learning the RoPEs: Better 2D and 3D Position Encodings with STRING",
ICML 2025): R(r) = RoPE(r) P with one orthogonal P per layer and head, shared by every token.

:class:`StringBase` holds what Cayley- and Circulant-STRING share: the RoPE part (learned frequencies on
:class:`~visionpe.rotary.base.LinearRotary`), the basis change P as a per-block :class:`BasisRotation` that
attention folds into the q/k projection, RGB-D positions (``depth_coords``), and :func:`fold_string_`.
P multiplies every token, prefix tokens included (only RoPE skips them): that is what makes :func:`fold_string_`
exact, since folding P into W_q and W_k transforms every token's q and k.

Rotary value embeddings (``rotate_values=True``): v_j -> RoPE(r_j) P v_j and o_i -> P^T RoPE(r_i)^T o_i, so that
o_i = sum_j a_ij P^T RoPE(r_j - r_i) P v_j = sum_j a_ij R(r_i)^T R(r_j) v_j. With R(r) = Q^T RoPE(r) P
(Circulant-STRING's Q = F) the Q cancels as in the logits. :func:`fold_string_` folds P into W_v and P^T into the
output projection as well.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention import PosAttention
from ..base import check_rotate_input
from ..checks import check_bool
from ..interfaces.rotary import LayerRotation, RotaryState
from .base import LinearRotary, RotaryOptions

__all__ = ["StringBase", "StringState", "BasisRotation", "fold_string_"]


def _layer_basis(basis: torch.Tensor, layer: int) -> torch.Tensor:
    """P of block ``layer`` from :meth:`StringBase.string_basis` (depth | 1, ...): one P shared by every layer or
    one per layer."""
    return basis[layer] if basis.shape[0] > 1 else basis[0]


def _times_basis(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """P x for every token of ``x`` (..., head_dim), with P (num_heads | 1, head_dim, head_dim)."""
    return x @ basis.to(x.dtype).transpose(-1, -2)


class BasisRotation(LayerRotation):
    """One block's STRING rotation: the basis change P on every token, then the RoPE tables (``inner``).

    With ``rotate_values`` the values are rotated as q and k (RoPE(r_j) P v_j) and attention's output back
    (P^T RoPE(r_i)^T o_i); the inner tables then carry the values' unit tables.
    """

    def __init__(self, basis: torch.Tensor, inner: LayerRotation, rotate_values: bool = False) -> None:
        self._basis, self.inner, self.num_tokens = basis, inner, inner.num_tokens
        self.values = rotate_values

    @property
    def basis(self) -> torch.Tensor:
        return self._basis

    def without_basis(self) -> LayerRotation:
        # P folded into the q/k projection for this forward: the values still need it
        return ValueBasisRotation(self._basis, self.inner) if self.values else self.inner

    def rotate_values(self, v: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        if not self.values:
            return v
        return self.inner.rotate_values(_times_basis(v, self._basis), keep)

    def unrotate_output(self, o: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        if not self.values:
            return o
        return self.inner.unrotate_output(o, keep) @ self._basis.to(o.dtype)  # P^T o per token

    def rotate(self, qk: torch.Tensor) -> torch.Tensor:
        return self.inner.rotate(_times_basis(qk, self._basis))

    def rotate_kept(self, qk: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        # P acts on each token alone: applied to the kept tokens, then their RoPE rows
        return self.inner.rotate_kept(_times_basis(qk, self._basis), keep)


class ValueBasisRotation(BasisRotation):
    """:class:`BasisRotation` once attention has folded P into the q/k projection for the forward: q and k get the
    RoPE tables only, the values and the output still P (rotary value embeddings)."""

    def __init__(self, basis: torch.Tensor, inner: LayerRotation) -> None:
        super().__init__(basis, inner, rotate_values=True)

    @property
    def basis(self) -> None:
        return None

    def without_basis(self) -> LayerRotation:
        return self

    def rotate(self, qk: torch.Tensor) -> torch.Tensor:
        return self.inner.rotate(qk)

    def rotate_kept(self, qk: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.inner.rotate_kept(qk, keep)

    def fused_tables(self, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.inner.fused_tables(keep)  # q and k get the inner tables only

    def rotate_qkv(
        self, qkv: torch.Tensor, batch: int, num_heads: int, keep: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.inner.rotate_qkv(qkv, batch, num_heads, keep)


class StringState(RotaryState):
    """STRING's per-forward state: the RoPE state and P of every layer (``basis``: (depth | 1, num_heads | 1,
    head_dim, head_dim), None once folded into the projections; ``rotate_values``: the values are rotated too)."""

    def __init__(self, rotary: RotaryState, basis: torch.Tensor | None, rotate_values: bool = False) -> None:
        self.rotary, self.basis, self.rotate_values = rotary, basis, rotate_values

    def layer(self, index: int) -> LayerRotation:
        inner = self.rotary.layer(index)
        if self.basis is None:
            return inner
        return BasisRotation(_layer_basis(self.basis, index), inner, self.rotate_values)


class StringBase(LinearRotary):
    """STRING as RoPE(r) times a fixed-per-forward orthogonal basis change ``string_basis()``.

    ``apply`` returns RoPE(r) P x for every token (prefix tokens get P only); attention folds P into the q/k
    projection for the forward (:class:`BasisRotation`), and once :func:`fold_string_` has moved P into the
    projection weights for good, ``apply`` is plain RoPE. ``rotate`` always returns R(r) x.
    """

    depth_coords: bool = False  # set by the constructor (read while LinearRotary's sets up extrapolation)

    per_token_tables = False  # a learned basis change before the tables

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int,
        ndim: int,
        depth_coords: bool = False,
        options: RotaryOptions | None = None,
    ) -> None:
        """``options``: the shared rotary options (:class:`~visionpe.rotary.base.RotaryOptions`), None for the
        defaults."""
        check_bool(depth_coords, "depth_coords")
        options = RotaryOptions.of(options)
        if depth_coords:
            # RGB-D: r = (z, y, x) on a 2D image grid, z from each patch's mean depth
            if ndim != 2:
                raise ValueError(f"depth_coords=True adds a depth axis to 2D image grids (ndim=2), got ndim={ndim}")
            extrapolation, coord_mode = options.extrapolation, options.coord_mode
            if extrapolation != "none" or coord_mode == "ref_scaled":
                raise ValueError(
                    "depth_coords=True rotates by learned depth positions, which no grid ratio scales: it needs "
                    f"extrapolation='none' and a coord_mode other than 'ref_scaled', got extrapolation="
                    f"{extrapolation!r}, coord_mode={coord_mode!r}"
                )
            ndim, options = 3, options.replace(grid_size=None)
        super().__init__(dim, num_heads, depth, ndim, options=options)
        self.depth_coords = depth_coords
        if depth_coords:
            # the paper's learnable linear layer on the mean-pooled depth, starting at z = depth
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

    def fixed_buffers(self) -> dict[str, torch.Tensor]:
        # the persistent flag is state (whether the checkpoint holds folded parameters), False at initialisation
        return {"folded": torch.zeros((), dtype=torch.bool)}

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.is_folded = False

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
        mean depth d, ``patch_depth`` (B, N), and (y, x) the grid ``coords`` (N, 2).

        Example:
            >>> from visionpe.rotary.string_cayley import StringCayley
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

    def prepare(
        self, coords: torch.Tensor, num_prefix_tokens: int = 0, grid_size: tuple[int, ...] | None = None
    ) -> StringState:
        """RoPE state of :meth:`LinearRotary.prepare` plus P of every layer (none once folded).

        With ``depth_coords``, ``coords`` are the (B, N, 3) or (N, 3) positions of :meth:`depth_positions`.
        """
        if self.depth_coords and coords.shape[-1] != 3:
            raise ValueError(
                f"{type(self).__name__} with depth_coords=True needs (z, y, x) positions from depth_positions(...), "
                f"got coords of shape {tuple(coords.shape)} (a model passes them when called with depth=...)"
            )
        rotary = super().prepare(coords, num_prefix_tokens, grid_size)
        return StringState(rotary, None if self.is_folded else self.string_basis(), self.rotate_values)

    @property
    def extra_inputs(self) -> tuple[str, ...]:
        """``("patch_depth",)`` with ``depth_coords``: each patch's mean depth, (B, N)."""
        return ("patch_depth",) if self.depth_coords else ()

    def model_coords(self, grid_size: tuple[int, ...], device=None, **inputs: torch.Tensor) -> torch.Tensor:
        """The grid's coordinates (:meth:`forward_coords`: drawn through ``coord_augment`` in training), or with
        ``depth_coords`` the (B, N, 3) positions (z, y, x) of :meth:`depth_positions` from ``patch_depth``."""
        coords = self.forward_coords(grid_size, device)
        return self.depth_positions(coords, inputs.get("patch_depth")) if self.depth_coords else coords

    def rotate(
        self, x: torch.Tensor, coords: torch.Tensor, layer: int = 0, grid_size: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """R(r) x for ``x`` (B, num_heads, N, head_dim) at ``coords`` (N, ndim), folded or not; ``grid_size`` as in
        :meth:`~visionpe.base.RotaryPositionEncoding.rotate` (the grid the extrapolation mode scales against)."""
        coords = check_rotate_input(self, x, coords, layer)
        rotary = LinearRotary.prepare(self, coords, 0, grid_size=self.rotation_grid_size(coords, grid_size))
        out = rotary.layer(layer).rotate(_times_basis(x, _layer_basis(self.string_basis(), layer)))
        out_basis = self.rotation_output_basis()
        return out if out_basis is None else out @ out_basis.to(x.dtype)


def fold_string_(model: nn.Module) -> nn.Module:
    """Fold every STRING scheme's orthogonal P into the q and k projections of ``model``, in place.

    W_q -> P W_q and W_k -> P W_k per head (biases alike); the schemes then apply RoPE only, so inference
    costs what RoPE costs and the outputs are unchanged (to fp32 rounding). With rotary value embeddings
    (``rotate_values=True``) W_v -> P W_v too and the output projection's columns of each head W_o -> W_o P^T.
    Returns ``model``.

    Raises ValueError when the model has no STRING scheme, is already folded, or normalises q/k after the
    projection (qk_norm): P would then no longer commute with the normalisation; with ``rotate_values``, also when
    attention normalises or gates its output before the projection (P^T would not commute either).
    """
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
    for attn in attentions:  # every check before any weight changes
        if not (isinstance(attn.q_norm, nn.Identity) and isinstance(attn.k_norm, nn.Identity)):
            raise ValueError("fold_string_ needs q/k without normalisation (qk_norm=False): P does not commute")
        heads, head_dim = attn.num_heads, attn.head_dim
        if (heads, head_dim) != (scheme.num_heads, scheme.head_dim):
            raise ValueError(
                f"attention has {heads} heads of {head_dim} channels, the scheme {scheme.num_heads} of "
                f"{scheme.head_dim}"
            )
        if scheme.rotate_values and not (isinstance(attn.norm, nn.Identity) and attn.gate is None):
            raise ValueError(
                "fold_string_ with rotate_values=True needs attention without an output norm or gate "
                "(scale_norm=False, no gate): P^T does not commute with them"
            )
    with torch.no_grad():
        basis = scheme.string_basis()
        for attn in attentions:
            layer_basis = _layer_basis(basis, attn.layer)
            weight, bias = attn.fold_qk_basis(layer_basis)
            attn.qkv.weight.copy_(weight)
            if bias is not None:
                attn.qkv.bias.copy_(bias)
            if scheme.rotate_values:
                _fold_value_basis(attn, layer_basis)
        scheme.folded.fill_(True)
        scheme.is_folded = True
    return model


def _fold_value_basis(attn: nn.Module, basis: torch.Tensor) -> None:
    """W_v -> P W_v (bias alike) and the output projection's columns of each head W_o -> W_o P^T, in place:
    rotary value embeddings' P v and P^T o moved into the weights (``basis``: (num_heads | 1, d, d))."""
    heads, head_dim = attn.num_heads, attn.head_dim
    weight, bias, proj = attn.qkv.weight, attn.qkv.bias, attn.proj.weight
    basis = basis.to(weight.dtype).expand(heads, head_dim, head_dim)
    v_rows = slice(2 * heads * head_dim, 3 * heads * head_dim)
    weight[v_rows] = (basis @ weight[v_rows].view(heads, head_dim, -1)).flatten(0, 1)
    if bias is not None:
        bias[v_rows] = (basis @ bias[v_rows].view(heads, head_dim, 1)).flatten()
    columns = proj.view(proj.shape[0], heads, head_dim)
    proj.copy_(torch.einsum("ohe,hfe->ohf", columns, basis.to(proj.dtype)).flatten(1))
