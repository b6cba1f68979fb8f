"""The timm ViT with pluggable position encodings, and state-dict conversion."""

from .official import (
    convert_irpe_state_dict,
    convert_liere_state_dict,
    convert_lookhere_state_dict,
    convert_rope_vit_state_dict,
    lookhere_scheme_kwargs,
)

__all__ = [
    "convert_irpe_state_dict",
    "convert_liere_state_dict",
    "convert_lookhere_state_dict",
    "convert_rope_vit_state_dict",
    "lookhere_scheme_kwargs",
]
