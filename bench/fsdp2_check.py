"""FSDP2 check (visionpe.training.fsdp.shard_model), run by torchrun: a ViT with a rotary scheme with learned
frequencies and a bias scheme, built on the meta device, sharded over the processes and materialised from the
one-process model's state dict, trains a few steps to the same weights as one process on the whole batch (full
precision); under a bf16 ``MixedPrecisionPolicy`` the blocks compute in bf16 while the position schemes' parameters
and the rotary tables given to the blocks stay fp32. Exits 1 when a check fails.

    torchrun --nproc_per_node 2 bench/fsdp2_check.py            # two GPUs (NCCL); --nproc_per_node 1 on one
    torchrun --nproc_per_node 2 bench/fsdp2_check.py --device cpu   # gloo, the pipeline check of a dry run
"""

from __future__ import annotations

import argparse
import os
import sys

import timm
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import visionpe  # noqa: F401 (registers the visionpe_vit_* models)
from visionpe.training.fsdp import materialize_model, shard_model


def _build(args: argparse.Namespace) -> nn.Module:
    return timm.create_model(
        "visionpe_vit_tiny_patch16_224",
        pos_embed=["rope_mixed", "alibi2d"],
        img_size=args.size,
        patch_size=16,
        embed_dim=args.dim,
        depth=args.depth,
        num_heads=args.heads,
        num_classes=10,
    )


def _train(model: nn.Module, batches, device) -> list[float]:
    optimizer, losses = torch.optim.AdamW(model.parameters(), lr=1e-3), []
    for images, targets in batches:
        loss = nn.functional.cross_entropy(model(images.to(device)), targets.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="global batch, split over the processes")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.batch % world:
        parser.error(f"--batch must be divisible by the number of processes ({world}), got {args.batch}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda needs a GPU; use --device cpu for the gloo pipeline check")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    mesh = init_device_mesh(device.type, (world,))
    failures: list[str] = []
    try:
        g = torch.Generator().manual_seed(1)
        batches = [
            (
                torch.randn(args.batch, 3, args.size, args.size, generator=g),
                torch.randint(0, 10, (args.batch,), generator=g),
            )
            for _ in range(args.steps)
        ]
        torch.manual_seed(0)
        reference = _build(args).to(device)
        initial = {k: v.clone() for k, v in reference.state_dict().items()}
        ref_losses = _train(reference, batches, device)
        n = args.batch // world
        local = [(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]) for x, y in batches]

        # full precision: the sharded run equals the one-process run
        with torch.device("meta"):
            model = _build(args)
        shard_model(model, mesh=mesh)
        materialize_model(model, device, initial)
        losses = _train(model, local, device)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        worst = max(float((full[k].float() - v.float()).abs().max()) for k, v in reference.state_dict().items())
        gathered = [None] * world
        dist.all_gather_object(gathered, losses)
        mean = [sum(r[i] for r in gathered) / world for i in range(args.steps)]
        loss_gap = max(abs(a - b) for a, b in zip(mean, ref_losses, strict=True))
        print(f"rank {rank}: fp32 sharded vs one process: max weight difference {worst:.2e}, loss gap {loss_gap:.2e}")
        if worst > args.tolerance or loss_gap > args.tolerance:
            failures.append(f"sharded training differs from one process (weights {worst:.2e}, loss {loss_gap:.2e})")

        # bf16 blocks: the position parameters and rotary tables stay fp32
        with torch.device("meta"):
            model = _build(args)
        shard_model(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
        materialize_model(model, device, initial)
        seen: dict[str, set[str]] = {}

        def look(block, block_args, kwargs):
            ctx = kwargs["pos"]
            tables = [t for s in ctx.rotary for t in vars(s).values() if isinstance(t, torch.Tensor)]
            seen.setdefault("rotary tables", set()).update(str(t.dtype) for t in tables if t.is_floating_point())
            seen.setdefault("rope_mixed freqs", set()).add(str(model.pos_schemes.rope_mixed.freqs.dtype))
            seen.setdefault("alibi2d slopes", set()).add(str(model.pos_schemes.alibi2d.slopes.dtype))
            seen.setdefault("block qkv weight", set()).add(str(block.attn.qkv.weight.dtype))

        for block in model.blocks:
            block.register_forward_pre_hook(look, with_kwargs=True)
        bf16_losses = _train(model, local, device)
        print(f"rank {rank}: bf16 blocks: { ({k: sorted(v) for k, v in seen.items()}) }, losses {bf16_losses}")
        expected = {
            "rotary tables": {"torch.float32"},
            "rope_mixed freqs": {"torch.float32"},
            "alibi2d slopes": {"torch.float32"},
            "block qkv weight": {"torch.bfloat16"},
        }
        if seen != expected:
            failures.append(f"bf16 policy: dtypes {seen}, expected {expected}")
        if not all(torch.isfinite(torch.tensor(bf16_losses))):
            failures.append(f"bf16 policy: non-finite losses {bf16_losses}")
    finally:
        dist.destroy_process_group()
    for failure in failures:
        print(f"rank {rank}: FAILED: {failure}", file=sys.stderr)
    if not failures:
        print(f"rank {rank}: FSDP2 checks passed on {world} {device.type} process(es)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
