"""Fine-tune a diffusers transformer with a visionpe rotary scheme in place of its own rotary.

``apply_position_scheme(transformer, "harope")`` (or any scheme of ``visionpe.list_schemes("rotary")``, with the
scheme's constructor options as keywords) builds the scheme for the model's shape (width, heads, one layer per
rotated attention module), keeps it in ``transformer.pos_schemes[name]`` and makes the model's attention rotate q and
k by it instead of the model's own rotary: diffusers attention processors (:class:`VisionPEFluxAttnProcessor`,
:class:`VisionPEWanAttnProcessor`: the model's own processor with the rotation replaced) are installed through
``transformer.set_attn_processor``, and the model's rotary module is replaced by one that builds the scheme's
per-forward state from the token positions (:class:`FluxSchemePositions`, :class:`WanSchemePositions`). The rotation
goes through the scheme's typed interface (:mod:`visionpe.interfaces.rotary`: ``prepare`` once per forward, then each
attention layer's :class:`~visionpe.interfaces.rotary.LayerRotation`), so every scheme acts as it does in a visionpe
ViT. ``remove_position_scheme`` puts back the processors, the rotary module and the state dict the model had.

Flux (``FluxTransformer2DModel``): the joint attention concatenates the text tokens, then the image tokens (the
double-stream blocks concatenate q, k, v of the two streams, the single-stream blocks take the concatenated
sequence); every attention module is a layer of the scheme, the double-stream blocks first. Image tokens are placed
on the (h, w) grid read from ``img_ids`` (columns 1 and 2; the grid is the largest id + 1 per axis, and each token
takes the scheme's coordinates of its own cell, so the token order does not matter; one image: a single value in
column 0). Text tokens are the scheme's prefix tokens, as a ViT's class token: they are not rotated, whatever their
ids. For the schemes whose angle is linear in the position (``rope_axial``, ``rope_mixed``, ``harope``, STRING, ...)
that is the rotation of position (0, 0), i.e. Flux's own text ids; a learned basis applied to every token before
the rotation (HARoPE's M, STRING's P) reaches the text tokens too, as it reaches a ViT's prefix tokens.

Wan (``WanTransformer3DModel``, ``WanVACETransformer3DModel``): the self-attention modules (``attn1`` of every block,
VACE blocks included) are the scheme's layers, in block order; the text enters through cross-attention, which keeps
its processor and has no position. The video tokens lie on the (frames, height, width) grid of the patched latent,
so the scheme is built for 3D grids (``ndim=3``); the 2D-only schemes are refused.

HARoPE in this setting: both families normalise q and k after the projections (Flux per head, Wan across the heads),
so M and M^-T act on the normalised q and k, as in HARoPE's released attention; they cannot be folded into the
projection weights (M does not commute with the normalisation), and :func:`visionpe.fold_harope_` refuses such
models. At initialisation M is (1 + 1e-6) I, so the swapped model equals the model swapped with
``rope_axial(base=10000)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from torch import nn

from ...checks import check_instance
from ...contract import EntryPoint, UnsupportedSchemeError, check_built_scheme, check_schemes, declared
from ...grid import validate_grid_size
from ...interfaces.rotary import LayerRotation, RotaryState
from ...registry import create_pos_embed, get_scheme_class, scheme_options
from ..timm_swap import SwapReport

__all__ = [
    "DIFFUSERS_SWAP_ENTRY",
    "DIFFUSERS_VIDEO_SWAP_ENTRY",
    "FluxSchemePositions",
    "JointPositions",
    "VisionPEFluxAttnProcessor",
    "VisionPEWanAttnProcessor",
    "WanSchemePositions",
    "remove_swapped_scheme",
    "swap_position_scheme",
    "swapped_scheme",
]

_SWAP_STATE = "_visionpe_diffusers_swap"


def _scheme_rule(scheme: Any) -> str | None:
    """Why a rotary scheme cannot rotate the joint text + image attention of a diffusion transformer, or None."""
    if declared(scheme, "insert_after", ()):
        return "runs between blocks, which a diffusers transformer has no place for"
    return None


#: what :func:`swap_position_scheme` provides a scheme on an image transformer (Flux): rotary schemes on one 2D grid,
#: the text tokens as prefix tokens, no depth map, no causal attention, no mixed-resolution batch. Not registered: the
#: diffusers extra is optional, and the compatibility page lists the entry points of the core install
DIFFUSERS_SWAP_ENTRY = EntryPoint(
    name="visionpe.integrations.diffusers.apply_position_scheme",
    argument="scheme",
    kinds=("rotary",),
    grid_rank=2,
    label="diffusers `apply_position_scheme`",
    rule=_scheme_rule,
)
#: the same on a video transformer (Wan): rotary schemes on the 3D (time, height, width) grid
DIFFUSERS_VIDEO_SWAP_ENTRY = EntryPoint(
    name="visionpe.integrations.diffusers.apply_position_scheme",
    argument="scheme",
    kinds=("rotary",),
    grid_rank=3,
    label="diffusers `apply_position_scheme` (video)",
    rule=_scheme_rule,
)


# -- the per-forward positions ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JointPositions:
    """What the swapped model hands every attention module in place of its own cos/sin: the scheme's per-forward
    :class:`~visionpe.interfaces.rotary.RotaryState` for ``num_text`` prefix (text) tokens followed by ``num_image``
    image tokens."""

    state: RotaryState
    num_text: int
    num_image: int

    def rotation(self, layer: int, num_tokens: int) -> LayerRotation:
        """The rotation of attention layer ``layer`` for a sequence of ``num_tokens`` tokens (ValueError when it is not
        the text + image sequence the state was built for)."""
        if num_tokens != self.num_text + self.num_image:
            raise ValueError(
                f"the attention sequence has {num_tokens} tokens, but the positions were built for {self.num_text} "
                f"text + {self.num_image} image tokens (txt_ids and img_ids of this forward)"
            )
        return self.state.layer(layer)


def _image_grid(image_ids: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """(N,) row-major cell index of every image token on its (h, w) grid, and the grid, from Flux's image ids (N, 3):
    (index, h, w), one image (a single index value), non-negative integer h and w."""
    if image_ids.shape[0] == 0:
        raise ValueError("img_ids must hold at least one image token, got none")
    if not image_ids.is_floating_point() and image_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"img_ids must be a float or integer tensor, got dtype {image_ids.dtype}")
    ids = image_ids.double()
    if not bool(torch.isfinite(ids).all()) or not bool((ids == ids.round()).all()):
        raise ValueError("img_ids must be integer positions (index, h, w) for a scheme on the (h, w) grid")
    if bool((ids[:, 1:] < 0).any()):
        raise ValueError("img_ids must hold non-negative h and w positions (columns 1 and 2)")
    if bool((ids[:, 0] != ids[0, 0]).any()):
        raise ValueError(
            "img_ids must number one image (a single value in column 0) for a 2D scheme on the (h, w) grid; several "
            "images in one sequence (Flux Kontext's reference images) would share their positions"
        )
    hw = ids[:, 1:].long()
    height, width = (int(n) + 1 for n in hw.amax(0).tolist())
    return hw[:, 0] * width + hw[:, 1], (height, width)


class FluxSchemePositions(nn.Module):
    """Replaces Flux's ``pos_embed`` while a visionpe scheme rotates q and k: ``ids`` (text ids then image ids, as the
    model concatenates them) in, :class:`JointPositions` out.

    The model's forward hands this module ``num_text`` (the length of ``txt_ids``) just before it calls it; the image
    tokens' coordinates are the scheme's coordinates (:meth:`~visionpe.base.RotaryPositionEncoding.model_coords`: its
    own convention, its training-time augmentation) of their cells on the grid read from the image ids, and the scheme
    is prepared with the text tokens as its prefix tokens. The scheme lives in the transformer's ``pos_schemes``;
    this module holds no parameter.
    """

    def __init__(self, scheme: nn.Module) -> None:
        super().__init__()
        check_instance(scheme, "scheme", nn.Module, expected="a visionpe rotary scheme")
        if getattr(scheme, "kind", None) != "rotary":
            raise TypeError(f"scheme must be a visionpe rotary scheme, got {type(scheme).__name__}")
        self.__dict__["scheme"] = scheme  # not a submodule: its parameters are the transformer's pos_schemes'
        #: the number of text tokens of the current forward, set by the model's forward pre-hook
        self.num_text: int | None = None

    def forward(self, ids: torch.Tensor) -> JointPositions:
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[1] != 3:
            raise ValueError(f"ids must be a (S, 3) tensor of Flux token ids, got {getattr(ids, 'shape', ids)}")
        num_text = self.num_text
        if num_text is None or not 0 <= num_text <= ids.shape[0]:
            raise ValueError(
                f"{type(self).__name__} needs the number of text tokens, which the swapped transformer's forward "
                f"sets from txt_ids; got {num_text} for {ids.shape[0]} ids (call the transformer, not its pos_embed)"
            )
        cells, grid = _image_grid(ids[num_text:])
        coords = self.scheme.model_coords(grid, ids.device)[cells]
        state = self.scheme.prepare(coords, num_text, grid_size=grid)
        return JointPositions(state, num_text, ids.shape[0] - num_text)


class WanSchemePositions(nn.Module):
    """Replaces Wan's ``rope`` while a visionpe scheme rotates q and k: the latent video (B, C, F, H, W) in,
    :class:`JointPositions` of its (F / p_t, H / p_h, W / p_w) token grid out (no text token: Wan's text enters
    through cross-attention), the tokens in the order of Wan's patch embedding (frame, row, column), each at the
    scheme's coordinates of its cell. Holds no parameter (the scheme lives in the transformer's ``pos_schemes``)."""

    def __init__(self, scheme: nn.Module, patch_size: Sequence[int]) -> None:
        super().__init__()
        check_instance(scheme, "scheme", nn.Module, expected="a visionpe rotary scheme")
        if getattr(scheme, "kind", None) != "rotary":
            raise TypeError(f"scheme must be a visionpe rotary scheme, got {type(scheme).__name__}")
        self.__dict__["scheme"] = scheme  # not a submodule: its parameters are the transformer's pos_schemes'
        self.patch_size = validate_grid_size(patch_size, "patch_size", ndims=(3,))

    def forward(self, hidden_states: torch.Tensor) -> JointPositions:
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.ndim != 5:
            got = getattr(hidden_states, "shape", hidden_states)
            raise ValueError(f"hidden_states must be a (B, C, F, H, W) latent video, got {got}")
        grid = tuple(n // p for n, p in zip(hidden_states.shape[2:], self.patch_size, strict=True))
        grid = validate_grid_size(grid, "the token grid", ndims=(3,))
        coords = self.scheme.model_coords(grid, hidden_states.device)
        return JointPositions(self.scheme.prepare(coords, 0, grid_size=grid), 0, coords.shape[0])


# -- the attention processors ------------------------------------------------------------------------------------


class _SchemeAttnProcessor:
    """A diffusers attention processor that rotates q and k by attention layer ``layer``'s rotation of a visionpe
    scheme (the scheme's :class:`~visionpe.interfaces.rotary.LayerRotation`, from the :class:`JointPositions` the model
    passes in place of its cos / sin); the rest is the model's processor."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"layer must be a non-negative int (the attention layer's index), got {layer!r}")
        self.layer = layer

    def _positions(self, positions: Any) -> JointPositions:
        if not isinstance(positions, JointPositions):
            raise TypeError(
                f"{type(self).__name__} takes the JointPositions that the swapped model's rotary module builds in "
                f"place of its cos / sin, got {type(positions).__name__}; call the transformer"
            )
        return positions

    def _attend(
        self, positions: JointPositions, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of q, k, v (B, S, heads, head_dim), diffusers' layout, q and k rotated (visionpe rotates
        (2, B, heads, S, head_dim)), values and output rotated where the scheme rotates values; (B, S, heads *
        head_dim) in q's dtype."""
        rotation = positions.rotation(self.layer, q.shape[1])
        q, k = rotation.rotate(torch.stack((q, k)).transpose(2, 3)).transpose(2, 3).unbind(0)
        v = rotation.rotate_values(v.transpose(1, 2)).transpose(1, 2)
        out = dispatch_attention_fn(
            q, k, v, attn_mask=mask, backend=self._attention_backend, parallel_config=self._parallel_config
        )
        return rotation.unrotate_output(out.transpose(1, 2)).transpose(1, 2).flatten(2, 3).to(q.dtype)


def _flux_projections(attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None):
    """q, k, v of the image stream and of the text stream (None without one), as diffusers' Flux processor projects
    them (separate or fused projections)."""
    if getattr(attn, "fused_projections", False):
        q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        if encoder_hidden_states is not None and hasattr(attn, "to_added_qkv"):
            return q, k, v, *attn.to_added_qkv(encoder_hidden_states).chunk(3, dim=-1)
        return q, k, v, None, None, None
    q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
    if encoder_hidden_states is not None and attn.added_kv_proj_dim is not None:
        text = attn.add_q_proj(encoder_hidden_states), attn.add_k_proj(encoder_hidden_states)
        return q, k, v, *text, attn.add_v_proj(encoder_hidden_states)
    return q, k, v, None, None, None


class VisionPEFluxAttnProcessor(_SchemeAttnProcessor):
    """diffusers' ``FluxAttnProcessor`` with q and k rotated by a visionpe scheme: attention layer ``layer`` of the
    model (the double-stream blocks first, then the single-stream ones) rotates the joint text + image sequence after
    the per-head normalisation (so a learned basis such as HARoPE's M acts on the normalised q and k). Projections,
    normalisation, the attention backend (``dispatch_attention_fn``) and the output projections are Flux's."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: JointPositions | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        positions = self._positions(image_rotary_emb)
        q, k, v, text_q, text_k, text_v = _flux_projections(attn, hidden_states, encoder_hidden_states)
        q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in (q, k, v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if text_q is not None:
            text_q, text_k, text_v = (t.unflatten(-1, (-1, attn.head_dim)) for t in (text_q, text_k, text_v))
            q = torch.cat([attn.norm_added_q(text_q), q], dim=1)
            k = torch.cat([attn.norm_added_k(text_k), k], dim=1)
            v = torch.cat([text_v, v], dim=1)
        out = self._attend(positions, q, k, v, attention_mask)
        if encoder_hidden_states is None:
            return out
        text = encoder_hidden_states.shape[1]
        text_out, out = out.split_with_sizes([text, out.shape[1] - text], 1)
        out = attn.to_out[1](attn.to_out[0](out.contiguous()))
        return out, attn.to_add_out(text_out.contiguous())


class VisionPEWanAttnProcessor(_SchemeAttnProcessor):
    """diffusers' ``WanAttnProcessor`` of a self-attention module (``attn1``, the only one Wan rotates) with q and k
    rotated by a visionpe scheme: self-attention layer ``layer`` of the model (in block order) rotates the video tokens
    after Wan's q/k normalisation (RMSNorm across the heads), so HARoPE's M acts on the normalised q and k. The
    cross-attention modules keep their processors."""

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: JointPositions | None = None,
    ) -> torch.Tensor:
        positions = self._positions(rotary_emb)
        if encoder_hidden_states is not None:
            raise ValueError(f"{type(self).__name__} runs self-attention; got encoder_hidden_states")
        if getattr(attn, "fused_projections", False):
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        out = self._attend(positions, q, k, v, attention_mask)
        return attn.to_out[1](attn.to_out[0](out))


# -- the swap --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _SwapFamily:
    """How one diffusers family takes a visionpe scheme: its entry point (the grid rank), the processor class names it
    replaces, which attention modules rotate (``rotates(module)``), the processor of each (``make_processor(layer)``),
    the module replacing its rotary (``make_positions(scheme, own_module)``) and the forward argument whose length is
    the number of text tokens (None: no text token in the rotated attention)."""

    entry: EntryPoint
    processors: tuple[str, ...]
    rotates: Callable[[nn.Module], bool]
    make_processor: Callable[[int], Any]
    make_positions: Callable[[nn.Module, nn.Module], nn.Module]
    text_ids: str | None


_FAMILIES = {
    "flux": _SwapFamily(
        DIFFUSERS_SWAP_ENTRY,
        ("FluxAttnProcessor",),
        lambda attn: True,
        VisionPEFluxAttnProcessor,
        lambda scheme, own: FluxSchemePositions(scheme),
        "txt_ids",
    ),
    "wan": _SwapFamily(
        DIFFUSERS_VIDEO_SWAP_ENTRY,
        ("WanAttnProcessor",),
        lambda attn: not attn.is_cross_attention,
        VisionPEWanAttnProcessor,
        lambda scheme, own: WanSchemePositions(scheme, own.patch_size),
        None,
    ),
}


@dataclass
class _SwapState:
    name: str
    attribute: str
    own_module: nn.Module
    processors: dict[str, Any]
    hook: Any | None


def swapped_scheme(transformer: nn.Module) -> str | None:
    """The name of the visionpe scheme that rotates ``transformer``'s attention (:func:`swap_position_scheme`), or
    None."""
    check_instance(transformer, "transformer", nn.Module, expected="a torch.nn.Module")
    state = getattr(transformer, _SWAP_STATE, None)
    return None if state is None else state.name


def _text_hook(attribute: str, argument: str, position: int) -> Callable:
    """The forward pre-hook handing the number of text tokens (the length of the ``argument`` ids) to the positions
    module at ``attribute``, read from the module it runs on (so that a deep copy's hook feeds the copy's)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get(argument, args[position] if len(args) > position else None)
        positions = getattr(module, attribute)
        positions.num_text = int(ids.shape[-2]) if isinstance(ids, torch.Tensor) and ids.ndim >= 2 else None

    return hook


def _train_grid(family: Any, train_grid_size: Sequence[int] | None) -> tuple[int, ...]:
    """The scheme's training grid: ``train_grid_size`` given per axis of the family (Flux: index, height, width; Wan:
    time, height, width), or the family's default, without an ``index`` axis (which numbers images); the scheme's
    reference grid (``grid_size``) for its coordinates and extrapolation modes."""
    axes = family.axis_names
    grid = family.default_train_grid if train_grid_size is None else train_grid_size
    grid = validate_grid_size(grid, "train_grid_size", ndims=(len(axes),))
    return tuple(n for n, a in zip(grid, axes, strict=True) if a != "index")


def swap_position_scheme(
    transformer: nn.Module,
    family: Any,
    scheme: str | None,
    train_grid_size: Sequence[int] | None = None,
    **options: Any,
) -> SwapReport:
    """Make the attention of ``transformer`` (of ``family``) rotate q and k by the visionpe rotary ``scheme``, in place
    (what ``apply_position_scheme(transformer, scheme, **options)`` does; see the module docstring).

    Args:
        transformer: a diffusers transformer of ``family`` (Flux, Wan), with diffusers' own attention processors.
        family: its :class:`~visionpe.integrations.diffusers.patch.DiffusionFamily`.
        scheme: a name of ``visionpe.list_schemes("rotary")``.
        train_grid_size: the training grid per axis of the family (Flux: index, height, width; Wan: time, height,
            width); without the index axis it is the scheme's ``grid_size`` (the reference of ``ref_scaled``
            coordinates and of the extrapolation modes) unless ``options`` sets it. None: the family's default (Flux:
            64 x 64 latent patches, 1024 px; Wan: 21 x 30 x 52).
        **options: the scheme's constructor options (``base=100``, ``block_size=4``...).

    Returns:
        A :class:`~visionpe.integrations.timm_swap.SwapReport`: the state-dict keys the scheme adds (its parameters and
        persistent buffers, ``pos_schemes.<name>.*``, at their init), those dropped (the model's rotary module has
        none), and no key copied or relabelled.

    Raises:
        TypeError: an attention module with another processor than diffusers' own (an IP-Adapter, a custom one).
        ValueError: the model is swapped already, an unknown name, a scheme of another kind (the contract's
            :class:`~visionpe.contract.UnsupportedSchemeError` names where it works), a scheme the model cannot run
            with these options, a family without a swap, options the scheme does not take.
    """
    check_instance(transformer, "transformer", nn.Module, expected="a diffusers transformer")
    current = swapped_scheme(transformer)
    if current is not None:
        raise ValueError(
            f"{type(transformer).__name__} already rotates by the visionpe scheme {current!r}; "
            "remove_position_scheme(transformer) first"
        )
    if scheme is None:
        raise ValueError(
            f"scheme=None expresses the model's own rotary and takes no options, got {sorted(options)}; "
            "name a rotary scheme to pass its options"
        )
    check_instance(scheme, "scheme", str, expected="a scheme name (str) or None")
    swap = _FAMILIES.get(family.name)
    if swap is None:
        raise UnsupportedSchemeError(
            f"scheme={scheme!r}: a visionpe scheme in place of the model's rotary is implemented for the families "
            f"{sorted(_FAMILIES)}, got {family.name!r} ({type(transformer).__name__}); scheme=None expresses its own"
        )
    check_schemes(swap.entry, [scheme])
    if hasattr(transformer, "pos_schemes"):
        raise ValueError(
            f"{type(transformer).__name__} has an attribute pos_schemes already, where the scheme would go"
        )
    own = getattr(transformer, family.attribute)
    processors = transformer.attn_processors
    others = {n: type(p).__name__ for n, p in processors.items() if type(p).__name__ not in swap.processors}
    if others:
        name, cls = next(iter(others.items()))
        raise TypeError(
            f"a visionpe scheme replaces diffusers' {' or '.join(swap.processors)}; {name} is {cls} "
            f"(an IP-Adapter or a custom processor): set the model's default processors first"
        )
    rotated = [n for n in processors if swap.rotates(transformer.get_submodule(n.removesuffix(".processor")))]
    attn = transformer.get_submodule(rotated[0].removesuffix(".processor"))
    context = {"grid_size": _train_grid(family, train_grid_size), "ndim": swap.entry.grid_rank}
    takes = scheme_options(get_scheme_class(scheme))
    extra = {k: v for k, v in context.items() if k in takes and k not in options}
    built = create_pos_embed(scheme, dim=attn.inner_dim, num_heads=attn.heads, depth=len(rotated), **extra, **options)
    check_built_scheme(swap.entry, scheme, built)
    reference = next(iter(transformer.parameters()))
    built.to(device=reference.device)
    if reference.is_floating_point() and reference.dtype != torch.float32:
        built.to(dtype=reference.dtype)
    built.train(transformer.training)
    # everything is checked and built: change the model
    before = set(transformer.state_dict())
    setattr(transformer, family.attribute, swap.make_positions(built, own))
    transformer.pos_schemes = nn.ModuleDict({scheme: built})
    layer = {n: i for i, n in enumerate(rotated)}
    transformer.set_attn_processor(
        {n: swap.make_processor(layer[n]) if n in layer else p for n, p in processors.items()}
    )
    hook = None
    if swap.text_ids is not None:
        names = list(inspect.signature(type(transformer).forward).parameters)[1:]
        hook = transformer.register_forward_pre_hook(
            _text_hook(family.attribute, swap.text_ids, names.index(swap.text_ids)), with_kwargs=True
        )
    object.__setattr__(transformer, _SWAP_STATE, _SwapState(scheme, family.attribute, own, processors, hook))
    after = set(transformer.state_dict())
    return SwapReport(added=sorted(after - before), dropped=sorted(before - after))


def remove_swapped_scheme(transformer: nn.Module) -> bool:
    """Put back the attention processors, the rotary module and the state dict ``transformer`` had before
    :func:`swap_position_scheme` (the scheme and its parameters are removed); False when no visionpe scheme rotates
    its attention (nothing is changed)."""
    check_instance(transformer, "transformer", nn.Module, expected="a torch.nn.Module")
    state = getattr(transformer, _SWAP_STATE, None)
    if state is None:
        return False
    if state.hook is not None:
        state.hook.remove()
    transformer.set_attn_processor(dict(state.processors))
    setattr(transformer, state.attribute, state.own_module)
    del transformer.pos_schemes
    object.__delattr__(transformer, _SWAP_STATE)
    return True
