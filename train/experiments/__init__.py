"""This project's experiments: the bundled digits and their protocols, and the sweeps behind ``train/*.py``.

Not part of the installed ``visionpe`` package: the scripts in ``train/`` put this folder on ``sys.path`` (Python
does that for the folder of the script it runs), and the configs name the data modules as
``experiments.DigitsDataModule``, ``experiments.MovingDigitsDataModule`` and ``experiments.ScenesDataModule``. The
bundled digits are found from this folder's place in the repository (``assets/digits/mnist_5k.npz``), or given as
``digits_path``.

- :mod:`.digits`: the 5,000 bundled MNIST digits and :class:`DigitsDataModule` (the resolution and canvas
  extrapolation protocols).
- :mod:`.moving_digits`: :class:`MovingDigitsDataModule`, moving digits whose label needs temporal order.
- :mod:`.scenes`: :class:`ScenesDataModule`, procedural scenes whose labels need absolute or relative position,
  rendered natively at any size as zoom or canvas (``train/scenes.py``).
- :mod:`.cli`: the LightningCLI of ``train/classify.py`` and ``train/video.py``.
- :mod:`.sweep`: train schemes from a config and sweep them over test sizes (``train/extrapolate.py``).
- :mod:`.vlm`: the multimodal extrapolation benchmark (``bench/vlm_extrapolation.py``; needs transformers).
"""

from .digits import DIGITS_MEAN, DIGITS_PATH, DIGITS_STD, DigitsDataModule, load_digits, split_digits
from .moving_digits import MovingDigitsDataModule
from .scenes import ScenesDataModule

__all__ = [
    "DIGITS_MEAN",
    "DIGITS_PATH",
    "DIGITS_STD",
    "DigitsDataModule",
    "MovingDigitsDataModule",
    "ScenesDataModule",
    "load_digits",
    "split_digits",
]
