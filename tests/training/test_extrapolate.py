"""The extrapolation sweep script: trains from a config, evaluates at several sizes, writes table, CSV and plot."""

import csv
from pathlib import Path

import lightning
import pytest
import timm

import visionpe
from experiments.sweep import accepts_extrapolation
from visionpe.rotary.scaling import EXTRAPOLATION_MODES
from visionpe.training.evaluate import line_styles, markdown_table, summarize

from ..scripts import load_script
from ..test_bench_results import PUBLISHED, published_untouched

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "configs" / "demo" / "digits.yaml")


def _script():
    return load_script("train/extrapolate.py")


def test_sweep_writes_table_csv_and_plot(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = [
        "--config",
        DIGITS,
        "--schemes",
        "rope_axial",
        "--references",
        "timm_ape",
        "--max-epochs",
        "1",
        "--sizes",
        "32",
        "48",
        "--extrapolation",
        "none",
        "ntk",
        "--seeds",
        "1",  # not the config's seed: the data module must follow it (Lightning checks the two agree)
        "--out",
        str(tmp_path / "out"),
        "--override",
        "data.init_args.train_subset=128",
        "trainer.enable_progress_bar=false",
        "trainer.limit_val_batches=1",
    ]
    with published_untouched():
        paths = _script().main(args)
    assert {p.name for p in paths.values()} == {"results.md", "results.csv", "results.png"}
    assert paths["png"].stat().st_size > 1000
    rows = list(csv.DictReader(paths["csv"].open()))
    assert {r["model"] for r in rows} == {"rope_axial", "rope_axial [ntk]", "timm APE ViT"}
    assert {int(r["size"]) for r in rows} == {32, 48} and {r["seed"] for r in rows} == {"1"}
    assert all(0.0 <= float(r["acc"]) <= 100.0 for r in rows)
    table = paths["md"].read_text()
    assert "| rope_axial [ntk] |" in table and "48 px" in table
    # ntk only changes positions beyond the training grid: identical accuracy at the training size
    at32 = {r["model"]: float(r["acc"]) for r in rows if r["size"] == "32"}
    assert at32["rope_axial"] == at32["rope_axial [ntk]"]

    # --reuse: finished runs are loaded from <out>/<model>/seed<k>/final.ckpt, not trained again
    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(lightning.pytorch.Trainer, "fit", no_training)
    with published_untouched():
        again = _script().main([*args, "--reuse", "--results", str(tmp_path / "docs"), "--results-name", "digits"])
    assert list(csv.DictReader(again["csv"].open())) == rows
    # --results: the same table for the documentation, headed by when, where and how it was measured
    assert again["results_md"] == tmp_path / "docs" / "digits.md" and again["results_csv"].name == "digits.csv"
    assert again["results_png"].read_bytes() == again["png"].read_bytes()  # the plot beside the table
    first, *rest = again["results_md"].read_text().splitlines()
    assert first.startswith("Measured ") and "torch " in first and "timm " in first
    assert "command: `python train/extrapolate.py --config configs/demo/digits.yaml --schemes rope_axial" in first
    assert str(tmp_path) not in first and "| rope_axial [ntk] |" in "\n".join(rest)
    assert "seed 1; config `configs/demo/digits.yaml`" in "\n".join(rest)
    table = list(csv.DictReader(again["results_csv"].open()))
    assert [r["model"] for r in table] == ["rope_axial", "timm APE ViT", "rope_axial [ntk]"]
    assert list(table[0]) == ["model", "32 px", "48 px"] and float(table[0]["32 px"]) == at32["rope_axial"]
    with pytest.raises(AssertionError, match="trained again"):
        _script().main(args)  # without --reuse every run trains


def test_summary_mean_and_std_over_seeds():
    rows = [{"model": "a", "seed": s, "size": 32, "acc": acc} for s, acc in [(0, 80.0), (1, 90.0)]]
    ((mean, std, n),) = summarize(rows)["a"].values()
    assert (mean, n) == (85.0, 2) and std == pytest.approx(7.0711, abs=1e-3)
    assert "85.0 ± 7.1" in markdown_table(rows)


def test_bad_arguments(tmp_path):
    script = _script()
    with pytest.raises(SystemExit):
        script.parse_args(["--config", DIGITS])  # nothing to evaluate
    with pytest.raises(ValueError, match="config must be an existing YAML file"):
        script.main(["--config", str(tmp_path / "missing.yaml"), "--schemes", "rope_axial"])
    with pytest.raises(ValueError, match="extrapolation modes"):
        script.main(["--config", DIGITS, "--schemes", "rope_axial", "--extrapolation", "bogus"])
    with pytest.raises(ValueError, match="would replace the position encoding of every run"):
        script.main(["--config", DIGITS, "--schemes", "rope_axial", "liere", "--override", "model.pos_embed=liere"])


def test_reference_models_are_built_like_visionpe_models():
    """The Eva reference rows get timm ViT's initialisation of every Linear layer (weight_init="vit"), not Eva's
    (head scaled by 1e-3, output projections by 1 / sqrt(2 l)), so that they train like the visionpe rows they are
    compared with; timm's own APE ViT needs nothing."""
    from experiments.cli import run_cli
    from experiments.sweep import REFERENCE_MODELS, reference_args

    def linear_stds(model):
        return {"head": float(model.head.weight.std()), "last proj": float(model.blocks[-1].attn.proj.weight.std())}

    vp = linear_stds(run_cli(args=["--config", DIGITS, "--model.pos_embed=rope_axial"], run=False).model.model)
    assert vp == pytest.approx({"head": 0.02, "last proj": 0.02}, rel=0.2)
    for name in REFERENCE_MODELS:
        assert linear_stds(run_cli(args=["--config", DIGITS, *reference_args(name)], run=False).model.model) == (
            pytest.approx(vp, rel=0.2)
        ), name
    eva = run_cli(args=["--config", DIGITS, "--model.model_name=vit_small_patch16_rope_224"], run=False).model.model
    assert linear_stds(eva)["head"] < 1e-3  # Eva's own init, as timm builds it
    with pytest.raises(ValueError, match="unknown reference model 'eva'"):
        reference_args("eva")
    with pytest.raises(ValueError, match="weight_init must be None or 'vit', got 'jax'"):
        run_cli(args=["--config", DIGITS, "--model.weight_init=jax"], run=False)


def test_rope_axial_model_equals_timm_eva_with_the_same_weights():
    """The demo's rope_axial ViT and timm's Eva RoPE-Axial reference, built from the same config, are the same
    function: with visionpe's weights loaded into Eva (LayerScale renamed), the logits agree at the training size and
    off it. So the sweep's reference rows differ from visionpe's only in their random draws."""
    import timm
    import torch
    import yaml

    kwargs = yaml.safe_load(Path(DIGITS).read_text())["model"]["model_kwargs"]
    torch.manual_seed(0)
    ours = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="rope_axial", num_classes=10, **kwargs)
    eva = timm.create_model("vit_small_patch16_rope_224", num_classes=10, **kwargs)
    rename = {".ls1.gamma": ".gamma_1", ".ls2.gamma": ".gamma_2"}
    state = {}
    for key, value in ours.state_dict().items():
        for old, new in rename.items():
            key = key.replace(old, new)
        state[key] = value
    assert set(state) == set(eva.state_dict())
    eva.load_state_dict(state)
    ours.eval(), eva.eval()
    with torch.no_grad():
        for size in (32, 48, 72):
            images = torch.randn(3, 3, size, size)
            torch.testing.assert_close(eva(images), ours(images), rtol=1e-5, atol=1e-6)


def test_sweep_evaluates_each_model_under_the_modes_it_accepts():
    # one sweep lists every scheme and mode: a model is left out of a mode that one of its schemes refuses
    def model(name, **kwargs):
        return timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=name, depth=1, **kwargs)

    accepted = {
        "liere": ("none", "pi"),
        "rope_axial": ("none", "pi", "ntk", "yarn", "riflex"),
        "learned": ("none",),
    }
    for name, modes in accepted.items():
        assert [m for m in EXTRAPOLATION_MODES if accepts_extrapolation(model(name), m)] == list(modes)
    assert not accepts_extrapolation(model(["rope_axial", "liere"]), "ntk")  # every rotary scheme must accept
    for pos_norm, modes in (("test_grid", ["none"]), ("train_grid", ["none", "pi", "ntk", "yarn"])):
        comrope = model("comrope_ld", pos_embed_kwargs={"pos_norm": pos_norm})
        assert [m for m in EXTRAPOLATION_MODES if accepts_extrapolation(comrope, m)] == modes
        for mode in modes:  # accepted means set_extrapolation succeeds
            visionpe.set_extrapolation(comrope, mode)


def test_scheme_options_in_overrides_reach_the_sweep(monkeypatch):
    # options of the swept scheme given as an override (here ComRoPE's train-grid positions, which `learned`,
    # the config's own pos_embed, does not take) must not break the set-up before training
    from experiments import sweep as experiments

    def reached(config, args, *rest):
        assert "--model.pos_embed=comrope_ld" in args and args[-1].startswith("--model.pos_embed_kwargs")
        raise RuntimeError("reached training")

    monkeypatch.setattr(experiments, "train_from_config", reached)
    options = ['--model.pos_embed_kwargs={"pos_norm": "train_grid"}']
    with pytest.raises(RuntimeError, match="reached training"):
        experiments.run_sweep(DIGITS, schemes=["comrope_ld"], overrides=options)
    # a scheme that does not take the options fails before any run trains
    with pytest.raises(ValueError, match=r"liere got unknown option\(s\) \['pos_norm'\]"):
        experiments.run_sweep(DIGITS, schemes=["comrope_ld", "liere"], overrides=options)


QUICK = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.limit_val_batches=1"]


def _checkpoint(out_dir, run_args, seed, *extra):
    """A finished run of one training step: out_dir / final.ckpt."""
    from experiments.sweep import FINAL_CHECKPOINT, train_from_config

    seed_args = [f"--seed_everything={seed}", f"--model.seed={seed}", f"--data.init_args.seed={seed}"]
    args = [*run_args, *seed_args, "--trainer.max_steps=1", "--data.init_args.train_subset=64", *QUICK, *extra]
    train_from_config(DIGITS, args, out_dir)
    return str(out_dir / FINAL_CHECKPOINT)


def test_checkpoints_are_evaluated_on_their_own_split(tmp_path, monkeypatch):
    """A checkpoint is scored on the held-out split it was trained with (its data module's seed and train_fraction,
    not the config's: with the config's split a seed-1 model is scored largely on its own training digits), under
    its own seed, and in a row of its own: two runs of one scheme with the same file name, and timm's models by
    their reference label rather than the config's unused pos_embed."""
    from experiments import sweep as experiments
    from experiments.sweep import reference_args

    paths = [
        _checkpoint(tmp_path / "a", ["--model.pos_embed=rope_axial"], 1, "--data.init_args.train_fraction=0.9"),
        _checkpoint(tmp_path / "b", ["--model.pos_embed=rope_axial"], 2),
        _checkpoint(tmp_path / "c", reference_args("timm_ape"), 0),
    ]
    evaluated = {}
    real_sweep = experiments.sweep

    def spy(models, loader_for_size, sizes, seed=0, device="cpu"):
        datamodule = loader_for_size.__self__
        for label in models:
            evaluated[label] = (seed, datamodule.seed, datamodule.train_fraction)
        return real_sweep(models, loader_for_size, sizes, seed=seed, device=device)

    monkeypatch.setattr(experiments, "sweep", spy)
    report = experiments.run_sweep(DIGITS, checkpoints=paths, sizes=[32], out_dir=tmp_path / "out")
    assert evaluated == {
        "rope_axial (a/final.ckpt)": (1, 1, 0.9),
        "rope_axial (b/final.ckpt)": (2, 2, 0.8),
        "timm APE ViT (c/final.ckpt)": (0, 0, 0.8),
    }
    rows = list(csv.DictReader(report["csv"].open()))
    assert [(r["model"], r["seed"]) for r in rows] == [(label, str(s)) for label, (s, _, _) in evaluated.items()]
    with pytest.raises(ValueError, match="checkpoints .* must not repeat"):  # one file under two names
        experiments.run_sweep(DIGITS, checkpoints=[paths[0], str(tmp_path / "b" / ".." / "a" / "final.ckpt")])
    with pytest.raises(ValueError, match="checkpoints must be existing files"):
        experiments.run_sweep(DIGITS, checkpoints=[str(tmp_path / "missing.ckpt")])


def test_sweep_arguments_are_checked_before_training(monkeypatch):
    """Repeated values (a repeated seed or size would be averaged as a second replicate), sizes the data or a model
    refuses, a bad epoch count and a mode that no model takes all fail before the first run trains."""
    from experiments import sweep as experiments

    def no_training(*args, **kwargs):
        raise AssertionError("a run trained before the arguments were checked")

    monkeypatch.setattr(experiments, "train_from_config", no_training)
    sweep = experiments.run_sweep
    for name, value in (("seeds", [0, 0]), ("sizes", [32, 48, 32]), ("extrapolation", ["none", "none"])):
        with pytest.raises(ValueError, match=rf"{name} must not repeat a value, got .* \(repeated: "):
            sweep(DIGITS, schemes=["rope_axial"], **{name: value})
    with pytest.raises(ValueError, match="schemes must not repeat a value"):
        sweep(DIGITS, schemes=["rope_axial", "learned", "rope_axial"])
    with pytest.raises(ValueError, match=r"sizes\[1\] must be >= 1, got 0"):
        sweep(DIGITS, schemes=["rope_axial"], sizes=[32, 0])
    with pytest.raises(ValueError, match=r"seeds\[0\] must be >= 0, got -1"):
        sweep(DIGITS, schemes=["rope_axial"], seeds=[-1])
    with pytest.raises(ValueError, match="test size 30 does not work for rope_axial: .*not divisible by the patch"):
        sweep(DIGITS, schemes=["rope_axial", "learned"], sizes=[32, 30])
    with pytest.raises(ValueError, match="test size 30 does not work for timm APE ViT"):
        sweep(DIGITS, references=["timm_ape"], sizes=[30])
    for epochs, error, match in (
        (-1, ValueError, ">= 1, got -1"),
        (0, ValueError, ">= 1, got 0"),
        (1.5, TypeError, "an int"),
    ):
        with pytest.raises(error, match=f"max_epochs must be {match}"):
            sweep(DIGITS, schemes=["rope_axial"], max_epochs=epochs)
    with pytest.raises(ValueError, match=r"mode 'ntk' is accepted by none of the models \['learned', 'liere'\]"):
        sweep(DIGITS, schemes=["learned", "liere"], extrapolation=["none", "ntk"])


def test_plot_lines_have_a_colour_per_model_and_a_style_per_mode():
    labels = ["learned", "rope_axial", "rope_mixed", "rope_mixed [pi]", "string_cayley [pi]", "rope_axial [ntk]"]
    labels += [f"scheme{i}" for i in range(8)]  # 12 models: beyond tab10
    styles = line_styles(labels)
    models = {label.split(" [")[0]: styles[label][0] for label in labels}
    assert len(set(models.values())) == len(models) == 12  # no two models share a colour
    assert styles["rope_mixed [pi]"][0] == styles["rope_mixed"][0] and styles["rope_mixed"][1] == "-"
    assert styles["rope_mixed [pi]"][1] == styles["string_cayley [pi]"][1] != styles["rope_axial [ntk]"][1] != "-"
    with pytest.raises(TypeError, match="labels must be an iterable of str.*got 3"):
        line_styles(["a", 3])
    with pytest.raises(TypeError, match="got the str 'rope_axial'"):
        line_styles("rope_axial")


def test_out_in_the_published_folder_is_refused(capsys):
    with published_untouched(), pytest.raises(SystemExit) as exit_:
        _script().parse_args(["--config", DIGITS, "--schemes", "rope_axial", "--out", str(PUBLISHED / "sweep")])
    assert exit_.value.code == 2 and "is the published results folder" in capsys.readouterr().err
