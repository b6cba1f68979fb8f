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
- The others use their registered defaults (``videorope`` delta = 2, ``mrope_interleaved`` and ``mhrope``
  without spatial reset, as released).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from visionpe.multimodal import get_multimodal_scheme, sample_hope_scale, sample_v2pe_delta

__all__ = ["BenchScheme", "BENCH_SCHEMES", "DEFAULT_SCHEMES", "get_bench_scheme"]


@dataclass(frozen=True)
class BenchScheme:
    """A benchmark entry: ``scheme`` (registered name), ``options`` (evaluation design options),
    ``train_options`` (batch size, generator, visual blocks in the batch) -> design options drawn for a training
    step (per image or visual span, as the papers draw them), or None;
    ``video_as_images``: feed video frames as consecutive images."""

    name: str
    scheme: str
    options: dict[str, Any] = field(default_factory=dict)
    train_options: Callable[[int, torch.Generator | None, int], dict[str, Any]] | None = None
    video_as_images: bool = False
    note: str = ""

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
        BenchScheme("circle_rope", "circle_rope", video_as_images=True, note="Circle-RoPE (video frames as images)"),
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
