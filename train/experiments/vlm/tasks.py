"""Multimodal extrapolation tasks built from the bundled MNIST digits, deterministic per seed.

Three tasks, each a token sequence with images or a video and one question whose answer is a digit. The question
comes first, then the visual input, and the answer is predicted at the last token (``<ask>``). Question first
makes the visual tokens able to find out whether they are the ones asked about from their offset to the
question, which does not depend on the size of the input for the 2-D designs; with the question last, a tiny
model learnt no cell addressing in 2,000 steps with any of the three schemes tried (rope_1d, mrope,
mrope_interleaved: accuracy of a random visible cell), since the offset from the end to a cell changes with the
grid size.

- ``grid`` (grid question answering, "higher resolution"): one image holding an R x C grid of digits,
  14 x 14 px per cell (one LLM token per cell); the question names a cell by row and column.
  ``<bos> row <r> col <c> <vs> <img> x R*C <ve> <ask>``
- ``multi_image`` (multi-image needle, like MM-NIAH): K images of one digit each (2 x 2 LLM tokens per image);
  the question names the index k of an image. ``<bos> image <k> (<vs> <img> x 4 <ve>) x K <ask>``
- ``video`` (video needle, like V-NIAH): a moving-digit clip of F frames (2 x 2 LLM tokens per frame): a sprite
  moves one cell (14 px) per frame, bouncing off the frame's edges; each frame shows a different digit, and one
  frame (the needle) shows its digit inside a bright border; the question asks for the marked digit.
  ``<bos> marked <vs> <vid> x 4F <ve> <ask>``

Training lengths (:data:`TASKS`): grids with R, C in {1, 2, 3}, K in {1, ..., 4} images, clips of 1 to 8
frames, each drawn uniformly per sample. Training the video task on 8-frame clips only was measured too: the
model then sits at chance for several hundred steps before finding the needle, and within this budget some
seeds never leave it, so the benchmark would measure optimisation luck; shorter clips in the mix (as the
smaller grids and image counts of the other tasks) make every run learn.

Indices in the questions are 1-based index tokens ``<1>`` ... ``<16>``. A model only learns the index tokens it
was trained on, so at evaluation the questions keep to the trained range (rows and columns up to 3, image
indices up to 4, see ``max_query_index``) while the context around them grows: what changes is the number of
visual tokens and positions, which is what the position scheme has to cope with.

Tiled images (``tiled=True``, for RoPE-DHR; grid task only): as InternVL's dynamic high resolution, an image larger
than one tile of :data:`TILE_CELLS` x :data:`TILE_CELLS` cells (28 px, the size of a multi-image image or a video
frame) is cut into X columns x Y rows of tiles, followed by a thumbnail of the whole image at the size of one tile
(``image_grid_thw`` (X Y + 1, 4, 4), tiles row-major then the thumbnail, ``tile_grid`` (X, Y)). InternVL resizes
the image to the tile grid; here the grid is padded with empty cells to whole tiles instead, so that every digit
keeps its cell and its token (the thumbnail is the padded image resized). An image within one tile is given as it
is, untiled (``tile_grid`` (1, 1)). Training grids up to 3 x 3 then hold up to 2 x 2 tiles, the 6 x 6 grid 3 x 3.

Pixels follow the Qwen2-VL processor: grayscale (one channel) normalised with the MNIST mean and std, cut into
``patch_size`` patches (temporal patch size 1) and flattened in its order (merge windows of
``spatial_merge_size`` x ``spatial_merge_size`` patches contiguous; :func:`patchify`). Grids ``(t, h, w)``
count patches before merging, as transformers expects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ..digits import DIGITS_MEAN, DIGITS_STD, load_digits, split_digits

__all__ = [
    "TOKENS",
    "VOCAB_SIZE",
    "DIGIT_TOKENS",
    "MAX_INDEX",
    "PATCH_SIZE",
    "SPATIAL_MERGE_SIZE",
    "TILE_CELLS",
    "TASKS",
    "TaskSpec",
    "DigitBank",
    "VLMSample",
    "patchify",
    "index_token",
    "make_grid_sample",
    "make_multi_image_sample",
    "make_video_sample",
    "make_sample",
    "tile_image",
    "sample_seed",
    "TaskDataset",
    "collate_samples",
]

MAX_INDEX = 16
# The whole vocabulary: special tokens, the ten digits, question words and the index tokens <1>..<16>.
_NAMES = (
    ["<pad>", "<bos>", "<vs>", "<ve>", "<img>", "<vid>", "<ask>", "row", "col", "image", "marked"]
    + [str(d) for d in range(10)]
    + [f"<{i}>" for i in range(1, MAX_INDEX + 1)]
)
TOKENS: dict[str, int] = {name: i for i, name in enumerate(_NAMES)}
VOCAB_SIZE = 48  # len(TOKENS) = 37, rounded up to a multiple of 8
DIGIT_TOKENS = tuple(TOKENS[str(d)] for d in range(10))
PATCH_SIZE = 7
SPATIAL_MERGE_SIZE = 2
CELL_PX = 14  # one LLM token: (2 x 2 patches of 7 px)
FRAME_PX = 28  # multi-image images and video frames: 2 x 2 LLM tokens
TILE_CELLS = FRAME_PX // CELL_PX  # a tile of a tiled image: 2 x 2 cells, 28 px
_BORDER = 255


def index_token(index: int) -> int:
    """Token id of the 1-based index ``<index>``, 1 <= index <= :data:`MAX_INDEX`."""
    index = _check_int("index", index, 1, MAX_INDEX)
    return TOKENS[f"<{index}>"]


@dataclass(frozen=True)
class TaskSpec:
    """A task's protocol: the lengths trained on, the lengths evaluated, and how the questions are bounded.

    ``train_lengths`` are drawn uniformly per training sample: grid sides (R and C drawn independently),
    image counts, or frame counts. ``eval_lengths`` are square grid sides, image counts or frame counts.
    ``max_query_index``: the largest row/column/image index a question may name (the trained range);
    None for the video task, whose question names no index.
    """

    name: str
    train_lengths: tuple[int, ...]
    eval_lengths: tuple[int, ...]
    max_query_index: int | None
    length_label: str
    description: str


TASKS: dict[str, TaskSpec] = {
    "grid": TaskSpec(
        "grid", (1, 2, 3), (2, 3, 4, 5, 6), 3, "grid side", "grid QA: train R, C <= 3, evaluate n x n up to 6 x 6"
    ),
    "multi_image": TaskSpec(
        "multi_image",
        (1, 2, 3, 4),
        (2, 4, 8, 12, 16),
        4,
        "images",
        "multi-image needle: train K <= 4, evaluate K <= 16",
    ),
    "video": TaskSpec(
        "video", tuple(range(1, 9)), (8, 16, 24, 32), None, "frames", "video needle: train 1-8 frames, evaluate 32"
    ),
}


def _check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        low = "-inf" if minimum is None else minimum
        high = "inf" if maximum is None else maximum
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return int(value)


def _check_generator(generator) -> torch.Generator:
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    return generator


def sample_seed(*keys: int) -> int:
    """A 63-bit seed mixed from non-negative integer keys (e.g. seed, stream, length, index)."""
    for i, key in enumerate(keys):
        _check_int(f"keys[{i}]", key, 0)
    high, low = np.random.SeedSequence(list(keys)).generate_state(2, dtype=np.uint32).tolist()
    return (high << 31) ^ low


class DigitBank:
    """The bundled digits at the sizes the tasks use, restricted to one split.

    Args:
        split: ``"train"`` or ``"val"`` (the stratified 80/20 split of
            :func:`~experiments.digits.split_digits` with ``split_seed``), or ``"all"``.
        split_seed: seed of the split.
        path: the ``.npz`` to read; default the bundled file.

    Attributes:
        images (N, 28, 28) uint8 and ``cells`` (N, 14, 14) uint8 (antialiased resize) for all 5,000 digits;
        ``labels`` (N,) int64; ``indices`` (M,) the digits of this split.
    """

    def __init__(self, split: str = "train", split_seed: int = 0, path: str | Path | None = None) -> None:
        if split not in ("train", "val", "all"):
            raise ValueError(f"split must be 'train', 'val' or 'all', got {split!r}")
        self.split = split
        self.split_seed = _check_int("split_seed", split_seed, 0)
        self.images, self.labels = load_digits(path)
        self.cells = (
            F.interpolate(self.images[:, None].float(), size=(CELL_PX, CELL_PX), mode="bilinear", antialias=True)
            .round()
            .clamp(0, 255)
            .to(torch.uint8)[:, 0]
        )
        if split == "all":
            self.indices = torch.arange(len(self.labels))
        else:
            train, val = split_digits(self.labels, 0.8, self.split_seed)
            self.indices = train if split == "train" else val

    def draw(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """(count,) digit indices drawn uniformly with replacement."""
        return self.indices[torch.randint(len(self.indices), (count,), generator=generator)]


@dataclass
class VLMSample:
    """One task sample; everything a Qwen2-VL forward needs for one sequence, plus the ground truth.

    ``input_ids`` and ``mm_token_type_ids`` (L,) (0 text, 1 image, 2 video); ``pixel_values`` (P, 49) with
    ``image_grid_thw`` (n_images, 3), or ``pixel_values_videos`` with ``video_grid_thw`` (1, 3), pre-merge
    patch grids; ``answer`` the digit 0-9 and ``answer_token`` its token id; ``digit_indices`` the bank
    indices of the digits shown (grid cells row-major, images in order, frames in order); ``target`` the
    0-based position of the asked digit in ``digit_indices``; ``length`` the task length (grid side, image
    count or frame count); ``info`` the task's own parameters.
    """

    input_ids: torch.Tensor
    mm_token_type_ids: torch.Tensor
    answer: int
    answer_token: int
    digit_indices: torch.Tensor
    target: int
    length: int
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    tile_grid: torch.Tensor | None = None
    info: dict = field(default_factory=dict)


def patchify(frames: torch.Tensor, patch_size: int = PATCH_SIZE, merge_size: int = SPATIAL_MERGE_SIZE) -> torch.Tensor:
    """Flatten frames into Qwen2-VL patches, in the processor's order (temporal patch size 1).

    Args:
        frames: (T, C, H, W) float, H and W divisible by ``patch_size * merge_size``.

    Returns:
        (T * H/p * W/p, C * p * p): frame by frame, merge windows of m x m patches in row-major order of the
        windows, patches row-major inside a window (transformers' ``Qwen2VLImageProcessor.patchify``).

    Example:
        >>> patchify(torch.zeros(2, 1, 28, 42)).shape
        torch.Size([48, 49])
    """
    if not isinstance(frames, torch.Tensor) or frames.ndim != 4:
        raise ValueError(f"frames must be a (T, C, H, W) tensor, got {getattr(frames, 'shape', type(frames).__name__)}")
    patch_size = _check_int("patch_size", patch_size, 1)
    merge_size = _check_int("merge_size", merge_size, 1)
    num_frames, channels, height, width = frames.shape
    unit = patch_size * merge_size
    if height % unit or width % unit:
        raise ValueError(
            f"frames must have H and W divisible by patch_size * merge_size = {unit}, got {height}x{width}"
        )
    gh, gw = height // unit, width // unit
    patches = frames.reshape(num_frames, channels, gh, merge_size, patch_size, gw, merge_size, patch_size)
    patches = patches.permute(0, 2, 5, 3, 6, 1, 4, 7)
    return patches.reshape(-1, channels * patch_size * patch_size)


def _normalize(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 (..., H, W) -> float (..., 1, H, W) normalised with the MNIST mean and std."""
    return ((pixels.float() / 255.0 - DIGITS_MEAN[0]) / DIGITS_STD[0]).unsqueeze(-3)


def _grid_thw(num_frames: int, height: int, width: int) -> list[int]:
    return [num_frames, height // PATCH_SIZE, width // PATCH_SIZE]


def _check_bank(bank) -> DigitBank:
    if not isinstance(bank, DigitBank):
        raise TypeError(f"bank must be a DigitBank, got {type(bank).__name__}")
    return bank


def _pick_target(name: str, target, choices: int, generator: torch.Generator) -> int:
    if target is None:
        return int(torch.randint(choices, (), generator=generator))
    return _check_int(name, target, 0, choices - 1)


def _sample(ids: list[int], types: list[int], bank: DigitBank, digits: torch.Tensor, target: int, length: int):
    answer = int(bank.labels[digits[target]])
    return VLMSample(
        input_ids=torch.tensor(ids),
        mm_token_type_ids=torch.tensor(types),
        answer=answer,
        answer_token=DIGIT_TOKENS[answer],
        digit_indices=digits,
        target=target,
        length=length,
    )


def make_grid_sample(
    bank: DigitBank,
    rows: int,
    cols: int,
    generator: torch.Generator,
    target: tuple[int, int] | None = None,
    max_query_index: int | None = None,
    tiled: bool = False,
) -> VLMSample:
    """A ``rows`` x ``cols`` grid of digits in one image and a question naming one cell.

    Args:
        bank: the digits to draw from.
        rows, cols: grid size, 1..16 each; the image is (14 rows) x (14 cols) pixels, one LLM token per cell.
        generator: the only source of randomness (digits, asked cell).
        target: the asked cell (row, col), 0-based; None draws it.
        max_query_index: when drawing, only cells with row and column < this (the trained index range).
        tiled: cut an image larger than one tile into tiles plus a thumbnail (:func:`tile_image`), for RoPE-DHR.

    Example:
        >>> bank = DigitBank("val")
        >>> s = make_grid_sample(bank, 2, 3, torch.Generator().manual_seed(0), target=(1, 2))
        >>> s.image_grid_thw.tolist(), s.input_ids.numel(), s.answer == int(bank.labels[s.digit_indices[5]])
        ([[1, 4, 6]], 14, True)
        >>> t = make_grid_sample(bank, 2, 3, torch.Generator().manual_seed(0), target=(1, 2), tiled=True)
        >>> t.image_grid_thw.tolist(), t.tile_grid.tolist(), t.answer == s.answer
        ([[3, 4, 4]], [[2, 1]], True)
    """
    bank, generator = _check_bank(bank), _check_generator(generator)
    rows = _check_int("rows", rows, 1, MAX_INDEX)
    cols = _check_int("cols", cols, 1, MAX_INDEX)
    if not isinstance(tiled, bool):
        raise TypeError(f"tiled must be a bool, got {type(tiled).__name__}")
    if max_query_index is not None:
        max_query_index = _check_int("max_query_index", max_query_index, 1, MAX_INDEX)
    digits = bank.draw(rows * cols, generator)
    if target is None:
        limit_r = rows if max_query_index is None else min(rows, max_query_index)
        limit_c = cols if max_query_index is None else min(cols, max_query_index)
        row = int(torch.randint(limit_r, (), generator=generator))
        col = int(torch.randint(limit_c, (), generator=generator))
    else:
        if not isinstance(target, (tuple, list)) or len(target) != 2:
            raise TypeError(f"target must be a (row, col) pair or None, got {target!r}")
        row = _check_int("target[0]", target[0], 0, rows - 1)
        col = _check_int("target[1]", target[1], 0, cols - 1)
    cells = bank.cells[digits].view(rows, cols, CELL_PX, CELL_PX)
    image = cells.permute(0, 2, 1, 3).reshape(rows * CELL_PX, cols * CELL_PX)
    if tiled:
        frames, tile_grid = tile_image(image)
    else:
        frames, tile_grid = image[None], (1, 1)
    num_tokens = frames.shape[0] * (frames.shape[1] // CELL_PX) * (frames.shape[2] // CELL_PX)
    ids = [TOKENS["<bos>"], TOKENS["row"], index_token(row + 1), TOKENS["col"], index_token(col + 1), TOKENS["<vs>"]]
    ids += [TOKENS["<img>"]] * num_tokens + [TOKENS["<ve>"], TOKENS["<ask>"]]
    types = [0] * 6 + [1] * num_tokens + [0, 0]
    sample = _sample(ids, types, bank, digits, row * cols + col, max(rows, cols))
    sample.pixel_values = patchify(_normalize(frames))
    sample.image_grid_thw = torch.tensor([_grid_thw(*frames.shape)])
    if tiled:
        sample.tile_grid = torch.tensor([tile_grid])
    sample.info = {"rows": rows, "cols": cols, "row": row, "col": col}
    return sample


def tile_image(image: torch.Tensor, tile_cells: int = TILE_CELLS) -> tuple[torch.Tensor, tuple[int, int]]:
    """Cut a uint8 image into tiles of ``tile_cells`` x ``tile_cells`` cells plus a thumbnail (InternVL's layout).

    Args:
        image: (H, W) uint8, H and W multiples of the cell size (14 px).
        tile_cells: cells per tile side.

    Returns:
        ``(frames, (X, Y))``: an image within one tile comes back as it is, (1, H, W) with (X, Y) = (1, 1); a larger
        one is padded with empty cells to X columns x Y rows of tiles and returned as (X Y + 1, T, T) frames of
        T = 14 ``tile_cells`` px: the tiles row-major, then the thumbnail (the padded image resized to one tile,
        antialiased bilinear).

    Example:
        >>> frames, grid = tile_image(torch.zeros(42, 70, dtype=torch.uint8))
        >>> tuple(frames.shape), grid
        ((7, 28, 28), (3, 2))
    """
    if not isinstance(image, torch.Tensor) or image.ndim != 2 or image.dtype != torch.uint8:
        raise ValueError(f"image must be an (H, W) uint8 tensor, got {getattr(image, 'shape', type(image).__name__)}")
    if image.shape[0] % CELL_PX or image.shape[1] % CELL_PX:
        raise ValueError(f"image must have H and W divisible by the cell size {CELL_PX}, got {tuple(image.shape)}")
    tile_cells = _check_int("tile_cells", tile_cells, 1)
    tile_px = tile_cells * CELL_PX
    rows, cols = image.shape[0] // CELL_PX, image.shape[1] // CELL_PX
    if rows <= tile_cells and cols <= tile_cells:
        return image[None], (1, 1)
    across, down = -(-cols // tile_cells), -(-rows // tile_cells)
    padded = F.pad(image, (0, across * tile_px - image.shape[1], 0, down * tile_px - image.shape[0]))
    tiles = padded.view(down, tile_px, across, tile_px).permute(0, 2, 1, 3).reshape(-1, tile_px, tile_px)
    thumbnail = F.interpolate(padded[None, None].float(), size=(tile_px, tile_px), mode="bilinear", antialias=True)
    thumbnail = thumbnail.round().clamp(0, 255).to(torch.uint8)[0]
    return torch.cat([tiles, thumbnail]), (across, down)


def make_multi_image_sample(
    bank: DigitBank,
    num_images: int,
    generator: torch.Generator,
    target: int | None = None,
    max_query_index: int | None = None,
) -> VLMSample:
    """``num_images`` images of one 28 x 28 digit each (2 x 2 LLM tokens per image), a question naming one.

    Args:
        bank: the digits to draw from.
        num_images: K, 1..16.
        generator: the only source of randomness.
        target: the asked image, 0-based; None draws it (below ``max_query_index`` when given).
        max_query_index: when drawing, only images with index < this (the trained index range).

    Example:
        >>> bank = DigitBank("val")
        >>> s = make_multi_image_sample(bank, 3, torch.Generator().manual_seed(0), target=1)
        >>> s.image_grid_thw.tolist(), s.input_ids.tolist()[1:3] == [TOKENS["image"], index_token(2)]
        ([[1, 4, 4], [1, 4, 4], [1, 4, 4]], True)
    """
    bank, generator = _check_bank(bank), _check_generator(generator)
    num_images = _check_int("num_images", num_images, 1, MAX_INDEX)
    if max_query_index is not None:
        max_query_index = _check_int("max_query_index", max_query_index, 1, MAX_INDEX)
    digits = bank.draw(num_images, generator)
    limit = num_images if max_query_index is None else min(num_images, max_query_index)
    target = _pick_target("target", target, num_images if target is not None else limit, generator)
    tokens_per_image = (FRAME_PX // (PATCH_SIZE * SPATIAL_MERGE_SIZE)) ** 2
    ids, types = [TOKENS["<bos>"], TOKENS["image"], index_token(target + 1)], [0, 0, 0]
    for _ in range(num_images):
        ids += [TOKENS["<vs>"]] + [TOKENS["<img>"]] * tokens_per_image + [TOKENS["<ve>"]]
        types += [0] + [1] * tokens_per_image + [0]
    ids.append(TOKENS["<ask>"])
    types.append(0)
    sample = _sample(ids, types, bank, digits, target, num_images)
    sample.pixel_values = patchify(_normalize(bank.images[digits]))
    sample.image_grid_thw = torch.tensor([_grid_thw(1, FRAME_PX, FRAME_PX)] * num_images)
    sample.info = {"num_images": num_images, "target": target}
    return sample


_FRAME_CELLS = FRAME_PX // CELL_PX  # a frame is 2 x 2 cells of one LLM token each


def _bounce(position: int, travel: int = _FRAME_CELLS - 1) -> int:
    """Where a free walk to ``position`` ends between walls at 0 and ``travel`` (reflected at the walls)."""
    phase = position % (2 * travel)
    return phase if phase <= travel else 2 * travel - phase


_DIRECTIONS = ((0, 1), (0, -1), (1, 0), (-1, 0), (1, 1), (1, -1), (-1, 1), (-1, -1))  # (dy, dx) per frame


def make_video_sample(
    bank: DigitBank,
    num_frames: int,
    generator: torch.Generator,
    needle_frame: int | None = None,
    video_as_images: bool = False,
) -> VLMSample:
    """A moving-digit clip in which one frame's digit is marked by a bright border; the question asks for it.

    A 28 x 28 frame is 2 x 2 cells of 14 px, one LLM token each. A 14 x 14 sprite starts in a random cell and
    moves one cell per frame in one of eight directions, bouncing off the edges. Motion by whole cells keeps
    every digit inside one token: a tiny vision tower trained for a minute cannot read digits cut across
    token boundaries (measured: 25 % instead of 95 % after 400 steps). Every frame shows a digit drawn
    uniformly at the sprite's place, so the marked frame's label may recur among the others: only the border tells
    the needle (with distractors that never shared its label, "the label seen exactly once" answered without the
    border, up to 65 % at 32 frames).

    Args:
        bank: the digits to draw from.
        num_frames: F, 1..64 (2 x 2 LLM tokens per frame).
        generator: the only source of randomness.
        needle_frame: the marked frame, 0-based; None draws it uniformly.
        video_as_images: give the frames as F consecutive images (``image_grid_thw`` (F, 3), image tokens)
            instead of one video: the same pixels and the same number of tokens, for schemes defined for
            images only (Circle-RoPE).

    Example:
        >>> bank = DigitBank("val")
        >>> s = make_video_sample(bank, 8, torch.Generator().manual_seed(0), needle_frame=3)
        >>> s.video_grid_thw.tolist(), s.pixel_values_videos.shape, s.target
        ([[8, 4, 4]], torch.Size([128, 49]), 3)
    """
    bank, generator = _check_bank(bank), _check_generator(generator)
    num_frames = _check_int("num_frames", num_frames, 1, 64)
    if not isinstance(video_as_images, bool):
        raise TypeError(f"video_as_images must be a bool, got {type(video_as_images).__name__}")
    needle = _pick_target("needle_frame", needle_frame, num_frames, generator)
    digits = bank.draw(num_frames, generator)  # the needle's label may recur among the distractors (see above)
    top, left = torch.randint(_FRAME_CELLS, (2,), generator=generator).tolist()
    dy, dx = _DIRECTIONS[int(torch.randint(len(_DIRECTIONS), (), generator=generator))]
    sprites = bank.cells[digits].clone()
    sprites[needle, [0, -1], :] = _BORDER
    sprites[needle, :, [0, -1]] = _BORDER
    frames = torch.zeros(num_frames, FRAME_PX, FRAME_PX, dtype=torch.uint8)
    for t in range(num_frames):
        y, x = CELL_PX * _bounce(top + dy * t), CELL_PX * _bounce(left + dx * t)
        frames[t, y : y + CELL_PX, x : x + CELL_PX] = sprites[t]
    tokens_per_frame = (FRAME_PX // (PATCH_SIZE * SPATIAL_MERGE_SIZE)) ** 2
    num_tokens = num_frames * tokens_per_frame
    kind = 1 if video_as_images else 2
    pad = TOKENS["<img>"] if video_as_images else TOKENS["<vid>"]
    ids = [TOKENS["<bos>"], TOKENS["marked"], TOKENS["<vs>"]] + [pad] * num_tokens + [TOKENS["<ve>"], TOKENS["<ask>"]]
    types = [0, 0, 0] + [kind] * num_tokens + [0, 0]
    sample = _sample(ids, types, bank, digits, needle, num_frames)
    pixels = patchify(_normalize(frames))
    if video_as_images:
        sample.pixel_values = pixels
        sample.image_grid_thw = torch.tensor([_grid_thw(1, FRAME_PX, FRAME_PX)] * num_frames)
    else:
        sample.pixel_values_videos = pixels
        sample.video_grid_thw = torch.tensor([_grid_thw(num_frames, FRAME_PX, FRAME_PX)])
    sample.info = {"needle_frame": needle, "start_cell": (top, left), "step": (dy, dx)}
    return sample


def make_sample(
    task: str,
    bank: DigitBank,
    length: int,
    generator: torch.Generator,
    *,
    training: bool,
    video_as_images: bool = False,
    tiled: bool = False,
) -> VLMSample:
    """One sample of ``task`` at ``length`` (grid: a ``length`` x ``length`` grid; images; frames).

    At evaluation (``training=False``) questions keep to the trained index range
    (:attr:`TaskSpec.max_query_index`); in training they may name any cell or image. ``tiled`` (grid only): see
    :func:`make_grid_sample`; the multi-image images and the video frames are one tile each, so tiling does not
    apply to them and is a ValueError there.

    Example:
        >>> s = make_sample("grid", DigitBank("val"), 6, torch.Generator().manual_seed(0), training=False)
        >>> s.length, s.info["row"] < 3 and s.info["col"] < 3
        (6, True)
    """
    spec = _task_spec(task)
    length = _check_int("length", length, 1)
    if not isinstance(training, bool):
        raise TypeError(f"training must be a bool, got {type(training).__name__}")
    if not isinstance(tiled, bool):
        raise TypeError(f"tiled must be a bool, got {type(tiled).__name__}")
    if tiled and task != "grid":
        raise ValueError(
            f"tiled applies to the grid task only (its images grow past one tile), got task {task!r}, whose "
            "images or frames are one tile each"
        )
    limit = None if training else spec.max_query_index
    if task == "grid":
        return make_grid_sample(bank, length, length, generator, max_query_index=limit, tiled=tiled)
    if task == "multi_image":
        return make_multi_image_sample(bank, length, generator, max_query_index=limit)
    return make_video_sample(bank, length, generator, video_as_images=video_as_images)


def _task_spec(task: str) -> TaskSpec:
    if not isinstance(task, str) or task not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {task!r}")
    return TASKS[task]


_TRAIN_STREAM, _EVAL_STREAM = 0, 1


class TaskDataset(Dataset):
    """``num_samples`` samples of ``task``; sample ``i`` is a pure function of ``(seed, split, length, i)``.

    Training samples (``training=True``) draw their length uniformly from ``lengths`` (for ``grid``: R and C
    independently); an evaluation dataset has one length (square grids), with questions in the trained index
    range.

    Args:
        task: a name from :data:`TASKS`.
        bank: the digits (use the ``"train"`` split for training, ``"val"`` for evaluation).
        lengths: grid sides, image counts or frame counts.
        num_samples: dataset size.
        seed: the seed of every sample.
        training: see above.
        video_as_images: see :func:`make_video_sample`.
        tiled: see :func:`make_grid_sample` (grid task only).
    """

    def __init__(
        self,
        task: str,
        bank: DigitBank,
        lengths: Sequence[int],
        num_samples: int,
        seed: int,
        training: bool,
        video_as_images: bool = False,
        tiled: bool = False,
    ) -> None:
        self.spec = _task_spec(task)
        self.task, self.bank = task, _check_bank(bank)
        if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence) or not lengths:
            raise TypeError(f"lengths must be a non-empty sequence of ints, got {lengths!r}")
        self.lengths = tuple(_check_int(f"lengths[{i}]", n, 1, 64) for i, n in enumerate(lengths))
        self.num_samples = _check_int("num_samples", num_samples, 1)
        self.seed = _check_int("seed", seed, 0)
        if not isinstance(training, bool):
            raise TypeError(f"training must be a bool, got {type(training).__name__}")
        if not training and len(self.lengths) != 1:
            raise ValueError(f"an evaluation dataset has one length (one dataset per length), got {list(lengths)}")
        if not isinstance(tiled, bool):
            raise TypeError(f"tiled must be a bool, got {type(tiled).__name__}")
        if tiled and task != "grid":
            raise ValueError(f"tiled applies to the grid task only, got task {task!r}")
        self.training, self.video_as_images, self.tiled = training, video_as_images, tiled

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> VLMSample:
        index = _check_int("index", index, 0, self.num_samples - 1)
        stream = _TRAIN_STREAM if self.training else _EVAL_STREAM
        key = 0 if self.training else self.lengths[0]
        generator = torch.Generator().manual_seed(sample_seed(self.seed, stream, key, index))
        if self.task == "grid" and self.training:
            # rows and columns drawn independently: non-square grids, so that rows and columns differ
            rows, cols = (self.lengths[int(i)] for i in torch.randint(len(self.lengths), (2,), generator=generator))
            return make_grid_sample(self.bank, rows, cols, generator, tiled=self.tiled)
        length = self.lengths[int(torch.randint(len(self.lengths), (), generator=generator))]
        return make_sample(
            self.task,
            self.bank,
            length,
            generator,
            training=self.training,
            video_as_images=self.video_as_images,
            tiled=self.tiled,
        )


def collate_samples(samples: Sequence[VLMSample]) -> dict[str, torch.Tensor]:
    """Left-pad a list of samples into one batch for ``Qwen2VLForConditionalGeneration.forward``.

    Returns ``input_ids``, ``attention_mask``, ``mm_token_type_ids`` (B, L_max), left padded so that the
    question's last token is at position -1 in every row; ``pixel_values`` / ``image_grid_thw`` and
    ``pixel_values_videos`` / ``video_grid_thw`` concatenated in sample order (present only when some sample
    has them); ``tile_grid`` likewise (tiled samples: every sample of the batch must be tiled); ``answers`` (B,)
    answer token ids; ``lengths`` (B,) task lengths.
    """
    if not samples or not all(isinstance(s, VLMSample) for s in samples):
        raise TypeError("samples must be a non-empty sequence of VLMSample")
    width = max(len(s.input_ids) for s in samples)
    batch = len(samples)
    input_ids = torch.full((batch, width), TOKENS["<pad>"], dtype=torch.long)
    types = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for b, s in enumerate(samples):
        n = len(s.input_ids)
        input_ids[b, width - n :] = s.input_ids
        types[b, width - n :] = s.mm_token_type_ids
        mask[b, width - n :] = 1
    out = {"input_ids": input_ids, "attention_mask": mask, "mm_token_type_ids": types}
    for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        present = [s for s in samples if getattr(s, grid) is not None]
        if present:
            out[pixels] = torch.cat([getattr(s, pixels) for s in present])
            out[grid] = torch.cat([getattr(s, grid) for s in present])
    tiled = [s.tile_grid is not None for s in samples]
    if any(tiled):
        if not all(tiled):
            raise ValueError(f"samples must be all tiled or all untiled, got tile_grid on {sum(tiled)} of {batch}")
        out["tile_grid"] = torch.cat([s.tile_grid for s in samples])
    out["answers"] = torch.tensor([s.answer_token for s in samples])
    out["lengths"] = torch.tensor([s.length for s in samples])
    return out
