"""The vision tower's own 2D RoPE in Qwen2-VL, Qwen2.5-VL and Qwen3-VL, swapped or scaled with visionpe's schemes.

The vision encoders of these models (Wang et al., "Qwen2-VL: Enhancing Vision-Language Model's Perception of the World
at Any Resolution", arXiv 2409.12191, 2024; Bai et al., "Qwen2.5-VL Technical Report", arXiv 2502.13923, 2025;
Bai et al., "Qwen3-VL Technical Report", arXiv 2511.21631, 2025) rotate q and k of every patch by an axial 2D RoPE.
With d the head dim, base the vision ``rope_theta`` (10000) and theta_n = base^(-4n / d) for n < d / 4, rotary pair j
turns by h * theta_j for j < d / 4 and by w * theta_{j - d/4} for d / 4 <= j < d / 2, where (h, w) is the patch's
row and column in its image; the frames of a video share them. Pair j is the channels (j, j + d / 2) (the
``rotate_half`` layout). In visionpe's terms that is ``rope_axial`` with ``base=rope_theta`` and ``axis_order="yx"``
(the first half of the pairs read the row) on integer ``index`` coordinates: :func:`own_vision_rope_options`.

:func:`apply_vision_rope` replaces that rotary by any visionpe rotary scheme whose angle is linear in position
(:class:`~visionpe.rotary.base.LinearRotary` without a basis change: ``rope_axial``, ``rope_mixed``, ``rope_learned``,
``rope_dinov3``, ``gridpe``) and its extrapolation modes; :func:`remove_vision_rope` puts the tower's own back.
visionpe's pair j (its channels (2j, 2j + 1)) becomes the tower's pair j (channels (j, j + d / 2)): the
projections are learned, so the layout only names the channels, and a scheme reproducing the tower's angles
reproduces its outputs.

How it reaches the attention. The tower computes, per image and in Python, its patches' (h, w) in merge-window order
(each ``spatial_merge_size``^2 block of patches contiguous, blocks row-major, the frames of a video one after
another: transformers' ``get_vision_position_ids``) and calls ``rotary_pos_emb(hidden_states, position_ids)`` once;
Qwen2.5-VL then permutes the rows of what it returns into its window-attention order. The replacement
(:class:`VisionTowerRotary`) returns, instead of cos/sin, two per-token tensors that any row permutation carries
along: the patch coordinates in the scheme's coordinate mode and the (h, w) grid of the patch's image (from
``grid_thw``, which a hook on the tower records for the duration of its forward). A hook on each block's attention
turns them into that block's cos/sin (so per-layer frequencies such as RoPE-Mixed's work), and schemes with
per-head frequencies get (N, heads, d) tables, which each block's attention of the patched tower applies through a
``forward`` of its own: its class's, with ``apply_rotary_pos_emb_vision`` extended to per-head tables
(:func:`~visionpe.integrations.hf.adapter.patch_rotary_function`; transformers' module and every other model are
unchanged). Nothing loops over the images: coordinates and frequencies are built once per distinct image size and
gathered per token.

Extrapolation (``extrapolation="pi" | "ntk" | "yarn" | "riflex"`` with ``base_grid=(h0, w0)``, the training grid in
patches): each image is scaled against ``base_grid`` with its own factors s_a = max(1, n_a / n0_a) per axis (rows
and columns of that image, in patches before merging), as the scheme documents (:mod:`visionpe.rotary.scaling`):
PI divides every frequency of axis a by s_a (position p_a read as p_a / s_a), NTK-aware scaling divides the slowest
band by s_a and keeps the fastest, YaRN ramps between the two by wavelength and multiplies cos/sin by
0.1 ln max_a s_a + 1. An image no larger than ``base_grid`` keeps the plain frequencies.

Qwen3-VL also adds a learned absolute position embedding, a square table bilinearly resampled to each image's grid
(``align_corners=True``); it stays as it is: only the rotary is replaced.

The model classes are imported from transformers by name (``SUPPORTED_TOWERS``), so a transformers without one of
them still serves the others.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ...base import PositionEncoding, check_layer
from ...checks import check_bool, check_choice, describe
from ...grid import validate_grid_size
from ...registry import create_pos_embed, get_scheme_class, registered_schemes
from ...rotary.base import LinearRotary
from ...rotary.functional import rotary_angles
from ...rotary.rope_mixed import RopeMixed
from ...rotary.scaling import EXTRAPOLATION_MODES
from .adapter import check_rotary_patch, patch_rotary_function, unpatch_rotary_function
from .compat import check_transformers, require_interface

__all__ = [
    "SUPPORTED_TOWERS",
    "VisionTowerRotary",
    "apply_vision_rope",
    "own_vision_rope_options",
    "remove_vision_rope",
    "vision_tower",
]

# class name of the vision tower -> transformers module that defines it
SUPPORTED_TOWERS = {
    "Qwen2VisionTransformerPretrainedModel": "transformers.models.qwen2_vl.modeling_qwen2_vl",
    "Qwen2_5_VisionTransformerPretrainedModel": "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    "Qwen3VLVisionModel": "transformers.models.qwen3_vl.modeling_qwen3_vl",
}


def _tower_classes() -> tuple[type, ...]:
    classes = []
    for name, module_name in SUPPORTED_TOWERS.items():
        try:
            classes.append(getattr(importlib.import_module(module_name), name))
        except (ImportError, AttributeError):
            continue
    return tuple(classes)


def vision_tower(model: nn.Module) -> nn.Module:
    """The vision tower of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL model.

    Args:
        model: a ``*ForConditionalGeneration`` (its ``model.visual``), its inner ``*Model`` (``visual``) or the tower
            itself (one of ``SUPPORTED_TOWERS``).

    Raises:
        TypeError: naming ``model`` for anything else.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a Qwen-VL model (a torch.nn.Module), got {describe(model)}")
    classes = _tower_classes()
    inner = getattr(model, "model", None)
    for candidate in (model, getattr(model, "visual", None), getattr(inner, "visual", None)):
        if classes and isinstance(candidate, classes):
            return candidate
    raise TypeError(
        "model must be a Qwen2-VL, Qwen2.5-VL or Qwen3-VL model (its *ForConditionalGeneration or inner *Model) or "
        f"its vision tower ({', '.join(SUPPORTED_TOWERS)}), got {type(model).__name__}"
    )


def _tower_shape(tower: nn.Module) -> tuple[int, int, int, int]:
    """(width, heads, blocks, head_dim) of the tower's attention."""
    attn = tower.blocks[0].attn
    num_heads, head_dim = int(attn.num_heads), int(attn.head_dim)
    return num_heads * head_dim, num_heads, len(tower.blocks), head_dim


def _own_rotary(tower: nn.Module) -> nn.Module:
    """The tower's own rotary module, also when visionpe replaced it."""
    current = tower.rotary_pos_emb
    return current.original if isinstance(current, VisionTowerRotary) else current


def own_vision_rope_options(model: nn.Module) -> dict[str, Any]:
    """The ``rope_axial`` options that reproduce the tower's own rotary: ``{"base": rope_theta, "axis_order": "yx"}``.

    ``rope_axial``'s default split (d / 4 pairs per axis, frequencies base^(-4n / d)) is the tower's; ``"yx"`` gives
    the first half of the pairs to the row, as the tower does. :func:`apply_vision_rope` fills these in for
    ``scheme="rope_axial"`` unless given.

    Args:
        model: a model accepted by :func:`vision_tower`.

    Raises:
        ValueError: when the tower's rotary is not the plain axial one of its config (another ``rope_type``, an
            attention scaling, or frequencies that differ from ``rope_theta``'s).

    Example:
        >>> own_vision_rope_options(model)  # doctest: +SKIP
        {'base': 10000.0, 'axis_order': 'yx'}
    """
    tower = vision_tower(model)
    own = _own_rotary(tower)
    rope = dict(getattr(tower.config, "rope_parameters", None) or {})
    base = float(rope.get("rope_theta", 10000.0))
    _, _, _, head_dim = _tower_shape(tower)
    inv_freq = getattr(own, "inv_freq", None)
    expected = base ** (-4.0 * torch.arange(head_dim // 4, dtype=torch.float64) / head_dim)
    if (
        rope.get("rope_type", "axial") != "axial"
        or float(getattr(own, "attention_scaling", 1.0)) != 1.0
        or not isinstance(inv_freq, torch.Tensor)
        or inv_freq.shape != expected.shape
        or not torch.allclose(inv_freq.detach().cpu().double(), expected, rtol=1e-5, atol=0)
    ):
        raise ValueError(
            f"the vision tower's rotary ({type(own).__name__}) is not the axial RoPE of rope_theta={base} with "
            f"head_dim={head_dim} that rope_axial reproduces (rope_type {rope.get('rope_type')!r}, "
            f"attention_scaling {getattr(own, 'attention_scaling', None)!r})"
        )
    return {"base": base, "axis_order": "yx"}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


_APPLY = "apply_rotary_pos_emb_vision"  # the global with which the towers' attention applies (cos, sin)


@functools.cache
def _per_head_apply(module_name: str):
    """``apply_rotary_pos_emb_vision`` of the modeling module ``module_name`` extended to per-head
    (N, heads, head_dim) tables; other tables go to the module's function as it is when called."""
    modeling = importlib.import_module(module_name)

    def apply_rotary_pos_emb_vision(q, k, cos, sin):
        if cos.ndim != 3:  # the tower's own (N, head_dim) tables, and visionpe's shared by the heads
            return getattr(modeling, _APPLY)(q, k, cos, sin)
        # visionpe's per-head tables against q, k (N, heads, head_dim), in fp32 as the original
        cos, sin = cos.float(), sin.float()
        q_out = q.float() * cos + _rotate_half(q.float()) * sin
        k_out = k.float() * cos + _rotate_half(k.float()) * sin
        return q_out.to(q.dtype), k_out.to(k.dtype)

    return apply_rotary_pos_emb_vision


def _is_positions(value: Any) -> bool:
    """Whether ``value`` is :meth:`VisionTowerRotary.forward`'s output (coordinates, grids), not cos/sin tables."""
    return (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, torch.Tensor) for v in value)
        and value[1].ndim == 2
        and value[1].shape[-1] == 2
        and not value[1].is_floating_point()
    )


def _at_layer(freqs: torch.Tensor, layer: int) -> torch.Tensor:
    """(heads | 1, ndim, P) frequencies of block ``layer`` from (depth | 1, heads | 1, ndim, P)."""
    return freqs[layer if freqs.shape[0] > 1 else 0]


class VisionTowerRotary(nn.Module):
    """Drop-in for a Qwen-VL vision tower's ``rotary_pos_emb`` that rotates with a visionpe scheme.

    ``forward(hidden_states, position_ids)`` returns the tokens' positions (:meth:`positions`) instead of cos/sin;
    a hook on each block's attention turns them into that block's tables (:meth:`layer_tables`). The tower's own
    rotary module is kept as ``original`` (its buffers are non-persistent); the scheme is the submodule ``scheme``,
    so its parameters (RoPE-Mixed's frequencies) are the model's and train with it.

    Args:
        scheme: a 2D :class:`~visionpe.rotary.base.LinearRotary` built for the tower's width, heads and blocks.
        original: the tower's own rotary module.
    """

    def __init__(self, scheme: LinearRotary, original: nn.Module) -> None:
        super().__init__()
        self.scheme = scheme
        self.original = original
        self._grid_thw: torch.Tensor | None = None
        self._handles: list = []

    def positions(self, position_ids: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token coordinates and image grids, in the tower's token order.

        Args:
            position_ids: (N, 2) integer (h, w) of each patch in its image, as the tower computes them
                (merge-window order, frames one after another).
            grid_thw: (num_images, 3) (t, h, w) of each image or video, in patches; N = sum t * h * w.

        Returns:
            ``coords`` (N, 2) fp32, the scheme's coordinates (:meth:`~visionpe.base.RotaryPositionEncoding.model_coords`
            of the image's grid, e.g. (h, w) themselves in ``index`` mode) at each token's (h, w); and ``grids``
            (N, 2) int64, the (h, w) grid of each token's image. Coordinates are built once per distinct image size
            (in training, a coordinate augmentation draws once per distinct size and forward).
        """
        if not isinstance(position_ids, torch.Tensor) or position_ids.ndim != 2 or position_ids.shape[-1] != 2:
            raise ValueError(f"position_ids must be an (N, 2) tensor of (h, w) positions, got {describe(position_ids)}")
        if position_ids.is_floating_point():
            raise ValueError(f"position_ids must hold integer positions, got dtype {position_ids.dtype}")
        if (
            not isinstance(grid_thw, torch.Tensor)
            or grid_thw.ndim != 2
            or grid_thw.shape[-1] != 3
            or grid_thw.is_floating_point()
        ):
            raise ValueError(
                f"grid_thw must be a (num_images, 3) integer tensor of (t, h, w), got {describe(grid_thw)}"
            )
        device = position_ids.device
        grid_thw = grid_thw.to(device=device, dtype=torch.int64)
        counts = grid_thw.prod(-1)
        if int(counts.sum()) != position_ids.shape[0]:
            raise ValueError(
                f"grid_thw covers {int(counts.sum())} patches (sum of t * h * w), but position_ids has "
                f"{position_ids.shape[0]} rows"
            )
        sizes, image_group = torch.unique(grid_thw[:, 1:], dim=0, return_inverse=True)
        group = image_group.repeat_interleave(counts)  # (N,) distinct-size index of each token
        grids = sizes[group]
        ids = position_ids.long()
        if bool(((ids < 0) | (ids >= grids)).any()):
            raise ValueError("position_ids must lie inside each token's image grid (0 <= h < H, 0 <= w < W)")
        size_list = [tuple(s) for s in sizes.tolist()]
        tables = [self.scheme.model_coords(size, device) for size in size_list]
        starts = torch.tensor([0] + [h * w for h, w in size_list[:-1]], device=device).cumsum(0)
        rows = starts[group] + ids[:, 0] * grids[:, 1] + ids[:, 1]
        coords = torch.cat(tables).to(device=device, dtype=torch.float32)[rows]
        return coords, grids

    def layer_tables(self, coords: torch.Tensor, grids: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of block ``layer`` in the tower's layout, fp32.

        Args:
            coords, grids: :meth:`positions` (in any token order).
            layer: the block.

        Returns:
            (N, head_dim) tables when the scheme's frequencies are shared by the heads, else (N, heads, head_dim);
            pair j is channels (j, j + head_dim / 2). With an extrapolation mode, each token's frequencies are
            the scheme's scaled for its image's grid (:meth:`~visionpe.rotary.base.LinearRotary.scaled_frequencies`,
            once per distinct grid), and YaRN's multiplier scales its rows.
        """
        scheme = self.scheme
        check_layer(layer, scheme.depth, type(scheme).__name__)
        scale: float | torch.Tensor
        with torch.autocast(coords.device.type, enabled=False):
            if scheme.extrapolation == "none":  # one set of frequencies for every image
                freqs, scale = scheme.scaled_frequencies(None)
                freqs = _at_layer(freqs, layer)[None]  # (1, heads | 1, 2, P)
            else:
                sizes, group = torch.unique(grids, dim=0, return_inverse=True)
                scaled = [scheme.scaled_frequencies(tuple(size)) for size in sizes.tolist()]
                freqs = torch.stack([_at_layer(f, layer) for f, _ in scaled])  # (U, heads | 1, 2, P)
                scale = scaled[0][1]
                if len(scaled) > 1:  # per token: its image's frequencies and multiplier
                    freqs = freqs[group.to(freqs.device)]
                    multipliers = torch.tensor([m for _, m in scaled], device=coords.device)
                    scale = multipliers[group][:, None, None]
            angles = rotary_angles(coords[:, None, None, :], freqs.to(coords.device)).squeeze(-2)  # (N, heads|1, P)
            cos, sin = angles.cos(), angles.sin()
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
            if isinstance(scale, torch.Tensor) or scale != 1.0:
                cos, sin = cos * scale, sin * scale
        if cos.shape[1] == 1:
            cos, sin = cos[:, 0], sin[:, 0]
        return cos, sin

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`positions` of the tower's forward (its ``grid_thw``, recorded by the tower hook)."""
        if self._grid_thw is None:
            raise ValueError(
                "VisionTowerRotary runs inside its vision tower's forward, which passes grid_thw; to build tables "
                "outside it, call positions(position_ids, grid_thw) and layer_tables(...)"
            )
        return self.positions(position_ids.to(hidden_states.device), self._grid_thw)

    # hooks -------------------------------------------------------------------------------------------------------

    def _before_tower(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._grid_thw = kwargs["grid_thw"] if "grid_thw" in kwargs else (args[1] if len(args) > 1 else None)

    def _after_tower(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._grid_thw = None

    def _before_attention(self, layer: int, module: nn.Module, args: tuple, kwargs: dict):
        positions = kwargs.get("position_embeddings")
        if not _is_positions(positions):  # tables given by the caller: left as they are
            return None
        return args, {**kwargs, "position_embeddings": self.layer_tables(*positions, layer)}

    def attach(self, tower: nn.Module) -> None:
        """Register the hooks on ``tower`` (its forward, to record ``grid_thw``; each block's attention)."""
        self._handles = [
            tower.register_forward_pre_hook(self._before_tower, with_kwargs=True),
            tower.register_forward_hook(self._after_tower, with_kwargs=True, always_call=True),
        ]
        for layer, block in enumerate(tower.blocks):
            hook = functools.partial(self._before_attention, layer)
            self._handles.append(block.attn.register_forward_pre_hook(hook, with_kwargs=True))

    def detach(self) -> None:
        """Remove the hooks :meth:`attach` registered."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._grid_thw = None


def _check_interface(tower: nn.Module) -> None:
    """The installed transformers' release and the tower interface the replacement relies on: the tower computes
    its patches' (h, w) with ``transformers.vision_utils.get_vision_position_ids`` and hands them to
    ``rotary_pos_emb(hidden_states, position_ids)``; each block's attention takes ``position_embeddings``.
    (The older ``rot_pos_emb(grid_thw)`` called the rotary with a length and indexed its table itself.)"""
    feature = "visionpe's vision-tower RoPE (apply_vision_rope)"
    check_transformers(feature)
    require_interface(feature, importlib.import_module(type(tower).__module__), "get_vision_position_ids")
    require_interface(feature, type(_own_rotary(tower)), "forward", ("position_ids",))
    require_interface(feature, type(tower.blocks[0].attn), "forward", ("position_embeddings",))


def _check_scheme_class(cls: type, given: Any) -> None:
    """TypeError naming ``scheme`` unless ``cls`` is a pairwise rotary (a LinearRotary without a basis change)."""
    kind = getattr(cls, "kind", None)
    name = getattr(cls, "scheme_name", cls.__name__)
    if kind != "rotary":
        what = {"absolute": "adds an embedding to the tokens", "bias": "adds a bias to the attention logits"}
        raise TypeError(
            f"scheme must be a rotary scheme (it replaces the tower's RoPE, a rotation of q and k), got {given!r}, "
            f"a {kind or 'non-visionpe'} scheme that {what.get(kind, 'is no rotary')}"
        )
    if not cls.per_token_tables:
        tables = sorted(n for n in registered_schemes() if get_scheme_class(n).per_token_tables)
        raise TypeError(
            f"scheme must rotate pairs of channels by angles linear in position ({', '.join(tables)}), which the "
            f"tower's attention applies as cos/sin tables; got {name!r} ({cls.__name__}), whose rotation is not such "
            "a table"
        )


# vision schemes that take their defaults from the tower's own rotary: name -> (the options it gives, its function)
_TOWER_DEFAULTS = {"rope_axial": (("base", "axis_order"), own_vision_rope_options)}


def _build_scheme(
    scheme: str | nn.Module,
    tower: nn.Module,
    mode: str | None,
    base_grid: tuple[int, int] | None,
    options: dict[str, Any],
) -> LinearRotary:
    dim, num_heads, depth, head_dim = _tower_shape(tower)
    if isinstance(scheme, str):
        cls = get_scheme_class(scheme)  # ValueError naming the valid schemes
        _check_scheme_class(cls, scheme)
        if options.get("ndim", 2) != 2:
            raise ValueError(
                f"ndim must be 2: the tower's RoPE is 2D within each frame (a video's frames share their (h, w)), "
                f"got ndim={options['ndim']!r}"
            )
        for name, value in (("extrapolation", mode), ("grid_size", base_grid)):
            if name in options and value is not None:
                raise ValueError(f"{name} is set by apply_vision_rope's own argument; got it in the options as well")
        opts = dict(options)
        own = _TOWER_DEFAULTS.get(scheme)  # the tower's own options unless told (its RoPE is axial)
        if own is not None and not set(own[0]) <= opts.keys():
            for key, value in own[1](tower).items():
                opts.setdefault(key, value)
        if mode is not None:
            opts["extrapolation"] = mode
        if base_grid is not None:
            opts["grid_size"] = base_grid
        built = create_pos_embed(scheme, dim=dim, num_heads=num_heads, depth=depth, **opts)
    elif isinstance(scheme, PositionEncoding):
        if options:
            raise ValueError(
                f"options apply to a scheme built by name; a built scheme ({type(scheme).__name__}) takes none, got "
                f"{sorted(options)}"
            )
        _check_scheme_class(type(scheme), type(scheme).__name__)
        if scheme.head_dim != head_dim or scheme.num_heads != num_heads or scheme.depth != depth:
            raise ValueError(
                f"scheme must be built for the tower's shape (dim={dim}, num_heads={num_heads}, depth={depth}), got "
                f"dim={scheme.dim}, num_heads={scheme.num_heads}, depth={scheme.depth}"
            )
        _check_built(scheme)
        if mode is not None or base_grid is not None:
            scheme.set_extrapolation(scheme.extrapolation if mode is None else mode, train_grid_size=base_grid)
        return scheme
    else:
        raise TypeError(f"scheme must be a rotary scheme name or a visionpe rotary module, got {describe(scheme)}")
    _check_built(built)
    return built


def _check_built(built: LinearRotary) -> None:
    """ValueError for what the tower cannot apply: a 3D scheme, value rotation, per-sample extra inputs."""
    if built.ndim != 2:
        raise ValueError(
            f"the scheme must be 2D (ndim=2): the tower's RoPE is 2D within each frame, got ndim={built.ndim}"
        )
    if built.rotate_values:
        raise ValueError(
            "rotate_values=True rotates the values and the attention output too, which the tower's attention does "
            "not do; got rotate_values=True"
        )
    if built.extra_inputs:
        raise ValueError(
            f"the scheme needs per-sample inputs {built.extra_inputs} that the vision tower does not provide"
        )


def apply_vision_rope(
    model: nn.Module,
    scheme: str | nn.Module = "rope_axial",
    extrapolation: str | None = None,
    *,
    base_grid: Sequence[int] | None = None,
    init_from_tower: bool = False,
    **options: Any,
) -> nn.Module:
    """Rotate the vision tower of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL model with a visionpe rotary scheme, in place.

    Args:
        model: a ``*ForConditionalGeneration``, its inner ``*Model`` or the vision tower itself.
        scheme: a rotary scheme's name, built for the tower (width, heads, blocks) with ``options``, or a built
            2D :class:`~visionpe.rotary.base.LinearRotary` of that shape (e.g. one trained before). For
            ``"rope_axial"`` (the default) ``base`` and ``axis_order`` default to the tower's own
            (:func:`own_vision_rope_options`), so ``apply_vision_rope(model)`` reproduces the model.
        extrapolation: ``None`` (the scheme's default, no scaling), ``"pi"``, ``"ntk"``, ``"yarn"`` or ``"riflex"``
            (axial schemes): each image is scaled against ``base_grid`` with its own factors (module docstring).
        base_grid: the training grid (h0, w0) in patches (before merging), the reference of ``extrapolation``
            (the scheme's ``grid_size``); needed with an extrapolation mode.
        init_from_tower: ``rope_mixed`` only: start every block's and head's frequencies at the tower's own axial
            ones (component x on the pairs that read w, y on those that read h), so the model is unchanged until
            the frequencies train: fine-tuning a pretrained tower into RoPE-Mixed. False (default): RoPE-Mixed's
            own random-direction init.
        **options: the scheme's options (``base=``, ``yarn_alpha=``, ``riflex_k=``...), for a scheme given by name.

    Returns:
        The same model; the tower's ``rotary_pos_emb`` is a :class:`VisionTowerRotary` holding the scheme (its
        parameters join the model's) and ``tower.visionpe_vision_rope`` names it.

    Raises:
        TypeError: ``model`` is not a supported model; ``scheme`` is not a rotary scheme (absolute and bias schemes
            do not rotate q and k), or rotates otherwise than by cos/sin tables of angles linear in position
            (LieRE, ComRoPE, STRING, HARoPE, SeqPE).
        ValueError: a 3D scheme, ``rotate_values``, an unknown scheme, option or mode, an extrapolation mode
            without ``base_grid``. Everything is checked before the model is touched.
        ImportError: (:class:`~visionpe.integrations.hf.compat.UnsupportedTransformersError`) for a transformers
            older than supported or whose tower passes its rotary other arguments; the message names the installed
            version, the supported range and the install command.

    Applying again replaces the previous scheme. :func:`remove_vision_rope` restores the tower's own rotary.

    Example (the tower's own RoPE built by visionpe; NTK-aware beyond 32 x 32 patches; RoPE-Mixed from the tower's):
        >>> apply_vision_rope(model)  # doctest: +SKIP
        >>> apply_vision_rope(model, extrapolation="ntk", base_grid=(32, 32))  # doctest: +SKIP
        >>> apply_vision_rope(model, "rope_mixed", init_from_tower=True)  # doctest: +SKIP
    """
    tower = vision_tower(model)
    _check_interface(tower)
    mode = None if extrapolation is None else check_choice(extrapolation, "extrapolation", EXTRAPOLATION_MODES)
    if base_grid is not None:
        base_grid = validate_grid_size(base_grid, "base_grid", ndims=(2,))
    if mode not in (None, "none") and base_grid is None:
        raise ValueError(
            f"extrapolation={mode!r} scales each image against the training grid: pass base_grid=(h0, w0) in "
            "patches, got base_grid=None"
        )
    if check_bool(init_from_tower, "init_from_tower"):
        cls = get_scheme_class(scheme) if isinstance(scheme, str) else type(scheme)
        if not issubclass(cls, RopeMixed):
            raise ValueError(
                f"init_from_tower=True sets RoPE-Mixed's frequencies to the tower's, so it takes scheme='rope_mixed', "
                f"got scheme={scheme if isinstance(scheme, str) else cls.__name__!r}"
            )
    built = _build_scheme(scheme, tower, mode, base_grid, dict(options))
    if init_from_tower:
        _, num_heads, _, _ = _tower_shape(tower)
        axial = create_pos_embed(
            "rope_axial", dim=built.dim, num_heads=num_heads, **own_vision_rope_options(tower)
        ).frequencies()[0, 0]  # rows (y, x); RoPE-Mixed's components are x, y
        with torch.no_grad():
            built.freqs.copy_(axial.flip(0)[:, None, None].expand_as(built.freqs))
    attn_module = importlib.import_module(type(tower.blocks[0].attn).__module__)
    per_head = built.frequencies().shape[1] > 1
    if per_head and not hasattr(attn_module, _APPLY):
        raise ValueError(
            f"the scheme has per-head frequencies, which {attn_module.__name__} cannot apply (it has no "
            f"{_APPLY}); choose a scheme whose heads share their frequencies"
        )
    if per_head:  # each block's attention gets a forward that applies them (raises for one it cannot patch)
        for block in tower.blocks:
            check_rotary_patch(block.attn, _APPLY, _per_head_apply(type(block.attn).__module__))
    # Everything above only reads the model; from here on it is patched.
    current = tower.rotary_pos_emb
    original = _own_rotary(tower)
    if isinstance(current, VisionTowerRotary):
        current.detach()
    device = getattr(original, "inv_freq", None)
    wrapper = VisionTowerRotary(built, original)
    if isinstance(device, torch.Tensor):
        wrapper.scheme.to(device.device)
    tower.rotary_pos_emb = wrapper
    wrapper.attach(tower)
    for block in tower.blocks:
        unpatch_rotary_function(block.attn)  # an earlier per-head scheme's
        if per_head:
            patch_rotary_function(block.attn, _APPLY, _per_head_apply(type(block.attn).__module__))
    tower.visionpe_vision_rope = getattr(built, "scheme_name", type(built).__name__)
    return model


def remove_vision_rope(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_vision_rope`, in place: the tower's own rotary module is back and every hook is removed, so
    the outputs equal the unpatched model's exactly, and the attention ``forward`` given for per-head schemes are
    removed. A model that is not patched is returned unchanged.

    Args:
        model: a model accepted by :func:`vision_tower`.

    Returns:
        The same model.
    """
    tower = vision_tower(model)
    current = tower.rotary_pos_emb
    if isinstance(current, VisionTowerRotary):
        current.detach()
        tower.rotary_pos_emb = current.original
    for block in tower.blocks:
        unpatch_rotary_function(block.attn)
    tower.__dict__.pop("visionpe_vision_rope", None)
    return model
