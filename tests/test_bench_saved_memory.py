"""bench/saved_memory.py: the count of memory kept for the backward, and the table it writes."""

import csv

import torch

from .scripts import load_script
from .test_bench_results import published_untouched

saved_memory = load_script("bench/saved_memory.py")


def test_saved_bytes_counts_each_storage_once():
    x = torch.randn(64, 64, requires_grad=True)
    # x * x saves x twice: one storage; (x * x).exp() saves its own 16 KB output on top
    assert saved_memory.saved_bytes(lambda t: t * t, x) == 64 * 64 * 4
    assert saved_memory.saved_bytes(lambda t: (t * t).exp(), x) == 2 * 64 * 64 * 4
    assert saved_memory.saved_bytes(lambda t: t.detach() + 1, x) == 0


def test_main_writes_its_table(monkeypatch, tmp_path, capsys):
    """Under runs/bench/saved_memory of the current folder by default, and the same files in --results."""
    monkeypatch.chdir(tmp_path)
    args = "--schemes rope_axial --batch 1 --size 32"
    monkeypatch.setattr("sys.argv", ["bench/saved_memory.py", *args.split(), "--results", str(tmp_path / "published")])
    with published_untouched():
        saved_memory.main()
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "MB |" not in line]
    out = tmp_path / "runs" / "bench" / "saved_memory"
    md = (out / "saved_memory.md").read_text()
    assert md.startswith("Measured ") and f"`python bench/saved_memory.py {args} --results .../published`" in md
    assert [line for line in md.splitlines() if line.startswith("| ") and "MB |" not in line] == printed
    for name in ("saved_memory.md", "saved_memory.csv"):
        assert (tmp_path / "published" / name).read_bytes() == (out / name).read_bytes()
    with open(out / "saved_memory.csv", newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == ["model", "saved for backward, MB", "ratio to timm", "extra MB per block"]
    assert [row[0] for row in table[1:]] == [saved_memory.REFERENCE, "rope_axial"] and table[1][2] == "1.00"
