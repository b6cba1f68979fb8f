"""The multimodal extrapolation benchmark: model, Lightning module, quick setting end to end, reports."""

import csv
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

from experiments.vlm import (  # noqa: E402
    BENCH_SCHEMES,
    SETTINGS,
    TASKS,
    DigitBank,
    VLMModule,
    VLMSize,
    VLMTaskDataModule,
    benchmark,  # noqa: E402
    build_tiny_vlm,
    collate_samples,
    get_bench_scheme,
    make_sample,
    run_benchmark,
    train_and_evaluate,
    write_task_report,
)
from experiments.vlm.benchmark import CHANCE, markdown_table  # noqa: E402

from ..scripts import load_script  # noqa: E402


def _script():
    return load_script("bench/vlm_extrapolation.py")


@pytest.fixture(scope="module")
def bank():
    return DigitBank("val")


def _batch(bank, task, lengths, video_as_images=False):
    gen = torch.Generator().manual_seed(0)
    samples = [make_sample(task, bank, n, gen, training=False, video_as_images=video_as_images) for n in lengths]
    return samples, collate_samples(samples)


@pytest.mark.parametrize("scheme", list(BENCH_SCHEMES))
def test_every_scheme_runs_every_task_padding_invariant(bank, scheme):
    module = VLMModule(scheme).eval()
    for task, lengths in (("grid", (1, 3, 2)), ("multi_image", (1, 4, 2)), ("video", (2, 5))):
        samples, batch = _batch(bank, task, lengths, module.scheme.video_as_images)
        with torch.no_grad():
            batched = module(batch)
            alone = torch.cat([module(collate_samples([s])) for s in samples])
            # the ids the module computes are the adapter's (apply_position_scheme's get_rope_index)
            ours = module.position_ids(batch, training=False)
            ref, _ = module.model.model.get_rope_index(
                batch["input_ids"],
                batch["mm_token_type_ids"],
                batch.get("image_grid_thw"),
                batch.get("video_grid_thw"),
                batch["attention_mask"],
            )
        assert batched.shape == (len(lengths), module.model.config.text_config.vocab_size)
        assert torch.isfinite(batched).all()
        torch.testing.assert_close(batched, alone, rtol=0, atol=1e-5)  # left padding changes nothing
        assert torch.equal(ours, ref)


def test_schemes_change_the_model_and_the_baseline_is_1d_rope(bank):
    _, batch = _batch(bank, "grid", (3, 2))
    logits = {}
    for scheme in ("rope_1d", "mrope", "vrope"):
        module = VLMModule(scheme, seed=0).eval()
        with torch.no_grad():
            logits[scheme] = module(batch)
    assert (logits["rope_1d"] - logits["mrope"]).abs().max() > 1e-4
    assert (logits["mrope"] - logits["vrope"]).abs().max() > 1e-4
    module = VLMModule("rope_1d")
    pos = module.position_ids(batch, training=True)
    mask = batch["attention_mask"].bool()
    assert pos.dtype == torch.float64  # V2PE with delta = 1: a fractional design, float64 ids
    expected = (batch["attention_mask"].cumsum(1) - 1).double()
    assert torch.equal(pos[0][mask], expected[mask]) and torch.equal(pos[0], pos[1]) and torch.equal(pos[1], pos[2])


def test_randomised_training_options_are_seeded_per_step(bank):
    _, batch = _batch(bank, "video", (8, 8, 8, 8))
    module = VLMModule("v2pe", seed=1)
    train_a, train_b = module.position_ids(batch, training=True), module.position_ids(batch, training=True)
    assert torch.equal(train_a, train_b)  # same (seed, step): same deltas
    assert not torch.equal(train_a, module.position_ids(batch, training=False))  # evaluation: delta = 1/4
    last_visual = train_a[0, :, -3]
    assert len(set(last_visual.tolist())) > 1  # one delta per sample
    hope = VLMModule("hope", seed=1)
    assert not torch.equal(hope.position_ids(batch, training=True), hope.position_ids(batch, training=False))


def test_training_draws_one_delta_per_image(bank):
    # V2PE's delta is drawn per image, so the K images of one sample step by their own deltas
    _, batch = _batch(bank, "multi_image", (4, 4, 4, 4))
    pos = VLMModule("v2pe", seed=2).position_ids(batch, training=True)[0]
    visual = batch["mm_token_type_ids"] == 1
    steps = []
    for b in range(pos.shape[0]):
        images = pos[b][visual[b]].view(4, 4)  # 4 images of 2x2 tokens, in order
        steps.append(images[:, 1] - images[:, 0])
    steps = torch.stack(steps)
    assert set(steps.flatten().tolist()) <= {1 / 2**k for k in range(9)}
    assert any(len(set(row.tolist())) > 1 for row in steps)


def test_model_config_and_sizes():
    model = build_tiny_vlm("mhrope", VLMSize(hidden_size=64, num_heads=4, num_kv_heads=4))
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, vision.patch_size, vision.temporal_patch_size) == (64, 2, 7, 1)
    assert model.visionpe_scheme == "mhrope" and model.bench_scheme is get_bench_scheme("mhrope")
    same = build_tiny_vlm("mhrope", seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters(), strict=True))
    with pytest.raises(ValueError, match=r"hidden_size / num_heads must be a multiple of 8, got 64 / 16"):
        VLMSize(num_heads=16)
    with pytest.raises(ValueError, match=r"num_layers must be a positive int, got 0"):
        VLMSize(num_layers=0)
    with pytest.raises(ValueError, match=r"scheme must be one of .*got 'rope3000'"):
        build_tiny_vlm("rope3000")
    with pytest.raises(TypeError, match=r"size must be a VLMSize, got dict"):
        build_tiny_vlm("mrope", {"hidden_size": 64})
    with pytest.raises(ValueError, match=r"lr must be a positive number, got 0"):
        VLMModule("mrope", lr=0)
    with pytest.raises(ValueError, match=r"task must be one of .*got 'audio'"):
        VLMTaskDataModule("audio")
    with pytest.raises(ValueError, match=r"eval_lengths must be ints in \[1, 16\] for task 'grid', got \[2, 20\]"):
        VLMTaskDataModule("grid", eval_lengths=[2, 20])


def test_quick_setting_end_to_end_learns(tmp_path, monkeypatch):
    """The quick setting through the CLI: two schemes trained and evaluated, md/csv/png written, and both models
    far above chance (10 %) at the training length (measured: about 90 %). Run again with --reuse, nothing is
    trained and the same tables come back."""
    paths = _script().main(["--setting", "quick", "--out", str(tmp_path), "--threads", "1"])
    quick = SETTINGS["quick"]
    assert set(paths) == set(quick.tasks) == {"video"}
    for path in paths["video"].values():
        assert path.is_file() and path.stat().st_size > 0
    with paths["video"]["csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert {r["scheme"] for r in rows} == set(quick.schemes) and len(rows) == 2 * len(quick.eval_lengths["video"])
    train_length = [r for r in rows if r["train_length"] == "True"]
    assert train_length and all(float(r["acc"]) >= 4 * CHANCE for r in train_length), rows
    table = paths["video"]["md"].read_text()
    assert "| rope_1d |" in table and "| mrope |" in table and "8 fr*" in table
    assert (tmp_path / "runs.csv").is_file() and (tmp_path / "summary.md").is_file()
    assert len(list((tmp_path / "results").glob("video_*_seed0.json"))) == 2

    def no_training(*args, **kwargs):
        raise AssertionError(f"--reuse trained {args} again")

    monkeypatch.setattr(benchmark, "train_and_evaluate", no_training)
    csv_text = paths["video"]["csv"].read_text()
    results = ["--results", str(tmp_path / "docs")]
    again = _script().main(["--setting", "quick", "--out", str(tmp_path), "--threads", "1", "--reuse", *results])
    assert again["video"]["csv"].read_text() == csv_text
    # --results: every task's table under the run's header line, and every row in one CSV
    first, *rest = (tmp_path / "docs" / "vlm.md").read_text().splitlines()
    assert first.startswith("Measured ") and "CPU" in first and str(tmp_path) not in first
    assert "command: `python bench/vlm_extrapolation.py --setting quick --out .../" in first
    assert "| rope_1d |" in "\n".join(rest) and rest[1].startswith("## ")
    assert list(csv.DictReader((tmp_path / "docs" / "vlm.csv").open())) == rows
    # a saved run of another setting is not reused
    (tmp_path / "results" / "video_mrope_seed0.json").write_text('{"setting": "small", "rows": [{"acc": 1}]}')
    with pytest.raises(AssertionError, match="trained .*mrope"):
        _script().main(["--setting", "quick", "--out", str(tmp_path), "--threads", "1", "--reuse"])


def test_train_and_evaluate_rows(tmp_path):
    setting = replace(SETTINGS["quick"], steps={"grid": 3, "multi_image": 3, "video": 3}, eval_samples=4)
    rows = train_and_evaluate("grid", "circle_rope", 2, setting, log_dir=tmp_path)
    assert [r["length"] for r in rows] == [3, 6] and all(r["scheme"] == "circle_rope" and r["seed"] == 2 for r in rows)
    assert [r["train_length"] for r in rows] == [True, False] and all(0 <= r["acc"] <= 100 for r in rows)
    assert any(tmp_path.rglob("metrics.csv"))
    with pytest.raises(ValueError, match=r"scheme must be one of .*got 'nope'"):
        train_and_evaluate("grid", "nope", 0, setting)
    with pytest.raises(ValueError, match=r"setting must be one of \['quick', 'small'\] or a BenchSetting, got 'big'"):
        train_and_evaluate("grid", "mrope", 0, "big")


def test_report_with_seeds(tmp_path):
    rows = [
        {
            "task": "multi_image",
            "scheme": s,
            "seed": seed,
            "length": k,
            "acc": acc + seed,
            "n": 200,
            "train_length": k <= 4,
            "steps": 10,
            "train_s": 1.0,
            "eval_s": 0.1,
        }
        for s, acc in (("rope_1d", 50.0), ("mrope", 70.0))
        for seed in (0, 1, 2)
        for k in (4, 8, 16)
    ]
    paths = write_task_report("multi_image", rows, tmp_path)
    assert {p.name for p in paths.values()} == {"multi_image.md", "multi_image.csv", "multi_image.png"}
    table = markdown_table("multi_image", rows)
    assert "| scheme | K=4* | K=8 | K=16 | mean beyond training |" in table
    assert "| mrope | 71.0 ± 1.0 | 71.0 ± 1.0 | 71.0 ± 1.0 | 71.0 ± 1.0 |" in table
    with pytest.raises(ValueError, match=r"rows hold no result for task 'grid'"):
        write_task_report("grid", rows, tmp_path)


def test_run_benchmark_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"schemes must be a non-empty list of .*got \['mrope', 'x'\]"):
        run_benchmark("quick", schemes=["mrope", "x"], out_dir=tmp_path)
    with pytest.raises(ValueError, match=r"tasks must be a non-empty list of .*got \['audio'\]"):
        run_benchmark("quick", tasks=["audio"], out_dir=tmp_path)
    with pytest.raises(ValueError, match=r"seeds must be a non-empty list of non-negative ints, got \[-1\]"):
        run_benchmark("quick", seeds=[-1], out_dir=tmp_path)
    with pytest.raises(ValueError, match=r"jobs must be a positive int, got 0"):
        run_benchmark("quick", jobs=0, out_dir=tmp_path)
    assert set(SETTINGS["small"].tasks) == set(TASKS) and len(SETTINGS["small"].schemes) == 9
