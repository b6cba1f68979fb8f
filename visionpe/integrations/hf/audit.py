"""Audit a Qwen-VL model's position ids: transformers' own ids against visionpe's reference for the model's scheme.

transformers computes a Qwen-VL model's multimodal position ids (M-RoPE, Wang et al., "Qwen2-VL", arXiv 2409.12191,
2024) in Python code that has changed between releases: the text after a video continued at the largest id plus one
in the original Qwen2-VL code and continues at the block start plus its spatial extent in transformers 5.x, Qwen2.5-VL
time ids moved from float64 to the dtype of ``second_per_grid_ts``, Qwen3-VL splits videos into frames. A model
trained with one rule and run with another sees shifted positions without any error. :func:`audit_position_ids`
runs the installed transformers' own code paths on a batch and compares every id with visionpe's reference ids for
the model's scheme (:func:`~visionpe.multimodal.get_position_ids`), so that a changed rule shows up as a first
differing id.

What is compared, on the valid tokens (``attention_mask`` 1; padded slots hold no position the model uses):

- ``forward``: the ids of ``compute_3d_position_ids`` (the model's ``forward`` without ``position_ids``: its
  ``get_rope_index``) for the prompt, then for each of ``decode_steps`` cached decoding steps the ids it makes from the
  stored ``rope_deltas``;
- ``generate`` (a ``*ForConditionalGeneration``): the ids of ``_prepare_position_ids_for_generation`` (what
  ``generate`` computes once for the prompt) and those ``_update_model_kwargs_for_generation`` appends for each
  decoding step.

The reference is visionpe's scheme with transformers 5.x's rules: Qwen2-VL ``mrope`` and Qwen2.5-VL
``mrope_abs_time`` (``tokens_per_second`` from ``vision_config``; ``second_per_grid_ts`` from the inputs, 1 per video
without it, as transformers) with ``continuation="spatial_extent"``; Qwen3-VL ``mrope_interleaved`` on videos split
into single frames. A decoding step k (from 0) of a sample with n valid prompt tokens sits at n + k + delta on every
row, delta being the reference's ``rope_deltas``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from torch import nn

from ...checks import check_instance, check_int, check_tensor, describe
from ...multimodal.ids import get_position_ids
from ...multimodal.registry import get_multimodal_scheme
from .adapter import _HFRotary
from .families import find_family
from .layers import split_video_frames
from .qwen import ADAPTER

__all__ = ["PositionIdsAudit", "audit_position_ids"]

ROWS = ("t", "h", "w")
PATHS = ("forward", "generate")


@dataclass(frozen=True)
class PositionIdsAudit:
    """What :func:`audit_position_ids` compared and, unless ``equal``, the first difference.

    Attributes:
        equal: True when every compared id equals the reference.
        model: the class of the audited inner model (``Qwen2VLModel``...).
        transformers_version: the installed transformers' version.
        scheme: the visionpe reference scheme; ``options`` its options (``second_per_grid_ts`` aside).
        paths: the code paths compared (``forward``, and ``generate`` for a ``*ForConditionalGeneration``).
        decode_steps: decoding steps compared after the prompt on each path.
        compared: ids compared (valid prompt tokens and decoding steps, times the three rows, on every path).
        path, sample, row, token: where the first difference is (path order, then sample, token, row): ``row`` 0, 1, 2
            for t, h, w and ``token`` the index in the sequence (``token >= prompt_length``: decoding step
            ``token - prompt_length``); None when equal.
        transformers_value, visionpe_value: the two ids there.
        prompt_length: L, the prompt's padded length.
    """

    equal: bool
    model: str
    transformers_version: str
    scheme: str
    options: dict[str, Any] = field(default_factory=dict)
    paths: tuple[str, ...] = ()
    decode_steps: int = 1
    compared: int = 0
    prompt_length: int = 0
    path: str | None = None
    sample: int | None = None
    row: int | None = None
    token: int | None = None
    transformers_value: float | None = None
    visionpe_value: float | None = None

    def __str__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        what = (
            f"{self.model} position ids from transformers {self.transformers_version} ({' and '.join(self.paths)} "
            f"paths: the prompt's valid tokens and {self.decode_steps} decoding step(s), {self.compared} ids) against "
            f"visionpe's {self.scheme!r} ({options})"
        )
        if self.equal:
            return f"equal: {what}"
        where = f"token {self.token}"
        if self.token is not None and self.token >= self.prompt_length:
            where += f" (decoding step {self.token - self.prompt_length})"
        return (
            f"DIFFERENT: {what}; first difference on the {self.path} path, sample {self.sample}, row "
            f"{ROWS[self.row]} ({self.row}), {where}: transformers {_number(self.transformers_value)}, "
            f"visionpe {_number(self.visionpe_value)}"
        )


def _number(value: float | None) -> str:
    return "None" if value is None else repr(int(value)) if float(value).is_integer() else repr(value)


class _CacheLength:
    """Stands in for a KV cache holding ``length`` tokens (the position code reads only its length)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def get_seq_length(self, *_: Any) -> int:
        return self.length


def _checked_inputs(inputs: Any) -> dict[str, Any]:
    check_instance(
        inputs, "inputs", Mapping, expected="a mapping of model inputs (the processor's output: input_ids, ...)"
    )
    ids = inputs.get("input_ids")
    if ids is None:
        raise ValueError("inputs['input_ids'] is required: the audit runs transformers' code on the prompt's ids")
    check_tensor(ids, "inputs['input_ids']", dtype="integer", expected="a (B, L) integer tensor")
    if ids.ndim != 2 or 0 in ids.shape:
        raise ValueError(f"inputs['input_ids'] must be a non-empty (B, L) tensor, got shape {tuple(ids.shape)}")
    shape = tuple(ids.shape)
    types = inputs.get("mm_token_type_ids")
    if types is None:
        raise ValueError(
            "inputs['mm_token_type_ids'] is required (0 text, 1 image, 2 video, as the processor returns it): "
            "without it transformers computes no multimodal ids at all"
        )
    for name, allowed in (("mm_token_type_ids", (0, 1, 2)), ("attention_mask", (0, 1))):
        value = inputs.get(name)
        if value is None:
            continue
        check_tensor(value, f"inputs[{name!r}]", dtype="integer", expected=f"an integer tensor of shape {shape}")
        if tuple(value.shape) != shape:
            raise ValueError(f"inputs[{name!r}] must have the shape of input_ids {shape}, got {tuple(value.shape)}")
        if not torch.isin(value, torch.tensor(allowed, device=value.device)).all():
            raise ValueError(f"inputs[{name!r}] must hold only {allowed}, got {sorted(value.unique().tolist())}")
    grids = [name for name in ("image_grid_thw", "video_grid_thw") if inputs.get(name) is not None]
    if not grids:
        raise ValueError(
            "inputs['image_grid_thw'] or inputs['video_grid_thw'] is required: without visual inputs transformers "
            "computes no multimodal ids (the model falls back to 1-D text positions), so there is nothing to audit"
        )
    for name in grids:
        grid = check_tensor(inputs[name], f"inputs[{name!r}]", dtype="integer", expected="an (N, 3) integer tensor")
        if grid.ndim != 2 or grid.shape[1] != 3:
            raise ValueError(f"inputs[{name!r}] must be (N, 3) rows (t, h, w), got shape {tuple(grid.shape)}")
    return dict(inputs)


def _first_difference(ours: torch.Tensor, theirs: torch.Tensor, compared: torch.Tensor):
    """(sample, token, row) of the first compared slot where the (3, B, T) ids differ, else None."""
    differ = (ours.double() != theirs.double()) & compared.unsqueeze(0)
    where = differ.permute(1, 2, 0).nonzero()  # (sample, token, row), lexicographic
    return None if where.numel() == 0 else tuple(int(i) for i in where[0])


def audit_position_ids(model: nn.Module, inputs: Mapping[str, Any], *, decode_steps: int = 1) -> PositionIdsAudit:
    """Compare an unpatched Qwen-VL model's own position ids with visionpe's reference ids for its scheme.

    Runs the installed transformers' code (no forward pass: only the position code) on ``inputs`` and compares the
    ids of the prompt and of ``decode_steps`` decoding steps, on the ``forward`` path and, for a
    ``*ForConditionalGeneration``, the ``generate`` path (see the module docstring for what each covers and for the
    reference). Its purpose is to detect position rules that change across transformers versions, before a model
    runs on ids other than those it was trained with.

    Args:
        model: a ``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration`` or
            ``Qwen3VLForConditionalGeneration`` (both paths) or its inner ``*Model`` (``forward`` only), not patched
            by :func:`~visionpe.integrations.hf.apply_position_scheme` (the audit is about transformers' own ids).
        inputs: the processor's output: ``input_ids`` and ``mm_token_type_ids`` (B, L), ``attention_mask`` (left or
            right padding), ``image_grid_thw`` and/or ``video_grid_thw``, and for Qwen2.5-VL videos
            ``second_per_grid_ts``. Pixel values are not needed (nor read).
        decode_steps: decoding steps to compare after the prompt (positive int).

    Returns:
        A :class:`PositionIdsAudit`; ``str()`` of it says what was compared and where the first difference is.
        The model is left as it was (its cached ``rope_deltas`` are restored).

    Raises:
        TypeError, ValueError: naming the argument, for a model that is not a supported Qwen-VL model or is
            patched, inputs that are not a mapping or miss ``input_ids``, ``mm_token_type_ids`` or a grid, tensors
            of the wrong dtype, shape or values, or a bad ``decode_steps``.

    Example:
        >>> audit = audit_position_ids(model, processor(text=..., images=..., return_tensors="pt"))  # doctest: +SKIP
        >>> assert audit.equal, str(audit)  # doctest: +SKIP
    """
    try:
        vl_model, family = find_family(model, ADAPTER)
    except TypeError as err:
        raise TypeError(
            f"model must be a Qwen2-VL, Qwen2.5-VL or Qwen3-VL model (a *ForConditionalGeneration or its inner "
            f"*Model), got {describe(model)}"
        ) from err
    patched_ids = getattr(vars(vl_model).get("get_rope_index"), "visionpe_patch", False)
    if isinstance(vl_model.language_model.rotary_emb, _HFRotary) or patched_ids:
        raise ValueError(
            f"model is patched (visionpe scheme {getattr(vl_model, 'visionpe_scheme', None)!r}): the audit compares "
            "transformers' own position ids; audit the model before apply_position_scheme or after "
            "remove_position_scheme"
        )
    check_int(decode_steps, "decode_steps", min=1)
    inputs = _checked_inputs(inputs)
    ids, types = inputs["input_ids"], inputs["mm_token_type_ids"]
    mask = inputs.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(ids)
    batch, length = ids.shape
    image_grid, video_grid = inputs.get("image_grid_thw"), inputs.get("video_grid_thw")
    spg = inputs.get("second_per_grid_ts")
    merge = int(getattr(vl_model.config.vision_config, family.merge_size))

    # visionpe's reference for the model's own scheme (its family's), with transformers 5.x's rules
    scheme = family.own_scheme
    entry = get_multimodal_scheme(scheme)
    options = entry.with_model_defaults({"continuation": "spatial_extent"}, vl_model.config)
    per_call: dict[str, Any] = {}
    if video_grid is not None and "second_per_grid_ts" in entry.call_inputs:  # Qwen2.5-VL: 1 without timing
        per_call["second_per_grid_ts"] = spg if spg is not None else [1.0] * len(video_grid)
    ref_video = video_grid
    if family.split_videos and video_grid is not None:  # frames are single-frame blocks with timestamp text between
        ref_video = split_video_frames(video_grid)
    ref_pos, ref_delta = get_position_ids(
        scheme,
        types,
        image_grid,
        ref_video,
        mask,
        spatial_merge_size=merge,
        pad_value=0,
        delta_convention="valid",
        **options,
        **per_call,
    )
    steps = torch.arange(decode_steps, device=ref_pos.device)
    ref_next = mask.sum(1, keepdim=True).to(ref_delta.dtype) + ref_delta + steps  # (B, steps)
    reference = torch.cat([ref_pos, ref_next.unsqueeze(0).expand(3, -1, -1)], dim=-1)  # (3, B, L + steps)
    compared = torch.cat([mask.bool(), torch.ones(batch, decode_steps, dtype=torch.bool, device=mask.device)], 1)

    found: dict[str, torch.Tensor] = {}
    saved_deltas = vl_model.rope_deltas
    try:
        found["forward"] = _forward_path_ids(vl_model, inputs, mask, decode_steps)
        if model is not vl_model:
            found["generate"] = _generate_path_ids(model, inputs, mask, decode_steps)
    finally:
        vl_model.rope_deltas = saved_deltas

    common = dict(
        model=family.model,
        transformers_version=transformers.__version__,
        scheme=scheme,
        options=options,
        paths=tuple(found),
        decode_steps=decode_steps,
        compared=3 * int(compared.sum()) * len(found),
        prompt_length=length,
    )
    for path, theirs in found.items():
        first = _first_difference(reference, theirs.to(reference.device), compared.to(reference.device))
        if first is not None:
            sample, token, row = first
            return PositionIdsAudit(
                equal=False,
                path=path,
                sample=sample,
                row=row,
                token=token,
                transformers_value=theirs[row, sample, token].item(),
                visionpe_value=reference[row, sample, token].item(),
                **common,
            )
    return PositionIdsAudit(equal=True, **common)


def _call_with_accepted(method, **kwargs: Any) -> Any:
    """``method(**kwargs)`` with the keywords its signature takes (the Qwen families' signatures differ)."""
    params = inspect.signature(method).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return method(**kwargs)
    return method(**{k: v for k, v in kwargs.items() if k in params})


def _forward_path_ids(vl_model: nn.Module, inputs: dict[str, Any], mask: torch.Tensor, steps: int) -> torch.Tensor:
    """(3, B, L + steps): ``compute_3d_position_ids`` on the prompt, then on ``steps`` cached one-token steps."""
    ids = inputs["input_ids"]
    batch, length = ids.shape
    visual = {k: inputs.get(k) for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")}
    vl_model.rope_deltas = None
    prompt = _call_with_accepted(
        vl_model.compute_3d_position_ids,
        input_ids=ids,
        inputs_embeds=None,
        attention_mask=inputs.get("attention_mask"),
        cache=None,
        past_key_values=None,
        mm_token_type_ids=inputs["mm_token_type_ids"],
        **visual,
    )
    if prompt is None:
        raise ValueError(
            "transformers computed no multimodal position ids for these inputs (compute_3d_position_ids returned "
            "None: it needs input_ids, mm_token_type_ids and a grid)"
        )
    columns = [prompt]
    for step in range(steps):
        grown = torch.cat([mask, torch.ones(batch, step + 1, dtype=mask.dtype, device=mask.device)], dim=1)
        types = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(grown[:, : step + 1])], dim=1)
        cache = _CacheLength(length + step)
        columns.append(
            _call_with_accepted(
                vl_model.compute_3d_position_ids,
                input_ids=ids[:, -1:],
                inputs_embeds=torch.zeros(batch, 1, 1, device=ids.device),
                attention_mask=grown,
                cache=cache,
                past_key_values=cache,
                mm_token_type_ids=types,
                **visual,
            )[..., -1:]
        )
    return torch.cat(columns, dim=-1)


def _generate_path_ids(model: nn.Module, inputs: dict[str, Any], mask: torch.Tensor, steps: int) -> torch.Tensor:
    """(3, B, L + steps): the ids ``generate`` prepares for the prompt and appends at each decoding step."""
    model_kwargs = {k: v for k, v in inputs.items() if k != "input_ids"}  # generate's model_kwargs
    model_kwargs["attention_mask"] = mask
    prepared = model._prepare_position_ids_for_generation(inputs["input_ids"], dict(model_kwargs))
    state = {"position_ids": prepared, "attention_mask": mask, "mm_token_type_ids": inputs["mm_token_type_ids"]}
    for _ in range(steps):
        state = model._update_model_kwargs_for_generation({}, state, num_new_tokens=1)
    position_ids = state["position_ids"]
    # (4, B, T): text positions, then the three rows the language model's rotary takes
    return position_ids[-3:] if position_ids.ndim == 3 else position_ids.unsqueeze(0).expand(3, -1, -1)
