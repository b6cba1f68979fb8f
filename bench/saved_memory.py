"""Memory a training forward keeps for the backward, per scheme, against timm's plain ViT.

Usage (from the repository root)::

    python bench/saved_memory.py                       # ViT-S/16, 224, batch 8, every scheme; writes saved_memory.*
    python bench/saved_memory.py --schemes liere string_cayley --batch 16
    python bench/saved_memory.py --results docs/benchmarks/results   # and the published table

What is measured: the bytes of every distinct storage that autograd saves during one training forward (a
``torch.autograd.graph.saved_tensors_hooks`` pack hook sees each saved tensor; storages shared by several saved
tensors, e.g. q, k and v cut from one qkv projection, count once). That is the activation memory held from the
forward until the backward: it decides the peak of a training step, and on CPU with glibc's default allocator,
how much memory the step hands back to the OS and touches afresh (page faults) every step. It does not depend on
timing, so unlike ``bench/throughput.py`` it is exact and repeatable. Weights that layers save for their own
backward count too (about 88 MB for ViT-S, alike for every model); a weight made for the forward, such as
STRING's P W_q, counts as the new memory it is. The reference is timm's
``vit_small_patch16_224``; the ratio is scheme / timm, and the extra MB per block is (scheme - timm) / depth.

The table printed is also written to ``<--out>/saved_memory.md`` and ``saved_memory.csv`` (default
``runs/bench/saved_memory``; ``bench/results.py`` puts the date, commit, versions, device and command on the
Markdown file's first line), and copied to ``--results DIR`` when given: the published table is ``--results
docs/benchmarks/results``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import visionpe  # noqa: E402  (registers the visionpe models)
from bench.results import add_output_arguments, copy_results, output_error, write_results  # noqa: E402

REFERENCE = "timm vit_small_patch16_224"


def saved_bytes(model: torch.nn.Module, images: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves in one forward of ``model`` on ``images``."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(images)
    del out
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", nargs="*", default=None, help="scheme names (default: every scheme)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    add_output_arguments(parser, "saved_memory", "saved_memory.md and .csv")
    args = parser.parse_args()
    error = output_error(args.out, args.results)
    if error:
        parser.error(error)
    if args.batch < 1 or args.size < 16:
        raise ValueError(f"--batch must be >= 1 and --size >= 16, got {args.batch}, {args.size}")
    schemes = args.schemes or visionpe.list_schemes()
    torch.manual_seed(0)
    images = torch.randn(args.batch, 3, args.size, args.size)
    reference = timm.create_model("vit_small_patch16_224", img_size=args.size)
    base = saved_bytes(reference, images)
    depth = len(reference.blocks)
    setting = f"batch {args.batch}, {args.size}px, training forward (fp32)"
    print(f"torch {torch.__version__}, {setting}")
    print("| model | saved for backward, MB | ratio to timm | extra MB per block |")
    print("|---|---:|---:|---:|")
    print(f"| {REFERENCE} | {base / 2**20:.0f} | 1.00 | 0.0 |")
    rows = [[REFERENCE, base / 2**20, 1.0, 0.0]]
    for scheme in schemes:
        model = timm.create_model("visionpe_vit_small_patch16_224", pos_embed=[scheme], img_size=args.size)
        size = saved_bytes(model, images)
        extra = (size - base) / 2**20 / depth
        print(f"| {scheme} | {size / 2**20:.0f} | {size / base:.2f} | {extra:.1f} |", flush=True)
        rows.append([scheme, size / 2**20, size / base, extra])
    columns = ["model", "saved for backward, MB", "ratio to timm", "extra MB per block"]
    formats = dict(zip(columns[1:], (".0f", ".2f", ".1f"), strict=True))
    notes = (
        f"ViT-S/16, {setting}: bytes of the distinct storages autograd saves for the backward; "
        f"extra MB per block = (model - timm) / {depth} blocks."
    )
    paths = write_results("saved_memory", rows, columns, out_dir=args.out, notes=notes, formats=formats)
    if args.results is not None:
        paths += tuple(copy_results(paths, args.results))
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
