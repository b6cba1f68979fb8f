"""Lightning DataModules: the bundled digits, ImageNet-style image folders, frame-folder clips, moving digits."""

from .digits import DIGITS_MEAN, DIGITS_PATH, DIGITS_STD, DigitsDataModule, load_digits
from .image_folder import ImageFolderDataModule
from .module import Classifier
from .video_data import FrameClipDataModule, MovingDigitsDataModule

__all__ = [
    "Classifier",
    "DIGITS_MEAN",
    "DIGITS_PATH",
    "DIGITS_STD",
    "DigitsDataModule",
    "FrameClipDataModule",
    "ImageFolderDataModule",
    "MovingDigitsDataModule",
    "load_digits",
]
