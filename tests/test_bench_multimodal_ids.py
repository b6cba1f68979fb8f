"""bench/multimodal_ids.py: a small run checks both functions agree, prints its timings and writes the same table."""

import csv

import pytest

from .scripts import load_script

pytest.importorskip("transformers")


def test_small_run_writes_its_table(monkeypatch, capsys, tmp_path):
    bench = load_script("bench/multimodal_ids.py")
    args = "--batch 2 --tokens 300 --rounds 1 --calls 1"
    monkeypatch.setattr("sys.argv", ["bench/multimodal_ids.py", *args.split(), "--out", str(tmp_path)])
    bench.main()
    out = capsys.readouterr().out
    assert "identical output: True" in out
    md = (tmp_path / "multimodal_ids.md").read_text()
    assert md.startswith("Measured ") and f"`python bench/multimodal_ids.py {args} --out .../" in md
    assert "identical ids and deltas from both: True" in md
    with open(tmp_path / "multimodal_ids.csv", newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == ["function", "wall min ms", "wall median ms", "cpu min ms", "cpu median ms"]
    assert [row[0].split(" ")[0] for row in table[1:]] == ["transformers", "visionpe", "speed-up"]
    printed = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ")}
    assert table[1][1:] == printed["transformers"] and table[2][1:] == printed["visionpe"]
    assert all(float(value) > 0 for row in table[1:] for value in row[1:])
