"""The LightningCLI behind ``train/classify.py`` and ``train/video.py``: a :class:`Classifier` and any data module."""

from __future__ import annotations

import sys
from unittest import mock

from lightning import LightningDataModule
from lightning.pytorch.cli import LightningCLI

from visionpe.training import Classifier

__all__ = ["run_cli"]


def run_cli(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Parse ``args`` (or sys.argv) as ``fit|validate|test --config ...`` and run it.

    Given ``args`` replace the command line: a script that builds its runs from its own arguments (such as
    ``train/extrapolate.py``) hands each run its arguments here, and Lightning then sees no command line of its own.
    """
    argv = sys.argv if args is None else sys.argv[:1]
    with mock.patch.object(sys, "argv", argv):  # else Lightning warns, for every run, that both were given
        return LightningCLI(
            Classifier,
            LightningDataModule,
            subclass_mode_data=True,
            args=args,
            run=run,
            save_config_kwargs={"overwrite": True},
        )
