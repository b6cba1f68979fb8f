"""Load a vanilla timm ViT state dict into a visionpe ViT with any position scheme."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from timm.layers import resample_abs_pos_embed
from torch import nn

from ..checks import check_bool

__all__ = ["LoadReport", "convert_timm_state_dict", "load_timm_state_dict"]


@dataclass
class LoadReport:
    """What :func:`load_timm_state_dict` did: keys kept at init (``added``), ignored (``dropped``), resampled."""

    added: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    resampled: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"added (kept init): {self.added}\ndropped: {self.dropped}\nresampled: {self.resampled}"


def convert_timm_state_dict(
    state_dict: Mapping[str, torch.Tensor], model: nn.Module
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Map a timm ``VisionTransformer`` state dict onto ``model`` (a :class:`VisionPEViT`).

    Weights whose name and shape match are kept. The absolute table ``pos_embed`` goes to the model's
    ``learned`` scheme, resampled to its grid (prefix rows kept or dropped to match), or is dropped when the
    model has no learned table. A visionpe checkpoint's own table (``pos_schemes.learned.pos_embed``) from
    another grid, e.g. trained at 224 and loaded into a model built for 384, is resampled the same way, and so is
    any grid-shaped parameter of a scheme that resamples it (``resample_table``, e.g. LOOPE's context).
    Returns the new state dict and a report.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    if not hasattr(model, "pos_schemes"):
        raise TypeError(f"model must be a visionpe VisionPEViT, got {type(model).__name__}")
    state_dict = tensors_by_name(state_dict)
    target = model.state_dict()
    out, report = {}, LoadReport()
    new_key = "pos_schemes.learned.pos_embed"
    table = target.get(new_key)
    for key, value in state_dict.items():
        if table is not None and (key == "pos_embed" or (key == new_key and value.shape != table.shape)):
            if value.ndim != 3 or value.shape[0] != 1 or value.shape[2] != table.shape[2]:
                report.dropped.append(f"{key} (shape {tuple(value.shape)} cannot fill {new_key} {tuple(table.shape)})")
                continue
            learned = model.pos_schemes["learned"]
            num_src_prefix, src_grid = _infer_grid(value.shape[1], model.num_prefix_tokens)
            prefix, patches = value[:, :num_src_prefix], value[:, num_src_prefix:]
            if src_grid != learned.grid_size:
                patches = resample_abs_pos_embed(
                    patches,
                    new_size=list(learned.grid_size),
                    old_size=list(src_grid),
                    num_prefix_tokens=0,
                    interpolation=learned.interpolation,
                    antialias=learned.antialias,
                )
                report.resampled.append(f"{key} -> {new_key} ({src_grid} -> {learned.grid_size})")
            prefix = prefix[:, : learned.num_embed_prefix]
            if prefix.shape[1] < learned.num_embed_prefix:  # e.g. registers the source model did not have
                prefix = torch.cat([prefix, table[:, prefix.shape[1] : learned.num_embed_prefix]], 1)
            out[new_key] = torch.cat([prefix, patches], dim=1)
        elif key in target and target[key].shape == value.shape:
            out[key] = value
        elif key in target and (resampled := _resample_scheme_table(model, key, value)) is not None:
            out[key] = resampled
            report.resampled.append(f"{key} ({tuple(value.shape)} -> {tuple(resampled.shape)})")
        else:
            reason = (
                "not in model" if key not in target else f"shape {tuple(value.shape)} != {tuple(target[key].shape)}"
            )
            report.dropped.append(f"{key} ({reason})")
    report.added = [k for k in target if k not in out]
    return out, report


def tensors_by_name(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` checked to map names to tensors, with a DistributedDataParallel ``module.`` prefix removed;
    TypeError naming the first key or value that is not a name or a tensor."""
    out = {}
    for key, value in state_dict.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise TypeError(
                f"state_dict must map names to tensors, got {type(value).__name__} at key {key!r}"
                if isinstance(key, str)
                else f"state_dict keys must be parameter names (str), got {key!r}"
            )
        out[key.removeprefix("module.")] = value
    return out


def load_timm_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> LoadReport:
    """Load a vanilla timm ViT ``state_dict`` into ``model``; new position parameters keep their init.

    With ``strict`` (default), a state dict that fills nothing of the model (no tensor matched: another
    architecture, an empty dict) or one whose tensors disagree in shape with the model's (a ViT-B state dict into a
    ViT-Ti) raises ValueError naming the keys; the classifier (``head``) alone may differ, as timm drops a classifier
    of another ``num_classes``. ``strict=False`` loads what matches and reports the rest, as before. The report
    lists the keys kept at init (``added``), ignored (``dropped``) and resampled either way.

    Example:
        >>> import timm, visionpe
        >>> src = timm.create_model("vit_tiny_patch16_224", num_classes=10)
        >>> dst = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="rope_mixed", num_classes=10)
        >>> report = visionpe.load_timm_state_dict(dst, src.state_dict())
        >>> report.added, [d.split()[0] for d in report.dropped]
        (['pos_schemes.rope_mixed.freqs'], ['pos_embed'])
    """
    check_bool(strict, "strict")
    new_state, report = convert_timm_state_dict(state_dict, model)
    if strict:
        classifier = str(getattr(model, "pretrained_cfg", {}).get("classifier", "head"))
        mismatched = [d for d in report.dropped if "not in model" not in d and not d.startswith(f"{classifier}.")]
        if not new_state:
            raise ValueError(
                f"state_dict fills no tensor of {type(model).__name__}: none of its {len(state_dict)} keys matched a "
                f"parameter by name and shape (dropped: {report.dropped[:5]}{' ...' if len(report.dropped) > 5 else ''}"
                "); pass strict=False to load it anyway"
            )
        if mismatched:
            raise ValueError(
                f"state_dict disagrees with {type(model).__name__} in shape at {len(mismatched)} key(s), e.g. "
                f"{mismatched[:3]}: it was saved for another model size; pass strict=False to load the rest anyway"
            )
    model.load_state_dict(new_state, strict=False)
    return report


def _resample_scheme_table(model: nn.Module, key: str, value: torch.Tensor) -> torch.Tensor | None:
    """A scheme's own grid-shaped parameter from a checkpoint of another grid (``pos_schemes.<name>.<param>``),
    resampled by the scheme's ``resample_table(param, value)`` (LOOPE's X_C), or None when it has none."""
    parts = key.split(".")
    if len(parts) != 3 or parts[0] != "pos_schemes" or parts[1] not in model.pos_schemes:
        return None
    resample = getattr(model.pos_schemes[parts[1]], "resample_table", None)
    return None if resample is None else resample(parts[2], value)


def _infer_grid(num_rows: int, num_prefix_tokens: int) -> tuple[int, tuple[int, int]]:
    """(prefix rows, square patch grid) of a timm table: the first of P, P - 1, ..., 0 prefix rows that leaves a
    perfect square, then up to 8 (registers the source model had and the target lacks)."""
    for prefix in [*range(num_prefix_tokens, -1, -1), *range(num_prefix_tokens + 1, 9)]:
        side = math.isqrt(max(num_rows - prefix, 0))
        if side and side * side == num_rows - prefix:
            return prefix, (side, side)
    raise ValueError(f"cannot infer the grid of a pos_embed with {num_rows} rows (not square after prefix rows)")
