"""LightningModule for image and video classification with any visionpe position encoding.

The DeiT recipe is assembled from what timm already provides: ``timm.create_model`` for the network,
``timm.data.Mixup`` (mixup, cutmix, label smoothing), ``timm.optim.create_optimizer_v2`` (AdamW, weight decay
skipped for norms, biases and the model's ``no_weight_decay`` set: position tables and frequencies),
``timm.scheduler`` (cosine with warm-up, stepped per update) and torchmetrics for accuracy. Lightning does the
rest: checkpointing, resume, logging, progress bars, DDP.
"""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import numpy as np
import timm
import torch
import torch.nn.functional as F
from timm.data import Mixup
from timm.layers import trunc_normal_
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from torchmetrics.classification import MulticlassAccuracy

import visionpe  # noqa: F401  (registers the visionpe models with timm)

__all__ = ["Classifier"]


class Classifier(L.LightningModule):
    """Classify images (B, C, H, W) or clips (B, C, T, H, W) with a timm/visionpe model.

    Args:
        model_name: any timm model name, e.g. ``visionpe_vit_small_patch16_224`` or a timm reference model.
        pos_embed, pos_embed_kwargs: the position scheme(s), passed to visionpe models (ignored for timm's own).
        model_kwargs: further ``timm.create_model`` arguments (``img_size``, ``patch_size``, ``embed_dim``...).
        num_classes: classes.
        base_lr: learning rate for a global batch of ``lr_batch_reference`` images (DeiT: 5e-4 per 512).
        weight_decay, opt: optimizer settings (timm names).
        warmup_epochs, min_lr, warmup_lr: cosine schedule with linear warm-up, stepped every update.
        mixup, cutmix, label_smoothing: timm Mixup settings; all zero trains with plain cross-entropy.
        drop_path_rate: stochastic depth.
        weight_init: None keeps the model's own initialisation; ``"vit"`` re-initialises every Linear layer as
            timm's VisionTransformer does (truncated normal, std 0.02, zero bias), e.g. to train timm's Eva models
            (which scale the head by 1e-3 and the residual projections by depth) exactly like a visionpe ViT.
        seed: the randomness of every training step is reseeded from (seed, step, rank), so resuming from a
            checkpoint replays the same mixup, cutmix and drop path as an uninterrupted run (the data modules
            seed their sampling and augmentation per epoch the same way).
    """

    def __init__(
        self,
        model_name: str = "visionpe_vit_small_patch16_224",
        pos_embed: str | list[str] | None = "learned",
        pos_embed_kwargs: dict[str, Any] | None = None,
        model_kwargs: dict[str, Any] | None = None,
        num_classes: int = 1000,
        base_lr: float = 5e-4,
        lr_batch_reference: int = 512,
        weight_decay: float = 0.05,
        opt: str = "adamw",
        warmup_epochs: float = 5.0,
        min_lr: float = 1e-5,
        warmup_lr: float = 1e-6,
        mixup: float = 0.8,
        cutmix: float = 1.0,
        label_smoothing: float = 0.1,
        drop_path_rate: float = 0.1,
        seed: int = 0,
        weight_init: str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be an int >= 2, got {num_classes!r}")
        for name, value in (("base_lr", base_lr), ("lr_batch_reference", lr_batch_reference)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        for name, value in (("mixup", mixup), ("cutmix", cutmix), ("label_smoothing", label_smoothing)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        if weight_init not in (None, "vit"):
            raise ValueError(f"weight_init must be None or 'vit', got {weight_init!r}")
        self.save_hyperparameters()
        kwargs = dict(model_kwargs or {})
        if model_name.startswith("visionpe_"):
            kwargs.update(pos_embed=pos_embed, pos_embed_kwargs=pos_embed_kwargs)
        self.model = timm.create_model(model_name, num_classes=num_classes, drop_path_rate=drop_path_rate, **kwargs)
        if weight_init == "vit":
            for module in self.model.modules():
                if isinstance(module, torch.nn.Linear):
                    trunc_normal_(module.weight, std=0.02)
                    if module.bias is not None:
                        torch.nn.init.zeros_(module.bias)
        self.mixup_fn = (
            Mixup(mixup_alpha=mixup, cutmix_alpha=cutmix, label_smoothing=label_smoothing, num_classes=num_classes)
            if mixup > 0 or cutmix > 0
            else None
        )
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Every step's randomness (mixup, cutmix, drop path) is a function of (seed, step, rank) only, so a run
        # resumed from a checkpoint replays exactly what the uninterrupted run would have drawn.
        step_seed = (self.hparams.seed * 1_000_003 + self.global_step) * 64 + self.global_rank
        random.seed(step_seed)
        np.random.seed(step_seed % 2**32)
        torch.manual_seed(step_seed)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, targets = batch
        if self.mixup_fn is not None and len(images) % 2 == 0:  # timm's Mixup pairs samples: even batches only
            images, soft = self.mixup_fn(images, targets)
            loss = SoftTargetCrossEntropy()(self(images), soft)
        else:
            loss = F.cross_entropy(self(images), targets, label_smoothing=self.hparams.label_smoothing)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=len(images))
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, targets = batch
        logits = self(images)
        self.val_acc.update(logits, targets)
        self.log("val/loss", F.cross_entropy(logits, targets), sync_dist=True, batch_size=len(images))
        self.log("val/acc", self.val_acc, prog_bar=True, on_epoch=True, batch_size=len(images))

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def global_batch_size(self) -> int:
        datamodule = getattr(self.trainer, "datamodule", None)
        batch_size = getattr(datamodule, "batch_size", None)
        if batch_size is None:
            raise ValueError("the datamodule must have a batch_size attribute to scale the learning rate")
        return batch_size * self.trainer.world_size * self.trainer.accumulate_grad_batches

    def configure_optimizers(self):
        lr = self.hparams.base_lr * self.global_batch_size() / self.hparams.lr_batch_reference
        optimizer = create_optimizer_v2(self.model, opt=self.hparams.opt, lr=lr, weight_decay=self.hparams.weight_decay)
        epochs = max(self.trainer.max_epochs or 1, 1)
        updates_per_epoch = max(int(self.trainer.estimated_stepping_batches // epochs), 1)
        scheduler, _ = create_scheduler_v2(
            optimizer,
            sched="cosine",
            num_epochs=epochs,
            warmup_epochs=self.hparams.warmup_epochs,
            min_lr=self.hparams.min_lr,
            warmup_lr=self.hparams.warmup_lr,
            step_on_epochs=False,
            updates_per_epoch=updates_per_epoch,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def lr_scheduler_step(self, scheduler, metric) -> None:
        scheduler.step_update(num_updates=self.global_step)
