"""bench/data_pipeline.py: a tiny CPU run trains the same model on synthetic data and through both data pipelines
and writes one row per pipeline, the synthetic one the baseline of the ratios."""

import csv

import pytest

from .scripts import load_script
from .test_bench_results import PUBLISHED, published_untouched, quick_notices


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/data_pipeline.py")


def test_dry_run_on_the_cpu_writes_a_row_per_pipeline(bench, monkeypatch, tmp_path, capsys):
    """A dry run says once that it measures nothing and writes under runs/bench/data_pipeline of the current folder."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    argv = ["--device", "cpu", "--dry-run", "--cache", str(tmp_path / "jpegs")]
    monkeypatch.setattr("sys.argv", ["bench/data_pipeline.py", *argv])
    with published_untouched():
        rows = bench.main()
    assert quick_notices(capsys.readouterr().out) == [
        "--dry-run: the numbers of this run are a pipeline check, not a measurement"
    ]
    assert [row[0] for row in rows] == ["synthetic", "gpu", "gpu-workers", "cpu"]
    assert rows[0][3] == "1.000x" and all(row[1] > 0 and row[2] == pytest.approx(4 * row[1]) for row in rows)
    out = tmp_path / "runs" / "bench" / "data_pipeline"
    assert sorted(p.name for p in out.iterdir()) == ["data_pipeline.csv", "data_pipeline.md"]
    md = (out / "data_pipeline.md").read_text()
    assert md.startswith("Measured ") and "command: `python bench/data_pipeline.py --device cpu --dry-run" in md
    assert "batch 4" in md and "16 generated JPEGs" in md
    with open(out / "data_pipeline.csv", newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == ["pipeline", "steps/s", "images/s", "ratio to synthetic"]
    assert [r[0] for r in table[1:]] == ["synthetic", "gpu", "gpu-workers", "cpu"] and table[1][3] == "1.000x"
    assert len(list((tmp_path / "jpegs").rglob("*.jpg"))) == 16 + (3 + 1) * 4 + 10  # images, train and val links


@pytest.mark.parametrize("results", [str(PUBLISHED), "elsewhere"], ids=["published", "elsewhere"])
def test_dry_run_takes_no_results(bench, capsys, results):
    with published_untouched(), pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--device", "cpu", "--dry-run", "--results", results])
    assert exit_.value.code == 2
    assert "--dry-run is a pipeline check, not a measurement, and takes no --results" in capsys.readouterr().err


def test_arguments_are_checked(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--steps", "0"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--pipelines", "disk"])
