"""bench/naflex.py: a mixed batch in timm's NaFlex layout at the grids it names, and a quick run printing one row per
model, timm's NaFlexVit first (ratio 1), with the same table written to naflex.md and naflex.csv."""

import csv

import pytest

from visionpe.grid import mixed_grid

from .scripts import load_script
from .test_bench_results import PUBLISHED, published_untouched, quick_notices


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
    """A quick run says once that it measures nothing and writes under runs/bench/naflex of the current folder."""
    monkeypatch.chdir(tmp_path)
    args = "--quick --batch 3 --patch 8 --schemes rope_axial cpe"
    monkeypatch.setattr("sys.argv", ["bench/naflex.py", *args.split()])
    with published_untouched():
        bench.main()
    out = capsys.readouterr().out
    assert "batch 3 of grids" in out and "quick mode" in out
    assert quick_notices(out) == ["--quick: the numbers of this run are a pipeline check, not a measurement"]
    out_dir = tmp_path / "runs" / "bench" / "naflex"
    rows = [line for line in out.splitlines() if line.startswith("| ") and "images/s" not in line]
    assert [row.split(" | ")[0] for row in rows] == [
        "| timm naflexvit_base_patch16_gap (own learned table, baseline)",
        "| visionpe learned (own table translated)",
        "| visionpe rope_axial",
        "| visionpe cpe",
    ]
    assert rows[0].split(" | ")[2] == "1.000x |" and all(float(row.split(" | ")[1]) > 0 for row in rows)
    md = (out_dir / "naflex.md").read_text()
    assert md.startswith("Measured ") and f"command: `python bench/naflex.py {args}`" in md
    with open(out_dir / "naflex.csv", newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == ["model", "images/s", "ratio to timm NaFlexVit"]
    assert [r[0] for r in table[1:]] == [row.split(" | ")[0][2:] for row in rows] and table[1][2] == "1.000"


@pytest.mark.parametrize("results", [str(PUBLISHED), "elsewhere"], ids=["published", "elsewhere"])
def test_quick_run_takes_no_results(bench, monkeypatch, capsys, tmp_path, results):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["bench/naflex.py", "--quick", "--results", results])
    with published_untouched(), pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2 and "--quick is a pipeline check, not a measurement, and takes no --results" in (
        capsys.readouterr().err
    )
    assert not list(tmp_path.iterdir())  # refused before anything ran or was written
