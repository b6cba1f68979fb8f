"""Patch a diffusers transformer's rotary with visionpe's, and restore it.

One :class:`DiffusionFamily` per diffusers model family says where the model keeps its rotary module, how to build
visionpe's replacement (a module taking the same inputs and returning the same cos / sin layout, its
:class:`~visionpe.integrations.diffusers.rotary.DiffusionRotary` computing them) and how the model's ``timestep``
argument maps to DyPE's t in [0, 1]. :func:`apply_position_scheme` finds the family of a model by its class,
swaps the module and registers a forward pre-hook that hands the timestep to the rotary at every call (the pipeline
call stays as it was); :func:`remove_position_scheme` puts the model's own module back.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ...checks import check_float
from ...grid import validate_grid_size
from ...rotary.scaling import Extrapolation
from ..timm_swap import SwapReport
from .rotary import DiffusionRotary
from .swap import remove_swapped_scheme, swap_position_scheme, swapped_scheme

__all__ = [
    "DIFFUSERS_FAMILIES",
    "DiffusionFamily",
    "PatchReport",
    "apply_position_scheme",
    "find_diffusers_family",
    "patched_rotary",
    "register_family",
    "remove_position_scheme",
]

_STATE = "_visionpe_diffusers_patch"


@dataclass(frozen=True)
class DiffusionFamily:
    """How visionpe patches one family of diffusers transformers.

    Attributes:
        name: the family's name (``"flux"``).
        class_names: the diffusers classes of the family (matched by class name along the model's MRO, so a
            subclass is found too).
        attribute: the attribute holding the model's rotary module (``"pos_embed"``, ``"rope"``).
        build: ``build(model, own_module, train_grid_size) -> nn.Module``: visionpe's replacement, with the same
            call signature and outputs as ``own_module``; it holds a :class:`DiffusionRotary`.
        timestep_scale: the factor taking the forward's ``timestep`` argument to DyPE's t in [0, 1] (1 for Flux,
            whose pipeline passes sigma; 1 / 1000 for those passing the scheduler's timestep in [0, 1000]).
        axis_names: the rotary's axes, for the docs and errors.
        default_train_grid: the released checkpoint's training grid in positions per axis (the modes' reference),
            used when ``train_grid_size`` is not given.
        own_module_class: the class name of the rotary module the family's models hold, or a tuple of names when a
            model of the family holds one of several (checked before patching; ``build`` sees which one it is).
    """

    name: str
    class_names: tuple[str, ...]
    attribute: str
    build: Callable[[nn.Module, nn.Module, tuple[int, ...] | None], nn.Module]
    timestep_scale: float
    axis_names: tuple[str, ...]
    default_train_grid: tuple[int, ...]
    own_module_class: str | tuple[str, ...]
    notes: str = field(default="", compare=False)

    def matches(self, model: nn.Module) -> bool:
        return any(cls.__name__ in self.class_names for cls in type(model).__mro__)

    @property
    def own_module_classes(self) -> tuple[str, ...]:
        """:attr:`own_module_class` as a tuple of class names."""
        own = self.own_module_class
        return (own,) if isinstance(own, str) else tuple(own)


#: every family visionpe patches, by name (filled by the family modules)
DIFFUSERS_FAMILIES: dict[str, DiffusionFamily] = {}


def register_family(family: DiffusionFamily) -> DiffusionFamily:
    """Add ``family`` to :data:`DIFFUSERS_FAMILIES` (a name registered twice raises)."""
    if not isinstance(family, DiffusionFamily):
        raise TypeError(f"family must be a DiffusionFamily, got {type(family).__name__}")
    if family.name in DIFFUSERS_FAMILIES:
        raise ValueError(f"a diffusers family named {family.name!r} is already registered")
    DIFFUSERS_FAMILIES[family.name] = family
    return family


def _supported() -> str:
    return ", ".join(f"{c} ({f.name})" for f in DIFFUSERS_FAMILIES.values() for c in f.class_names)


def find_diffusers_family(model: Any) -> DiffusionFamily:
    """The family of ``model``; a TypeError names its class and the supported ones for any other object."""
    if isinstance(model, nn.Module):
        for family in DIFFUSERS_FAMILIES.values():
            if family.matches(model):
                return family
    raise TypeError(
        f"transformer must be a diffusers transformer of a supported family, got {type(model).__name__}; "
        f"supported: {_supported()}"
    )


@dataclass
class PatchReport:
    """What :func:`apply_position_scheme` did: the family, the module replaced and the rotary now in place."""

    family: str
    attribute: str
    rotary: DiffusionRotary
    train_grid_size: tuple[int, ...]


@dataclass
class _PatchState:
    family: DiffusionFamily
    own_module: nn.Module
    hook_id: int  # the key of the timestep pre-hook in the model's hook dicts (a copy of the model keeps it)


def patched_rotary(transformer: nn.Module) -> DiffusionRotary | Extrapolation:
    """The :class:`DiffusionRotary` of a transformer patched by :func:`apply_position_scheme` (the table module of a
    model with a position table, an :class:`~visionpe.rotary.scaling.Extrapolation` too); a ValueError for an
    unpatched one."""
    if not isinstance(transformer, nn.Module):
        raise TypeError(f"transformer must be a torch.nn.Module, got {type(transformer).__name__}")
    state = getattr(transformer, _STATE, None)
    if state is None:
        raise ValueError(
            f"{type(transformer).__name__} is not patched by visionpe: call "
            "visionpe.integrations.diffusers.apply_position_scheme(transformer) first"
        )
    module = getattr(transformer, state.family.attribute)
    return next(m for m in module.modules() if isinstance(m, Extrapolation))


class _TimestepHook:
    """The patched model's forward pre-hook: hands the call's ``timestep`` to the module at ``path`` (the rotary),
    looked up at every call, so that a copy of the model (``copy.deepcopy``) feeds its own rotary."""

    def __init__(self, path: str, scale: float, position: int) -> None:
        self.path, self.scale, self.position = path, scale, position

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        timestep = kwargs.get("timestep", args[self.position] if len(args) > self.position else None)
        module.get_submodule(self.path).set_timestep(timestep, self.scale)


def _timestep_position(model: nn.Module) -> int:
    names = list(inspect.signature(type(model).forward).parameters)[1:]
    return names.index("timestep") if "timestep" in names else len(names)


def apply_position_scheme(
    transformer: nn.Module,
    scheme: str | None = None,
    *,
    train_grid_size: Sequence[int] | None = None,
    **options: Any,
) -> PatchReport | SwapReport:
    """Express a diffusers transformer's rotary in visionpe, in place; ``visionpe.set_extrapolation`` then sets its
    modes per axis (PI, NTK, YaRN, RIFLEx, DyPE).

    Args:
        transformer: a diffusers transformer of a family in :data:`DIFFUSERS_FAMILIES`.
        scheme: None: the model's own encoding, exactly (the denoiser's output equals the original's to float
            rounding at any size until a mode is set); a name of ``visionpe.list_schemes("rotary")`` (Flux and Wan):
            that scheme replaces the model's rotary for fine-tuning, built with ``**options`` (its constructor's
            options), and a :class:`~visionpe.integrations.timm_swap.SwapReport` lists its new parameters
            (:mod:`visionpe.integrations.diffusers.swap`).
        train_grid_size: the grid the modes' factors are relative to, in positions per axis of the rotary (the
            family's ``axis_names``); None: the released checkpoint's (``DiffusionFamily.default_train_grid``).

    Returns:
        A :class:`PatchReport` (scheme None) or a :class:`~visionpe.integrations.timm_swap.SwapReport` (a scheme).

    Raises:
        TypeError: ``transformer`` is not of a supported family (the message lists them).
        ValueError: the model is patched already, a scheme other than None, or a ``train_grid_size`` that is not
            one positive int per axis of the family.
    """
    family = find_diffusers_family(transformer)
    if getattr(transformer, _STATE, None) is not None:
        raise ValueError(f"{type(transformer).__name__} is patched already; remove_position_scheme(transformer) first")
    if scheme is not None or options or swapped_scheme(transformer) is not None:
        return swap_position_scheme(transformer, family, scheme, train_grid_size, **options)
    if train_grid_size is not None:
        train_grid_size = validate_grid_size(train_grid_size, "train_grid_size", ndims=(len(family.axis_names),))
    own = getattr(transformer, family.attribute, None)
    if own is None or type(own).__name__ not in family.own_module_classes:
        expected = " or ".join(family.own_module_classes)
        raise TypeError(
            f"{type(transformer).__name__}.{family.attribute} must be diffusers' {expected} "
            f"for visionpe to replace it, got {type(own).__name__}"
        )
    check_float(family.timestep_scale, "timestep_scale", min=0, min_open=True)
    replacement = family.build(transformer, own, train_grid_size)
    rotary = next((m for m in replacement.modules() if isinstance(m, Extrapolation)), None)
    if rotary is None:
        raise TypeError(
            f"the {family.name} family built {type(replacement).__name__}, which holds no DiffusionRotary (nor "
            "another Extrapolation module, as a position table)"
        )
    param = next(iter(transformer.parameters()), None)
    if param is not None:
        replacement.to(device=param.device)
    setattr(transformer, family.attribute, replacement)
    path = next(f"{family.attribute}.{n}".rstrip(".") for n, m in replacement.named_modules() if m is rotary)
    # first among the model's pre-hooks: a family's own hook (CogVideoX's rotary argument) reads the timestep after it
    hook = transformer.register_forward_pre_hook(
        _TimestepHook(path, family.timestep_scale, _timestep_position(transformer)), with_kwargs=True, prepend=True
    )
    object.__setattr__(transformer, _STATE, _PatchState(family, own, hook.id))
    return PatchReport(family.name, family.attribute, rotary, rotary.train_grid_size)


def remove_position_scheme(transformer: nn.Module) -> nn.Module:
    """Put back the rotary module the transformer had before :func:`apply_position_scheme`; returns the transformer.

    A ValueError for a transformer visionpe did not patch.
    """
    if not isinstance(transformer, nn.Module):
        raise TypeError(f"transformer must be a torch.nn.Module, got {type(transformer).__name__}")
    state = getattr(transformer, _STATE, None)
    if state is None:
        if remove_swapped_scheme(transformer):
            return transformer
        raise ValueError(f"{type(transformer).__name__} is not patched by visionpe; nothing to remove")
    for hooks in (transformer._forward_pre_hooks, transformer._forward_pre_hooks_with_kwargs):
        hooks.pop(state.hook_id, None)
    setattr(transformer, state.family.attribute, state.own_module)
    object.__delattr__(transformer, _STATE)
    return transformer
