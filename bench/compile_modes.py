"""Whole-model compilation with CUDA graphs and max-autotune, for every scheme (``bench/gpu_smoke.sh --part compile``).

The CPU test suite checks that every scheme's model traces as one graph (``tests/reliability/test_compile.py``).
This script checks what only a GPU shows: that the compiled model runs under ``torch.compile`` modes that capture
CUDA graphs (``reduce-overhead``) or autotune the kernels (``max-autotune``), trains, and agrees with eager. For every
scheme: a ViT of ``--depth`` blocks (ViT-S width) at ``--size`` px, batch ``--batch``, bf16 autocast, SGD; the
compiled model's first-step logits against the eager model's (same weights, same batch), then ``--steps`` more
training steps. Reported per scheme and mode: graphs and graph breaks (dynamo's counters), CUDA-graph skips
(inductor's reasons, e.g. a CPU tensor or a dynamic shape), compile time, the logits' relative error and whether
every loss stayed finite.

    .venv/bin/python bench/compile_modes.py                              # on cuda: every scheme, both modes
    .venv/bin/python bench/compile_modes.py --device cpu --modes default --schemes rope_axial --size 32 --depth 1

Writes ``<--out>/compile_modes.md`` and ``.csv`` (default ``runs/bench/compile_modes``; ``bench/results.py``), and
copies them to ``--results DIR`` when given; exits with status 1 when a scheme fails (an exception, a graph break, a
CUDA-graph skip under ``reduce-overhead``, non-finite losses or logits beyond ``--tol``), after every row is written.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import timm
import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import visionpe  # noqa: E402
from bench.results import add_output_arguments, copy_results, output_error, table_cells, write_results  # noqa: E402

MODES = ("reduce-overhead", "max-autotune", "default")
COLUMNS = ["scheme", "mode", "result", "graphs", "graph breaks", "cudagraph skips", "compile s", "logits rel err"]


def check(name: str, mode: str, device: str, size: int, depth: int, batch: int, steps: int, tol: float) -> dict:
    """One scheme under one compile mode: a row of the table (``result`` "ok" or why it failed)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = timm.create_model("visionpe_vit_small_patch16_224", pos_embed=name, img_size=size, depth=depth)
    model = model.to(device).train()
    images = torch.randn(batch, 3, size, size, device=device)
    labels = torch.randint(0, model.num_classes, (batch,), device=device)
    row = {"scheme": name, "mode": mode}
    with torch.autocast(device, dtype=torch.bfloat16), torch.no_grad():
        reference = model(images).float()
    compiled = torch.compile(model, mode=mode, dynamic=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    finite = True
    try:
        start = time.perf_counter()
        for step in range(1 + steps):
            with torch.autocast(device, dtype=torch.bfloat16):
                logits = compiled(images)
                loss = torch.nn.functional.cross_entropy(logits.float(), labels)
            if step == 0:
                row["logits rel err"] = float(
                    (logits.detach().float() - reference).abs().max() / reference.abs().max().clamp_min(1e-6)
                )
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            finite &= bool(torch.isfinite(loss))
            if step == 0:
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                row["compile s"] = time.perf_counter() - start
    except Exception as err:  # reported as the row's result; the other schemes still run
        row["result"] = f"FAILED: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
        return row
    row["graphs"] = counters["stats"]["unique_graphs"]
    row["graph breaks"] = sum(counters["graph_break"].values())
    row["cudagraph skips"] = counters["inductor"]["cudagraph_skips"]
    problems = []
    if row["graph breaks"]:
        problems.append(f"graph breaks: {'; '.join(list(counters['graph_break'])[:2])[:160]}")
    if mode == "reduce-overhead" and device.startswith("cuda") and row["cudagraph skips"]:
        problems.append("CUDA graphs skipped")
    if not finite:
        problems.append("non-finite loss")
    if row["logits rel err"] > tol:
        problems.append(f"logits {row['logits rel err']:.1e} from eager")
    row["result"] = "FAILED: " + ", ".join(problems) if problems else "ok"
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--schemes", nargs="*", default=None, help="default: every registered scheme")
    parser.add_argument("--modes", nargs="+", default=["reduce-overhead", "max-autotune"], choices=MODES)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--depth", type=int, default=2, help="ViT-S blocks (compile time grows with depth)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="training steps after the compiled first one")
    parser.add_argument("--tol", type=float, default=0.05, help="largest relative error of the logits against eager")
    add_output_arguments(parser, "compile_modes", "compile_modes.md and .csv")
    args = parser.parse_args(argv)
    error = output_error(args.out, args.results)
    if error:
        parser.error(error)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device; pass --device cpu --modes default for a dry run")
    schemes = args.schemes or visionpe.list_schemes()
    unknown = sorted(set(schemes) - set(visionpe.list_schemes()))
    if unknown:
        parser.error(f"--schemes: unknown {unknown}; registered: {visionpe.list_schemes()}")
    notes = (
        f"torch.compile(model, mode=...) of a {args.depth}-block ViT-S at {args.size} px, batch {args.batch}, bf16 "
        f"autocast, SGD, on {args.device}; first compiled step against eager (same weights and batch), then "
        f"{args.steps} training steps. graphs / graph breaks: dynamo's counters; cudagraph skips: inductor's; "
        f"compile s: the first step, compilation included; accepted within {args.tol} relative error."
    )
    formats = {"compile s": ".1f", "logits rel err": ".1e"}
    rows = []
    print("| " + " | ".join(COLUMNS) + " |\n" + "|---" * len(COLUMNS) + "|")
    for mode in args.modes:
        for name in schemes:
            row = check(name, mode, args.device, args.size, args.depth, args.batch, args.steps, args.tol)
            rows.append(row)
            print("| " + " | ".join(table_cells([row], COLUMNS, formats)[0]) + " |", flush=True)
            # rewritten after every row: a run cut short by its time limit keeps what it measured
            paths = write_results(
                "compile_modes", rows, COLUMNS, out_dir=args.out, notes=notes, device=args.device, formats=formats
            )
            if args.results is not None:
                paths += tuple(copy_results(paths, args.results))
    print("wrote " + ", ".join(str(p) for p in paths))
    raise SystemExit(0 if all(r["result"] == "ok" for r in rows) else 1)


if __name__ == "__main__":
    main()
