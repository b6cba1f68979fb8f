"""Procedural scenes whose labels need position, rendered natively at any size: the scenes benchmark.

A scene is a description in resolution-free units: the training field is the unit square, cut into a lattice of
``CELLS x CELLS`` cells; every object sits inside one cell (so objects never overlap) and has a shape (circle,
square, diamond), a colour (a palette colour or a grey level), a centre ``(x, y)`` (units, ``y`` pointing down) and
a radius (units). :func:`sample_scenes` draws descriptions from a ``torch.Generator``; :func:`scene_labels` reads the
label of a task off a description; :func:`render` draws a batch of descriptions at once, anti-aliased from the
signed distance of every pixel centre to its cell's object (pixel coverage ``clamp(0.5 - d, 0, 1)`` with ``d`` in
pixels; squares as the product of the two exact 1D coverages, i.e. the exact box-filtered area).

The four tasks (:data:`TASKS`), each with 4 classes; distractors are grey, the objects a label is about coloured:

- ``region`` (absolute): which quadrant of the image holds the red target. Every cell other than the target's
  holds a distractor with probability ``density``, independently, so the scene distribution is invariant under the
  translations by half the field that swap quadrants; these move whole blocks of patches (quadrants are
  patch-aligned), so a model that is invariant to patch permutations (no position encoding, average pooling) gives
  the four quadrant versions of a scene the same logits: it is at chance by construction. Evaluation sets hold
  whole orbits (each scene with its target in all four quadrants), so such a model scores exactly 25 %.
- ``relative``: where the red object A lies relative to the blue object B (0 left of, 1 right of, 2 above,
  3 below); A and B share a lattice row or column, anywhere in the field, so the label does not depend on where
  the pair is.
- ``count``: how many grey objects (0-3) share the red target's row, which spans the whole field.
- ``colour`` (control): the colour of the one coloured object (red, green, blue, yellow); needs no position.

Two ways beyond the training size ``img_size`` (``S``), both from the same kind of description:

- ``zoom``: the same scenes (a unit field) with more pixels: size ``k S`` renders them at ``k S`` pixels per unit.
  Every zoom size renders the very same descriptions as the training-size evaluation set.
- ``canvas``: a field of ``k`` units (``k CELLS`` cells a side) at the training ``S`` pixels per unit: objects keep
  their pixel size, the image holds ``k^2`` times as many cells (distractors at the same density), rows and
  quadrants are ``k`` times as long and A-B distances reach ``k`` times as far.

At the training size both coincide. :class:`ScenesDataModule` serves one task: an endless stream of fresh training
batches (batch ``(seed, epoch, index)`` is drawn from its own seed, whatever the worker count), a fixed validation
set at ``img_size`` and fixed evaluation sets per (task, kind, size) through ``eval_dataloader(size, kind)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from visionpe.training.sampling import (
    _EVAL_STREAM,
    _TRAIN_STREAM,
    EpochSampler,
    _check_int,
    _check_int_tuple,
    _one_thread,
    _sample_seed,
    _unpack,
)

__all__ = [
    "CELLS",
    "KINDS",
    "NUM_CLASSES",
    "PALETTE",
    "SCENES_MEAN",
    "SCENES_STD",
    "SHAPES",
    "TASKS",
    "Scenes",
    "ScenesDataModule",
    "check_task",
    "render",
    "row_blind_count_accuracy",
    "sample_scenes",
    "scene_batch",
    "scene_labels",
]

TASKS = ("region", "relative", "count", "colour")
KINDS = ("zoom", "canvas")
NUM_CLASSES = 4  # every task: quadrants, directions, counts 0-3, colours
SHAPES = ("circle", "square", "diamond")
PALETTE = ((1.0, 0.15, 0.15), (0.15, 0.9, 0.15), (0.2, 0.35, 1.0), (1.0, 0.9, 0.1))  # red, green, blue, yellow
RED, BLUE = 0, 2
CELLS = 4  # lattice cells per unit of field side
SCENES_MEAN = (0.5, 0.5, 0.5)
SCENES_STD = (0.5, 0.5, 0.5)

_CELL = 1.0 / CELLS  # cell side in units
_RADIUS = (0.055, 0.085)  # object radius range in units (1.8-2.7 px at 32 px per unit)
_MARGIN = 0.02  # gap in units between an object's extent and its cell's border
_MIN_PX_PER_UNIT = 0.5 / _MARGIN  # the anti-aliased fringe (half a pixel) stays inside the cell
_SQUARE = 0.85  # square half-side / radius (a circle's radius, a diamond's vertex distance)
_GREY = (0.3, 0.7)
_VAL_STREAM = 7  # seed stream of the validation set (training and evaluation use sampling's streams)


def check_task(task: object) -> str:
    """``task`` if it is one of :data:`TASKS`, else a ValueError naming the valid ones."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    return task  # type: ignore[return-value]


def _check_kind(kind: object) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return kind  # type: ignore[return-value]


# --- descriptions -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenes:
    """A batch of N scene descriptions on a ``G x G`` lattice of cells (``G = cells``), one object per occupied cell.

    Attributes (all indexed ``[n, row, column]``):
        field: side of the field in units (1.0: the training field; ``k`` for a canvas ``k`` times as wide).
        occupied: (N, G, G) bool, whether the cell holds an object.
        role: (N, G, G) int64, 0 distractor, 1 target (A), 2 reference object (B of ``relative``).
        shape: (N, G, G) int64 index into :data:`SHAPES`.
        colour: (N, G, G) int64 index into :data:`PALETTE`, -1 for grey.
        grey: (N, G, G) float grey level of grey objects.
        centre: (N, G, G, 2) float ``(x, y)`` in units from the top-left corner, inside the cell.
        radius: (N, G, G) float in units.
    """

    field: float
    occupied: torch.Tensor
    role: torch.Tensor
    shape: torch.Tensor
    colour: torch.Tensor
    grey: torch.Tensor
    centre: torch.Tensor
    radius: torch.Tensor

    @property
    def cells(self) -> int:
        return self.occupied.shape[-1]

    def __len__(self) -> int:
        return self.occupied.shape[0]

    def _map(self, fn) -> Scenes:
        return Scenes(self.field, *(fn(getattr(self, f.name)) for f in fields(self)[1:]))

    def select(self, index) -> Scenes:
        """The scenes ``index`` (an int tensor, slice or mask over N)."""
        return self._map(lambda t: t[index])

    def rgb(self) -> torch.Tensor:
        """(N, G, G, 3) float colour of each cell's object (palette colour, or its grey level on every channel)."""
        palette = torch.tensor(PALETTE, dtype=torch.float32)
        coloured = palette[self.colour.clamp(min=0)]
        return torch.where((self.colour >= 0)[..., None], coloured, self.grey[..., None].expand(*self.grey.shape, 3))

    def swap_quadrants(self, dx: int, dy: int) -> Scenes:
        """The scenes translated by half the field ``dx`` times across and ``dy`` times down, wrapping around: the
        quadrants trade places as whole blocks (``dx = dy = 1`` swaps diagonally). Needs an even number of cells."""
        g = self.cells
        if g % 2:
            raise ValueError(f"swap_quadrants needs an even number of cells a side, got {g}")
        shift = (dy % 2 * g // 2, dx % 2 * g // 2)
        moved = self._map(lambda t: torch.roll(t, shift, dims=(1, 2)))
        offset = torch.tensor([dx % 2, dy % 2], dtype=self.centre.dtype) * self.field / 2
        centre = torch.remainder(moved.centre + offset, self.field)
        return Scenes(
            self.field, moved.occupied, moved.role, moved.shape, moved.colour, moved.grey, centre, moved.radius
        )


def _cells_for(field: float) -> int:
    if isinstance(field, bool) or not isinstance(field, (int, float)) or field <= 0:
        raise ValueError(f"field must be a positive number of units, got {field!r}")
    cells = round(field * CELLS)
    if not math.isclose(cells, field * CELLS, abs_tol=1e-9):
        raise ValueError(f"field must be a multiple of 1/{CELLS} unit (whole lattice cells), got {field}")
    return cells


def _check_density(density: object) -> None:
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be a float in [0, 1], got {density!r}")


def _distinct_pair(n: int, high: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two distinct uniform integers in [0, high) per row, as (smaller, larger)."""
    a = torch.randint(high, (n,), generator=generator)
    b = torch.randint(high - 1, (n,), generator=generator)
    b = b + (b >= a).long()
    return torch.minimum(a, b), torch.maximum(a, b)


def sample_scenes(
    task: str, n: int, generator: torch.Generator, field: float = 1.0, density: float = 0.3
) -> tuple[Scenes, torch.Tensor]:
    """Draw ``n`` scene descriptions of ``task`` on a field of ``field`` units; return them and their labels.

    Every cell holds a grey distractor with probability ``density``, independently; then the task's objects are
    placed (replacing distractors in their cells) and, for ``count``, the target's row is emptied but for ``label``
    distractors. The labels returned are the ones the scenes were built for; :func:`scene_labels` reads the same
    labels off the descriptions.

    Example:
        >>> scenes, labels = sample_scenes("relative", 8, torch.Generator().manual_seed(0), field=2.0)
        >>> scenes.cells, len(scenes), bool((scene_labels(scenes, "relative") == labels).all())
        (8, 8, True)
    """
    check_task(task)
    n = _check_int("n", n)
    _check_density(density)
    g = _cells_for(field)
    if g < 2:
        raise ValueError(f"field must span at least 2 cells ({2 / CELLS} units), got {field}")
    shape3 = (n, g, g)
    occupied = torch.rand(shape3, generator=generator) < density
    role = torch.zeros(shape3, dtype=torch.long)
    shape = torch.randint(len(SHAPES), shape3, generator=generator)
    colour = torch.full(shape3, -1, dtype=torch.long)
    grey = _GREY[0] + (_GREY[1] - _GREY[0]) * torch.rand(shape3, generator=generator)
    radius = _RADIUS[0] + (_RADIUS[1] - _RADIUS[0]) * torch.rand(shape3, generator=generator)
    room = _CELL / 2 - radius - _MARGIN  # how far a centre may move from its cell's centre
    jitter = (2 * torch.rand((*shape3, 2), generator=generator) - 1) * room[..., None]
    grid = (torch.arange(g, dtype=torch.float32) + 0.5) * _CELL
    cx = grid[None, None, :].expand(shape3)
    cy = grid[None, :, None].expand(shape3)
    centre = torch.stack([cx, cy], dim=-1) + jitter
    rows = torch.arange(n)

    def place(r: torch.Tensor, c: torch.Tensor, which: int, palette_index: torch.Tensor | int) -> None:
        occupied[rows, r, c] = True
        role[rows, r, c] = which
        colour[rows, r, c] = palette_index

    if task in ("region", "colour"):
        cell = torch.randint(g * g, (n,), generator=generator)
        labels = torch.randint(NUM_CLASSES, (n,), generator=generator) if task == "colour" else None
        place(cell // g, cell % g, 1, labels if labels is not None else RED)
        if labels is None:
            labels = scene_labels_region(cell // g, cell % g, g)
    elif task == "relative":
        labels = torch.randint(NUM_CLASSES, (n,), generator=generator)  # A left of, right of, above, below B
        line = torch.randint(g, (n,), generator=generator)
        low, high = _distinct_pair(n, g, generator)
        a_pos = torch.where(labels % 2 == 0, low, high)  # left / above: A at the smaller index
        b_pos = torch.where(labels % 2 == 0, high, low)
        horizontal = labels < 2
        place(torch.where(horizontal, line, a_pos), torch.where(horizontal, a_pos, line), 1, RED)
        place(torch.where(horizontal, line, b_pos), torch.where(horizontal, b_pos, line), 2, BLUE)
    else:  # count
        labels = torch.randint(min(NUM_CLASSES, g), (n,), generator=generator)
        r, c = torch.randint(g, (n,), generator=generator), torch.randint(g, (n,), generator=generator)
        keys = torch.rand((n, g), generator=generator)
        keys[rows, c] = 2.0  # the target's own cell ranks last
        rank = keys.argsort(dim=1).argsort(dim=1)
        occupied[rows, r] = rank < labels[:, None]
        role[rows, r] = 0
        colour[rows, r] = -1
        place(r, c, 1, RED)
    scenes = Scenes(float(field), occupied, role, shape, colour, grey, centre, radius)
    return scenes, labels


def row_blind_count_accuracy(field: float = 1.0, density: float = 0.3) -> float:
    """The best expected accuracy (in [0, 1]) on ``count`` for a model that cannot tell rows apart.

    Such a model (no position encoding, average pooling) can still count the grey objects of the whole image. As
    :func:`sample_scenes` builds them, the target's row holds exactly ``label`` grey objects (labels uniform over the
    classes) and each of the other ``G (G - 1)`` cells one with probability ``density``, so the image's total is the
    label plus a binomial count. This returns the Bayes rate of guessing the label from that total: 43.0 % on the
    training field at density 0.3, falling towards chance as a canvas adds rows (29.2 % at 4 units).

    Example:
        >>> round(100 * row_blind_count_accuracy(1.0), 1), round(100 * row_blind_count_accuracy(4.0), 1)
        (43.0, 29.2)
    """
    cells = _cells_for(field)
    _check_density(density)
    classes, others = min(NUM_CLASSES, cells), cells * (cells - 1)
    if density in (0.0, 1.0):  # the other cells' count is known: the total gives the label away
        return 1.0
    log_p, log_q = math.log(density), math.log1p(-density)
    log_n = math.lgamma(others + 1)
    pmf = [
        math.exp(log_n - math.lgamma(k + 1) - math.lgamma(others - k + 1) + k * log_p + (others - k) * log_q)
        for k in range(others + 1)
    ]
    # P(total = t, label = l) = pmf[t - l] / classes; the best guess for each total takes the largest.
    best = sum(max(pmf[t - l] for l in range(classes) if 0 <= t - l <= others) for t in range(others + classes))
    return best / classes


def scene_labels_region(row: torch.Tensor, column: torch.Tensor, cells: int) -> torch.Tensor:
    """The quadrant (0 top-left, 1 top-right, 2 bottom-left, 3 bottom-right) of lattice cells ``(row, column)``."""
    half = cells // 2
    return 2 * (row >= half).long() + (column >= half).long()


def _object(scenes: Scenes, which: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, 2) centres and (N,) colours of the one object with role ``which`` in every scene."""
    mask = scenes.occupied & (scenes.role == which)
    counts = mask.flatten(1).sum(1)
    if not bool((counts == 1).all()):
        raise ValueError(f"every scene must hold exactly one object with role {which}, got counts {counts.tolist()}")
    index = mask.flatten(1).float().argmax(1)
    rows = torch.arange(len(scenes))
    return scenes.centre.flatten(1, 2)[rows, index], scenes.colour.flatten(1)[rows, index]


def scene_labels(scenes: Scenes, task: str) -> torch.Tensor:
    """(N,) int64 labels of ``task`` read off the descriptions (centres in units and colours, not lattice indices).

    ``region``: quadrant of the target's centre (0 top-left, 1 top-right, 2 bottom-left, 3 bottom-right).
    ``relative``: A relative to B along the axis of their larger offset (0 left, 1 right, 2 above, 3 below).
    ``count``: grey objects whose centre is within half a cell of the target's height. ``colour``: the target's
    palette index.
    """
    check_task(task)
    target, target_colour = _object(scenes, 1)
    if task == "region":
        half = scenes.field / 2
        return 2 * (target[:, 1] >= half).long() + (target[:, 0] >= half).long()
    if task == "colour":
        return target_colour
    if task == "relative":
        reference, _ = _object(scenes, 2)
        dx, dy = (target - reference).unbind(-1)
        horizontal = dx.abs() > dy.abs()
        return torch.where(horizontal, (dx > 0).long(), 2 + (dy > 0).long())
    same_row = (scenes.centre[..., 1] - target[:, 1, None, None]).abs() < _CELL / 2
    return (same_row & scenes.occupied & (scenes.role == 0)).flatten(1).sum(1)


# --- rendering ----------------------------------------------------------------------------------------------------


def _coverage_1d(distance_px: torch.Tensor) -> torch.Tensor:
    """Share of a pixel covered by the inside of an edge at signed distance ``distance_px`` (negative inside)."""
    return (0.5 - distance_px).clamp(0.0, 1.0)


def render(scenes: Scenes, px_per_unit: int) -> torch.Tensor:
    """Draw every scene at ``px_per_unit`` pixels per unit: (N, 3, S, S) float in [0, 1] on black, S = field * px.

    Each cell is a tile of ``px_per_unit / CELLS`` pixels a side holding at most its own object, so the whole batch
    is drawn at once: per pixel the coverage of its cell's object, from the signed distance of the pixel centre to
    the shape (circle, diamond: ``clamp(0.5 - d, 0, 1)``; square: the exact box-filtered area, a product of the two
    1D coverages), times the object's colour.

    Example:
        >>> scenes, _ = sample_scenes("colour", 2, torch.Generator().manual_seed(0))
        >>> render(scenes, 32).shape, render(scenes, 128).shape
        (torch.Size([2, 3, 32, 32]), torch.Size([2, 3, 128, 128]))
    """
    tile = _check_int("px_per_unit", px_per_unit) / CELLS
    if tile != int(tile) or px_per_unit < _MIN_PX_PER_UNIT:
        raise ValueError(
            f"px_per_unit must be a multiple of {CELLS} (whole pixels per lattice cell) and >= "
            f"{math.ceil(_MIN_PX_PER_UNIT / CELLS) * CELLS} (anti-aliasing inside each cell), got {px_per_unit}"
        )
    tile, g, n = int(tile), scenes.cells, len(scenes)
    with _one_thread():
        pixel = (torch.arange(tile, dtype=torch.float32) + 0.5) / px_per_unit  # pixel centres within a cell, units
        origin = torch.arange(g, dtype=torch.float32) * _CELL
        local_x = scenes.centre[..., 0] - origin[None, None, :]  # (N, G, G), the object's centre within its cell
        local_y = scenes.centre[..., 1] - origin[None, :, None]
        dx = (pixel[None, None, None, None, :] - local_x[..., None, None]) * px_per_unit  # (N, G, G, 1, T), px
        dy = (pixel[None, None, None, :, None] - local_y[..., None, None]) * px_per_unit  # (N, G, G, T, 1)
        r = (scenes.radius * px_per_unit)[..., None, None]
        circle = _coverage_1d(torch.sqrt(dx * dx + dy * dy) - r)
        square = _coverage_1d(dx.abs() - _SQUARE * r) * _coverage_1d(dy.abs() - _SQUARE * r)
        diamond = _coverage_1d((dx.abs() + dy.abs() - r) / math.sqrt(2.0))
        shape = scenes.shape[..., None, None]
        coverage = torch.where(shape == 0, circle, torch.where(shape == 1, square, diamond))
        coverage = coverage * scenes.occupied[..., None, None]
        image = coverage[:, None] * scenes.rgb().permute(0, 3, 1, 2)[..., None, None]  # (N, 3, G, G, T, T)
        return image.permute(0, 1, 2, 4, 3, 5).reshape(n, 3, g * tile, g * tile).contiguous()


def _field_and_px(size: int, img_size: int, kind: str) -> tuple[float, int]:
    """(field in units, pixels per unit) of an image of ``size`` px under ``kind`` for training size ``img_size``."""
    if kind == "zoom":
        return 1.0, size
    field = size / img_size
    cells = size * CELLS / img_size
    if cells != int(cells):
        raise ValueError(
            f"size must be a multiple of {img_size // math.gcd(img_size, CELLS)} px for a canvas of whole lattice "
            f"cells ({CELLS} per {img_size} px), got {size}"
        )
    return field, img_size


def scene_batch(
    task: str,
    n: int,
    generator: torch.Generator,
    size: int,
    img_size: int = 32,
    kind: str = "zoom",
    density: float = 0.3,
    orbits: bool = False,
) -> tuple[Scenes, torch.Tensor, torch.Tensor]:
    """``n`` scenes of ``task`` at ``size`` px (``kind`` relative to the training ``img_size``): (scenes, images in
    [0, 1] (n, 3, size, size), labels (n,)). ``orbits`` (``region`` only, ``n`` a multiple of 4): ``n / 4`` scenes,
    each followed by its three quadrant swaps, so that every scene appears with its target in every quadrant."""
    check_task(task)
    field, px = _field_and_px(size, img_size, _check_kind(kind))
    if orbits:
        if task != "region" or n % 4:
            raise ValueError(f"orbits need task='region' and n a multiple of 4, got task={task!r}, n={n}")
        base, _ = sample_scenes(task, n // 4, generator, field, density)
        versions = [base.swap_quadrants(dx, dy) for dy in (0, 1) for dx in (0, 1)]
        order = torch.arange(n).view(n // 4, 4).t().reshape(-1)  # scene i's four versions next to each other
        scenes = Scenes(
            base.field, *(torch.cat([getattr(v, f.name) for v in versions])[order] for f in fields(Scenes)[1:])
        )
        labels = scene_labels(scenes, task)
    else:
        scenes, labels = sample_scenes(task, n, generator, field, density)
    return scenes, render(scenes, px), labels


# --- datasets and data module -------------------------------------------------------------------------------------


def _normalize(images: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(SCENES_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(SCENES_STD).view(1, 3, 1, 1)
    return (images - mean) / std


class _SceneBatches(Dataset):
    """Whole batches (x (B, 3, S, S) normalised, y (B,)) of one task, batch ``item`` drawn from its own seed.

    Training (``epoch_keyed``): item ``(index, epoch)`` of :class:`EpochSampler`, fresh scenes every batch of every
    epoch. Evaluation: ``count`` fixed scenes; the seed of a batch depends on the task, the field and the batch
    index, not on the pixel size, so every zoom size renders the scenes of the training-size set.
    """

    def __init__(
        self,
        task: str,
        kind: str,
        size: int,
        img_size: int,
        batch_size: int,
        num_batches: int,
        seed: int,
        stream: int,
        density: float,
        count: int | None = None,
        orbits: bool = False,
    ) -> None:
        self.task, self.kind, self.size, self.img_size = task, kind, size, img_size
        self.batch_size, self.num_batches, self.seed, self.stream = batch_size, num_batches, seed, stream
        self.density, self.count, self.orbits = density, count, orbits
        self.field, _ = _field_and_px(size, img_size, kind)

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        index, epoch = _unpack(item)
        if not 0 <= index < self.num_batches:
            raise IndexError(f"batch index {index} out of range for {self.num_batches} batches")
        n = self.batch_size
        if self.count is not None:
            n = min(self.batch_size, self.count - index * self.batch_size)
        keys = (self.seed, self.stream, TASKS.index(self.task), round(self.field * CELLS), epoch, index)
        generator = torch.Generator().manual_seed(_sample_seed(*keys))
        _, images, labels = scene_batch(
            self.task, n, generator, self.size, self.img_size, self.kind, self.density, self.orbits
        )
        with _one_thread():
            return _normalize(images), labels


class ScenesDataModule(L.LightningDataModule):
    """One task of the scenes benchmark: fresh training scenes every step, fixed evaluation sets per size and kind.

    Batches are ``(x, y)``: x (B, 3, S, S) float32 normalised with :data:`SCENES_MEAN` / :data:`SCENES_STD`
    (background -1), y (B,) int64 in 0..3. S is ``img_size`` for training and ``val_dataloader``, the requested size
    for ``eval_dataloader(size, kind)``.

    Args:
        task: one of :data:`TASKS`.
        img_size: training (and validation) image side in px: the unit field at ``img_size`` px per unit; a multiple
            of 4 (the lattice), at least 28 px, and of ``patch_size`` when given.
        eval_sizes: image sides for :meth:`eval_dataloader` and :meth:`test_dataloader`, distinct, each a multiple of
            ``patch_size`` (when given) whose scale ``size / img_size`` gives whole lattice cells.
        eval_kind: ``zoom`` or ``canvas``, the kind :meth:`eval_dataloader` and :meth:`test_dataloader` serve by
            default (``train/scenes.py`` evaluates both).
        batch_size: training and validation batch size.
        steps_per_epoch: training batches per epoch (each one new scenes).
        val_samples: scenes in the validation set (at ``img_size``).
        eval_samples: scenes in each evaluation set (per size and kind).
        eval_batch_size: batch size of the evaluation loaders (default ``batch_size``).
        density: probability that a free lattice cell holds a grey distractor.
        patch_size: the model's patch size, to refuse sizes it does not divide (and, for ``region``, sizes whose
            quadrants are not whole patches, which would break the task's invariance); None: no check.
        num_workers: DataLoader workers (the batches do not depend on them).
        seed: seed of every scene.

    Example:
        >>> dm = ScenesDataModule("count", img_size=32, eval_sizes=(32, 64), batch_size=8, patch_size=4)
        >>> x, y = next(iter(dm.train_dataloader()))
        >>> x.shape, y.shape, next(iter(dm.eval_dataloader(64, kind="canvas")))[0].shape
        (torch.Size([8, 3, 32, 32]), torch.Size([8]), torch.Size([8, 3, 64, 64]))
    """

    num_classes = NUM_CLASSES
    mean, std = SCENES_MEAN, SCENES_STD
    size_label = "px"

    def __init__(
        self,
        task: str = "region",
        img_size: int = 32,
        eval_sizes: Sequence[int] = (32, 48, 64, 96, 128),
        eval_kind: str = "zoom",
        batch_size: int = 64,
        steps_per_epoch: int = 100,
        val_samples: int = 512,
        eval_samples: int = 1000,
        eval_batch_size: int | None = None,
        density: float = 0.3,
        patch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.task = check_task(task)
        self.eval_kind = _check_kind(eval_kind)
        self.patch_size = None if patch_size is None else _check_int("patch_size", patch_size)
        self.img_size = _check_int("img_size", img_size, minimum=28)
        if img_size % CELLS:
            raise ValueError(f"img_size must be a multiple of {CELLS} (whole pixels per lattice cell), got {img_size}")
        self._check_patch("img_size", self.img_size)
        self.eval_sizes = _check_int_tuple("eval_sizes", eval_sizes)
        repeated = sorted({s for s in self.eval_sizes if self.eval_sizes.count(s) > 1})
        if repeated:
            raise ValueError(f"eval_sizes must not repeat a size, got {list(self.eval_sizes)} (repeated: {repeated})")
        self.batch_size = _check_int("batch_size", batch_size)
        self.steps_per_epoch = _check_int("steps_per_epoch", steps_per_epoch)
        self.val_samples = _check_int("val_samples", val_samples)
        self.eval_samples = _check_int("eval_samples", eval_samples)
        self.eval_batch_size = (
            self.batch_size if eval_batch_size is None else _check_int("eval_batch_size", eval_batch_size)
        )
        if self.task == "region":
            for name in ("val_samples", "eval_samples", "batch_size", "eval_batch_size"):
                if getattr(self, name) % 4:
                    raise ValueError(
                        f"{name} must be a multiple of 4 for task='region' (evaluation sets hold whole orbits of "
                        f"four quadrant swaps), got {getattr(self, name)}"
                    )
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 <= density <= 1.0:
            raise ValueError(f"density must be a float in [0, 1], got {density!r}")
        self.density = float(density)
        self.num_workers = _check_int("num_workers", num_workers, minimum=0)
        self.seed = _check_int("seed", seed, minimum=0)
        for size in self.eval_sizes:
            for kind in KINDS:
                self.check_size(size, kind)
        self.save_hyperparameters()

    def _check_patch(self, name: str, size: int) -> None:
        if self.patch_size is None:
            return
        if size % self.patch_size:
            raise ValueError(f"{name} must be a multiple of the patch size {self.patch_size}, got {size}")
        if self.task == "region" and (size // 2) % self.patch_size:
            raise ValueError(
                f"{name} must be a multiple of twice the patch size ({2 * self.patch_size}) for task='region' "
                f"(quadrants of whole patches), got {size}"
            )

    def check_size(self, size: int, kind: str | None = None) -> int:
        """``size`` if :meth:`eval_dataloader` serves it under ``kind`` (default ``eval_kind``), else a ValueError."""
        size = _check_int("size", size)
        kind = _check_kind(self.eval_kind if kind is None else kind)
        self._check_patch("size", size)
        if kind == "zoom" and (size % CELLS or size < _MIN_PX_PER_UNIT):
            raise ValueError(f"size must be a multiple of {CELLS} px and >= 28 px for zoom, got {size}")
        if kind == "canvas":
            if size < self.img_size:
                raise ValueError(f"size must be >= img_size ({self.img_size} px) for canvas, got {size}")
            _field_and_px(size, self.img_size, kind)
            if self.task == "region" and round(size * CELLS / self.img_size) % 2:
                raise ValueError(
                    f"size must give an even number of lattice cells for a region canvas (whole quadrants), got "
                    f"{size} px ({round(size * CELLS / self.img_size)} cells)"
                )
        return size

    def setup(self, stage: str | None = None) -> None:
        """Nothing to load: every scene is drawn when its batch is asked for."""

    def _loader(self, dataset: Dataset, sampler=None) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=None,
            sampler=sampler,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def _fixed(self, size: int, kind: str, count: int, stream: int, batch_size: int) -> _SceneBatches:
        batches = math.ceil(count / batch_size)
        orbits = self.task == "region"
        return _SceneBatches(
            self.task, kind, size, self.img_size, batch_size, batches, self.seed, stream, self.density, count, orbits
        )

    def train_dataloader(self) -> DataLoader:
        """``steps_per_epoch`` batches of new scenes at ``img_size`` each epoch; x (B, 3, img_size, img_size)."""
        dataset = _SceneBatches(
            self.task,
            "zoom",
            self.img_size,
            self.img_size,
            self.batch_size,
            self.steps_per_epoch,
            self.seed,
            _TRAIN_STREAM,
            self.density,
        )
        return self._loader(dataset, EpochSampler(self.steps_per_epoch, self.seed, shuffle=False))

    def val_dataloader(self) -> DataLoader:
        """The fixed validation set at ``img_size`` (``val_samples`` scenes)."""
        return self._loader(self._fixed(self.img_size, "zoom", self.val_samples, _VAL_STREAM, self.batch_size))

    def eval_dataloader(self, size: int, kind: str | None = None) -> DataLoader:
        """The fixed evaluation set of ``eval_samples`` scenes at ``size`` px under ``kind`` (default
        ``eval_kind``): x (B, 3, size, size). At ``img_size`` both kinds give the same images."""
        kind = self.eval_kind if kind is None else kind
        size = self.check_size(size, kind)
        return self._loader(self._fixed(size, kind, self.eval_samples, _EVAL_STREAM, self.eval_batch_size))

    def test_dataloader(self) -> list[DataLoader]:
        """One :meth:`eval_dataloader` per entry of ``eval_sizes`` (``eval_kind``), in that order."""
        return [self.eval_dataloader(size) for size in self.eval_sizes]
