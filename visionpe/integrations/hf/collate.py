"""Position ids built in the data loader: one collator for every supported VLM family and multimodal design.

A patched model (:func:`~visionpe.integrations.hf.apply_position_scheme`) builds its ids in ``forward`` when none
are given: from the token types and the grids, on the device of the batch, once per step, with the host-device
synchronisations that a layout of variable blocks takes. :class:`VLMPositionCollator` builds them in the
``DataLoader``'s workers instead, from the processor's outputs, and the patched model takes them as given:

- ``position_ids``: (R, B, L) for the Qwen-VL families and the three-row schemes of the 1-D RoPE families, (B, L)
  for their one-row schemes; ``rope_deltas`` (B, 1): the batch's own decoding deltas, which the model keeps for a
  later forward over a KV cache, so that it never continues from an earlier batch's;
- for designs whose ids differ per decoder layer (registry entry ``layer_of``: PyPE, Circle-RoPE with ``age=True``)
  ``layer_position_ids`` (V, R, B, L) and ``layer_rope_deltas`` (V, B, 1), one per distinct layer variant;
- for designs that change the causal mask inside visual blocks (``block_mask``: CCA, PyPE) ``layer_attention_mask``
  (V, B, L, L) bool, True where key k is visible to query q;
- for packed rows (``packed=True``, Qwen-VL families) the row of :func:`~visionpe.integrations.hf.packing.
  pack_qwen_vl_features` with ``cu_seqlens`` (S + 1,) and ``max_seqlen``, the sample boundaries.

The patched forward pops these keys (transformers would pass unknown keywords on to the vision tower and the
attention) and runs no position design: the ids, masks and deltas are used as they are. What a family or a design
cannot take is refused when the collator is built, with a ValueError saying why, read from the design's registry
entry (``layer_of``, ``block_mask``, ``representatives_option``, ``call_inputs``), never from its name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ...checks import check_bool, check_choice, check_instance, check_int
from ...multimodal.registry import get_multimodal_scheme
from .adapter import ROTARY_OPTIONS, state_of
from .families import FAMILIES, find_family
from .layers import LayerPlan
from .llava import _Adapter as _RopeOneState
from .llava import check_scheme_options as _check_rope_1d_options
from .packing import check_packable, pack_qwen_vl_features, token_row
from .qwen import _QwenState, layer_position_tensors, scheme_position_ids
from .qwen import check_scheme_options as _check_qwen_options

__all__ = ["VLMPositionCollator", "PADDING_SIDES"]

PADDING_SIDES = ("left", "right")
_TOKEN_ROWS = ("input_ids", "attention_mask", "mm_token_type_ids", "labels")
# per-sample visual inputs, concatenated in sample order (one row per image, video or tile)
_CONCATENATED = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "image_sizes",
    "clusters",
    "weights",
)


class VLMPositionCollator:
    """``collate_fn`` / ``data_collator`` that adds everything a patched VLM needs beside its inputs.

    Args:
        scheme: the visionpe scheme the model is patched with (``model.visionpe_scheme``).
        config: the model's config (``model.config``): the layout of the visual tokens, the merge size, the number
            of decoder layers and the defaults of the design's options are read from it.
        family: the inner model's class name, a key of :data:`~visionpe.integrations.hf.families.FAMILIES`
            (``"Qwen2VLModel"``, ``"LlavaModel"``...).
        packed: pack the samples into one row (Qwen-VL families, designs that one set of ids and row 0 can express:
            :func:`~visionpe.integrations.hf.packing.check_packable`).
        padding_side: where padded batches pad (``"left"`` or ``"right"``; the ids are right either way).
        pad_token_id: ``input_ids`` at padded slots.
        ignore_index: ``labels`` at padded slots (and at each packed sample's first token).
        **scheme_options: the design options the model was patched with (:meth:`from_model` reads them from the
            model); ``mrope_section``, an option of the rotary, is ignored.

    Raises:
        TypeError, ValueError: for an unknown family or scheme, an option the design does not take, or a family or
            design the collator cannot serve (the message says why: ids per decoder layer or K > 1 positions per
            token in a 1-D RoPE family, a packed row for a 1-D RoPE family or a design with a block mask or
            per-layer ids, a required option without a value).

    Example:
        >>> collator = VLMPositionCollator.from_model(model)  # doctest: +SKIP
        >>> loader = DataLoader(dataset, batch_size=8, collate_fn=collator, num_workers=2)  # doctest: +SKIP
        >>> loss = model(**next(iter(loader))).loss  # the forward builds no ids  # doctest: +SKIP
    """

    def __init__(
        self,
        scheme: str,
        config: Any,
        family: str,
        *,
        packed: bool = False,
        padding_side: str = "left",
        pad_token_id: int = 0,
        ignore_index: int = -100,
        **scheme_options: Any,
    ) -> None:
        entry = get_multimodal_scheme(scheme)
        check_choice(family, "family", tuple(FAMILIES), expected="an inner model class name of FAMILIES")
        check_bool(packed, "packed")
        check_choice(padding_side, "padding_side", PADDING_SIDES)
        check_int(pad_token_id, "pad_token_id", min=0)
        check_int(ignore_index, "ignore_index")
        for name in ("text_config", "vision_config"):
            if getattr(config, name, None) is None:
                raise TypeError(f"config must be the model's config, with a {name}; got {type(config).__name__}")
        row = FAMILIES[family]
        options = {k: v for k, v in scheme_options.items() if k not in ROTARY_OPTIONS}
        entry.check_options(options)
        options = entry.with_model_defaults(options, config)
        num_layers = int(config.text_config.num_hidden_layers)
        self.scheme, self.family, self.config = scheme, family, config
        self.packed, self.padding_side = packed, padding_side
        self.pad_token_id, self.ignore_index = pad_token_id, ignore_index
        self.scheme_options = options
        self._plan: LayerPlan | None = None
        if row.adapter == "qwen":
            _check_qwen_options(entry, options)
            merge = int(getattr(config.vision_config, row.merge_size))
            self._state: Any = _QwenState(entry, options, row, merge)
            if packed:
                check_packable(scheme, options)
            else:
                plan = LayerPlan(
                    entry,
                    options,
                    num_layers,
                    spatial_merge_size=merge,
                    split_videos=row.split_videos,
                    takes_time=self._state.takes_time,
                )
                self._plan = plan if plan.needed else None
        else:
            if packed:
                raise ValueError(
                    f"{family} cannot take packed rows: the 1-D RoPE adapter always passes a 2-D attention mask, "
                    "which turns off transformers' packed-sequence masking; use packed=False (padded batches)"
                )
            _check_rope_1d_options(entry, options, num_layers)
            self._state = _RopeOneState(entry, options, row, config, entry.allocation != "single_axis")

    @classmethod
    def from_model(cls, model: nn.Module, **kwargs: Any) -> VLMPositionCollator:
        """The collator of a model patched by :func:`~visionpe.integrations.hf.apply_position_scheme`.

        The scheme and its options (with the defaults the adapter resolved from the config) are the model's; options
        given here override them (e.g. a V2PE ``delta`` drawn for training), as do ``packed``, ``padding_side``,
        ``pad_token_id`` (default: the text config's, else 0) and ``ignore_index``.
        """
        check_instance(model, "model", nn.Module, expected="a patched transformers VLM")
        vl_model, row = find_family(model)
        state = state_of(vl_model)
        if state is None:
            raise ValueError(
                f"model ({type(model).__name__}) has no visionpe scheme: call apply_position_scheme(model, scheme) "
                "first, or build VLMPositionCollator(scheme, config, family) directly"
            )
        settings = {k: kwargs.pop(k) for k in ("packed", "padding_side", "pad_token_id", "ignore_index") if k in kwargs}
        if "pad_token_id" not in settings:
            pad = getattr(vl_model.config.text_config, "pad_token_id", None)
            settings["pad_token_id"] = int(pad) if isinstance(pad, int) and pad >= 0 else 0
        options = {**state.options, **kwargs}
        return cls(state.scheme, vl_model.config, row.model, **settings, **options)

    # ------------------------------------------------------------------------------------------------------- call
    def __call__(self, features: Sequence[Mapping[str, Any]] | Mapping[str, Any]) -> dict[str, Any]:
        """The model's inputs for one batch, with its positions.

        Args:
            features: one mapping per sample as the processor returns it for that sample alone (``input_ids`` (L,)
                or (1, L), ``attention_mask``, ``mm_token_type_ids``, ``labels``, the visual inputs), which are
                padded (or packed) here; or a mapping for a whole batch the processor already padded (``input_ids``
                (B, L) ...), returned with the positions added.

        Returns:
            The batch as a dict, with ``position_ids`` and ``rope_deltas`` (padded), the per-layer ids and masks
            the design needs, or for packed rows the packed inputs with ``cu_seqlens`` and ``max_seqlen``.
        """
        if isinstance(features, Mapping):
            if self.packed:
                raise ValueError(
                    "a packed collator takes one mapping per sample (a list), got one mapping for a padded batch"
                )
            batch = dict(features)
        else:
            check_instance(features, "features", (list, tuple), expected="a list of per-sample feature mappings")
            if not features:
                raise ValueError("features must hold at least one sample, got an empty list")
            if self.packed:
                return self._packed(features)
            batch = self._padded(features)
        return self._with_positions(batch)

    def _packed(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        row = FAMILIES[self.family]
        out = pack_qwen_vl_features(
            features,
            self.scheme,
            spatial_merge_size=self._state.spatial_merge_size,
            split_video_frames=row.split_videos,
            ignore_index=self.ignore_index,
            **self.scheme_options,
        )
        starts = (out["position_ids"][0, 0] == 0).nonzero().flatten()
        length = out["input_ids"].shape[1]
        out["cu_seqlens"] = torch.cat([starts, torch.tensor([length])]).to(torch.int32)
        out["max_seqlen"] = int(out["cu_seqlens"].diff().max())
        return out

    def _padded(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Pad the samples' token rows to the longest (on :attr:`padding_side`) and concatenate their visual inputs."""
        rows: dict[str, list[torch.Tensor]] = {name: [] for name in _TOKEN_ROWS}
        visual: dict[str, list[torch.Tensor]] = {name: [] for name in _CONCATENATED}
        for index, feature in enumerate(features):
            if not isinstance(feature, Mapping):
                raise TypeError(f"features[{index}] must be a mapping of model inputs, got {type(feature).__name__}")
            if "input_ids" not in feature:
                raise ValueError(f"features[{index}] has no 'input_ids'")
            unknown = [k for k in feature if k not in _TOKEN_ROWS and k not in _CONCATENATED]
            if unknown:
                raise ValueError(
                    f"features[{index}] has keys {unknown} that the collator does not know how to batch; it pads "
                    f"{list(_TOKEN_ROWS)} and concatenates {list(_CONCATENATED)}"
                )
            ids = token_row(feature["input_ids"], "input_ids", index)
            for name in _TOKEN_ROWS:
                value = feature.get(name)
                if value is None and name == "attention_mask":
                    value = torch.ones_like(ids)
                if value is None:
                    rows[name].append(None)
                    continue
                value = token_row(value, name, index)
                if value.shape != ids.shape:
                    raise ValueError(
                        f"features[{index}][{name!r}] has {value.numel()} entries, input_ids {ids.numel()}"
                    )
                rows[name].append(value)
            for name in _CONCATENATED:
                if feature.get(name) is not None:
                    visual[name].append(torch.as_tensor(feature[name]))
        longest = max(r.numel() for r in rows["input_ids"])
        fill = {
            "input_ids": self.pad_token_id,
            "attention_mask": 0,
            "mm_token_type_ids": 0,
            "labels": self.ignore_index,
        }
        out: dict[str, Any] = {}
        for name, values in rows.items():
            present = [v is not None for v in values]
            if not any(present):
                continue
            if not all(present):
                raise ValueError(f"{name!r} is in some samples and not in others: give it for every sample or none")
            padded = torch.full((len(values), longest), fill[name], dtype=torch.long)
            for b, value in enumerate(values):
                if self.padding_side == "left":
                    padded[b, longest - value.numel() :] = value
                else:
                    padded[b, : value.numel()] = value
            out[name] = padded
        for name, values in visual.items():
            if values:
                try:
                    out[name] = torch.cat(values)
                except RuntimeError as err:
                    raise ValueError(f"the samples' {name!r} cannot be concatenated along dim 0: {err}") from err
        return out

    def _with_positions(self, batch: dict[str, Any]) -> dict[str, Any]:
        input_ids = batch.get("input_ids")
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            raise ValueError(f"the batch needs (B, L) input_ids, got {getattr(input_ids, 'shape', input_ids)!r}")
        mask = batch.get("attention_mask")
        if mask is None:
            mask = batch["attention_mask"] = torch.ones_like(input_ids)
        types_ = batch.get("mm_token_type_ids")
        if FAMILIES[self.family].adapter == "qwen":
            if types_ is None:
                visual = [k for k in ("image_grid_thw", "video_grid_thw") if batch.get(k) is not None]
                if visual:
                    raise ValueError(
                        f"the batch has {', '.join(visual)} but no mm_token_type_ids (0 text, 1 image, 2 video), "
                        "which place the visual tokens; the processor returns them alongside input_ids"
                    )
                types_ = batch["mm_token_type_ids"] = torch.zeros_like(input_ids)
            image, video = batch.get("image_grid_thw"), batch.get("video_grid_thw")
            if self._plan is not None:
                batch.update(layer_position_tensors(self._state, self._plan, types_, image, video, mask, batch))
            else:
                batch["position_ids"], batch["rope_deltas"] = scheme_position_ids(
                    self._state, types_, image, video, mask, batch
                )
            return batch
        position_ids, deltas = self._state.position_ids(input_ids, types_, mask, batch)
        batch["position_ids"], batch["rope_deltas"] = position_ids, deltas
        if self._state.block_mask:
            batch["layer_attention_mask"] = self._state.block_visibility(input_ids, types_, mask, batch)[None]
        return batch

    def __repr__(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self.scheme_options.items())
        return (
            f"{type(self).__name__}({self.scheme!r}, family={self.family!r}, packed={self.packed}, "
            f"padding_side={self.padding_side!r}{options})"
        )
