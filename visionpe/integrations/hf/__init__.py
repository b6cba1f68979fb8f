"""Hugging Face transformers integration: run a transformers VLM with any visionpe multimodal scheme.

:func:`apply_position_scheme` patches a model in place and :func:`remove_position_scheme` undoes it; both pick the
adapter of the model's family by its class:

- :mod:`visionpe.integrations.hf.qwen`: Qwen2-VL, Qwen2.5-VL and Qwen3-VL (M-RoPE language models, 3-row ids);
- :mod:`visionpe.integrations.hf.llava`: LLaVA, LLaVA-OneVision and InternVL, whose language models use 1-D RoPE
  (``"rope_1d"`` is their own scheme).

``SUPPORTED_MODELS`` maps every supported inner model class to its transformers module; ``QWEN_MODELS`` and
``ROPE_1D_MODELS`` are the two adapters' tables. All three are read from the family table
(:data:`visionpe.integrations.hf.families.FAMILIES`), which says for each model where its ids, rotary and attention
live and which of its methods the adapters replace (per instance: transformers' modules are never patched).


Beside the language model's positions: :mod:`visionpe.integrations.hf.collate` builds the positions of every family
and design in the data loader's workers (:class:`VLMPositionCollator`; the patched model takes them as given),
:mod:`visionpe.integrations.hf.packing` packs Qwen-VL samples into one row for varlen training
(:class:`QwenVLPackingCollator`), and :mod:`visionpe.integrations.hf.vision_tower` swaps or
scales the 2D RoPE of the Qwen-VL vision encoders (:func:`apply_vision_rope`).

Needs the ``vlm`` extra (from a clone: ``pip install -e ".[vlm]"``, transformers); importing this package without it
raises an ImportError that says so. ``import visionpe`` never imports it.
"""

from __future__ import annotations

from typing import Any

try:
    import transformers  # noqa: F401  (the model classes are imported from it by name)
except ImportError as err:
    raise ImportError(
        'visionpe.integrations.hf needs the "vlm" extra (transformers is missing); from a clone of visionpe: '
        'pip install -e ".[vlm]"'
    ) from err

from torch import nn

from . import llava, qwen
from .audit import PositionIdsAudit, audit_position_ids
from .collate import VLMPositionCollator
from .families import FAMILIES, find_model, models_of, outer_name
from .packing import QwenVLPackingCollator, check_packable, pack_qwen_vl_features
from .vision_tower import (
    VisionTowerRotary,
    apply_vision_rope,
    own_vision_rope_options,
    remove_vision_rope,
    vision_tower,
)

__all__ = [
    "apply_position_scheme",
    "remove_position_scheme",
    "audit_position_ids",
    "PositionIdsAudit",
    "SUPPORTED_MODELS",
    "QWEN_MODELS",
    "ROPE_1D_MODELS",
    "QwenVLPackingCollator",
    "VLMPositionCollator",
    "check_packable",
    "pack_qwen_vl_features",
    "VisionTowerRotary",
    "apply_vision_rope",
    "own_vision_rope_options",
    "remove_vision_rope",
    "vision_tower",
]

QWEN_MODELS = models_of(qwen.ADAPTER)
ROPE_1D_MODELS = models_of(llava.ADAPTER)
# inner model class name -> transformers module, for every model either adapter supports (the family table's rows)
SUPPORTED_MODELS = models_of()
_ADAPTERS = {qwen.ADAPTER: qwen, llava.ADAPTER: llava}


def _adapter(model: Any):
    """The adapter module for ``model``'s class (its family's); TypeError listing every supported class otherwise."""
    found = find_model(model, SUPPORTED_MODELS)
    if found is not None:
        return _ADAPTERS[FAMILIES[found[1]].adapter]
    supported = ", ".join(f"{name} (or {outer_name(name)})" for name in SUPPORTED_MODELS)
    raise TypeError(f"apply_position_scheme supports {supported}; got {type(model).__name__}")


def apply_position_scheme(model: nn.Module, scheme: str, **kwargs: Any) -> nn.Module:
    """Make a supported transformers VLM use the visionpe multimodal scheme ``scheme``, in place.

    Dispatches by class to :func:`visionpe.integrations.hf.qwen.apply_position_scheme` (Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL) or :func:`visionpe.integrations.hf.llava.apply_position_scheme` (LLaVA, LLaVA-OneVision, InternVL);
    see those for the options each takes.

    Args:
        model: a model of ``SUPPORTED_MODELS`` (its ``*ForConditionalGeneration`` or inner ``*Model``).
        scheme: a name from :func:`visionpe.multimodal.list_multimodal_schemes`.
        **kwargs: the scheme's design options and the allocation's ``mrope_section``.

    Returns:
        The same model.

    Raises:
        TypeError: for a model of no supported class (the message lists them).

    Example:
        >>> from visionpe.integrations.hf import apply_position_scheme
        >>> model = apply_position_scheme(model, "v2pe", delta=0.25)  # doctest: +SKIP
    """
    return _adapter(model).apply_position_scheme(model, scheme, **kwargs)


def remove_position_scheme(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_position_scheme`, in place (a model that is not patched is returned unchanged).

    Args:
        model: a model of ``SUPPORTED_MODELS``.

    Returns:
        The same model.

    Raises:
        TypeError: for a model of no supported class.
    """
    return _adapter(model).remove_position_scheme(model)
