"""Multimodal extrapolation benchmark: tiny Qwen2-VL models trained on digit tasks with each position scheme.

``tasks`` (deterministic task generators from the bundled digits), ``schemes`` (the compared schemes and their
papers' training settings), ``model`` (the tiny Qwen2-VL), ``module`` / ``data`` (Lightning) and ``benchmark``
(train every scheme on every task, evaluate at every length, write tables and plots).
"""

from .benchmark import SETTINGS, BenchSetting, run_benchmark, train_and_evaluate, write_task_report
from .data import VLMTaskDataModule
from .model import MODEL_SIZES, VLMSize, build_tiny_vlm, merge_visual_tokens
from .module import VLMModule
from .schemes import BENCH_SCHEMES, DEFAULT_SCHEMES, BenchScheme, get_bench_scheme
from .tasks import (
    TASKS,
    TOKENS,
    DigitBank,
    TaskDataset,
    TaskSpec,
    VLMSample,
    collate_samples,
    make_grid_sample,
    make_multi_image_sample,
    make_sample,
    make_video_sample,
    patchify,
    tile_image,
)

__all__ = [
    "SETTINGS",
    "BenchSetting",
    "run_benchmark",
    "train_and_evaluate",
    "write_task_report",
    "BENCH_SCHEMES",
    "DEFAULT_SCHEMES",
    "BenchScheme",
    "get_bench_scheme",
    "MODEL_SIZES",
    "VLMSize",
    "build_tiny_vlm",
    "merge_visual_tokens",
    "VLMModule",
    "VLMTaskDataModule",
    "TASKS",
    "TOKENS",
    "DigitBank",
    "TaskDataset",
    "TaskSpec",
    "VLMSample",
    "collate_samples",
    "make_grid_sample",
    "make_multi_image_sample",
    "make_sample",
    "make_video_sample",
    "patchify",
    "tile_image",
]
