"""FSDP2 (visionpe.training.fsdp.shard_model, materialize_model): models built on the meta device, sharded over two
gloo processes on the CPU, materialised from the one-process model's state dict and trained a few steps equal the
same training in one process; a bf16 policy keeps the position schemes' parameters and tables in fp32.

Every model is tiny (depth 2, width 32 or 48, a 2 x 3 grid); the two processes are spawned once for every case."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import timm
import torch
import torch.multiprocessing as mp
from torch import nn

from visionpe.attention import PosBlock
from visionpe.camera import Cameras, look_at
from visionpe.training.fsdp import materialize_model, shard_model, shard_units

pytestmark = pytest.mark.skipif(
    sys.platform == "win32" or not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)

IMAGE = (16, 24)  # a 2 x 3 grid of 8-pixel patches: not square
TINY = dict(img_size=IMAGE, patch_size=8, embed_dim=32, depth=2, num_heads=2)
STEPS, BATCH = 3, 4  # global batch; each of the 2 processes takes half
try:
    import open_clip  # noqa: F401

    HAS_OPEN_CLIP = True
except ImportError:
    HAS_OPEN_CLIP = False


def _cameras(batch: int, views: int = 2) -> Cameras:
    g = torch.Generator().manual_seed(3)
    eyes = torch.randn(batch, views, 3, generator=g)
    eyes = 3 * eyes / eyes.norm(dim=-1, keepdim=True)
    k = torch.tensor([[16.0, 0, IMAGE[1] / 2], [0, 16.0, IMAGE[0] / 2], [0, 0, 1]]).expand(batch, views, 3, 3)
    return Cameras(look_at(eyes, torch.zeros(batch, views, 3)), k, IMAGE)


def _tower(**kwargs) -> nn.Module:
    from visionpe.integrations.open_clip import register_visionpe_tower

    name = "visionpe_fsdp2_test_tower"
    if name not in timm.list_models(name):
        register_visionpe_tower(
            name, pos_embed="rope_mixed", img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=2
        )
    return timm.create_model(name, **kwargs)


# name: (build, inputs(batch) -> (args, targets), optimizer, the position parameter that must be in the root unit)
CASES = {
    # a rotary scheme with learned frequencies and the learned absolute table
    "vit_rope_mixed_learned": (
        lambda: timm.create_model(
            "visionpe_vit_tiny_patch16_224", pos_embed=["learned", "rope_mixed"], num_classes=3, **TINY
        ),
        lambda g, n: ((torch.randn(n, 3, *IMAGE, generator=g),), torch.randint(0, 3, (n,), generator=g)),
        "adamw",
        "pos_schemes.rope_mixed.freqs",
    ),
    # a bias scheme with per-layer learned MLPs and thresholds, with SGD
    "vit_fire": (
        lambda: timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="fire", num_classes=3, **TINY),
        lambda g, n: ((torch.randn(n, 3, *IMAGE, generator=g),), torch.randint(0, 3, (n,), generator=g)),
        "sgd",
        "pos_schemes.fire.threshold",
    ),
    "video_vit_rope_mixed": (
        lambda: timm.create_model(
            "visionpe_video_vit_tiny_tubelet2x16", pos_embed="rope_mixed", num_frames=4, num_classes=3, **TINY
        ),
        lambda g, n: ((torch.randn(n, 3, 4, *IMAGE, generator=g),), torch.randint(0, 3, (n,), generator=g)),
        "adamw",
        "pos_schemes.rope_mixed.freqs",
    ),
    "multiview_vit_gta_rope_mixed": (
        lambda: timm.create_model(
            "visionpe_mvvit_tiny_patch16", camera_embed="gta", pos_embed="rope_mixed", num_classes=3, **TINY
        ),
        lambda g, n: (
            (torch.randn(n, 2, 3, *IMAGE, generator=g), _cameras(n)),
            torch.randint(0, 3, (n,), generator=g),
        ),
        "adamw",
        "pos_schemes.rope_mixed.freqs",
    ),
}
if HAS_OPEN_CLIP:
    CASES["open_clip_tower_rope_mixed"] = (
        lambda: _tower(num_classes=3),
        lambda g, n: ((torch.randn(n, 3, 16, 16, generator=g),), torch.randint(0, 3, (n,), generator=g)),
        "adamw",
        "pos_schemes.rope_mixed.freqs",
    )


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05)


def _train(model: nn.Module, kind: str, batches) -> list[float]:
    optimizer, losses = _optimizer(kind, model.parameters()), []
    for args, targets in batches:
        loss = nn.functional.cross_entropy(model(*args), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def _shard_args(args: tuple, rank: int, world: int) -> tuple:
    def part(x):
        if isinstance(x, Cameras):
            return Cameras(*(part(t) for t in (x.w2c, x.intrinsics)), x.image_size)
        n = x.shape[0] // world
        return x[rank * n : (rank + 1) * n]

    return tuple(part(a) for a in args)


def _root_fqns(model: nn.Module) -> set[str]:
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(model, FSDPModule)
    group = model._get_fsdp_state()._fsdp_param_group
    return {p._param_fqn for p in group.fsdp_params}


def _worker(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    # a file rendezvous in the test's own folder: no port to race for with tests running beside it
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    report: dict = {}
    try:
        for name, (build, inputs, kind, position_param) in CASES.items():
            torch.manual_seed(0)
            reference = build()
            g = torch.Generator().manual_seed(1)
            batches = [inputs(g, BATCH) for _ in range(STEPS)]
            ref_losses = _train(reference, kind, batches)  # one process, the whole batch

            torch.manual_seed(0)
            with torch.device("meta"):
                model = build()
            shard_model(model, mesh=mesh)
            torch.manual_seed(0)
            initial = build().state_dict()  # the one-process model before training
            materialize_model(model, "cpu", initial)
            local = [(_shard_args(a, rank, world), _shard_args((t,), rank, world)[0]) for a, t in batches]
            losses = _train(model, kind, local)
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            expected = reference.state_dict()
            worst = max(float((full[k].float() - v.float()).abs().max()) for k, v in expected.items())
            report[name] = {
                "keys_equal": sorted(full) == sorted(expected),
                "max_diff": worst,
                "losses": losses,
                "ref_losses": ref_losses,
                "position_param_in_root": position_param in _root_fqns(model),
                "position_param_sharded": isinstance(model.get_parameter(position_param), DTensor),
                "units": shard_units(model),
            }

        # bf16 blocks: the position schemes' parameters and the context given to the blocks stay fp32
        torch.manual_seed(0)
        with torch.device("meta"):
            model = timm.create_model(
                "visionpe_vit_tiny_patch16_224", pos_embed=["rope_mixed", "alibi2d"], num_classes=3, **TINY
            )
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        shard_model(model, mesh=mesh, mp_policy=policy)
        torch.manual_seed(0)
        reference = timm.create_model(
            "visionpe_vit_tiny_patch16_224", pos_embed=["rope_mixed", "alibi2d"], num_classes=3, **TINY
        )
        materialize_model(model, "cpu", reference.state_dict())
        seen: dict = {}

        def look(block, args, kwargs):
            ctx = kwargs["pos"]
            tables = [t for state in ctx.rotary for t in vars(state).values() if isinstance(t, torch.Tensor)]
            seen.setdefault("tables", set()).update(str(t.dtype) for t in tables if t.is_floating_point())
            seen.setdefault("freqs", set()).add(str(model.pos_schemes.rope_mixed.freqs.dtype))
            seen.setdefault("slopes", set()).add(str(model.pos_schemes.alibi2d.slopes.dtype))
            seen.setdefault("qkv", set()).add(str(block.attn.qkv.weight.dtype))
            seen.setdefault("tokens", set()).add(str(args[0].dtype))

        handles = [blk.register_forward_pre_hook(look, with_kwargs=True) for blk in model.blocks]
        x = torch.randn(2, 3, *IMAGE, generator=torch.Generator().manual_seed(2))
        logits = model(x)
        logits.sum().backward()
        for h in handles:
            h.remove()
        grads = {n: str(p.grad.dtype) for n, p in model.named_parameters() if p.grad is not None}
        report["bf16"] = {
            **{k: sorted(v) for k, v in seen.items()},
            "out_dtype": str(logits.dtype),
            "grad_dtypes": sorted(set(grads.values())),
            "freqs_param_dtype": str(model.pos_schemes.rope_mixed.freqs.dtype),
            "close_to_fp32": float((logits - reference(x)).detach().abs().max()),
        }
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()


def test_two_sharded_processes_from_meta_match_one_process(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name in CASES:
        for report in ranks:
            case = report[name]
            assert case["keys_equal"], name
            assert case["max_diff"] < 1e-5, (name, case["max_diff"])
            # each process's half-batch loss; their mean is the one-process loss of the whole batch
            assert case["position_param_in_root"] and case["position_param_sharded"], name
            assert case["units"] == ["blocks.0", "blocks.1"], name
        for step in range(STEPS):
            mean = sum(r[name]["losses"][step] for r in ranks) / 2
            assert mean == pytest.approx(ranks[0][name]["ref_losses"][step], abs=1e-5), (name, step)
    for report in ranks:
        bf16 = report["bf16"]
        assert bf16["tables"] == ["torch.float32"]  # the rotary context reaches the blocks uncast
        assert bf16["freqs"] == ["torch.float32"] and bf16["freqs_param_dtype"] == "torch.float32"
        assert bf16["slopes"] == ["torch.float32"]
        assert bf16["qkv"] == ["torch.bfloat16"] and bf16["tokens"] == ["torch.bfloat16"]  # the policy applies
        assert bf16["out_dtype"] == "torch.float32" and bf16["grad_dtypes"] == ["torch.float32"]
        assert bf16["close_to_fp32"] < 0.1  # bf16 blocks: the fp32 model's output to bf16 precision


def test_shard_units_are_the_blocks_of_each_model():
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="rope_mixed", **TINY)
    assert shard_units(model) == ["blocks.0", "blocks.1"]
    assert shard_units(model, [PosBlock]) == ["blocks.0", "blocks.1"]
    with pytest.raises(ValueError, match="match no module"):
        shard_units(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        shard_units("vit")


def test_shard_and_materialize_check_their_arguments():
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="rope_mixed", **TINY)
    with pytest.raises(TypeError, match="mp_policy"):
        shard_model(model, mp_policy=torch.bfloat16)
    with pytest.raises(TypeError, match="reshard_after_forward"):
        shard_model(model, reshard_after_forward="yes")
    with pytest.raises(ValueError, match="no meta-device tensor"):
        materialize_model(model, "cpu")
    with pytest.raises(ValueError, match="device must be"):
        materialize_model(model, "not-a-device")
    with pytest.raises(TypeError, match="state_dict"):
        materialize_model(model, "cpu", state_dict=[1])


def test_materialize_without_a_state_dict_initialises_every_tensor():
    with torch.device("meta"):
        model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=["learned", "rope_mixed", "fire"], **TINY)
    materialize_model(model, "cpu")
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert not tensor.is_meta and torch.isfinite(tensor).all(), name
    # the schemes' own initialisation, not nn.Linear's default over it: rope_mixed's frequencies are its constructor's
    torch.manual_seed(0)
    fresh = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=["learned", "rope_mixed", "fire"], **TINY)
    torch.testing.assert_close(model.pos_schemes.fire.base_threshold, fresh.pos_schemes.fire.base_threshold)
    assert model.pos_schemes.rope_mixed.freqs.shape == fresh.pos_schemes.rope_mixed.freqs.shape


def test_fsdp2_config_composes_with_the_imagenet_config(tmp_path):
    from lightning.pytorch.strategies import ModelParallelStrategy

    from experiments.cli import run_cli

    root = Path(__file__).resolve().parents[2]
    small = ["--model.model_name=visionpe_vit_tiny_patch16_224", "--model.model_kwargs={}", "--model.num_classes=10"]
    cli = run_cli(
        args=["--config", str(root / "configs" / "imagenet" / "deit_small.yaml")]
        + ["--config", str(root / "configs" / "fsdp2" / "vit.yaml"), "--trainer.accelerator=cpu"]
        + ["--trainer.devices=1", "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}", *small],
        run=False,
    )
    strategy = cli.trainer.strategy
    assert type(strategy) is ModelParallelStrategy
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == ("auto", 1)
    assert strategy._save_distributed_checkpoint and cli.config.trainer.precision == "32-true"
    assert cli.model.hparams.sharded_param_dtype == "bfloat16"
    # the model the module builds is what shard_model shards: its blocks are the units
    assert shard_units(cli.model.model) == [f"blocks.{i}" for i in range(len(cli.model.model.blocks))]


def _fit_classifier(strategy, **module_kwargs):
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from visionpe.training.module import Classifier

    class Images(L.LightningDataModule):
        batch_size = BATCH

        def train_dataloader(self):
            generator = torch.Generator().manual_seed(0)
            images = torch.randn(2 * BATCH, 3, *IMAGE, generator=generator)
            return DataLoader(TensorDataset(images, torch.randint(0, 3, (2 * BATCH,), generator=generator)), BATCH)

    torch.manual_seed(0)
    module = Classifier(
        "visionpe_vit_tiny_patch16_224",
        pos_embed=["learned", "rope_mixed"],
        num_classes=3,
        model_kwargs=TINY,
        mixup=0.0,
        cutmix=0.0,
        warmup_epochs=0.0,
        drop_path_rate=0.0,
        opt="sgd",  # Adam's first steps are about lr * sign(grad): float noise in a near-zero gradient flips them
        base_lr=0.5,
        **module_kwargs,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # one process: the same batches as the run without a strategy
    )
    trainer.fit(module, Images())
    return module


def test_the_classifier_shards_itself_under_lightnings_model_parallel_strategy():
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    sharded = _fit_classifier(ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1))
    assert isinstance(sharded.model, FSDPModule) and all(isinstance(b, FSDPModule) for b in sharded.model.blocks)
    freqs = sharded.model.pos_schemes.rope_mixed.freqs
    assert isinstance(freqs, DTensor) and freqs.dtype == torch.float32
    plain = _fit_classifier("auto")  # the same two updates without sharding
    trained = {name: value.full_tensor() for name, value in sharded.model.state_dict().items()}
    assert trained.keys() == plain.model.state_dict().keys()
    for name, value in plain.model.state_dict().items():
        torch.testing.assert_close(trained[name], value, atol=1e-5, rtol=1e-5, msg=name)
    # bf16 blocks: the run trains, the position parameters stay fp32
    low = _fit_classifier(
        ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), sharded_param_dtype="bfloat16"
    )
    assert low.model.pos_schemes.rope_mixed.freqs.dtype == torch.float32
    assert all(torch.isfinite(p.full_tensor()).all() for p in low.model.parameters())
    # a precision for sharded blocks under a strategy that does not shard is refused, not ignored
    with pytest.raises(ValueError, match="sharded_param_dtype='bfloat16' applies to Lightning's ModelParallelStrategy"):
        _fit_classifier("auto", sharded_param_dtype="bfloat16")
    with pytest.raises(ValueError, match="sharded_param_dtype must be None, 'bfloat16' or 'float16', got 'bf16'"):
        _fit_classifier("auto", sharded_param_dtype="bf16")
