"""1-D RoPE VLM adapter: run LLaVA, LLaVA-OneVision or InternVL (transformers) with any visionpe multimodal scheme.

These models (Liu et al., "Visual Instruction Tuning", NeurIPS 2023; Li et al., "LLaVA-OneVision: Easy Visual Task
Transfer", arXiv 2408.03326, 2024; Chen et al., "Expanding Performance Boundaries of Open-Source Multimodal Models
with Model, Data, and Test-Time Scaling" (InternVL2.5), arXiv 2412.05271, 2024) scatter the image features into
placeholder tokens (``input_ids == config.image_token_id``) and hand the sequence to a Llama-family language model
that rotates queries and keys by 1-D RoPE of ``position_ids``. Nothing in them knows where an image starts or what
grid it has, so the adapter rebuilds that from the placeholder runs and the model's vision config:

- LLaVA: an image is ``(image_size / patch_size)^2`` consecutive tokens, one grid of h x w (CLIP's CLS dropped by
  ``vision_feature_select_strategy="default"``); a run of image tokens holds one or more whole images.
- InternVL: a run of image tokens (between ``<img>`` and ``</img>``) is one image of T tiles (the thumbnail last
  when T > 1), each tile a grid of ``(image_size / patch_size * downsample_ratio)`` squared tokens: the block
  (T, h, w), which is the tile layout that ``rope_dhr`` reads (its ``tile_grid`` option gives each image's
  columns and rows) and a whole image for ``v2pe``, as V2PE counts it in InternVL.
- LLaVA-OneVision (anyres): an image processed in patches is its base view (h x w) followed by the unpadded
  high-resolution view of R x C tokens with the learned newline token appended to each row: two blocks, (1, h, w)
  and (1, R, C + 1), the newlines forming the grid's last column (this library's reading; R and C are computed
  from ``image_sizes``, ``image_grid_pinpoints`` and ``vision_aspect_ratio`` as the model does). An image of a
  multi-image sample (``batch_num_images`` > 1, base view only) and a video (frames pooled to
  ceil(h/2) x ceil(w/2), block (F, h', w')) end with one newline token, which takes a text position.

Schemes whose ids are one row (allocation ``single_axis``: ``rope_1d``, ``v2pe``, ``rope_dhr``, ``bipe``) reach
the language model as (B, L) ``position_ids``; for integer ids its own rotary embedding stays (any ``rope_type``),
fractional ids (float64, ``v2pe``) get a rotary that takes their angles in fp64 (the model's would cast them to
fp32, which merges V2PE's 1/256 steps above 2^16). Schemes with three rows (``mrope``, ``videorope``, ``vrope``...)
pass (3, B, L) ids and replace the language model's ``rotary_emb`` with :class:`~visionpe.multimodal.MultimodalRotary`
(the section of the allocation scaled to the model's head_dim), so that every row drives its pairs. ``rope_1d``
reproduces the model: its ids are transformers' own (``cumsum(attention_mask) - 1``).

Masks: the adapter always hands the language model an explicit 2-D attention mask (all ones where none was given),
since without one transformers reads non-arange ids as packed sequences and builds a block-diagonal mask; and it
refuses FlashAttention, whose packed-sequence detection splits sequences at every repeat of the smallest id.
Schemes that change the causal mask inside visual blocks (``cca``) get it at prefill as a 4-D additive mask
(transformers passes 4-D masks through to sdpa and eager attention); decoded tokens use the plain causal mask.
Schemes whose ids differ per decoder layer (``pype``, ``circle_rope`` with ``age=True``) are refused.

``generate`` gets the scheme's ids for the prompt and continues them by one per new token, which is each scheme's
rule after a text token; a prompt that ends with a visual token (where the next id is not the last + 1) or with
padding (right padding) raises. ``bipe`` advances its id only after a separator token: its generated ids are
rewritten before each step from the tokens generated so far (greedy and sampling; beams keep transformers' +1).

Where each model keeps its ids, rotary and attention, which of its methods the adapter replaces and how its
placeholder runs are laid out is the model's row of :data:`~visionpe.integrations.hf.families.FAMILIES`; the steps
shared with the Qwen-VL adapter are in :mod:`~visionpe.integrations.hf.adapter`. Everything is patched on the model
instance: another model of the same class in the process keeps transformers' own behaviour.
"""

from __future__ import annotations

import importlib
import inspect
import math
from typing import Any

import torch
from torch import nn

from ...checks import check_instance, check_int, check_tensor
from ...multimodal.cca import additive_mask, visual_block_mask
from ...multimodal.design import parse_layout
from ...multimodal.ids import get_position_ids
from ...multimodal.registry import MultimodalScheme
from ...multimodal.rotary import MultimodalRotary
from .adapter import (
    COLLATED_INPUTS,
    Adapter,
    PatchState,
    Prepared,
    apply_scheme,
    bind_arguments,
    check_design_options,
    checked_section,
    own_method,
    own_rotary,
    remove_scheme,
    rotary_options,
    state_of,
)
from .families import VLMFamily, find_model, models_of, outer_name

__all__ = [
    "apply_position_scheme",
    "remove_position_scheme",
    "SUPPORTED_MODELS",
    "OWN_SCHEME",
    "check_scheme_options",
    "find_model",
    "outer_name",
]


ADAPTER = "llava"
# class name of the inner model -> transformers module that defines it (the families this adapter runs)
SUPPORTED_MODELS = models_of(ADAPTER)
OWN_SCHEME = "rope_1d"  # the scheme that gives these models' own position ids (every row's own_scheme)
_VISUAL_INPUTS = ("pixel_values", "pixel_values_videos", "mm_encoder_outputs")
_TILES, _ANYRES = "tiles", "anyres"  # family.visual_layout: a run is one image of tiles / LLaVA-OneVision's views


def _pair(value: Any, name: str) -> tuple[int, int]:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return int(value[0]), int(value[1])
    if isinstance(value, int):
        return value, value
    raise ValueError(f"{name} must be an int or an (h, w) pair, got {value!r}")


def _runs(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat start index (row-major) and length of every run of consecutive True entries in the rows of ``mask``."""
    false = torch.zeros_like(mask[:, :1])
    starts = mask & ~torch.cat([false, mask[:, :-1]], 1)
    ends = mask & ~torch.cat([mask[:, 1:], false], 1)
    first, last = starts.reshape(-1).nonzero().squeeze(1), ends.reshape(-1).nonzero().squeeze(1)
    return first, last - first + 1


class _Adapter(PatchState):
    """The state of a patched model: the scheme, its options and how the model family lays out its visual tokens."""

    def __init__(
        self,
        entry: MultimodalScheme,
        options: dict[str, Any],
        family: VLMFamily,
        config: Any,
        multi_row: bool,
    ) -> None:
        super().__init__(entry, options, family)
        self.config = config  # the inner model's: the layout of its placeholder runs is read from it
        self.multi_row = multi_row
        # bipe: ids after which the position advances (else None: every token)
        self.separators = None if entry.advance_tokens is None else entry.advance_tokens(self.options)
        self.takes_input_ids = "input_ids" in entry.call_inputs
        self.block_mask = entry.block_mask  # CCA: the mask changes inside visual blocks
        self.image_token_id = int(config.image_token_id)
        video = getattr(config, "video_token_id", None) if family.video_tokens else None
        self.video_token_id = None if video is None else int(video)
        self.rope_deltas: torch.Tensor | None = None  # of the last prefill, for cached forwards without ids

    # ----------------------------------------------------------------------------------------------- layout
    def token_types(
        self, input_ids: torch.Tensor | None, given: torch.Tensor | None, inputs: dict[str, Any], shape
    ) -> torch.Tensor:
        """(B, L) 0 text, 1 image, 2 video: from ``input_ids``, else from ``mm_token_type_ids`` (embeds-only calls)."""
        if input_ids is not None:
            out = (input_ids == self.image_token_id).long()
            if self.video_token_id is not None:
                out = out + 2 * (input_ids == self.video_token_id).long()
            return out
        if given is None:
            visual = [name for name in _VISUAL_INPUTS if inputs.get(name) is not None]
            if visual:
                raise ValueError(
                    f"visionpe scheme {self.scheme!r} needs mm_token_type_ids (0 text, 1 image"
                    f"{', 2 video' if self.video_token_id is not None else ''}) for an inputs_embeds call with "
                    f"{', '.join(visual)}: the visual tokens are not read from the embeddings; pass "
                    "mm_token_type_ids of the shape of the embeddings' (B, L)"
                )
            return torch.zeros(shape, dtype=torch.long)
        check_tensor(given, "mm_token_type_ids", dtype="integer", expected="a (B, L) integer tensor")
        if tuple(given.shape) != tuple(shape):
            raise ValueError(f"mm_token_type_ids must have shape {tuple(shape)} (B, L), got {tuple(given.shape)}")
        highest = 2 if self.video_token_id is not None else 1
        if given.numel() and (given.min() < 0 or given.max() > highest):
            raise ValueError(
                f"mm_token_type_ids must hold 0 (text) or 1 (image){' or 2 (video)' if highest == 2 else ''} for "
                f"{self.family.model}, got values {sorted(set(given.unique().tolist()))}"
            )
        return given.long()

    def layout(
        self, types_: torch.Tensor, inputs: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Token types (newline tokens relabelled as text) and the (G, 3) image and video grids, merged."""
        if self.family.visual_layout == _ANYRES:
            return _onevision_layout(self.config, self.family, types_, inputs)
        tiles = self.family.visual_layout == _TILES  # InternVL: a run is one image of tiles, else whole images
        config = self.config
        vision = config.vision_config
        size = _pair(vision.image_size, "vision_config.image_size")
        patch = _pair(vision.patch_size, "vision_config.patch_size")
        height, width = size[0] // patch[0], size[1] // patch[1]
        if tiles:
            ratio = float(config.downsample_ratio)
            height, width = int(height * ratio), int(width * ratio)
        starts, lengths = _runs(types_ == 1)
        if not len(starts):
            return types_, None, None
        per = height * width
        unit = "tile" if tiles else "image"
        bad = lengths % per != 0
        if bad.any():
            r = int(bad.nonzero()[0])
            b, pos = divmod(int(starts[r]), types_.shape[1])
            hint = (
                " (vision_feature_select_strategy='full' keeps a CLS token, and image_sizes of Pixtral-style towers "
                "split an image into rows: neither is a grid this adapter supports)"
                if not tiles
                else ""
            )
            raise ValueError(
                f"sample {b} has a run of {int(lengths[r])} image tokens (image_token_id={self.image_token_id}) from "
                f"position {pos}, which is not a whole number of {unit}s of {height}x{width} = {per} tokens{hint}"
            )
        count = lengths // per
        if tiles:  # InternVL: one image per run, its tiles as the grid's t
            grid = torch.stack([count, torch.full_like(count, height), torch.full_like(count, width)], 1)
        else:  # LLaVA: every image is one (1, h, w) grid, several may follow each other
            grid = torch.tensor([[1, height, width]]).repeat(int(count.sum()), 1)
        return types_, grid.to(types_.device), None

    def _inputs(
        self,
        input_ids: torch.Tensor | None,
        given_types: torch.Tensor | None,
        mask: torch.Tensor,
        inputs: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, dict[str, Any]]:
        """Token types, image and video grids and design options of one batch."""
        types_ = self.token_types(input_ids, given_types, inputs, mask.shape).to(mask.device)
        types_ = types_ * (mask != 0).long()  # a padding token is never visual
        types_, image_grid, video_grid = self.layout(types_, inputs)
        options = dict(self.options)
        if self.takes_input_ids and input_ids is not None:
            options["input_ids"] = input_ids
        return types_, image_grid, video_grid, options

    def position_ids(
        self,
        input_ids: torch.Tensor | None,
        given_types: torch.Tensor | None,
        mask: torch.Tensor,
        inputs: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The scheme's ids, (B, L) for one-row schemes or (3, B, L), and the decoding deltas (B, 1)."""
        types_, image_grid, video_grid, options = self._inputs(input_ids, given_types, mask, inputs)
        pos, deltas = get_position_ids(
            self.scheme,
            types_,
            image_grid,
            video_grid,
            mask,
            spatial_merge_size=1,
            pad_value=0,
            delta_convention="valid",
            **options,
        )
        return (pos if self.multi_row else pos[0]), deltas

    def block_visibility(
        self,
        input_ids: torch.Tensor | None,
        given_types: torch.Tensor | None,
        mask: torch.Tensor,
        inputs: dict[str, Any],
    ) -> torch.Tensor:
        """(B, L, L) bool visibility of a block-mask design (CCA): causal, and inside each visual block key k
        visible to query q iff k's offset in the block is at most q's."""
        types_, image_grid, video_grid, options = self._inputs(input_ids, given_types, mask, inputs)
        layout = parse_layout(types_, image_grid, video_grid, mask, 1)
        design = self.entry.run_design(layout, options)
        return visual_block_mask(layout, design.local[0])

    # ------------------------------------------------------------------------------------------------- ids
    def text_advance(self, tokens: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | float:
        """Position step after each of ``tokens`` (text): 1, or for bipe 1 after a separator and 0 otherwise."""
        if self.separators is None or tokens is None:
            return 1
        separators = torch.tensor(self.separators, dtype=tokens.dtype, device=tokens.device)
        return torch.isin(tokens, separators).to(dtype)

    def checked_ids(self, position_ids: Any, batch: int, length: int) -> torch.Tensor:
        """User ``position_ids`` in the layout the patched language model takes: (B, L), or (3, B, L)."""
        check_tensor(position_ids, "position_ids", dtype="real", expected="an integer or floating point tensor")
        if self.multi_row:
            if position_ids.ndim == 2 and position_ids.shape[-1] == length:
                return position_ids.unsqueeze(0).expand(3, -1, -1)
            if position_ids.ndim == 3 and position_ids.shape[0] == 3 and position_ids.shape[-1] == length:
                return position_ids
            raise ValueError(
                f"position_ids of the three-row scheme {self.scheme!r} must be (3, B, L) or (B, L) with L = {length}, "
                f"got {tuple(position_ids.shape)}"
            )
        if position_ids.ndim != 2 or position_ids.shape[-1] != length or position_ids.shape[0] not in (1, batch):
            raise ValueError(
                f"position_ids of the one-row scheme {self.scheme!r} must be (B, L) = ({batch}, {length}) (the "
                f"language model's rotary takes one row; 3-row ids are for three-row schemes), got "
                f"{tuple(position_ids.shape)}"
            )
        return position_ids

    def checked_deltas(self, deltas: Any, batch: int) -> torch.Tensor:
        """A collator's ``rope_deltas`` for a batch of ``batch`` prompts: a (B, 1) real tensor."""
        check_tensor(deltas, "rope_deltas", dtype="real", expected="a (B, 1) tensor of decoding deltas")
        if tuple(deltas.shape) != (batch, 1):
            raise ValueError(f"rope_deltas must be (B, 1) = ({batch}, 1), got {tuple(deltas.shape)}")
        return deltas

    def given_block_mask(self, visible: Any, mask: torch.Tensor, past: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive (B, 1, L, L) mask from a collator's ``layer_attention_mask`` (1, B, L, L) bool (True:
        visible), for the prompt of a block-mask design."""
        if not self.block_mask:
            raise ValueError(
                f"layer_attention_mask is the mask inside visual blocks of a block-mask design; the model runs "
                f"{self.scheme!r}, which has none"
            )
        batch, length = mask.shape[0], mask.shape[-1]
        expected = (1, batch, length, length)
        if not isinstance(visible, torch.Tensor) or visible.dtype != torch.bool:
            raise TypeError(
                f"layer_attention_mask must be a {expected} bool tensor (True: visible), got "
                f"{getattr(visible, 'dtype', type(visible).__name__)}"
            )
        if past or mask.ndim != 2 or tuple(visible.shape) != expected:
            raise ValueError(
                f"layer_attention_mask must be {expected} (one mask, B, L, L) with the (B, L) attention_mask of an "
                f"uncached call, got {tuple(visible.shape)} with attention_mask {tuple(mask.shape)} and {past} "
                "cached tokens"
            )
        return additive_mask(visible[0].to(mask.device), dtype)

    def continued_ids(self, mask: torch.Tensor, length: int) -> torch.Tensor:
        """Ids of ``length`` new tokens after a cached prefix, from the last prefill's deltas (forward without ids)."""
        if self.separators is not None:
            raise ValueError(
                "bipe advances its ids only after a separator: a forward over a KV cache needs explicit position_ids "
                "(generate() builds them)"
            )
        valid = mask.long().cumsum(-1)[:, -length:] - 1
        deltas = self.rope_deltas
        if deltas is None:
            raise ValueError(
                f"a forward over a KV cache without position_ids continues the ids from the prompt's decoding deltas, "
                f"and the prompt of visionpe scheme {self.scheme!r} came with position_ids but no rope_deltas: pass "
                "the collator's rope_deltas with its position_ids, or position_ids with every cached call"
            )
        if mask.shape[0] % deltas.shape[0]:
            raise ValueError(
                f"the cached call has batch size {mask.shape[0]}, but the prompt's rope_deltas are for "
                f"{deltas.shape[0]} samples: a KV cache continues the batch whose prompt filled it"
            )
        valid = valid + deltas.repeat_interleave(mask.shape[0] // deltas.shape[0], 0).to(valid.device)
        ids = valid.masked_fill(mask[:, -length:] == 0, 0)
        return ids.unsqueeze(0).expand(3, -1, -1) if self.multi_row else ids

    def check_generation_start(self, pos: torch.Tensor, deltas: torch.Tensor, mask: torch.Tensor, input_ids) -> None:
        """Raise unless generate's rule (next id = last id + 1, bipe: + separator) gives the scheme's next id."""
        nxt = (mask != 0).sum(1, keepdim=True).to(deltas.dtype) + deltas  # (B, 1)
        step = self.text_advance(None if input_ids is None else input_ids[:, -1:], pos.dtype)
        rows = pos[..., -1:] if self.multi_row else pos[None, :, -1:]
        wrong = ((rows + step).to(torch.float64) - nxt.to(torch.float64)).abs().amax(0) > 1e-9
        if wrong.any():
            b = int(wrong.nonzero()[0, 0])
            raise ValueError(
                f"generate continues the position ids by one per new token from the prompt's last id; with "
                f"{self.scheme!r} that is right after a text token, but sample {b}'s prompt ends with a visual token "
                f"(next id {float(nxt[b, 0])}, last id {rows[:, b, 0].tolist()}): end the prompt with text"
            )

    def fix_decode_ids(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, cache: Any) -> None:
        """bipe in generate: rewrite, in place, the ids of the tokens this step feeds (last id + separator step)."""
        past = cache.get_seq_length() if cache is not None else 0
        total = input_ids.shape[1]
        if position_ids is None or past == 0 or past >= total or position_ids.shape[-1] != total:
            return
        step = self.text_advance(input_ids, position_ids.dtype)
        for j in range(past, total):
            position_ids[..., j] = position_ids[..., j - 1] + step[:, j - 1]


def _onevision_layout(
    config: Any, family: VLMFamily, types_: torch.Tensor, inputs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """LLaVA-OneVision's image and video blocks (see the module docstring); its newline tokens become text."""
    vision = config.vision_config
    side = int(vision.image_size) // int(vision.patch_size)
    modeling = importlib.import_module(family.module)
    flat = types_.reshape(-1)
    text = []  # flat indices of newline tokens
    image_grid, video_grid = [], []
    image_tokens = (flat == 1).nonzero().squeeze(1)
    if image_tokens.numel():
        sizes = inputs.get("image_sizes")
        if sizes is None:
            raise ValueError(
                "LLaVA-OneVision image tokens need image_sizes (num_images, 2) to lay out each image's views: pass "
                "the image_sizes the processor returns"
            )
        sizes = torch.as_tensor(sizes).reshape(-1, 2).tolist()
        counts_per_sample = inputs.get("batch_num_images")
        if counts_per_sample is None:
            patched = [True] * len(sizes)
        else:
            patched = [n == 1 for n in torch.as_tensor(counts_per_sample).tolist() for _ in range(n)]
            if len(patched) != len(sizes):
                raise ValueError(
                    f"batch_num_images sums to {len(patched)} images but image_sizes has {len(sizes)} rows"
                )
        try:
            # the model's own expression (a character-set strip), so that both read the same N
            max_patches = int(config.vision_aspect_ratio.strip("anyres_max_"))  # noqa: B005
        except (AttributeError, ValueError) as err:
            raise ValueError(
                f"config.vision_aspect_ratio must be 'anyres_max_N', got {config.vision_aspect_ratio!r}"
            ) from err
        start = 0
        for size, anyres in zip(sizes, patched, strict=True):
            image_grid.append((1, side, side))
            if anyres:
                rows, cols = modeling.get_anyres_image_grid_shape(size, config.image_grid_pinpoints, vision.image_size)
                height, width = modeling.unpad_image(torch.empty(0, rows * side, cols * side), size).shape[1:]
                ratio = math.sqrt(height * width / (max_patches * side**2))
                if ratio > 1.1:
                    height, width = int(height // ratio), int(width // ratio)
                image_grid.append((1, height, width + 1))  # the newline closes each row: the grid's last column
                start += side * side + height * (width + 1)
            else:
                start += side * side + 1
                if start <= image_tokens.numel():
                    text.append(int(image_tokens[start - 1]))
        if start != image_tokens.numel():
            raise ValueError(
                f"image_sizes {sizes} lay out {start} image tokens, but the batch has {image_tokens.numel()} "
                f"(image_token_id={config.image_token_id}); this adapter supports LLaVA-OneVision's anyres layout with "
                "one grid of image_size / patch_size per view (vision_feature_select_strategy keeping every patch)"
            )
    starts, lengths = _runs(types_ == 2)
    if len(starts):
        pooled = math.ceil(side / 2)
        frames = (lengths - 1) // (pooled * pooled)
        bad = (frames < 1) | ((lengths - 1) % (pooled * pooled) != 0)
        if bad.any():
            r = int(bad.nonzero()[0])
            b, pos = divmod(int(starts[r]), types_.shape[1])
            raise ValueError(
                f"sample {b} has a run of {int(lengths[r])} video tokens from position {pos}; a LLaVA-OneVision video "
                f"is F frames of {pooled}x{pooled} pooled tokens and one newline token"
            )
        video_grid = [(int(f), pooled, pooled) for f in frames.tolist()]
        text.extend((starts + lengths - 1).tolist())
    if text:
        types_ = types_.clone()
        types_.view(-1)[torch.as_tensor(text, dtype=torch.long, device=types_.device)] = 0
    device = types_.device
    return (
        types_,
        torch.tensor(image_grid, device=device) if image_grid else None,
        torch.tensor(video_grid, device=device) if video_grid else None,
    )


def _check_attention(vl_model: nn.Module, family: VLMFamily) -> None:
    implementation = getattr(family.language(vl_model).config, "_attn_implementation", None) or ""
    if "flash" in implementation:
        raise ValueError(
            f"visionpe schemes need sdpa or eager attention in the language model, got {implementation!r}: "
            "FlashAttention reads position ids that repeat their smallest value as packed sequences and splits them"
        )


def _forward(self, *args: Any, **kwargs: Any) -> Any:
    """Per-instance ``forward`` of a patched inner model: the scheme's ids and an explicit 2-D attention mask."""
    state = state_of(self)
    own = own_method(self, "forward", state)
    if state is None:  # removed through a path that left this attribute
        return own(*args, **kwargs)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(args) > sum(p.kind in positional for p in inspect.signature(own).parameters.values()):
        return own(*args, **kwargs)  # transformers raises its own error
    given = bind_arguments(own, args, kwargs)
    types_ = given.pop("mm_token_type_ids", None)
    collated = {name: given.pop(name) for name in COLLATED_INPUTS if name in given}
    _refuse_collated(state, collated)
    if "past_key_values" in given and "cache" not in given:
        given["cache"] = given.pop("past_key_values")
    _check_attention(self, state.family)
    input_ids, embeds = given.get("input_ids"), given.get("inputs_embeds")
    source = input_ids if input_ids is not None else embeds
    if source is None or (input_ids is not None and embeds is not None):
        return own(**given)  # transformers raises its own error
    batch, length = source.shape[:2]
    cache = given.get("cache")
    past = cache.get_seq_length() if cache is not None else 0
    mask = given.get("attention_mask")
    if mask is None:
        # never None: transformers would read non-arange ids as packed sequences (block-diagonal attention)
        mask = torch.ones(batch, past + length, dtype=torch.long, device=source.device)
        given["attention_mask"] = mask
    position_ids = given.get("position_ids")
    deltas = collated.get("rope_deltas")
    if deltas is not None and (position_ids is None or past):
        raise ValueError(
            "rope_deltas come with the position_ids of a whole prompt (an uncached call), as the collator gives them; "
            f"got them {'without position_ids' if position_ids is None else f'after {past} cached tokens'}"
        )
    if position_ids is None:
        if mask.ndim != 2:
            raise ValueError(
                f"attention_mask must be a 2-D (B, L) mask for visionpe scheme {state.scheme!r} to place the tokens "
                f"(or pass position_ids), got shape {tuple(mask.shape)}"
            )
        if past == 0:
            position_ids, state.rope_deltas = state.position_ids(input_ids, types_, mask, given)
        else:
            position_ids = state.continued_ids(mask, length)
    else:
        position_ids = state.checked_ids(position_ids, batch, length)
        if past == 0:  # this prompt's deltas (the collator's), never an earlier call's; None: unknown
            state.rope_deltas = None if deltas is None else state.checked_deltas(deltas, batch)
    given["position_ids"] = position_ids.to(source.device)
    visible = collated.get("layer_attention_mask")
    if visible is not None:
        given["attention_mask"] = state.given_block_mask(visible, mask, past, self.get_input_embeddings().weight.dtype)
    elif state.block_mask and past == 0 and mask.ndim == 2:
        # at prefill the mask changes inside the visual blocks (transformers passes a 4-D mask through untouched);
        # decoded tokens use the plain causal mask
        dtype = self.get_input_embeddings().weight.dtype
        visible = state.block_visibility(input_ids, types_, mask, given)
        given["attention_mask"] = additive_mask(visible, dtype)
    return own(**given)


def _refuse_collated(state: _Adapter, collated: dict[str, Any]) -> None:
    """ValueError for what a collator gives other families: per-layer ids and a packed row's boundaries."""
    refused = [name for name in ("layer_position_ids", "layer_rope_deltas") if collated.get(name) is not None]
    if refused:
        raise ValueError(
            f"{', '.join(refused)} are per-layer ids, which the 1-D RoPE adapter does not run (one set of position "
            f"ids for every layer); the model runs {state.scheme!r}"
        )
    packed = [name for name in ("cu_seqlens", "max_seqlen") if collated.get(name) is not None]
    if packed:
        raise ValueError(
            f"{', '.join(packed)} describe a packed row, which the 1-D RoPE adapter does not run: it always passes "
            "a 2-D attention mask, which turns off transformers' packed-sequence masking; use padded batches"
        )


def _prepare_position_ids_for_generation(self, inputs_tensor: torch.Tensor, model_kwargs: dict[str, Any]):
    """Per-instance ``_prepare_position_ids_for_generation`` of a patched ``*ForConditionalGeneration``."""
    state = state_of(getattr(self, "model", None))
    own = own_method(self, "_prepare_position_ids_for_generation", state)
    if state is None:
        return own(inputs_tensor, model_kwargs)
    input_ids = model_kwargs.get("input_ids")
    if input_ids is None or input_ids.shape[1] == 0:
        floating = inputs_tensor.is_floating_point()
        input_ids = inputs_tensor if inputs_tensor.ndim == 2 and not floating else None
    shape = input_ids.shape if input_ids is not None else inputs_tensor.shape[:2]
    mask = model_kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones(shape, dtype=torch.long, device=inputs_tensor.device)
    if mask.ndim != 2 or tuple(mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask must be (B, L) = {tuple(shape)} for generate, got {tuple(mask.shape)}")
    if not (mask[:, -1] != 0).all():
        b = int((mask[:, -1] == 0).nonzero()[0])
        raise ValueError(
            f"generate with visionpe scheme {state.scheme!r} needs left padding: sample {b} of attention_mask ends "
            "with padding (set tokenizer.padding_side = 'left')"
        )
    pos, deltas = state.position_ids(input_ids, model_kwargs.get("mm_token_type_ids"), mask, model_kwargs)
    state.check_generation_start(pos, deltas, mask, input_ids)
    return pos


def _prepare_inputs_for_generation(
    self,
    input_ids: torch.Tensor,
    next_sequence_length: int | None = None,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    is_first_iteration: bool | None = False,
    mm_token_type_ids: torch.Tensor | None = None,
    **kwargs: Any,
):
    """Per-instance ``prepare_inputs_for_generation`` (GenerationMixin's arguments, which generate inspects, plus
    ``mm_token_type_ids``); for bipe it first rewrites the ids of the tokens this step feeds."""
    state = state_of(getattr(self, "model", None))
    own = own_method(self, "prepare_inputs_for_generation", state)
    if state is not None and state.separators is not None:
        state.fix_decode_ids(input_ids, kwargs.get("position_ids"), cache)
    if mm_token_type_ids is not None:
        kwargs["mm_token_type_ids"] = mm_token_type_ids
    return own(
        input_ids,
        next_sequence_length=next_sequence_length,
        cache=cache,
        attention_mask=attention_mask,
        inputs_embeds=inputs_embeds,
        is_first_iteration=is_first_iteration,
        **kwargs,
    )


_PATCHES = {
    "forward": _forward,
    "_prepare_position_ids_for_generation": _prepare_position_ids_for_generation,
    "prepare_inputs_for_generation": _prepare_inputs_for_generation,
}
for _function in _PATCHES.values():
    _function.visionpe_patch = True


def _validate(entry: MultimodalScheme, options: dict[str, Any], vl_model: nn.Module, family: VLMFamily) -> None:
    """What the 1-D RoPE adapter refuses (:func:`check_scheme_options`) and FlashAttention."""
    check_scheme_options(entry, options, int(vl_model.config.text_config.num_hidden_layers))
    _check_attention(vl_model, family)


def check_scheme_options(entry: MultimodalScheme, options: dict[str, Any], num_layers: int) -> None:
    """ValueError for what the 1-D RoPE adapter (and its collator) refuse: per-call inputs, ids per decoder layer
    (over ``num_layers`` layers) and K > 1 positions per token."""
    check_instance(entry, "entry", MultimodalScheme, expected="a MultimodalScheme registry entry")
    check_instance(options, "options", dict, expected="a dict of design options")
    check_int(num_layers, "num_layers", min=1)
    per_call = [name for name in options if name in entry.call_inputs]
    if per_call:
        raise ValueError(
            f"{per_call} describe one batch: the adapter reads input_ids from each call and does not take "
            "clusters, weights or second_per_grid_ts (these models give no timing or token clusters)"
        )
    if entry.layer_of is not None:
        try:
            per_layer = any(entry.layer_of(layer, options) != 0 for layer in range(num_layers))
        except ValueError:  # options that cannot place the layers (PyPE without its interval)
            per_layer = True
        if per_layer:
            raise ValueError(
                f"scheme {entry.name!r} with options {options} gives decoder layers their own ids; the 1-D RoPE "
                "adapter passes one set of position ids to every layer, so it does not run it"
            )
    if entry.representatives(options) != 1:
        raise ValueError(
            f"{entry.representatives_option} must be 1 in the 1-D RoPE adapter (K > 1 needs PPERotary's 3K rows), "
            f"got {entry.representatives(options)!r}"
        )


def _prepare(
    entry: MultimodalScheme, options: dict[str, Any], given: dict[str, Any], vl_model: nn.Module, family: VLMFamily
) -> Prepared:
    """The options checked on a trial batch, and the rotary where the model's own cannot take the ids: three rows
    (the allocation's section scaled to the head_dim) or fractional ids (angles in fp64)."""
    trial = {k: v for k, v in options.items() if k != "tile_grid"}  # tile_grid is checked against each batch
    check_design_options(entry.name, trial, 1)
    scalar_options = {k: v for k, v in trial.items() if not isinstance(v, torch.Tensor)}
    ids, _ = get_position_ids(
        entry.name, torch.tensor([[0, 1, 0]]), torch.tensor([[1, 1, 1]]), spatial_merge_size=1, **scalar_options
    )
    multi_row = entry.allocation != "single_axis"
    if "mrope_section" in given:
        checked_section(given["mrope_section"], entry)
    rotary = None
    if multi_row or ids.dtype == torch.float64:
        rope = dict(getattr(vl_model.config.text_config, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                f"{entry.name!r} replaces the language model's rotary embedding, which supports rope_type 'default' "
                f"on the full head_dim; the model uses rope_type {rope.get('rope_type')!r}, partial_rotary_factor "
                f"{rope.get('partial_rotary_factor', 1.0)!r} (rope_1d and integer one-row schemes keep the model's)"
            )
        head_dim, rotary_kwargs = rotary_options(entry, given, vl_model, family)
        rotary = MultimodalRotary.from_scheme(
            entry.name,
            head_dim,
            base=float(rope.get("rope_theta", 10000.0)),
            attention_scaling=float(getattr(own_rotary(vl_model, family), "attention_scaling", 1.0)),
            **rotary_kwargs,
        )
    return Prepared(_Adapter(entry, options, family, vl_model.config, multi_row), rotary)


_ADAPTER = Adapter(ADAPTER, _validate, _prepare, _PATCHES)


def apply_position_scheme(model: nn.Module, scheme: str, **kwargs: Any) -> nn.Module:
    """Make a LLaVA, LLaVA-OneVision or InternVL model use the visionpe scheme ``scheme``, in place.

    Args:
        model: a ``LlavaForConditionalGeneration``, ``LlavaOnevisionForConditionalGeneration`` or
            ``InternVLForConditionalGeneration`` (or their inner ``*Model``; patching the inner model covers
            ``forward``, ``generate`` needs the outer one patched).
        scheme: a name from :func:`visionpe.multimodal.list_multimodal_schemes`; ``"rope_1d"`` gives the model's
            own ids.
        **kwargs: the scheme's design options (``delta=`` for v2pe, ``tile_grid=`` for rope_dhr on InternVL, the
            same for every call, ``separator_ids=`` for bipe...) and ``mrope_section=`` for a sectioned allocation
            (default: the scheme's proportions scaled to the language model's head_dim). ``input_ids`` (bipe) are
            read from each call; per-batch inputs that the model does not receive (``clusters``, ``weights``,
            ``second_per_grid_ts``) and ``num_representatives`` > 1 (ppe) are refused.

    Returns:
        The same model; ``model.visionpe_scheme`` records the scheme.

    Raises:
        TypeError, ValueError: for an unsupported model, an unknown scheme or option, an option value the scheme
            does not accept, FlashAttention, or a non-default ``rope_type`` where the rotary must be replaced
            (three-row or fractional schemes). Every check runs before anything is patched.
        ImportError: (:class:`~visionpe.integrations.hf.compat.UnsupportedTransformersError`) for a transformers
            older than the adapter supports or without a method or argument it relies on; the message names the
            installed version, the supported range and the install command.

    The patched ``forward`` takes ``mm_token_type_ids`` (0 text, 1 image, 2 video), needed only when
    ``inputs_embeds`` come with visual inputs; ``generate`` takes it too. Applying a scheme to a patched model
    replaces the first one; :func:`remove_position_scheme` undoes the patch. Head-wise allocations (``mhrope``) give
    each attention module of the patched model a ``forward`` of its own that applies per-head tables
    (:func:`~visionpe.integrations.hf.adapter.patch_rotary_function`); transformers' modules are unchanged.

    Example:
        >>> model = apply_position_scheme(model, "v2pe", delta=0.25)  # doctest: +SKIP
        >>> out = model.generate(**inputs, max_new_tokens=32)  # doctest: +SKIP
    """
    return apply_scheme(_ADAPTER, model, scheme, kwargs)


def remove_position_scheme(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_position_scheme`, in place: the model runs with its own positions again.

    The inner model's ``forward``, the outer model's ``_prepare_position_ids_for_generation`` and
    ``prepare_inputs_for_generation`` and the language model's rotary embedding are put back, and
    ``visionpe_scheme`` is deleted. A model that is not patched is returned unchanged. (Patched through the
    ``*ForConditionalGeneration`` and removed through its inner ``*Model``, the outer model keeps inert methods that
    defer to the class's: remove through the model that was patched.)

    Args:
        model: a model accepted by :func:`apply_position_scheme`.

    Returns:
        The same model.
    """
    return remove_scheme(model, ADAPTER)
