"""Sharded against unsharded ViT: sequence parallelism (``visionpe.parallel``) checked and timed.

For every scheme, mode (Ulysses, ring), layout (contiguous, zig-zag) and causality: a visionpe ViT of ``--depth``
blocks at ``--size`` px and its copy wrapped in :class:`~visionpe.parallel.SequenceParallelViT`, the same weights and
images on every rank; the logits and the gradients (averaged over the ranks, as DDP does) of the sharded model
against the unsharded one (the largest difference relative to the largest value of each tensor), and the time of a
forward + backward of each (median of ``--repeats``). Rank 0 prints a Markdown table; the exit status is 1 when a
difference exceeds ``--tol``.

    .venv/bin/python bench/sequence_parallel.py                                  # CPU, gloo, 2 spawned processes
    torchrun --nproc_per_node=2 bench/sequence_parallel.py --device cuda --backend nccl --size 512 --depth 4

Under ``torchrun`` the processes come from it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``); otherwise the script spawns
``--nproc`` processes itself (CPU only). Prefix tokens + patches must be divisible by the number of processes (twice
it for zig-zag): the class token and a (size / 16)^2 grid, e.g. 1 + 15 tokens at 48 x 80 px.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import visionpe  # noqa: E402, F401  (registers the models)
from visionpe.parallel import SequenceParallelViT, average_gradients  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--schemes", nargs="+", default=["rope_axial", "alibi2d"])
    parser.add_argument("--modes", nargs="+", choices=("ulysses", "ring"), default=["ulysses", "ring"])
    parser.add_argument("--layouts", nargs="+", choices=("contiguous", "zigzag"), default=["contiguous", "zigzag"])
    parser.add_argument("--size", type=int, nargs=2, default=(48, 80), metavar=("H", "W"), help="image size in px")
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tol", type=float, default=1e-4, help="largest relative difference accepted")
    parser.add_argument("--nproc", type=int, default=2, help="processes to spawn without torchrun (CPU)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and args.backend != "nccl":
        parser.error("--device cuda needs --backend nccl")
    if args.device == "cpu" and args.backend != "gloo":
        parser.error("--device cpu needs --backend gloo")
    return args


def timed(step) -> tuple[float, object]:
    """Seconds of ``step()`` (synchronised on a GPU) and its result."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| over max |expected| (fp32 rounding of large gradients, e.g. the class token's)."""
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()


def run_case(args, device, scheme: str, mode: str, layout: str, causal: bool) -> dict:
    torch.manual_seed(0)
    kwargs = dict(img_size=tuple(args.size), embed_dim=args.dim, depth=args.depth, num_heads=args.heads)
    reference = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=scheme, num_classes=10, **kwargs)
    reference = reference.to(device)
    sharded = SequenceParallelViT(copy.deepcopy(reference), mode=mode, layout=layout)
    images = torch.randn(args.batch, 3, *args.size, generator=torch.Generator().manual_seed(1)).to(device)

    def step(model):
        model.zero_grad()
        out = model(images, is_causal=causal)
        out.square().mean().backward()
        return out.detach()

    times = {"unsharded": [], "sharded": []}
    for _ in range(args.repeats):
        seconds, expected = timed(lambda: step(reference))
        times["unsharded"].append(seconds)
        seconds, out = timed(lambda: step(sharded))
        times["sharded"].append(seconds)
    average_gradients(sharded)
    parameters = zip(reference.parameters(), sharded.model.parameters(), strict=True)
    pairs = [(out, expected)] + [(q.grad, p.grad) for p, q in parameters]
    error = max(relative_error(a, b) for a, b in pairs)
    return {
        "case": f"{scheme} {mode} {layout} {'causal' if causal else 'full'}",
        "max rel err": error,
        "unsharded ms": 1e3 * statistics.median(times["unsharded"]),
        "sharded ms": 1e3 * statistics.median(times["sharded"]),
    }


def main(args: argparse.Namespace) -> int:
    rank = dist.get_rank()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    rows = [
        run_case(args, device, scheme, mode, layout, causal)
        for scheme in args.schemes
        for mode in args.modes
        for layout in args.layouts
        for causal in (False, True)
    ]
    failed = [r for r in rows if not r["max rel err"] <= args.tol]
    if rank == 0:
        tokens = 1 + (args.size[0] // 16) * (args.size[1] // 16)
        print(f"{dist.get_world_size()} ranks ({args.backend}, {device.type}), {tokens} tokens, batch {args.batch}")
        print("| case | max rel err | unsharded ms | sharded ms |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['case']} | {r['max rel err']:.2e} | {r['unsharded ms']:.1f} | {r['sharded ms']:.1f} |")
        print("ok" if not failed else f"FAILED beyond --tol {args.tol}: {[r['case'] for r in failed]}")
    return 1 if failed else 0


def _spawned(rank: int, args: argparse.Namespace, port: int, world: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        status = main(args)
    finally:
        dist.destroy_process_group()
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    arguments = parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        dist.init_process_group(arguments.backend)
        code = main(arguments)
        dist.destroy_process_group()
        sys.exit(code)
    if arguments.device != "cpu":
        sys.exit("without torchrun the script spawns CPU processes only: use torchrun for --device cuda")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    try:
        mp.spawn(_spawned, args=(arguments, free, arguments.nproc), nprocs=arguments.nproc, join=True)
    except mp.ProcessRaisedException as error:
        sys.exit(str(error))
    except mp.ProcessExitedException:
        sys.exit(1)
