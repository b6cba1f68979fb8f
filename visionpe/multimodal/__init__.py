"""Multimodal (VLM) position ids and rotary frequency allocation.

Every scheme is a position design (token types, grids, timing -> ids; :func:`get_position_ids`) followed
by a frequency allocation (which pair or head reads which row; :class:`MultimodalRotary`), after Huang et al.,
"Revisiting Multimodal Positional Encoding in Vision-Language Models", ICLR 2026.
"""

from .allocation import ALLOCATIONS, Allocation, build_allocation
from .bipe import BiPESideIndex, bipe_side_index
from .cca import cca_attention_mask, concentric_levels
from .hope import sample_hope_scale
from .ids import get_position_ids
from .ppe_rotary import PPERotary
from .pype import pype_attention_mask, pype_num_levels
from .registry import MULTIMODAL_SCHEMES, MultimodalScheme, get_multimodal_scheme, list_multimodal_schemes
from .rotary import MultimodalRotary, apply_multimodal_rotary, rotate_half
from .v2pe import sample_v2pe_delta

__all__ = [
    "get_position_ids",
    "MultimodalRotary",
    "apply_multimodal_rotary",
    "rotate_half",
    "Allocation",
    "ALLOCATIONS",
    "build_allocation",
    "MultimodalScheme",
    "MULTIMODAL_SCHEMES",
    "get_multimodal_scheme",
    "list_multimodal_schemes",
    "sample_v2pe_delta",
    "sample_hope_scale",
    "bipe_side_index",
    "BiPESideIndex",
    "PPERotary",
    "cca_attention_mask",
    "concentric_levels",
    "pype_attention_mask",
    "pype_num_levels",
]
