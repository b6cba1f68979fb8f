"""bench/results.py: the result files every benchmark writes, a Markdown table under a header line and a CSV."""

import csv
import re
import subprocess

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
