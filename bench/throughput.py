"""Training throughput of every registered position scheme against timm's plain ViT, in one run.

ViT-S/16 at 224, batch 8, forward + backward on CPU (by default). Each model is timed in interleaved
rounds (every model once per round) and the median step time is reported, so that slow drift of a shared
machine hits all models alike. Ratios are against ``timm.create_model("vit_small_patch16_224")`` measured
in the same run; timm's own RoPE ViTs (Eva) are printed as reference rows.

    .venv/bin/python bench/throughput.py                  # all schemes; writes runs/bench/throughput/throughput.*
    .venv/bin/python bench/throughput.py --results docs/benchmarks/results  # and the published table
    .venv/bin/python bench/throughput.py --schemes rope_axial rope_mixed --rounds 5
    .venv/bin/python bench/throughput.py --malloc retain  # glibc keeps freed memory: no page faults per step
    .venv/bin/python bench/throughput.py --patch-drop 0.5  # every model, the baseline too, with timm's patch dropout
    .venv/bin/python bench/throughput.py --schemes string_cayley --depth  # and STRING on RGB-D (depth_coords)
    .venv/bin/python bench/throughput.py --rove           # and RoPE rotating the values too (rotate_values=True)
    .venv/bin/python bench/throughput.py --schemes alibi2d --flex  # and bias schemes on FlexAttention (GPU rows)
    .venv/bin/python bench/throughput.py --schemes rope_axial --fused-rotary rope_axial  # and RoPE's compiled kernel
    .venv/bin/python bench/throughput.py --schemes learned_factorized --update --results docs/benchmarks/results
    .venv/bin/python bench/throughput.py --inference --size 512 --schemes alibi2d lookhere  # forward passes only
    python3 bench/throughput.py --device cuda --precision bf16 --batch 128 --steps 5 --profile  # on a GPU

``--malloc retain`` (Linux, glibc) sets M_MMAP_THRESHOLD to its 32 MB maximum and M_TRIM_THRESHOLD beyond any
heap before the models are built, for every model of the run alike. With the default allocator, freed memory at
the top of the heap goes back to the OS and the next step touches fresh pages again; how often depends on the
order of allocations of the whole process (each scheme's intermediates, and the other models of the run), and on
a virtual machine a page fault costs several microseconds. The retained heap takes that out and times the
arithmetic and memory traffic alone (as jemalloc or tcmalloc, which PyTorch's CPU tuning guide recommends, do).

``--fused-rotary`` rows run the rotary schemes named with ``set_rotary_backend(model, "fused")``: the model eager,
q and k rotated by one kernel compiled with ``torch.compile`` (compiled during the warm-up steps, at least one).

``--inference`` times forward passes instead (models in eval mode, ``torch.inference_mode``): what evaluating at
large sizes costs, where bias schemes compute their bias in chunks of query rows (``PosAttention``).

The table printed is also written to ``<--out>/throughput.md`` and ``throughput.csv`` (``throughput_inference.*``
with ``--inference``; ``--out`` defaults to ``runs/bench/throughput``; ``bench/results.py``: the date, commit,
versions, device and command on the first line of the Markdown file), and copied to ``--results DIR`` when given:
the published table is ``--results docs/benchmarks/results``. ``--update`` (one row more, the others kept) reads
the previous table from ``--results`` when given, else from ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import ctypes.util
import inspect
import statistics
import sys
import time
from pathlib import Path

import timm
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import visionpe  # noqa: E402
from bench.results import add_output_arguments, copy_results, output_error, write_results  # noqa: E402

REFERENCES = ["vit_small_patch16_rope_224", "vit_small_patch16_rope_mixed_224"]
COMBOS = [["learned", "rope_mixed"]]
ROVE = ["rope_axial", "rope_mixed"]  # rows with --rove


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's largest mmap threshold on 64-bit


def retain_heap() -> None:
    """Make glibc keep freed memory in the heap (no trimming, mmap only above 32 MB) for the rest of the run."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        raise SystemExit("--malloc retain needs glibc's mallopt (Linux); use --malloc default")
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)):
        raise SystemExit("mallopt refused the retained-heap settings")


def step_time(
    model: torch.nn.Module,
    images: torch.Tensor,
    precision: str = "fp32",
    steps: int = 1,
    inference: bool = False,
    **inputs: torch.Tensor,
) -> float:
    """Seconds per forward + backward (``inference``: per forward under ``torch.inference_mode``), the mean of
    ``steps`` steps (CUDA synchronised before and after)."""
    device = images.device.type
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        with (
            torch.inference_mode(inference),
            torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"),
        ):
            out = model(images, **inputs)
        if not inference:
            out.float().square().mean().backward()
            model.zero_grad(set_to_none=True)
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def profile_step(
    model: torch.nn.Module,
    images: torch.Tensor,
    precision: str = "fp32",
    steps: int = 2,
    inference: bool = False,
    **inputs: torch.Tensor,
) -> tuple[float, float]:
    """(kernels launched, device milliseconds) per step (training, or ``inference``: a forward), from
    ``torch.profiler`` over ``steps`` steps.

    On CUDA: CUDA kernels and their GPU time, so that time the GPU sits idle waiting for the CPU to launch kernels
    shows as the gap to the measured step time. On CPU: aten operator calls (nested calls included) and their self
    CPU time.
    """
    cuda = images.device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        step_time(model, images, precision, steps, inference, **inputs)
    if cuda:
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.self_device_time_total for e in events)
    else:
        events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
        busy = sum(e.self_cpu_time_total for e in events)
    return sum(e.count for e in events) / steps, busy / steps / 1e3


def fusable_rotary_schemes() -> list[str]:
    """Registered rotary schemes whose default configuration rotates q and k by cos/sin tables, the rotations that
    ``set_rotary_backend(model, "fused")`` compiles into one kernel."""
    from visionpe.interfaces.fused_rotary import rotation_tables

    names = []
    for name in visionpe.list_schemes("rotary"):
        takes_grid = "grid_size" in inspect.signature(visionpe.registry.get_scheme_class(name)).parameters
        scheme = visionpe.create_pos_embed(name, dim=32, num_heads=2, **({"grid_size": (2, 3)} if takes_grid else {}))
        state = scheme.prepare(scheme.coords((2, 3)), 1, grid_size=(2, 3))
        if rotation_tables(state.layer(0).without_basis()) is not None:
            names.append(name)
    return names


def previous_rows(out: Path, name: str = "throughput") -> tuple[list[list], str]:
    """The rows of ``out/<name>.csv`` (model, images/s, ratio) and the first line of ``out/<name>.md`` (when and how
    they were measured), for ``--update``; exits when either file is missing or has profile columns."""
    csv_path, md_path = out / f"{name}.csv", out / f"{name}.md"
    if not csv_path.is_file() or not md_path.is_file():
        sys.exit(f"--update needs a previous {name}.csv and {name}.md in {out}")
    with open(csv_path, newline="") as f:
        table = list(csv.reader(f))
    if len(table[0]) != 3:
        sys.exit(f"--update keeps tables of model, images/s and ratio only; {csv_path} has columns {table[0]}")
    rows = [[r[0], float(r[1]), float(r[2])] for r in table[1:]]
    return rows, md_path.read_text().splitlines()[0].removeprefix("Measured ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", nargs="*", default=None, help="scheme names (default: all + combos)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for a GPU run (e.g. --batch 128 --steps 5)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast")
    parser.add_argument("--steps", type=int, default=1, help="steps per timed measurement (mean)")
    parser.add_argument(
        "--profile", action="store_true", help="also kernels (CPU: aten ops) and device ms per step, torch.profiler"
    )
    parser.add_argument("--malloc", choices=["default", "retain"], default="default", help="see the module notes")
    parser.add_argument("--patch-drop", type=float, default=0.0, help="timm's patch_drop_rate for every model")
    parser.add_argument(
        "--depth", action="store_true", help="also STRING with depth_coords=True, called with a random depth map"
    )
    parser.add_argument(
        "--rove", action="store_true", help="also rope_axial and rope_mixed rotating the values (rotate_values=True)"
    )
    parser.add_argument(
        "--flex",
        nargs="*",
        default=None,
        help="also these bias schemes (none named: every one with per-offset terms) on FlexAttention "
        "(set_attention_backend(model, 'flex'); on a CPU training keeps the dense path, so these rows matter on a GPU)",
    )
    parser.add_argument(
        "--fused-rotary",
        nargs="*",
        default=None,
        help="also these rotary schemes (none named: every one with cos/sin tables) with q and k rotated by one "
        "compiled kernel (set_rotary_backend(model, 'fused'); rows '<scheme> (fused)', compiled in the warm-up)",
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="re-measure only --schemes (and the baseline) and keep the other rows of the previous table in "
        "--results (when given, else --out), each with its ratio against its own run's baseline",
    )
    parser.add_argument(
        "--inference",
        action="store_true",
        help="time forward passes of models in eval mode under torch.inference_mode instead of training steps "
        "(writes throughput_inference.md and .csv)",
    )
    add_output_arguments(parser, "throughput", "throughput.md and .csv (throughput_inference.* with --inference)")
    args = parser.parse_args()
    error = output_error(args.out, args.results)
    if error:
        parser.error(error)
    results_name = "throughput_inference" if args.inference else "throughput"
    if not 0 <= args.patch_drop < 1:
        parser.error(f"--patch-drop must be in [0, 1), got {args.patch_drop}")
    if args.update and (not args.schemes or args.profile):
        parser.error("--update re-measures the schemes named by --schemes (at least one), without --profile")
    previous = previous_rows(Path(args.results or args.out), results_name) if args.update else None
    if args.malloc == "retain":
        retain_heap()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    schemes = [[s] for s in args.schemes] if args.schemes else [[s] for s in visionpe.list_schemes()] + COMBOS
    drop = {"patch_drop_rate": args.patch_drop} if args.patch_drop else {}
    baseline = timm.create_model("vit_small_patch16_224", img_size=args.size, **drop)
    models = {"timm vit_small_patch16_224 (baseline)": baseline}
    for ref in () if args.update else REFERENCES:  # --update keeps the references of the previous table
        models[f"timm {ref} (reference)"] = timm.create_model(ref, img_size=args.size, **drop)
    for names in schemes:
        label = "+".join(names)
        models[label] = timm.create_model("visionpe_vit_small_patch16_224", pos_embed=names, img_size=args.size, **drop)
    images = torch.randn(args.batch, 3, args.size, args.size, device=args.device)
    inputs: dict[str, dict[str, torch.Tensor]] = {}  # extra forward arguments per model
    if args.depth:
        for name in ("string_cayley", "string_circulant"):
            label = f"{name} (RGB-D, depth_coords)"
            models[label] = timm.create_model(
                "visionpe_vit_small_patch16_224",
                pos_embed=name,
                pos_embed_kwargs={"depth_coords": True},
                img_size=args.size,
                **drop,
            )
            inputs[label] = {"depth": torch.rand(args.batch, 1, args.size, args.size, device=args.device) * 5}
    if args.rove:
        for name in ROVE:
            models[f"{name} (RoVE, rotate_values)"] = timm.create_model(
                "visionpe_vit_small_patch16_224",
                pos_embed=name,
                pos_embed_kwargs={"rotate_values": True},
                img_size=args.size,
                **drop,
            )

    def add_switched(option: str, given: list[str], candidates: list[str], what: str, tag: str, switch) -> list[str]:
        """Rows '<scheme> (<tag>)': the schemes ``given`` (none: every candidate) with ``switch(model)`` applied."""
        unknown = sorted(set(given) - set(candidates))
        if unknown:
            parser.error(f"{option} takes {what} ({', '.join(candidates)}), got {unknown}")
        labels = []
        for name in given or candidates:
            model = timm.create_model("visionpe_vit_small_patch16_224", pos_embed=name, img_size=args.size, **drop)
            labels.append(f"{name} ({tag})")
            models[labels[-1]] = switch(model)
        return labels

    if args.flex is not None:
        from bench.fused_bias import fusable_schemes

        add_switched(
            "--flex",
            args.flex,
            fusable_schemes(),
            "bias schemes with per-offset terms",
            "flex",
            lambda model: visionpe.set_attention_backend(model, "flex"),
        )
    compiled = set()  # rows whose first step compiles: warmed up at least once, so that no round times it
    if args.fused_rotary is not None:
        compiled.update(
            add_switched(
                "--fused-rotary",
                args.fused_rotary,
                fusable_rotary_schemes(),
                "rotary schemes with cos/sin tables",
                "fused",
                lambda model: visionpe.set_rotary_backend(model, "fused"),
            )
        )
    for label, model in models.items():
        model.to(args.device).train(not args.inference)
        for _ in range(max(args.warmup, label in compiled)):
            step_time(model, images, args.precision, 1, args.inference, **inputs.get(label, {}))

    times: dict[str, list[float]] = {label: [] for label in models}
    for _ in range(args.rounds):
        for label, model in models.items():
            extra = inputs.get(label, {})
            times[label].append(step_time(model, images, args.precision, args.steps, args.inference, **extra))

    base = statistics.median(next(iter(times.values())))
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{torch.get_num_threads()} threads"
    passes = "forward (inference)" if args.inference else "fwd+bwd"
    settings = (
        f"{args.precision}, batch {args.batch}, {args.size}px, {passes}, median of {args.rounds} interleaved rounds "
        f"of {args.steps} step(s), {args.malloc} malloc, patch dropout {args.patch_drop}"
    )
    print(f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {where}, {settings}")
    unit = "kernels" if args.device.startswith("cuda") else "aten ops"
    extra = f" {unit} per step | device ms per step |" if args.profile else ""
    print(f"| model | images/s | ratio to timm ViT-S |{extra}")
    print("|---|---|---|" + ("---|---|" if args.profile else ""))
    rows = []
    for label, ts in times.items():
        t = statistics.median(ts)
        rows.append([label, args.batch / t, base / t])
        row = f"| {label} | {args.batch / t:.1f} | {base / t:.3f}x |"
        if args.profile:
            extra = inputs.get(label, {})
            count, busy = profile_step(models[label], images, args.precision, 2, args.inference, **extra)
            rows[-1] += [count, busy]
            row += f" {count:.0f} | {busy:.1f} |"
        print(row, flush=True)
    if previous is not None:
        measured = {row[0] for row in rows}
        rows += [row for row in previous[0] if row[0] not in measured]
    columns = ["model", "images/s", "ratio to timm ViT-S"]
    columns += [f"{unit} per step", "device ms per step"] if args.profile else []
    formats = {"images/s": ".1f", "ratio to timm ViT-S": ".3f", f"{unit} per step": ".0f", "device ms per step": ".1f"}
    threads = "" if args.device.startswith("cuda") else f", {torch.get_num_threads()} threads"
    step = "inference forward (eval mode)" if args.inference else "training step"
    notes = f"ViT-S/16 {step}, {settings}{threads}; ratio = images/s of the model / images/s of the baseline."
    if previous is not None:
        measured_rows = ", ".join(list(models)[1:])  # every row of this run but the baseline
        notes += (
            f" Rows measured by this command: the baseline and {measured_rows}; the other "
            f"rows (ratios against that run's baseline) are from the previous table: {previous[1]}"
        )
    paths = write_results(
        results_name, rows, columns, out_dir=args.out, notes=notes, device=args.device, formats=formats
    )
    if args.results is not None:
        paths += tuple(copy_results(paths, args.results))
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
