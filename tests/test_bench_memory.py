"""bench/memory.py: a small run measures each model in its own process and writes the table it prints."""

import csv
import os

import pytest

from .scripts import load_script
from .test_bench_results import published_untouched

pytestmark = pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc/self/clear_refs"
)


def test_small_run_writes_its_table(monkeypatch, capsys, tmp_path):
    """Under runs/bench/memory of the current folder by default, and the same files in --results."""
    bench = load_script("bench/memory.py")
    monkeypatch.chdir(tmp_path)
    args = "--schemes rope_axial --size 256 --threads 1"
    monkeypatch.setattr("sys.argv", ["bench/memory.py", *args.split(), "--results", str(tmp_path / "published")])
    with published_untouched():
        bench.main()
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "peak MB" not in line]
    assert [line.split(" | ")[0] for line in printed] == ["| timm", "| rope_axial"]
    out = tmp_path / "runs" / "bench" / "memory"
    md = (out / "memory.md").read_text()
    assert md.startswith("Measured ") and f"`python bench/memory.py {args} --results .../published`" in md
    assert "ViT-S/16 at 256x256 (256 patches)" in md
    for name in ("memory.md", "memory.csv"):
        assert (tmp_path / "published" / name).read_bytes() == (out / name).read_bytes()
    with open(out / "memory.csv", newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == ["scheme", "peak MB", "ratio vs timm", "forward s", "note"]
    assert [row[0] for row in table[1:]] == ["timm", "rope_axial"] and table[1][2] == "1.00"
    assert [row[1] for row in table[1:]] == [line.split(" | ")[1] for line in printed]


def test_update_measures_the_named_schemes_again_and_keeps_the_other_rows(monkeypatch, tmp_path):
    bench = load_script("bench/memory.py")
    monkeypatch.setattr(
        "sys.argv", ["bench/memory.py", "--schemes", "none", "sincos", "--size", "64", "--out", str(tmp_path)]
    )
    bench.main()
    first = (tmp_path / "memory.csv").read_text().splitlines()
    header = (tmp_path / "memory.md").read_text().splitlines()[0]
    args = ["--schemes", "sincos", "--update", "--size", "64", "--out", str(tmp_path)]
    monkeypatch.setattr("sys.argv", ["bench/memory.py", *args])
    bench.main()
    with open(tmp_path / "memory.csv", newline="") as f:
        table = list(csv.reader(f))
    assert [row[0] for row in table[1:]] == ["timm", "none", "sincos"]
    assert table[2] == next(line for line in first if line.startswith("none")).split(",")  # kept as it was
    md = (tmp_path / "memory.md").read_text()
    assert "Rows measured by this command: timm, sincos" in md and header.removeprefix("Measured ") in md
    monkeypatch.setattr("sys.argv", ["bench/memory.py", "--update", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench.main()
