"""The scenes benchmark: rendering, labels, determinism, argument checks, the tasks' claims and the quick mode."""

import csv
import dataclasses
import math
from pathlib import Path

import lightning
import pytest
import timm
import torch

import visionpe  # noqa: F401  (registers the visionpe models)
from experiments.cli import run_cli
from experiments.scenes import (
    CELLS,
    KINDS,
    TASKS,
    Scenes,
    ScenesDataModule,
    render,
    row_blind_count_accuracy,
    sample_scenes,
    scene_batch,
    scene_labels,
)

from ..scripts import load_script
from ..test_bench_results import PUBLISHED, published_untouched, quick_notices

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "scenes" / "scenes.yaml")


def _one_object(shape: int, centre=(0.375, 0.625), radius=0.08, field=1.0, colour=-1, grey=1.0) -> Scenes:
    """A scene holding one object (role target) in the cell of ``centre``."""
    g = round(field * CELLS)
    n = (1, g, g)
    scenes = Scenes(
        field,
        torch.zeros(n, dtype=torch.bool),
        torch.zeros(n, dtype=torch.long),
        torch.full(n, shape),
        torch.full(n, colour),
        torch.full(n, grey),
        torch.zeros(*n, 2),
        torch.full(n, radius),
    )
    row, col = int(centre[1] * CELLS), int(centre[0] * CELLS)
    scenes.occupied[0, row, col] = True
    scenes.role[0, row, col] = 1
    scenes.centre[0, row, col] = torch.tensor(centre)
    return scenes


def _generator(seed=0):
    return torch.Generator().manual_seed(seed)


# --- rendering ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("px", [32, 128])
def test_coverage_sums_to_the_shape_area(px):
    # white objects: each channel's sum is the covered area in px^2; squares are exact box-filtered coverage
    r = 0.08 * px
    areas = {0: math.pi * r * r, 1: (2 * 0.85 * r) ** 2, 2: 2 * r * r}
    tolerance = {0: 0.02, 1: 1e-5, 2: 0.06 if px == 32 else 0.01}
    for shape, area in areas.items():
        image = render(_one_object(shape, centre=(0.37, 0.61)), px)
        assert image.min() >= 0 and image.max() <= 1
        assert image[0, 0].sum().item() == pytest.approx(area, rel=tolerance[shape])
        edge = image[0, 0][(image[0, 0] > 0) & (image[0, 0] < 1)]
        assert edge.numel() > 0  # anti-aliased: partly covered pixels along the edge


def test_zoom_renders_the_same_scene():
    scenes, _ = sample_scenes("region", 16, _generator())
    small, large = render(scenes, 32), render(scenes, 128)
    pooled = torch.nn.functional.avg_pool2d(large, 4)  # box filtered: about the coverage at 32 px
    assert (pooled - small).abs().mean() < 5e-3 and (pooled - small).abs().max() < 0.35  # at diamonds' vertices
    squares = dataclasses.replace(scenes, shape=torch.ones_like(scenes.shape))  # exact box-filtered coverage
    assert torch.allclose(torch.nn.functional.avg_pool2d(render(squares, 128), 4), render(squares, 32), atol=1e-5)
    # the data's zoom sets: every size renders the scenes of the training-size set
    dm = ScenesDataModule("relative", eval_sizes=(32, 64), batch_size=8, eval_samples=8, patch_size=4)
    x32, y32 = next(iter(dm.eval_dataloader(32, "zoom")))
    x64, y64 = next(iter(dm.eval_dataloader(64, "zoom")))
    assert torch.equal(y32, y64) and (torch.nn.functional.avg_pool2d(x64, 2) - x32).abs().mean() < 0.01


def test_canvas_keeps_the_object_pixel_size():
    one = render(_one_object(2, centre=(0.37, 0.61)), 32)
    far = render(_one_object(2, centre=(1.37, 1.61), field=4.0), 32)  # the same object in a 4x wider field
    assert far.shape == (1, 3, 128, 128)
    assert torch.allclose(far[..., 32:64, 32:64], one, atol=1e-5) and far.sum() == pytest.approx(one.sum().item())
    for task in TASKS:
        scenes, images, _ = scene_batch(task, 8, _generator(), 96, img_size=32, kind="canvas")
        assert scenes.field == 3.0 and scenes.cells == 3 * CELLS and images.shape == (8, 3, 96, 96)
        assert 0.055 <= scenes.radius.min() and scenes.radius.max() <= 0.085  # units: the training pixel size


# --- labels and determinism -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", [1.0, 1.5, 4.0])
def test_labels_are_read_off_the_descriptions(field):
    for task in TASKS:
        scenes, labels = sample_scenes(task, 64, _generator(3), field=field)
        assert torch.equal(scene_labels(scenes, task), labels), task
        assert set(labels.tolist()) <= {0, 1, 2, 3}
    # hand-made descriptions
    target = _one_object(0, centre=(0.8, 0.3), colour=3)
    assert scene_labels(target, "region").item() == 1 and scene_labels(target, "colour").item() == 3
    assert scene_labels(target, "count").item() == 0
    pair = _one_object(0, centre=(0.62, 0.88))
    pair.occupied[0, 3, 0], pair.role[0, 3, 0] = True, 2  # B at the left end of the bottom row
    pair.centre[0, 3, 0] = torch.tensor([0.12, 0.86])
    assert scene_labels(pair, "relative").item() == 1  # A right of B
    pair.role[0, 3, 0] = 0  # now a grey distractor in the target's row
    assert scene_labels(pair, "count").item() == 1 and scene_labels(pair, "region").item() == 3


@pytest.mark.parametrize("field", [1.0, 2.0])
def test_the_row_blind_count_bound_is_what_the_scenes_allow(field):
    # Guess the count from the number of grey objects in the whole image, the best a model blind to rows can do:
    # on 40,000 generated scenes the best guess per total (the commonest label among scenes with that total) scores
    # the computed bound, within sampling error (its standard error is about 0.25 points here).
    scenes, labels = sample_scenes("count", 40_000, _generator(5), field=field)
    total = (scenes.occupied & (scenes.role == 0)).flatten(1).sum(1)
    joint = torch.zeros(int(total.max()) + 1, 4)
    joint.index_put_((total, labels), torch.ones(len(labels)), accumulate=True)
    empirical = float(joint.amax(1).sum() / len(labels))
    assert empirical == pytest.approx(row_blind_count_accuracy(field), abs=0.012)
    assert row_blind_count_accuracy(field) > 0.25 + 0.05  # well above chance: the total tells something


def test_the_row_blind_count_bound_falls_towards_chance_on_a_canvas():
    bounds = [row_blind_count_accuracy(k) for k in (1.0, 1.5, 2.0, 3.0, 4.0)]
    assert bounds == sorted(bounds, reverse=True) and 0.25 < bounds[-1] < bounds[0] < 0.5
    assert row_blind_count_accuracy(1.0, density=0.0) == 1.0  # nothing outside the row: the total is the label
    with pytest.raises(ValueError, match="density must be a float in"):
        row_blind_count_accuracy(1.0, density=1.5)
    with pytest.raises(ValueError, match="field must be a multiple of 1/4 unit"):
        row_blind_count_accuracy(1.1)


def test_batches_are_determined_by_the_seed():
    def first_batches(seed, workers=0):
        dm = ScenesDataModule("count", batch_size=8, steps_per_epoch=3, num_workers=workers, seed=seed)
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(1)
        return [b for b in loader], next(iter(dm.eval_dataloader(64, "canvas")))

    (train, evaluation), (again, evaluation_again) = first_batches(0), first_batches(0, workers=1)
    for (x, y), (x2, y2) in zip([*train, evaluation], [*again, evaluation_again], strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(train[0][0], train[1][0])  # fresh scenes every step
    other, _ = first_batches(1)
    assert not torch.equal(train[0][0], other[0][0])
    dm = ScenesDataModule("count", batch_size=8, steps_per_epoch=3)
    assert not torch.equal(next(iter(dm.train_dataloader()))[0], train[0][0])  # epoch 0 differs from epoch 1


# --- bad input ------------------------------------------------------------------------------------------------------


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="task must be one of"):
        ScenesDataModule("parity")
    with pytest.raises(ValueError, match="task must be one of"):
        sample_scenes("parity", 2, _generator())
    with pytest.raises(ValueError, match="multiple of the patch size 4, got 50"):
        ScenesDataModule("colour", eval_sizes=(32, 50), patch_size=4)
    with pytest.raises(ValueError, match="eval_sizes must not repeat a size"):
        ScenesDataModule("colour", eval_sizes=(32, 64, 32))
    with pytest.raises(ValueError, match="kind must be one of"):
        ScenesDataModule("colour").eval_dataloader(64, "crop")
    with pytest.raises(ValueError, match="even number of lattice cells"):
        ScenesDataModule("region", eval_sizes=(40,), img_size=32)
    with pytest.raises(ValueError, match="px_per_unit must be a multiple of 4"):
        render(_one_object(0), 30)


def test_the_command_checks_its_arguments_before_training(monkeypatch, tmp_path):
    script = load_script("train/scenes.py")

    def no_training(*args, **kwargs):
        raise AssertionError("trained before the arguments were checked")

    monkeypatch.setattr(script, "train_from_config", no_training)
    base = ["--config", CONFIG, "--schemes", "none", "--references", "--out", str(tmp_path)]
    for extra, message in [
        (["--config", str(tmp_path / "missing.yaml")], "existing YAML"),
        (["--tasks", "region", "parity"], "task must be one of"),
        (["--tasks", "count", "count"], "tasks must not repeat"),
        (["--seeds", "0", "0"], "seeds must not repeat"),
        (["--scales", "1", "2", "2"], "scales must not repeat"),
        (["--scales", "1", "1.0625"], "multiple of the patch size 4"),
        (["--scales", "1", "1.01"], "whole pixels"),
        (["--kinds", "zoom", "crop"], "kinds must be in"),
        (["--extrapolation", "none", "ntk"], "accepted by none"),
    ]:
        with pytest.raises(ValueError, match=message):
            script.main([*base, *extra])


def test_the_learned_table_starts_at_big_vision_scale():
    script = load_script("train/scenes.py")
    assert script.scheme_options("learned", 64) == {"init_std": 0.125} and script.scheme_options("rope_axial", 64) == {}
    argv = ["--config", CONFIG, "--schemes", "learned", "--references", "--extrapolation", "none"]
    settings = script._settings(script.parse_args(argv))
    (label, args), *_ = script.check_arguments(CONFIG, settings, ["region"], ["zoom"])["runs"]
    model = run_cli(args=["--config", CONFIG, *args], run=False).model.model
    table = dict(model.named_parameters())["pos_schemes.learned.pos_embed"]
    assert label == "learned" and abs(table.std().item() - 64**-0.5) < 0.01  # timm's 0.02 does not learn here


def test_the_gpu_configuration_passes_the_checks(monkeypatch):
    script = load_script("train/scenes.py")
    monkeypatch.setattr(script, "_probe", lambda *args: None)  # a ViT-S forward at 256 px is slow on a CPU
    config = CONFIG.replace("scenes.yaml", "scenes_gpu.yaml")
    argv = ["--config", config, "--schemes", "learned", "rope_axial", "--references", "timm_ape"]
    settings = script._settings(script.parse_args(argv))
    checked = script.check_arguments(config, settings, list(TASKS), ["zoom", "canvas"])
    assert checked["sizes"] == [64, 96, 128, 192, 256] and settings["embed_dim"] == 384
    assert "--model.pos_embed_kwargs={init_std: 0.05103103630798288}" in checked["runs"][0][1]


# --- the tasks are what they claim ----------------------------------------------------------------------------------


def _model(pos_embed, **kwargs):
    options = dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, global_pool="avg")
    options.update(class_token=False, init_values=1.0, dynamic_img_size=True, num_classes=4)
    return timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=pos_embed, **{**options, **kwargs})


def test_nope_is_exactly_at_chance_on_region():
    torch.manual_seed(0)
    model = _model("none").eval()
    dm = ScenesDataModule("region", eval_sizes=(32, 64), batch_size=16, eval_samples=32, patch_size=4)
    for size, kind in [(32, "zoom"), (64, "zoom"), (64, "canvas")]:
        x, y = next(iter(dm.eval_dataloader(size, kind)))
        with torch.no_grad():
            logits = model(x)
        orbits = logits.view(-1, 4, 4)  # each scene with its target in the four quadrants
        assert torch.allclose(orbits, orbits[:, :1].expand_as(orbits), atol=1e-5)
        assert sorted(y.view(-1, 4)[0].tolist()) == [0, 1, 2, 3]
        # a patch-permutation-invariant model: the same logits for any shuffle of the patches
        grid = size // 4
        patches = x.unfold(2, 4, 4).unfold(3, 4, 4).reshape(len(x), 3, grid * grid, 4, 4)
        shuffled = patches[:, :, torch.randperm(grid * grid)].reshape(len(x), 3, grid, grid, 4, 4)
        shuffled = shuffled.permute(0, 1, 2, 4, 3, 5).reshape_as(x)
        with torch.no_grad():
            assert torch.allclose(model(shuffled), logits, atol=1e-5)
    # so on whole orbits its accuracy is exactly chance
    assert (logits.argmax(-1) == y).float().mean().item() == 0.25


def test_nope_learns_the_control_task():
    torch.manual_seed(0)
    model = _model("none", depth=1)
    dm = ScenesDataModule("colour", batch_size=32, steps_per_epoch=80, val_samples=256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for x, y in dm.train_dataloader():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        right = sum(int((model(x).argmax(-1) == y).sum()) for x, y in dm.val_dataloader())
    # a short run: well above chance (25 %; 5 standard errors at 256 scenes), without any position
    assert right / dm.val_samples >= 0.4


# --- the command --------------------------------------------------------------------------------------------------


def test_quick_mode_end_to_end(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = load_script("train/scenes.py")
    args = ["--config", CONFIG, "--quick", "--out", str(tmp_path / "out")]
    with published_untouched():
        paths = script.main(args)
    rows = list(csv.DictReader(paths["csv"].open()))
    assert {r["task"] for r in rows} == set(TASKS) and {r["kind"] for r in rows} == set(KINDS)
    assert {(r["model"], r["mode"]) for r in rows} == {("none", "none"), ("rope_axial", "none"), ("rope_axial", "ntk")}
    assert {float(r["scale"]) for r in rows} == {1.0, 2.0} and {int(r["size"]) for r in rows} == {32, 64}
    assert all(float(r["acc"]) == 25.0 for r in rows if r["model"] == "none" and r["task"] == "region")
    assert paths["png"].stat().st_size > 10_000 and "## region, canvas" in paths["md"].read_text()
    assert "the best such guess scores zoom 43.0, 43.0 % at 1x, 2x; canvas 43.0, 33.6 % at 1x, 2x" in (
        paths["md"].read_text()
    )

    # --reuse: nothing is trained or evaluated again; --results writes the documented files with their header
    monkeypatch.setattr(lightning.pytorch.Trainer, "fit", lambda *a, **k: pytest.fail("trained again"))
    monkeypatch.setattr(script, "evaluate", lambda *a, **k: pytest.fail("evaluated again"))
    with published_untouched():  # --quick writes --results where it is told, never the published tables
        again = script.main([*args, "--reuse", "--results", str(tmp_path / "docs")])
    assert list(csv.DictReader(again["csv"].open())) == rows
    assert sorted(p.name for p in (tmp_path / "docs").iterdir()) == ["scenes.csv", "scenes.md", "scenes.png"]
    first = again["results_md"].read_text().splitlines()[0]
    assert first.startswith("Measured ") and "command: `python train/scenes.py --config" in first
    assert again["results_png"].name == "scenes.png" and again["results_csv"].name == "scenes.csv"
    assert "`[mode]`: the same weights" in again["results_md"].read_text()  # the ntk rows
    unscaled = [r for r in rows if r["mode"] == "none" and r["task"] != "count"]  # as read back: strings
    assert not any(line.startswith("`[mode]`") for line in script.table_notes(unscaled, CONFIG, 32, 0.3))
    assert "`[mode]`" in paths["md"].read_text() and "`[mode]`" not in script.markdown(unscaled, "t", 32, 0.3)

    # --reuse with one more size: only the sets at that size are evaluated, the others are loaded unchanged
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(lightning.pytorch.Trainer, "fit", lambda *a, **k: pytest.fail("trained again"))
    evaluated = []

    def recording(model, datamodule, task, label, seed, kinds, sizes, modes, device, skip=frozenset()):
        new = evaluate(model, datamodule, task, label, seed, kinds, sizes, modes, device, skip=skip)
        evaluated.extend(new)
        return new

    evaluate = script.evaluate
    monkeypatch.setattr(script, "evaluate", recording)
    wider = script.main([*args, "--reuse", "--scales", "1", "1.5", "2"])
    assert evaluated and {r["size"] for r in evaluated} == {48}
    assert len(evaluated) == len(rows) // 2  # the 1.5x sets of every task, kind, model and mode
    extended = list(csv.DictReader(wider["csv"].open()))
    assert [r for r in extended if int(r["size"]) != 48] == rows
    assert {int(r["size"]) for r in extended} == {32, 48, 64}
    # and each run's eval.csv now holds all three sizes, so a second pass evaluates nothing
    monkeypatch.setattr(script, "evaluate", lambda *a, **k: pytest.fail("evaluated again"))
    assert list(csv.DictReader(script.main([*args, "--reuse", "--scales", "1", "1.5", "2"])["csv"].open())) == extended


def test_jobs_train_in_processes_of_their_own_with_the_same_rows(tmp_path):
    script = load_script("train/scenes.py")
    base = ["--config", CONFIG, "--quick", "--tasks", "region", "relative", "--kinds", "zoom", "--threads", "1"]
    one = script.main([*base, "--out", str(tmp_path / "one")])
    two = script.main([*base, "--jobs", "2", "--out", str(tmp_path / "two")])
    assert list(csv.DictReader(two["csv"].open())) == list(csv.DictReader(one["csv"].open()))
    with pytest.raises(ValueError, match="jobs must be"):
        script.main([*base, "--jobs", "0", "--out", str(tmp_path / "none")])


def test_quick_mode_says_it_measures_nothing_and_keeps_out_of_the_published_tables(monkeypatch, tmp_path, capsys):
    script = load_script("train/scenes.py")
    monkeypatch.chdir(tmp_path)

    def stop(args):
        raise RuntimeError("stopped before training")

    monkeypatch.setattr(script, "_settings", stop)
    with pytest.raises(RuntimeError, match="stopped before training"):
        script.main(["--config", CONFIG, "--quick"])
    assert quick_notices(capsys.readouterr().out) == [
        "--quick: the numbers of this run are a pipeline check, not a measurement"
    ]
    with pytest.raises(RuntimeError, match="stopped before training"):
        script.main(["--config", CONFIG])
    assert quick_notices(capsys.readouterr().out) == []  # a measurement says nothing of the kind
    for argv, message in [
        (["--quick", "--results", str(PUBLISHED)], "--quick is a pipeline check, not a measurement: --results"),
        (["--out", str(PUBLISHED / "scenes")], "is the published results folder"),
    ]:
        with published_untouched(), pytest.raises(SystemExit) as exit_:
            script.main(["--config", CONFIG, *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def _row(task, kind, model, mode, seed, scale, acc):
    return {"task": task, "kind": kind, "model": model, "mode": mode, "seed": seed, "scale": scale, "acc": acc, "n": 8}


def test_a_model_below_the_bar_at_the_training_size_keeps_its_row_marked():
    script = load_script("train/scenes.py")
    rows = [
        _row("region", kind, model, "none", seed, scale, acc)
        for kind in ("zoom", "canvas")
        for seed in (0, 1)
        for model, scale, acc in [
            ("rope_axial", 1.0, 100.0),
            ("rope_axial", 2.0, 60.0),
            ("slow", 1.0, 90.0 + seed * 4),  # mean 92 %: below the bar
            ("slow", 2.0, 50.0),
        ]
    ]
    assert script.not_learned(rows) == {("region", "slow")}
    _, body = script.table_rows(rows)
    labels = {cells[2] for cells in body}
    assert labels == {"rope_axial", f"slow {script.NOT_LEARNED_MARK}"}
    assert script.NOT_LEARNED_NOTE in script.table_notes(rows, CONFIG, 32, 0.3)
    assert script.NOT_LEARNED_NOTE in script.markdown(rows, "t", 32, 0.3)
    learned = [r for r in rows if r["model"] == "rope_axial"]
    assert script.NOT_LEARNED_NOTE not in script.table_notes(learned, CONFIG, 32, 0.3)


@pytest.mark.parametrize("count", [4, 15, 32])
def test_no_two_rows_of_a_plot_share_a_colour_and_line_style(count):
    from visionpe.training.evaluate import plot_palette

    models = [f"m{i}" for i in range(count)]
    colours, styles = plot_palette(models, ["pi", "none", "yarn"])
    assert len({tuple(colours[m]) for m in models}) == count
    assert styles["none"] == "-" and len(set(map(str, styles.values()))) == 3
    with pytest.raises(ValueError, match="models must be at most 60"):
        plot_palette([f"m{i}" for i in range(61)])
