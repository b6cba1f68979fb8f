"""LightningModule for image and video classification with any visionpe position encoding.

The DeiT recipe is assembled from what timm already provides: ``timm.create_model`` for the network,
``timm.data.Mixup`` (mixup, cutmix, label smoothing), ``timm.optim.create_optimizer_v2`` (AdamW, weight decay
skipped for norms, biases and the model's ``no_weight_decay`` set: position tables and frequencies),
``timm.scheduler.CosineLRScheduler`` (cosine with linear warm-up, counted and stepped in optimizer updates) and
torchmetrics for accuracy. Lightning does the rest: checkpointing, resume, logging, progress bars, DDP and FSDP
(:class:`~visionpe.training.fsdp.BlockFSDPStrategy`).
"""

from __future__ import annotations

import math
import random
from typing import Any

import lightning as L
import numpy as np
import timm
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from timm.data import Mixup
from timm.layers import trunc_normal_
from timm.loss import SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2, get_optimizer_class, param_groups_weight_decay
from timm.scheduler import CosineLRScheduler
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torchmetrics.classification import MulticlassAccuracy

import visionpe  # noqa: F401  (registers the visionpe models with timm)

from ..grid import validate_positive
from ..integrations.timm import apply_position_scheme
from ..integrations.timm_swap import SWAP_ENTRY
from ..models.vit import normalize_schemes
from .fsdp import shard_model
from .sampling import _check_int
from .sampling import _sample_seed as sample_seed

_STEP_STREAM = 5  # key of the per-batch seeds (the data modules use other streams)

__all__ = ["Classifier"]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _weight_decay_by_name(model: torch.nn.Module, weight_decay: float) -> dict[str, float]:
    """{parameter name: weight decay} as timm's ``create_optimizer_v2`` splits them (no decay for norms, biases and the
    model's ``no_weight_decay`` set)."""
    names = {id(param): name for name, param in model.named_parameters()}
    no_weight_decay = getattr(model, "no_weight_decay", set)()
    groups = param_groups_weight_decay(model, weight_decay, no_weight_decay_list=no_weight_decay)
    return {names[id(param)]: group["weight_decay"] for group in groups for param in group["params"]}


_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def _unwrapped_name(name: str) -> str:
    """A parameter's name with the module prefixes of FSDP units and checkpoint wrappers removed."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _check_args(args: dict[str, Any]) -> None:
    """Validate the Classifier's arguments (``locals()`` of its ``__init__``), naming the argument, what it must be
    and what was given, before anything is built."""

    def fail(name: str, expected: str) -> None:
        value = args[name]
        numeric = isinstance(value, (int, float, str)) and not isinstance(value, bool)
        error = ValueError if numeric else TypeError
        raise error(f"{name} must be {expected}, got {value!r}")

    if args["sharded_param_dtype"] not in (None, "bfloat16", "float16"):
        fail("sharded_param_dtype", "None, 'bfloat16' or 'float16'")
    if not isinstance(args["model_name"], str) or not timm.is_model(args["model_name"]):
        fail("model_name", "a timm model name (timm.list_models(), visionpe_* included)")
    for name in ("pos_embed_kwargs", "model_kwargs"):
        if args[name] is not None and not isinstance(args[name], dict):
            fail(name, "None or a dict")
    for name, minimum in (("num_classes", 2), ("lr_batch_reference", 1), ("seed", 0)):
        _check_int(name, args[name], minimum)
    validate_positive(args["base_lr"], "base_lr")
    for name in ("weight_decay", "warmup_epochs", "min_lr", "warmup_lr", "mixup", "cutmix"):
        if not _is_number(args[name]) or args[name] < 0:
            fail(name, "a number >= 0")
    for name in ("label_smoothing", "drop_path_rate"):
        if not _is_number(args[name]) or not 0 <= args[name] < 1:
            fail(name, "a number in [0, 1)")
    opt = args["opt"]
    if not isinstance(opt, str):
        fail("opt", "a timm optimizer name")
    try:
        get_optimizer_class(opt.lower().removeprefix("lookahead_"))
    except ValueError:
        fail("opt", "a timm optimizer name (timm.optim.list_optimizers(), optionally with a 'lookahead_' prefix)")
    if args["weight_init"] not in (None, "vit"):
        fail("weight_init", "None or 'vit'")


class Classifier(L.LightningModule):
    """Classify images (B, C, H, W) or clips (B, C, T, H, W) with a timm/visionpe model.

    Args:
        model_name: any timm model name, e.g. ``visionpe_vit_small_patch16_224`` or a timm reference model.
        pos_embed, pos_embed_kwargs: the position scheme(s) and their options. A visionpe model is created with them
            (None: its default, ``learned``). A timm model of another name (a ViT, Eva or NaFlexVit) is created as
            timm builds it and, when either is given, has its position encoding replaced in place by
            :func:`~visionpe.integrations.timm.apply_position_scheme` (``pos_embed=None`` with options: its own
            encoding with those options); with neither it keeps its own. A model class that cannot take visionpe
            schemes raises.
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
        seed: the randomness of every training batch is reseeded from (seed, update, micro-batch of the update,
            rank), so resuming from a checkpoint replays the same mixup, cutmix and drop path as an uninterrupted
            run, and the micro-batches of an accumulated update draw differently (the data modules seed their
            sampling and augmentation per epoch the same way).
        sharded_param_dtype: under Lightning's ``ModelParallelStrategy`` (FSDP2), the dtype in which the blocks
            gather their parameters (``"bfloat16"`` or ``"float16"``; gradients are reduced in fp32), None: full
            precision. The model is sharded in :meth:`configure_model` by
            :func:`~visionpe.training.fsdp.shard_model`: one unit per block, the model (with its position schemes,
            kept in fp32) the root. Any other strategy with this set raises.

    The schedule counts optimizer updates: ``warmup_epochs`` and the cosine are measured in epochs of updates, and
    a run bounded by ``trainer.max_steps`` ends its cosine at ``max_steps``. Clips get cutmix boxes in (H, W), the
    same box on every frame. Validation and test keep one accuracy per dataloader; with several (the data modules'
    ``test_dataloader``: one per eval size), they are logged as ``test/acc@<size><unit>``, e.g. ``test/acc@48px``.
    Position schemes with training losses of their own (SeqPE's contrastive and transfer terms) add them to the task
    loss in training steps, each times its weight (:meth:`auxiliary_losses`), logged as ``train/<name>``;
    ``train/loss`` is the total.
    """

    def __init__(
        self,
        model_name: str = "visionpe_vit_small_patch16_224",
        pos_embed: str | list[str] | None = None,
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
        sharded_param_dtype: str | None = None,
    ) -> None:
        super().__init__()
        _check_args(locals())
        self.save_hyperparameters()
        kwargs = dict(model_kwargs or {})
        visionpe_model = model_name.startswith("visionpe_")
        if not visionpe_model and pos_embed is not None:  # refuse a scheme the swap cannot place before building
            normalize_schemes(pos_embed, pos_embed_kwargs, SWAP_ENTRY)
        if visionpe_model and pos_embed is not None:
            kwargs["pos_embed"] = pos_embed
        if visionpe_model and pos_embed_kwargs is not None:
            kwargs["pos_embed_kwargs"] = pos_embed_kwargs
        self.model = timm.create_model(model_name, num_classes=num_classes, drop_path_rate=drop_path_rate, **kwargs)
        if not visionpe_model and (pos_embed is not None or pos_embed_kwargs is not None):
            apply_position_scheme(self.model, pos_embed, pos_embed_kwargs)
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
        self.accuracies = torch.nn.ModuleDict()  # "<stage>_<dataloader_idx>": one accuracy per eval dataloader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Every batch's randomness (mixup, cutmix, drop path) is a function of (seed, update, micro-batch, rank) only,
        # so a run resumed from a checkpoint replays exactly what the uninterrupted run would have drawn. Lightning
        # accumulates over windows of accumulate_grad_batches batches from the start of each epoch, during which
        # global_step (the update count) stands still: the micro-batch index tells the window's batches apart.
        micro = batch_idx % self.trainer.accumulate_grad_batches
        step_seed = sample_seed(self.hparams.seed, _STEP_STREAM, self.global_step, micro, self.global_rank)
        random.seed(step_seed)
        np.random.seed(step_seed % 2**32)
        torch.manual_seed(step_seed)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, targets = batch
        if self.mixup_fn is not None and len(images) % 2 == 0:  # timm's Mixup pairs samples: even batches only
            images, soft = self._mix(images, targets)
            loss = SoftTargetCrossEntropy()(self(images), soft)
        else:
            loss = F.cross_entropy(self(images), targets, label_smoothing=self.hparams.label_smoothing)
        log = {"on_step": True, "on_epoch": True, "batch_size": len(images), "sync_dist": True}
        for name, (weight, term) in self.auxiliary_losses().items():
            loss = loss + weight * term
            self.log(f"train/{name}", term, **log)
        self.log("train/loss", loss, prog_bar=True, **log)
        return loss

    def auxiliary_losses(self) -> dict[str, tuple[float, torch.Tensor]]:
        """{name: (weight, unweighted term)} of every position scheme's training losses
        (:meth:`~visionpe.base.PositionEncoding.auxiliary_losses`, e.g. SeqPE's contrastive and transfer terms),
        which :meth:`training_step` adds to the task loss times their weights and logs as ``train/<name>``. Empty for
        models without position schemes (timm's own) and for schemes without such losses."""
        terms: dict[str, tuple[float, torch.Tensor]] = {}
        for key, scheme in getattr(self.model, "pos_schemes", {}).items():
            for name, term in scheme.auxiliary_losses().items():
                weight = float(scheme.auxiliary_loss_weights.get(name, 1.0))
                terms[f"{key}/{name}" if name in terms else name] = (weight, term)
        return terms

    def _mix(self, images: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """timm's Mixup; a clip (B, C, T, H, W) is mixed as (B, C T, H, W), so that cutmix cuts one (H, W) box
        through every frame (timm cuts dims 2 and 3 with a box drawn for the last two: T and H of a clip)."""
        if images.ndim == 4:
            return self.mixup_fn(images, targets)
        frames = images.reshape(images.shape[0], -1, *images.shape[-2:])
        frames, soft = self.mixup_fn(frames, targets)
        return frames.reshape(images.shape), soft

    def _accuracy(self, stage: str, dataloader_idx: int) -> MulticlassAccuracy:
        key = f"{stage}_{dataloader_idx}"
        if key not in self.accuracies:
            metric = MulticlassAccuracy(num_classes=self.hparams.num_classes, average="micro")
            self.accuracies[key] = metric.to(self.device)
        return self.accuracies[key]

    def _metric_name(self, stage: str, dataloader_idx: int) -> tuple[str, bool]:
        """``<stage>/acc@<size><unit>`` when the data module names the sizes of several loaders (then without
        Lightning's ``/dataloader_idx_k`` suffix), else ``<stage>/acc``."""
        loaders = self.trainer.test_dataloaders if stage == "test" else self.trainer.val_dataloaders
        count = len(loaders) if isinstance(loaders, (list, tuple)) else 1
        datamodule = getattr(self.trainer, "datamodule", None)
        sizes = getattr(datamodule, "eval_sizes", None)
        if stage == "test" and count > 1 and sizes is not None and len(sizes) == count:
            return f"test/acc@{sizes[dataloader_idx]}{getattr(datamodule, 'size_label', '')}", False
        return f"{stage}/acc", True

    def _eval_step(self, stage: str, batch: tuple[torch.Tensor, torch.Tensor], dataloader_idx: int) -> None:
        images, targets = batch
        logits = self(images)
        metric = self._accuracy(stage, dataloader_idx)
        metric.update(logits, targets)
        name, add_idx = self._metric_name(stage, dataloader_idx)
        loss = F.cross_entropy(logits, targets)
        log = {"batch_size": len(images), "add_dataloader_idx": add_idx}
        self.log(name.replace("/acc", "/loss"), loss, sync_dist=True, **log)
        attribute = f"accuracies.{stage}_{dataloader_idx}"  # added after Lightning listed the metric attributes
        self.log(name, metric, prog_bar=stage == "val", on_epoch=True, metric_attribute=attribute, **log)

    def validation_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._eval_step("val", batch, dataloader_idx)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step("test", batch, dataloader_idx)

    def global_batch_size(self) -> int:
        datamodule = getattr(self.trainer, "datamodule", None)
        batch_size = getattr(datamodule, "batch_size", None)
        if batch_size is None:
            raise ValueError("the datamodule must have a batch_size attribute to scale the learning rate")
        return batch_size * self.trainer.world_size * self.trainer.accumulate_grad_batches

    def configure_model(self) -> None:
        """Under Lightning's ``ModelParallelStrategy``: shard the model with FSDP2 over the data-parallel mesh
        (:func:`~visionpe.training.fsdp.shard_model`), once; under any other strategy, or outside a trainer
        (``load_from_checkpoint``), nothing is sharded here."""
        dtype = self.hparams.get("sharded_param_dtype")
        if self._trainer is None:  # load_from_checkpoint builds the module outside any trainer: nothing to shard
            return
        if not isinstance(self.trainer.strategy, ModelParallelStrategy):
            if dtype is not None:
                raise ValueError(
                    f"sharded_param_dtype={dtype!r} applies to Lightning's ModelParallelStrategy (FSDP2), but the "
                    f"trainer's strategy is {type(self.trainer.strategy).__name__}; set it to None"
                )
            return
        if isinstance(self.model, FSDPModule):  # configure_model runs again for a later fit / test
            return
        policy = None if dtype is None else MixedPrecisionPolicy(getattr(torch, dtype), reduce_dtype=torch.float32)
        shard_model(self.model, mesh=self.device_mesh["data_parallel"], mp_policy=policy)

    def setup(self, stage: str) -> None:
        # Before a strategy wraps the model: FSDP turns each parameter into a flat 1-D shard, from which timm's split
        # (no decay for tensors of one dimension) could no longer be read, so the split is taken here, by name.
        self._weight_decay = _weight_decay_by_name(self.model, self.hparams.weight_decay)

    def _parameter_groups(self) -> list[dict[str, Any]] | torch.nn.Module:
        """The model itself (timm splits weight decay), or, for a model sharded by FSDP, the split taken in
        :meth:`setup` applied to the wrapped parameters by name."""
        named = list(self.model.named_parameters())
        if not any(prefix in name for name, _ in named for prefix in _WRAPPER_PREFIXES):
            return self.model
        split = getattr(self, "_weight_decay", None)
        if split is None:
            raise RuntimeError("the model was wrapped before Classifier.setup() read its weight-decay split")
        groups: dict[float, list[torch.nn.Parameter]] = {}
        for name, param in named:
            if param.requires_grad:
                key = _unwrapped_name(name)
                if key not in split:
                    raise RuntimeError(f"parameter {key!r} of the wrapped model was not in the model at setup()")
                groups.setdefault(split[key], []).append(param)
        return [{"params": params, "weight_decay": decay} for decay, params in sorted(groups.items())]

    def configure_optimizers(self):
        lr = self.hparams.base_lr * self.global_batch_size() / self.hparams.lr_batch_reference
        optimizer = create_optimizer_v2(
            self._parameter_groups(), opt=self.hparams.opt, lr=lr, weight_decay=self.hparams.weight_decay
        )
        # the schedule in optimizer updates: all of them (max_epochs or max_steps, whichever ends the run first),
        # and an epoch's worth (the last window of an epoch updates too, as Lightning does)
        total = int(self.trainer.estimated_stepping_batches)
        self.trainer.fit_loop.setup_data()  # the batches per epoch (estimated_stepping_batches skips it for max_steps)
        batches = self.trainer.num_training_batches
        per_epoch = (
            total if batches == float("inf") else max(math.ceil(batches / self.trainer.accumulate_grad_batches), 1)
        )
        warmup = round(self.hparams.warmup_epochs * per_epoch)
        if warmup >= total:
            rank_zero_warn(
                f"warmup_epochs={self.hparams.warmup_epochs} is {warmup} updates, but the run has {total}: the "
                "learning rate never leaves the warm-up"
            )
        scheduler = CosineLRScheduler(
            optimizer,
            t_initial=total,
            lr_min=self.hparams.min_lr,
            warmup_t=warmup,
            warmup_lr_init=self.hparams.warmup_lr,
            t_in_epochs=False,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def lr_scheduler_step(self, scheduler, metric) -> None:
        scheduler.step_update(num_updates=self.global_step)
