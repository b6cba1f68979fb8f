"""The multimodal extrapolation benchmark: model, Lightning module, quick setting end to end, reports."""

import csv
import re
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
from experiments.vlm.benchmark import CHANCE, check_trainer_args, load_trainer_config, markdown_table  # noqa: E402
from experiments.vlm.model import merge_visual_tokens  # noqa: E402
from visionpe.absolute.sincos import sincos_2d  # noqa: E402
from visionpe.multimodal import PPERotary, cca_attention_mask, get_position_ids, pype_attention_mask  # noqa: E402

from ..scripts import ROOT, load_script  # noqa: E402
from ..test_bench_results import PUBLISHED, published_untouched, quick_notices  # noqa: E402


def _script():
    return load_script("bench/vlm_extrapolation.py")


@pytest.fixture(scope="module")
def bank():
    return DigitBank("val")


def _batch(bank, task, lengths, video_as_images=False, tiled=False):
    gen = torch.Generator().manual_seed(0)
    samples = [
        make_sample(task, bank, n, gen, training=False, video_as_images=video_as_images, tiled=tiled) for n in lengths
    ]
    return samples, collate_samples(samples)


NEW_DESIGNS = ("cca", "pype", "bipe", "ppe", "rope_dhr", "mrope_abs_time", "circle_rope_age")


# the benchmark's entries (not design names: they name every registered design, and a test parametrized by all of
# them would read as a generic test of the designs, which a design defined outside the package must join too)
@pytest.mark.parametrize("bench_entry", list(BENCH_SCHEMES.values()), ids=lambda e: f"bench_{e.name}")
def test_every_scheme_runs_every_task_padding_invariant(bank, bench_entry):
    module = VLMModule(bench_entry.name).eval()
    entry = module.scheme
    for task, lengths in (("grid", (1, 3, 2)), ("multi_image", (1, 4, 2)), ("video", (2, 5))):
        if not entry.applies_to(task):
            continue
        samples, batch = _batch(bank, task, lengths, entry.video_as_images, entry.tiled)
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
                **entry.call_inputs(batch.get("video_grid_thw")),
            )
        assert batched.shape == (len(lengths), module.model.config.text_config.vocab_size)
        assert torch.isfinite(batched).all()
        torch.testing.assert_close(batched, alone, rtol=0, atol=1e-5)  # left padding changes nothing
        if not entry.batch_options:  # BiPE's separators and RoPE-DHR's tiles come from the batch, not the adapter
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
    with published_untouched():
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
    with published_untouched():  # the quick setting writes --results where it is told, never the published tables
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


def test_the_quick_setting_says_it_measures_nothing_and_keeps_out_of_the_published_tables(
    tmp_path, monkeypatch, capsys
):
    script = _script()
    monkeypatch.setattr(script, "run_benchmark", lambda *a, **k: {})
    for setting, notices in (
        ("quick", ["--setting quick: the numbers of this run are a pipeline check, not a measurement"]),
        ("small", []),
    ):
        assert script.main(["--setting", setting, "--out", str(tmp_path)]) == {}
        assert quick_notices(capsys.readouterr().out) == notices
    monkeypatch.setattr(script, "run_benchmark", lambda *a, **k: pytest.fail("ran despite refused outputs"))
    for argv, message in [
        (["--results", str(PUBLISHED)], "--setting quick is a pipeline check, not a measurement: --results"),
        (["--setting", "small", "--out", str(PUBLISHED)], "is the published results folder"),
    ]:
        with published_untouched(), pytest.raises(SystemExit) as exit_:
            script.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


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


def test_trainer_arguments_from_a_config_replace_the_cpu_default(tmp_path, monkeypatch):
    """configs/fsdp/vlm.yaml is accepted (its strategy built per run); other Trainer arguments reach the Trainer."""
    from visionpe.training.fsdp import BlockFSDPStrategy

    section = load_trainer_config(ROOT / "configs/fsdp/vlm.yaml")
    assert section["accelerator"] == "gpu" and isinstance(section["strategy"], dict)  # as written
    built = [check_trainer_args(section)["strategy"] for _ in range(2)]
    assert all(isinstance(s, BlockFSDPStrategy) for s in built) and built[0] is not built[1]
    seen = []
    original = benchmark.L.Trainer

    def trainer(**kwargs):
        seen.append(kwargs)
        return original(**kwargs)

    monkeypatch.setattr(benchmark.L, "Trainer", trainer)
    setting = replace(SETTINGS["quick"], steps={"grid": 2, "multi_image": 2, "video": 2}, eval_samples=4)
    rows = train_and_evaluate("grid", "mrope", 0, setting, trainer_args={"precision": "bf16-mixed", "devices": 1})
    assert seen[0]["precision"] == "bf16-mixed" and seen[0]["accelerator"] == "cpu" and seen[0]["max_steps"] == 2
    assert all(0 <= r["acc"] <= 100 for r in rows)
    with pytest.raises(ValueError, match="trainer_args cannot set 'max_steps': the benchmark's protocol sets it"):
        check_trainer_args({"max_steps": 10})
    with pytest.raises(ValueError, match="trainer_args has 'gpus', which is no lightning.Trainer argument"):
        run_benchmark("quick", out_dir=tmp_path, trainer_args={"gpus": 1})
    with pytest.raises(TypeError, match="trainer_args strategy 'visionpe.training.fsdp.Nope' does not instantiate"):
        check_trainer_args({"strategy": {"class_path": "visionpe.training.fsdp.Nope"}})
    (tmp_path / "bad.yaml").write_text("model: {}\n")
    with pytest.raises(ValueError, match="must hold a 'trainer' mapping"):
        load_trainer_config(tmp_path / "bad.yaml")


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
    assert set(SETTINGS["small"].tasks) == set(TASKS) and len(SETTINGS["small"].schemes) == 16


def _attention_inputs(module, batch):
    """The logits, and what each decoder layer's attention receives: (attention_mask, (cos, sin)) per layer."""
    seen = []

    def hook(mod, args, kwargs):
        seen.append((kwargs["attention_mask"], kwargs["position_embeddings"]))

    layers = module.model.model.language_model.layers
    hooks = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]
    try:
        with torch.no_grad():
            logits = module(batch)
    finally:
        for handle in hooks:
            handle.remove()
    return logits, seen


def test_cca_mask_reaches_every_attention(bank):
    module = VLMModule("cca").eval()
    for task, lengths in (("grid", (3, 2)), ("multi_image", (2, 3)), ("video", (3,))):
        _, batch = _batch(bank, task, lengths)
        _, seen = _attention_inputs(module, batch)
        expected = cca_attention_mask(
            batch["mm_token_type_ids"],
            batch.get("image_grid_thw"),
            batch.get("video_grid_thw"),
            attention_mask=batch["attention_mask"],
            spatial_merge_size=2,
            dtype=seen[0][0].dtype,
        )
        assert len(seen) == 2 and all(torch.equal(mask, expected) for mask, _ in seen)
        # the mask is not the causal one: a border token sees a later token of the same ring
        causal = torch.ones_like(expected[0, 0], dtype=torch.bool).tril()
        assert ((expected[:, 0] == 0) & ~causal).any()
    pos = module.position_ids(batch, training=False)
    ref, _ = get_position_ids(
        "cca", batch["mm_token_type_ids"], None, batch["video_grid_thw"], batch["attention_mask"], pad_value=0
    )
    assert torch.equal(pos, ref)


def test_pype_rotates_each_layer_with_its_own_ids(bank):
    module = VLMModule("pype").eval()
    assert module.scheme.options == {"interval": 1}
    _, batch = _batch(bank, "grid", (5, 3))  # a 5 x 5 grid: 3 levels at layer 0, 2 at layer 1
    _, seen = _attention_inputs(module, batch)
    rotary = module.model.model.language_model.rotary_emb.rotary
    args = (batch["mm_token_type_ids"], batch["image_grid_thw"], None, batch["attention_mask"])
    for layer, (mask, (cos, sin)) in enumerate(seen):
        ids, _ = get_position_ids("pype", *args, interval=1, layer=layer, pad_value=0)
        expected_cos, expected_sin = rotary(ids, dtype=cos.dtype)
        valid = batch["attention_mask"].bool()
        torch.testing.assert_close(cos[valid], expected_cos[valid])
        torch.testing.assert_close(sin[valid], expected_sin[valid])
        expected_mask = pype_attention_mask(*args, interval=1, layer=layer, dtype=mask.dtype)
        assert torch.equal(mask, expected_mask)
    assert not torch.allclose(seen[0][1][0], seen[1][1][0])  # per-layer ids: the tables differ
    assert not torch.equal(seen[0][0], seen[1][0])  # and so do the masks


def test_bipe_segments_and_side_embedding(bank):
    module = VLMModule("bipe").eval()
    samples, batch = _batch(bank, "multi_image", (2, 1))
    pos = module.position_ids(batch, training=False)
    assert torch.equal(pos[0], pos[1]) and torch.equal(pos[1], pos[2])
    # <bos> image <k> <vs> | image | <ve> <vs> | image | <ve> <ask>: the question ends at <vs>, each image is a segment
    expected = [0] * 4 + [1] * 4 + [2] * 2 + [3] * 4 + [4] * 2
    assert pos[0, 0].tolist() == expected
    side = module.side_embedding(batch)
    table = module.model.bipe_intra.weight
    torch.testing.assert_close(side[0, :4], table[:4])  # the question: intra 0..3 in the learned table
    torch.testing.assert_close(side[0, 8:10], table[:2])  # <ve> <vs>: a new sentence
    visual = batch["mm_token_type_ids"][0] == 1
    coords = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]] * 2, dtype=torch.float32)
    torch.testing.assert_close(side[0][visual], sincos_2d(coords, table.shape[1]))  # fixed 2-D sin-cos per frame
    assert (side[1][batch["attention_mask"][1] == 0] == 0).all()  # nothing at padding
    # the model run in parts is the model's own forward plus the side embedding
    module.side_embedding = lambda b: torch.zeros(*b["input_ids"].shape, table.shape[1])
    with torch.no_grad():
        parts = module(batch)
        whole = module.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            mm_token_type_ids=batch["mm_token_type_ids"],
            position_ids=pos,
            pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"],
            logits_to_keep=1,
            use_cache=False,
        ).logits[:, -1]
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)
    assert "bipe_intra.weight" in dict(module.model.named_parameters())


def test_merge_visual_tokens_clusters_each_frame():
    torch.manual_seed(0)
    features = [torch.randn(9, 8), torch.randn(12, 8, requires_grad=True)]
    clusters, merged = merge_visual_tokens(features, [1, 3], 0.45)
    assert [len(c) for c in clusters] == [9, 12] and [m.shape[0] for m in merged] == [5, 6]
    assert sorted(set(clusters[0].tolist())) == list(range(5))
    # frames are clustered separately: 2 clusters per frame of 4 tokens, numbered frame after frame
    assert [sorted(set(clusters[1][4 * f : 4 * f + 4].tolist())) for f in range(3)] == [[0, 1], [2, 3], [4, 5]]
    for c, m, x in zip(clusters, merged, features, strict=True):
        for k in range(m.shape[0]):
            torch.testing.assert_close(m[k], x[c == k].mean(0))
    merged[1].sum().backward()  # the merged features are differentiable in the tower's output
    assert features[1].grad is not None and features[1].grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"ratio must be a number in \(0, 1\], got 0"):
        merge_visual_tokens(features, [1, 3], 0)
    with pytest.raises(ValueError, match=r"features\[1\] has 12 tokens, not a multiple of frames\[1\] = 5"):
        merge_visual_tokens(features, [1, 5], 0.5)


def test_ppe_merges_tokens_and_keeps_k_positions(bank):
    module = VLMModule("ppe").eval()
    assert isinstance(module.model.model.language_model.rotary_emb.rotary, PPERotary)
    _, batch = _batch(bank, "grid", (3, 2))  # 9 and 4 visual tokens: 5 and 2 kept
    seen = {}

    def hook(mod, args, kwargs):
        seen.update(kwargs)

    handle = module.model.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        module(batch)
    handle.remove()
    mask, ids = seen["attention_mask"], seen["position_ids"]
    assert mask.sum(1).tolist() == [8 + 5, 8 + 2] and seen["inputs_embeds"].shape[1] == 13
    assert ids.shape == (6, 2, 13)  # K = 2 positions per token, rows t1 t2 h1 h2 w1 w2
    # the merged tokens carry the dense ids of two members of their cluster, as get_position_ids gives them
    features = module.visual_features(batch)
    clusters, _ = merge_visual_tokens(features, [1, 1], 0.45)
    dense_clusters = torch.zeros_like(batch["input_ids"])
    visual = batch["mm_token_type_ids"] == 1
    dense_clusters[visual] = torch.cat(clusters)
    dense, _ = get_position_ids(
        "ppe",
        batch["mm_token_type_ids"],
        batch["image_grid_thw"],
        None,
        batch["attention_mask"],
        clusters=dense_clusters,
        num_representatives=2,
        pad_value=0,
    )
    for b, count in enumerate((5, 2)):
        kept = ids[:, b, -(2 + count) : -2]
        starts = [int((clusters[b] == k).nonzero()[0]) for k in range(count)]
        columns = visual[b].nonzero().flatten()[starts]
        expected = dense[:, b, columns].T.tolist()
        assert sorted(kept.T.tolist()) == sorted(expected)
        assert torch.equal(ids[:, b, -2:], dense[:, b, -2:])  # the text after the image keeps its dense ids
        rows_t = kept[:2]
        assert (rows_t == dense[0, b, visual[b]].min()).all()  # one image: one time id


def test_rope_dhr_tiles_reuse_the_thumbnail_ids(bank):
    module = VLMModule("rope_dhr").eval()
    _, batch = _batch(bank, "grid", (5,), tiled=True)  # 3 x 3 tiles and a thumbnail of 2 x 2 tokens each
    assert batch["tile_grid"].tolist() == [[3, 3]]
    pos = module.position_ids(batch, training=False)[0, 0]
    visual = pos[batch["mm_token_type_ids"][0] == 1]
    start = int(visual[0])
    assert len(visual) == 40 and sorted(set(visual.tolist())) == list(range(start, start + 4))
    assert visual[-4:].tolist() == list(range(start, start + 4))  # the thumbnail: raster ids
    assert pos[-2:].tolist() == [start + 4, start + 5]  # the text after the image continues after one tile
    with pytest.raises(ValueError, match=r"needs \['tile_grid'\] in the batch"):
        module.position_ids({k: v for k, v in batch.items() if k != "tile_grid"}, training=False)
    entry = get_bench_scheme("rope_dhr")
    assert entry.applies_to("grid") and not entry.applies_to("video") and not entry.applies_to("multi_image")
    with pytest.raises(ValueError, match=r"scheme 'rope_dhr' does not apply to task 'video': RoPE-DHR is defined"):
        VLMTaskDataModule("video", "rope_dhr")
    with pytest.raises(ValueError, match=r"does not apply to task 'multi_image': every image is one tile"):
        train_and_evaluate("multi_image", "rope_dhr", 0, "quick")


@pytest.mark.parametrize("scheme", NEW_DESIGNS)
def test_new_designs_train_and_evaluate_end_to_end(tmp_path, scheme):
    setting = replace(
        SETTINGS["quick"],
        steps={"grid": 2, "multi_image": 2, "video": 2},
        eval_samples=4,
        eval_lengths={"grid": (3, 5), "multi_image": (4, 8), "video": (8, 16)},
    )
    for task in TASKS:
        if not get_bench_scheme(scheme).applies_to(task):
            continue
        rows = train_and_evaluate(task, scheme, 1, setting)
        assert [r["length"] for r in rows] == list(setting.eval_lengths[task])
        assert all(r["scheme"] == scheme and r["steps"] == 2 and 0 <= r["acc"] <= 100 for r in rows)


def test_not_applicable_designs_are_reported_not_run(tmp_path, monkeypatch):
    def fake(task, scheme, seed, setting, log_dir=None, trainer_args=None):
        return [
            {
                "task": task,
                "scheme": scheme,
                "seed": seed,
                "length": n,
                "acc": 50.0,
                "n": 4,
                "train_length": n <= max(TASKS[task].train_lengths),
                "steps": 2,
                "train_s": 0.0,
                "train_cpu_s": 0.0,
                "eval_s": 0.0,
            }
            for n in setting.lengths(task)
        ]

    monkeypatch.setattr(benchmark, "train_and_evaluate", fake)
    logged = []
    paths = run_benchmark(
        "quick", schemes=["rope_dhr", "mrope"], tasks=["grid", "video"], out_dir=tmp_path, log=logged.append
    )
    assert set(paths) == {"grid", "video"}
    video = paths["video"]["md"].read_text()
    assert "| rope_dhr‡ | not run | not run |" in video and "| mrope | 50.0 | 50.0 |" in video
    assert "‡ rope_dhr is not run on this task: RoPE-DHR is defined for tiled images" in video
    assert "rope_dhr" in paths["grid"]["md"].read_text() and "‡" not in paths["grid"]["md"].read_text()
    assert any("video rope_dhr: not run" in line for line in logged)
    assert not list((tmp_path / "results").glob("video_rope_dhr_*"))
    only = run_benchmark("quick", schemes=["rope_dhr"], tasks=["video"], out_dir=tmp_path / "none", log=None)
    assert only == {}


def _fake_runs(monkeypatch, acc=50.0):
    """train_and_evaluate replaced by rows of the setting (accuracy ``acc``), so that the CLI runs in no time."""
    trained = []

    def fake(task, scheme, seed, setting, log_dir=None, trainer_args=None):
        trained.append((task, scheme, seed))
        return [
            {
                "task": task,
                "scheme": scheme,
                "seed": seed,
                "length": n,
                "acc": acc,
                "n": setting.eval_samples,
                "train_length": n <= max(TASKS[task].train_lengths),
                "steps": setting.steps[task],
                "train_s": 1.0,
                "train_cpu_s": 1.0,
                "eval_s": 0.1,
            }
            for n in setting.lengths(task)
        ]

    monkeypatch.setattr(benchmark, "train_and_evaluate", fake)
    return trained


def test_update_measures_the_named_schemes_and_keeps_the_others(tmp_path, monkeypatch, capsys):
    results = str(tmp_path / "docs")
    base = ["--setting", "quick", "--tasks", "grid", "video", "--seeds", "0", "1", "--threads", "1"]
    _fake_runs(monkeypatch, acc=40.0)
    _script().main([*base, "--schemes", "mrope", "cca", "--out", str(tmp_path / "a"), "--results", results])
    before = list(csv.DictReader((tmp_path / "docs" / "vlm.csv").open()))
    assert {r["scheme"] for r in before} == {"mrope", "cca"}
    trained = _fake_runs(monkeypatch, acc=70.0)
    update = [*base, "--schemes", "cca", "rope_dhr", "--out", str(tmp_path / "b"), "--results", results, "--update"]
    _script().main(update)
    assert {run[1] for run in trained} == {"cca", "rope_dhr"} and ("video", "rope_dhr", 0) not in trained
    after = list(csv.DictReader((tmp_path / "docs" / "vlm.csv").open()))
    assert [r for r in after if r["scheme"] == "mrope"] == [r for r in before if r["scheme"] == "mrope"]
    assert {float(r["acc"]) for r in after if r["scheme"] in ("cca", "rope_dhr")} == {70.0}
    assert [r["scheme"] for r in after if r["task"] == "grid" and r["seed"] == "0" and r["length"] == "3"] == [
        "mrope",
        "cca",
        "rope_dhr",
    ]  # the benchmark's scheme order
    text = (tmp_path / "docs" / "vlm.md").read_text()
    assert sorted(p.name for p in (tmp_path / "docs").glob("*.png")) == ["vlm_grid.png", "vlm_video.png"]
    first, _, second = text.splitlines()[:3]
    assert first.startswith("Measured ") and "--update" in first
    assert second.startswith("Rows of mrope kept from an earlier run (`--update`): measured ")
    assert "| mrope | 40.0 ± 0.0 | 40.0 ± 0.0 | 40.0 ± 0.0 |" in text and "| cca | 70.0 ± 0.0 |" in text
    assert "| rope_dhr‡ | not run | not run | not run |" in text  # not applicable to the video task
    # rows of another setting or other seeds are not merged: refused, nothing written
    for argv, match in (
        ([*base[:6], "2", *base[7:]], r"previous rows of mrope on grid have seeds \[0, 1\], this run \[1, 2\]"),
        (["--setting", "small", *base[2:]], r"mrope on grid, seed 0: lengths \[3, 6\], setting 'small' evaluates"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            _script().main([*argv, "--schemes", "cca", "--out", str(tmp_path / "c"), "--results", results, "--update"])
        assert exit_info.value.code == 2
        assert re.search(match, capsys.readouterr().err)
        assert (tmp_path / "docs" / "vlm.md").read_text() == text
    # a table this run does not touch keeps its own seeds (one set for all its schemes)
    measured = ["mrope", "cca", "rope_dhr"]
    kept = _script().check_previous_rows(after, SETTINGS["quick"], [0], measured, ["grid"])
    assert {(r["task"], r["seed"]) for r in kept if r["scheme"] == "cca"} == {("video", "0"), ("video", "1")}
    mixed = [r for r in after if not (r["task"] == "video" and r["scheme"] == "mrope" and r["seed"] == "1")]
    with pytest.raises(ValueError, match=r"cca on video have seeds \[0, 1\], other schemes of that task \[0\]"):
        _script().check_previous_rows(mixed, SETTINGS["quick"], [0], measured, ["grid"])
    with pytest.raises(ValueError, match=r"mrope on grid, seed 0: 250 steps and 100 questions per length, setting"):
        rows = [{**r, "steps": "250"} for r in after]
        _script().check_previous_rows(rows, replace(SETTINGS["quick"], steps={"grid": 9, "video": 9}), [0, 1], [], [])
    with pytest.raises(ValueError, match=r"--update needs the vlm.csv and vlm.md that an earlier --results run wrote"):
        _script().previous_rows(tmp_path / "nothing")
    with pytest.raises(SystemExit):
        _script().main([*base, "--update", "--out", str(tmp_path / "d")])  # --update needs --results and --schemes
    # a further update keeps the line saying where the earliest rows were measured, after the previous run's; each
    # kept scheme is named on the line of the run that measured it (mrope by the first run, not the second)
    _fake_runs(monkeypatch, acc=80.0)
    _script().main([*base, "--schemes", "cca", "--out", str(tmp_path / "e"), "--results", results, "--update"])
    lines = [line for line in (tmp_path / "docs" / "vlm.md").read_text().splitlines() if line]
    assert lines[1] == f"Rows of rope_dhr kept from an earlier run (`--update`): measured {first[9:]}"
    assert lines[2] == second and not lines[3].startswith("Rows of ")
    # when every kept scheme comes from runs before the earlier one, the earlier run gets no line
    _fake_runs(monkeypatch, acc=90.0)
    _script().main(
        [*base, "--schemes", "cca", "rope_dhr", "--out", str(tmp_path / "g"), "--results", results, "--update"]
    )
    again = [line for line in (tmp_path / "docs" / "vlm.md").read_text().splitlines() if line]
    assert again[1] == second and not again[2].startswith("Rows of ")
    _fake_runs(monkeypatch, acc=80.0)
    _script().main([*base, "--schemes", "cca", "--out", str(tmp_path / "h"), "--results", results, "--update"])
    lines = [line for line in (tmp_path / "docs" / "vlm.md").read_text().splitlines() if line]
    assert _script().kept_lines(tmp_path / "docs", ["rope_dhr"]) == [lines[1]]
    assert _script().kept_lines(tmp_path / "nothing", ["mrope"]) == []
    with pytest.raises(ValueError, match=r"schemes must be a list of .*got 'mrope'"):
        _script().kept_lines(tmp_path / "docs", "mrope")
    with pytest.raises(ValueError, match=r"older must be lines starting with 'Rows of ', got \['x'\]"):
        _script().write_results_files(after, tmp_path / "f", earlier="then", older=["x"])


def test_mrope_abs_time_gets_one_second_per_frame_and_two_time_ids_per_second(bank):
    entry = get_bench_scheme("mrope_abs_time")
    assert entry.seconds_per_frame == 1.0 and entry.options == {"tokens_per_second": 2.0}
    _, batch = _batch(bank, "video", (3, 5))
    assert entry.call_inputs(batch["video_grid_thw"]) == {"second_per_grid_ts": [1.0, 1.0]}
    assert entry.call_inputs(None) == {} and get_bench_scheme("mrope").call_inputs(batch["video_grid_thw"]) == {}
    ours = VLMModule("mrope_abs_time").position_ids(batch, training=True)
    qwen2 = VLMModule("mrope").position_ids(batch, training=True)
    video = batch["mm_token_type_ids"] == 2
    for b, frames in enumerate((3, 5)):
        # Qwen2.5-VL: frame t at floor(t * 2 ids/s * 1 s) = 2t after the block start; h and w as Qwen2-VL's
        time = ours[0, b][video[b]].view(frames, 4)
        start = int(qwen2[0, b][video[b]][0])
        expected = start + 2 * torch.arange(frames)
        assert torch.equal(time, expected[:, None].expand(frames, 4))
        assert torch.equal(qwen2[0, b][video[b]].view(frames, 4)[:, 0], start + torch.arange(frames))
        assert torch.equal(ours[1:, b][:, video[b]], qwen2[1:, b][:, video[b]])
        # the text after the clip continues after its last time id
        assert ours[0, b, -2].item() == start + 2 * (frames - 1) + 1
    _, images = _batch(bank, "multi_image", (2, 3))
    with torch.no_grad():  # images have t = 0: the same ids as Qwen2-VL's
        assert torch.equal(
            VLMModule("mrope_abs_time").position_ids(images, False), VLMModule("mrope").position_ids(images, False)
        )
    with pytest.raises(ValueError, match=r"seconds_per_frame must be a positive finite number or None, got 0"):
        replace(entry, seconds_per_frame=0)
    with pytest.raises(ValueError, match=r"video_grid_thw must be a \(V, 3\) tensor or None, got \[1, 2, 2\]"):
        entry.call_inputs([1, 2, 2])


def test_circle_rope_age_alternates_circle_and_mrope_ids_over_the_layers(bank):
    entry = get_bench_scheme("circle_rope_age")
    plain = get_bench_scheme("circle_rope")
    assert entry.scheme == "circle_rope" and entry.options == {"age": True} and entry.video_as_images
    assert plain.options == {} and plain.video_as_images
    _, batch = _batch(bank, "grid", (3, 2))
    age, circle, qwen2 = (VLMModule(name, seed=0).eval() for name in ("circle_rope_age", "circle_rope", "mrope"))
    # layer 0's ids (what get_rope_index gives) are Circle-RoPE's, as without AGE
    assert torch.equal(age.position_ids(batch, False), circle.position_ids(batch, False))
    with torch.no_grad():
        logits = {name: m(batch) for name, m in (("age", age), ("circle", circle), ("mrope", qwen2))}
    # same initialisation, so layer 1's M-RoPE ids are the only difference from either design alone
    assert (logits["age"] - logits["circle"]).abs().max() > 1e-5
    assert (logits["age"] - logits["mrope"]).abs().max() > 1e-5
    # layer 1's ids under AGE are Qwen2-VL's M-RoPE ids
    mrope_ids, _ = get_position_ids(
        "circle_rope",
        batch["mm_token_type_ids"],
        batch["image_grid_thw"],
        None,
        batch["attention_mask"],
        spatial_merge_size=2,
        pad_value=0,
        age=True,
        layer=1,
    )
    expected, _ = get_position_ids(
        "mrope",
        batch["mm_token_type_ids"],
        batch["image_grid_thw"],
        None,
        batch["attention_mask"],
        spatial_merge_size=2,
        pad_value=0,
    )
    assert torch.equal(mrope_ids, expected)


def test_results_plot_every_scheme_of_the_table_each_line_its_own_look(tmp_path, monkeypatch):
    import matplotlib.figure

    from experiments.vlm import benchmark

    figures = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: figures.append((fig, path)))
    applies = {task: [s for s in BENCH_SCHEMES if BENCH_SCHEMES[s].applies_to(task)] for task in ("grid", "video")}
    assert len(applies["video"]) > 10  # more designs than the ten colours
    rows = [
        {"task": task, "scheme": scheme, "seed": seed, "length": n, "acc": 10.0 + i + seed, "n": 100}
        | {"train_length": n <= max(TASKS[task].train_lengths), "steps": 9, "train_s": 1.0, "eval_s": 0.1}
        for task, schemes in applies.items()
        for i, scheme in enumerate(schemes)
        for seed in (0, 1)
        for n in TASKS[task].eval_lengths
    ]
    _script().write_results_files([{k: str(v) for k, v in r.items()} for r in rows], tmp_path, ["x"])
    assert [path.name for _, path in figures] == ["vlm_grid.png", "vlm_video.png"]
    for (fig, _), schemes in zip(figures, applies.values(), strict=True):
        lines = [line for line in fig.axes[0].get_lines() if not line.get_label().startswith("_")]
        assert [line.get_label() for line in lines] == schemes
        looks = {(str(line.get_color()), line.get_linestyle()) for line in lines}
        assert len(looks) == len(schemes), "two schemes of one plot share a colour and a line style"
        assert [line.get_ydata()[0] for line in lines] == [10.5 + i for i in range(len(schemes))]  # mean of seeds
    with pytest.raises(ValueError, match=r"rows must hold at least one row of task 'multi_image', got none"):
        benchmark.plot_task("multi_image", rows, tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"task must be one of .*got 'maze'"):
        benchmark.plot_task("maze", rows, tmp_path / "x.png")
