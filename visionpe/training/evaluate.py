"""Extrapolation sweeps: accuracy of trained models at resolutions or clip lengths they never saw.

:func:`sweep` evaluates every model at every size with a loader per size (timm's eval transform at that size,
or longer clips); :func:`write_report` writes the Markdown table, the CSV and the PNG plot (accuracy against
size, one line per model, mean ± std over seeds when several are given).
"""

from __future__ import annotations

import csv
import math
import re
import statistics
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

__all__ = [
    "accuracy",
    "sweep",
    "summarize",
    "markdown_table",
    "write_report",
    "line_styles",
    "plot_palette",
    "LINE_STYLES",
]


@torch.no_grad()
def accuracy(model: nn.Module, loader: DataLoader, device: str | torch.device = "cpu") -> float:
    """Top-1 accuracy in % of ``model`` over ``loader`` (batches of (inputs, int targets))."""
    model.eval().to(device)
    correct = total = 0
    for inputs, targets in loader:
        preds = model(inputs.to(device)).argmax(dim=-1).cpu()
        correct += int((preds == targets).sum())
        total += len(targets)
    if total == 0:
        raise ValueError("loader yielded no samples: cannot compute an accuracy")
    return 100.0 * correct / total


def sweep(
    models: Mapping[str, nn.Module],
    loader_for_size: Callable[[int], DataLoader],
    sizes: Iterable[int],
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> list[dict]:
    """Rows ``{"model", "seed", "size", "acc"}`` for every model at every size."""
    sizes = list(sizes)
    if not sizes or not all(isinstance(s, int) and s > 0 for s in sizes):
        raise ValueError(f"sizes must be a non-empty list of positive ints, got {sizes!r}")
    rows = []
    for size in sizes:
        loader = loader_for_size(size)
        for name, model in models.items():
            rows.append({"model": name, "seed": seed, "size": size, "acc": accuracy(model, loader, device)})
    return rows


def summarize(
    rows: Iterable[Mapping], group: str = "model", by: str = "size"
) -> dict[str, dict[int, tuple[float, float, int]]]:
    """{row[group]: {row[by]: (mean, std, n_seeds) of row["acc"]}} in order of first appearance, sizes sorted.

    std is 0 for a single seed. ``group`` and ``by`` name the columns (e.g. ``scheme`` and ``length``).
    """
    grouped: dict[str, dict[int, list[float]]] = {}
    for row in rows:
        grouped.setdefault(row[group], {}).setdefault(int(row[by]), []).append(float(row["acc"]))
    return {
        name: {
            size: (statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else 0.0, len(v))
            for size, v in sorted(by_size.items())
        }
        for name, by_size in grouped.items()
    }


def markdown_table(rows: list[dict], size_label: str = "px") -> str:
    """Accuracy table, one row per model, one column per size (mean ± std over seeds)."""
    summary = summarize(rows)
    sizes = sorted({int(r["size"]) for r in rows})
    lines = ["| model | " + " | ".join(f"{s} {size_label}" for s in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    for model, by_size in summary.items():
        cells = []
        for s in sizes:
            mean, std, n = by_size.get(s, (math.nan, 0.0, 0))
            cells.append(f"{mean:.1f} ± {std:.1f}" if n > 1 else f"{mean:.1f}")
        lines.append(f"| {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _matplotlib():
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(
            'plots need matplotlib, part of the "train" extra; from a clone of visionpe: pip install -e ".[train]"'
        ) from err
    return matplotlib


def _names(values: Iterable[str], name: str, what: str = "") -> list[str]:
    """``values`` as a list after checking it is an iterable of str (TypeError naming ``name`` otherwise)."""
    expected = f"an iterable of str{f' ({what})' if what else ''}"
    if isinstance(values, str):
        raise TypeError(f"{name} must be {expected}, got the str {values!r}")
    values = list(values)
    wrong = [value for value in values if not isinstance(value, str)]
    if wrong:
        raise TypeError(f"{name} must be {expected}, got {wrong[0]!r}")
    return values


LINE_STYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1)), (0, (3, 1, 1, 1, 1, 1)))
_MODE_LABEL = re.compile(r"^(?P<model>.+) \[(?P<mode>[^\]]+)\]$")


def line_styles(labels: Iterable[str]) -> dict[str, tuple[tuple[float, ...], str | tuple]]:
    """{label: (colour, line style)} for plot lines labelled ``model`` or ``model [mode]``: one colour per model
    (tab10, or tab20 beyond 10 models, in order of first appearance) and one line style per mode (solid for the
    plain model), so that ``rope_mixed [pi]`` has ``rope_mixed``'s colour, dashed, and no two models share one.

    Raises:
        TypeError: ``labels`` is a str or holds anything but str.
    """
    parts = {}
    for label in dict.fromkeys(_names(labels, "labels", "one per plot line")):
        match = _MODE_LABEL.match(label)
        parts[label] = (match["model"], match["mode"]) if match else (label, "none")
    models = dict.fromkeys(model for model, _ in parts.values())
    colours, styles = plot_palette(models, dict.fromkeys(mode for _, mode in parts.values()))
    return {label: (colours[model], styles[mode]) for label, (model, mode) in parts.items()}


def plot_palette(models: Iterable[str], modes: Iterable[str] = ("none",)) -> tuple[dict, dict]:
    """({model: colour}, {mode: line style}): one colour per model (tab10, tab20 beyond 10 models, tab20, tab20b and
    tab20c beyond 20, in order) and one line style per extrapolation mode, ``"none"`` (the plain model) solid and the
    others in order: no two models share a colour, no two modes a line style.

    Raises:
        TypeError: ``models`` or ``modes`` is a str or holds anything but str.
        ValueError: more models than distinct colours (60) or more modes than line styles.
    """
    models, modes = _names(models, "models"), _names(modes, "modes")
    if "none" in modes:  # the plain model keeps the solid line
        modes.remove("none")
        modes.insert(0, "none")
    maps = _matplotlib().colormaps
    names = ("tab10",) if len(models) <= 10 else ("tab20",) if len(models) <= 20 else ("tab20", "tab20b", "tab20c")
    palette = [maps[name](i) for name in names for i in range(maps[name].N)]
    if len(models) > len(palette):
        raise ValueError(f"models must be at most {len(palette)} in one plot (distinct colours), got {len(models)}")
    if len(modes) > len(LINE_STYLES):
        raise ValueError(f"modes must be at most {len(LINE_STYLES)} in one plot (distinct line styles), got {modes}")
    colours = {m: palette[i] for i, m in enumerate(models)}
    return colours, {m: LINE_STYLES[i] for i, m in enumerate(modes)}


def write_report(rows: list[dict], out_dir: str | Path, title: str, size_label: str = "px") -> dict[str, Path]:
    """Write ``results.md``, ``results.csv`` and ``results.png`` under ``out_dir``; return their paths."""
    if not rows:
        raise ValueError("rows is empty: nothing to report")
    matplotlib = _matplotlib()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"md": out_dir / "results.md", "csv": out_dir / "results.csv", "png": out_dir / "results.png"}
    paths["md"].write_text(f"# {title}\n\nTop-1 accuracy (%)\n\n{markdown_table(rows, size_label)}\n")
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["model", "seed", "size", "acc"])
        writer.writeheader()
        writer.writerows({k: row[k] for k in ("model", "seed", "size", "acc")} for row in rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    summary = summarize(rows)
    styles = line_styles(summary)
    for model, by_size in summary.items():
        sizes = list(by_size)
        means = [by_size[s][0] for s in sizes]
        stds = [by_size[s][1] for s in sizes]
        colour, style = styles[model]
        ax.errorbar(sizes, means, yerr=stds, marker="o", capsize=3, label=model, color=colour, linestyle=style)
    ax.set_xlabel(f"test size ({size_label})")
    ax.set_ylabel("top-1 accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths["png"], dpi=120)
    plt.close(fig)
    return paths
