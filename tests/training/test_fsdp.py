"""FSDP training (visionpe.training.fsdp): two processes over gloo on the CPU equal one process on the whole batch,
and the FSDP override configs parse and build their strategy through the LightningCLI."""

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Subset, TensorDataset

from experiments.cli import run_cli
from visionpe.attention import PosBlock
from visionpe.training import Classifier
from visionpe.training.fsdp import DEFAULT_BLOCK_CLASSES, BlockFSDPStrategy, resolve_block_classes

ROOT = Path(__file__).resolve().parents[2]
IMAGENET = str(ROOT / "configs" / "imagenet" / "deit_small.yaml")
DIGITS = str(ROOT / "configs" / "demo" / "digits.yaml")
DEPTH, STEPS, GLOBAL_BATCH, CLIP = 2, 2, 8, 0.1

pytestmark = pytest.mark.skipif(
    sys.platform == "win32" or not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)


def _classifier() -> Classifier:
    torch.manual_seed(0)
    return Classifier(
        model_name="visionpe_vit_tiny_patch16_224",
        pos_embed=["rope_mixed", "alibi2d"],  # a rotary scheme with learned frequencies and a bias scheme
        model_kwargs={"img_size": 16, "patch_size": 4, "embed_dim": 32, "depth": DEPTH, "num_heads": 2},
        num_classes=4,
        opt="sgd",  # momentum SGD: unlike Adam's, its steps scale with the gradient, so clipping shows
        base_lr=0.5,
        lr_batch_reference=GLOBAL_BATCH,
        warmup_epochs=0,
        min_lr=0.5,
        mixup=0.0,
        cutmix=0.0,
        label_smoothing=0.0,
        drop_path_rate=0.0,
    )


class _Data(L.LightningDataModule):
    """Fixed images in order; rank r of w takes the samples r, r + w, ..., so the ranks' batches of a step together
    are the one-process batch of that step (Lightning's distributed sampler, which shuffles, is turned off)."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        generator = torch.Generator().manual_seed(1)
        images = torch.randn(GLOBAL_BATCH * STEPS, 3, 16, 16, generator=generator)
        self.data = TensorDataset(images, torch.randint(0, 4, (len(images),), generator=generator))

    def train_dataloader(self) -> DataLoader:
        rank, world = self.trainer.global_rank, self.trainer.world_size
        return DataLoader(Subset(self.data, range(rank, len(self.data), world)), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def _trainer(callback: Callback, accelerator: str = "cpu", **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator=accelerator,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        gradient_clip_val=CLIP,  # by the norm of all shards together under FSDP
        callbacks=[callback],
        **kwargs,
    )


def _fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0", LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FullyShardedDataParallel

    losses = _Losses()
    strategy = BlockFSDPStrategy(block_classes=["visionpe.attention.PosBlock"], process_group_backend="gloo")
    trainer = _trainer(losses, devices=world, strategy=strategy)
    model, data = _classifier(), _Data(GLOBAL_BATCH // world)
    trainer.fit(model, datamodule=data)
    trainer.limit_val_batches = 1.0
    (validated,) = trainer.validate(model, datamodule=data, verbose=False)  # a later stage reuses the units
    modules = list(trainer.model.modules())
    info = {
        "losses": losses.losses,
        "val_loss": validated["val/loss"],
        "units": sum(isinstance(m, FullyShardedDataParallel) for m in modules),
        "checkpointed": sorted(
            type(m._checkpoint_wrapped_module).__name__ for m in modules if isinstance(m, CheckpointWrapper)
        ),
        "weight_decay": sorted(
            (group["weight_decay"], sum(p.numel() for p in group["params"]))
            for group in trainer.optimizers[0].param_groups
        ),
    }
    trainer.save_checkpoint(Path(out) / "fsdp.ckpt")  # state_dict_type="full": one file, written by rank 0
    strategy._state_dict_type = "sharded"
    trainer.save_checkpoint(Path(out) / "sharded")  # a folder with each rank's shards
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(info))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_fsdp_processes_match_one_process_on_the_whole_batch(tmp_path):
    mp.spawn(_fsdp_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for info in ranks:
        assert info["units"] == DEPTH + 1  # one unit per block, and the root (embedding, schemes, head)
        assert info["checkpointed"] == ["PosBlock"] * DEPTH

    losses = _Losses()
    reference = _classifier()
    trainer = _trainer(losses, devices=1)
    trainer.fit(reference, datamodule=_Data(GLOBAL_BATCH))
    trainer.limit_val_batches = 1.0
    (validated,) = trainer.validate(reference, datamodule=_Data(GLOBAL_BATCH), verbose=False)

    # each rank's loss is the mean over its half of the batch: their mean is the whole batch's mean
    sharded = [sum(step) / 2 for step in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    assert len(sharded) == STEPS and sharded == pytest.approx(losses.losses, abs=1e-5)
    assert sharded[1] != pytest.approx(sharded[0], abs=1e-4)  # the first step moved the parameters
    for info in ranks:  # validation after fit, in the same processes: the mean over both ranks' samples
        assert info["val_loss"] == pytest.approx(validated["val/loss"], abs=1e-5)

    # the weight-decay split of timm (taken before FSDP flattened the parameters) reaches the optimizer: each rank
    # holds its shard of the decayed matrices and of the undecayed norms, biases and position parameters
    model = reference.model
    decayed = sum(
        p.numel() for g in reference.trainer.optimizers[0].param_groups if g["weight_decay"] > 0 for p in g["params"]
    )
    assert 0 < decayed < sum(p.numel() for p in model.parameters())
    shards = [dict((str(wd), n) for wd, n in info["weight_decay"]) for info in ranks]
    assert sum(s[str(reference.hparams.weight_decay)] for s in shards) == decayed

    state = torch.load(tmp_path / "fsdp.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    expected = reference.state_dict()
    assert state.keys() == expected.keys()  # a full checkpoint loads into a plain Classifier
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, atol=2e-5, rtol=1e-4, msg=name)
    assert not torch.equal(state["model.head.weight"], _classifier().state_dict()["model.head.weight"])

    # the sharded checkpoint, merged as the docs say (consolidate_checkpoint), holds the same state
    subprocess.run(
        [sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint", str(tmp_path / "sharded")],
        check=True,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    merged = torch.load(tmp_path / "sharded.consolidated", map_location="cpu", weights_only=False)["state_dict"]
    assert merged.keys() == state.keys() and all(torch.equal(merged[k], state[k]) for k in state)


@pytest.mark.parametrize(
    "name, arch, state_dict_type",
    [("vit_large", (16, 1024, 24, 16), "full"), ("vit_huge", (14, 1280, 32, 16), "sharded")],
    ids=["vit_large", "vit_huge"],
)
def test_fsdp_config_composes_with_the_imagenet_config(name, arch, state_dict_type, tmp_path):
    config = ROOT / "configs" / "fsdp" / f"{name}.yaml"
    small = ["--model.model_name=visionpe_vit_tiny_patch16_224", "--model.model_kwargs={}", "--model.num_classes=10"]
    cli = run_cli(
        args=["--config", IMAGENET, "--config", str(config), "--trainer.accelerator=cpu", "--trainer.devices=1"]
        + ["--trainer.precision=32-true", "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}", *small],
        run=False,
    )
    strategy = cli.trainer.strategy
    assert type(strategy) is BlockFSDPStrategy
    assert strategy.block_classes == resolve_block_classes(DEFAULT_BLOCK_CLASSES) and issubclass(
        PosBlock, *strategy.block_classes
    )
    assert strategy.activation_checkpointing and strategy.fp32_outside_blocks
    assert strategy.sharding_strategy.name == "FULL_SHARD" and strategy._state_dict_type == state_dict_type
    assert cli.config.trainer.precision == "32-true"  # the flag wins; the config file asks for bf16-mixed
    # the model the config names, built on the meta device: the ViT-L/H architecture
    import timm
    import yaml

    model_config = yaml.safe_load(config.read_text())["model"]
    with torch.device("meta"):
        model = timm.create_model(
            model_config["model_name"], pos_embed="rope_mixed", **model_config.get("model_kwargs", {})
        )
    patch, dim, depth, heads = arch
    assert (model.patch_embed.patch_size[0], model.embed_dim, len(model.blocks), model.blocks[0].attn.num_heads) == arch
    assert all(isinstance(block, PosBlock) for block in model.blocks)


def test_fsdp_config_files_set_the_imagenet_precision():
    import yaml

    for name in ("vit_large", "vit_huge", "vlm"):
        trainer = yaml.safe_load((ROOT / "configs" / "fsdp" / f"{name}.yaml").read_text())["trainer"]
        assert trainer["precision"] == "bf16-mixed"
        assert trainer["strategy"]["class_path"] == "visionpe.training.fsdp.BlockFSDPStrategy"
        resolve_block_classes(trainer["strategy"]["init_args"]["block_classes"])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"block_classes": []}, ValueError, "block_classes must name at least one module class"),
        ({"block_classes": "timm.models.vision_transformer.Block"}, TypeError, "block_classes must be a list"),
        ({"block_classes": ["Block"]}, ValueError, "must be dotted names"),
        ({"block_classes": ["timm.nope.Block"]}, ValueError, "cannot import 'timm.nope'"),
        ({"block_classes": ["timm.models.vision_transformer.Nope"]}, ValueError, "has no attribute 'Nope'"),
        ({"block_classes": ["torch.Tensor"]}, ValueError, "must be a torch.nn.Module subclass"),
        ({"block_classes": [3]}, TypeError, "a dotted class name or a class"),
        ({"activation_checkpointing": "yes"}, TypeError, "activation_checkpointing must be a bool"),
        ({"sharding_strategy": "ZERO3"}, ValueError, "sharding_strategy must be one of"),
        ({"state_dict_type": "local"}, ValueError, "state_dict_type must be one of"),
        ({"device_mesh": (2,)}, ValueError, "device_mesh must be None or two ints"),
        ({"device_mesh": (0, 8)}, ValueError, "device_mesh sizes must be >= 1"),
        ({"auto_wrap_policy": {PosBlock}}, ValueError, "set by BlockFSDPStrategy"),
    ],
)
def test_strategy_arguments_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        BlockFSDPStrategy(**kwargs)


def test_model_checks_before_wrapping():
    strategy = BlockFSDPStrategy(block_classes=[PosBlock])
    model = _classifier()
    strategy._check_model(model)  # a visionpe ViT: its blocks are PosBlocks, its own checkpointing is off
    model.model.set_grad_checkpointing(True)
    with pytest.raises(ValueError, match="checkpoints its blocks itself .*each block would run three times"):
        strategy._check_model(model)
    BlockFSDPStrategy(block_classes=[PosBlock], activation_checkpointing=False)._check_model(model)
    with pytest.raises(ValueError, match=r"block_classes \['Linear'\] match no module"):
        BlockFSDPStrategy(block_classes=["torch.nn.Linear"])._check_model(torch.nn.Sequential(torch.nn.ReLU()))


class _Dtypes(Callback):
    """The dtypes that the first block and the position schemes compute with, seen inside the first forward."""

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        vit = pl_module.model
        first = next(m for m in vit.blocks[0].modules() if isinstance(m, PosBlock))  # inside its unit and wrapper

        def record(module, args) -> None:
            if not self.seen:
                self.seen = {"schemes " + n: str(t.dtype) for n, t in vit.pos_schemes.named_parameters()}
                self.seen |= {"schemes " + n: str(t.dtype) for n, t in vit.pos_schemes.named_buffers()}
                self.seen |= {"block " + n: str(t.dtype) for n, t in first.named_parameters()}

        first.register_forward_pre_hook(record)  # the unit's parameters are gathered by then


def _gpu_worker(rank: int, world: int, port: int, out: str, fp32_outside_blocks: bool) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0", LOCAL_RANK=str(rank)
    )
    dtypes, losses = _Dtypes(), _Losses()
    strategy = BlockFSDPStrategy(fp32_outside_blocks=fp32_outside_blocks)
    trainer = _trainer(losses, accelerator="gpu", devices=world, strategy=strategy, precision="bf16-mixed")
    trainer.callbacks.append(dtypes)
    model, data = _classifier(), _Data(GLOBAL_BATCH // world)
    trainer.fit(model, datamodule=data)
    trainer.limit_val_batches = 1.0
    (validated,) = trainer.validate(model, datamodule=data, verbose=False)  # the units moved back to the GPU
    if rank == 0:
        seen = {"dtypes": dtypes.seen, "losses": [*losses.losses, validated["val/loss"]]}
        Path(out).write_text(json.dumps(seen))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 FSDP units: Lightning's FSDP autocasts on CUDA only")
@pytest.mark.parametrize("fp32_outside_blocks", [True, False])
def test_bf16_blocks_leave_the_position_schemes_in_fp32_on_gpus(fp32_outside_blocks, tmp_path):
    world = min(torch.cuda.device_count(), 2)
    out = tmp_path / "seen.json"
    mp.spawn(_gpu_worker, args=(world, _free_port(), str(out), fp32_outside_blocks), nprocs=world, join=True)
    seen = json.loads(out.read_text())
    block = {name: dtype for name, dtype in seen["dtypes"].items() if name.startswith("block ")}
    schemes = {name: dtype for name, dtype in seen["dtypes"].items() if name.startswith("schemes ")}
    assert block and set(block.values()) == {"torch.bfloat16"}
    assert any("freqs" in name for name in schemes) and any("slopes" in name for name in schemes)
    assert set(schemes.values()) == {"torch.float32" if fp32_outside_blocks else "torch.bfloat16"}
    assert len(seen["losses"]) == STEPS + 1 and all(math.isfinite(loss) for loss in seen["losses"])
