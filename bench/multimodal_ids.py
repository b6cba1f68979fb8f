"""Speed of ``visionpe.multimodal.get_position_ids`` against transformers' ``Qwen2VLModel.get_rope_index``.

A batch of 16 left-padded sequences of about 1000 tokens with 3 images each (merged grids of 6x8 to 12x14
tokens), on CPU. Both functions run in the same process and must return identical ids and
deltas (visionpe with transformers 5.x's conventions: ``continuation="spatial_extent"``, pads 0). Each
round times a block of back-to-back calls per function, alternating the two; the minimum and the median
over the rounds of the per-call wall time and process CPU time are reported (on a shared machine the
minimum is the steadier estimate of the cost), with the ratio transformers / visionpe.

    .venv/bin/python bench/multimodal_ids.py   # writes docs/benchmarks/results/multimodal_ids.md and .csv
    .venv/bin/python bench/multimodal_ids.py --batch 16 --tokens 1000 --images 3 --rounds 15 --calls 10

The table printed is also written to ``<--out>/multimodal_ids.md`` and ``multimodal_ids.csv`` (``bench/results.py``:
the date, commit, versions, device and command on the first line of the Markdown file).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.results import DEFAULT_OUT, ROOT, write_results  # noqa: E402
from visionpe.multimodal import get_position_ids  # noqa: E402

FUNCTIONS = {
    "transformers": "Qwen2VLModel.get_rope_index",
    "visionpe": "visionpe.multimodal.get_position_ids",
}


def make_batch(batch: int, tokens: int, images: int, seed: int = 0):
    """(token_type_ids, attention_mask, image_grid_thw), left padded; text runs separate the images."""
    gen = torch.Generator().manual_seed(seed)
    rows, grids = [], []
    for _ in range(batch):
        length = tokens - int(torch.randint(0, tokens // 5, (1,), generator=gen))
        sample_grids = [
            (1, 2 * int(torch.randint(6, 13, (1,), generator=gen)), 2 * int(torch.randint(8, 15, (1,), generator=gen)))
            for _ in range(images)
        ]
        visual = sum(t * h * w // 4 for t, h, w in sample_grids)
        text = max(length - visual, images + 1)
        cuts = sorted(torch.randperm(text - 1, generator=gen)[:images].add(1).tolist())
        bounds = [0, *cuts, text]
        row = []
        for k in range(images + 1):
            row += [0] * (bounds[k + 1] - bounds[k])
            if k < images:
                t, h, w = sample_grids[k]
                row += [1] * (t * h * w // 4)
        rows.append(row)
        grids += sample_grids
    width = max(len(r) for r in rows)
    types = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for b, row in enumerate(rows):
        types[b, width - len(row) :] = torch.tensor(row)
        mask[b, width - len(row) :] = 1
    return types, mask, torch.tensor(grids)


def transformers_rope_index(merge: int = 2):
    """``Qwen2VLModel.get_rope_index`` on a stand-in for the model: it only reads the config."""
    fake = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge)))
    fake.get_vision_position_ids = lambda *a, **k: Qwen2VLModel.get_vision_position_ids(fake, *a, **k)
    return lambda *a, **k: Qwen2VLModel.get_rope_index(fake, *a, **k)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--images", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10, help="back-to-back calls per timed block")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: fair on a shared box)")
    parser.add_argument(
        "--out", default=str(ROOT / DEFAULT_OUT), help=f"folder of multimodal_ids.md and .csv (default {DEFAULT_OUT})"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    types, mask, grids = make_batch(args.batch, args.tokens, args.images)
    reference = transformers_rope_index()
    input_ids = types.clone()  # get_rope_index only reads its shape, device and dtype

    def ours():
        return get_position_ids(
            "mrope", types, grids, None, mask, continuation="spatial_extent", pad_value=0, delta_convention="valid"
        )

    def theirs():
        return reference(input_ids, types, grids, None, attention_mask=mask)

    ref_pos, ref_delta = theirs()
    pos, delta = ours()
    identical = torch.equal(pos, ref_pos) and torch.equal(delta, ref_delta)
    if not identical:
        raise SystemExit("visionpe and transformers disagree; not timing")
    # Each round times a block of back-to-back calls of one function (as a data collator would call it),
    # alternating the two functions so that drift of a shared machine hits both alike.
    wall = {"transformers": [], "visionpe": []}
    cpu = {"transformers": [], "visionpe": []}
    for _ in range(args.rounds):
        for name, fn in (("transformers", theirs), ("visionpe", ours)):
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(args.calls):
                fn()
            wall[name].append((time.perf_counter() - start) / args.calls)
            cpu[name].append((time.process_time() - start_cpu) / args.calls)
    lengths = mask.sum(1)
    setting = (
        f"batch {args.batch} x {types.shape[1]} tokens (valid {int(lengths.min())}-{int(lengths.max())}), "
        f"{args.images} images each, {args.rounds} rounds of {args.calls} calls, {args.threads} thread(s)"
    )
    print(f"{setting}; identical output: {identical}")
    print(f"  {'ms':<13} {'wall min':>9} {'wall med':>9} {'cpu min':>9} {'cpu med':>9}")
    stats = {}
    for name in wall:
        stats[name] = (min(wall[name]), statistics.median(wall[name]), min(cpu[name]), statistics.median(cpu[name]))
        print(f"  {name:<13} " + " ".join(f"{v * 1e3:9.2f}" for v in stats[name]))
    ratios = [t / v for t, v in zip(stats["transformers"], stats["visionpe"], strict=True)]
    print(f"  {'speed-up':<13} " + " ".join(f"{r:8.1f}x" for r in ratios))
    columns = ["function", "wall min ms", "wall median ms", "cpu min ms", "cpu median ms"]
    rows = [[f"{name} ({label})", *(f"{v * 1e3:.2f}" for v in stats[name])] for name, label in FUNCTIONS.items()]
    rows.append(["speed-up (transformers / visionpe)", *(f"{r:.1f}" for r in ratios)])
    notes = (
        f"Qwen2-VL M-RoPE position ids, {setting}; identical ids and deltas from both: {identical}. "
        "Per-call wall and process CPU time, minimum and median over the rounds."
    )
    paths = write_results("multimodal_ids", rows, columns, out_dir=args.out, notes=notes)
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
