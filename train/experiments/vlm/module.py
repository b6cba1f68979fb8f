"""LightningModule for the multimodal benchmark: a tiny Qwen2-VL answering one digit per sequence.

The loss is the cross-entropy of the answer token only: the logits of the last position (the ``<ask>`` token,
computed alone with ``logits_to_keep=1``) over the whole vocabulary. Accuracy (torchmetrics) counts the arg-max
token over the whole vocabulary, so a model must also learn to answer with a digit; chance is 10 %.

Position ids are computed here, per batch, with :func:`visionpe.multimodal.get_position_ids` and passed to the
model's ``forward`` as ``position_ids``: this is what the patched ``get_rope_index`` computes, except that
schemes whose papers randomise their design during training (V2PE's delta, HoPE's gamma) get per-sample values
drawn from a generator seeded by ``(seed, step)``, and the designs that read more than the layout get it from the
batch (BiPE the token ids, in which its separators are found; RoPE-DHR the tile grid of each image) and
Qwen2.5-VL's absolute time its ``second_per_grid_ts`` from the scheme's fixed frame rate, one value per video.

CCA's and PyPE's masks and PyPE's per-layer ids are built by the adapter on each forward of the model (its
``forward`` is patched per instance), from the same inputs. Two designs run the model in parts, the vision tower,
then the inputs of the language model, then the language model and its head (the same modules and the same
computation as the model's ``forward``, plus what the design adds):

- BiPE adds its intra-segment embedding (:func:`~visionpe.multimodal.bipe_side_index`) to the inputs;
- PPE merges the visual tokens of each image or frame (:func:`~experiments.vlm.model.merge_visual_tokens`), computes
  the ids on the dense sequence with the clusters (each token carrying K members' ids) and keeps one column per
  cluster (its first member's): the language model sees the text and the merged tokens, left-padded.
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

from visionpe.absolute.sincos import sincos_2d
from visionpe.multimodal import bipe_side_index, get_position_ids

from .model import VLMSize, build_tiny_vlm, merge_visual_tokens
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

    def position_ids(
        self, batch: dict[str, torch.Tensor], training: bool, clusters: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(3, B, L) ids of the scheme for ``batch`` (training draws options per visual block where the paper does).

        int64, or float64 for fractional designs (V2PE, and ``rope_1d``, which is V2PE with delta = 1): passed to the
        model as they are, and the patched rotary takes their angles in fp64 (docs/schemes.md). The scheme's
        ``batch_options`` are read from the batch; ``clusters`` (B, L) is PPE's (3K rows then)."""
        missing = [key for key in self.scheme.batch_options if key not in batch]
        if missing:
            raise ValueError(f"scheme {self.scheme.name!r} needs {missing} in the batch, got keys {sorted(batch)}")
        if clusters is not None and self.scheme.merge_ratio is None:
            raise ValueError(f"clusters are PPE's merged tokens; scheme {self.scheme.name!r} merges none")
        generator = None
        if training and self.scheme.train_options is not None:
            generator = torch.Generator().manual_seed(sample_seed(self.seed, _OPTION_STREAM, int(self.global_step)))
        num_blocks = sum(len(batch[key]) for key in ("image_grid_thw", "video_grid_thw") if batch.get(key) is not None)
        options = self.scheme.design_options(batch["input_ids"].shape[0], generator, training, max(num_blocks, 1))
        options.update({key: batch[key] for key in self.scheme.batch_options})
        options.update(self.scheme.call_inputs(batch.get("video_grid_thw")))  # mrope_abs_time's video timing
        if clusters is not None:
            options["clusters"] = clusters
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
        if self.scheme.side_embedding or self.scheme.merge_ratio is not None:
            return self._forward_in_parts(batch, training)
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

    def visual_features(self, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The vision tower's output, one (N_b, hidden) tensor per image or video, in the order of the grids."""
        vl_model = self.model.model
        features: list[torch.Tensor] = []
        if batch.get("pixel_values") is not None:
            features += vl_model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
        if batch.get("pixel_values_videos") is not None:
            features += vl_model.get_video_features(batch["pixel_values_videos"], batch["video_grid_thw"]).pooler_output
        return list(features)

    def side_embedding(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, L, hidden) BiPE's intra-segment embedding: the learned table at the intra index for text, a fixed 2-D
        sin-cos of the (row, column) inside the frame for visual tokens, zero at padding."""
        options = self.scheme.options
        side = bipe_side_index(
            batch["mm_token_type_ids"],
            batch.get("image_grid_thw"),
            batch.get("video_grid_thw"),
            batch["attention_mask"],
            input_ids=batch["input_ids"],
            separator_ids=options["separator_ids"],
            spatial_merge_size=SPATIAL_MERGE_SIZE,
            pad_value=0,
        )
        text = self.model.bipe_intra(side.intra)
        coords = torch.stack([side.visual_row, side.visual_col], -1).clamp(min=0).flatten(0, 1)
        visual = sincos_2d(coords, text.shape[-1]).view_as(text).to(text.dtype)
        embedding = torch.where(side.is_visual[..., None], visual, text)
        return embedding * batch["attention_mask"][..., None].to(text.dtype)

    def _forward_in_parts(self, batch: dict[str, torch.Tensor], training: bool) -> torch.Tensor:
        """The model's forward in parts, for BiPE (side embedding) and PPE (merged visual tokens)."""
        vl_model = self.model.model
        types = batch["mm_token_type_ids"]
        visual = types > 0
        embeds = vl_model.get_input_embeddings()(batch["input_ids"])
        features = self.visual_features(batch)
        mask = batch["attention_mask"]
        clusters = None
        if self.scheme.merge_ratio is not None and features:
            frames = [
                int(g[0])
                for key in ("image_grid_thw", "video_grid_thw")
                if batch.get(key) is not None
                for g in batch[key]
            ]
            block_clusters, merged = merge_visual_tokens(features, frames, self.scheme.merge_ratio)
            # every member carries its cluster's merged feature; one column per cluster is kept below
            features = [m.index_select(0, c) for c, m in zip(block_clusters, merged, strict=True)]
            clusters = torch.zeros_like(batch["input_ids"])
            clusters[visual] = torch.cat(block_clusters)
        if features:
            embeds = embeds.masked_scatter(visual[..., None], torch.cat(features).to(embeds.dtype))
        if self.scheme.side_embedding:
            embeds = embeds + self.side_embedding(batch)
        position_ids = self.position_ids(batch, training, clusters=clusters)
        if clusters is not None:
            embeds, mask, position_ids = _keep_first_members(embeds, mask, position_ids, visual, clusters)
        out = vl_model.language_model(
            inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids, use_cache=False
        )
        return self.model.lm_head(out.last_hidden_state[:, -1])

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
            embedding = "embed_tokens" in name or name.startswith("bipe_intra")  # tables are not decayed
            (decay if param.ndim >= 2 and not embedding else no_decay).append(param)
        # Lightning refuses to clip a fused optimizer's gradients under mixed precision (the fused step unscales
        # them itself); in full precision, the benchmark's default, the fused kernel stays
        mixed = self._trainer is not None and "mixed" in str(self._trainer.precision)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr,
            betas=(0.9, 0.98),
            fused=not mixed,
        )

        def schedule(step: int) -> float:
            if step < self.warmup_steps:
                return (step + 1) / (self.warmup_steps + 1)
            progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
            return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _keep_first_members(
    embeds: torch.Tensor,
    mask: torch.Tensor,
    position_ids: torch.Tensor,
    visual: torch.Tensor,
    clusters: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequence with one column per cluster (its first member) and every valid text token, left-padded again.

    Clusters are numbered per visual block; a block starts where a visual run starts after text (the grids of the
    benchmark's tasks have one visual run per image or video)."""
    valid = mask.bool()
    batch_size, length = mask.shape
    starts = visual & ~torch.cat([torch.zeros_like(visual[:, :1]), visual[:, :-1]], 1)
    block = torch.cumsum(starts.flatten().long(), 0).view(batch_size, length)  # block number, global to the batch
    key = torch.where(visual, block * (int(clusters.max()) + 1) + clusters, -1)
    first = torch.zeros_like(visual)
    flat_key = key[visual]
    positions = visual.flatten().nonzero().flatten()
    seen = torch.unique(flat_key, return_inverse=True)[1]
    first_of = torch.full((int(seen.max()) + 1,), positions.numel(), device=positions.device)
    first_of.scatter_reduce_(0, seen, torch.arange(positions.numel(), device=positions.device), reduce="amin")
    first.view(-1)[positions[first_of]] = True
    keep = (valid & ~visual) | first
    counts = keep.sum(1)
    width = int(counts.max())
    target = width - counts[:, None] + keep.long().cumsum(1) - 1  # left padding: the last kept token at -1
    rows, cols = keep.nonzero(as_tuple=True)
    new_cols = target[rows, cols]
    new_embeds = embeds.new_zeros(batch_size, width, embeds.shape[-1])
    new_embeds[rows, new_cols] = embeds[rows, cols]
    new_mask = mask.new_zeros(batch_size, width)
    new_mask[rows, new_cols] = 1
    new_ids = position_ids.new_zeros(position_ids.shape[0], batch_size, width)
    new_ids[:, rows, new_cols] = position_ids[:, rows, cols]
    return new_embeds, new_mask, new_ids
