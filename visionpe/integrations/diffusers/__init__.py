"""visionpe in diffusers' diffusion transformers: the model's rotary expressed in visionpe, the extrapolation modes
per axis (PI, NTK, YaRN, RIFLEx, DyPE) on top of it, and the way back.

    >>> from visionpe.integrations.diffusers import apply_position_scheme, remove_position_scheme
    >>> # transformer = FluxTransformer2DModel.from_pretrained(..., subfolder="transformer")
    >>> # apply_position_scheme(transformer)                  # identical outputs
    >>> # visionpe.set_extrapolation(transformer, "dype")    # DyPE at 2x the training side
    >>> # remove_position_scheme(transformer)                # the model's own rotary back

Needs diffusers (the ``diffusion`` extra: ``pip install -e ".[diffusion]"``).
"""

from __future__ import annotations

try:
    import diffusers  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        'visionpe.integrations.diffusers needs the "diffusion" extra (diffusers is missing); from a clone of visionpe: '
        'pip install -e ".[diffusion]"'
    ) from error

from . import (
    flux,  # noqa: F401  (registers the family)
    qwenimage,  # noqa: F401  (registers the family)
)
from .cogvideox import COGVIDEOX  # noqa: F401  (registers the family)
from .hunyuan_video import HUNYUAN_VIDEO  # noqa: F401  (registers the family)
from .patch import (
    DIFFUSERS_FAMILIES,
    DiffusionFamily,
    PatchReport,
    apply_position_scheme,
    find_diffusers_family,
    patched_rotary,
    remove_position_scheme,
)
from .rotary import DYPE_METHODS, DiffusionRotary, dype_frequencies, rope_frequencies
from .tables import PIXART, SD3  # noqa: F401  (registers the families)
from .wan import WAN  # noqa: F401  (registers the family)

__all__ = [
    "DIFFUSERS_FAMILIES",
    "DYPE_METHODS",
    "DiffusionFamily",
    "DiffusionRotary",
    "PatchReport",
    "apply_position_scheme",
    "dype_frequencies",
    "find_diffusers_family",
    "patched_rotary",
    "remove_position_scheme",
    "rope_frequencies",
]
