"""The LightningCLI behind ``train/classify.py`` and ``train/video.py``: a :class:`Classifier` and any data module."""

from __future__ import annotations

from lightning import LightningDataModule
from lightning.pytorch.cli import LightningCLI

from visionpe.training import Classifier

__all__ = ["run_cli"]


def run_cli(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Parse ``args`` (or sys.argv) as ``fit|validate|test --config ...`` and run it."""
    return LightningCLI(
        Classifier,
        LightningDataModule,
        subclass_mode_data=True,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
    )
