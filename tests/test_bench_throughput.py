"""bench/throughput.py: the CPU table's script also times bf16 autocast and several steps per measurement (the
options its GPU rows use); a run prints one row per model with its ratio to timm's ViT-S and writes the same table
to throughput.md and throughput.csv."""

import csv

import pytest
import timm
import torch

from .scripts import load_script
from .test_bench_results import PUBLISHED, published_untouched


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/throughput.py")


def test_step_time_runs_bf16_steps_and_clears_gradients(bench, monkeypatch):
    model = timm.create_model("visionpe_vit_small_patch16_224", pos_embed="rope_axial", img_size=32, depth=1)
    dtypes, forward = [], model.forward

    def recorded(x):
        out = forward(x)
        dtypes.append(out.dtype)
        return out

    monkeypatch.setattr(model, "forward", recorded)
    seconds = bench.step_time(model, torch.randn(2, 3, 32, 32), "bf16", steps=3)
    assert seconds > 0 and dtypes == [torch.bfloat16] * 3
    assert all(p.grad is None for p in model.parameters())
    dtypes.clear()
    bench.step_time(model, torch.randn(2, 3, 32, 32))
    assert dtypes == [torch.float32]


def test_main_prints_a_row_per_model(bench, monkeypatch, capsys, tmp_path):
    args = "--schemes rope_axial --rounds 1 --warmup 0 --batch 1 --size 32 --steps 2 --precision bf16 --profile"
    monkeypatch.setattr("sys.argv", ["bench/throughput.py", *args.split(), "--out", str(tmp_path)])
    bench.main()
    out = capsys.readouterr().out
    assert "bf16, batch 1, 32px" in out and "rounds of 2 step(s)" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "images/s" not in line]
    assert [row.split(" | ")[0] for row in rows] == [
        "| timm vit_small_patch16_224 (baseline)",
        "| timm vit_small_patch16_rope_224 (reference)",
        "| timm vit_small_patch16_rope_mixed_224 (reference)",
        "| rope_axial",
    ]
    assert rows[0].split(" | ")[2] == "1.000x" and "aten ops per step | device ms per step |" in out
    assert all(float(row.split(" | ")[3]) > 0 and float(row.split(" | ")[4].rstrip(" |")) > 0 for row in rows)
    # the files hold the same rows, under the date, versions and command
    md = (tmp_path / "throughput.md").read_text()
    assert md.startswith("Measured ") and f"command: `python bench/throughput.py {args} --out .../" in md
    assert "bf16, batch 1, 32px" in md and str(tmp_path) not in md
    with open(tmp_path / "throughput.csv", newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == ["model", "images/s", "ratio to timm ViT-S", "aten ops per step", "device ms per step"]
    assert [r[0] for r in table[1:]] == [row.split(" | ")[0][2:] for row in rows]
    assert table[1][2] == "1.000" and [r[1] for r in table[1:]] == [row.split(" | ")[1] for row in rows]


def test_profile_counts_the_ops_a_scheme_adds(bench):
    # on CPU the profile counts aten operator calls: a rotary scheme launches more per step than no encoding
    images = torch.randn(1, 3, 32, 32)
    counts = {}
    for name in ("none", "rope_axial"):
        model = timm.create_model("visionpe_vit_small_patch16_224", pos_embed=name, img_size=32, depth=2)
        counts[name], busy = bench.profile_step(model, images)
        assert busy > 0
    assert counts["rope_axial"] > counts["none"] > 0, counts


def test_rove_adds_rows_that_rotate_the_values(bench, monkeypatch, capsys, tmp_path):
    args = "--schemes none --rove --rounds 1 --warmup 0 --batch 1 --size 32"
    monkeypatch.setattr("sys.argv", ["bench/throughput.py", *args.split(), "--out", str(tmp_path)])
    bench.main()
    with open(tmp_path / "throughput.csv", newline="") as f:
        labels = [row[0] for row in csv.reader(f)][1:]
    assert labels[-2:] == ["rope_axial (RoVE, rotate_values)", "rope_mixed (RoVE, rotate_values)"]


def test_flex_adds_bias_rows_on_flexattention(bench, monkeypatch, capsys, tmp_path):
    args = "--schemes none --flex alibi2d --rounds 1 --warmup 0 --batch 1 --size 32"
    monkeypatch.setattr("sys.argv", ["bench/throughput.py", *args.split(), "--out", str(tmp_path)])
    bench.main()
    with open(tmp_path / "throughput.csv", newline="") as f:
        labels = [row[0] for row in csv.reader(f)][1:]
    assert labels[-1] == "alibi2d (flex)"
    monkeypatch.setattr("sys.argv", ["bench/throughput.py", "--schemes", "none", "--flex", "fire"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--flex takes bias schemes with per-offset terms" in capsys.readouterr().err


def test_update_remeasures_the_named_schemes_and_keeps_the_other_rows(bench, monkeypatch, capsys, tmp_path):
    base = "--rounds 1 --warmup 0 --batch 1 --size 32"
    monkeypatch.setattr(
        "sys.argv", ["bench/throughput.py", "--schemes", "none", "sincos", *base.split(), "--out", str(tmp_path)]
    )
    bench.main()
    with open(tmp_path / "throughput.csv", newline="") as f:
        first = {row[0]: row for row in csv.reader(f)}
    monkeypatch.setattr(
        "sys.argv", ["bench/throughput.py", "--schemes", "sincos", "--update", *base.split(), "--out", str(tmp_path)]
    )
    bench.main()
    with open(tmp_path / "throughput.csv", newline="") as f:
        second = {row[0]: row for row in csv.reader(f)}
    assert set(second) == set(first) and second["none"] == first["none"]  # kept as it was
    assert all(second[k] == first[k] for k in first if "(reference)" in k)  # references kept too
    md = (tmp_path / "throughput.md").read_text()
    assert "Rows measured by this command: the baseline and sincos" in md
    monkeypatch.setattr("sys.argv", ["bench/throughput.py", "--update", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--update re-measures the schemes named by --schemes" in capsys.readouterr().err


def test_fused_rotary_adds_compiled_rows(bench, monkeypatch, capsys, tmp_path):
    steps, step_time = {}, bench.step_time

    def counted(model, *args, **kwargs):
        backends = {m.rotary_backend for m in model.modules() if hasattr(m, "rotary_backend")}
        steps[frozenset(backends)] = steps.get(frozenset(backends), 0) + 1
        return step_time(model, *args, **kwargs)

    monkeypatch.setattr(bench, "step_time", counted)
    base = "--rounds 1 --warmup 0 --batch 1 --size 32".split()
    args = ["--schemes", "rope_axial", "--fused-rotary", "rope_axial", *base, "--out", str(tmp_path)]
    monkeypatch.setattr("sys.argv", ["bench/throughput.py", *args])
    bench.main()
    with open(tmp_path / "throughput.csv", newline="") as f:
        labels = [row[0] for row in csv.reader(f)][1:]
    assert labels[-2:] == ["rope_axial", "rope_axial (fused)"]
    # the fused row compiles on its first step: one warm-up step although --warmup 0, then the timed round
    assert steps == {frozenset(): 3, frozenset({"eager"}): 1, frozenset({"fused"}): 2}  # timm's, rope_axial, fused
    # --update re-measures the fused row with the others and names it among the rows it measured
    args = ["--schemes", "none", "--fused-rotary", "rope_axial", "--update", *base, "--out", str(tmp_path)]
    monkeypatch.setattr("sys.argv", ["bench/throughput.py", *args])
    bench.main()
    with open(tmp_path / "throughput.csv", newline="") as f:
        labels = [row[0] for row in csv.reader(f)][1:]
    assert labels[:3] == ["timm vit_small_patch16_224 (baseline)", "none", "rope_axial (fused)"]
    assert "rope_axial" in labels[3:]  # kept from the previous table
    md = (tmp_path / "throughput.md").read_text()
    assert "Rows measured by this command: the baseline and none, rope_axial (fused); the other" in md
    monkeypatch.setattr("sys.argv", ["bench/throughput.py", "--schemes", "none", "--fused-rotary", "liere"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--fused-rotary takes rotary schemes with cos/sin tables" in capsys.readouterr().err


def test_inference_times_forward_passes_in_eval_mode(bench, monkeypatch, tmp_path):
    model = timm.create_model("visionpe_vit_small_patch16_224", pos_embed="alibi2d", img_size=32, depth=1)
    modes = []
    model.blocks[0].register_forward_hook(lambda m, i, o: modes.append((m.training, torch.is_inference_mode_enabled())))
    model.eval()
    assert bench.step_time(model, torch.randn(2, 3, 32, 32), steps=2, inference=True) > 0
    assert modes == [(False, True)] * 2 and all(p.grad is None for p in model.parameters())

    args = "--schemes alibi2d --inference --rounds 1 --warmup 0 --batch 1 --size 32"
    monkeypatch.setattr("sys.argv", ["bench/throughput.py", *args.split(), "--out", str(tmp_path)])
    bench.main()
    md = (tmp_path / "throughput_inference.md").read_text()
    assert "ViT-S/16 inference forward (eval mode), fp32, batch 1, 32px, forward (inference)" in md
    assert not (tmp_path / "throughput.md").exists()
    with open(tmp_path / "throughput_inference.csv", newline="") as f:
        assert [row[0] for row in csv.reader(f)][-1] == "alibi2d"


def test_writes_under_runs_by_default_and_the_published_folder_only_with_results(bench, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    base = ["--schemes", "none", "--rounds", "1", "--warmup", "0", "--batch", "1", "--size", "32"]
    with published_untouched():
        monkeypatch.setattr("sys.argv", ["bench/throughput.py", *base])
        bench.main()
    runs = tmp_path / "runs" / "bench" / "throughput"
    assert sorted(p.name for p in runs.iterdir()) == ["throughput.csv", "throughput.md"]
    # --update reads the previous table from --results when given: none there yet, so it stops before measuring
    published = tmp_path / "published"
    monkeypatch.setattr("sys.argv", ["bench/throughput.py", *base, "--update", "--results", str(published)])
    with pytest.raises(SystemExit, match=f"--update needs a previous throughput.csv and throughput.md in {published}"):
        bench.main()
    monkeypatch.setattr("sys.argv", ["bench/throughput.py", *base, "--results", str(published)])
    bench.main()
    assert (published / "throughput.md").read_text() == (runs / "throughput.md").read_text()
    assert "--results .../published`" in (published / "throughput.md").read_text().splitlines()[0]
    # --out is the run's folder, never the published one
    monkeypatch.setattr("sys.argv", ["bench/throughput.py", *base, "--out", str(PUBLISHED)])
    with published_untouched(), pytest.raises(SystemExit):
        bench.main()
    assert "is the published results folder" in capsys.readouterr().err
