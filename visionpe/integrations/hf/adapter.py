"""What the Hugging Face adapters share: the steps of ``apply_position_scheme`` and the per-instance patches.

:func:`apply_scheme` is ``apply_position_scheme`` for every family: find the model's row in the family table
(:mod:`~visionpe.integrations.hf.families`), check the installed transformers against the methods that row patches,
validate the options, resolve the defaults the scheme reads from the model's config
(:meth:`~visionpe.multimodal.registry.MultimodalScheme.with_model_defaults`), let the adapter build what it
installs (its :class:`Adapter` steps), and only then patch: the model's earlier scheme is removed, the row's methods
are replaced on the instance, and the language model's rotary embedding is wrapped where the scheme needs its own.
Every error is raised before anything is patched.

Everything is patched per instance, never in transformers' modules: two models of one family in one process, one
patched and one not, each compute as their own. Head-wise schemes (``mhrope``) give the attention (B, H_kv, L, D)
tables, which the modeling module's ``apply_rotary_pos_emb`` cannot apply; :func:`patch_rotary_function` gives each
attention module of the patched model a ``forward`` that is its class's, with that one global name bound to a
function that also takes per-head tables.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...checks import check_instance, check_int
from ...multimodal.allocation import ALLOCATIONS
from ...multimodal.ids import get_position_ids
from ...multimodal.registry import MultimodalScheme, get_multimodal_scheme
from ...multimodal.rotary import MultimodalRotary, apply_multimodal_rotary
from .compat import UnsupportedTransformersError, check_transformers, require_interface
from .families import VLMFamily, find_family
from .layers import LayerPlan, bind_arguments, installed_plan
from .layers import install as install_layer_plan
from .layers import uninstall as uninstall_layer_plan

__all__ = [
    "ROTARY_OPTIONS",
    "COLLATED_INPUTS",
    "LAYER_INPUTS",
    "Adapter",
    "Prepared",
    "PatchState",
    "apply_scheme",
    "remove_scheme",
    "state_of",
    "own_method",
    "bind_arguments",
    "check_design_options",
    "checked_section",
    "scaled_section",
    "rotary_options",
    "check_rotary_patch",
    "patch_rotary_function",
    "unpatch_rotary_function",
    "check_rotary_function",
]

ROTARY_OPTIONS = ("mrope_section",)  # options of the allocation, not of the position design
# what a collator (visionpe.integrations.hf.collate) adds to a batch beside position_ids: the patched forwards pop
# them (transformers would hand unknown keywords on to the vision tower and the attention) and use them as given
LAYER_INPUTS = ("layer_position_ids", "layer_rope_deltas", "layer_attention_mask")
COLLATED_INPUTS = ("rope_deltas", *LAYER_INPUTS, "cu_seqlens", "max_seqlen")
_STATE = "_visionpe_state"  # attribute of the inner model that holds its PatchState
_PLAN_BELOW = "visionpe_forward_before"  # attribute where a layer plan keeps the forward its own forward calls
_INTERLEAVED = "interleaved"  # the allocation whose section is laid out pair by pair (see scaled_section)
_SECTION_LAYOUTS = ("chunked", _INTERLEAVED)  # the layouts a model's own mrope_section can have


class PatchState:
    """What a patched model runs: the scheme's registry entry, its design options and the model's family.

    ``originals`` holds, per method of the family's ``patched``, the instance attribute that the patch shadowed
    (None where there was none, the usual case). Adapters extend it with what their patched methods need.
    """

    def __init__(self, entry: MultimodalScheme, options: dict[str, Any], family: VLMFamily) -> None:
        self.entry = entry
        self.scheme = entry.name
        self.options = dict(options)
        self.family = family
        self.originals: dict[str, Any] = {}


@dataclass(frozen=True)
class Prepared:
    """What :func:`apply_scheme` installs: the state, the rotary that replaces the language model's (None: the
    model keeps its own) and the per-layer plan (None: one set of ids and the causal mask for every layer)."""

    state: PatchState
    rotary: nn.Module | None = None
    plan: LayerPlan | None = None


@dataclass(frozen=True)
class Adapter:
    """The steps of ``apply_position_scheme`` that differ between adapters.

    Attributes:
        name: the adapter's module name (the families of :data:`~visionpe.integrations.hf.families.FAMILIES` whose
            ``adapter`` it is are the ones it runs).
        validate: ``validate(entry, options, vl_model, family)``: raise for options (design options only) or a model
            setting the adapter cannot run.
        prepare: ``prepare(entry, options, rotary_options, vl_model, family) -> Prepared``: build the state and the
            rotary (options with the model's defaults resolved); raise for values that cannot run. Reads the model
            only.
        methods: the per-instance replacement of every method of the family's ``patched``, by name.
    """

    name: str
    validate: Callable[[MultimodalScheme, dict[str, Any], nn.Module, VLMFamily], None]
    prepare: Callable[[MultimodalScheme, dict[str, Any], dict[str, Any], nn.Module, VLMFamily], Prepared]
    methods: dict[str, Callable[..., Any]]


def apply_scheme(adapter: Adapter, model: nn.Module, scheme: str, kwargs: dict[str, Any]) -> nn.Module:
    """``apply_position_scheme(model, scheme, **kwargs)`` of ``adapter``: validate, resolve defaults, install."""
    check_instance(adapter, "adapter", Adapter, expected="an Adapter")
    check_instance(kwargs, "kwargs", dict, expected="a dict of options")
    vl_model, family = find_family(model, adapter.name)
    check_interface(family, model, vl_model)
    entry = get_multimodal_scheme(scheme)
    options = {name: value for name, value in kwargs.items() if name not in ROTARY_OPTIONS}
    unknown = [name for name in options if name not in entry.design_options()]
    if unknown:
        valid = entry.design_options() + list(ROTARY_OPTIONS)
        raise ValueError(f"{scheme} got unknown option(s) {unknown}; valid options: {valid}")
    adapter.validate(entry, options, vl_model, family)
    options = entry.with_model_defaults(options, vl_model.config)
    prepared = adapter.prepare(entry, options, {k: kwargs[k] for k in ROTARY_OPTIONS if k in kwargs}, vl_model, family)
    if prepared.rotary is not None and prepared.rotary.per_head:
        check_rotary_function(vl_model, family)
    # Everything above only reads the model; from here on it is patched.
    remove_scheme(model, adapter.name)
    _install(model, vl_model, family, prepared, adapter.methods)
    return model


def check_interface(family: VLMFamily, model: nn.Module, vl_model: nn.Module) -> None:
    """The installed transformers' release, and every method the family's adapter replaces (with the arguments it
    reads or passes by name) and every module function it calls (:mod:`~visionpe.integrations.hf.compat`)."""
    check_instance(family, "family", VLMFamily, expected="a VLMFamily row")
    check_transformers(family.feature)
    for on_outer, name, parameters in family.patched:
        if not on_outer or model is not vl_model:
            require_interface(family.feature, type(model if on_outer else vl_model), name, parameters)
    if family.functions:
        modeling = importlib.import_module(family.module)
        for name in family.functions:
            require_interface(family.feature, modeling, name)


def state_of(vl_model: nn.Module | None) -> PatchState | None:
    """The :class:`PatchState` of a patched inner model, else None (also for None)."""
    if vl_model is None:
        return None
    check_instance(vl_model, "vl_model", nn.Module, expected="a torch.nn.Module or None")
    return vl_model.__dict__.get(_STATE)


def own_method(obj: nn.Module, name: str, state: PatchState | None) -> Any:
    """``obj``'s method ``name`` as it was before patching: a shadowed instance attribute, else the class's."""
    check_instance(name, "name", str, expected="a method name (str)")
    previous = state.originals.get(name) if state is not None else None
    return previous if previous is not None else getattr(type(obj), name).__get__(obj)


def _install(
    model: nn.Module, vl_model: nn.Module, family: VLMFamily, prepared: Prepared, methods: dict[str, Callable]
) -> None:
    state = prepared.state
    if prepared.rotary is not None:
        language = family.language(vl_model)
        original = getattr(language, family.rotary)
        setattr(language, family.rotary, _HFRotary(prepared.rotary, original).to(original.inv_freq.device))
        if prepared.rotary.per_head:
            for attention in family.attentions(vl_model):
                apply = _per_head_apply(type(attention).__module__, family.rotary_function)
                patch_rotary_function(attention, family.rotary_function, apply)
    if prepared.plan is not None:
        # after the rotary (the plan wraps the one in place) and before the methods: installing a plan clears every
        # earlier per-instance forward it finds, the adapter's own included
        install_layer_plan(vl_model, prepared.plan)
    plan_forward = installed_plan(vl_model) is not None
    for obj, name in family.methods(model, vl_model):
        method = types.MethodType(methods[name], obj)
        if plan_forward and obj is vl_model and name == "forward":
            # the plan's forward of the inner model runs first and calls the forward it found: the adapter's goes
            # there, in front of what was there before (an accelerate hook, or the class's)
            state.originals[name] = obj.__dict__.get(_PLAN_BELOW)
            obj.__dict__[_PLAN_BELOW] = method
            continue
        current = obj.__dict__.get(name)
        state.originals[name] = None if getattr(current, "visionpe_patch", False) else current
        setattr(obj, name, method)
    vl_model.__dict__[_STATE] = state
    if family.deltas is not None:
        setattr(vl_model, family.deltas, None)
    model.visionpe_scheme = state.scheme
    vl_model.visionpe_scheme = state.scheme


def remove_scheme(model: nn.Module, adapter: str) -> nn.Module:
    """``remove_position_scheme(model)`` of the adapter named ``adapter``: put back every method, module and forward
    that :func:`apply_scheme` replaced (a model that is not patched is returned unchanged)."""
    vl_model, family = find_family(model, adapter)
    state = vl_model.__dict__.pop(_STATE, None)
    originals = state.originals if state is not None else {}
    if installed_plan(vl_model) is not None:
        # first: the plan's forward wraps the adapter's own forward of the inner model, which it puts back
        uninstall_layer_plan(vl_model)
    for obj, name in family.methods(model, vl_model):
        if not getattr(obj.__dict__.get(name), "visionpe_patch", False):
            continue
        del obj.__dict__[name]
        if originals.get(name) is not None:
            setattr(obj, name, originals[name])
    for attention in family.attentions(vl_model):
        unpatch_rotary_function(attention)
    language = family.language(vl_model)
    rotary = getattr(language, family.rotary)
    if isinstance(rotary, _HFRotary):
        setattr(language, family.rotary, rotary.original)
        if family.deltas is not None:
            setattr(vl_model, family.deltas, None)
    for obj in (model, vl_model):
        obj.__dict__.pop("visionpe_scheme", None)
    return model


class _HFRotary(nn.Module):
    """Drop-in for the language model's ``rotary_emb``: ``forward(x, position_ids) -> (cos, sin)`` in x's dtype.

    ``position_ids`` keep their dtype: int64 ids give fp32 angles, float64 ids (fractional schemes) fp64 angles.

    It keeps the model's own rotary module (a submodule, so that ``.to()`` moves it along; its buffers are
    non-persistent and stay out of the state dict), which :func:`remove_scheme` puts back.
    """

    def __init__(self, rotary: MultimodalRotary, original: nn.Module) -> None:
        super().__init__()
        self.rotary = rotary
        self.original = original

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rotary.mix.shape[1]  # 3, or 3K for PPE's K positions per token
        if rows != 3 and position_ids.ndim == 3 and position_ids.shape[0] == rows + 1:
            # generate puts a text row in front of the scheme's ids; transformers drops it only from 4 rows
            position_ids = position_ids[1:]
        return self.rotary(position_ids.to(x.device), dtype=x.dtype)


def own_rotary(vl_model: nn.Module, family: VLMFamily) -> nn.Module:
    """The language model's own rotary module, also when a scheme replaced it (its settings are the defaults)."""
    rotary = getattr(family.language(vl_model), family.rotary)
    return rotary.original if isinstance(rotary, _HFRotary) else rotary


# ------------------------------------------------------------------------------------------------ options and rotary
def check_design_options(scheme: str, options: dict[str, Any], spatial_merge_size: int) -> None:
    """Run the scheme's position design once on a one-image batch, so that bad option values fail here.

    A (B,) tensor option (per-sample values) sets the batch size of the trial run.
    """
    check_instance(options, "options", dict, expected="a dict of design options")
    batch_size = 1
    for value in options.values():
        if isinstance(value, torch.Tensor) and value.ndim == 1 and value.numel():
            batch_size = value.numel()
    types_ = torch.tensor([[0, 1, 0]]).expand(batch_size, -1)
    image_grid = torch.tensor([[1, spatial_merge_size, spatial_merge_size]]).repeat(batch_size, 1)
    try:
        get_position_ids(scheme, types_, image_grid, spatial_merge_size=spatial_merge_size, pad_value=0, **options)
    except (TypeError, ValueError) as err:
        kind = TypeError if isinstance(err, TypeError) else ValueError
        raise kind(f"apply_position_scheme({scheme!r}): {err}") from err


def checked_section(section: Any, entry: MultimodalScheme) -> tuple[int, ...]:
    """``mrope_section`` as a tuple, if the scheme's allocation takes one; its values are checked by the allocation."""
    check_instance(entry, "entry", MultimodalScheme, expected="a MultimodalScheme registry entry")
    if "mrope_section" not in inspect.signature(ALLOCATIONS[entry.allocation]).parameters:
        raise ValueError(
            f"{entry.name} uses the {entry.allocation!r} allocation, which takes no mrope_section; got {section!r}"
        )
    if not isinstance(section, (list, tuple)):
        raise TypeError(
            f"mrope_section must be a list or tuple of three non-negative ints (t, h, w), "
            f"got {type(section).__name__} ({section!r})"
        )
    return tuple(section)


def scaled_section(default: tuple[int, int, int], num_pairs: int, interleaved: bool = False) -> tuple[int, int, int]:
    """A (t, h, w) split of ``num_pairs`` in the proportions of ``default``, with h == w where the layout allows it.

    For the interleaved allocation (pair n -> h if n % 3 == 1 and n < 3 s_h, -> w if n % 3 == 2 and n < 3 s_w)
    every section pair must exist, i.e. 3 s_h <= P + 1 and 3 s_w <= P: h and w are each cut to their largest
    value there and t takes the rest (2 pairs -> (1, 1, 0), 5 pairs -> (2, 2, 1)); splits that already fit stay.
    """
    check_int(num_pairs, "num_pairs", min=1)
    if not isinstance(default, (list, tuple)) or len(default) != 3 or sum(default) <= 0:
        raise ValueError(f"default must be a (t, h, w) section with a positive sum, got {default!r}")
    spatial = round(num_pairs * default[1] / sum(default))
    if not interleaved:
        return (num_pairs - 2 * spatial, spatial, spatial)
    s_h, s_w = min(spatial, (num_pairs + 1) // 3), min(spatial, num_pairs // 3)
    return (num_pairs - s_h - s_w, s_h, s_w)


def _default_section(entry: MultimodalScheme, family: VLMFamily, rope: dict[str, Any], num_pairs: int):
    """The model's own ``mrope_section`` where the scheme's allocation can read it, else the scheme's default
    proportions scaled to ``num_pairs``; None for allocations without a section."""
    default = entry.allocation_kwargs.get("mrope_section")
    if default is None:
        return None
    own = tuple(rope.get("mrope_section") or ())
    fits = family.section_allocation is not None and len(own) == 3 and sum(own) == num_pairs
    if entry.allocation in _SECTION_LAYOUTS:  # a section laid out for chunked or interleaved pairs serves that one
        fits = fits and entry.allocation == family.section_allocation
    else:  # the allocations that interleave h and w (LTA, HoPE) read (t, h, w) shares with h == w
        fits = fits and own[1] == own[2]
    return own if fits else scaled_section(default, num_pairs, interleaved=entry.allocation == _INTERLEAVED)


def rotary_options(
    entry: MultimodalScheme, given: dict[str, Any], vl_model: nn.Module, family: VLMFamily
) -> tuple[int, dict[str, Any]]:
    """(head_dim, allocation options) of the rotary that replaces ``vl_model``'s for ``entry``: ``mrope_section``
    as given or by default (:func:`_default_section`) and, for head-wise allocations, the language model's KV heads."""
    check_instance(entry, "entry", MultimodalScheme, expected="a MultimodalScheme registry entry")
    check_instance(family, "family", VLMFamily, expected="a VLMFamily row")
    text_config = vl_model.config.text_config
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    options: dict[str, Any] = {}
    if "mrope_section" in given:
        options["mrope_section"] = checked_section(given["mrope_section"], entry)
    else:
        section = _default_section(entry, family, rope, head_dim // 2)
        if section is not None:
            options["mrope_section"] = section
    if "num_kv_heads" in inspect.signature(ALLOCATIONS[entry.allocation]).parameters:
        options["num_kv_heads"] = text_config.num_key_value_heads
    return head_dim, options


# ------------------------------------------------------------------------------- per-instance rotary application
@functools.cache
def _per_head_apply(module_name: str, name: str) -> Callable[..., Any]:
    """``name`` of the modeling module ``module_name`` (``apply_rotary_pos_emb``), extended to per-head
    (B, H_kv, L, D) tables (MHRoPE), which go to :func:`~visionpe.multimodal.apply_multimodal_rotary`; other tables
    go to the module's function as it is when called (one function per module and name)."""
    modeling = importlib.import_module(module_name)

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if cos.ndim == 4:
            return apply_multimodal_rotary(q, k, cos, sin)
        return getattr(modeling, name)(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    apply_rotary_pos_emb.visionpe_module = module_name
    return apply_rotary_pos_emb


def _rebound(function: Any, name: str, value: Any) -> tuple[Any, bool]:
    """A copy of ``function`` that reads ``value`` for its global ``name``, through the chain of functions it wraps
    (``__wrapped__``, held in its closure, as ``functools.wraps`` decorators do); and whether any function of the
    chain reads that global. The copies share code, defaults and every other global with the originals."""
    inner = getattr(function, "__wrapped__", None)
    closure = function.__closure__
    reads = False
    if inner is not None and closure:
        new_inner, reads = _rebound(inner, name, value)
        cells = []
        for cell in closure:
            try:
                holds_inner = cell.cell_contents is inner
            except ValueError:  # an empty cell
                holds_inner = False
            cells.append(types.CellType(new_inner) if holds_inner else cell)
        closure = tuple(cells)
    else:
        new_inner = inner
    globals_ = function.__globals__
    if name in function.__code__.co_names and name in globals_:
        globals_ = {**globals_, name: value}
        reads = True
    copy = types.FunctionType(function.__code__, globals_, function.__name__, function.__defaults__, closure)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__dict__.update(function.__dict__)
    copy.__qualname__, copy.__doc__, copy.__module__ = function.__qualname__, function.__doc__, function.__module__
    copy.__annotations__ = dict(getattr(function, "__annotations__", {}))
    if new_inner is not None:
        copy.__wrapped__ = new_inner
    return copy, reads


@functools.cache
def _forward_with(cls: type, name: str, value: Any) -> Any:
    """``cls.forward`` with its global ``name`` bound to ``value`` (one copy per class and value)."""
    forward, reads = _rebound(cls.forward, name, value)
    if not reads:
        raise UnsupportedTransformersError(
            f"{cls.__module__}.{cls.__name__}.forward does not call the module's {name}, which visionpe's head-wise "
            "schemes extend to per-head tables: this transformers applies the rotary embedding differently; choose a "
            "scheme whose heads share their frequencies"
        )
    forward.visionpe_patch = True
    forward.visionpe_global = name
    return forward


def check_rotary_patch(module: nn.Module, name: str, function: Callable[..., Any]) -> None:
    """Raise what :func:`patch_rotary_function` would raise for these arguments, without patching anything.

    Raises:
        ValueError: when ``module`` already has a ``forward`` of its own (a hook that wraps it), which the patch would
            replace.
        UnsupportedTransformersError: when its class's ``forward`` never calls the global ``name``.
    """
    check_instance(module, "module", nn.Module, expected="a torch.nn.Module")
    check_instance(name, "name", str, expected="a global name (str)")
    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}")
    current = module.__dict__.get("forward")
    if current is not None and getattr(current, "visionpe_global", None) is None:
        raise ValueError(
            f"{type(module).__name__} has a forward of its own ({current!r}), which a head-wise scheme would replace "
            "to apply per-head tables: apply the scheme before adding hooks that wrap forward"
        )
    _forward_with(type(module), name, function)


def patch_rotary_function(module: nn.Module, name: str, function: Callable[..., Any]) -> None:
    """Give ``module`` (an attention module) a per-instance ``forward``: its class's, calling ``function`` where it
    calls the global ``name`` of its modeling module. The modeling module, the class and every other instance are
    unchanged; :func:`unpatch_rotary_function` undoes it. Raises as :func:`check_rotary_patch`.

    Example:
        >>> patch_rotary_function(attention, "apply_rotary_pos_emb", my_apply)  # doctest: +SKIP
    """
    check_rotary_patch(module, name, function)
    module.forward = types.MethodType(_forward_with(type(module), name, function), module)


def unpatch_rotary_function(module: nn.Module) -> None:
    """Undo :func:`patch_rotary_function` (nothing for a module it did not patch)."""
    check_instance(module, "module", nn.Module, expected="a torch.nn.Module")
    if getattr(module.__dict__.get("forward"), "visionpe_global", None) is not None:
        del module.__dict__["forward"]


def check_rotary_function(vl_model: nn.Module, family: VLMFamily) -> None:
    """Raise, before patching, what :func:`patch_rotary_function` would raise on ``vl_model``'s attention modules
    for a head-wise scheme."""
    for attention in family.attentions(vl_model):
        check_rotary_patch(
            attention, family.rotary_function, _per_head_apply(type(attention).__module__, family.rotary_function)
        )
