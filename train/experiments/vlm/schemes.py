"""The position schemes the benchmark compares, each with its papers' training and evaluation settings.

Every entry is a registered visionpe multimodal scheme (:func:`visionpe.multimodal.list_multimodal_schemes`)
plus the design options used at evaluation and, for the schemes whose papers randomise them during training,
a sampler of per-sample options:

- ``rope_1d``: the baseline, plain 1-D RoPE over the token sequence. It is V2PE with delta = 1 (every token,
  visual or not, advances the position by 1, all three rows equal, one axis on every pair), which is exactly
  1-D RoPE (V2PE, Ge et al., arXiv 2412.09616, with delta = 1).
- ``v2pe``: training draws delta per sample from {1, 1/2, ..., 1/256} (the paper's ``v2pe_rnd``); evaluation
  uses delta = 1/4 (its fixed-stride evaluation).
- ``hope``: training draws the temporal scale gamma per sample from {0.5, 0.75, 1, 1.25, 1.5}; evaluation uses
  0.75 (the V-NIAH script). The papers draw per visual span; one value per sample is the same for one image
  or one video and shares it across the images of a multi-image sample.
- ``circle_rope`` is defined for images only: on the video task its frames are given as consecutive images
  (same pixels, same tokens) and the scheme places them as its paper places several images.
- ``circle_rope_age``: Circle-RoPE with AGE (``age=True``, the paper's ``strategy_4`` and the released
  configuration): decoder layer 0 has the Circle-RoPE ids, layer 1 Qwen2-VL's M-RoPE ids (the benchmark's model has
  2 decoder layers, so one of each); the adapter builds layer 1's ids on every forward, as for PyPE. Its other
  options are those of the ``circle_rope`` row (alpha 0.5, radius 10, the paper's per-image shift of 1), and the
  video frames are given as consecutive images as there, so the two rows differ by AGE alone.
- ``mrope_abs_time`` (Qwen2.5-VL): the temporal id of frame t is floor(t * tokens_per_second * second_per_grid),
  with the released ``tokens_per_second`` = 2. The video task has no clock of its own (the sprite moves one cell per
  frame), so its clips are given a fixed frame rate of 1 frame per second in training and evaluation alike: with the
  temporal patch size 1 of the benchmark's model, ``second_per_grid_ts`` = 1 s for every video (``seconds_per_frame``,
  handed to the design with each batch, one value per video). That is the timing of Qwen2.5-VL's released
  processing (2 frames per second in temporal patches of 2: 1 s per temporal grid step), so consecutive frames are 2
  temporal ids apart, where Qwen2-VL's ``mrope`` puts them 1 apart. Images have t = 0 under both, so on the grid and
  multi-image tasks the design gives ``mrope``'s ids (the rows measure the seed-to-seed spread of the same design).
- The others use their registered defaults (``videorope`` delta = 2, ``mrope_interleaved`` and ``mhrope``
  without spatial reset, as released).

Five designs need more than ids from the token types and grids; each gets the inputs it needs:

- ``cca`` (Xing et al., NeurIPS 2024): concentric ids and its intra-image attention mask. The adapter
  (``apply_position_scheme``) builds the (B, 1, L, L) additive mask from the 2-D attention mask, the token types
  and the grids on every forward, and hands it to each decoder layer (SDPA attention).
- ``pype`` (Chen et al., 2025): per-layer ids and masks, also built by the adapter, each decoder layer rotated with
  its own ids. ``interval`` = 1: the paper drops one concentric level every k layers over a 32-layer model; the
  benchmark's model has 2 decoder layers, so with any k > 1 both layers would have CCA's ids, and k = 1 is the
  only interval under which the pyramid descends at all (layer 1 merges the two innermost levels).
- ``bipe`` (He et al., ICML 2024): the inter-segment index as the rotary position, the intra-segment index as an
  absolute embedding added to the inputs (:func:`~visionpe.multimodal.bipe_side_index`: a learned table of 1,024
  rows for text, as released; a fixed 2-D sin-cos of the (row, column) inside its frame for visual tokens). Every
  image and every video frame is a segment of its own (the library's reading); the text before an image ends its
  sentence at ``<vs>`` (the separator, ``separator_ids``), so the question is one segment, the text between two
  images one, and the closing ``<ve> <ask>`` one.
- ``ppe`` (Huang et al., ICLR 2026): the vision tower's output is merged before the language model as in the
  released code (DPC-kNN clustering, Chat-UniVi's CTM with k = 5 neighbours, each image and each video frame
  separately, keeping ``ceil(0.45 N)`` tokens of N: ``spatial_clustering_ratio`` 0.45), and every merged token keeps
  the M-RoPE ids of K members of its cluster (:class:`~visionpe.multimodal.PPERotary`). The released K = 8 splits
  each of the (16, 24, 24) sections of 64 pairs into sub-bands of 2, 3 and 3 pairs; the benchmark's heads have 8
  pairs ((2, 3, 3)), on which K = 8 would leave the h and w rows without a pair, so K = 2 (one-pair sub-bands
  cycling over t1, t2, h1, h2, w1, w2, as the released code does when K does not divide the sections).
- ``rope_dhr`` (Liu et al., ICML 2025): tiled images, the tiles reusing the thumbnail's ids (``tile_grid`` from the
  batch; :func:`~experiments.vlm.tasks.tile_image`). Only the grid task has images larger than one tile: a
  multi-image image or a video frame is one tile, on which RoPE-DHR's ids are 1-D RoPE's (the ``rope_1d`` row), and
  the paper covers images only, so those two tasks are not run (``not_applicable``) and the tables say so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from visionpe.multimodal import get_multimodal_scheme, sample_hope_scale, sample_v2pe_delta

from .tasks import TASKS, TOKENS

__all__ = [
    "BenchScheme",
    "BENCH_SCHEMES",
    "DEFAULT_SCHEMES",
    "PPE_CLUSTERING_RATIO",
    "VIDEO_SECONDS_PER_FRAME",
    "get_bench_scheme",
]

PPE_CLUSTERING_RATIO = 0.45  # the released PPE configuration's spatial_clustering_ratio
VIDEO_SECONDS_PER_FRAME = 1.0  # mrope_abs_time's clock for the video task: 1 frame per second, temporal patch 1


@dataclass(frozen=True)
class BenchScheme:
    """A benchmark entry: ``scheme`` (registered name), ``options`` (evaluation design options),
    ``train_options`` (batch size, generator, visual blocks in the batch) -> design options drawn for a training
    step (per image or visual span, as the papers draw them), or None;
    ``video_as_images``: feed video frames as consecutive images;
    ``batch_options``: design options read from the batch under the same name (``input_ids``, ``tile_grid``);
    ``tiled``: the task data cut large images into tiles and a thumbnail;
    ``side_embedding``: BiPE's intra-segment embedding is added to the inputs;
    ``merge_ratio``: visual tokens are merged before the language model, this fraction of each image or frame kept;
    ``not_applicable``: {task: why the design does not apply to it}; those combinations are not run;
    ``seconds_per_frame``: the video timing of a design that reads it (Qwen2.5-VL's ``second_per_grid_ts``, one value
    per video of each batch, training and evaluation alike), or None."""

    name: str
    scheme: str
    options: dict[str, Any] = field(default_factory=dict)
    train_options: Callable[[int, torch.Generator | None, int], dict[str, Any]] | None = None
    video_as_images: bool = False
    note: str = ""
    batch_options: tuple[str, ...] = ()
    tiled: bool = False
    side_embedding: bool = False
    merge_ratio: float | None = None
    not_applicable: dict[str, str] = field(default_factory=dict)
    seconds_per_frame: float | None = None

    def __post_init__(self) -> None:
        spf = self.seconds_per_frame
        if spf is not None and (isinstance(spf, bool) or not isinstance(spf, (int, float)) or not 0 < spf < 1e9):
            raise ValueError(f"seconds_per_frame must be a positive finite number or None, got {spf!r}")

    def call_inputs(self, video_grid_thw: torch.Tensor | None) -> dict[str, Any]:
        """The per-call inputs of the design for a batch with videos ``video_grid_thw`` (V, 3) or None: with
        ``seconds_per_frame``, ``second_per_grid_ts`` as a list of V values (as Qwen2.5-VL's processor gives it);
        otherwise none."""
        if video_grid_thw is not None and (not isinstance(video_grid_thw, torch.Tensor) or video_grid_thw.ndim != 2):
            raise ValueError(f"video_grid_thw must be a (V, 3) tensor or None, got {video_grid_thw!r}")
        if self.seconds_per_frame is None or video_grid_thw is None:
            return {}
        return {"second_per_grid_ts": [float(self.seconds_per_frame)] * int(video_grid_thw.shape[0])}

    def applies_to(self, task: str) -> bool:
        """Whether the benchmark runs this design on ``task``."""
        if not isinstance(task, str) or task not in TASKS:
            raise ValueError(f"task must be one of {sorted(TASKS)}, got {task!r}")
        return task not in self.not_applicable

    def design_options(
        self, batch_size: int, generator: torch.Generator | None, training: bool, num_blocks: int = 1
    ) -> dict[str, Any]:
        """The design options for one batch: drawn in training when the paper does so, one value per visual block
        (``num_blocks``: at least the most visual blocks of one sample; the batch's total is enough)."""
        if training and self.train_options is not None:
            return self.train_options(batch_size, generator, num_blocks)
        return dict(self.options)


def _v2pe_train(batch_size: int, generator: torch.Generator | None, num_blocks: int) -> dict[str, Any]:
    return {"delta": sample_v2pe_delta(batch_size, generator, num_blocks)}  # per image, as V2PE draws it


def _hope_train(batch_size: int, generator: torch.Generator | None, num_blocks: int) -> dict[str, Any]:
    return {"temporal_scale": sample_hope_scale(batch_size, generator, num_blocks)}  # per visual span, as HoPE draws it


BENCH_SCHEMES: dict[str, BenchScheme] = {
    s.name: s
    for s in (
        BenchScheme("rope_1d", "v2pe", {"delta": 1.0}, note="1-D RoPE baseline (V2PE with delta = 1)"),
        BenchScheme("mrope", "mrope", note="Qwen2-VL M-RoPE"),
        BenchScheme("mrope_interleaved", "mrope_interleaved", note="Qwen3-VL MRoPE-I"),
        BenchScheme("mhrope", "mhrope", note="MHRoPE (head-wise allocation)"),
        BenchScheme("v2pe", "v2pe", {"delta": 0.25}, _v2pe_train, note="V2PE: train delta random, eval 1/4"),
        BenchScheme("vrope", "vrope", note="VRoPE"),
        BenchScheme("videorope", "videorope", note="VideoRoPE (delta = 2)"),
        BenchScheme("hope", "hope", {"temporal_scale": 0.75}, _hope_train, note="HoPE: train gamma random, eval 0.75"),
        BenchScheme(
            "mrope_abs_time",
            "mrope_abs_time",
            {"tokens_per_second": 2.0},
            seconds_per_frame=VIDEO_SECONDS_PER_FRAME,
            note="Qwen2.5-VL M-RoPE, time ids in seconds (2 per second, clips at 1 frame per second)",
        ),
        BenchScheme("circle_rope", "circle_rope", video_as_images=True, note="Circle-RoPE (video frames as images)"),
        BenchScheme(
            "circle_rope_age",
            "circle_rope",
            {"age": True},
            video_as_images=True,
            note="Circle-RoPE with AGE: Circle-RoPE ids on even layers, M-RoPE on odd (video frames as images)",
        ),
        BenchScheme("cca", "cca", note="CCA: concentric ids and the inward intra-image mask"),
        BenchScheme("pype", "pype", {"interval": 1}, note="PyPE: CCA at layer 0, one level fewer per layer"),
        BenchScheme(
            "bipe",
            "bipe",
            {"separator_ids": (TOKENS["<vs>"],)},
            batch_options=("input_ids",),
            side_embedding=True,
            note="BiPE: segment index as position, intra-segment embedding added",
        ),
        BenchScheme(
            "ppe",
            "ppe",
            {"num_representatives": 2},
            merge_ratio=PPE_CLUSTERING_RATIO,
            note="PPE: 45 % of the visual tokens kept (DPC-kNN), K = 2 positions per merged token",
        ),
        BenchScheme(
            "rope_dhr",
            "rope_dhr",
            batch_options=("tile_grid",),
            tiled=True,
            not_applicable={
                "multi_image": "every image is one tile, on which RoPE-DHR is 1-D RoPE (see rope_1d)",
                "video": "RoPE-DHR is defined for tiled images; a frame is one tile",
            },
            note="RoPE-DHR: tiles + thumbnail, the tiles reusing the thumbnail's ids",
        ),
    )
}
DEFAULT_SCHEMES = tuple(BENCH_SCHEMES)

for _entry in BENCH_SCHEMES.values():  # fail at import if the registry and this table drift apart
    get_multimodal_scheme(_entry.scheme).check_options(_entry.options)


def get_bench_scheme(name: str) -> BenchScheme:
    """The benchmark entry ``name``; an unknown name raises ValueError listing the valid ones."""
    if not isinstance(name, str):
        raise TypeError(f"scheme must be a str, got {type(name).__name__} ({name!r})")
    if name not in BENCH_SCHEMES:
        raise ValueError(f"scheme must be one of {list(BENCH_SCHEMES)}, got {name!r}")
    return BENCH_SCHEMES[name]
