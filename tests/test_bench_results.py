"""bench/results.py: the result files every benchmark writes, a Markdown table under a header line and a CSV."""

import argparse
import contextlib
import csv
import hashlib
import os
import re
import subprocess

import pytest
import timm
import torch

from .scripts import ROOT, load_script

results = load_script("bench/results.py")

COLUMNS = ["model", "images/s", "ratio"]
ROWS = [["timm vit_small_patch16_224 (baseline)", 123.456, 1.0], {"model": "rope_axial", "images/s": 100.0}]


def write(tmp_path, **kwargs):
    kwargs.setdefault("command", ["bench/throughput.py", "--rounds", "3"])
    return results.write_results(
        "throughput", ROWS, COLUMNS, out_dir=tmp_path / "out", formats={"images/s": ".1f", "ratio": ".3f"}, **kwargs
    )


def test_header_names_date_commit_versions_device_and_command(tmp_path):
    md, _ = write(tmp_path, notes="batch 8, 224 px")
    first, *rest = md.read_text().splitlines()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert re.match(r"Measured \d{4}-\d\d-\d\d \d\d:\d\d UTC, commit ", first)
    assert f"commit {head.stdout.strip()}" in first
    assert f"torch {torch.__version__}" in first and f"timm {timm.__version__}" in first
    assert "CPU (" in first and "cores)" in first
    assert first.endswith("command: `python bench/throughput.py --rounds 3`")
    assert rest[:2] == ["", "batch 8, 224 px"]


def test_table_matches_rows_and_csv_round_trips(tmp_path):
    md, path = write(tmp_path)
    assert md.name == "throughput.md" and path.name == "throughput.csv"
    table = [line for line in md.read_text().splitlines() if line.startswith("|")]
    assert table == [
        "| model | images/s | ratio |",
        "|---|---:|---:|",
        "| timm vit_small_patch16_224 (baseline) | 123.5 | 1.000 |",
        "| rope_axial | 100.0 |  |",
    ]
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows == [COLUMNS, ["timm vit_small_patch16_224 (baseline)", "123.5", "1.000"], ["rope_axial", "100.0", ""]]
    assert not path.read_text().startswith("#")


def test_no_machine_paths(tmp_path):
    script = str(ROOT / "bench" / "throughput.py")
    md, path = write(tmp_path, command=[script, "--out", str(tmp_path / "out"), f"--log={tmp_path}/log.txt"])
    text = md.read_text() + path.read_text()
    assert str(ROOT) not in text and str(tmp_path) not in text
    assert "command: `python bench/throughput.py --out .../out --log=.../log.txt`" in text
    # error messages in cells lose their paths too; a unit such as images/s is no path
    assert results.relative_path(f"{ROOT}/visionpe/base.py: error in images/s") == "visionpe/base.py: error in images/s"


def test_rows_must_fit_the_columns(tmp_path):
    try:
        results.write_results("bad", [[1, 2]], COLUMNS, out_dir=tmp_path)
    except ValueError as error:
        assert "2 values for 3 columns" in str(error)
    else:
        raise AssertionError("a short row was accepted")


def test_cuda_device_named_or_marked_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert results.device_name("cuda") == "cuda (not available)"
    assert results.device_name("cpu").startswith("CPU (")


def test_last_options_keeps_each_option_where_it_is_given_last():
    argv = ["train/scenes.py", "--config", "c.yaml", "--seeds", "0", "--jobs", "2", "--seeds", "0", "1", "2", "--reuse"]
    assert results.last_options(argv) == [
        "train/scenes.py",
        "--config",
        "c.yaml",
        "--jobs",
        "2",
        "--seeds",
        "0",
        "1",
        "2",
        "--reuse",
    ]
    assert results.last_options(["x.py", "--a=1", "--b", "--a", "2"]) == ["x.py", "--b", "--a", "2"]
    assert results.last_options(["x.py", "pos"]) == ["x.py", "pos"]
    assert results.last_options([]) == []


PUBLISHED = ROOT / results.PUBLISHED


def _state(folder):
    """Every file under ``folder``: its bytes (to put back) and its modification time."""
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


@contextlib.contextmanager
def published_untouched(folder=PUBLISHED):
    """Run the block, then fail if it wrote, added or removed a file under ``folder`` (the published tables,
    ``docs/benchmarks/results``; compared by SHA-256 and modification time). A file the block changed is put back
    as it was (bytes and time) and a file it added is removed before the failure, so that a failing test leaves
    the published tables as they were."""
    before = _state(folder)
    try:
        yield
    finally:
        after = _state(folder)
        changed = []
        for path in sorted(before.keys() | after.keys()):
            old, new = before.get(path), after.get(path)
            if old is not None and new is not None and old[1] == new[1]:
                if hashlib.sha256(old[0]).digest() == hashlib.sha256(new[0]).digest():
                    continue
            changed.append(path.relative_to(folder).as_posix())
            if old is None:
                path.unlink()
            else:
                path.write_bytes(old[0])
                os.utime(path, ns=(old[1], old[1]))
    assert not changed, f"the run changed the published tables in {folder}: {changed} (put back as they were)"


def quick_notices(text):
    """The lines of ``text`` that are the quick-mode notice (``bench/results.py``'s ``print_quick_notice``)."""
    return [
        line
        for line in text.splitlines()
        if line.endswith(": the numbers of this run are a pipeline check, not a measurement")
    ]


def test_published_untouched_catches_and_undoes_a_write(tmp_path):
    folder = tmp_path / "published"
    folder.mkdir()
    (folder / "table.md").write_text("measured")
    with published_untouched(folder):
        (folder / "table.md").read_text()
    try:
        with published_untouched(folder):
            (folder / "table.md").write_text("quick numbers")
            (folder / "new.csv").write_text("x")
    except AssertionError as error:
        assert "['new.csv', 'table.md']" in str(error)
    else:
        raise AssertionError("a write into the published folder went unnoticed")
    assert (folder / "table.md").read_text() == "measured" and not (folder / "new.csv").exists()


def test_runs_dir_and_published_folder(tmp_path, monkeypatch):
    assert results.runs_dir("throughput") == "runs/bench/throughput"
    for bad in ("", "a/b", "..", "x y"):
        with pytest.raises(ValueError, match="name must be a file name"):
            results.runs_dir(bad)
    with pytest.raises(TypeError, match="name must be a str"):
        results.runs_dir(3)
    assert results.is_published(PUBLISHED) and results.is_published(PUBLISHED / "sub" / "x")
    assert results.is_published(ROOT / "docs" / "benchmarks" / ".." / "benchmarks" / "results")
    assert not results.is_published(ROOT / "docs" / "benchmarks") and not results.is_published(tmp_path)
    monkeypatch.chdir(ROOT)  # a relative path is read from the current directory
    assert results.is_published("docs/benchmarks/results") and not results.is_published("runs/bench/throughput")
    monkeypatch.chdir(tmp_path)
    assert not results.is_published("docs/benchmarks/results")
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        results.is_published(None)


def test_output_arguments_default_to_runs_and_refuse_the_published_folder():
    parser = argparse.ArgumentParser()
    results.add_output_arguments(parser, "naflex", "naflex.md and .csv")
    args = parser.parse_args([])
    assert args.out == "runs/bench/naflex" and args.results is None
    assert results.output_error(args.out, args.results) is None
    assert results.output_error(args.out, "anywhere") is None  # a measurement may write any folder
    error = results.output_error(PUBLISHED, None)
    assert error.startswith(f"--out {PUBLISHED} is the published results folder") and "--results" in error
    # a quick mode: no --results at all, or (for the scripts whose quick runs write their own tables) none published
    assert "--quick is a pipeline check, not a measurement, and takes no --results" in results.output_error(
        args.out, "elsewhere", "--quick"
    )
    assert results.output_error(args.out, "elsewhere", "--quick", quick_results=True) is None
    error = results.output_error(args.out, PUBLISHED / "x", "--setting quick", quick_results=True)
    assert error.startswith("--setting quick is a pipeline check") and "is the published results folder" in error
    assert results.output_error(args.out, None, "--quick") is None
    with pytest.raises(ValueError, match="quick must be None or"):
        results.output_error(args.out, None, "")
    with pytest.raises(TypeError, match="quick_results must be a bool"):
        results.output_error(args.out, None, "--quick", quick_results=1)
    with pytest.raises(TypeError, match="parser must be an argparse.ArgumentParser"):
        results.add_output_arguments(None, "naflex", "naflex.md")
    with pytest.raises(ValueError, match="files must be a non-empty str"):
        results.add_output_arguments(argparse.ArgumentParser(), "naflex", "")


def test_quick_notice_is_one_line(capsys):
    results.print_quick_notice("--dry-run")
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and quick_notices(out) == [out.rstrip("\n")] and out.startswith("--dry-run: ")
    with pytest.raises(ValueError, match="quick must be the quick mode's option"):
        results.print_quick_notice("")


def test_copy_results_copies_the_written_files(tmp_path):
    md, csv_path = write(tmp_path)
    copies = results.copy_results([md, csv_path], tmp_path / "published")
    assert copies == [tmp_path / "published" / "throughput.md", tmp_path / "published" / "throughput.csv"]
    assert [p.read_bytes() for p in copies] == [md.read_bytes(), csv_path.read_bytes()]
    assert results.copy_results([md], md.parent) == [md]  # --results the folder of --out: left as it is
    with pytest.raises(ValueError, match="paths must be existing files"):
        results.copy_results([tmp_path / "missing.md"], tmp_path / "published")
    with pytest.raises(ValueError, match="results must be a folder path"):
        results.copy_results([md], "")
