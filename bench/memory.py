"""Peak forward memory of every registered scheme at 1024x1024 (4096 patches), against the plain ViT.

Usage (from the repository root)::

    python bench/memory.py                     # ViT-S/16, 1024x1024, batch 1, every scheme; writes memory.md/.csv
    python bench/memory.py --schemes irpe lookhere --size 512
    python bench/memory.py --results docs/benchmarks/results   # and the published table

What is measured: each model runs in its own subprocess (so allocator caches and earlier peaks cannot leak
between schemes). The worker builds the model, runs one small warm-up forward, then records its resident set
size (RSS), resets the kernel's peak-RSS counter (``/proc/self/clear_refs``, Linux) and runs one forward under
``torch.inference_mode()``. The reported number is the peak RSS during that forward minus the RSS just before
it: everything the forward allocates (activations, attention biases, bucket maps, temporary buffers), not the
parameters or the Python/torch baseline, which are the same for every scheme. The reference is timm's
``vit_small_patch16_224`` (fused attention) at the same size in the same run; the ratio is scheme / timm.

The table printed is also written to ``<--out>/memory.md`` and ``memory.csv`` (default ``runs/bench/memory``;
``bench/results.py`` puts the date, commit, versions, device and command on the Markdown file's first line), and
copied to ``--results DIR`` when given: the published table is ``--results docs/benchmarks/results``. ``--update``
reads the previous table from ``--results`` when given, else from ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.results import add_output_arguments, copy_results, output_error, write_results  # noqa: E402

REFERENCE = "timm"


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def worker(scheme: str, size: int, batch: int, model_size: str, threads: int, attn_backend: str = "sdpa") -> dict:
    """Measure one model; returns {"scheme", "growth_mb", "seconds"}.

    ``attn_backend="flex"`` runs visionpe's bias schemes through FlexAttention
    (:func:`visionpe.set_attention_backend`); its kernel is compiled for the measured shape by a warm-up forward at
    that size, so the measured forward holds neither compilation nor its memory."""
    import timm
    import torch

    import visionpe  # registers the visionpe models

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if scheme == REFERENCE:
        model = timm.create_model(f"vit_{model_size}_patch16_224", dynamic_img_size=True)
    else:
        model = timm.create_model(f"visionpe_vit_{model_size}_patch16_224", pos_embed=scheme, dynamic_img_size=True)
    model.eval()
    if attn_backend != "sdpa":
        visionpe.set_attention_backend(model, attn_backend)
    images = torch.randn(batch, 3, size, size)
    with torch.inference_mode():
        # load kernels and lazily built state outside the measurement (and compile FlexAttention for this shape)
        model(torch.randn(1, 3, 64, 64) if attn_backend == "sdpa" else images)
        before = _status_mb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (peak RSS) to the current RSS
        start = time.perf_counter()
        out = model(images)
        seconds = time.perf_counter() - start
        peak = _status_mb("VmHWM")
    if not torch.isfinite(out).all():
        raise RuntimeError(f"{scheme}: non-finite output")
    return {"scheme": scheme, "growth_mb": peak - before, "seconds": seconds}


def previous_rows(out: Path, schemes: list[str] | None) -> tuple[dict[str, list], str]:
    """The rows of ``out/memory.csv`` other than timm's and ``schemes``', by scheme, and the first line of
    ``out/memory.md`` (when and how they were measured), for ``--update``."""
    csv_path, md_path = out / "memory.csv", out / "memory.md"
    if not csv_path.is_file() or not md_path.is_file():
        sys.exit(f"--update needs a previous memory.csv and memory.md in {out}")
    with open(csv_path, newline="") as f:
        table = list(csv.reader(f))
    skip = {REFERENCE, *(schemes or [])}
    rows = {r[0]: [r[0], *(float(v) if v else None for v in r[1:4]), r[4]] for r in table[1:] if r[0] not in skip}
    return rows, md_path.read_text().splitlines()[0].removeprefix("Measured ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels (1024 -> 4096 patches)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--model", default="small", choices=("tiny", "small", "base", "large"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--schemes", nargs="*", help="scheme names (default: visionpe.list_schemes())")
    parser.add_argument("--target", type=float, default=1.5, help="ratio to flag as exceeded")
    add_output_arguments(parser, "memory", "memory.md and .csv")
    parser.add_argument(
        "--update",
        action="store_true",
        help="measure --schemes (and timm) again and keep the other rows of memory.csv in --results (when given, "
        "else --out) from its last run",
    )
    parser.add_argument(
        "--attn-backend",
        default="sdpa",
        choices=("sdpa", "flex"),
        help="attention of the bias schemes (visionpe.set_attention_backend); flex: see bench/fused_bias.py",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    error = output_error(args.out, args.results)
    if error:
        parser.error(error)
    for name in ("size", "batch", "threads"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    if args.size % 16:
        parser.error(f"--size must be a multiple of the patch size 16, got {args.size}")
    if not os.access("/proc/self/clear_refs", os.W_OK):
        sys.exit("this benchmark needs Linux /proc/self/clear_refs to reset the peak-RSS counter")

    if args.worker:
        print(json.dumps(worker(args.worker, args.size, args.batch, args.model, args.threads, args.attn_backend)))
        return
    kept = previous_rows(Path(args.results or args.out), args.schemes) if args.update else ({}, "")
    if args.update and not args.schemes:
        parser.error("--update re-measures the schemes named by --schemes; name at least one")

    if args.schemes:
        schemes = args.schemes
    else:
        import visionpe

        schemes = visionpe.list_schemes()
    results = {}
    for scheme in [REFERENCE, *schemes]:
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            scheme,
            "--size",
            str(args.size),
            "--batch",
            str(args.batch),
            "--model",
            args.model,
            "--threads",
            str(args.threads),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            results[scheme] = {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
        else:
            results[scheme] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"  measured {scheme}", file=sys.stderr, flush=True)

    tokens = (args.size // 16) ** 2
    ref = results[REFERENCE].get("growth_mb")
    setting = (
        f"Forward peak memory, ViT-{args.model[0].upper()}/16 at {args.size}x{args.size} ({tokens} patches), "
        f"batch {args.batch}, inference mode, CPU (peak RSS growth during the forward)"
    )
    print(f"\n{setting}\n")
    print("| scheme | peak MB | ratio vs timm | forward s |\n|---|---:|---:|---:|")
    rows = []
    rows_by_scheme = dict(kept[0])
    for scheme, res in results.items():
        if "error" in res:
            print(f"| {scheme} | error: {res['error']} | | |")
            rows_by_scheme[scheme] = [scheme, None, None, None, f"error: {res['error']}"]
            continue
        ratio = res["growth_mb"] / ref if ref else float("nan")
        flag = "" if scheme == REFERENCE or ratio <= args.target else f" (> {args.target}x)"
        print(f"| {scheme} | {res['growth_mb']:.0f} | {ratio:.2f}{flag} | {res['seconds']:.1f} |")
        rows_by_scheme[scheme] = [scheme, res["growth_mb"], ratio, res["seconds"], flag.strip(" ()")]
    rows = [rows_by_scheme[REFERENCE]] + [rows_by_scheme[s] for s in sorted(rows_by_scheme) if s != REFERENCE]
    notes = (
        f"{setting}, {args.threads} thread(s); each model in its own process; ratio = scheme / timm "
        f"vit_{args.model}_patch16_224, noted when above the {args.target}x target."
    )
    if args.update:
        notes += (
            f" Rows measured by this command: timm, {', '.join(args.schemes)}; the other rows (ratios against that "
            f"run's timm) are from the previous table: {kept[1]}"
        )
    columns = ["scheme", "peak MB", "ratio vs timm", "forward s", "note"]
    formats = {"peak MB": ".0f", "ratio vs timm": ".2f", "forward s": ".1f"}
    paths = write_results("memory", rows, columns, out_dir=args.out, notes=notes, formats=formats)
    if args.results is not None:
        paths += tuple(copy_results(paths, args.results))
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
