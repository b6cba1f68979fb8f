"""One registry that maps scheme names to the classes that build them.

Every scheme module registers itself with :func:`register_scheme`; :func:`create_pos_embed` builds one by
name with the model's dimensions, and fails early with a message naming the valid schemes or arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from torch import nn

from .base import check_model_shape
from .checks import check_choice, check_instance

__all__ = [
    "register_scheme",
    "unregister_scheme",
    "list_schemes",
    "registered_schemes",
    "create_pos_embed",
    "get_scheme_class",
    "scheme_options",
]

_SCHEMES: dict[str, type[nn.Module]] = {}


def register_scheme(name: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: make ``cls`` available as ``create_pos_embed(name, ...)``."""

    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        if name in _SCHEMES and _SCHEMES[name] is not cls:
            raise ValueError(f"scheme name {name!r} is already registered to {_SCHEMES[name].__name__}")
        _SCHEMES[name] = cls
        cls.scheme_name = name
        return cls

    return wrap


def unregister_scheme(name: str) -> type[nn.Module]:
    """Remove the scheme ``name`` from the registry and return its class (ValueError if it is not registered).

    For schemes registered for a while, e.g. in a test: models built with it keep working.

    Example:
        >>> import visionpe
        >>> from visionpe.registry import register_scheme, unregister_scheme
        >>> cls = unregister_scheme("rope_axial")
        >>> "rope_axial" in visionpe.list_schemes()
        False
        >>> _ = register_scheme("rope_axial")(cls)
    """
    cls = get_scheme_class(name)
    del _SCHEMES[name]
    return cls


def list_schemes(kind: str | None = None) -> list[str]:
    """Sorted names of the registered schemes of one kind, or of the image schemes.

    Args:
        kind: ``"absolute"``, ``"rotary"`` or ``"bias"``; None for all three (the schemes of a single-image model,
            :class:`~visionpe.VisionPEViT`); ``"camera"`` for the camera-aware schemes of multi-view models
            (:mod:`visionpe.camera`).

    Example:
        >>> import visionpe
        >>> "rope_mixed" in visionpe.list_schemes("rotary")
        True
    """
    kinds = ("absolute", "rotary", "bias", "camera")
    if kind is not None:
        check_choice(kind, "kind", kinds, expected=f"one of {kinds} or None")
    return sorted(n for n, c in _SCHEMES.items() if (c.kind == kind if kind else c.kind in kinds[:3]))


def registered_schemes() -> list[str]:
    """Sorted names of every registered scheme, of every kind (the image schemes and the camera schemes)."""
    return sorted(_SCHEMES)


def get_scheme_class(name: str) -> type[nn.Module]:
    check_instance(name, "scheme name", str, expected="a str")
    if name not in _SCHEMES:
        valid = ", ".join(list_schemes() + list_schemes("camera"))
        raise ValueError(f"unknown position scheme {name!r}; valid names: {valid}")
    return _SCHEMES[name]


def create_pos_embed(name: str, *, dim: int, num_heads: int, depth: int = 1, **kwargs) -> nn.Module:
    """Build the position scheme ``name`` for a model of width ``dim`` with ``num_heads`` heads and ``depth`` blocks.

    Per-scheme options go in ``kwargs``; an option the scheme does not take raises ValueError naming it.

    Example:
        >>> import visionpe
        >>> rope = visionpe.create_pos_embed("rope_axial", dim=384, num_heads=6, depth=12)
        >>> rope.kind
        'rotary'
    """
    cls = get_scheme_class(name)
    check_model_shape(dim, num_heads, depth)
    valid = scheme_options(cls)
    unknown = [k for k in kwargs if k not in valid]
    if unknown and not _takes_any_keyword(cls):
        raise ValueError(f"{name} got unknown option(s) {unknown}; valid options: {list(valid)}")
    return cls(dim=dim, num_heads=num_heads, depth=depth, **kwargs)


def scheme_options(cls: type[nn.Module]) -> tuple[str, ...]:
    """The keyword options a scheme class names besides the model's ``dim``, ``num_heads`` and ``depth``: its
    ``option_names()`` where it declares them (the rotary family: its own options, then the shared
    :class:`~visionpe.rotary.base.RotaryOptions` it takes), else its constructor's named arguments."""
    if not isinstance(cls, type):
        raise TypeError(f"cls must be a scheme class, got {type(cls).__name__}")
    option_names = getattr(cls, "option_names", None)
    if callable(option_names):
        return tuple(option_names())
    params = inspect.signature(cls.__init__).parameters.values()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in params if p.kind in named and p.name not in ("self", "dim", "num_heads", "depth"))


def _takes_any_keyword(cls: type[nn.Module]) -> bool:
    """Whether the constructor the scheme presents takes any keyword (``**kwargs``): then no option is unknown."""
    params = inspect.signature(cls.__init__).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
