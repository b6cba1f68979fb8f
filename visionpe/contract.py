"""What each scheme needs and supports, what each entry point provides, and the one check between them.

A scheme class declares, as class attributes (:class:`~visionpe.base.PositionEncoding`):

- ``kind``: how it enters the model (``absolute``, ``rotary``, ``bias``, ``camera``);
- ``requires``: inputs beyond the patch tokens it cannot work without (``"cameras"`` for the camera schemes,
  ``"pixels"`` for an absolute scheme that computes its encoding from the input image, passed to its forward as
  ``pixels=``: LOOPE's context term);
- ``grid_ranks``: the grid ranks it can be built for (2 for images, 3 for video);
- ``supports_causal``: whether a model with causal attention stays causal with it (a token reads no later token);
- ``supports_mixed_resolution``: whether it takes mixed-resolution batches (timm's NaFlex layout);
- ``onnx_refusal``: why ``torch.onnx`` cannot export it, or None (``torch.export`` works for every scheme);
- ``rotary_backends`` and ``attention_backends``: the backends of :func:`~visionpe.set_rotary_backend` and
  :func:`~visionpe.set_attention_backend` that act on it (the defaults ``"eager"`` and ``"sdpa"`` always do);
- ``supported_extrapolation`` (rotary schemes with the extrapolation settings): the modes of
  :func:`~visionpe.set_extrapolation`, read from an instance since some depend on its options.

An :class:`EntryPoint` declares what a way of building a model provides: the kinds of scheme it places, the inputs
it passes them, its grid rank, and whether it offers causal attention and mixed-resolution batches. Every entry point
calls :func:`check_schemes` before it builds anything; a request that cannot work raises :class:`UnsupportedSchemeError`
(a ValueError) naming the entry point, the scheme, what is missing and where the scheme is supported. Nothing keeps
its own list of names: the valid names of an entry point are the registered schemes it supports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .checks import check_instance
from .registry import create_pos_embed, get_scheme_class, registered_schemes

__all__ = [
    "EntryPoint",
    "UnsupportedSchemeError",
    "register_entry_point",
    "register_other_names",
    "entry_points",
    "get_entry_point",
    "check_schemes",
    "check_built_scheme",
    "check_causal",
    "check_mixed_resolution",
    "declared",
    "refusal",
    "supported_entry_points",
    "valid_schemes",
]


class UnsupportedSchemeError(ValueError):
    """A scheme asked of an entry point, a mode or a backend that cannot do what the request says (a ValueError)."""


@dataclass(frozen=True)
class EntryPoint:
    """A way of building a model with position schemes, and what it provides them.

    Args:
        name: how users call it, e.g. ``'timm.create_model("visionpe_vit_*")'``.
        argument: the argument that names the schemes (``pos_embed``, ``camera_embed``).
        kinds: the kinds of scheme it places.
        provides: the inputs beyond the image it passes the schemes (``"cameras"``, ``"patch_depth"``).
        grid_rank: the rank of its patch grid (2 for images, 3 for video).
        causal: whether its forward takes ``is_causal=True``.
        mixed_resolution: whether its forward takes mixed-resolution batches.
        label: a short name for tables (default ``name``).
        rule: a further rule of this entry point: given a scheme class (what it declares, i.e. its default options)
            or a built scheme (its options), why it cannot run here (a clause following the scheme's name) or
            None. :func:`refusal` applies it to the class, :func:`check_built_scheme` to the built scheme.
    """

    name: str
    argument: str
    kinds: tuple[str, ...]
    provides: frozenset[str] = field(default_factory=frozenset)
    grid_rank: int = 2
    causal: bool = False
    mixed_resolution: bool = False
    label: str = ""
    rule: Callable[[Any], str | None] | None = None

    def __str__(self) -> str:
        return self.name


_ENTRY_POINTS: dict[tuple[str, str], EntryPoint] = {}
# what a required input is, where its name alone does not say it
_INPUTS = {"pixels": "pixels (the input image, passed to its forward: it computes its positions from it)"}
# names of other registries (the multimodal designs): (a function listing them, what they are and where they go)
_OTHER_NAMES: list[tuple[Callable[[], Iterable[str]], str]] = []


def register_other_names(names: Callable[[], Iterable[str]], description: str) -> None:
    """Record another registry's names (``names()`` lists them) so that an entry point given one of them says what
    it is and where it goes (``description``, e.g. "a multimodal design (...: visionpe.multimodal)") instead of
    calling it unknown. The registry registers itself; the core imports none."""
    if not callable(names):
        raise TypeError(f"names must be a callable returning names, got {type(names).__name__}")
    check_instance(description, "description", str, expected="a str")
    _OTHER_NAMES.append((names, description))


def register_entry_point(entry: EntryPoint) -> EntryPoint:
    """Record ``entry`` (for :func:`supported_entry_points` and the compatibility table); returns it."""
    check_instance(entry, "entry", EntryPoint, expected="a visionpe.contract.EntryPoint")
    _ENTRY_POINTS[(entry.name, entry.argument)] = entry
    return entry


def entry_points() -> list[EntryPoint]:
    """Every registered entry point, in registration order."""
    return list(_ENTRY_POINTS.values())


def get_entry_point(name: str, argument: str = "pos_embed") -> EntryPoint:
    """The registered entry point ``name`` whose schemes are named by ``argument``."""
    key = (name, argument)
    if key not in _ENTRY_POINTS:
        known = [f"{n} ({a})" for n, a in _ENTRY_POINTS]
        raise ValueError(f"unknown entry point {name!r} with argument {argument!r}; known: {known}")
    return _ENTRY_POINTS[key]


def declared(scheme: Any, attribute: str, default: Any) -> Any:
    """``scheme``'s ``attribute``: a built scheme's value, or a scheme class's declared one (``default`` where the
    class computes it per instance, a property). Entry points' rules read schemes through it."""
    value = getattr(scheme, attribute, default)
    return default if isinstance(value, property) else value


def refusal(entry: EntryPoint, name: str, scheme: Any = None) -> str | None:
    """Why ``entry`` cannot use the registered scheme ``name`` (one clause, without the entry point), or None; the
    entry point's :attr:`~EntryPoint.rule` reads the built ``scheme`` when given, else the class's declarations."""
    cls = get_scheme_class(name)
    kind = cls.kind
    missing = sorted(set(declared(cls, "requires", frozenset())) - set(entry.provides))
    if missing:
        needs = " and ".join(_INPUTS.get(m, m) for m in missing)
        return f"{name!r} needs {needs}, which this entry point does not provide"
    if kind not in entry.kinds:
        return f"{name!r} is a {kind} scheme and {entry.argument} here takes {' or '.join(entry.kinds)} schemes"
    ranks = tuple(declared(cls, "grid_ranks", (2,)))
    if entry.grid_rank not in ranks:
        supported = " or ".join(f"{r}D" for r in ranks)
        return f"{name!r} supports {supported} grids and this entry point has a {entry.grid_rank}D grid"
    if entry.rule is not None:
        reason = entry.rule(cls if scheme is None else scheme)
        if reason is not None:
            return f"{name!r} {reason}"
    return None


def supported_entry_points(name: str) -> list[EntryPoint]:
    """The registered entry points that take the scheme ``name``."""
    return [e for e in _ENTRY_POINTS.values() if refusal(e, name) is None]


def valid_schemes(entry: EntryPoint) -> list[str]:
    """The registered schemes ``entry`` takes, sorted."""
    return sorted(n for n in registered_schemes() if refusal(entry, n) is None)


def _where(name: str) -> str:
    places = supported_entry_points(name)
    if not places:
        return f"no registered entry point takes {name!r}"
    return f"{name!r} works with " + "; ".join(f"{e.name} ({e.argument}=...)" for e in places)


def check_schemes(entry: EntryPoint, names: Iterable[str]) -> None:
    """ValueError unless ``entry`` can place every scheme in ``names``.

    An unknown name gets a ValueError listing the names valid for ``entry`` (and saying where a multimodal design
    goes); a known one that cannot work here an :class:`UnsupportedSchemeError` naming the entry point, the scheme,
    what is missing and the entry points that take it.

    Example:
        >>> from visionpe.models.vit import VIT_ENTRY
        >>> check_schemes(VIT_ENTRY, ["rope_axial"])
        >>> check_schemes(VIT_ENTRY, ["gta"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        visionpe.contract.UnsupportedSchemeError: timm.create_model("visionpe_vit_*") cannot use pos_embed='gta': ...
    """
    check_instance(entry, "entry", EntryPoint, expected="a visionpe.contract.EntryPoint")
    names = list(names)
    for name in names:
        check_instance(name, f"{entry.argument} name", str, expected="a scheme name (str)")
        if name not in registered_schemes():
            raise ValueError(_unknown(entry, name))
        reason = refusal(entry, name)
        if reason is not None:
            raise UnsupportedSchemeError(f"{entry.name} cannot use {entry.argument}={name!r}: {reason}; {_where(name)}")
    widening = [n for n in names if get_scheme_class(n).kind == "bias" and get_scheme_class(n).augments_qk]
    if len(widening) > 1:  # each appends its channels to q and k sized for the original heads
        raise UnsupportedSchemeError(
            f"{entry.name} cannot use {entry.argument}={names}: {widening} each write their bias into channels "
            "appended to q and k, and only one such scheme fits a model; keep one of them"
        )


def _unknown(entry: EntryPoint, name: str) -> str:
    message = f"unknown position scheme {name!r} for {entry.argument} of {entry.name}"
    for names, description in _OTHER_NAMES:
        if name in names():
            message = f"{name!r} is {description}, not a scheme for {entry.argument} of {entry.name}"
    return f"{message}; valid names: {', '.join(valid_schemes(entry))}"


def check_built_scheme(entry: EntryPoint, name: str, scheme: Any) -> None:
    """:class:`UnsupportedSchemeError` when the built ``scheme`` asks for inputs (``extra_inputs``, set by options
    such as STRING's ``depth_coords=True``) that ``entry`` does not pass, or when its options break the entry point's
    :attr:`~EntryPoint.rule`."""
    missing = sorted(set(getattr(scheme, "extra_inputs", ())) - set(entry.provides))
    if missing:
        raise UnsupportedSchemeError(
            f"{entry.name} cannot use {entry.argument}={name!r} with these options: it then reads "
            f"{' and '.join(missing)}, which this entry point does not pass"
        )
    reason = entry.rule(scheme) if entry.rule is not None else None
    if reason is not None:
        raise UnsupportedSchemeError(f"{entry.name} cannot use {entry.argument}={name!r} with these options: {reason}")


def check_causal(entry: EntryPoint, schemes: Any) -> None:
    """:class:`UnsupportedSchemeError` for ``is_causal=True`` on ``entry`` when it offers no causal attention or when
    a scheme would let a token read later tokens (``supports_causal`` False). ``schemes``: {name: scheme} (a dict or
    a model's ``pos_schemes``) or (name, scheme) pairs."""
    items = schemes.items() if hasattr(schemes, "items") else schemes
    if not entry.causal:
        raise UnsupportedSchemeError(f"{entry.name} has no causal attention; got is_causal=True")
    for name, scheme in items:
        if not getattr(scheme, "supports_causal", True):
            raise UnsupportedSchemeError(
                f"{entry.name}: {entry.argument}={name!r} mixes every token with its neighbours outside attention, "
                f"so the model would not be causal; got is_causal=True"
            )


def check_mixed_resolution(entry: EntryPoint, schemes: Any) -> None:
    """:class:`UnsupportedSchemeError` for a mixed-resolution batch (timm's NaFlex layout) on ``entry`` when a scheme
    does not take one (``supports_mixed_resolution`` False, e.g. LOOPE, whose context reads the whole image).
    ``schemes``: {name: scheme} (a dict or a model's ``pos_schemes``) or (name, scheme) pairs."""
    items = schemes.items() if hasattr(schemes, "items") else schemes
    for name, scheme in items:
        if not declared(scheme, "supports_mixed_resolution", True):
            why = ""
            if "pixels" in declared(scheme, "requires", frozenset()):
                why = " (it reads the input image, which a batch of flattened patches does not give)"
            raise UnsupportedSchemeError(
                f"{entry.name}: {entry.argument}={name!r} does not take mixed-resolution batches{why}; feed "
                "(B, C, H, W) images"
            )


_MARK = {True: "✓", False: "–"}


def compatibility_table(schemes: Iterable[str] | None = None) -> str:
    """The contract as a Markdown table: every registered scheme against every registered entry point (✓: it works;
    –: it refuses with :class:`UnsupportedSchemeError`), then causal attention, mixed-resolution batches, ONNX export,
    the extrapolation modes and the non-default backends. Generated from the declarations, so it cannot drift
    from what the code does (the generic tests check the declarations against the schemes' behaviour). ``schemes``:
    the rows, every registered scheme by default."""
    entries = entry_points()
    header = ["scheme", "kind", *(e.label or e.name for e in entries)]
    header += ["causal", "mixed batch", "ONNX", "extrapolation", "backends"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in registered_schemes() if schemes is None else schemes:
        cls = get_scheme_class(name)
        cells = [f"`{name}`", cls.kind, *(_MARK[refusal(e, name) is None] for e in entries)]
        cells.append(_MARK[bool(cls.supports_causal) and cls.kind != "camera"])
        cells.append(_MARK[bool(cls.supports_mixed_resolution) and cls.kind != "camera"])
        cells.append("not tested" if cls.kind == "camera" else _MARK[cls.onnx_refusal is None])
        modes = ()
        if cls.kind == "rotary":
            scheme = create_pos_embed(name, dim=64, num_heads=2, depth=1)
            modes = tuple(m for m in getattr(scheme, "supported_extrapolation", ()) if m != "none")
        cells.append(", ".join(modes) or "–")
        backends = [b for b in (*cls.rotary_backends, *cls.attention_backends) if b not in ("eager", "sdpa")]
        cells.append(", ".join(backends) or "–")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
