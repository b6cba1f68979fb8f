"""Camera-aware position encodings for multi-view transformers.

:class:`Cameras` holds each view's world-to-camera pose and intrinsics; the schemes of this package
(``kind == "camera"``, ``visionpe.list_schemes("camera")``) read them. Relative schemes transform q, k and v inside
attention (:class:`RelativeCameraEncoding`), absolute ones add a 3D embedding to the tokens
(:class:`AbsoluteCameraEncoding`). One file per scheme; importing this package registers every scheme.
"""

import importlib as _importlib
import pkgutil as _pkgutil

from .base import (
    AbsoluteCameraEncoding,
    CameraPositionEncoding,
    CameraState,
    CameraTransform,
    QKVCameraTransform,
    RelativeCameraEncoding,
    view_blocks_matmul,
)
from .cameras import Cameras, invert_rigid, look_at, random_rigid

__all__ = [
    "Cameras",
    "look_at",
    "random_rigid",
    "invert_rigid",
    "CameraPositionEncoding",
    "RelativeCameraEncoding",
    "AbsoluteCameraEncoding",
    "CameraState",
    "CameraTransform",
    "QKVCameraTransform",
    "view_blocks_matmul",
]

for _module in _pkgutil.iter_modules(__path__):
    if _module.name not in ("base", "cameras"):
        _importlib.import_module(f"{__name__}.{_module.name}")
