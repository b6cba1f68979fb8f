"""The three ways a position encoding enters a ViT, as base classes the model and attention rely on.

- :class:`AbsolutePositionEncoding` adds to (or transforms) the token sequence, before the blocks or
  after the blocks named in ``insert_after``.
- :class:`RotaryPositionEncoding` rotates q and k inside attention. ``prepare`` turns coordinates into a
  per-forward :class:`~visionpe.interfaces.rotary.RotaryState` once (e.g. cos/sin for every layer); each block asks it
  for its :class:`~visionpe.interfaces.rotary.LayerRotation`.
- :class:`BiasPositionEncoding` adds to the attention logits; it may depend on q (contextual terms) and
  may add a value term, which needs the attention probabilities.

Prefix tokens (cls, registers) come first in the sequence and get no position: identity rotation, zero bias.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from .checks import check_instance, check_int, is_int
from .grid import CoordAugment, grid_coords, validate_count, validate_grid_size

if TYPE_CHECKING:
    from .interfaces.rotary import RotaryState

__all__ = [
    "PositionEncoding",
    "AbsolutePositionEncoding",
    "RotaryPositionEncoding",
    "BiasPositionEncoding",
    "check_coords",
    "check_layer",
    "check_model_shape",
    "check_rotate_input",
    "set_coord_augment",
]


def check_model_shape(dim: int, num_heads: int, depth: int = 1) -> int:
    """Validate the model shape a scheme is built for; return ``head_dim = dim // num_heads``.

    ``dim``, ``num_heads`` and ``depth`` must be positive ints (TypeError for other types, bool included;
    ValueError for values <= 0) and ``num_heads`` must divide ``dim``.

    Example:
        >>> check_model_shape(384, 6, 12)
        64
    """
    for arg, value in (("dim", dim), ("num_heads", num_heads), ("depth", depth)):
        check_int(value, arg, min=1)
    if dim % num_heads:
        raise ValueError(f"dim must be divisible by num_heads, got dim={dim}, num_heads={num_heads}")
    return dim // num_heads


def check_coords(coords: torch.Tensor, ndims: tuple[int, ...], scheme: str) -> torch.Tensor:
    """Validate a ``(N, ndim)`` coordinate tensor for a scheme that supports ``ndims`` axes."""
    if not isinstance(coords, torch.Tensor):
        raise TypeError(f"coords must be a torch.Tensor of shape (N, ndim), got {type(coords).__name__}")
    if coords.ndim != 2:
        raise ValueError(f"coords must have shape (N, ndim), got shape {tuple(coords.shape)}")
    if coords.shape[1] not in ndims:
        raise ValueError(
            f"{scheme} supports coordinates with {' or '.join(map(str, ndims))} axes, "
            f"got coords with {coords.shape[1]} axes (shape {tuple(coords.shape)})"
        )
    if not coords.is_floating_point():
        coords = coords.float()
    if not torch.isfinite(coords).all():
        raise ValueError(f"coords must be finite, got NaN or inf in {scheme} coordinates")
    return coords


def check_layer(layer: int, depth: int | None, scheme: str) -> int:
    """``layer`` if it is an int (not a bool) in ``[0, depth)`` (any non-negative int when ``depth`` is None), else a
    ValueError naming ``layer``, the range and the scheme: a cheap Python check for the per-block paths."""
    if not is_int(layer) or not 0 <= layer < (depth or layer + 1):
        raise ValueError(f"layer must be an int in [0, depth={depth}) for {scheme}, got {layer!r}")
    return layer


def check_rotate_input(scheme: nn.Module, x: torch.Tensor, coords: torch.Tensor, layer: int) -> torch.Tensor:
    """Validate the arguments of ``rotate`` (x (B, num_heads, N, head_dim), coords (N, ndim), layer); return coords
    as a float tensor on x's device."""
    name = type(scheme).__name__
    heads, head_dim = getattr(scheme, "num_heads", None), getattr(scheme, "head_dim", None)
    expected = f"(B, num_heads={heads}, N, head_dim={head_dim})" if heads else "(B, num_heads, N, head_dim)"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a {expected} tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if x.ndim != 4 or (heads and (x.shape[1], x.shape[3]) != (heads, head_dim)) or x.shape[0] == 0:
        raise ValueError(f"x must be a non-empty {expected} tensor for {name}, got shape {tuple(x.shape)}")
    check_layer(layer, getattr(scheme, "depth", None), name)
    coords = check_coords(coords, scheme.coord_ndims, name)
    if coords.shape[0] != x.shape[2]:
        raise ValueError(f"coords has {coords.shape[0]} rows but x has {x.shape[2]} tokens (dim 2)")
    return coords.to(x.device)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 shard)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _distribute_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (the full tensor, the same on every process) as a DTensor with ``like``'s mesh and placements."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements)


class PositionEncoding(nn.Module):
    """Common interface. Subclasses set ``kind`` and ``ndims`` (the grid ranks they support).

    Fixed tables (rotary frequencies, slopes, masks, index tables) are buffers that a scheme computes from its
    configuration, named with their values by :meth:`fixed_buffers`. They are non-persistent (no state-dict entries)
    unless they are state a checkpoint must keep (a seeded draw, a flag). The base class rebuilds them:

    - after every move (``.to()``, ``.cuda()``, ``.to_empty()``): the non-persistent ones are recomputed on the new
      device, so a scheme built on the meta device and materialised with ``to_empty`` holds the right tables, and a
      blanket ``model.to(torch.bfloat16)`` leaves them in the dtype they were computed in (fp32; RayRoPE's float64):
      a cast to a wider dtype (``model.double()``) casts the computed values;
    - in :meth:`init_non_persistent_buffers` (timm's hook, called by ``timm.models.reinit_non_persistent_buffers``);
    - in :meth:`reset_parameters`, the hook meta-device initialisation calls (Lightning's ``ModelParallelStrategy``
      and ``FSDPStrategy``, timm's ``init_weights``), with the persistent ones back to their initial values and the
      parameters drawn afresh as the constructor draws them.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> PositionEncoding:
        self = super().__new__(cls)
        # the constructor's arguments, from which reset_parameters draws the parameters afresh (set before
        # nn.Module.__init__, hence object.__setattr__)
        object.__setattr__(self, "_init_arguments", (args, dict(kwargs)))
        return self

    def fixed_buffers(self) -> dict[str, torch.Tensor]:
        """The scheme's fixed tables by buffer name, computed from its configuration on the CPU in the dtype the
        scheme keeps them in (fp32 for angles and frequencies), persistent ones at their initial values.

        Every buffer the scheme registers itself must be named here (the meta-device test of every scheme checks it):
        it is the one place :meth:`reset_parameters`, :meth:`init_non_persistent_buffers` and moves rebuild them
        from. Empty by default (a scheme without buffers)."""
        return {}

    def _computed_buffers(self) -> dict[str, torch.Tensor]:
        with torch.device("cpu"):  # not the meta device of a `with torch.device("meta")` block around a move
            values = self.fixed_buffers()
        unknown = sorted(set(values) - set(self._buffers))
        if unknown:
            raise RuntimeError(
                f"{type(self).__name__}.fixed_buffers() names {unknown}, which are not buffers the scheme registered "
                f"(its buffers: {sorted(self._buffers)})"
            )
        return values

    def _set_fixed_buffers(self, persistent: bool) -> None:
        """Put the values of :meth:`fixed_buffers` in place, on each buffer's device; ``persistent`` False: only the
        non-persistent ones."""
        for name, value in self._computed_buffers().items():
            current = self._buffers[name]
            if name not in self._non_persistent_buffers_set:
                if persistent and current is not None:
                    with torch.no_grad():
                        current.copy_(value.to(current.dtype))  # state: keeps its tensor, dtype and device
                continue
            dtype = value.dtype
            if current is not None and value.is_floating_point() and current.is_floating_point():
                if torch.finfo(current.dtype).bits > torch.finfo(dtype).bits:
                    dtype = current.dtype  # model.double(): the computed values, cast
            device = value.device if current is None else current.device
            self._buffers[name] = value.to(device=device, dtype=dtype)

    def init_non_persistent_buffers(self) -> None:
        """Recompute the non-persistent fixed tables (:meth:`fixed_buffers`) in place, in the dtype they are computed
        in, on the device they are on: timm's hook (``timm.models.reinit_non_persistent_buffers``)."""
        self._set_fixed_buffers(persistent=False)

    def reset_parameters(self) -> None:
        """Initialise the scheme afresh after ``to_empty`` (meta-device initialisation): fixed tables recomputed,
        persistent buffers back to their initial values, and the parameters (the scheme's submodules' included)
        drawn as the constructor draws them, from the global CPU generator, by building the scheme again on the CPU
        with the constructor's arguments and copying its parameters. Sharded (DTensor) parameters receive their shard
        of the fresh values (every process must call it, in the same order).

        Raises:
            RuntimeError: a parameter's shape differs from the one the constructor gives (it was changed since
                construction, e.g. a learned table resampled by ``set_grid_size``): load a state dict instead.
        """
        params = dict(self.named_parameters())
        if params:
            args, kwargs = self._init_arguments
            with torch.device("cpu"):
                fresh = dict(type(self)(*args, **kwargs).named_parameters())
            for name, param in params.items():
                value = fresh.get(name)
                if value is None or value.shape != param.shape:
                    given = None if value is None else tuple(value.shape)
                    raise RuntimeError(
                        f"{type(self).__name__}.reset_parameters: parameter {name!r} has shape {tuple(param.shape)}, "
                        f"but the constructor's arguments give {given}: it changed after construction, so load its "
                        "values from a state dict instead"
                    )
                value = value.detach().to(dtype=param.dtype)
                if _is_dtensor(param):
                    value = _distribute_like(value, param)
                with torch.no_grad():
                    param.copy_(value.to(param.device))
        self._set_fixed_buffers(persistent=True)

    def _apply(self, fn, *args, **kwargs):
        module = super()._apply(fn, *args, **kwargs)
        self._set_fixed_buffers(persistent=False)  # see the class docstring
        return module

    kind: ClassVar[str] = ""
    ndims: ClassVar[tuple[int, ...]] = (2,)
    # -- capabilities, read by visionpe.contract (the entry points' check and the compatibility table) --
    #: inputs beyond the patch tokens the scheme cannot work without (``"cameras"``; ``"pixels"``: the input image,
    #: which the model passes to an absolute scheme's forward as ``pixels=``)
    requires: ClassVar[frozenset[str]] = frozenset()
    #: inputs the scheme reads when the model is given them, and does without otherwise (3DPPE's known depths)
    optional_inputs: ClassVar[frozenset[str]] = frozenset()
    #: grid ranks the scheme can be built for (2: images; 3: video, through the scheme's ``ndim`` option)
    grid_ranks: ClassVar[tuple[int, ...]] = (2,)
    #: with causal attention, a token still reads no later token (False: the scheme mixes tokens outside attention)
    supports_causal: ClassVar[bool] = True
    #: takes mixed-resolution batches (timm's NaFlex layout), each sample at its own grid
    supports_mixed_resolution: ClassVar[bool] = True
    #: why ``torch.onnx`` cannot export a model with the scheme, or None (``torch.export`` works for every scheme)
    onnx_refusal: ClassVar[str | None] = None
    #: the backends of :func:`~visionpe.set_rotary_backend` that act on the scheme
    rotary_backends: ClassVar[tuple[str, ...]] = ()
    #: the backends of :func:`~visionpe.set_attention_backend` that act on the scheme
    attention_backends: ClassVar[tuple[str, ...]] = ()
    #: a rotary scheme whose ``prepare`` gives cos/sin tables of its coordinates times frequencies and nothing else:
    #: prepared with per-sample coordinates, it rotates a mixed-resolution batch in one padded attention
    per_token_tables: ClassVar[bool] = False
    coord_mode: str = "index"
    #: blocks after which the scheme runs (absolute schemes applied between blocks, e.g. CPE's PEG); () = before
    insert_after: tuple[int, ...] = ()
    #: the scheme adds nothing to prefix tokens (timm's ``no_embed_class``; the learned table sets it)
    no_embed_class: bool = False
    #: the scheme reads its positions from coordinates (:meth:`forward_coords`), so a training-time
    #: :class:`~visionpe.grid.CoordAugment` applies; schemes that read integer offsets or tables leave it False
    consumes_coords: ClassVar[bool] = False
    _coord_augment: CoordAugment | None = None

    @property
    def coord_augment(self) -> CoordAugment | None:
        """The training-time coordinate augmentation (:class:`~visionpe.grid.CoordAugment`) that
        :meth:`forward_coords` draws from in training mode, or None. Setting it to a scheme that reads no coordinates
        (``consumes_coords`` False) raises ValueError; a dict of the fields is converted."""
        return self._coord_augment

    @coord_augment.setter
    def coord_augment(self, value: CoordAugment | dict | None) -> None:
        value = CoordAugment.from_value(value)
        if value is not None and not self.consumes_coords:
            raise ValueError(
                f"coord_augment applies to schemes that read coordinates; {type(self).__name__} reads integer offsets "
                f"or tables, so it would not change anything; got coord_augment={value!r}"
            )
        self._coord_augment = value

    def forward_coords(self, grid_size: tuple[int, ...], device=None, coords_fn=None) -> torch.Tensor:
        """The coordinates a forward uses: ``coords_fn(grid_size)`` (default :meth:`coords` on ``device``), or in
        training mode with :attr:`coord_augment` set, one draw of it (:meth:`~visionpe.grid.CoordAugment.apply`).
        In eval mode this is ``coords_fn(grid_size)`` itself, so evaluation is that of a scheme without
        augmentation, bit for bit."""
        if coords_fn is None:

            def coords_fn(grid: tuple[int, ...]) -> torch.Tensor:
                return self.coords(grid, device)

        if not self.training or self._coord_augment is None:
            return coords_fn(grid_size)
        return self._coord_augment.apply(coords_fn, self.check_grid(grid_size))

    @property
    def extra_inputs(self) -> tuple[str, ...]:
        """Names of per-sample inputs beyond the image that the scheme needs from the model, passed to
        :meth:`RotaryPositionEncoding.model_coords` by name (e.g. ``("patch_depth",)``, each patch's mean depth,
        for STRING with ``depth_coords=True``). Empty by default."""
        return ()

    #: weight of each term of :meth:`auxiliary_losses` by name in the training loss (a name not listed: 1)
    auxiliary_loss_weights: Mapping[str, float] = MappingProxyType({})

    def auxiliary_losses(self, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Training losses of the scheme's own, by name (e.g. SeqPE's ``seqpe_ct``), unweighted: the trainer
        (:class:`visionpe.training.Classifier`) adds each times its :attr:`auxiliary_loss_weights` entry to the task
        loss in training steps. ``generator`` drives the sampling they draw. Empty by default."""
        return {}

    def modules_after_blocks(self) -> dict[str, int]:
        """{submodule name: block index} for submodules that run after one particular block (CPE's PEG after
        block ``i``), so the model groups their parameters with that block (layer-wise decay, freezing). Empty by
        default."""
        return {}

    @property
    def coord_ndims(self) -> tuple[int, ...]:
        """Columns of the coordinates ``rotate`` takes: the grid's ranks (STRING with depth adds one)."""
        return tuple(self.ndims)

    def check_grid(self, grid_size: tuple[int, ...]) -> tuple[int, ...]:
        grid_size = validate_grid_size(grid_size)
        if len(grid_size) not in self.ndims:
            raise ValueError(
                f"{type(self).__name__} supports {' or '.join(f'{n}D' for n in self.ndims)} grids, "
                f"got a {len(grid_size)}D grid_size {grid_size}"
            )
        return grid_size

    def coords(self, grid_size: tuple[int, ...], device=None) -> torch.Tensor:
        """Patch coordinates in this scheme's coordinate mode, ``(N, ndim)``.

        ``ref_scaled`` (i * n_train / n, position interpolation) is relative to the scheme's training grid,
        ``train_grid_size``.
        """
        grid_size = self.check_grid(grid_size)
        if self.coord_mode != "ref_scaled":
            return grid_coords(grid_size, mode=self.coord_mode, device=device)
        train = getattr(self, "train_grid_size", None)
        if train is None:
            raise ValueError(
                f"{type(self).__name__} has coord_mode='ref_scaled', which needs the training grid "
                "(train_grid_size, from grid_size at construction), got None"
            )
        return grid_coords(grid_size, mode="ref_scaled", ref_grid_size=train, device=device)

    def set_grid_size(self, grid_size: tuple[int, ...]) -> None:  # noqa: B027 - optional hook
        """Called when the model's nominal grid changes (``set_input_size``); tables may resample."""


class AbsolutePositionEncoding(PositionEncoding, ABC):
    """Added to tokens. ``insert_after`` empty: applied once, before the blocks; else after each of those blocks,
    called with ``after_block=i`` (so ``forward`` then takes that keyword)."""

    kind = "absolute"

    @abstractmethod
    def forward(self, x: torch.Tensor, grid_size: tuple[int, ...], num_prefix_tokens: int) -> torch.Tensor:
        """``x``: (B, num_prefix_tokens + N, C) -> same shape."""

    def check_tokens(
        self, x: torch.Tensor, grid_size: tuple[int, ...], num_prefix_tokens: int, dim: int | None = None
    ) -> tuple[int, ...]:
        """Validate ``forward``'s arguments: x (B >= 1, num_prefix_tokens + prod(grid_size), dim); returns the grid."""
        grid_size = self.check_grid(grid_size)
        validate_count(num_prefix_tokens, "num_prefix_tokens")
        # messages are formatted only on failure: under torch.compile, formatting a traced size fixes its value
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a (B, P + N, C) tensor, got {type(x).__name__}")
        if (
            x.ndim != 3
            or x.shape[0] == 0
            or x.shape[1] != num_prefix_tokens + math.prod(grid_size)
            or (dim is not None and x.shape[2] != dim)
            or not x.is_floating_point()
        ):
            raise ValueError(
                f"x must have shape (B, {num_prefix_tokens} + {math.prod(grid_size)}, {dim or 'C'}) (B >= 1, "
                f"floating point) for grid_size {grid_size} and {num_prefix_tokens} prefix tokens, got shape "
                f"{tuple(x.shape)} and dtype {x.dtype}"
            )
        return grid_size


class RotaryPositionEncoding(PositionEncoding, ABC):
    """Rotates q and k. ``prepare`` builds a typed per-forward state once (:mod:`visionpe.interfaces.rotary`); each
    block asks it for its rotation."""

    kind = "rotary"
    consumes_coords = True
    rotary_backends = ("eager",)

    @abstractmethod
    def prepare(
        self, coords: torch.Tensor, num_prefix_tokens: int = 0, grid_size: tuple[int, ...] | None = None
    ) -> RotaryState:
        """Per-forward :class:`~visionpe.interfaces.rotary.RotaryState` from patch ``coords`` (N, ndim) (or (B, N, ndim)
        where the scheme takes per-sample positions); prefix rows get the identity unless the scheme says otherwise.

        ``grid_size`` is the current grid when the model knows it (schemes that scale for extrapolation use it).
        Attention then asks the state for each block's :class:`~visionpe.interfaces.rotary.LayerRotation`.
        """

    def apply(self, qk: torch.Tensor, state: RotaryState, layer: int) -> torch.Tensor:
        """Rotate ``qk`` (..., B, num_heads, num_prefix_tokens + N, head_dim), q and k stacked in front, as block
        ``layer`` does: ``state.layer(layer).rotate(qk)``."""
        return state.layer(layer).rotate(qk)

    def model_coords(self, grid_size: tuple[int, ...], device=None, **inputs: torch.Tensor) -> torch.Tensor:
        """The positions the model prepares this scheme with for ``grid_size``: :meth:`forward_coords` by default
        (:meth:`coords`, drawn through :attr:`coord_augment` in training). A scheme that declares
        :attr:`extra_inputs` receives them here by name (e.g. STRING's ``patch_depth``)."""
        return self.forward_coords(grid_size, device)

    def rotate(
        self, x: torch.Tensor, coords: torch.Tensor, layer: int = 0, grid_size: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """Rotate ``x`` (B, num_heads, N, head_dim) by the positions ``coords`` (N, ndim).

        Every token of ``x`` is rotated; the model passes prefix tokens separately and leaves them as they are.

        ``grid_size``: the grid ``coords`` come from, which the extrapolation mode (``pi``, ``ntk``, ``yarn``)
        scales against the training grid, as the model path does. When it is None and a mode is set, it is read off
        integer ``index`` coordinates (``coords.amax(0) + 1``); other coordinates then need it given (ValueError).
        """
        coords = check_rotate_input(self, x, coords, layer)
        return self.apply(x, self.prepare(coords, 0, grid_size=self.rotation_grid_size(coords, grid_size)), layer)

    def rotation_grid_size(self, coords: torch.Tensor, grid_size: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The grid that :meth:`rotate` passes to :meth:`prepare`: ``grid_size`` checked, or, when it is None and an
        extrapolation mode is set, inferred from ``index`` coordinates (non-negative integers) as
        ``coords.amax(0) + 1``; ValueError asking for ``grid_size`` when it cannot be inferred."""
        if grid_size is not None:
            grid_size = self.check_grid(grid_size)
            if len(grid_size) != coords.shape[1]:
                raise ValueError(
                    f"grid_size must have one entry per coordinate axis ({coords.shape[1]}), got {grid_size}"
                )
            return grid_size
        mode = getattr(self, "extrapolation", "none")
        if mode == "none":
            return None
        index_mode = self.coord_mode == "index" and not getattr(self, "_scales_own_coords", False)
        if index_mode and coords.shape[0] > 0 and bool((coords >= 0).all()) and bool((coords == coords.round()).all()):
            return tuple(int(n) + 1 for n in coords.amax(0).tolist())
        raise ValueError(
            f"{type(self).__name__} has extrapolation={mode!r}, which scales against the grid the coordinates come "
            f"from: pass grid_size=(...) to rotate (it can only be inferred from non-negative integer 'index' "
            f"coordinates; coord_mode={self.coord_mode!r})"
        )


class BiasPositionEncoding(PositionEncoding, ABC):
    """Adds to attention logits (already divided by sqrt(head_dim)).

    ``needs_probs``: the scheme adds a value term from the attention probabilities, so attention runs explicitly.

    At large N attention runs in chunks of query rows (see :class:`~visionpe.attention.PosAttention`): ``attn_bias``
    and ``value_term`` then get ``rows``, a contiguous slice of the P + N query tokens, and only those rows' q or
    probabilities, and must return only those rows. ``prepare`` should therefore keep state that grows like N
    (coordinates, per-offset tables), not like N^2, and build the rows asked for.
    """

    kind = "bias"
    attention_backends = ("sdpa",)
    needs_probs: bool = False
    #: ``attn_bias`` and ``augment_qk`` also receive ``tokens``, the block's normalised input (B, P + N, C), for
    #: biases computed from the tokens themselves (context-aware slopes or curvatures)
    needs_tokens: bool = False
    #: the bias is written as extra channels appended to q and k (:meth:`augment_qk`): q~ . k~ = q . k + bias, so
    #: attention never builds an N x N bias; ``attn_bias`` is then not called
    augments_qk: bool = False
    #: ``attn_bias`` depends on the positions only and returns a batch dimension of 1, shared by every sample
    #: (ALiBi, LookHere, KERPLE...); attention then sizes its query chunks for one sample's bias instead of the
    #: batch's (False: the bias may hold one (heads, rows, N) block per sample, as a content-dependent bias does)
    batch_shared_bias: bool = False

    @abstractmethod
    def prepare(self, grid_size: tuple[int, ...], num_prefix_tokens: int, device=None) -> Any:
        """Per-forward state for a grid (e.g. per-offset bucket ids or coordinates)."""

    @abstractmethod
    def attn_bias(
        self, q: torch.Tensor, k: torch.Tensor, state: Any, layer: int, rows: slice | None = None
    ) -> torch.Tensor:
        """Additive logits, broadcastable to (B, num_heads, R, N_total).

        ``q`` (B, num_heads, R, head_dim) holds the query ``rows`` (all N_total rows for None, R = N_total); ``k``
        is always every key. Schemes with ``needs_tokens`` also get ``tokens=`` (B, N_total, C), every token (the
        scheme cuts the query ``rows`` from it).
        """

    def bind_tokens(self, state: Any, layer: int, tokens: torch.Tensor) -> Any:
        """For schemes with ``needs_tokens``: the state to pass to block ``layer``'s ``attn_bias`` calls with these
        ``tokens``. Attention at large sizes asks for the bias in chunks of query rows, each with the block's
        same tokens; a scheme may compute here, once, what every chunk reads of them (Cable's summed steps). The
        returned state must give the same bias as ``state`` for these tokens and this layer, and ``state`` itself
        for any other (default: ``state`` unchanged)."""
        return state

    def augment_qk(
        self, q: torch.Tensor, k: torch.Tensor, state: Any, layer: int, tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For schemes with ``augments_qk``: q and k (B, num_heads, P + N, head_dim) with channels appended, q~ and k~
        (B, num_heads, P + N, head_dim + E), such that q~_i . k~_j = q_i . k_j + sqrt(head_dim) * bias_ij (attention
        keeps the scale 1 / sqrt(head_dim) of the original heads). ``tokens``: see ``needs_tokens``."""
        raise RuntimeError(f"{type(self).__name__} sets augments_qk=False and appends no channels to q and k")

    def value_term(self, attn: torch.Tensor, state: Any, layer: int, rows: slice | None = None) -> torch.Tensor:
        """Extra attention output (B, num_heads, R, head_dim) from the probabilities ``attn`` (B, num_heads, R, N)
        of the query ``rows`` (all rows for None)."""
        raise RuntimeError(f"{type(self).__name__} sets needs_probs=False and has no value term")

    def fused_bias(self, q: torch.Tensor, k: torch.Tensor, state: Any, layer: int) -> list | None:
        """The bias of block ``layer`` as per-offset terms (:class:`~visionpe.bias.offsets.OffsetBias`) that fused
        attention reads pair by pair (FlexAttention's ``score_mod``, :func:`~visionpe.attention.set_attention_backend`),
        with the values ``attn_bias`` gives for all rows; or None where the bias is not a function of the grid offset
        (the default: such schemes keep the dense path). ``q`` and ``k`` as in ``attn_bias`` with every row."""
        return None


def set_coord_augment(module: nn.Module, coord_augment: CoordAugment | Mapping[str, Any] | None) -> list[str]:
    """Set (or with None, clear) the training-time coordinate augmentation of every scheme of ``module`` that reads
    coordinates; returns the names of the schemes set (``""`` for ``module`` itself).

    ``module`` is a model or one scheme. Schemes that read integer offsets or tables instead of coordinates
    (``learned``, ``cpe``, ``irpe``, ``none``) are left as they are in a model with other schemes (rope-vit's
    ``["learned", "rope_mixed"]`` augments the rotary part); a ValueError is raised when the scheme given, or every
    scheme of the model, reads no coordinates.

    Example:
        >>> import timm, visionpe
        >>> m = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=["learned", "rope_axial"], depth=1)
        >>> set_coord_augment(m, CoordAugment("randomized", max_grid_size=28))
        ['pos_schemes.rope_axial']
    """
    check_instance(module, "module", nn.Module, expected="a torch.nn.Module (a model or a scheme)")
    coord_augment = CoordAugment.from_value(coord_augment)
    schemes = [(n, m) for n, m in module.named_modules() if isinstance(m, PositionEncoding)]
    if not schemes:
        raise ValueError(f"module must hold a visionpe position scheme, got a {type(module).__name__} with none")
    if isinstance(module, PositionEncoding):
        module.coord_augment = coord_augment  # raises for a scheme that reads no coordinates
        return [""]
    targets = [(n, m) for n, m in schemes if m.consumes_coords]
    if not targets:
        names = [getattr(m, "scheme_name", type(m).__name__) for _, m in schemes]
        raise ValueError(
            f"coord_augment applies to schemes that read coordinates, but this model's schemes {names} read integer "
            f"offsets or tables; got coord_augment={coord_augment!r}"
        )
    for _, scheme in targets:
        scheme.coord_augment = coord_augment
    return [n for n, _ in targets]


# -- mixed-resolution batches ---------------------------------------------------------------------------------------
