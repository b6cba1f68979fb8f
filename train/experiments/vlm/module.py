"""LightningModule for the multimodal benchmark: a tiny Qwen2-VL answering one digit per sequence.

The loss is the cross-entropy of the answer token only: the logits of the last position (the ``<ask>`` token,
computed alone with ``logits_to_keep=1``) over the whole vocabulary. Accuracy (torchmetrics) counts the arg-max
token over the whole vocabulary, so a model must also learn to answer with a digit; chance is 10 %.

Position ids are computed here, per batch, with :func:`visionpe.multimodal.get_position_ids` and passed to the
model's ``forward`` as ``position_ids``: this is what the patched ``get_rope_index`` computes, except that
schemes whose papers randomise their design during training (V2PE's delta, HoPE's gamma) get per-sample values
drawn from a generator seeded by ``(seed, step)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from visionpe.multimodal import get_position_ids

from .model import VLMSize, build_tiny_vlm
from .tasks import SPATIAL_MERGE_SIZE, VOCAB_SIZE, sample_seed

__all__ = ["VLMModule"]

_OPTION_STREAM = 2


class VLMModule(L.LightningModule):
    """Train and evaluate a tiny Qwen2-VL with one position scheme.

    Args:
        scheme: a name from :data:`~experiments.vlm.schemes.BENCH_SCHEMES`.
        size: model sizes (:class:`~experiments.vlm.model.VLMSize`), or a dict of its fields.
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay (matrices only; norms, biases and embeddings are not decayed).
        warmup_steps: linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at ``max_steps``.
        max_steps: length of the schedule (the Trainer's ``max_steps``).
        eval_lengths: the lengths of the test dataloaders, in order (their accuracies are logged as
            ``test/acc@<length>``).
        seed: model initialisation and the per-step option draws.
    """

    def __init__(
        self,
        scheme: str = "mrope",
        size: VLMSize | dict[str, Any] | None = None,
        lr: float = 2e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 50,
        max_steps: int = 1000,
        min_lr_ratio: float = 0.05,
        eval_lengths: Sequence[int] = (),
        seed: int = 0,
    ) -> None:
        super().__init__()
        if isinstance(size, dict):
            size = VLMSize(**size)
        for name, value in (("lr", lr), ("min_lr_ratio", min_lr_ratio)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or weight_decay < 0:
            raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
        for name, value, minimum in (("warmup_steps", warmup_steps, 0), ("max_steps", max_steps, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        self.model = build_tiny_vlm(scheme, size, seed=seed)
        self.scheme = self.model.bench_scheme
        self.save_hyperparameters(
            {
                "scheme": scheme,
                "size": self.model.bench_size,
                "lr": lr,
                "weight_decay": weight_decay,
                "warmup_steps": warmup_steps,
                "max_steps": max_steps,
                "min_lr_ratio": min_lr_ratio,
                "eval_lengths": list(eval_lengths),
                "seed": seed,
            }
        )
        self.lr, self.weight_decay, self.min_lr_ratio = float(lr), float(weight_decay), float(min_lr_ratio)
        self.warmup_steps, self.max_steps, self.seed = warmup_steps, max_steps, seed
        self.eval_lengths = tuple(int(n) for n in eval_lengths)
        self.train_acc = MulticlassAccuracy(num_classes=VOCAB_SIZE, average="micro")
        self.test_acc = nn.ModuleList(
            [MulticlassAccuracy(num_classes=VOCAB_SIZE, average="micro") for _ in self.eval_lengths]
        )

    def position_ids(self, batch: dict[str, torch.Tensor], training: bool) -> torch.Tensor:
        """(3, B, L) ids of the scheme for ``batch`` (training draws options per visual block where the paper does).

        int64, or float64 for fractional designs (V2PE, and ``rope_1d``, which is V2PE with delta = 1): passed to the
        model as they are, and the patched rotary takes their angles in fp64 (docs/schemes.md)."""
        generator = None
        if training and self.scheme.train_options is not None:
            generator = torch.Generator().manual_seed(sample_seed(self.seed, _OPTION_STREAM, int(self.global_step)))
        num_blocks = sum(len(batch[key]) for key in ("image_grid_thw", "video_grid_thw") if batch.get(key) is not None)
        options = self.scheme.design_options(batch["input_ids"].shape[0], generator, training, max(num_blocks, 1))
        position_ids, _ = get_position_ids(
            self.scheme.scheme,
            batch["mm_token_type_ids"],
            batch.get("image_grid_thw"),
            batch.get("video_grid_thw"),
            batch["attention_mask"],
            spatial_merge_size=SPATIAL_MERGE_SIZE,
            pad_value=0,
            **options,
        )
        return position_ids

    def forward(self, batch: dict[str, torch.Tensor], training: bool = False) -> torch.Tensor:
        """(B, vocab) logits at the last position (the question's ``<ask>`` token)."""
        inputs = {
            key: batch[key]
            for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
            if key in batch
        }
        out = self.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            mm_token_type_ids=batch["mm_token_type_ids"],
            position_ids=self.position_ids(batch, training),
            logits_to_keep=1,
            use_cache=False,
            **inputs,
        )
        return out.logits[:, -1]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch, training=True)
        loss = F.cross_entropy(logits.float(), batch["answers"])
        self.train_acc.update(logits.detach().argmax(-1), batch["answers"])
        # Logging through Lightning costs a few ms per call, as much as a tenth of a step here: log every
        # ``log_every_n_steps`` only, with the accuracy over the steps since the last log.
        trainer = self._trainer  # None when called outside a Trainer
        if trainer is not None and (self.global_step + 1) % trainer.log_every_n_steps == 0:
            self.log("train/loss", loss.detach(), batch_size=batch["answers"].numel())
            self.log("train/acc", self.train_acc.compute(), batch_size=batch["answers"].numel())
            self.train_acc.reset()
        return loss

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        if dataloader_idx >= len(self.test_acc):
            raise ValueError(
                f"test dataloader {dataloader_idx} has no metric: eval_lengths = {self.eval_lengths} "
                "must list one length per test dataloader"
            )
        metric = self.test_acc[dataloader_idx]
        metric.update(self(batch).argmax(-1), batch["answers"])
        self.log(
            f"test/acc@{self.eval_lengths[dataloader_idx]}",
            metric,
            on_step=False,
            on_epoch=True,
            batch_size=batch["answers"].numel(),
            add_dataloader_idx=False,
        )

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, param in self.model.named_parameters():
            (decay if param.ndim >= 2 and "embed_tokens" not in name else no_decay).append(param)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr,
            betas=(0.9, 0.98),
            fused=True,
        )

        def schedule(step: int) -> float:
            if step < self.warmup_steps:
                return (step + 1) / (self.warmup_steps + 1)
            progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
            return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
