"""Tiny diffusion transformers trained on the project's procedural data, sampled beyond their training size.

What ``train/diffusion.py`` is made of:

- Data: scenes (:mod:`.scenes`, the ``colour`` task's scenes: one coloured object and grey distractors on a lattice
  of cells) as images in [-1, 1], cut into patches by hand (:func:`patchify`) and numbered as Flux numbers its
  latent patches (:func:`flux_ids`: index 0, row, column); moving digits (:mod:`.moving_digits`) as grey clips.
- Models: a tiny diffusers ``FluxTransformer2DModel`` (:func:`tiny_flux`) and ``WanTransformer3DModel``
  (:func:`tiny_wan`), conditioned on nothing but a constant: one text token of zeros (and, for Flux, a pooled
  vector of zeros), so the learned bias of the text projection is the only "prompt".
- Training: rectified flow (flow matching): ``x_t = (1 - t) x0 + t eps`` with ``t`` drawn logit-normal, the model
  predicts ``eps - x0`` (:func:`train_denoiser`, with an exponential moving average of the weights, which samples).
- Sampling: Euler over ``steps`` equal steps of sigma from 1 to 0 (:func:`sample`); the transformer gets the
  timestep as the pipelines pass it (Flux: sigma in [0, 1]; Wan: sigma * 1000), so DyPE's schedule reads sigma.
- Measures: objects per image and their areas, from a detector built on how :func:`~.scenes.render` draws a scene
  (:func:`detect_objects`; :func:`validate_detector` checks it on rendered scenes), and the similarity of frame f to
  frame f + lag of a clip (:func:`lag_similarity`), which is high where a generated clip repeats itself.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from visionpe.checks import check_choice, check_float, check_instance, check_int

from .scenes import CELLS, SHAPES, Scenes, render, sample_scenes

__all__ = [
    "DETECT_MIN_AREA",
    "DETECT_THRESHOLD",
    "SCENE_TASK",
    "TIMESTEPS",
    "data_statistics",
    "denoise",
    "detect_objects",
    "digit_clips",
    "flux_ids",
    "label_components",
    "lag_similarity",
    "object_areas",
    "patchify",
    "preconditioning",
    "sample",
    "scene_images",
    "tiny_flux",
    "tiny_wan",
    "train_denoiser",
    "transformer_call",
    "unpatchify",
    "validate_detector",
]

#: how :func:`train_denoiser` draws the noise level t of a training sample
TIMESTEPS = ("uniform", "logit-normal")
#: the scenes generated: those of the ``colour`` task (one coloured object, grey distractors at the given density)
SCENE_TASK = "colour"
#: a pixel belongs to an object when its brightest channel exceeds this (objects are coverage x colour on black;
#: the darkest grey is 0.3, so a pixel of it counts when more than two thirds of it is covered)
DETECT_THRESHOLD = 0.2
#: components smaller than this many pixels are not counted (the smallest rendered object keeps 4 pixels above the
#: threshold at 32 px per unit; smaller specks in a generated image are noise, not objects)
DETECT_MIN_AREA = 3


def _check_images(images: object, name: str = "images") -> torch.Tensor:
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or not images.is_floating_point():
        got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"{name} must be a float (N, C, H, W) tensor, got {got}")
    return images


# --- data ---------------------------------------------------------------------------------------------------------


def scene_images(
    n: int, generator: torch.Generator, field: float = 1.0, px_per_unit: int = 32, density: float = 0.3
) -> tuple[torch.Tensor, Scenes]:
    """``n`` scenes of :data:`SCENE_TASK` on a field of ``field`` units rendered at ``px_per_unit``: (images in
    [0, 1] (n, 3, S, S) with S = field * px_per_unit, the descriptions).

    Example:
        >>> images, scenes = scene_images(2, torch.Generator().manual_seed(0), field=2.0)
        >>> tuple(images.shape), scenes.cells
        ((2, 3, 64, 64), 8)
    """
    check_int(n, "n", min=1)
    check_instance(generator, "generator", torch.Generator, expected="a torch.Generator")
    scenes, _ = sample_scenes(SCENE_TASK, n, generator, field=field, density=density)
    return render(scenes, px_per_unit), scenes


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """(N, C, H, W) -> (N, (H / p)(W / p), C p p) tokens, row-major over the patch grid, each patch's values in
    (channel, row, column) order (what diffusers' Flux pipeline does to its latents, with ``patch`` for its 2)."""
    images = _check_images(images)
    check_int(patch, "patch", min=1)
    n, c, h, w = images.shape
    if h % patch or w % patch:
        raise ValueError(f"patch must divide the image's height and width, got patch={patch} for {h} x {w}")
    x = images.reshape(n, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n, (h // patch) * (w // patch), c * patch * patch)


def unpatchify(tokens: torch.Tensor, patch: int, rows: int, cols: int) -> torch.Tensor:
    """The inverse of :func:`patchify`: (N, rows cols, C p p) -> (N, C, rows p, cols p)."""
    check_int(patch, "patch", min=1)
    check_int(rows, "rows", min=1)
    check_int(cols, "cols", min=1)
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 3 or tokens.shape[1] != rows * cols:
        got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"tokens must be a (N, {rows * cols}, C * {patch}^2) tensor, got {got}")
    if tokens.shape[2] % (patch * patch):
        raise ValueError(f"tokens must hold C * {patch * patch} values per token, got {tokens.shape[2]}")
    n, c = tokens.shape[0], tokens.shape[2] // (patch * patch)
    x = tokens.reshape(n, rows, cols, c, patch, patch).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(n, c, rows * patch, cols * patch)


def flux_ids(rows: int, cols: int) -> torch.Tensor:
    """Flux's ``img_ids`` of a ``rows x cols`` grid of image tokens: (rows cols, 3) float, (0, row, column) each."""
    check_int(rows, "rows", min=1)
    check_int(cols, "cols", min=1)
    ids = torch.zeros(rows, cols, 3)
    ids[..., 1] = torch.arange(rows, dtype=torch.float32)[:, None]
    ids[..., 2] = torch.arange(cols, dtype=torch.float32)[None, :]
    return ids.reshape(-1, 3)


def digit_clips(datamodule, n: int, num_frames: int, generator: torch.Generator, evaluation: bool = False):
    """``n`` grey moving-digit clips in [0, 1], (n, 1, num_frames, S, S), from an :class:`~.moving_digits.
    MovingDigitsDataModule` (set up here): training clips drawn at random epochs and indices from ``generator``,
    or (``evaluation``) the first ``n`` fixed evaluation clips continued to ``num_frames``."""
    from .moving_digits import MovingDigitsDataModule

    check_instance(datamodule, "datamodule", MovingDigitsDataModule, expected="a MovingDigitsDataModule")
    check_int(n, "n", min=1)
    check_int(num_frames, "num_frames", min=2)
    check_instance(generator, "generator", torch.Generator, expected="a torch.Generator")
    datamodule.setup()
    if evaluation:
        dataset = datamodule._val(num_frames)
        if n > len(dataset):
            raise ValueError(f"n must be at most the {len(dataset)} evaluation clips, got {n}")
        items = [dataset[i] for i in range(n)]
    else:
        if num_frames != datamodule.num_frames:
            raise ValueError(f"num_frames must be the training length {datamodule.num_frames}, got {num_frames}")
        dataset = datamodule.train_dataset
        epochs = torch.randint(1 << 20, (n,), generator=generator).tolist()
        indices = torch.randint(len(dataset), (n,), generator=generator).tolist()
        items = [dataset[(i, e)] for i, e in zip(indices, epochs, strict=True)]
    mean, std = datamodule.mean[0], datamodule.std[0]
    clips = torch.stack([x[:1] for x, _ in items]) * std + mean  # grey: every channel holds the same values
    return clips.clamp(0, 1)


# --- the object detector ------------------------------------------------------------------------------------------


def label_components(mask: torch.Tensor) -> torch.Tensor:
    """4-connected components of a (N, H, W) bool mask: (N, H, W) int64, 0 off the mask, else a label shared by
    the pixels of one component (the largest flat index + 1 among them), by propagating the maximum to the four
    neighbours until nothing changes."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.ndim != 3:
        got = f"{tuple(mask.shape)} {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a (N, H, W) bool tensor, got {got}")
    n, h, w = mask.shape
    index = torch.arange(1, h * w + 1).view(1, h, w).expand(n, h, w)
    labels = torch.where(mask, index, torch.zeros_like(index))
    while True:
        p = F.pad(labels, (1, 1, 1, 1))
        around = torch.stack([labels, p[:, :-2, 1:-1], p[:, 2:, 1:-1], p[:, 1:-1, :-2], p[:, 1:-1, 2:]]).amax(0)
        new = torch.where(mask, around, labels)
        if torch.equal(new, labels):
            return labels
        labels = new


def detect_objects(
    images: torch.Tensor, threshold: float = DETECT_THRESHOLD, min_area: int = DETECT_MIN_AREA
) -> list[torch.Tensor]:
    """The objects of every image of ``images`` ((N, C, H, W) in [0, 1], black background): per image, the (K,)
    int64 areas in pixels of its K objects.

    An object is a 4-connected component of pixels whose brightest channel exceeds ``threshold`` with at least
    ``min_area`` pixels. :func:`~.scenes.render` draws each object inside its own lattice cell with a margin to the
    cell's border (anti-aliased, coverage times colour on black, the darkest grey 0.3), so on rendered scenes each
    object is one component (:func:`validate_detector` measures how often the count is exact).

    Example:
        >>> images, scenes = scene_images(4, torch.Generator().manual_seed(0))
        >>> [len(a) for a in detect_objects(images)] == scenes.occupied.flatten(1).sum(1).tolist()
        True
    """
    images = _check_images(images)
    check_float(threshold, "threshold", min=0, max=1, min_open=True, max_open=True)
    check_int(min_area, "min_area", min=1)
    labels = label_components(images.amax(1) > threshold).flatten(1)
    out = []
    for row in labels:
        _, areas = row[row > 0].unique(return_counts=True)
        out.append(areas[areas >= min_area])
    return out


def object_areas(scenes: Scenes, px_per_unit: int) -> torch.Tensor:
    """(N, G, G) analytic area in pixels of the object of every cell (0 for an empty cell), from its shape and
    radius as :func:`~.scenes.render` draws them: a circle pi r^2, a square (2 0.85 r)^2, a diamond 2 r^2."""
    check_instance(scenes, "scenes", Scenes, expected="a Scenes batch")
    check_int(px_per_unit, "px_per_unit", min=1)
    r = scenes.radius * px_per_unit
    by_shape = {"circle": math.pi * r * r, "square": (2 * 0.85 * r) ** 2, "diamond": 2 * r * r}
    area = torch.zeros_like(r)
    for index, name in enumerate(SHAPES):
        area = torch.where(scenes.shape == index, by_shape[name], area)
    return area * scenes.occupied


def validate_detector(n: int, generator: torch.Generator, field: float = 1.0, px_per_unit: int = 32) -> dict:
    """How well :func:`detect_objects` reads ``n`` rendered scenes of ``field`` units: the share of images whose
    count is exact (``exact``), the mean count found and true (``found``, ``true``), and per object matched to its
    cell by the component's centroid, the mean detected and analytic areas (px) and their correlation (``area``,
    ``analytic_area``, ``area_corr``)."""
    check_int(n, "n", min=1)
    images, scenes = scene_images(n, generator, field, px_per_unit)
    true = scenes.occupied.flatten(1).sum(1)
    found = torch.tensor([len(a) for a in detect_objects(images)])
    # per object: the component covering the object's centre pixel, its area against the analytic one
    labels = label_components(images.amax(1) > DETECT_THRESHOLD)
    centre = (scenes.centre * px_per_unit).long().clamp(0, images.shape[-1] - 1)
    rows, cy, cx = torch.nonzero(scenes.occupied, as_tuple=True)
    hit = labels[rows, centre[rows, cy, cx, 1], centre[rows, cy, cx, 0]]
    counts = torch.stack([torch.bincount(lab.flatten(), minlength=lab.numel() + 1) for lab in labels])
    detected = counts[rows, hit].float() * (hit > 0)
    analytic = object_areas(scenes, px_per_unit)[rows, cy, cx]
    corr = torch.corrcoef(torch.stack([detected, analytic]))[0, 1]
    return {
        "images": n,
        "exact": float((found == true).float().mean()),
        "found": float(found.float().mean()),
        "true": float(true.float().mean()),
        "area": float(detected.mean()),
        "analytic_area": float(analytic.mean()),
        "area_corr": float(corr),
        "cells": CELLS * field,
    }


# --- the video measure --------------------------------------------------------------------------------------------


def lag_similarity(clips: torch.Tensor, lag: int) -> torch.Tensor:
    """(N,) the mean over f of the cosine similarity between frame f and frame f + ``lag`` of each clip
    ((N, C, T, H, W), T > lag), every frame centred on its own mean first (so a constant background does not count
    as similar; a frame without variation counts as dissimilar to everything)."""
    if not isinstance(clips, torch.Tensor) or clips.ndim != 5 or not clips.is_floating_point():
        got = tuple(clips.shape) if isinstance(clips, torch.Tensor) else type(clips).__name__
        raise ValueError(f"clips must be a float (N, C, T, H, W) tensor, got {got}")
    check_int(lag, "lag", min=1)
    if clips.shape[2] <= lag:
        raise ValueError(f"lag must be shorter than the clips' {clips.shape[2]} frames, got {lag}")
    frames = clips.transpose(1, 2).flatten(2)  # (N, T, C H W)
    frames = frames - frames.mean(-1, keepdim=True)
    return F.cosine_similarity(frames[:, :-lag], frames[:, lag:], dim=-1, eps=1e-8).mean(1)


# --- models, training, sampling -----------------------------------------------------------------------------------


def tiny_flux(patch: int, width: int = 64, heads: int = 2, double: int = 2, single: int = 2, channels: int = 3):
    """A tiny ``FluxTransformer2DModel`` on hand-made patches of ``patch`` x ``patch`` pixels of ``channels``
    channels: ``heads`` heads of ``width / heads`` channels, ``double`` double-stream and ``single`` single-stream
    blocks; the rotary's axes (index, height, width) get ``(d - 2 b, b, b)`` channels with ``b`` the largest even
    number up to ``0.44 d`` (Flux's 16, 56, 56 of 128), text and pooled inputs of 8 channels."""
    from diffusers import FluxTransformer2DModel

    check_int(patch, "patch", min=1)
    check_int(heads, "heads", min=1)
    check_int(width, "width", min=8 * heads)
    if width % heads or (width // heads) % 4:
        raise ValueError(f"width must be heads times a multiple of 4, got width={width} with heads={heads}")
    check_int(double, "double", min=0)
    check_int(single, "single", min=0)
    check_int(channels, "channels", min=1)
    head = width // heads
    side = 2 * int(0.44 * head / 2)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=channels * patch * patch,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=head,
        num_attention_heads=heads,
        joint_attention_dim=8,
        pooled_projection_dim=8,
        axes_dims_rope=(head - 2 * side, side, side),
    )


def tiny_wan(patch: int, width: int = 64, heads: int = 2, layers: int = 2, channels: int = 1):
    """A tiny ``WanTransformer3DModel`` on pixels: patches of 1 frame x ``patch`` x ``patch`` pixels of
    ``channels`` channels, ``heads`` heads of ``width / heads`` channels (Wan's rotary splits a head of d into
    time, height and width blocks of d - 4 (d // 6), 2 (d // 6), 2 (d // 6)), ``layers`` blocks, a text input of
    8 channels."""
    from diffusers import WanTransformer3DModel

    check_int(patch, "patch", min=1)
    check_int(heads, "heads", min=1)
    check_int(width, "width", min=12 * heads)
    if width % heads or (width // heads) % 2:
        raise ValueError(f"width must be heads times an even number, got width={width} with heads={heads}")
    check_int(layers, "layers", min=1)
    check_int(channels, "channels", min=1)
    return WanTransformer3DModel(
        patch_size=(1, patch, patch),
        num_attention_heads=heads,
        attention_head_dim=width // heads,
        in_channels=channels,
        out_channels=channels,
        text_dim=8,
        freq_dim=32,
        ffn_dim=4 * width,
        num_layers=layers,
        rope_max_seq_len=64,
    )


def _family(model: nn.Module) -> str:
    names = {cls.__name__ for cls in type(model).__mro__}
    if "FluxTransformer2DModel" in names:
        return "flux"
    if "WanTransformer3DModel" in names:
        return "wan"
    raise TypeError(f"model must be a diffusers FluxTransformer2DModel or WanTransformer3DModel, got {type(model)}")


def transformer_call(model: nn.Module, x: torch.Tensor, sigma: torch.Tensor, patch: int) -> torch.Tensor:
    """The transformer's output for the input ``x`` at noise level ``sigma`` ((N,) in [0, 1]), called as the pipelines
    call it.

    Flux: ``x`` (N, C, H, W) pixels, cut into ``patch`` x ``patch`` tokens here, the timestep sigma (as Flux's
    pipeline passes it), one text token of zeros and a pooled vector of zeros. Wan: ``x`` (N, C, T, H, W), patched by
    the model itself, the timestep sigma * 1000 (as Wan's pipeline passes it), one text token of zeros."""
    family = _family(model)
    n = x.shape[0]
    if family == "flux":
        rows, cols = x.shape[-2] // patch, x.shape[-1] // patch
        out = model(
            hidden_states=patchify(x, patch),
            encoder_hidden_states=x.new_zeros(n, 1, model.config.joint_attention_dim),
            pooled_projections=x.new_zeros(n, model.config.pooled_projection_dim),
            timestep=sigma,
            img_ids=flux_ids(rows, cols),
            txt_ids=x.new_zeros(1, 3),
            return_dict=False,
        )[0]
        return unpatchify(out, patch, rows, cols)
    return model(
        hidden_states=x,
        timestep=sigma * 1000,
        encoder_hidden_states=x.new_zeros(n, 1, model.config.text_dim),
        return_dict=False,
    )[0]


def preconditioning(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(c_in, c_skip, c_out) at noise levels ``sigma`` for data of unit variance: the velocity is predicted as
    ``c_skip x_t + c_out F(c_in x_t)`` (Karras et al.'s preconditioning, EDM 2022, written for rectified flow).

    With ``x_t = (1 - t) x0 + t eps`` and ``v = eps - x0``: Var(x_t) = (1 - t)^2 + t^2 = D, c_in = 1 / sqrt(D)
    (the transformer sees unit variance), c_skip = Cov(v, x_t) / D = (2 t - 1) / D (the best linear guess of v from
    x_t), c_out = 1 / sqrt(D) (the standard deviation of what is left, so the transformer's target has unit
    variance at every t). Near t = 1 the velocity is mostly the input itself, which the skip carries; without it
    the tiny transformers must copy the noise through their normalised residual stream, and do it badly."""
    if not isinstance(sigma, torch.Tensor):
        raise TypeError(f"sigma must be a tensor of noise levels in [0, 1], got {type(sigma).__name__}")
    d = (1 - sigma) ** 2 + sigma**2
    return d.rsqrt(), (2 * sigma - 1) / d, d.rsqrt()


def _expand(c: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return c.view((-1,) + (1,) * (like.ndim - 1))


def denoise(model: nn.Module, x: torch.Tensor, sigma: torch.Tensor, patch: int) -> torch.Tensor:
    """The prediction of ``eps - x0`` for ``x`` (data normalised to unit variance plus noise) at noise levels
    ``sigma`` ((N,) in [0, 1]): ``c_skip x + c_out transformer(c_in x)`` (:func:`preconditioning`,
    :func:`transformer_call`)."""
    c_in, c_skip, c_out = (_expand(c, x) for c in preconditioning(sigma))
    return c_skip * x + c_out * transformer_call(model, c_in * x, sigma, patch)


def _check_normalisation(mean: float, std: float) -> None:
    check_float(mean, "mean", min=0, max=1, expected="the data's mean pixel value in [0, 1]")
    check_float(std, "std", min=0, min_open=True, expected="the data's pixel standard deviation, > 0")


def data_statistics(data: Callable[[int, torch.Generator], torch.Tensor], n: int = 512) -> tuple[float, float]:
    """(mean, std) of the pixel values of ``n`` samples ``data(n, generator)`` (a fixed generator): the
    normalisation :func:`train_denoiser` and :func:`sample` map the data to unit variance with."""
    check_int(n, "n", min=2)
    x = data(n, torch.Generator().manual_seed(2024))
    return float(x.mean()), float(x.std())


def train_denoiser(
    model: nn.Module,
    data: Callable[[int, torch.Generator], torch.Tensor],
    steps: int,
    batch_size: int,
    generator: torch.Generator,
    mean: float,
    std: float,
    patch: int = 1,
    lr: float = 1e-3,
    warmup: int = 100,
    ema: float = 0.998,
    timesteps: str = "uniform",
    log: Callable[[int, float], None] | None = None,
) -> tuple[nn.Module, list[float]]:
    """Train ``model`` by rectified flow for ``steps`` steps of ``batch_size`` fresh samples ``data(batch_size,
    generator)`` (in [0, 1], normalised to ``x0 = (x - mean) / std``); returns (the exponential moving average of
    its weights, the loss of every step).

    Each step: t uniform in [0, 1] (``timesteps="uniform"``) or logit-normal (``"logit-normal"``: the sigmoid of a
    standard normal, as SD3 trains), eps ~ N(0, 1), ``x_t = (1 - t) x0 + t eps``, the target ``v = eps - x0``
    predicted by :func:`denoise`; the loss is the mean squared error of the transformer's output against its share
    of the target, ``(v - c_skip x_t) / c_out`` (:func:`preconditioning`). AdamW (weight decay 0) at ``lr`` with
    ``warmup`` linear steps, then a cosine decay to 0; the average's decay ``ema``.
    """
    check_int(steps, "steps", min=1)
    check_int(batch_size, "batch_size", min=1)
    check_instance(generator, "generator", torch.Generator, expected="a torch.Generator")
    _check_normalisation(mean, std)
    check_float(lr, "lr", min=0, min_open=True)
    check_int(warmup, "warmup", min=0)
    check_float(ema, "ema", min=0, max=1, max_open=True)
    check_choice(timesteps, "timesteps", TIMESTEPS)
    _family(model)
    if any(type(m).__name__ in ("FluxRotary", "WanRotary") for m in model.modules()):
        # the average is a deep copy, whose timestep hook would still feed the original's rotary
        raise ValueError(
            "model must be trained as diffusers builds it: apply_position_scheme to the average it returns, not before"
        )
    average = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    losses = []
    model.train()
    for step in range(steps):
        x0 = (data(batch_size, generator) - mean) / std
        if timesteps == "uniform":
            t = torch.rand(batch_size, generator=generator)
        else:
            t = torch.sigmoid(torch.randn(batch_size, generator=generator))
        eps = torch.randn(x0.shape, generator=generator)
        tt = _expand(t, x0)
        xt = (1 - tt) * x0 + tt * eps
        c_in, c_skip, c_out = (_expand(c, x0) for c in preconditioning(t))
        target = (eps - x0 - c_skip * xt) / c_out
        loss = F.mse_loss(transformer_call(model, c_in * xt, t, patch), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            for a, p in zip(average.parameters(), model.parameters(), strict=True):
                a.lerp_(p, 1 - ema)
        losses.append(float(loss.detach()))
        if log is not None:
            log(step, losses[-1])
    model.eval()
    return average, losses


@torch.no_grad()
def sample(
    model: nn.Module,
    shape: Sequence[int],
    steps: int,
    generator: torch.Generator,
    mean: float,
    std: float,
    patch: int = 1,
    batch_size: int = 32,
) -> torch.Tensor:
    """Samples of ``shape`` ((N, C, H, W) for Flux, (N, C, T, H, W) for Wan) in [0, 1]: Euler steps
    ``x <- x + (sigma' - sigma) v`` over ``steps`` equal steps of sigma from 1 (noise) to 0, v the model's
    ``eps - x0`` (:func:`denoise`), then ``x std + mean`` clamped to [0, 1]; drawn ``batch_size`` at a time."""
    _family(model)
    if not isinstance(shape, (tuple, list, torch.Size)) or len(shape) not in (4, 5):
        raise ValueError(f"shape must be (N, C, H, W) or (N, C, T, H, W), got {shape!r}")
    check_int(steps, "steps", min=1)
    check_int(batch_size, "batch_size", min=1)
    check_instance(generator, "generator", torch.Generator, expected="a torch.Generator")
    _check_normalisation(mean, std)
    noise = torch.randn(tuple(shape), generator=generator)
    sigmas = torch.linspace(1, 0, steps + 1)
    out = []
    for x in noise.split(batch_size):
        for i in range(steps):
            sigma = sigmas[i].expand(x.shape[0])
            x = x + (sigmas[i + 1] - sigmas[i]) * denoise(model, x, sigma, patch)
        out.append((x * std + mean).clamp(0, 1))
    return torch.cat(out)
