"""End-to-end training tests through the LightningCLI, the way users run train/classify.py and train/video.py."""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from experiments.cli import run_cli
from visionpe.training import Classifier

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "configs" / "demo" / "digits.yaml")
VIDEO = str(ROOT / "configs" / "demo" / "moving_digits.yaml")
FAST = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.logger=false"]


def _fit(config, tmp_path, *extra):
    args = ["fit", "--config", config, f"--trainer.default_root_dir={tmp_path}", *FAST, *extra]
    return run_cli(args=args)


def test_image_pipeline_fits_one_short_epoch(tmp_path):
    cli = _fit(
        DIGITS,
        tmp_path,
        "--trainer.max_epochs=1",
        "--data.init_args.train_subset=256",
        "--model.pos_embed=rope_mixed",
        "--trainer.limit_val_batches=2",
    )
    assert cli.trainer.current_epoch == 1 and torch.isfinite(cli.trainer.callback_metrics["train/loss_epoch"])
    assert "val/acc" in cli.trainer.callback_metrics


def test_video_pipeline_fits_one_short_epoch(tmp_path):
    cli = _fit(
        VIDEO,
        tmp_path,
        "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=3",
        "--trainer.limit_val_batches=1",
    )
    assert cli.trainer.current_epoch == 1 and "val/acc" in cli.trainer.callback_metrics
    clip = torch.randn(2, 3, 16, 32, 32)  # twice the training clip length
    assert cli.model.eval()(clip).shape == (2, 40)


class _StopAfterFirstEpoch(Callback):
    """Simulates an interrupted run: stop after epoch 0 (its last.ckpt is written), max_epochs unchanged."""

    def on_train_epoch_end(self, trainer, pl_module):
        trainer.should_stop = True


def test_resume_mid_run_reaches_the_same_state(tmp_path):
    common = [
        "--trainer.max_epochs=2",
        "--data.init_args.train_subset=256",
        "--trainer.limit_val_batches=1",
        "--model.mixup=0.8",
        "--model.cutmix=1.0",
        "--model.drop_path_rate=0.1",
    ]
    straight = _fit(DIGITS, tmp_path / "a", *common)
    interrupted = run_cli(
        args=["--config", DIGITS, f"--trainer.default_root_dir={tmp_path / 'b'}", *FAST, *common], run=False
    )
    interrupted.trainer.callbacks.append(_StopAfterFirstEpoch())
    interrupted.trainer.fit(interrupted.model, datamodule=interrupted.datamodule)
    assert interrupted.trainer.current_epoch == 1 < straight.trainer.current_epoch
    ckpt = interrupted.trainer.checkpoint_callback.last_model_path
    resumed = _fit(DIGITS, tmp_path / "c", f"--ckpt_path={ckpt}", *common)
    assert resumed.trainer.global_step == straight.trainer.global_step
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def _val_acc(log_dir: Path) -> float:
    (metrics,) = list(log_dir.rglob("metrics.csv"))
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("val/acc")]
    return float(rows[-1]["val/acc"])


@pytest.mark.skipif(sys.platform == "win32", reason="gloo DDP subprocess launch")
def test_ddp_two_processes_match_one_process(tmp_path):
    first = _fit(
        DIGITS,
        tmp_path / "train",
        "--trainer.max_epochs=1",
        "--data.init_args.train_subset=128",
        "--trainer.limit_val_batches=1",
    )
    ckpt = first.trainer.checkpoint_callback.last_model_path
    accs = {}
    for devices in (1, 2):
        out = tmp_path / f"val{devices}"
        cmd = [
            sys.executable,
            str(ROOT / "train" / "classify.py"),
            "validate",
            "--config",
            DIGITS,
            f"--ckpt_path={ckpt}",
            f"--trainer.devices={devices}",
            "--trainer.strategy=" + ("ddp" if devices == 2 else "auto"),
            "--trainer.enable_progress_bar=false",
            "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.save_dir={out}",
            "--data.init_args.batch_size=100",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        accs[devices] = _val_acc(out)
    assert accs[1] == pytest.approx(accs[2], abs=1e-4)


def test_bad_model_arguments_are_clear():
    with pytest.raises(ValueError, match="unknown position scheme 'bogus'"):
        Classifier(model_name="visionpe_vit_tiny_patch16_224", pos_embed="bogus", num_classes=10)
    with pytest.raises(ValueError, match="num_classes"):
        Classifier(num_classes=1)
    with pytest.raises(ValueError, match="base_lr"):
        Classifier(base_lr=0.0, num_classes=10)


def test_a_scheme_named_with_a_timm_model_replaces_its_encoding_in_place():
    """pos_embed with a timm model name applies the scheme (apply_position_scheme), never trains the timm model's
    own encoding under the scheme's name; without pos_embed the timm model keeps its own."""
    small = dict(depth=1, embed_dim=32, num_heads=2, img_size=32)
    module = Classifier(model_name="vit_tiny_patch16_224", pos_embed="rope_mixed", model_kwargs=small, num_classes=10)
    assert list(module.model.pos_schemes) == ["rope_mixed"] and module.model.pos_embed is None
    options = {"rope_mixed": {"base": 50.0}}
    module = Classifier(
        model_name="vit_tiny_patch16_224",
        pos_embed=["learned", "rope_mixed"],
        pos_embed_kwargs=options,
        model_kwargs=small,
        num_classes=10,
    )
    assert list(module.model.pos_schemes) == ["learned", "rope_mixed"]
    own = Classifier(model_name="vit_tiny_patch16_224", model_kwargs=small, num_classes=10).model
    assert not hasattr(own, "pos_schemes") and own.pos_embed is not None
    with pytest.raises(ValueError, match="'gta' needs cameras"):
        Classifier(model_name="vit_tiny_patch16_224", pos_embed="gta", model_kwargs=small, num_classes=10)
    default = Classifier(model_name="visionpe_vit_tiny_patch16_224", model_kwargs=small, num_classes=10).model
    assert default.pos_embed_names == ["learned"]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"base_lr": "1e-3"}, TypeError, r"base_lr must be a positive finite number, got str \('1e-3'\)"),
        ({"mixup": None}, TypeError, "mixup must be a number >= 0, got None"),
        ({"opt": "bogus"}, ValueError, "opt must be a timm optimizer name .*got 'bogus'"),
        ({"seed": 1.5}, TypeError, r"seed must be an int, got float \(1.5\)"),
        ({"seed": -1}, ValueError, "seed must be >= 0, got -1"),
        ({"label_smoothing": 1.5}, ValueError, r"label_smoothing must be a number in \[0, 1\), got 1.5"),
        ({"drop_path_rate": 2.0}, ValueError, r"drop_path_rate must be a number in \[0, 1\), got 2.0"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay must be a number >= 0, got -0.1"),
        ({"warmup_epochs": -1}, ValueError, "warmup_epochs must be a number >= 0, got -1"),
        ({"min_lr": float("nan")}, ValueError, "min_lr must be a number >= 0, got nan"),
        ({"lr_batch_reference": True}, TypeError, r"lr_batch_reference must be an int, got bool \(True\)"),
        ({"model_kwargs": [1]}, TypeError, r"model_kwargs must be None or a dict, got \[1\]"),
    ],
)
def test_every_classifier_argument_is_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        Classifier(model_name="visionpe_vit_tiny_patch16_224", num_classes=10, **kwargs)
    Classifier(model_name="visionpe_vit_tiny_patch16_224", num_classes=10, opt="lookahead_adamw")  # timm's prefix


def _tiny_trainer(tmp_path, **kwargs):
    import lightning

    options = {"enable_progress_bar": False, "enable_model_summary": False, "logger": False}
    return lightning.Trainer(default_root_dir=tmp_path, accelerator="cpu", **options, **kwargs)


def _tiny_digits(**kwargs):
    from experiments import DigitsDataModule

    return DigitsDataModule(img_size=16, eval_sizes=(16, 24), batch_size=16, num_workers=0, **kwargs)


TINY = {"img_size": 16, "patch_size": 4, "embed_dim": 32, "depth": 1, "num_heads": 2, "dynamic_img_size": True}


def test_test_reports_one_accuracy_per_eval_size(tmp_path):
    """The data modules' test_dataloader gives one loader per eval size: trainer.test reports each under its size,
    each equal to the model's accuracy on that loader alone (one shared metric pooled them)."""
    from visionpe.training.evaluate import accuracy

    model = Classifier(
        "visionpe_vit_tiny_patch16_224", "rope_axial", model_kwargs=TINY, num_classes=10, mixup=0, cutmix=0
    )
    data = _tiny_digits(train_subset=64)
    per_loader = _tiny_trainer(tmp_path, limit_test_batches=3).test(model, datamodule=data)
    assert [set(r) for r in per_loader] == [{"test/acc@16px", "test/loss@16px"}, {"test/acc@24px", "test/loss@24px"}]
    results = per_loader[0] | per_loader[1]
    for size in data.eval_sizes:
        loader = data.eval_dataloader(size)
        subset = torch.utils.data.DataLoader(list(loader)[:3], batch_size=None)
        assert results[f"test/acc@{size}px"] == pytest.approx(accuracy(model, subset) / 100, abs=1e-6)
    (val,) = _tiny_trainer(tmp_path, limit_val_batches=2).validate(model, datamodule=data)
    assert set(val) == {"val/acc", "val/loss"}


class _Draws(Classifier):
    """Records one draw of the global RNG per training batch (what mixup, cutmix and drop path draw from)."""

    def training_step(self, batch, batch_idx):
        self.draws.append(float(torch.rand(())))
        return super().training_step(batch, batch_idx)


def test_accumulated_micro_batches_draw_differently(tmp_path):
    model = _Draws("visionpe_vit_tiny_patch16_224", "learned", model_kwargs=TINY, num_classes=10, mixup=0.8)
    model.draws = []
    trainer = _tiny_trainer(tmp_path, max_steps=3, accumulate_grad_batches=2, limit_val_batches=0)
    trainer.fit(model, datamodule=_tiny_digits(train_subset=128))
    assert trainer.global_step == 3 and len(model.draws) == 6
    assert len(set(model.draws)) == 6  # two micro-batches of one update drew the same mixup and drop path


class _LearningRates(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rates.append(trainer.optimizers[0].param_groups[0]["lr"])


@pytest.mark.parametrize("limits", [{"max_steps": 24, "max_epochs": -1}, {"max_steps": 24, "max_epochs": 50}])
def test_schedule_of_a_run_bounded_by_max_steps(tmp_path, limits):
    """warmup_epochs counts epochs of updates (8 per epoch here) and the cosine ends at max_steps, also when
    max_epochs is -1 (the schedule took max_steps for one epoch: 5 epochs of warm-up were 120 updates). As in DeiT
    (timm's warmup_prefix=False), the cosine runs from update 0 and the warm-up ramps towards the peak beside it."""
    kwargs = {"model_kwargs": TINY, "num_classes": 10, "mixup": 0, "cutmix": 0, "base_lr": 1e-3}
    model = Classifier("visionpe_vit_tiny_patch16_224", "learned", warmup_epochs=1, min_lr=1e-5, **kwargs)
    rates = _LearningRates()
    rates.rates = []
    trainer = _tiny_trainer(tmp_path, callbacks=[rates], limit_val_batches=0, **limits)
    trainer.fit(model, datamodule=_tiny_digits(train_subset=128))  # 128 / 16 = 8 updates per epoch
    peak, low, start = 1e-3 * 16 / 512, 1e-5, 1e-6

    def cosine(t):
        return low + (peak - low) * 0.5 * (1 + math.cos(math.pi * t / 24))

    assert len(rates.rates) == 24
    assert rates.rates[:8] == pytest.approx([start + t * (peak - start) / 8 for t in range(8)])
    assert rates.rates[8:] == pytest.approx([cosine(t) for t in range(8, 24)])


def test_cutmix_on_clips_cuts_one_box_through_every_frame():
    model = Classifier("visionpe_vit_tiny_patch16_224", "none", num_classes=4, mixup=0, cutmix=1.0, label_smoothing=0)
    clips = torch.zeros(2, 3, 6, 16, 20)
    clips[1] = 1.0  # timm pairs sample 0 with the last one (the batch flipped)
    torch.manual_seed(0)
    mixed, soft = model._mix(clips.clone(), torch.tensor([0, 1]))
    pasted = mixed[0] != 0  # (C, T, H, W): where sample 0 got sample 1's pixels
    assert pasted.any() and (pasted == pasted[:1, :1]).all()  # the same (H, W) box in every channel and frame
    rows, cols = pasted[0, 0].any(1), pasted[0, 0].any(0)
    assert int(pasted[0, 0].sum()) == int(rows.sum()) * int(cols.sum())  # a rectangle
    area = float(pasted[0, 0].float().mean())
    assert soft[0, 0] == pytest.approx(1 - area) and soft[0, 1] == pytest.approx(area)


def test_fast_dev_run_writes_its_checkpoint_under_runs(tmp_path, monkeypatch):
    """fast_dev_run turns the loggers off, so ModelCheckpoint falls back to trainer.default_root_dir: the config's
    runs/demo, not ./checkpoints of the folder the command runs from."""
    monkeypatch.chdir(tmp_path)
    run_cli(args=["fit", "--config", DIGITS, "--trainer.fast_dev_run=true", *FAST[:2]])
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["runs/demo/checkpoints/last.ckpt"]


def test_every_config_with_checkpoints_keeps_them_under_runs():
    """A config whose Trainer saves checkpoints (a ModelCheckpoint without dirpath) sets default_root_dir under
    runs/ (git ignores it), where they go when no logger names a folder (fast_dev_run, --trainer.logger=false)."""
    checked = []
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        trainer = (yaml.safe_load(path.read_text()) or {}).get("trainer") or {}
        callbacks = trainer.get("callbacks") or []
        saving = [c for c in callbacks if c["class_path"].endswith("ModelCheckpoint")]
        if any("dirpath" not in (c.get("init_args") or {}) for c in saving):
            root = trainer.get("default_root_dir", ".")
            assert Path(root).parts[0] == "runs", f"{path.relative_to(ROOT)}: checkpoints under {root}"
            checked.append(path.name)
    assert {"digits.yaml", "moving_digits.yaml", "deit_small.yaml", "ssv2_small.yaml"} <= set(checked)
