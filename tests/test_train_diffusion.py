"""The diffusion extrapolation benchmark: the object detector on rendered scenes, the lag similarity on constructed
clips, the samplers' conventions and ``train/diffusion.py --quick`` end to end."""

import csv
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

TRAIN = str(Path(__file__).resolve().parents[1] / "train")
if TRAIN not in sys.path:
    sys.path.insert(0, TRAIN)

from experiments.diffusion import (  # noqa: E402
    DETECT_MIN_AREA,
    detect_objects,
    flux_ids,
    label_components,
    lag_similarity,
    object_areas,
    patchify,
    sample,
    scene_images,
    tiny_flux,
    tiny_wan,
    unpatchify,
    validate_detector,
)
from experiments.scenes import CELLS, Scenes, render  # noqa: E402

from .scripts import load_script  # noqa: E402
from .test_bench_results import PUBLISHED, published_untouched, quick_notices  # noqa: E402


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# --- the detector ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", [1.0, 2.0])
def test_detector_counts_the_objects_of_rendered_scenes(field):
    images, scenes = scene_images(200, _gen(3), field=field)
    found = torch.tensor([len(a) for a in detect_objects(images)])
    true = scenes.occupied.flatten(1).sum(1)
    assert (found == true).float().mean() >= 0.99
    assert true.float().mean() > (5 if field == 1 else 18)  # the scenes hold objects to find
    # every object's area is the shape's coverage: within a few pixels of its analytic area
    report = validate_detector(200, _gen(4), field=field)
    assert report["exact"] >= 0.99 and report["area_corr"] > 0.8  # dark greys lose more of their fringe
    assert abs(report["area"] - report["analytic_area"]) < 4


def test_detector_areas_follow_the_rendered_radius():
    # one white circle of radius r px: the component holds the pixels whose centre lies within r (coverage > 0.5
    # at threshold 0.2 needs d < 0.3 px), about pi r^2
    for radius in (0.06, 0.08):
        g = CELLS
        occupied = torch.zeros(1, g, g, dtype=torch.bool)
        occupied[0, 1, 2] = True
        centre = torch.zeros(1, g, g, 2)
        centre[0, 1, 2] = torch.tensor([0.625, 0.375])
        scenes = Scenes(
            1.0,
            occupied,
            torch.zeros(1, g, g, dtype=torch.long),
            torch.zeros(1, g, g, dtype=torch.long),
            torch.full((1, g, g), -1),
            torch.ones(1, g, g),
            centre,
            torch.full((1, g, g), radius),
        )
        (areas,) = detect_objects(render(scenes, 64))
        r = radius * 64
        assert len(areas) == 1 and math.pi * (r - 0.5) ** 2 < areas[0] < math.pi * (r + 0.5) ** 2
        assert object_areas(scenes, 64)[0, 1, 2] == pytest.approx(math.pi * r * r)


def test_components_are_four_connected_and_small_specks_are_dropped():
    image = torch.zeros(1, 3, 8, 8)
    image[0, :, 1, 1] = image[0, :, 2, 2] = 1.0  # diagonal neighbours: two components of one pixel
    image[0, 0, 5:7, 4:7] = 0.9  # a red 2 x 3 block
    labels = label_components(image.amax(1) > 0.2)
    assert labels[0, 1, 1] != labels[0, 2, 2] and len(labels.unique()) == 4
    (areas,) = detect_objects(image)
    assert areas.tolist() == [6]  # the single pixels are below DETECT_MIN_AREA
    assert DETECT_MIN_AREA > 1
    (areas,) = detect_objects(image, min_area=1)
    assert sorted(areas.tolist()) == [1, 1, 6]
    (dark,) = detect_objects(image * 0.2)  # nothing above the threshold
    assert len(dark) == 0


def test_detector_refuses_bad_input():
    with pytest.raises(ValueError, match="images must be a float"):
        detect_objects(torch.zeros(3, 8, 8))
    with pytest.raises(ValueError, match="threshold"):
        detect_objects(torch.zeros(1, 3, 8, 8), threshold=1.5)
    with pytest.raises(ValueError, match="mask must be"):
        label_components(torch.zeros(1, 4, 4))


# --- the lag similarity -------------------------------------------------------------------------------------------


def test_lag_similarity_is_one_on_a_repeating_clip_and_low_on_a_moving_one():
    g = _gen(5)
    first = torch.rand(3, 1, 8, 6, 6, generator=g)
    repeating = torch.cat([first, first], dim=2)  # frames 8..15 repeat frames 0..7
    assert torch.allclose(lag_similarity(repeating, 8), torch.ones(3), atol=1e-6)
    # an independent second half: about 0; the same with a brighter second half (centred cosine): still 1
    fresh = torch.cat([first, torch.rand(3, 1, 8, 6, 6, generator=g)], dim=2)
    assert lag_similarity(fresh, 8).abs().max() < 0.3
    assert torch.allclose(lag_similarity(torch.cat([first, 2 * first + 0.5], dim=2), 8), torch.ones(3), atol=1e-5)
    # against an independent formula: the centred cosine of two frames, averaged
    clip = torch.rand(1, 2, 10, 4, 4, generator=g)
    expected = []
    for f in range(10 - 3):
        a, b = clip[0, :, f].flatten(), clip[0, :, f + 3].flatten()
        a, b = a - a.mean(), b - b.mean()
        expected.append(float(a @ b / (a.norm() * b.norm())))
    assert lag_similarity(clip, 3).item() == pytest.approx(sum(expected) / len(expected), abs=1e-6)


def test_lag_similarity_refuses_bad_input():
    with pytest.raises(ValueError, match="clips must be"):
        lag_similarity(torch.zeros(2, 8, 4, 4), 1)
    with pytest.raises(ValueError, match="lag must be shorter"):
        lag_similarity(torch.zeros(1, 1, 8, 4, 4), 8)
    with pytest.raises(ValueError, match="lag"):
        lag_similarity(torch.zeros(1, 1, 8, 4, 4), 0)


# --- patches, ids, models -----------------------------------------------------------------------------------------


def test_patches_round_trip_and_follow_flux_ids():
    images = torch.rand(2, 3, 8, 12, generator=_gen())
    tokens = patchify(images, 4)
    assert tokens.shape == (2, 6, 48)
    assert torch.equal(unpatchify(tokens, 4, 2, 3), images)
    ids = flux_ids(2, 3)
    assert ids[4].tolist() == [0.0, 1.0, 1.0]  # token 4: row 1, column 1
    assert torch.equal(tokens[:, 4].reshape(2, 3, 4, 4), images[:, :, 4:8, 4:8])
    with pytest.raises(ValueError, match="patch must divide"):
        patchify(images, 5)


def test_tiny_models_sample_in_range_and_modes_change_only_beyond_the_training_size():
    import visionpe
    from visionpe.integrations.diffusers import apply_position_scheme

    torch.manual_seed(0)
    model = tiny_flux(4, width=32, double=1, single=1).eval()
    apply_position_scheme(model, train_grid_size=(1, 2, 2))
    x = sample(model, (2, 3, 8, 8), 2, _gen(1), 0.1, 0.2, patch=4)
    assert x.shape == (2, 3, 8, 8) and 0 <= x.min() and x.max() <= 1
    wide = sample(model, (2, 3, 16, 16), 2, _gen(1), 0.1, 0.2, patch=4)
    visionpe.set_extrapolation(model, "pi")
    assert torch.equal(sample(model, (2, 3, 8, 8), 2, _gen(1), 0.1, 0.2, patch=4), x)  # at the training size: no change
    assert not torch.equal(sample(model, (2, 3, 16, 16), 2, _gen(1), 0.1, 0.2, patch=4), wide)
    video = tiny_wan(4, width=24, layers=1).eval()
    apply_position_scheme(video, train_grid_size=(2, 2, 2))
    clips = sample(video, (1, 1, 4, 8, 8), 2, _gen(2), 0.1, 0.2)
    assert clips.shape == (1, 1, 4, 8, 8) and 0 <= clips.min() and clips.max() <= 1
    with pytest.raises(ValueError, match="shape must be"):
        sample(model, (2, 3, 8), 2, _gen(1), 0.1, 0.2, patch=4)


# --- the script ------------------------------------------------------------------------------------------------------


def test_quick_runs_end_to_end_and_keeps_out_of_the_published_tables(tmp_path, capsys):
    script = load_script("train/diffusion.py")
    with published_untouched():
        paths = script.main(["--quick", "--out", str(tmp_path / "run"), "--results", str(tmp_path / "docs")])
    out = capsys.readouterr().out
    assert quick_notices(out) == ["--quick: the numbers of this run are a pipeline check, not a measurement"]
    rows = list(csv.DictReader(paths["csv"].open()))
    image = [r for r in rows if r["part"] == "image"]
    assert [(r["samples"], r["mode"], r["size"]) for r in image] == [
        ("training scenes", "", "32"),
        ("canvas reference", "", "64"),
        ("samples", "none", "32"),
        *(("samples", m, "64") for m in script.IMAGE_MODES),
    ]
    video = [r for r in rows if r["part"] == "video"]
    assert [(r["samples"], r["mode"], r["size"]) for r in video] == [
        ("real clips", "", "8"),
        ("real clips", "", "16"),
        ("samples", "none", "8"),
        *(("samples", m, "16") for m in script.VIDEO_MODES),
    ]
    # the real rows are measured: scenes of one field hold about 1 + 0.3 x 15 objects, a 2 x 2 canvas 1 + 0.3 x 63
    assert 2 < float(image[0]["objects"]) < 10 < float(image[1]["objects"]) < 30
    assert all(r["lag8"] == "" for r in video if r["size"] == "8")
    expected = [f"diffusion{s}.{e}" for s in ("", "_size", "_video") for e in ("csv", "md")] + ["diffusion.png"]
    assert sorted(p.name for p in (tmp_path / "docs").iterdir()) == sorted(expected)
    first = (tmp_path / "docs" / "diffusion.md").read_text().splitlines()[0]
    assert first.startswith("Measured ") and "command: `python train/diffusion.py --quick" in first
    assert "| canvas reference |" in (tmp_path / "docs" / "diffusion.md").read_text()
    assert "lag-8 similarity" in (tmp_path / "docs" / "diffusion_video.md").read_text()
    # --reuse loads the weights instead of training them again
    again = script.main(["--quick", "--parts", "image", "--out", str(tmp_path / "run"), "--reuse"])
    assert "loaded" in capsys.readouterr().out
    assert [r["objects"] for r in csv.DictReader(again["csv"].open())] == [r["objects"] for r in image]


def test_quick_refuses_the_published_folder_and_bad_arguments(capsys):
    script = load_script("train/diffusion.py")
    for argv, message in [
        (["--quick", "--results", str(PUBLISHED)], "--quick is a pipeline check, not a measurement: --results"),
        (["--out", str(PUBLISHED / "diffusion")], "is the published results folder"),
    ]:
        with published_untouched(), pytest.raises(SystemExit) as exit_:
            script.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(ValueError, match="--modes must be"):
        script.main(["--quick", "--modes", "zoom"])
    with pytest.raises(ValueError, match="--seeds must be"):
        script.main(["--quick", "--seeds", "1", "1"])
    with pytest.raises(ValueError, match="--parts must"):
        script.main(["--quick", "--parts", "audio"])
