"""One table of multimodal schemes: name -> (position design, frequency allocation).

Twelve-odd published schemes are combinations of a handful of designs and allocations (Huang et al.,
"Revisiting Multimodal Positional Encoding in Vision-Language Models", ICLR 2026), so each entry names one
of each instead of defining a class.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from ..checks import check_instance
from ..contract import register_other_names
from .bipe import bipe_advance_tokens, bipe_design
from .cca import cca_design
from .circle_rope import circle_rope_design, circle_rope_layer_of
from .design import DesignOutput, VisualLayout
from .hope import hope_design
from .mrope import mrope_abs_time_design, mrope_abs_time_model_defaults, mrope_design
from .mrope_interleaved import mrope_interleaved_design
from .ppe import ppe_design
from .pype import pype_design, pype_layer_of
from .rope_1d import rope_1d_design
from .rope_dhr import rope_dhr_design
from .v2pe import v2pe_design
from .videorope import videorope_design
from .vrope import vrope_design

__all__ = ["MultimodalScheme", "MULTIMODAL_SCHEMES", "get_multimodal_scheme", "list_multimodal_schemes"]


@dataclass(frozen=True)
class MultimodalScheme:
    """``design(layout, **options) -> DesignOutput`` and an allocation name from ``ALLOCATIONS`` with defaults.

    Properties a model adapter must honour beyond the ids:

    - ``layer_of``: for designs whose ids differ per decoder layer (PyPE, Circle-RoPE's AGE), ``layer_of(layer,
      options)`` names the first layer whose ids decoder layer ``layer`` shares (ValueError for options that cannot
      place the layers); the design then takes ``layer=``. None: one set of ids for every layer.
    - ``block_mask``: the design changes the causal mask inside each visual block (CCA, PyPE): key k is visible to
      query q iff its position offset in the block is at most q's (:func:`~visionpe.multimodal.cca.visual_block_mask`).
    - ``required_options``: options without a default that a model adapter must be given (the design accepts their
      absence only where the result does not depend on them, e.g. PyPE's layer 0).
    - ``call_inputs``: options that describe one batch's tokens (PPE's ``clusters``, BiPE's ``input_ids``, a video's
      ``second_per_grid_ts``): an adapter takes them with each call, never once for the model.
    - ``model_defaults``: ``model_defaults(config) -> {option: value}``, the defaults a model adapter reads from the
      model's config (Qwen2.5-VL's ``vision_config.tokens_per_second`` for ``mrope_abs_time``); options given
      explicitly win (:meth:`with_model_defaults`).
    - ``representatives_option``: the option that gives K positions per token (PPE's ``num_representatives``): the
      ids then have 3K rows, which need :class:`~visionpe.multimodal.PPERotary` for K > 1.
    - ``advance_tokens``: ``advance_tokens(options) -> token ids``, for designs whose text position advances only
      after those tokens (BiPE's separators), where a decoder must not add one per generated token. None: every
      text token advances the position by one.
    """

    name: str
    design: Callable[..., DesignOutput]
    allocation: str
    allocation_kwargs: dict[str, Any] = field(default_factory=dict)
    reference: str = ""
    layer_of: Callable[[int, dict[str, Any]], int] | None = None
    block_mask: bool = False
    required_options: tuple[str, ...] = ()
    call_inputs: tuple[str, ...] = ()
    model_defaults: Callable[[Any], dict[str, Any]] | None = None
    representatives_option: str | None = None
    advance_tokens: Callable[[dict[str, Any]], tuple[int, ...]] | None = None

    def design_options(self) -> list[str]:
        """Keyword options of the position design (``get_position_ids(scheme, ..., **options)``)."""
        return list(_design_options(self.design))

    def check_options(self, options: dict[str, Any]) -> None:
        """ValueError naming any option the design does not take."""
        unknown = [k for k in options if k not in _design_options(self.design)]
        if unknown:
            raise ValueError(f"{self.name} got unknown option(s) {unknown}; valid options: {self.design_options()}")

    def run_design(self, layout: VisualLayout, options: dict[str, Any]) -> DesignOutput:
        self.check_options(options)
        return self.design(layout, **options)

    def with_model_defaults(self, options: dict[str, Any], config: Any) -> dict[str, Any]:
        """``options`` followed by the defaults this design reads from a model's ``config`` for the options not given.

        Example:
            >>> from types import SimpleNamespace
            >>> config = SimpleNamespace(vision_config=SimpleNamespace(tokens_per_second=4))
            >>> get_multimodal_scheme("mrope_abs_time").with_model_defaults({}, config)
            {'tokens_per_second': 4.0}
        """
        check_instance(options, "options", dict, expected="a dict of design options")
        if self.model_defaults is None:
            return dict(options)
        defaults = self.model_defaults(config)
        return {**options, **{name: value for name, value in defaults.items() if name not in options}}

    def representatives(self, options: dict[str, Any]) -> Any:
        """K, the positions per token that ``options`` ask for (1 for designs without ``representatives_option``),
        as given: the design checks its value."""
        check_instance(options, "options", dict, expected="a dict of design options")
        return 1 if self.representatives_option is None else options.get(self.representatives_option, 1)


@cache
def _design_options(design: Callable[..., DesignOutput]) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(design).parameters if p != "layout")


MULTIMODAL_SCHEMES: dict[str, MultimodalScheme] = {
    s.name: s
    for s in (
        MultimodalScheme("mrope", mrope_design, "chunked", {"mrope_section": (16, 24, 24)}, "Qwen2-VL"),
        MultimodalScheme(
            "mrope_abs_time",
            mrope_abs_time_design,
            "chunked",
            {"mrope_section": (16, 24, 24)},
            "Qwen2.5-VL",
            call_inputs=("second_per_grid_ts",),
            model_defaults=mrope_abs_time_model_defaults,
        ),
        MultimodalScheme(
            "mrope_interleaved",
            mrope_interleaved_design,
            "interleaved",
            {"mrope_section": (24, 20, 20)},
            "Qwen3-VL / MRoPE-I",
        ),
        MultimodalScheme("mhrope", mrope_interleaved_design, "head", {}, "MHRoPE (Huang et al. 2026)"),
        MultimodalScheme("v2pe", v2pe_design, "single_axis", {}, "V2PE (Ge et al. 2025)"),
        MultimodalScheme("vrope", vrope_design, "vrope", {}, "VRoPE (Liu et al. 2025)"),
        MultimodalScheme("videorope", videorope_design, "lta", {"mrope_section": (16, 24, 24)}, "VideoRoPE"),
        MultimodalScheme("hope", hope_design, "hope", {"mrope_section": (16, 24, 24)}, "HoPE (Li et al. 2025)"),
        MultimodalScheme(
            "circle_rope",
            circle_rope_design,
            "chunked",
            {"mrope_section": (16, 24, 24)},
            "Circle-RoPE",
            layer_of=circle_rope_layer_of,
        ),
        MultimodalScheme("rope_dhr", rope_dhr_design, "single_axis", {}, "RoPE-DHR (CoMemo, Liu et al. 2025)"),
        MultimodalScheme(
            "bipe",
            bipe_design,
            "single_axis",
            {},
            "BiPE (He et al. 2024)",
            call_inputs=("input_ids",),
            advance_tokens=bipe_advance_tokens,
        ),
        MultimodalScheme(
            "ppe",
            ppe_design,
            "chunked",
            {"mrope_section": (16, 24, 24)},
            "PPE (Huang et al. 2026)",
            call_inputs=("clusters", "weights", "second_per_grid_ts"),
            representatives_option="num_representatives",
        ),
        MultimodalScheme("rope_1d", rope_1d_design, "single_axis", {}, "1-D RoPE (RoFormer, Su et al. 2024)"),
        MultimodalScheme("cca", cca_design, "single_axis", {}, "CCA (Xing et al. 2024)", block_mask=True),
        MultimodalScheme(
            "pype",
            pype_design,
            "single_axis",
            {},
            "PyPE (Chen et al. 2025)",
            layer_of=pype_layer_of,
            block_mask=True,
            required_options=("interval",),
        ),
    )
}


def list_multimodal_schemes() -> list[str]:
    """Sorted names accepted by :func:`~visionpe.multimodal.get_position_ids`.

    Example:
        >>> from visionpe.multimodal import list_multimodal_schemes
        >>> "mrope" in list_multimodal_schemes()
        True
    """
    return sorted(MULTIMODAL_SCHEMES)


def get_multimodal_scheme(name: str) -> MultimodalScheme:
    """The registry entry for ``name``; unknown names raise ValueError listing the valid ones."""
    check_instance(name, "scheme", str, expected="a str")
    if name not in MULTIMODAL_SCHEMES:
        raise ValueError(f"unknown multimodal scheme {name!r}; valid names: {', '.join(list_multimodal_schemes())}")
    return MULTIMODAL_SCHEMES[name]


# image models name this registry's designs in their refusals (visionpe.contract)
register_other_names(
    list_multimodal_schemes,
    "a multimodal design (positions of the text and image tokens of a vision-language model: visionpe.multimodal "
    "and the Hugging Face adapters)",
)
