"""Packed (padding-free) training batches for Qwen-VL models, with any visionpe multimodal scheme.

Packing concatenates several samples into one row of batch size 1 so that no compute goes to padding, as
transformers' ``DataCollatorWithFlattening`` does for text models. A Qwen-VL model (M-RoPE, Wang et al.,
"Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at Any Resolution", arXiv 2409.12191, 2024)
needs two kinds of positions for such a row, and transformers' Qwen2-VL, Qwen2.5-VL and Qwen3-VL text models take
them stacked as (4, 1, L) with ``attention_mask=None``:

- row 0, a plain arange restarting at 0 in every sample: transformers finds the samples from it (a new sample
  wherever it does not step by 1; for FlashAttention-2, wherever it equals its minimum) and builds a
  block-diagonal causal mask (SDPA, eager) or the varlen ``cu_seqlens`` (FlashAttention-2). It drives no rotation.
- rows 1-3, each sample's (t, h, w) ids from the scheme, restarted at 0: they drive the rotary. They cannot serve
  for the boundaries: t is constant across an image, so the mask would cut the image into one-token samples.

transformers looks for packed samples only when there is neither a 2-D attention mask nor a cache, and a model whose
config has ``use_cache=True`` (the released Qwen-VL configs) makes a cache in every forward, training included, so
the batch also says ``use_cache=False``: without it every sample would attend to the samples before it.

:func:`pack_qwen_vl_features` builds that row from processed samples and :class:`QwenVLPackingCollator` wraps it
as a ``collate_fn`` / ``data_collator``; the ids come from
:func:`~visionpe.multimodal.get_position_ids` with ``cu_seqlens`` (docs/packing.md). The model, patched by
:func:`~visionpe.integrations.hf.apply_position_scheme`, takes the ids as they are: with ``position_ids`` given,
neither transformers nor the adapter recompute them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ...checks import check_bool, check_instance, check_int
from ...multimodal.ids import get_position_ids
from ...multimodal.registry import get_multimodal_scheme
from .adapter import ROTARY_OPTIONS
from .families import find_family
from .qwen import ADAPTER

__all__ = ["pack_qwen_vl_features", "QwenVLPackingCollator", "check_packable"]

# visual model inputs, concatenated over the samples in order (patches along dim 0, one grid row per image/video)
_PROBED_LAYERS = 128  # more decoder layers than any released Qwen-VL model has (80)
_CONCATENATED = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def check_packable(scheme: str, options: Mapping[str, Any] | None = None) -> None:
    """ValueError unless one packed (4, 1, L) ``position_ids`` tensor with ``attention_mask=None`` expresses
    ``scheme`` with these design options.

    It cannot for a scheme that changes the causal mask inside visual blocks (registry entry ``block_mask``: CCA,
    PyPE): transformers builds the packed row's mask from row 0 alone, so the block rule would be dropped silently.
    Nor for ids that differ per decoder layer (``layer_of`` naming a layer other than 0 for some layer up to
    ``_PROBED_LAYERS``: PyPE, Circle-RoPE with ``age=True``): one tensor holds one set of ids.
    """
    entry = get_multimodal_scheme(scheme)
    options = dict(options or {})
    if getattr(entry, "block_mask", False):
        raise ValueError(
            f"scheme {scheme!r} changes the causal mask inside visual blocks, which a packed row cannot carry: "
            "transformers builds its mask from position_ids[0] alone (attention_mask=None); train it on padded "
            "batches"
        )
    layer_of = getattr(entry, "layer_of", None)
    if layer_of is not None:
        shared = [layer_of(layer, options) for layer in range(_PROBED_LAYERS)]
        if any(shared):
            raise ValueError(
                f"scheme {scheme!r} with options {options} gives decoder layer {shared.index(max(shared))} other ids "
                "than layer 0, but a packed row's position_ids hold one set of ids for every layer; train it on "
                "padded batches"
            )


def token_row(value: Any, name: str, index: int) -> torch.Tensor:
    """One sample's per-token entry as a 1-D int64 tensor: a list, a (L,) or a (1, L) tensor."""
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(
                f"features[{index}][{name!r}] must be a list of ints or an integer tensor, got {type(value).__name__}"
            ) from err
    if value.ndim == 2 and value.shape[0] == 1:
        value = value[0]
    if value.ndim != 1 or value.is_floating_point() or value.is_complex():
        raise ValueError(
            f"features[{index}][{name!r}] must be one sample's integer ids, shape (L,) or (1, L), got shape "
            f"{tuple(value.shape)} and dtype {value.dtype}"
        )
    return value.long()


def _tensor(value: Any, name: str, index: int) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"features[{index}][{name!r}] must be a tensor, got {type(value).__name__}") from err


def pack_qwen_vl_features(
    features: Sequence[Mapping[str, Any]],
    scheme: str = "mrope",
    *,
    spatial_merge_size: int = 2,
    split_video_frames: bool = False,
    ignore_index: int = -100,
    **scheme_options: Any,
) -> dict[str, Any]:
    """Pack processed Qwen-VL samples into one row that a (patched) Qwen-VL model takes for training.

    Args:
        features: one mapping per sample, as a Qwen-VL processor returns it for that sample alone: ``input_ids``
            (L,) or (1, L); ``mm_token_type_ids`` (0 text, 1 image, 2 video; required when the sample has visual
            inputs, zeros otherwise); optionally ``attention_mask`` (its padded tokens are dropped),
            ``labels`` (same length; default: ``input_ids`` with the visual placeholder tokens set to
            ``ignore_index``), ``pixel_values`` and ``image_grid_thw``, ``pixel_values_videos`` and
            ``video_grid_thw``, ``second_per_grid_ts`` (Qwen2.5-VL, one per video).
        scheme: the visionpe scheme the model was patched with (``model.visionpe_scheme``).
        spatial_merge_size: the vision tower's ``spatial_merge_size``.
        split_video_frames: True for Qwen3-VL, whose videos are one block per frame (with timestamp text between
            frames) in the position design while the vision tower takes the grids unsplit.
        ignore_index: label value the loss skips (-100 in transformers).
        **scheme_options: the scheme's design options, the same as given to ``apply_position_scheme`` (the model
            does not compute ids when they are given, so only these count in packed training). Per-sample options
            take one value per sample ((S,) or (S, K) tensors, e.g. V2PE's ``delta`` drawn per sample), per-token
            options the packed row's (1, L) shape.

    Returns:
        A dict of model inputs: ``input_ids``, ``mm_token_type_ids`` and ``labels`` (1, L); ``position_ids``
        (4, 1, L) (row 0 restarting arange, rows 1-3 the scheme's ids per sample from 0; float64 for fractional
        schemes); ``attention_mask`` None (a 2-D mask would switch off transformers' packed-sequence masking);
        ``use_cache`` False (transformers looks for packed samples only without a cache, and a model whose config
        has ``use_cache=True`` makes one in every forward, training included: the samples would see each other);
        the visual inputs present in any sample, concatenated in sample order. ``labels`` hold ``ignore_index`` at
        the first token of every sample: the model's shifted loss would otherwise predict it from the previous
        sample's last token. The boundaries are where ``position_ids[0]`` is 0. No ``cu_seqlens`` key is
        returned: Qwen-VL's vision tower would read it as its own.

    Raises:
        ValueError, TypeError: naming the feature and key for a malformed sample, or the argument for a bad
            option; ValueError when the scheme's ids have other than 3 rows (PPE with ``num_representatives`` > 1),
            which transformers' text models cannot take packed; ValueError for a scheme that
            :func:`check_packable` refuses (a mask inside visual blocks, or ids per decoder layer).
    """
    check_instance(features, "features", (list, tuple), expected="a list of per-sample feature mappings")
    if not features:
        raise ValueError("features must hold at least one sample, got an empty list")
    entry = get_multimodal_scheme(scheme)
    check_packable(scheme, scheme_options)
    check_int(spatial_merge_size, "spatial_merge_size", min=1)
    check_bool(split_video_frames, "split_video_frames")
    check_int(ignore_index, "ignore_index")
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in ("input_ids", "mm_token_type_ids", "labels")}
    visual: dict[str, list[torch.Tensor]] = {name: [] for name in _CONCATENATED}
    lengths = []
    for index, feature in enumerate(features):
        if not isinstance(feature, Mapping):
            raise TypeError(f"features[{index}] must be a mapping of model inputs, got {type(feature).__name__}")
        if "input_ids" not in feature:
            raise ValueError(f"features[{index}] has no 'input_ids'")
        ids = token_row(feature["input_ids"], "input_ids", index)
        has_visual = any(feature.get(name) is not None for name in _CONCATENATED)
        if feature.get("mm_token_type_ids") is None:
            if has_visual:
                raise ValueError(
                    f"features[{index}] has visual inputs but no 'mm_token_type_ids' (0 text, 1 image, 2 video), "
                    "which place its visual tokens; the processor returns them alongside input_ids"
                )
            types = torch.zeros_like(ids)
        else:
            types = token_row(feature["mm_token_type_ids"], "mm_token_type_ids", index)
        labels = None if feature.get("labels") is None else token_row(feature["labels"], "labels", index)
        keep = None
        if feature.get("attention_mask") is not None:
            keep = token_row(feature["attention_mask"], "attention_mask", index) != 0
        for name, value in (("mm_token_type_ids", types), ("labels", labels), ("attention_mask", keep)):
            if value is not None and value.shape != ids.shape:
                raise ValueError(
                    f"features[{index}][{name!r}] must have input_ids' length {ids.numel()}, got {value.numel()}"
                )
        if labels is None:
            labels = ids.masked_fill(types != 0, ignore_index)
        if keep is not None:
            ids, types, labels = ids[keep], types[keep], labels[keep]
        if ids.numel() == 0:
            raise ValueError(f"features[{index}] has no tokens; every packed sample needs at least one")
        labels = labels.clone()
        labels[0] = ignore_index
        rows["input_ids"].append(ids)
        rows["mm_token_type_ids"].append(types)
        rows["labels"].append(labels)
        lengths.append(ids.numel())
        for name in _CONCATENATED:
            if feature.get(name) is not None:
                visual[name].append(_tensor(feature[name], name, index))
    packed: dict[str, Any] = {name: torch.cat(values)[None] for name, values in rows.items()}
    for name, values in visual.items():
        if values:
            packed[name] = torch.cat(values)
    image_grid = packed.get("image_grid_thw")
    video_grid = packed.get("video_grid_thw")
    if split_video_frames and video_grid is not None:
        video_grid = torch.repeat_interleave(video_grid, video_grid[:, 0], dim=0)
        video_grid[:, 0] = 1
    options = dict(scheme_options)
    if "second_per_grid_ts" in entry.design_options() and packed.get("second_per_grid_ts") is not None:
        options.setdefault("second_per_grid_ts", packed["second_per_grid_ts"])
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
    position_ids, _ = get_position_ids(
        scheme,
        packed["mm_token_type_ids"],
        image_grid,
        video_grid,
        cu_seqlens=cu_seqlens,
        spatial_merge_size=spatial_merge_size,
        pad_value=0,
        **options,
    )
    if position_ids.shape[0] != 4:
        raise ValueError(
            f"scheme {scheme!r} with these options gives {position_ids.shape[0] - 1} rows of ids; transformers' "
            "Qwen-VL text models take packed ids as exactly 4 rows (row 0 for the sample boundaries, then t, h, w)"
        )
    packed["position_ids"] = position_ids
    packed["attention_mask"] = None
    packed["use_cache"] = False
    return packed


def _trial_run(scheme: str, options: dict[str, Any], spatial_merge_size: int) -> None:
    """Pack a text sample and a one-image sample once, so that bad option values fail when the collator is built."""
    merge = spatial_merge_size
    features = [
        {"input_ids": [5, 6]},
        {"input_ids": [5, 7, 5], "mm_token_type_ids": [0, 1, 0], "image_grid_thw": [[1, merge, merge]]},
    ]
    pack_qwen_vl_features(features, scheme, spatial_merge_size=merge, **options)


class QwenVLPackingCollator:
    """A data collator (``DataLoader(collate_fn=...)``, ``Trainer(data_collator=...)``) that packs each batch of
    processed Qwen-VL samples into one row with :func:`pack_qwen_vl_features`.

    Args:
        scheme, spatial_merge_size, split_video_frames, ignore_index, **scheme_options: as
            :func:`pack_qwen_vl_features`; checked here, so that a bad option fails before training starts.

    It holds plain settings only, so it pickles into ``DataLoader`` workers. :meth:`from_model` reads the settings
    from a patched model.

    Example:
        >>> collator = QwenVLPackingCollator("v2pe", delta=0.25)  # doctest: +SKIP
        >>> batch = collator([processor(text=..., images=...) for ...])  # doctest: +SKIP
        >>> loss = model(**batch).loss  # doctest: +SKIP
    """

    def __init__(
        self,
        scheme: str = "mrope",
        *,
        spatial_merge_size: int = 2,
        split_video_frames: bool = False,
        ignore_index: int = -100,
        **scheme_options: Any,
    ) -> None:
        entry = get_multimodal_scheme(scheme)
        entry.check_options(scheme_options)
        if "second_per_grid_ts" in scheme_options:
            raise ValueError(
                "second_per_grid_ts is per video: it comes with each sample's features (one value per video), not "
                "as a collator option"
            )
        check_int(spatial_merge_size, "spatial_merge_size", min=1)
        check_bool(split_video_frames, "split_video_frames")
        check_int(ignore_index, "ignore_index")
        _trial_run(scheme, scheme_options, spatial_merge_size)
        self.scheme = scheme
        self.spatial_merge_size = spatial_merge_size
        self.split_video_frames = split_video_frames
        self.ignore_index = ignore_index
        self.scheme_options = dict(scheme_options)

    @classmethod
    def from_model(cls, model: nn.Module, *, ignore_index: int = -100, **scheme_options: Any) -> QwenVLPackingCollator:
        """A collator for ``model``, patched by :func:`~visionpe.integrations.hf.apply_position_scheme`.

        The scheme is ``model.visionpe_scheme``; ``spatial_merge_size`` comes from the vision config, the frame
        split from the model family (Qwen3-VL) and, for ``mrope_abs_time``, ``tokens_per_second`` from the vision
        config unless given, as the adapter does. Pass the same options as to ``apply_position_scheme``
        (``mrope_section``, an option of the rotary, is ignored here).
        """
        vl_model, family = find_family(model, ADAPTER)
        scheme = getattr(vl_model, "visionpe_scheme", None)
        if scheme is None:
            raise ValueError(
                f"model ({type(model).__name__}) has no visionpe scheme: call apply_position_scheme(model, scheme) "
                "first, or build QwenVLPackingCollator(scheme, ...) directly"
            )
        # the rotary's own options (mrope_section) are the model's business, not the ids'
        scheme_options = {k: v for k, v in scheme_options.items() if k not in ROTARY_OPTIONS}
        scheme_options = get_multimodal_scheme(scheme).with_model_defaults(scheme_options, vl_model.config)
        return cls(
            scheme,
            spatial_merge_size=int(getattr(vl_model.config.vision_config, family.merge_size)),
            split_video_frames=family.split_videos,
            ignore_index=ignore_index,
            **scheme_options,
        )

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return pack_qwen_vl_features(
            features,
            self.scheme,
            spatial_merge_size=self.spatial_merge_size,
            split_video_frames=self.split_video_frames,
            ignore_index=self.ignore_index,
            **self.scheme_options,
        )

    def __repr__(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self.scheme_options.items())
        return (
            f"{type(self).__name__}({self.scheme!r}, spatial_merge_size={self.spatial_merge_size}, "
            f"split_video_frames={self.split_video_frames}{options})"
        )
