"""Training throughput of every registered position scheme against timm's plain ViT, in one run.

ViT-S/16 at 224, batch 8, forward + backward on CPU (by default). Each model is timed in interleaved
rounds (every model once per round) and the median step time is reported, so that slow drift of a shared
machine hits all models alike. Ratios are against ``timm.create_model("vit_small_patch16_224")`` measured
in the same run; timm's own RoPE ViTs (Eva) are printed as reference rows.

    .venv/bin/python bench/throughput.py                  # all schemes
    .venv/bin/python bench/throughput.py --schemes rope_axial rope_mixed --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch

import visionpe

REFERENCES = ["vit_small_patch16_rope_224", "vit_small_patch16_rope_mixed_224"]
COMBOS = [["learned", "rope_mixed"]]


def step_time(model: torch.nn.Module, images: torch.Tensor) -> float:
    start = time.perf_counter()
    model(images).float().square().mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", nargs="*", default=None, help="scheme names (default: all + combos)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    schemes = [[s] for s in args.schemes] if args.schemes else [[s] for s in visionpe.list_schemes()] + COMBOS
    models = {"timm vit_small_patch16_224 (baseline)": timm.create_model("vit_small_patch16_224")}
    for ref in REFERENCES:
        models[f"timm {ref} (reference)"] = timm.create_model(ref, img_size=args.size)
    for names in schemes:
        label = "+".join(names)
        models[label] = timm.create_model("visionpe_vit_small_patch16_224", pos_embed=names, img_size=args.size)
    images = torch.randn(args.batch, 3, args.size, args.size)
    for model in models.values():
        model.train()
        for _ in range(args.warmup):
            step_time(model, images)

    times: dict[str, list[float]] = {label: [] for label in models}
    for _ in range(args.rounds):
        for label, model in models.items():
            times[label].append(step_time(model, images))

    base = statistics.median(next(iter(times.values())))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, {args.size}px, "
        f"fwd+bwd, median of {args.rounds} interleaved rounds"
    )
    print("| model | images/s | ratio to timm ViT-S |")
    print("|---|---|---|")
    for label, ts in times.items():
        t = statistics.median(ts)
        print(f"| {label} | {args.batch / t:.1f} | {base / t:.3f}x |")


if __name__ == "__main__":
    main()
