"""End-to-end training tests through the LightningCLI, the way users run train/classify.py and train/video.py."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from visionpe.training import Classifier
from visionpe.training.cli import run_cli

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
