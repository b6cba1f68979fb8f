"""The transformers releases the Hugging Face adapters support, checked when they patch a model.

The adapters replace transformers methods by name and call the originals with transformers' own arguments, so they
depend on interfaces that changed between releases: Qwen-VL's ``get_rope_index`` reads the visual layout from
``mm_token_type_ids`` and is reached through ``compute_3d_position_ids`` (``forward``) and
``_prepare_position_ids_for_generation`` (``generate``); the cache argument is ``cache`` (``past_key_values`` is a
deprecated alias); a vision tower computes its patches' (h, w) with ``transformers.vision_utils`` and passes them to
``rotary_pos_emb(hidden_states, position_ids)`` (the towers' older ``rot_pos_emb(grid_thw)`` built the tables from
the grid instead). On another interface a patch would be bypassed or fed the wrong arguments, and the model would run
with wrong position ids without an error, so :func:`check_transformers` (the version against the ``vlm`` extra's
floor in pyproject.toml) and :func:`require_interface` (each method and argument an adapter relies on) run before
anything is patched. :func:`visionpe.integrations.hf.audit.audit_position_ids` is the check of the ids themselves.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import transformers
from packaging.version import InvalidVersion, Version

__all__ = ["TRANSFORMERS_MIN", "INSTALL", "UnsupportedTransformersError", "check_transformers", "require_interface"]

# The oldest transformers the adapters are tested with: the floor of the vlm extra in pyproject.toml (a test keeps the
# two equal). Releases before it build Qwen-VL's position ids from input_ids, without mm_token_type_ids.
TRANSFORMERS_MIN = "5.25.0"
INSTALL = f'from a clone of visionpe: pip install -e ".[vlm]" (or pip install -U "transformers>={TRANSFORMERS_MIN}")'


class UnsupportedTransformersError(ImportError):
    """The installed transformers is older than the adapters support, or lacks an interface they patch."""


def check_transformers(feature: str, version: str | None = None) -> None:
    """Raise :class:`UnsupportedTransformersError` when the installed transformers (or ``version``) is older than
    :data:`TRANSFORMERS_MIN`; the message names ``feature``, the installed version, the supported range and the
    install command."""
    installed = transformers.__version__ if version is None else version
    try:
        supported = Version(installed) >= Version(TRANSFORMERS_MIN)
    except InvalidVersion:
        supported = False
    if not supported:
        raise UnsupportedTransformersError(
            f"{feature} supports transformers>={TRANSFORMERS_MIN}, but transformers {installed} is installed; "
            f"upgrade it, {INSTALL}"
        )


def require_interface(feature: str, owner: Any, method: str, parameters: Sequence[str] = ()) -> None:
    """Raise :class:`UnsupportedTransformersError` unless ``owner`` (a class, module or object) has ``method`` and
    the callable's signature names every one of ``parameters`` (a ``**kwargs`` would swallow a missing one
    silently, so it does not count)."""
    name = getattr(owner, "__name__", type(owner).__name__)
    found = getattr(owner, method, None)
    missing: list[str] = []
    if callable(found):
        try:
            signature = inspect.signature(found)
        except (TypeError, ValueError):  # a callable without a signature: only its presence can be checked
            signature = None
        if signature is not None:
            missing = [p for p in parameters if p not in signature.parameters]
    if found is None or not callable(found) or missing:
        what = f"no {method}" if found is None or not callable(found) else f"a {method} without {', '.join(missing)}"
        raise UnsupportedTransformersError(
            f"{feature} patches {name}.{method}{'(' + ', '.join(parameters) + ')' if parameters else ''}, but "
            f"transformers {transformers.__version__} has {what}: its position code differs from the interface "
            f"this adapter is written for (transformers>={TRANSFORMERS_MIN}), and running the model would give "
            f"wrong position ids; install a supported transformers, {INSTALL}"
        )
