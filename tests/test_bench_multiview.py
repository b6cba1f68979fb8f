"""bench/multiview.py: one row per camera scheme with its ratio to the same multi-view ViT without camera encoding,
written to multiview_speed.md and .csv; a name that is not a camera scheme stops it before any model is built."""

import csv

import pytest

from .scripts import load_script
from .test_bench_results import published_untouched


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/multiview.py")


def test_main_writes_a_row_per_model(bench, monkeypatch, capsys, tmp_path):
    """Under runs/bench/multiview of the current folder by default, and the same files in --results."""
    monkeypatch.chdir(tmp_path)
    schemes = ["gta", "rayrope"]
    args = ["--model", "tiny", "--size", "32", "--batch", "1", "--rounds", "1", "--warmup", "0", "--schemes", *schemes]
    monkeypatch.setattr("sys.argv", ["bench/multiview.py", *args, "--results", str(tmp_path / "published")])
    with published_untouched():
        bench.main()
    out = tmp_path / "runs" / "bench" / "multiview"
    with open(out / "multiview_speed.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["model", "samples/s", "ratio to no camera"]
    assert [r[0] for r in rows[1:]] == [bench.BASELINE, "gta", "rayrope, encoded_dim=48"]
    assert float(rows[1][2]) == 1.0
    assert "2 views at 32px" in (out / "multiview_speed.md").read_text()
    for name in ("multiview_speed.md", "multiview_speed.csv"):
        assert (tmp_path / "published" / name).read_bytes() == (out / name).read_bytes()


def test_a_scheme_that_is_not_a_camera_scheme_is_refused(bench, monkeypatch):
    monkeypatch.setattr("sys.argv", ["bench/multiview.py", "--schemes", "rope_axial"])
    with pytest.raises(SystemExit):
        bench.main()
