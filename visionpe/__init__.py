"""visionpe: position encodings for vision and vision-language transformers.

``import visionpe`` registers ``visionpe_vit_{tiny,small,base,large}_patch16_224`` with timm and makes the
subpackages of ``__all__`` available (``visionpe.multimodal.get_position_ids`` after a plain ``import visionpe``);
like the rest of the core they need torch and timm only.
"""

from . import absolute, bias, camera, grid, multimodal, rotary  # noqa: F401  (registers the schemes)
from .attention import PosAttention, PosBlock, PositionContext, set_attention_backend, set_rotary_backend
from .base import (
    AbsolutePositionEncoding,
    BiasPositionEncoding,
    PositionEncoding,
    RotaryPositionEncoding,
    set_coord_augment,
)
from .bias.irpe import irpe_piecewise_index
from .grid import CoordAugment
from .integrations import timm as _timm_models  # noqa: F401  (registers the timm models)
from .interfaces.rotary import LayerRotation, RotaryState
from .models.convert import LoadReport, convert_timm_state_dict, load_timm_state_dict
from .models.vit import VisionPEViT
from .parallel import SEQUENCE_PARALLEL_ENTRY as _SEQUENCE_PARALLEL  # noqa: F401  (after the models' entry points)
from .registry import create_pos_embed, list_schemes, register_scheme
from .rotary.harope import fold_harope_
from .rotary.scaling import set_extrapolation
from .rotary.string_base import fold_string_

__version__ = "0.1.0"

__all__ = [
    "grid",
    "camera",
    "multimodal",
    "list_schemes",
    "create_pos_embed",
    "register_scheme",
    "VisionPEViT",
    "PosAttention",
    "PosBlock",
    "PositionContext",
    "PositionEncoding",
    "AbsolutePositionEncoding",
    "RotaryPositionEncoding",
    "BiasPositionEncoding",
    "RotaryState",
    "LayerRotation",
    "LoadReport",
    "convert_timm_state_dict",
    "load_timm_state_dict",
    "set_extrapolation",
    "set_attention_backend",
    "set_rotary_backend",
    "CoordAugment",
    "set_coord_augment",
    "fold_string_",
    "fold_harope_",
    "irpe_piecewise_index",
]
