"""Hugging Face transformers integration: run a transformers VLM with any visionpe multimodal scheme.

:func:`apply_position_scheme` patches a model in place and :func:`remove_position_scheme` undoes it. Each model
family has its own module: :mod:`visionpe.integrations.hf.qwen` for Qwen2-VL, Qwen2.5-VL and Qwen3-VL (M-RoPE
language models).

Needs the ``vlm`` extra (``pip install "visionpe[vlm]"``, transformers); importing this package without it raises an
ImportError that says so. ``import visionpe`` never imports it.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401  (the model classes are imported from it by name)
except ImportError as err:
    raise ImportError(
        'visionpe.integrations.hf needs the "vlm" extra (transformers is missing): pip install "visionpe[vlm]"'
    ) from err

from .qwen import SUPPORTED_MODELS, apply_position_scheme, remove_position_scheme

__all__ = ["apply_position_scheme", "remove_position_scheme", "SUPPORTED_MODELS"]
