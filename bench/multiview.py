"""Training throughput of the multi-view ViT with each camera scheme, against the same model without one.

A multi-view ViT-S/16 (``visionpe_mvvit_small_patch16``), 2 views at 224 px (2 x 196 tokens), batch 4, forward +
backward on CPU. Every model is timed in interleaved rounds and the median step is reported; the ratio is against the
model without camera encoding (``camera_embed=None``) in the same run. Cameras are random poses looking at the
origin.

    .venv/bin/python bench/multiview.py                      # every camera scheme; writes runs/bench/multiview/
    .venv/bin/python bench/multiview.py --schemes gta cape --rounds 3 --out runs/mv
    .venv/bin/python bench/multiview.py --results docs/benchmarks/results   # and the published table

The table is also written to ``<--out>/multiview_speed.md`` and ``.csv`` (default ``runs/bench/multiview``;
``bench/results.py``) and copied to ``--results DIR`` when given: the published table is ``--results
docs/benchmarks/results``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import timm
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import visionpe  # noqa: E402
from bench.results import add_output_arguments, copy_results, output_error, write_results  # noqa: E402
from bench.throughput import step_time  # noqa: E402
from visionpe.camera import Cameras, look_at  # noqa: E402

BASELINE = "no camera encoding (baseline)"


def scheme_options(name: str, head_dim: int) -> dict:
    """Options a scheme needs at this head size: RayRoPE encodes a multiple of 24 channels per head (48 of ViT-S's
    64; the rest pass unchanged)."""
    return {"encoded_dim": head_dim // 24 * 24} if name == "rayrope" and head_dim % 24 else {}


def random_cameras(batch: int, views: int, size: int, seed: int = 0) -> Cameras:
    """Cameras at distance 3 from the origin in random directions, looking at it, focal length = image size."""
    g = torch.Generator().manual_seed(seed)
    eyes = torch.randn(batch, views, 3, generator=g)
    eyes = 3 * eyes / eyes.norm(dim=-1, keepdim=True)
    k = torch.tensor([[size, 0.0, size / 2], [0.0, size, size / 2], [0.0, 0.0, 1.0]]).expand(batch, views, 3, 3)
    return Cameras(look_at(eyes, torch.zeros(batch, views, 3)), k, (size, size))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", nargs="*", default=None, help="camera schemes (default: all registered)")
    parser.add_argument("--model", default="small", choices=("tiny", "small", "base"))
    parser.add_argument("--views", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    add_output_arguments(parser, "multiview", "multiview_speed.md and .csv")
    args = parser.parse_args()
    error = output_error(args.out, args.results)
    if error:
        parser.error(error)
    known = visionpe.list_schemes("camera")
    schemes = args.schemes if args.schemes is not None else known
    unknown = [s for s in schemes if s not in known]
    if unknown:
        parser.error(f"--schemes must be camera schemes ({', '.join(known)}), got {unknown}")
    for name, value in (("--views", args.views), ("--batch", args.batch), ("--rounds", args.rounds)):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    variant = f"visionpe_mvvit_{args.model}_patch16"
    models = {BASELINE: timm.create_model(variant, img_size=args.size, num_views=args.views)}
    head_dim = models[BASELINE].embed_dim // models[BASELINE].blocks[0].attn.num_heads
    for name in schemes:
        options = scheme_options(name, head_dim)
        label = name + "".join(f", {k}={v}" for k, v in options.items())
        models[label] = timm.create_model(
            variant, camera_embed=name, camera_embed_kwargs=options, img_size=args.size, num_views=args.views
        )
    images = torch.randn(args.batch, args.views, 3, args.size, args.size)
    cameras = random_cameras(args.batch, args.views, args.size)
    for model in models.values():
        model.train()
        for _ in range(args.warmup):
            step_time(model, images, cameras=cameras)
    times: dict[str, list[float]] = {label: [] for label in models}
    for _ in range(args.rounds):
        for label, model in models.items():
            times[label].append(step_time(model, images, cameras=cameras))

    base = statistics.median(times[BASELINE])
    settings = (
        f"multi-view ViT-{args.model[0].upper()}/16, {args.views} views at {args.size}px, batch {args.batch}, fp32, "
        f"fwd+bwd, median of {args.rounds} interleaved rounds, {torch.get_num_threads()} threads"
    )
    print(f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {settings}")
    rows = []
    for label, ts in times.items():
        t = statistics.median(ts)
        rows.append([label, args.batch / t, base / t])
        print(f"| {label} | {args.batch / t:.2f} samples/s | {base / t:.3f}x |", flush=True)
    notes = f"{settings}; ratio = samples/s of the model / samples/s of the same model without camera encoding."
    paths = write_results(
        "multiview_speed",
        rows,
        ["model", "samples/s", "ratio to no camera"],
        out_dir=args.out,
        notes=notes,
        formats={"samples/s": ".2f", "ratio to no camera": ".3f"},
    )
    if args.results is not None:
        paths += tuple(copy_results(paths, args.results))
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
