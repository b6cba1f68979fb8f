"""Per-layer positions and intra-block attention masks inside a transformers language model.

Two kinds of multimodal scheme need more than one ``position_ids`` tensor and the causal mask:

- **per-layer ids**: PyPE (Chen et al., arXiv 2501.10967, 2025) gives decoder layer l its own visual levels and text
  positions; Circle-RoPE's AGE (Wang et al., arXiv 2505.16416, 2025) alternates two sets of ids across layers;
- **an intra-block mask**: CCA (Xing et al., NeurIPS 2024) and PyPE replace the causal mask inside each visual block by
  "key k visible to query q iff its level is at most q's", an additive (B, 1, L, L) float mask.

transformers computes one (cos, sin) pair per forward and hands it, with one mask, to every decoder layer. The
:class:`LayerPlan` installed on a patched model changes three methods, per instance (``forward`` of the vision-language
model, of the language model's rotary embedding and of each decoder layer; the classes and the state dict are
untouched):

1. The model's ``forward``, when the prompt is encoded (no cached tokens), builds from the 2-D attention mask, the
   token types and the grids the ids of every distinct layer variant and their masks; with cached tokens (decoding)
   it builds nothing but the per-layer shift of the new text tokens, from the per-layer decoding deltas the prefill
   stored (the plain causal mask is right there: new tokens are text and see everything before them).
2. The rotary embedding, given the model's ids (layer 0's: those of ``get_rope_index``, advanced by ``generate``),
   also computes the tables of every other variant from those ids plus the variant's offset, so each layer's keys
   in the cache carry that layer's positions and cached decoding equals a one-shot prefill.
3. Each decoder layer swaps in its variant's (cos, sin) and mask.

transformers 5.x passes a 4-D mask through untouched (``masking_utils._preprocess_mask_arguments`` returns it as it
is); eager attention adds it to the scores and SDPA takes it as ``attn_mask``. FlashAttention-2 and the other kernels
cannot take it (FA2 would drop it silently), so a scheme with a mask refuses them when applied and when called.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
from torch import nn

from ...multimodal.cca import additive_mask, visual_block_mask
from ...multimodal.design import assemble_positions, parse_layout
from ...multimodal.registry import MultimodalScheme

__all__ = [
    "LayerPlan",
    "MASK_ATTENTION_IMPLEMENTATIONS",
    "bind_arguments",
    "check_attention_implementation",
    "split_video_frames",
]

MASK_ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")
_VISUAL_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw")


def split_video_frames(video_grid_thw: torch.Tensor) -> torch.Tensor:
    """Qwen3-VL layout: each frame of a (T, h, w) video grid becomes its own (1, h, w) block."""
    grid = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
    grid[:, 0] = 1
    return grid


def check_attention_implementation(config: Any, scheme: str) -> None:
    """ValueError unless ``config._attn_implementation`` can take a 4-D float mask (eager or SDPA)."""
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is not None and implementation not in MASK_ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"visionpe scheme {scheme!r} changes the attention mask inside each visual block (an additive (B, 1, L, L) "
            f"float mask), which attn_implementation={implementation!r} cannot take (FlashAttention-2 would drop it "
            f"silently); use one of {MASK_ATTENTION_IMPLEMENTATIONS}, e.g. model.set_attn_implementation('sdpa')"
        )


class _Call:
    """What one forward needs in its decoder layers: id offsets, visibility, and the tables and masks made from them."""

    def __init__(
        self, offsets: dict[int, torch.Tensor], allowed: dict[int, torch.Tensor], alias: dict[int, int]
    ) -> None:
        self.offsets = offsets  # variant -> (3, B, L) (prefill) or (B, 1) (decoding), added to the model's ids
        self.allowed = allowed  # variant -> (B, L, L) bool
        self.alias = alias  # variant -> an earlier variant with the same ids on this batch (PyPE once K(l) = 1)
        self.tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._masks: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def mask(self, variant: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (variant, dtype, device)
        if key not in self._masks:
            self._masks[key] = additive_mask(self.allowed[variant].to(device), dtype)
        return self._masks[key]


class LayerPlan:
    """Which ids each decoder layer reads and whether visual blocks get their own mask, for one patched model.

    Args:
        entry: the registry entry of the scheme.
        options: its design options as given to the model (``layer`` excluded).
        num_layers: decoder layers of the language model.
        spatial_merge_size, split_videos, takes_time: as the adapter's ``get_rope_index`` (Qwen3-VL splits videos
            into frames; Qwen2.5-VL passes ``second_per_grid_ts`` to designs that take it).

    ``layer_variant[l]`` is the first layer whose ids layer l shares (``entry.layer_of``); layer 0's variant gives
    the ids of ``get_rope_index``. ``deltas`` holds, per other variant, its decoding deltas minus layer 0's, from the
    last prefill with visual tokens.
    """

    def __init__(
        self,
        entry: MultimodalScheme,
        options: dict[str, Any],
        num_layers: int,
        *,
        spatial_merge_size: int,
        split_videos: bool,
        takes_time: bool,
    ) -> None:
        self.scheme = entry.name
        self.entry = entry
        self.options = dict(options)
        layer_of = entry.layer_of
        self.layer_variant = [layer_of(layer, self.options) if layer_of else 0 for layer in range(num_layers)]
        self.variants = sorted(set(self.layer_variant))
        self.block_mask = entry.block_mask
        self.spatial_merge_size = spatial_merge_size
        self.split_videos = split_videos
        self.takes_time = takes_time
        self.deltas: dict[int, torch.Tensor] | None = None
        self.alias: dict[int, int] = {}
        self.generation: dict[str, Any] | None = None
        self.call: _Call | None = None

    def remember_generation(self, model_kwargs: dict[str, Any]) -> None:
        """Keep the layout of a ``generate`` prompt (called when generate builds its position ids).

        generate encodes the images and videos before the prefill and then drops the grids from the model's inputs
        (``mm_encoder_outputs`` replace them); the prefill's masks and per-layer ids are built from what is kept here.
        """
        types_ = model_kwargs.get("mm_token_type_ids")
        image, video = model_kwargs.get("image_grid_thw"), model_kwargs.get("video_grid_thw")
        if types_ is None or (image is None and video is None):
            self.generation = None
            return
        self.generation = {
            "types": types_,
            "image": image,
            "video": video,
            "mask": model_kwargs.get("attention_mask"),
            "time": model_kwargs.get("second_per_grid_ts"),
        }

    def _recall(self, types_: torch.Tensor) -> tuple[Any, Any, Any] | None:
        """The grids (and video timing) of the remembered prompt if ``types_`` is that prompt, each sample repeated k
        times (generate's expansion for beams or several sequences) and followed by generated text; else None."""
        memo = self.generation
        if memo is None:
            return None
        stored = memo["types"].to(types_.device)
        batch, length = stored.shape
        if types_.shape[1] < length or types_.shape[0] % batch:
            return None
        repeats = types_.shape[0] // batch
        if not torch.equal(types_[:, :length], stored.repeat_interleave(repeats, 0)) or types_[:, length:].any():
            return None
        image, video, time = memo["image"], memo["video"], memo["time"]
        if repeats == 1:
            return image, video, time
        # Grids are listed per modality in order of appearance across the batch: repeat each sample's own grids.
        video_rows = None if video is None else split_video_frames(video) if self.split_videos else video
        layout = parse_layout(stored, image, video_rows, memo["mask"], self.spatial_merge_size)
        sample = layout.block_sample.cpu()
        num_images = 0 if image is None else len(image)
        image_sample, video_sample = sample[:num_images], sample[num_images:]
        if self.split_videos and video is not None:  # one block per frame: a video's sample is its first frame's
            video_sample = video_sample[torch.cumsum(video[:, 0].cpu(), 0) - video[:, 0].cpu()]

        def expand(rows: Any, owners: torch.Tensor) -> Any:
            if rows is None:
                return None
            order = torch.cat([(owners == b).nonzero().flatten().repeat(repeats) for b in range(batch)])
            return rows[order.to(rows.device)] if isinstance(rows, torch.Tensor) else [rows[i] for i in order]

        return expand(image, image_sample), expand(video, video_sample), expand(time, video_sample)

    @property
    def needed(self) -> bool:
        """Whether the model needs the plan: several id variants or a mask."""
        return len(self.variants) > 1 or self.block_mask

    @property
    def base(self) -> int:
        return self.layer_variant[0]

    def prepare(self, model: nn.Module, given: dict[str, Any]) -> _Call | None:
        """The per-layer offsets and masks of one call of the vision-language model ``model`` (arguments ``given``)."""
        if self.block_mask:
            check_attention_implementation(model.language_model.config, self.scheme)
        types_ = given.get("mm_token_type_ids")
        visual = [name for name in _VISUAL_INPUTS if given.get(name) is not None]
        if visual and types_ is None:
            raise ValueError(
                f"visionpe scheme {self.scheme!r} needs mm_token_type_ids (0 text, 1 image, 2 video) to build its "
                f"per-layer positions and attention mask: {', '.join(visual)} came without them"
            )
        tokens = given.get("input_ids")
        tokens = tokens if tokens is not None else given.get("inputs_embeds")
        if tokens is None:
            return None  # transformers raises its own error
        length = tokens.shape[1]
        cache = given.get("cache", given.get("past_key_values"))
        cached = 0 if cache is None else cache.get_seq_length()
        if cached:
            if types_ is not None and bool(types_[:, -length:].any()):
                raise ValueError(
                    f"visionpe scheme {self.scheme!r} places visual tokens per layer or masks them as a block when "
                    f"the prompt is encoded; visual tokens after {cached} cached tokens are not supported: encode "
                    "every image and video in the first (uncached) call"
                )
            if self.deltas is None:
                return None
            batch = tokens.shape[0]
            offsets = {v: d.repeat_interleave(batch // d.shape[0], dim=0) for v, d in self.deltas.items()}
            return _Call(offsets, {}, self.alias)
        self.deltas, self.alias = None, {}
        if types_ is None or not bool(types_.any()):
            return None  # all text: every layer has the plain ids and the plain causal mask
        image, video = given.get("image_grid_thw"), given.get("video_grid_thw")
        time = given.get("second_per_grid_ts")
        if image is None and video is None:
            # generate encodes the images before the prefill and drops the grids from the model's inputs
            recalled = self._recall(types_)
            if recalled is None:
                raise ValueError(
                    f"visionpe scheme {self.scheme!r} needs image_grid_thw / video_grid_thw to place the visual tokens "
                    "that mm_token_type_ids marks (per-layer positions and the mask inside each block)"
                )
            image, video, time = recalled
        mask = given.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.ndim != 2):
            shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(
                f"visionpe scheme {self.scheme!r} builds its own attention masks from a (B, L) attention_mask of 1 "
                f"(token) and 0 (padding), got {shape}"
            )
        if self.block_mask and cache is not None and getattr(cache, "is_compileable", False):
            raise ValueError(
                f"visionpe scheme {self.scheme!r} builds (B, 1, L, L) masks over the prompt, which a static cache of "
                f"another length cannot take: use a dynamic cache (the default), got {type(cache).__name__}"
            )
        if self.split_videos and video is not None:
            video = split_video_frames(video)
        layout = parse_layout(types_, image, video, mask, self.spatial_merge_size)
        options = dict(self.options)
        if self.takes_time and time is not None:
            options["second_per_grid_ts"] = time
        ids, deltas, allowed, designs = {}, {}, {}, {}
        for variant in self.variants:
            design = self.entry.run_design(layout, {**options, "layer": variant} if self.entry.layer_of else options)
            same = [u for u, d in designs.items() if _same_design(d, design)]
            if same:  # e.g. PyPE's deeper layers once every block is down to one level: share tables and masks
                self.alias[variant] = same[0]
                continue
            designs[variant] = design
            if len(self.variants) > 1:
                ids[variant], deltas[variant] = assemble_positions(
                    layout, design, pad_value=0, delta_convention="valid"
                )
            if self.block_mask:
                allowed[variant] = visual_block_mask(layout, design.local[0])
        base = self.base
        offsets = {v: ids[v] - ids[base] for v in ids if v != base}
        self.deltas = {v: deltas[v] - deltas[base] for v in deltas if v != base} or None
        return _Call(offsets, allowed, self.alias)


def _same_design(a: Any, b: Any) -> bool:
    """Whether two design outputs give the same ids (same offsets, advances and rows)."""
    return (
        a.anchored == b.anchored
        and a.delta_rows == b.delta_rows
        and a.integer == b.integer
        and a.text_advance is None
        and b.text_advance is None
        and a.local.shape == b.local.shape
        and torch.equal(a.local, b.local)
        and torch.equal(a.advance, b.advance)
    )


def bind_arguments(method: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name (transformers calls with keywords; positional ones are matched to the signature
    of ``method``)."""
    if not callable(method):
        raise TypeError(f"method must be callable, got {type(method).__name__}")
    if not args:
        return dict(kwargs)

    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [n for n, p in inspect.signature(method).parameters.items() if p.kind in positional]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _previous_forward(module: nn.Module) -> Any:
    """The forward that ran before the plan was installed: an instance one (e.g. accelerate's hooks) or the class's."""
    previous = module.__dict__.get("visionpe_forward_before")
    return previous if previous is not None else type(module).forward.__get__(module)


def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
    own = _previous_forward(self)
    plan = self.__dict__.get("visionpe_plan")
    if plan is None:
        return own(*args, **kwargs)
    plan.call = plan.prepare(self, bind_arguments(own, args, kwargs))
    try:
        return own(*args, **kwargs)
    finally:
        plan.call = None


def _rotary_forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    own = _previous_forward(self)
    out = own(x, position_ids)
    plan = self.__dict__.get("visionpe_plan")
    call = plan.call if plan is not None else None
    if call is not None:
        for variant, offset in call.offsets.items():
            call.tables[variant] = own(x, position_ids + offset.to(position_ids.device))
    return out


def _layer_forward(self, *args: Any, **kwargs: Any) -> Any:
    own = _previous_forward(self)
    plan = self.__dict__.get("visionpe_plan")
    call = plan.call if plan is not None else None
    if call is not None:
        if len(args) > 1:  # transformers passes everything but the hidden states by keyword
            kwargs = bind_arguments(own, args, kwargs)
            args = (kwargs.pop("hidden_states"),)
        variant = plan.layer_variant[self.__dict__["visionpe_layer_index"]]
        variant = call.alias.get(variant, variant)
        if variant in call.tables:
            kwargs["position_embeddings"] = call.tables[variant]
        if variant in call.allowed:
            hidden = args[0] if args else kwargs["hidden_states"]
            kwargs["attention_mask"] = call.mask(variant, hidden.dtype, hidden.device)
    return own(*args, **kwargs)


for _function in (_model_forward, _rotary_forward, _layer_forward):
    _function.visionpe_patch = True


def _patch(module: nn.Module, function: Any, plan: LayerPlan, **attributes: Any) -> None:
    module.__dict__["visionpe_forward_before"] = module.__dict__.get("forward")
    module.__dict__["visionpe_plan"] = plan
    module.__dict__.update({f"visionpe_{k}": v for k, v in attributes.items()})
    module.forward = types.MethodType(function, module)


def _unpatch(module: nn.Module) -> None:
    if not getattr(module.__dict__.get("forward"), "visionpe_patch", False):
        return
    previous = module.__dict__.pop("visionpe_forward_before", None)
    del module.__dict__["forward"]
    if previous is not None:
        module.forward = previous
    module.__dict__.pop("visionpe_plan", None)
    module.__dict__.pop("visionpe_layer_index", None)


def _patched_modules(vl_model: nn.Module) -> list[nn.Module]:
    language = vl_model.language_model
    return [vl_model, language.rotary_emb, *language.layers]


def install(vl_model: nn.Module, plan: LayerPlan | None) -> None:
    """Install ``plan`` on the vision-language model (replacing any earlier one); None only removes the earlier one."""
    uninstall(vl_model)
    if plan is None or not plan.needed:
        return
    _patch(vl_model, _model_forward, plan)
    _patch(vl_model.language_model.rotary_emb, _rotary_forward, plan)
    for index, layer in enumerate(vl_model.language_model.layers):
        _patch(layer, _layer_forward, plan, layer_index=index)


def uninstall(vl_model: nn.Module) -> None:
    """Put back the forwards that :func:`install` replaced (a no-op on a model without a plan)."""
    for module in _patched_modules(vl_model):
        _unpatch(module)


def installed_plan(vl_model: nn.Module) -> LayerPlan | None:
    """The plan installed on ``vl_model``, or None."""
    return vl_model.__dict__.get("visionpe_plan")
