"""Speed of ``visionpe.multimodal.get_position_ids``: against transformers' ``Qwen2VLModel.get_rope_index``, and
batched against a per-sample loop for every registered design.

Batches, on CPU:

- ``fixed``: 16 left-padded sequences of about 1000 tokens with 3 images each (merged grids of 6x8 to 12x14 tokens);
- ``mixed-<seed>``: 16 sequences with 0 to 3 images each (pre-merge h and w even in 16..46, merge 2, so 8x8 to
  23x23 merged tokens) and text runs before, between and after them (32 to 512 text tokens per sample); even
  samples are left-padded, odd ones right-padded, so the padded length follows the longest sample.

Table 1 (``multimodal_ids``): visionpe's ``get_position_ids("mrope", ...)`` against transformers' ``get_rope_index``
on every batch. Both must first return identical ids and deltas (visionpe with transformers 5.x's conventions:
``continuation="spatial_extent"``, pads 0). Each round times a block of back-to-back calls per function, alternating
the functions so that drift of a shared machine hits both alike; per-call process CPU time and wall time, minimum
and median over the rounds. The ``mixed, overall`` row sums the minimum per-call times over the mixed batches.

Table 2 (``multimodal_ids_designs``): for every registered design (``list_multimodal_schemes()``, with the options it
needs, ``DESIGN_OPTIONS``), the batched call against a Python loop of the same call on each sample alone (its own
valid tokens, its own grids and per-sample options), over all the batches above. The loop's ids must equal the
batched ids at each sample's valid tokens and its deltas the batched deltas before anything is timed.

    .venv/bin/python bench/multimodal_ids.py --results docs/benchmarks/results   # the published tables
    .venv/bin/python bench/multimodal_ids.py --quick   # small batches, one round: a smoke test in a few seconds

The tables printed are also written to ``<--out>/multimodal_ids.md`` and ``multimodal_ids_designs.md`` with their
``.csv`` (default ``runs/bench/multimodal_ids``; ``bench/results.py``: the date, commit, versions, device and
command on the first line of each Markdown file), and copied to ``--results DIR`` when given: the published tables
are ``--results docs/benchmarks/results``. ``--quick`` checks the pipeline and measures nothing: it says so in one
line and takes no ``--results``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import Qwen2VLConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.results import (  # noqa: E402
    add_output_arguments,
    copy_results,
    output_error,
    print_quick_notice,
    write_results,
)
from visionpe.integrations.hf import VLMPositionCollator  # noqa: E402
from visionpe.multimodal import get_position_ids, list_multimodal_schemes  # noqa: E402

FUNCTIONS = {
    "transformers": "Qwen2VLModel.get_rope_index",
    "visionpe": "visionpe.multimodal.get_position_ids",
}
ID_COLUMNS = [
    "batch",
    "B x L",
    "valid tokens",
    "images",
    "transformers cpu min ms",
    "visionpe cpu min ms",
    "speed-up cpu min",
    "speed-up cpu median",
    "speed-up wall min",
]
DESIGN_COLUMNS = [
    "design",
    "options",
    "batched cpu min ms",
    "loop cpu min ms",
    "speed-up cpu min",
    "lowest batch speed-up",
    "speed-up cpu median",
    "loop ids vs batched",
]
COLLATOR_COLUMNS = [
    "batch",
    "design",
    "collator cpu min ms per sample",
    "in-forward ids cpu min ms per sample",
    "collator / in-forward",
]
# table 3: a plain design and one with per-layer ids and a mask inside visual blocks (28 decoder layers)
COLLATOR_DESIGNS = {"mrope": {"continuation": "spatial_extent"}, "pype": {"interval": 2}}
SEPARATORS = (869, 13)  # BiPE's sentence separators (Llama "." and "\n")


class Batch:
    """A padded batch and, per sample, how many of ``grids``' rows are its images (in order); with text ids (a
    separator about every 12 tokens, for BiPE) and cluster ids at the visual tokens (16 per image, for PPE)."""

    def __init__(
        self, name: str, types: torch.Tensor, mask: torch.Tensor, grids: torch.Tensor, images_per_sample: list[int]
    ) -> None:
        self.name, self.types, self.mask, self.grids = name, types, mask, grids
        self.images_per_sample = images_per_sample
        gen = torch.Generator().manual_seed(len(name) + int(mask.sum()))
        ids = torch.randint(100, 32000, types.shape, generator=gen)
        ids[torch.rand(types.shape, generator=gen) < 1 / 12] = SEPARATORS[0]
        self.input_ids = ids.masked_fill(types != 0, 0)
        self.clusters = torch.randint(0, 16, types.shape, generator=gen).masked_fill(types == 0, 0)

    def sample(self, b: int) -> tuple[torch.Tensor, torch.Tensor, slice]:
        """Sample ``b`` alone: its valid token types (1, n), their flat positions in the batch row, its grid rows."""
        keep = self.mask[b].bool()
        first = sum(self.images_per_sample[:b])
        return self.types[b, keep][None], keep, slice(first, first + self.images_per_sample[b])


def _pad(rows: list[list[int]], sides: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    types = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, (row, side) in enumerate(zip(rows, sides, strict=True)):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        types[b, span] = torch.tensor(row, dtype=torch.long)
        mask[b, span] = 1
    return types, mask


def _interleave(text: int, grids: list[tuple[int, int, int]], gen: torch.Generator, merge: int = 2) -> list[int]:
    """Token types of ``text`` text tokens cut into len(grids) + 1 runs (the inner ones non-empty) around the images."""
    cuts = sorted(torch.randperm(text - 1, generator=gen)[: len(grids)].add(1).tolist())
    bounds = [0, *cuts, text]
    row = []
    for k in range(len(grids) + 1):
        row += [0] * (bounds[k + 1] - bounds[k])
        if k < len(grids):
            t, h, w = grids[k]
            row += [1] * (t * (h // merge) * (w // merge))
    return row


def make_batch(batch: int, tokens: int, images: int, seed: int = 0) -> Batch:
    """The fixed batch: ``images`` images per sample, about ``tokens`` tokens each, left padded."""
    gen = torch.Generator().manual_seed(seed)
    rows, grids = [], []
    for _ in range(batch):
        length = tokens - int(torch.randint(0, tokens // 5, (1,), generator=gen))
        sample_grids = [
            (1, 2 * int(torch.randint(6, 13, (1,), generator=gen)), 2 * int(torch.randint(8, 15, (1,), generator=gen)))
            for _ in range(images)
        ]
        visual = sum(t * h * w // 4 for t, h, w in sample_grids)
        rows.append(_interleave(max(length - visual, images + 1), sample_grids, gen))
        grids += sample_grids
    types, mask = _pad(rows, ["left"] * batch)
    return Batch("fixed", types, mask, torch.tensor(grids, dtype=torch.long).view(-1, 3), [images] * batch)


def make_mixed_batch(
    batch: int, seed: int, max_images: int = 3, side: tuple[int, int] = (16, 46), text: tuple[int, int] = (32, 512)
) -> Batch:
    """A mixed batch: 0..max_images images per sample, pre-merge h and w even in ``side``, ``text`` text tokens per
    sample in runs around them; even samples left-padded, odd ones right-padded."""
    gen = torch.Generator().manual_seed(1000 + seed)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    rows, grids, counts = [], [], []
    for _ in range(batch):
        sample_grids = [
            (1, 2 * randint(side[0] // 2, side[1] // 2), 2 * randint(side[0] // 2, side[1] // 2))
            for _ in range(randint(0, max_images))
        ]
        rows.append(_interleave(max(randint(*text), len(sample_grids) + 1), sample_grids, gen))
        grids += sample_grids
        counts.append(len(sample_grids))
    types, mask = _pad(rows, ["left" if b % 2 == 0 else "right" for b in range(batch)])
    return Batch(f"mixed-{seed}", types, mask, torch.tensor(grids, dtype=torch.long).view(-1, 3), counts)


def transformers_rope_index(merge: int = 2):
    """``Qwen2VLModel.get_rope_index`` on a stand-in for the model: it only reads the config."""
    fake = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge)))
    fake.get_vision_position_ids = lambda *a, **k: Qwen2VLModel.get_vision_position_ids(fake, *a, **k)
    return lambda *a, **k: Qwen2VLModel.get_rope_index(fake, *a, **k)


# Options of each design in table 2: per batch (a function of the Batch) and the same for sample b alone. Designs
# not listed run with their defaults.
DESIGN_OPTIONS: dict[str, tuple[str, Callable[[Batch], dict], Callable[[Batch, int], dict]]] = {
    "pype": ("interval=2, layer=6", lambda x: {"interval": 2, "layer": 6}, lambda x, b: {"interval": 2, "layer": 6}),
    "ppe": (
        "clusters (16 per image), num_representatives=4",
        lambda x: {"clusters": x.clusters, "num_representatives": 4},
        lambda x, b: {"clusters": x.clusters[b, x.mask[b].bool()][None], "num_representatives": 4},
    ),
    "rope_dhr": (
        "tile_grid (1, 1) per image",
        lambda x: {"tile_grid": torch.ones(len(x.grids), 2, dtype=torch.long)},
        lambda x, b: {"tile_grid": torch.ones(x.images_per_sample[b], 2, dtype=torch.long)},
    ),
    "bipe": (
        "input_ids (separators about every 12 tokens)",
        lambda x: {"input_ids": x.input_ids},
        lambda x, b: {"input_ids": x.input_ids[b, x.mask[b].bool()][None]},
    ),
}


def time_blocks(functions: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, tuple[float, ...]]:
    """Per function (wall min, wall median, cpu min, cpu median) of one call, in seconds: ``rounds`` rounds, each
    timing a block of ``calls`` back-to-back calls of every function in turn."""
    wall = {name: [] for name in functions}
    cpu = {name: [] for name in functions}
    for _ in range(rounds):
        for name, fn in functions.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(calls):
                fn()
            wall[name].append((time.perf_counter() - start) / calls)
            cpu[name].append((time.process_time() - start_cpu) / calls)
    return {
        name: (min(wall[name]), statistics.median(wall[name]), min(cpu[name]), statistics.median(cpu[name]))
        for name in functions
    }


def compare_with_transformers(batch: Batch, rounds: int, calls: int) -> dict[str, tuple[float, ...]]:
    reference = transformers_rope_index()
    input_ids = batch.types.clone()  # get_rope_index only reads its shape, device and dtype
    types, mask, grids = batch.types, batch.mask, batch.grids

    def ours():
        return get_position_ids(
            "mrope", types, grids, None, mask, continuation="spatial_extent", pad_value=0, delta_convention="valid"
        )

    def theirs():
        return reference(input_ids, types, grids, None, attention_mask=mask)

    ref_pos, ref_delta = theirs()
    pos, delta = ours()
    if not (torch.equal(pos, ref_pos) and torch.equal(delta, ref_delta)):
        raise SystemExit(f"visionpe and transformers disagree on batch {batch.name}; not timing")
    return time_blocks({"transformers": theirs, "visionpe": ours}, rounds, calls)


def compare_with_loop(scheme: str, batch: Batch, rounds: int, calls: int) -> dict[str, tuple[float, ...]]:
    _, batch_options, sample_options = DESIGN_OPTIONS.get(scheme, ("", lambda x: {}, lambda x, b: {}))
    types, mask, grids = batch.types, batch.mask, batch.grids
    options = batch_options(batch)
    samples = []
    for b in range(types.shape[0]):
        sample_types, keep, rows = batch.sample(b)
        samples.append((sample_types, grids[rows], keep, sample_options(batch, b)))

    def batched():
        return get_position_ids(scheme, types, grids, None, mask, **options)

    def loop():
        return [get_position_ids(scheme, t, g, None, None, **o) for t, g, _, o in samples]

    pos, delta = batched()
    largest = 0.0
    for b, ((sample_pos, sample_delta), (_, _, keep, _)) in enumerate(zip(loop(), samples, strict=True)):
        pair = ((sample_pos[:, 0], pos[:, b, keep]), (sample_delta[0], delta[b]))
        if all(torch.equal(x, y) for x, y in pair):
            continue
        # Fractional designs (Circle-RoPE's trigonometry) may round differently in the last bit: torch's vectorised
        # float64 kernels and their scalar tail loop can differ by an ulp, and which elements fall in the tail
        # depends on the batch. Anything beyond that is a disagreement.
        close = pos.is_floating_point() and all(
            x.shape == y.shape and torch.allclose(x, y, rtol=1e-13, atol=1e-12) for x, y in pair
        )
        if not close:
            raise SystemExit(f"{scheme}: sample {b} of batch {batch.name} alone differs from the batch; not timing")
        largest = max(largest, *(float((x - y).abs().max()) for x, y in pair if x.numel()))
    return time_blocks({"batched": batched, "loop": loop}, rounds, calls) | {"largest difference": largest}


def compare_collator(scheme: str, batch: Batch, rounds: int, calls: int) -> dict[str, tuple[float, ...]]:
    """``VLMPositionCollator`` on the batch's samples (padding and every position input, as a DataLoader worker
    runs it) against the same positions built from the padded batch, which is what the patched model's forward
    builds when the batch comes without them. Both must give every sample the same ids at its valid tokens."""
    config = Qwen2VLConfig(text_config={"num_hidden_layers": 28})
    collator = VLMPositionCollator(scheme, config, "Qwen2VLModel", **COLLATOR_DESIGNS[scheme])
    features = []
    for b in range(batch.types.shape[0]):
        types, keep, rows = batch.sample(b)
        feature = {"input_ids": batch.input_ids[b, keep], "mm_token_type_ids": types[0]}
        if batch.images_per_sample[b]:
            feature["image_grid_thw"] = batch.grids[rows]
        features.append(feature)
    padded = {"input_ids": batch.input_ids, "attention_mask": batch.mask, "mm_token_type_ids": batch.types}
    padded["image_grid_thw"] = batch.grids

    def in_forward():
        return collator(dict(padded))

    def in_loader():
        return collator(features)

    ours, reference = in_loader(), in_forward()
    valid = ours["attention_mask"].bool()
    for b in range(batch.types.shape[0]):
        if not torch.equal(ours["position_ids"][:, b, valid[b]], reference["position_ids"][:, b, batch.mask[b].bool()]):
            raise SystemExit(f"{scheme}: the collator's ids of sample {b} of batch {batch.name} differ; not timing")
    return time_blocks({"collator": in_loader, "in-forward": in_forward}, rounds, calls)


def describe(batch: Batch) -> list:
    lengths = batch.mask.sum(1)
    counts = batch.images_per_sample
    images = f"{min(counts)}-{max(counts)} per sample, {len(batch.grids)} in all"
    return [f"{batch.types.shape[0]} x {batch.types.shape[1]}", f"{int(lengths.min())}-{int(lengths.max())}", images]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16, help="samples per batch (fixed and mixed)")
    parser.add_argument("--tokens", type=int, default=1000, help="tokens per sample of the fixed batch")
    parser.add_argument("--images", type=int, default=3, help="images per sample of the fixed batch")
    parser.add_argument("--mixed", type=int, default=4, help="number of mixed batches (seeds 0, 1, ...)")
    parser.add_argument("--max-images", type=int, default=3, help="most images per sample of a mixed batch")
    parser.add_argument("--side", type=int, nargs=2, default=(16, 46), help="pre-merge h and w range (even values)")
    parser.add_argument("--text", type=int, nargs=2, default=(32, 512), help="text tokens per sample, range")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10, help="back-to-back calls per timed block")
    parser.add_argument("--design-rounds", type=int, default=7, help="rounds per design and batch in table 2")
    parser.add_argument("--design-calls", type=int, default=5, help="calls per timed block in table 2")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: fair on a shared box)")
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: batches of 4, short sequences, 2 mixed batches, one round"
    )
    add_output_arguments(parser, "multimodal_ids", "multimodal_ids{,_designs,_collator}.md and .csv")
    args = parser.parse_args(argv)
    error = output_error(args.out, args.results, "--quick" if args.quick else None)
    if error:
        parser.error(error)
    if args.quick:
        print_quick_notice("--quick")
        args.batch, args.tokens, args.mixed, args.side, args.text = 4, 300, 2, (16, 24), (16, 64)
        args.rounds = args.calls = args.design_rounds = args.design_calls = 1
    torch.set_num_threads(args.threads)
    batches = [make_batch(args.batch, args.tokens, args.images)]
    batches += [
        make_mixed_batch(args.batch, seed, args.max_images, tuple(args.side), tuple(args.text))
        for seed in range(args.mixed)
    ]
    timing = f"{args.rounds} rounds of {args.calls} calls, {args.threads} thread(s)"

    print(f"M-RoPE ids, transformers get_rope_index vs visionpe get_position_ids; {timing}; identical output: True")
    header = f"  {'batch':<10} {'B x L':>10} {'tf cpu ms':>10} {'vpe cpu ms':>10}"
    header += f" {'cpu min':>8} {'cpu med':>8} {'wall':>8}"
    print(header)
    rows, totals = [], {"transformers": 0.0, "visionpe": 0.0}
    for batch in batches:
        stats = compare_with_transformers(batch, args.rounds, args.calls)
        ratios = [stats["transformers"][i] / stats["visionpe"][i] for i in (2, 3, 0)]
        if batch.name != "fixed":
            for name in totals:
                totals[name] += stats[name][2]
        rows.append([batch.name, *describe(batch), stats["transformers"][2] * 1e3, stats["visionpe"][2] * 1e3, *ratios])
        print(
            f"  {batch.name:<10} {rows[-1][1]:>10} {rows[-1][4]:10.3f} {rows[-1][5]:10.3f} "
            + " ".join(f"{r:7.1f}x" for r in ratios)
        )
    if args.mixed:
        overall = totals["transformers"] / totals["visionpe"]
        rows.append(["mixed, overall", "", "", "", totals["transformers"] * 1e3, totals["visionpe"] * 1e3, overall])
        rows[-1] += [None, None]
        print(f"  {'mixed, overall':<21} {rows[-1][4]:10.3f} {rows[-1][5]:10.3f} {overall:7.1f}x")
    notes = (
        f"Qwen2-VL M-RoPE position ids from {FUNCTIONS['transformers']} and {FUNCTIONS['visionpe']} (transformers 5.x "
        f"conventions), identical ids and deltas from both on every batch; {timing}. Per-call process CPU time "
        "(minimum over the rounds), both functions measured in the same run; speed-up = transformers / visionpe on "
        "the minimum and median CPU time and the minimum wall time. fixed: left padded, "
        f"{args.images} images per sample; mixed-<seed>: 0-{args.max_images} images per sample, pre-merge sides "
        f"{args.side[0]}-{args.side[1]}, {args.text[0]}-{args.text[1]} text tokens per sample, even samples left "
        "padded and odd ones right padded. mixed, overall: minimum per-call times summed over the mixed batches."
    )
    formats = {c: ".3f" for c in ID_COLUMNS if c.endswith("ms")} | {c: ".1f" for c in ID_COLUMNS if "speed" in c}
    paths = write_results("multimodal_ids", rows, ID_COLUMNS, out_dir=args.out, notes=notes, formats=formats)

    design_timing = f"{args.design_rounds} rounds of {args.design_calls} calls per batch"
    print(f"Every design, batched call vs a per-sample loop over all {len(batches)} batches; {design_timing}")
    print(f"  {'design':<18} {'batch ms':>9} {'loop ms':>9} {'cpu min':>8} {'lowest':>8} {'cpu med':>8}")
    design_rows = []
    for scheme in list_multimodal_schemes():
        sums = {"batched": [0.0, 0.0], "loop": [0.0, 0.0]}
        lowest, largest = float("inf"), 0.0
        for batch in batches:
            stats = compare_with_loop(scheme, batch, args.design_rounds, args.design_calls)
            for name in sums:
                sums[name][0] += stats[name][2]
                sums[name][1] += stats[name][3]
            lowest = min(lowest, stats["loop"][2] / stats["batched"][2])
            largest = max(largest, stats["largest difference"])
        ratio, median_ratio = sums["loop"][0] / sums["batched"][0], sums["loop"][1] / sums["batched"][1]
        options = DESIGN_OPTIONS.get(scheme, ("defaults",))[0]
        match = "identical" if largest == 0 else f"within {largest:.1e}"
        design_rows.append(
            [scheme, options, sums["batched"][0] * 1e3, sums["loop"][0] * 1e3, ratio, lowest, median_ratio, match]
        )
        print(
            f"  {scheme:<18} {sums['batched'][0] * 1e3:9.3f} {sums['loop'][0] * 1e3:9.3f} {ratio:7.1f}x "
            f"{lowest:7.1f}x {median_ratio:7.1f}x  {match}"
        )
    design_notes = (
        f"get_position_ids(scheme, ...) on each batch of multimodal_ids (the fixed one and {args.mixed} mixed) against "
        "a Python loop of the same call on each sample alone (its valid tokens only, its own grids and options); the "
        f"loop's ids equal the batched ids at the valid tokens and its deltas the batched deltas (bit for bit, or for "
        "fractional ids within the largest difference shown: float64 kernels may round an element differently by "
        f"an ulp depending on where it falls in the batch). {design_timing}, "
        f"{args.threads} thread(s). Times: the minimum per-call process CPU time, summed over the batches; speed-up = "
        "loop / batched on these sums (cpu min) and on the medians (cpu median); lowest batch speed-up: the smallest "
        "ratio of the minima on one batch."
    )
    design_formats = {c: ".3f" for c in DESIGN_COLUMNS if c.endswith("ms")}
    design_formats |= {c: ".1f" for c in DESIGN_COLUMNS if "speed" in c}
    paths += write_results(
        "multimodal_ids_designs",
        design_rows,
        DESIGN_COLUMNS,
        out_dir=args.out,
        notes=design_notes,
        formats=design_formats,
    )

    print(f"Positions in the data loader (VLMPositionCollator) vs in the forward, per sample; {design_timing}")
    print(f"  {'':<8} {'batch':<10} {'design':<8} {'collator ms':>12} {'forward ms':>12} {'ratio':>7}")
    collator_rows = []
    for batch in batches:
        size = batch.types.shape[0]
        for scheme in COLLATOR_DESIGNS:
            stats = compare_collator(scheme, batch, args.design_rounds, args.design_calls)
            loader, forward = stats["collator"][2] / size * 1e3, stats["in-forward"][2] / size * 1e3
            collator_rows.append([batch.name, scheme, loader, forward, loader / forward])
            print(f"  collator {batch.name:<10} {scheme:<8} {loader:12.4f} {forward:12.4f} {loader / forward:6.2f}x")
    collator_notes = (
        "VLMPositionCollator(scheme, Qwen2VLConfig(28 layers), 'Qwen2VLModel') on each batch's samples (padding them "
        "and building position_ids, rope_deltas and, for pype (interval=2), per-layer ids and masks, as a DataLoader "
        "worker runs it) against the same positions built from the padded batch, the work the patched model's "
        "forward does when the batch comes without them (on the accelerator it adds host-device synchronisations, "
        "which this CPU measurement does not show). The ids of every sample agree before anything is timed. "
        f"{design_timing}, {args.threads} thread(s); minimum per-call process CPU time divided by the batch size."
    )
    collator_formats = {c: ".4f" for c in COLLATOR_COLUMNS if "ms" in c} | {"collator / in-forward": ".2f"}
    paths += write_results(
        "multimodal_ids_collator",
        collator_rows,
        COLLATOR_COLUMNS,
        out_dir=args.out,
        notes=collator_notes,
        formats=collator_formats,
    )
    if args.results is not None:
        paths += tuple(copy_results(paths, args.results))
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
