"""bench/naflex.py: a mixed batch in timm's NaFlex layout at the grids it names, and a quick run printing one row per
model, timm's NaFlexVit first (ratio 1), with the same table written to naflex.md and naflex.csv."""

import csv

import pytest

from visionpe.grid import mixed_grid

from .scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/naflex.py")


def test_batch_holds_each_grid_in_timm_layout(bench):
    grid_sizes = bench.grids(5, 64)
    assert len(set(grid_sizes)) == 5 and all(h * w <= 64 for h, w in grid_sizes)
    assert any(h != w for h, w in grid_sizes)
    batch = bench.naflex_batch(grid_sizes, patch=4, seq_len=64)
    assert batch["patches"].shape == (5, 64, 48)
    assert mixed_grid(batch["patch_coord"], batch["patch_valid"]).grid_sizes == tuple(grid_sizes)


def test_quick_run_prints_and_writes_a_row_per_model(bench, monkeypatch, capsys, tmp_path):
    args = "--quick --batch 3 --patch 8 --schemes rope_axial cpe"
    monkeypatch.setattr("sys.argv", ["bench/naflex.py", *args.split(), "--out", str(tmp_path)])
    bench.main()
    out = capsys.readouterr().out
    assert "batch 3 of grids" in out and "quick mode" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "images/s" not in line]
    assert [row.split(" | ")[0] for row in rows] == [
        "| timm naflexvit_base_patch16_gap (own learned table, baseline)",
        "| visionpe learned (own table translated)",
        "| visionpe rope_axial",
        "| visionpe cpe",
    ]
    assert rows[0].split(" | ")[2] == "1.000x |" and all(float(row.split(" | ")[1]) > 0 for row in rows)
    md = (tmp_path / "naflex.md").read_text()
    assert md.startswith("Measured ") and f"command: `python bench/naflex.py {args} --out .../" in md
    with open(tmp_path / "naflex.csv", newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == ["model", "images/s", "ratio to timm NaFlexVit"]
    assert [r[0] for r in table[1:]] == [row.split(" | ")[0][2:] for row in rows] and table[1][2] == "1.000"
