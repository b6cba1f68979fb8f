"""bench/multimodal_ids.py: a quick run checks visionpe against transformers and every design against its per-sample
loop, prints its timings and writes both tables; the mixed batches have what they claim."""

import csv

import pytest
import torch

from visionpe.multimodal import list_multimodal_schemes

from .scripts import load_script
from .test_bench_results import PUBLISHED, published_untouched, quick_notices

pytest.importorskip("transformers")


def _table(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_quick_run_writes_both_tables(monkeypatch, capsys, tmp_path):
    """A quick run says once that it measures nothing and writes under runs/bench/multimodal_ids of the current
    folder, never into the published tables."""
    bench = load_script("bench/multimodal_ids.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["bench/multimodal_ids.py", "--quick"])
    with published_untouched():
        bench.main()
    out = capsys.readouterr().out
    assert "identical output: True" in out
    assert quick_notices(out) == ["--quick: the numbers of this run are a pipeline check, not a measurement"]
    out_dir = tmp_path / "runs" / "bench" / "multimodal_ids"
    assert sorted(p.name for p in out_dir.iterdir()) == [
        "multimodal_ids.csv",
        "multimodal_ids.md",
        "multimodal_ids_collator.csv",
        "multimodal_ids_collator.md",
        "multimodal_ids_designs.csv",
        "multimodal_ids_designs.md",
    ]
    md = (out_dir / "multimodal_ids.md").read_text()
    assert md.startswith("Measured ") and "`python bench/multimodal_ids.py --quick`" in md
    assert "identical ids and deltas from both on every batch" in md and "process CPU time" in md
    table = _table(out_dir / "multimodal_ids.csv")
    assert table[0] == bench.ID_COLUMNS
    assert [row[0] for row in table[1:]] == ["fixed", "mixed-0", "mixed-1", "mixed, overall"]
    printed = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ")}
    for row in table[1:3]:
        assert printed[row[0]][4:6] == row[4:6]  # the same ms printed and written
    for row in table[1:]:
        assert all(float(value) > 0 for value in row[4:7])
    overall = table[-1]
    assert float(overall[6]) == pytest.approx(float(overall[4]) / float(overall[5]), abs=0.06)

    designs = _table(out_dir / "multimodal_ids_designs.csv")
    assert designs[0] == bench.DESIGN_COLUMNS
    assert [row[0] for row in designs[1:]] == list_multimodal_schemes()
    for row in designs[1:]:
        assert all(float(value) > 0 for value in row[2:7])
        assert row[7] == "identical" or row[7].startswith("within ")
    options = {row[0]: row[1] for row in designs[1:]}
    assert "interval=2" in options["pype"] and "clusters" in options["ppe"] and "input_ids" in options["bipe"]
    assert "tile_grid" in options["rope_dhr"]
    assert (out_dir / "multimodal_ids_designs.md").read_text().startswith("Measured ")

    collated = _table(out_dir / "multimodal_ids_collator.csv")  # per batch, a plain and a per-layer, masked design
    assert collated[0] == bench.COLLATOR_COLUMNS
    assert [row[:2] for row in collated[1:]] == [
        [batch, scheme] for batch in ("fixed", "mixed-0", "mixed-1") for scheme in bench.COLLATOR_DESIGNS
    ]
    for row in collated[1:]:
        loader, forward, ratio = (float(value) for value in row[2:5])
        assert loader > 0 and forward > 0 and ratio == pytest.approx(loader / forward, rel=0.05, abs=0.01)
    assert "DataLoader worker" in (out_dir / "multimodal_ids_collator.md").read_text()


def test_collator_disagreement_stops_before_timing(monkeypatch):
    bench = load_script("bench/multimodal_ids.py")
    batch = bench.make_mixed_batch(4, seed=0, side=(16, 20), text=(8, 16))
    real = bench.VLMPositionCollator.__call__

    def shifted(self, features):
        out = real(self, features)
        if not isinstance(features, dict):  # the samples' batch, not the padded one
            out["position_ids"] = out["position_ids"] + 1
        return out

    monkeypatch.setattr(bench.VLMPositionCollator, "__call__", shifted)
    with pytest.raises(SystemExit, match="collator's ids of sample 0"):
        bench.compare_collator("mrope", batch, rounds=1, calls=1)


def test_mixed_batches_mix_images_and_padding_sides():
    bench = load_script("bench/multimodal_ids.py")
    batch = bench.make_mixed_batch(16, seed=0)
    assert batch.types.shape[0] == 16 and sum(batch.images_per_sample) == len(batch.grids)
    assert set(batch.images_per_sample) <= {0, 1, 2, 3} and len(set(batch.images_per_sample)) > 1
    assert ((batch.grids[:, 1:] >= 16) & (batch.grids[:, 1:] <= 46) & (batch.grids[:, 1:] % 2 == 0)).all()
    lengths = batch.mask.sum(1)
    shorter = lengths < batch.types.shape[1]
    assert (batch.mask[0::2, -1] == 1).all() and (batch.mask[1::2, 0] == 1).all()  # left, then right padded
    assert shorter[0::2].any() and shorter[1::2].any()
    for b in range(16):  # each sample alone holds exactly its own images' tokens
        types, keep, rows = batch.sample(b)
        assert int(keep.sum()) == types.shape[1]
        assert int((types == 1).sum()) == int((batch.grids[rows].prod(1) // 4).sum())


def test_disagreement_stops_before_timing(monkeypatch):
    bench = load_script("bench/multimodal_ids.py")
    batch = bench.make_mixed_batch(4, seed=0, side=(16, 20), text=(8, 16))
    real = bench.get_position_ids

    def off_by_one(*args, **kwargs):
        pos, delta = real(*args, **kwargs)
        return pos + (args[1].shape[0] == 1), delta  # a sample alone (B = 1) gets shifted ids

    monkeypatch.setattr(bench, "get_position_ids", off_by_one)
    with pytest.raises(SystemExit, match="alone differs from the batch"):
        bench.compare_with_loop("mrope", batch, rounds=1, calls=1)
    monkeypatch.setattr(bench, "get_position_ids", lambda *a, **k: (torch.zeros(3, 4, 1), torch.zeros(4, 1)))
    with pytest.raises(SystemExit, match="disagree"):
        bench.compare_with_transformers(batch, rounds=1, calls=1)


@pytest.mark.parametrize("results", [str(PUBLISHED), "elsewhere"], ids=["published", "elsewhere"])
def test_quick_run_takes_no_results(monkeypatch, capsys, tmp_path, results):
    bench = load_script("bench/multimodal_ids.py")
    monkeypatch.chdir(tmp_path)
    with published_untouched(), pytest.raises(SystemExit) as exit_:
        bench.main(["--quick", "--results", results])
    assert exit_.value.code == 2 and "--quick is a pipeline check, not a measurement, and takes no --results" in (
        capsys.readouterr().err
    )
    assert not list(tmp_path.iterdir())  # refused before anything ran or was written
