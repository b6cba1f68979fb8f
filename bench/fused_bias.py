"""Bias schemes on FlexAttention against the dense SDPA path: peak memory and time of one inference forward.

Usage (from the repository root)::

    python bench/fused_bias.py                        # ViT-S/16 at 1024x1024, batch 1; writes fused_bias.md/.csv
    python bench/fused_bias.py --size 512 --schemes alibi2d irpe
    python bench/fused_bias.py --results docs/benchmarks/results   # and the published table

Every bias scheme that gives its bias per grid offset (``fused_bias``) runs twice, each time in its own subprocess
(``bench/memory.py``'s worker): with the default dense path, where the bias of each block is built as a
(B, heads, N, N) tensor (in query chunks at large N), and with ``visionpe.set_attention_backend(model, "flex")``,
where FlexAttention adds it inside the kernel from a table of (2H - 1)(2W - 1) values. A warm-up forward at the
measured size compiles the kernel first (tens of seconds on a CPU, once per shape). Reported: the peak RSS growth
during the measured forward (as ``bench/memory.py``), its wall time, and flex / dense ratios, with timm's
``vit_small_patch16_224`` as the reference row. On the CPU FlexAttention serves inference only (it has no CPU
backward), so training keeps the dense path there; on a GPU run ``--device cuda`` of ``bench/throughput.py`` with
the backend set for training speed.

The table is written to ``<--out>/fused_bias.md`` and ``.csv`` (default ``runs/bench/fused_bias``; ``bench/results.py``)
and copied to ``--results DIR`` when given: the published table is ``--results docs/benchmarks/results``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.results import add_output_arguments, copy_results, output_error, write_results  # noqa: E402

MEMORY = Path(__file__).resolve().parent / "memory.py"


def fusable_schemes() -> list[str]:
    """Registered bias schemes whose default configuration gives per-offset terms."""
    import torch

    import visionpe

    names = []
    for name in visionpe.list_schemes("bias"):
        takes_grid = "grid_size" in inspect.signature(visionpe.registry.get_scheme_class(name)).parameters
        options = {"grid_size": (2, 3)} if takes_grid else {}
        scheme = visionpe.create_pos_embed(name, dim=32, num_heads=2, **options).eval()
        if scheme.augments_qk or scheme.needs_tokens:
            continue
        q = torch.zeros(1, 2, 7, 16)
        if scheme.fused_bias(q, q, scheme.prepare((2, 3), 1), 0) is not None:
            names.append(name)
    return names


def measure(scheme: str, backend: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(MEMORY), "--worker", scheme, "--size", str(args.size), "--batch", str(args.batch)]
    cmd += ["--model", args.model, "--threads", str(args.threads), "--attn-backend", backend]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        lines = proc.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels (1024 -> 4096 patches)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--model", default="small", choices=("tiny", "small", "base", "large"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--schemes", nargs="*", help="bias schemes (default: every one with per-offset terms)")
    add_output_arguments(parser, "fused_bias", "fused_bias.md and .csv")
    args = parser.parse_args()
    error = output_error(args.out, args.results)
    if error:
        parser.error(error)
    for name in ("size", "batch", "threads"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    if args.size % 16:
        parser.error(f"--size must be a multiple of the patch size 16, got {args.size}")
    fusable = fusable_schemes()
    schemes = args.schemes or fusable
    bad = [s for s in schemes if s not in fusable]
    if bad:
        parser.error(f"--schemes: {bad} give no per-offset terms; schemes that do: {fusable}")

    reference = measure("timm", "sdpa", args)
    rows = [
        ["timm vit_small (reference)", reference.get("growth_mb"), None, None, reference.get("seconds"), None, None]
    ]
    print(f"  timm: {reference}", file=sys.stderr, flush=True)
    for scheme in schemes:
        dense, flex = measure(scheme, "sdpa", args), measure(scheme, "flex", args)
        print(f"  {scheme}: dense {dense}, flex {flex}", file=sys.stderr, flush=True)
        if "error" in dense or "error" in flex:
            rows.append([scheme, None, None, None, None, None, f"error: {dense.get('error') or flex.get('error')}"])
            continue
        rows.append(
            [
                scheme,
                dense["growth_mb"],
                flex["growth_mb"],
                flex["growth_mb"] / dense["growth_mb"],
                dense["seconds"],
                flex["seconds"],
                flex["seconds"] / dense["seconds"],
            ]
        )
    columns = ["scheme", "dense MB", "flex MB", "memory flex/dense", "dense s", "flex s", "time flex/dense"]
    tokens = (args.size // 16) ** 2
    notes = (
        f"One inference forward of ViT-{args.model[0].upper()}/16 at {args.size}x{args.size} ({tokens} patches), "
        f"batch {args.batch}, CPU, {args.threads} thread(s), each model in its own process; MB: peak RSS growth during "
        "the forward; dense: the default SDPA path (bias built per block, in query chunks at large N); flex: "
        "FlexAttention with the bias read per grid offset, compiled by a warm-up forward at the same size."
    )
    formats = {c: ".0f" for c in ("dense MB", "flex MB")}
    formats.update({c: ".2f" for c in ("memory flex/dense", "time flex/dense")})
    formats.update({c: ".1f" for c in ("dense s", "flex s")})
    paths = write_results("fused_bias", rows, columns, out_dir=args.out, notes=notes, formats=formats)
    if args.results is not None:
        paths += tuple(copy_results(paths, args.results))
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
