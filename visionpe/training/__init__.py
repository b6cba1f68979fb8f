"""Training with Lightning: the :class:`Classifier` module, image-folder and frame-folder data, extrapolation sweeps.

Needs the ``train`` extra (from a clone: ``pip install -e ".[train]"``; Lightning, torchmetrics, kornia, matplotlib,
TensorBoard). The data modules and the module plug into any Lightning project or LightningCLI config::

    from visionpe.training import Classifier, ImageFolderDataModule

    model = Classifier("visionpe_vit_small_patch16_224", pos_embed="rope_mixed", num_classes=1000)
    trainer.fit(model, datamodule=ImageFolderDataModule("/path/to/imagenet"))

:mod:`visionpe.training.evaluate` measures trained models at sizes they never saw (:func:`~.evaluate.sweep`) and
writes the table, CSV and plot (:func:`~.evaluate.write_report`). With ``gpu_pipeline=True`` the data modules
run the training augmentation batched on the GPU (:class:`~visionpe.training.gpu_augment.BatchAugment`, kornia).
"""

try:
    import kornia  # noqa: F401
    import lightning  # noqa: F401
    import torchmetrics  # noqa: F401
except ImportError as err:
    raise ImportError(
        f'visionpe.training needs the "train" extra ({err.name or "lightning"} is missing); from a clone of '
        'visionpe: pip install -e ".[train]"'
    ) from err

from .fsdp import BlockFSDPStrategy
from .gpu_augment import BatchAugment
from .image_folder import ImageFolderDataModule
from .module import Classifier
from .video_data import FrameClipDataModule

__all__ = ["BatchAugment", "BlockFSDPStrategy", "Classifier", "FrameClipDataModule", "ImageFolderDataModule"]
