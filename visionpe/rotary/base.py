"""Base class for rotary schemes whose angle is linear in position: phi_j(p) = sum_a p_a * F[a, j].

Extrapolation-time scaling (PI, NTK-aware, YaRN) acts on F per axis, see :mod:`.scaling`.

Memory: cos/sin tables are (heads, N, head_dim) per layer, 6 MB each for ViT-S at 1024 px (N = 4097); all
layers at once would be 300 MB. Schemes with one frequency set for every layer (RoPE-Axial) build their single
table once per forward; schemes with per-layer frequencies (RoPE-Mixed, STRING) keep the coordinates and
frequencies in the state and build each layer's table when that layer applies it, so only one layer's table
(plus those autograd keeps for backward) exists at a time.

Rotary value embeddings (``rotate_values=True``, García-Castellanos, Weiler, Bekkers, "RoVE: Rotary Value
Embeddings Attention for Relative Position-dependent Value Pathways", arXiv 2606.11275): the values are rotated by
the keys' tables and attention's output back by the queries', o_i = R(p_i)^T sum_j a_ij R(p_j) v_j
= sum_j a_ij R(p_j - p_i) v_j. Those tables are unit rotations: YaRN's multiplier scales q and k only.
"""

from __future__ import annotations

import inspect
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

import torch

from ..base import RotaryPositionEncoding, check_layer, check_model_shape
from ..checks import check_bool, is_int
from ..grid import COORD_MODES, validate_grid_size
from ..interfaces.rotary import IdentityRotation, LayerRotation, RotaryState
from .functional import apply_rotary, rotary_angles, rotary_tables, rotate_qkv_pairs_
from .scaling import Extrapolation

__all__ = ["LinearRotary", "RotaryOptions", "LayerAngles", "TableState", "TableRotation"]


class TableRotation(LayerRotation):
    """One block's rotation by interleaved cos/sin tables (:func:`~visionpe.rotary.functional.rotary_tables`):
    (num_heads | 1, T, head_dim) shared by the images, or (B, num_heads | 1, T, head_dim), one per image."""

    def __init__(
        self, cos: torch.Tensor, sin: torch.Tensor, value_tables: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        self.cos, self.sin = cos, sin
        self.num_tokens = cos.shape[-2]
        # rotary value embeddings: unit cos/sin of the same angles (without YaRN's multiplier); None: v unrotated
        self.value_tables = value_tables

    def rotate(self, qk: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos, self.sin
        if qk.ndim < 2 or qk.shape[-2] != cos.shape[-2] or qk.shape[-1] != cos.shape[-1]:
            raise ValueError(
                f"qk must have shape (..., P + N = {cos.shape[-2]}, head_dim = {cos.shape[-1]}) to match the "
                f"prepared state (cos/sin {tuple(cos.shape)}), got {tuple(qk.shape)}"
            )
        return apply_rotary(qk, cos, sin)

    def fused_tables(self, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.cos, self.sin) if keep is None else self.kept_tables(keep)

    def kept_tables(self, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (B, num_heads | 1, K, head_dim) at the tokens ``keep`` (B, K) of each sample (int64 indices into
        the T tokens of the tables)."""
        return _kept_rows(self.cos, self.sin, keep)

    def rotate_values(self, v: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """R(p_j) v_j by the unit tables when the scheme rotates values (``keep``: the kept rows), else ``v``."""
        if self.value_tables is None:
            return v
        cos, sin = self._value_tables(v, keep)
        return apply_rotary(v, cos, sin)

    def unrotate_output(self, o: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """R(p_i)^T o_i (the inverse rotation: the sin table negated) when the scheme rotates values, else ``o``."""
        if self.value_tables is None:
            return o
        cos, sin = self._value_tables(o, keep)
        return apply_rotary(o, cos, -sin)

    def _value_tables(self, x: torch.Tensor, keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The unit tables of the T tokens, or of the kept ones, checked against ``x`` (B, num_heads, T | K, d)."""
        cos, sin = self.value_tables if keep is None else _kept_rows(*self.value_tables, keep)
        if x.ndim != 4 or x.shape[-2:] != cos.shape[-2:]:
            raise ValueError(
                f"the values / attention output must have shape (B, num_heads, {cos.shape[-2]}, {cos.shape[-1]}) "
                f"to match the prepared state, got {tuple(x.shape)}"
            )
        return cos, sin

    def rotate_kept(self, qk: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """The kept rows of the tables, gathered per sample (:meth:`kept_tables`), rotate the kept tokens directly."""
        cos, sin = self.kept_tables(keep)
        if qk.ndim < 4 or (qk.shape[-4], qk.shape[-2], qk.shape[-1]) != (cos.shape[0], *cos.shape[-2:]):
            raise ValueError(
                f"qk must have shape (..., B={cos.shape[0]}, num_heads, K={cos.shape[-2]}, "
                f"head_dim={cos.shape[-1]}) for keep {tuple(keep.shape)}, got {tuple(qk.shape)}"
            )
        return apply_rotary(qk, cos, sin)

    def rotate_qkv(
        self, qkv: torch.Tensor, batch: int, num_heads: int, keep: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 in eager mode: q and k rotated in place in the projection output
        (:func:`~visionpe.rotary.functional.rotate_qkv_pairs_`; the kept rows of the tables under patch dropout),
        then cut from it; otherwise the default (the real form: low precision, ONNX export, compiled graphs)."""
        if (
            qkv.dtype != torch.float32
            or torch.compiler.is_compiling()
            or torch.jit.is_tracing()
            or torch.onnx.is_in_onnx_export()
        ):
            return super().rotate_qkv(qkv, batch, num_heads, keep)
        cos, sin = (self.cos, self.sin) if keep is None else self.kept_tables(keep)
        return IdentityRotation().rotate_qkv(rotate_qkv_pairs_(qkv, cos, sin, num_heads), batch, num_heads)


def _kept_rows(cos: torch.Tensor, sin: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (B, num_heads | 1, K, head_dim) at the tokens ``keep`` (B, K) of each sample, from tables
    (num_heads | 1, T, head_dim) or per-sample (B, num_heads | 1, T, head_dim)."""
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


class TableState(RotaryState):
    """State of a scheme whose tables serve every block (RoPE-Axial): cos/sin (1, num_heads | 1, T, head_dim) built
    once per forward."""

    def __init__(
        self,
        cos: torch.Tensor,
        sin: torch.Tensor,
        depth: int | None,
        scheme: str,
        value_tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.cos, self.sin, self.depth, self.scheme = cos, sin, depth, scheme
        self.value_tables = value_tables  # unit tables of rotary value embeddings, or None

    def layer(self, index: int) -> TableRotation:
        check_layer(index, self.depth, self.scheme)
        row = index if self.cos.shape[0] > 1 else 0
        values = None if self.value_tables is None else tuple(table[row] for table in self.value_tables)
        return TableRotation(self.cos[row], self.sin[row], values)


@dataclass(frozen=True)
class LayerAngles(RotaryState):
    """State of a scheme with per-layer frequencies: each block's cos/sin are built when it asks for them.

    ``coords`` (N, ndim) patch coordinates (or (B, 1, N, ndim) per sample: STRING's RGB-D depth), ``freqs``
    (depth | 1, num_heads | 1, ndim, head_dim // 2) frequencies after extrapolation scaling, ``mscale`` the YaRN
    multiplier of the tables, ``rotate_values`` whether the blocks also rotate v and o (unit tables).
    """

    coords: torch.Tensor
    freqs: torch.Tensor
    num_prefix_tokens: int
    mscale: float
    depth: int | None = None
    scheme: str = "LinearRotary"
    rotate_values: bool = False

    def layer(self, index: int) -> TableRotation:
        check_layer(index, self.depth, self.scheme)
        freqs = self.freqs[index if self.freqs.shape[0] > 1 else 0]
        if not self.rotate_values:
            return TableRotation(*_tables(self.coords, freqs, self.num_prefix_tokens, self.mscale))
        cos, sin, values = _value_tables(self.coords, freqs, self.num_prefix_tokens, self.mscale)
        return TableRotation(cos, sin, values)


@dataclass(frozen=True)
class RotaryOptions:
    """The options every :class:`LinearRotary` scheme shares, declared once: a scheme's constructor takes them as
    keywords (``create_pos_embed("rope_axial", ..., extrapolation="yarn")``) on top of its own options.

    Fields, in the order :class:`LinearRotary` takes them positionally:
        coord_mode: grid convention, one of :data:`~visionpe.grid.COORD_MODES` (``index``: integer patch positions).
        grid_size: training grid (the model passes it); the reference of ``extrapolation`` and of ``ref_scaled``.
        extrapolation: ``none`` (default), ``pi``, ``ntk`` or ``yarn`` scaling at a larger grid
            (:mod:`visionpe.rotary.scaling`; each scheme lists its modes in ``supported_extrapolation``).
        yarn_alpha, yarn_beta: YaRN ramp bounds.
        rotate_values: rotary value embeddings (RoVE): rotate v by the keys' positions and attention's output back
            by the queries' (see the module docstring); False by default. Keyword only.

    The values are checked where a scheme is built (:class:`LinearRotary`): ``grid_size`` against the scheme's
    ``ndim``, ``extrapolation`` against the modes it implements.

    Example:
        >>> RotaryOptions(extrapolation="yarn").replace(grid_size=(14, 14)).grid_size
        (14, 14)
    """

    coord_mode: str = "index"
    grid_size: Sequence[int] | int | None = None
    extrapolation: str = "none"
    yarn_alpha: float = 1.0
    yarn_beta: float = 32.0
    rotate_values: bool = field(default=False, kw_only=True)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names, in field order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def of(cls, options: RotaryOptions | None) -> RotaryOptions:
        """``options`` itself, or the defaults for None; TypeError naming ``options`` for anything else."""
        if options is None:
            return cls()
        if not isinstance(options, cls):
            raise TypeError(f"options must be a RotaryOptions or None, got {type(options).__name__}")
        return options

    def replace(self, **changes: Any) -> RotaryOptions:
        """A copy with ``changes`` (option names) set; TypeError naming an unknown option."""
        unknown = [k for k in changes if k not in self.names()]
        if unknown:
            raise TypeError(f"RotaryOptions got unknown option(s) {unknown}; valid options: {list(self.names())}")
        return replace(self, **changes)


def _with_shared_options(init: Any, names: tuple[str, ...]) -> inspect.Signature:
    """``init``'s signature with its ``**options`` replaced by the shared options ``names`` as keywords, with the
    defaults of :class:`RotaryOptions`: what :func:`inspect.signature`, the registry and the docs read."""
    params = list(inspect.signature(init).parameters.values())
    defaults = {f.name: f.default for f in fields(RotaryOptions)}
    annotations = {f.name: f.type for f in fields(RotaryOptions)}
    shared = [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=defaults[n], annotation=annotations[n])
        for n in names
    ]
    own = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    split = next((i for i, p in enumerate(own) if p.kind is inspect.Parameter.KEYWORD_ONLY), len(own))
    return inspect.signature(init).replace(parameters=[*own[:split], *shared, *own[split:]])


class LinearRotary(RotaryPositionEncoding, Extrapolation):
    """Subclasses implement :meth:`frequencies`, returning (depth | 1, num_heads | 1, ndim, head_dim // 2).

    ``prepare`` returns a :class:`TableState` (the (1, num_heads | 1, P + N, head_dim) cos/sin tables) when one
    frequency set serves every layer, else a :class:`LayerAngles` from which each block builds its own tables
    (see the module docstring for why); either gives a :class:`TableRotation` per block.
    With ``extrapolation`` set, ``prepare`` rescales the frequencies for the current ``grid_size`` relative to
    the training grid (``grid_size`` at construction); the default ``"none"`` leaves them untouched.
    ``coord_mode`` is one of :data:`~visionpe.grid.COORD_MODES`; ``ref_scaled`` (i * n_train / n, position
    interpolation) is relative to the training grid, so it needs ``grid_size``.
    ``rotate_values=True`` (rotary value embeddings, see the module docstring) also rotates the values by the keys'
    positions and attention's output back by the queries', with unit tables of the same angles.

    These shared options are one :class:`RotaryOptions`. A subclass declares only its own arguments and takes the
    shared ones as ``**options``, turned into a :class:`RotaryOptions` by :meth:`rotary_options`; its constructor
    then presents them by name (:func:`inspect.signature`, :meth:`option_names`, read by the registry and the
    models), as keywords after its own. ``shared_options`` lists those it takes.
    """

    grid_ranks = (2, 3)
    # cos/sin tables: one compiled kernel rotates q and k (set_rotary_backend)
    rotary_backends = ("eager", "fused")
    per_token_tables = True

    #: the fields of :class:`RotaryOptions` a subclass's constructor takes as keywords (its ``**options``); a
    #: subclass that fixes some of them (``rope_dinov3``: coordinates and extrapolation) names fewer
    shared_options: ClassVar[tuple[str, ...]] = RotaryOptions.names()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A constructor that takes the shared options as ``**options`` is given the signature that names them
        (its own arguments, then ``shared_options`` as keywords), so that the registry, the models and
        :func:`inspect.signature` see every option the scheme takes."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None and "options" in inspect.signature(init).parameters:
            kind = inspect.signature(init).parameters["options"].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                init.__signature__ = _with_shared_options(init, cls.shared_options)

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The keyword options of the scheme: its constructor's arguments but the model's ``dim``, ``num_heads`` and
        ``depth`` (its own options, then the shared ones it takes)."""
        params = inspect.signature(cls.__init__).parameters
        return tuple(n for n in params if n not in ("self", "dim", "num_heads", "depth"))

    @classmethod
    def rotary_options(cls, options: dict[str, Any], **fixed: Any) -> RotaryOptions:
        """The :class:`RotaryOptions` of a constructor's ``**options`` (and of the values ``fixed`` by the scheme);
        TypeError naming an option the scheme does not take, as Python's own for an unexpected keyword."""
        if not isinstance(options, dict):
            raise TypeError(f"options must be a dict of keyword options, got {type(options).__name__}")
        for name in options:
            if name not in cls.shared_options:
                raise TypeError(f"{cls.__name__}.__init__() got an unexpected keyword argument {name!r}")
        return RotaryOptions(**fixed, **options)

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int,
        ndim: int,
        *args: Any,
        options: RotaryOptions | None = None,
        **kwargs: Any,
    ) -> None:
        """``options``: the shared options (:class:`RotaryOptions`); or, for subclasses written without it, its fields
        as arguments, positionally in field order (``coord_mode, grid_size, extrapolation, yarn_alpha, yarn_beta``)
        or by name."""
        if args or kwargs:
            if options is not None:
                raise TypeError(
                    "give the shared options either as options=RotaryOptions(...) or as separate arguments, not "
                    f"both; got options and {[*map(repr, args), *kwargs]}"
                )
            options = RotaryOptions(*args, **kwargs)
        options = RotaryOptions.of(options)
        coord_mode, grid_size, rotate_values = options.coord_mode, options.grid_size, options.rotate_values
        extrapolation, yarn_alpha, yarn_beta = options.extrapolation, options.yarn_alpha, options.yarn_beta
        super().__init__()
        head_dim = check_model_shape(dim, num_heads, depth)
        self.rotate_values = check_bool(rotate_values, "rotate_values")
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
        if is_int(grid_size):  # the same size on every axis, as timm takes img_size=224
            grid_size = (grid_size,) * ndim
        if isinstance(grid_size, (tuple, list)) and len(grid_size) != ndim:
            raise ValueError(f"grid_size must have ndim={ndim} entries, got {tuple(grid_size)}")
        if grid_size is not None:
            grid_size = validate_grid_size(grid_size, "grid_size", ndims=(ndim,))
        self.init_extrapolation(extrapolation, grid_size, yarn_alpha, yarn_beta)

    @property
    def ndims(self) -> tuple[int, ...]:  # the instance supports exactly the rank it was built for
        return (self.ndim,)

    @abstractmethod
    def frequencies(self) -> torch.Tensor:
        """(depth | 1, num_heads | 1, ndim, head_dim // 2) frequencies, rows in coordinate order."""

    def scaled_frequencies(self, grid_size: Sequence[int] | None = None) -> tuple[torch.Tensor, float]:
        """Frequencies for ``grid_size`` under the extrapolation mode (and the band multiplier, when set), and the
        cos/sin multiplier (YaRN): :meth:`~visionpe.rotary.scaling.Extrapolation.adjust_frequencies`."""
        return self.adjust_frequencies(self.frequencies(), grid_size)

    def prepare(
        self, coords: torch.Tensor, num_prefix_tokens: int = 0, grid_size: tuple[int, ...] | None = None
    ) -> TableState | LayerAngles:
        freqs, mscale = self.scaled_frequencies(grid_size)
        name = type(self).__name__
        values = self.rotate_values
        if coords.ndim == 3:  # per-sample positions (B, N, ndim): (B, num_heads | 1, P + N, head_dim) per layer
            return LayerAngles(coords.unsqueeze(1), freqs, num_prefix_tokens, mscale, self.depth, name, values)
        if freqs.shape[0] > 1:
            return LayerAngles(coords, freqs, num_prefix_tokens, mscale, self.depth, name, values)
        if not values:
            return TableState(*_tables(coords, freqs, num_prefix_tokens, mscale), self.depth, name)
        cos, sin, value_tables = _value_tables(coords, freqs, num_prefix_tokens, mscale)
        return TableState(cos, sin, self.depth, name, value_tables)

    def layer_tables(self, state: TableState | LayerAngles, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (num_heads | 1, P + N, head_dim) of block ``layer`` from a ``prepare`` state
        ((B, num_heads | 1, P + N, head_dim) for per-sample positions)."""
        rotation = state.layer(layer)
        return rotation.cos, rotation.sin


def _tables(
    coords: torch.Tensor, freqs: torch.Tensor, num_prefix_tokens: int, mscale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (..., P + N, head_dim) for frequencies (..., ndim, head_dim // 2)."""
    cos, sin = rotary_tables(rotary_angles(coords, freqs), num_prefix_tokens)
    if mscale != 1.0:
        # YaRN's temperature: every row (prefix included) so all logits scale alike
        cos, sin = cos * mscale, sin * mscale
    return cos, sin


def _value_tables(
    coords: torch.Tensor, freqs: torch.Tensor, num_prefix_tokens: int, mscale: float
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """cos/sin tables of q and k (YaRN's ``mscale`` included) and the unit tables of the values and the output:
    the same tensors when ``mscale`` is 1."""
    cos, sin = _tables(coords, freqs, num_prefix_tokens, 1.0)
    if mscale == 1.0:
        return cos, sin, (cos, sin)
    return cos * mscale, sin * mscale, (cos, sin)
