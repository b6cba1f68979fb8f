"""One writer for every benchmark's result files: ``<out_dir>/<name>.md`` and ``<out_dir>/<name>.csv``.

The Markdown file starts with one line that says when and on what the numbers were measured (UTC date, git
commit with ``+dirty`` when tracked files have uncommitted changes, torch and timm versions, the device) and the
exact command that wrote it, then optional notes (the settings of the run), then the table. The CSV file holds the
same table, header row first, with no comments, so that it loads as it is::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # in a bench/ script: the repository root
    from bench.results import write_results

    write_results(
        "throughput",
        [["timm vit_small_patch16_224", 123.4, 1.0]],
        ["model", "images/s", "ratio"],
        out_dir="runs/bench/throughput",
        formats={"images/s": ".1f", "ratio": ".3f"},
        notes="batch 8, 224 px, fp32",
    )

Where the files go: a benchmark writes them under ``runs/`` (git ignores it), by default ``runs/bench/<name>``
(``--out``), and into the published tables, ``docs/benchmarks/results``, only when it is given
``--results docs/benchmarks/results``: :func:`add_output_arguments` adds both options, :func:`output_error` refuses
an ``--out`` inside the published folder and ``--results`` with a quick mode, :func:`copy_results` copies the
written files to ``--results``. A quick mode (``--quick``, ``--dry-run``...) prints :func:`print_quick_notice`'s
one line: its numbers check the pipeline and measure nothing.

Paths never appear as they are on the machine that ran the benchmark: paths inside the repository are written
relative to its root, others as ``.../<last component>``; the interpreter is written as ``python``.
"""

from __future__ import annotations

import csv
import datetime
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from argparse import ArgumentParser
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the published tables (committed, linked from the documentation); written only through an explicit ``--results``
PUBLISHED = "docs/benchmarks/results"
#: the folder of every benchmark's own result files, ``runs/bench/<name>`` (git ignores ``runs/``)
RUNS = "runs/bench"

# an absolute path, not part of a word or of a relative path ("images/s", "fwd/bwd", "bench/memory.py")
_ABSOLUTE = re.compile(r"(?<![\w.~/-])/[\w.+~-]+(?:/[\w.+~-]+)*/?")


def relative_path(text: str) -> str:
    """``text`` with every absolute path made relative to the repository root, or ``.../<last component>``."""
    root = str(ROOT)

    def replace(match: re.Match[str]) -> str:
        path = match.group(0)
        if path == root or path.startswith(root + "/"):
            return os.path.relpath(path, root)
        name = Path(path.rstrip("/")).name
        return f".../{name}" if name else "..."

    return _ABSOLUTE.sub(replace, text)


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that ran, shell-quoted, as ``python <script> <args>``, with no machine paths in it."""
    argv = list(sys.argv if argv is None else argv)
    if not argv:
        return "python"
    return shlex.join(["python", *(relative_path(arg) for arg in argv)])


def last_options(argv: Sequence[str]) -> list[str]:
    """``argv`` with every ``--option`` (with its values) kept only where it is given last.

    For scripts whose options are all argparse ``store`` actions, where the last occurrence wins: a wrapper script's
    defaults followed by the user's overrides then read as the command that ran in effect. The program name and
    anything before the first option stay in place; ``--name=value`` counts as ``--name``.
    """
    argv = list(argv)
    head = next((i for i, arg in enumerate(argv) if arg.startswith("--")), len(argv))
    groups: list[list[str]] = []
    for arg in argv[head:]:
        if arg.startswith("--"):
            groups.append([arg])
        else:
            groups[-1].append(arg)
    last = {group[0].split("=", 1)[0]: i for i, group in enumerate(groups)}
    return argv[:head] + [
        arg for i, group in enumerate(groups) if last[group[0].split("=", 1)[0]] == i for arg in group
    ]


def git_commit() -> str:
    """The short hash of HEAD, with ``+dirty`` when tracked files have uncommitted changes; ``unknown`` without git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        changes = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if changes else "")


def cpu_name() -> str:
    """The CPU model (Linux ``/proc/cpuinfo``; ``platform.processor()`` elsewhere) and its core count."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    return f"{model}, {os.cpu_count()} cores"


def device_name(device: str | None = None) -> str:
    """``device`` in words: the CUDA device's name for ``cuda``/``cuda:N``, else the CPU (model and core count)."""
    if device and device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(torch.device(device))
        return f"{device} (not available)"
    return f"CPU ({cpu_name()})"


def _versions() -> str:
    parts = []
    for module in ("torch", "timm"):
        try:
            parts.append(f"{module} {__import__(module).__version__}")
        except ImportError:
            parts.append(f"{module} not installed")
    return ", ".join(parts)


def header(
    device: str | None = None, command: Sequence[str] | str | None = None, now=None, commit: str | None = None
) -> str:
    """The first line of a result file: date (UTC), commit, torch and timm versions, device, command.

    ``commit``: the commit(s) the measurements ran at, when they were not taken at the current one (e.g. runs
    trained earlier and reused); default :func:`git_commit`."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    cmd = relative_path(command) if isinstance(command, str) else command_line(command)
    return (
        f"Measured {now:%Y-%m-%d %H:%M} UTC, commit {commit or git_commit()}, {_versions()}, {device_name(device)}; "
        f"command: `{cmd}`"
    )


def _cell(value, fmt: str | None) -> str:
    if value is None:
        return ""
    if fmt and isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, fmt)
    return relative_path(str(value))


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def table_cells(
    rows: Iterable[Sequence | Mapping], columns: Sequence[str], formats: Mapping[str, str] | None = None
) -> list[list[str]]:
    """``rows`` (sequences in column order, or mappings by column name) as strings, formatted per column."""
    formats = formats or {}
    cells = []
    for row in rows:
        values = [row.get(c) for c in columns] if isinstance(row, Mapping) else list(row)
        if len(values) != len(columns):
            raise ValueError(f"row {values!r} has {len(values)} values for {len(columns)} columns")
        cells.append([_cell(v, formats.get(c)) for c, v in zip(columns, values, strict=True)])
    return cells


def markdown_table(columns: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    """A Markdown table; columns whose cells are all numbers (or empty) are right-aligned."""

    def escape(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    align = []
    for j in range(len(columns)):
        values = [row[j] for row in cells if row[j]]
        align.append("---:" if values and all(_numeric(v) for v in values) else "---")
    lines = ["| " + " | ".join(escape(c) for c in columns) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(escape(v) for v in row) + " |" for row in cells]
    return "\n".join(lines)


def write_results(
    name: str,
    rows: Iterable[Sequence | Mapping],
    columns: Sequence[str],
    *,
    out_dir: str | os.PathLike,
    command: Sequence[str] | str | None = None,
    notes: str | Sequence[str] | None = None,
    device: str | None = None,
    formats: Mapping[str, str] | None = None,
    commit: str | None = None,
) -> tuple[Path, Path]:
    """Write ``<out_dir>/<name>.md`` and ``<out_dir>/<name>.csv``; returns their paths.

    ``rows``: sequences in the order of ``columns``, or mappings from column name to value; ``None`` is an empty
    cell. ``formats``: a format spec per column for numbers (``{"images/s": ".1f"}``), the same in both files.
    ``command``: the argv (default ``sys.argv``) or a ready string. ``notes``: lines between the header and the
    table (the run's settings). ``device``: ``"cuda"`` names the CUDA device, anything else the CPU. ``commit``: see
    :func:`header`. ``out_dir`` has no default (a script passes its ``--out``, see :func:`add_output_arguments`);
    a relative one is taken from the current directory, and created if missing.
    """
    cells = table_cells(rows, columns, formats)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [header(device, command, commit=commit)]
    if notes:
        for note in [notes] if isinstance(notes, str) else notes:
            lines += ["", relative_path(note)]
    lines += ["", markdown_table(columns, cells), ""]
    md_path, csv_path = out / f"{name}.md", out / f"{name}.csv"
    md_path.write_text("\n".join(lines))
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(cells)
    return md_path, csv_path


def runs_dir(name: str) -> str:
    """``runs/bench/<name>``: where the benchmark ``name`` writes its result files unless given ``--out``."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if not re.fullmatch(r"[\w.-]+", name) or set(name) == {"."}:
        raise ValueError(f"name must be a file name (letters, digits, '_', '-', '.'), got {name!r}")
    return f"{RUNS}/{name}"


def is_published(path: str | os.PathLike) -> bool:
    """Whether ``path`` (a relative one: from the current directory) is the published folder
    ``docs/benchmarks/results`` of this repository or lies inside it."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if not str(path):
        raise ValueError("path must not be empty")
    published = (ROOT / PUBLISHED).resolve()
    target = Path(path).resolve()
    return target == published or published in target.parents


def add_output_arguments(parser: ArgumentParser, name: str, files: str) -> None:
    """Add ``--out DIR`` (default :func:`runs_dir` of ``name``) and ``--results DIR`` (default none) to ``parser``.

    ``files``: what the script writes there, for the help (e.g. ``"throughput.md and .csv"``). ``--results`` gets the
    same files, copied after they are written (:func:`copy_results`); the published tables are
    ``--results docs/benchmarks/results``.
    """
    if not isinstance(parser, ArgumentParser):
        raise TypeError(f"parser must be an argparse.ArgumentParser, got {type(parser).__name__}")
    if not isinstance(files, str) or not files:
        raise ValueError(f"files must be a non-empty str, got {files!r}")
    default = runs_dir(name)
    parser.add_argument("--out", default=default, help=f"folder of {files} (default {default}; git ignores runs/)")
    parser.add_argument(
        "--results",
        default=None,
        help=f"also write {files} there; the published tables are --results {PUBLISHED} (refused in a quick mode)",
    )


def output_error(
    out: str | os.PathLike | None,
    results: str | os.PathLike | None = None,
    quick: str | None = None,
    *,
    quick_results: bool = False,
) -> str | None:
    """Why a script's output folders must be refused, or ``None`` when they are fine.

    ``out``: the run's own folder (``--out``; ``None``: a script without one); it may not lie in the published
    folder, which only ``--results`` writes. ``results``: ``--results`` (``None``: not given). ``quick``: how the
    quick mode in effect is spelled (``"--quick"``, ``"--dry-run"``, ``"--setting quick"``), ``None`` for a
    measurement; a quick run takes no ``--results``, unless ``quick_results`` (a script whose quick runs write
    their tables to a folder of their own, in its tests and ``bench/gpu_smoke.sh --dry-run``), and then never the
    published folder.
    """
    if quick is not None and (not isinstance(quick, str) or not quick):
        raise ValueError(f"quick must be None or the quick mode's option as given, got {quick!r}")
    if not isinstance(quick_results, bool):
        raise TypeError(f"quick_results must be a bool, got {type(quick_results).__name__}")
    if out is not None and is_published(out):
        return (
            f"--out {os.fspath(out)} is the published results folder ({PUBLISHED}); --out is the run's own folder "
            f"(under runs/), and the published tables are written with --results {PUBLISHED}"
        )
    if quick is None or results is None:
        return None
    if not quick_results:
        return (
            f"{quick} is a pipeline check, not a measurement, and takes no --results (its numbers never go into "
            f"result tables); drop --results, or run without {quick}"
        )
    if is_published(results):
        return (
            f"{quick} is a pipeline check, not a measurement: --results {os.fspath(results)} is the published results "
            f"folder ({PUBLISHED}); give --results another folder, or run without {quick}"
        )
    return None


def print_quick_notice(quick: str) -> None:
    """Print the one line of a quick mode (``quick``: its option as given, e.g. ``"--quick"``): its numbers check
    that the pipeline runs and measure nothing."""
    if not isinstance(quick, str) or not quick:
        raise ValueError(f"quick must be the quick mode's option as given, got {quick!r}")
    print(f"{quick}: the numbers of this run are a pipeline check, not a measurement", flush=True)


def copy_results(paths: Iterable[str | os.PathLike], results: str | os.PathLike) -> list[Path]:
    """Copy the result files ``paths`` into the folder ``results`` (created if missing); returns the copies' paths.

    A file already in ``results`` (``--results`` the same folder as ``--out``) is left as it is.
    """
    if not isinstance(results, (str, os.PathLike)) or not str(results):
        raise ValueError(f"results must be a folder path, got {results!r}")
    sources = [Path(p) for p in paths]
    missing = [str(p) for p in sources if not p.is_file()]
    if missing:
        raise ValueError(f"paths must be existing files, got {missing}")
    folder = Path(results)
    folder.mkdir(parents=True, exist_ok=True)
    copies = []
    for source in sources:
        target = folder / source.name
        if not (target.exists() and target.resolve() == source.resolve()):
            shutil.copyfile(source, target)
        copies.append(target)
    return copies
