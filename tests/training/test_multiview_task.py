"""The multi-view experiment: its scenes, labels and renderer, and the training driver's quick mode."""

import csv

import pytest
import torch

import visionpe
from experiments.multiview import COLOURS, GREY, LABELS, MultiViewTask
from visionpe.camera import Cameras, RelativeCameraEncoding, random_rigid
from visionpe.registry import get_scheme_class

from ..scripts import load_script
from ..test_bench_results import PUBLISHED, published_untouched, quick_notices

RELATIVE = [s for s in visionpe.list_schemes("camera") if issubclass(get_scheme_class(s), RelativeCameraEncoding)]
ABSOLUTE = [s for s in visionpe.list_schemes("camera") if s not in RELATIVE]
needs_relative = pytest.mark.skipif(not RELATIVE, reason="no relative camera scheme is registered")


def _sample(task, n, seed=0):
    return task.sample(n, torch.Generator().manual_seed(seed))


def _naive_pixels(points, cameras):
    """(B, V, K, 2) pixels and (B, V, K) depths, one point and camera at a time: K (R X + t), divided by z."""
    batch, views, balls = cameras.batch_size, cameras.num_views, points.shape[1]
    pixels, depths = torch.zeros(batch, views, balls, 2), torch.zeros(batch, views, balls)
    for b in range(batch):
        for v in range(views):
            rot, t, k = cameras.w2c[b, v, :3, :3], cameras.w2c[b, v, :3, 3], cameras.intrinsics[b, v]
            for i in range(balls):
                x = k @ (rot @ points[b, i] + t)
                pixels[b, v, i], depths[b, v, i] = x[:2] / x[2], x[2]
    return pixels, depths


def test_the_same_seed_draws_the_same_scenes():
    task = MultiViewTask()
    a, b, c = _sample(task, 12, 5), _sample(task, 12, 5), _sample(task, 12, 6)
    for x, y in zip(a, b, strict=True):
        x, y = (x.w2c, y.w2c) if hasattr(x, "w2c") else (x, y)
        assert torch.equal(x, y)
    assert not torch.equal(a.points, c.points) and not torch.equal(a.images, c.images)


@pytest.mark.parametrize("label", LABELS)
def test_labels_follow_their_definition_and_are_balanced(label):
    task = MultiViewTask(label=label)
    batch = _sample(task, 1200)
    cams = Cameras(batch.cameras.w2c[:20], batch.cameras.intrinsics[:20], batch.cameras.image_size)
    pixels, depths = _naive_pixels(batch.points[:20], cams)
    ball = pixels[:, 1, :, 0].argmin(-1) if label == "match" else depths[:, 0].argmin(-1)
    assert torch.equal(batch.labels[:20], batch.colours[:20].gather(1, ball[:, None])[:, 0])
    assert torch.equal(batch.colours.sort(-1).values, torch.arange(3).expand(1200, 3))
    counts = torch.bincount(batch.labels, minlength=task.num_classes)
    # 3 balanced classes: 400 expected each, a binomial std of 16
    assert bool(((counts - 400).abs() < 80).all()), counts.tolist()
    assert task.chance == pytest.approx(100 / 3)


def test_the_leftmost_disk_of_view_1_lies_on_its_own_epipolar_segment_and_off_the_others():
    task = MultiViewTask()
    batch = _sample(task, 8, seed=4)
    pixels, _ = _naive_pixels(batch.points, batch.cameras)
    f, c = task.focal * task.img_size, task.img_size / 2
    for b in range(8):
        # each ball's ray of view 0 over the depths balls can have, sampled finely, seen by camera 1: K (R X + t)
        depth = batch.cameras.centers[b, 0].norm() + task.depth_range * torch.linspace(-1, 1, 401)
        c2w, w2c, k = batch.cameras.c2w[b, 0], batch.cameras.w2c[b, 1], batch.cameras.intrinsics[b, 1]
        leftmost = int(pixels[b, 1, :, 0].argmin())
        gaps = []
        for ball in [leftmost, *(i for i in range(3) if i != leftmost)]:
            ray = torch.cat(((pixels[b, 0, ball] - c) / f, torch.ones(1)))
            points = (depth[:, None] * ray) @ c2w[:3, :3].T + c2w[:3, 3]
            seen = (points @ w2c[:3, :3].T + w2c[:3, 3]) @ k.T
            gaps.append(float((seen[:, :2] / seen[:, 2:] - pixels[b, 1, leftmost]).norm(dim=-1).min()))
        assert gaps[0] < 0.05 and min(gaps[1:]) > task.margin - 0.05, gaps


@pytest.mark.parametrize("label", LABELS)
def test_a_rigid_motion_of_the_world_keeps_images_and_labels(label):
    task = MultiViewTask(label=label)
    batch = _sample(task, 24)
    world = random_rigid((24,), translation=5.0, generator=torch.Generator().manual_seed(1))
    points = batch.points @ world[:, :3, :3].transpose(-1, -2) + world[:, None, :3, 3]
    cameras = batch.cameras.transform(world)
    assert not torch.allclose(cameras.w2c, batch.cameras.w2c, atol=0.1)
    assert torch.equal(task.labels(points, cameras, batch.colours), batch.labels)
    torch.testing.assert_close(task.render(points, cameras, batch.colours), batch.images, atol=2e-3, rtol=0)
    # move_world: the cameras' poses relative to each other stay, the world frame does not
    moved = task.move_world(batch.cameras, torch.Generator().manual_seed(2))
    relative = moved.w2c[:, 1] @ moved.c2w[:, 0]
    torch.testing.assert_close(relative, batch.cameras.w2c[:, 1] @ batch.cameras.c2w[:, 0], atol=1e-4, rtol=0)
    assert (moved.w2c[:, 0, :3, 3] - batch.cameras.w2c[:, 0, :3, 3]).norm(dim=-1).mean() > 1


@pytest.mark.parametrize("label", LABELS)
def test_each_disk_is_drawn_at_its_projected_pixel_in_its_colour(label):
    task = MultiViewTask(label=label)
    batch = _sample(task, 6)
    pixels, _ = _naive_pixels(batch.points, batch.cameras)
    image01 = (batch.images + 1) / 2  # (B, V, 3, H, W), black 0
    centres = torch.arange(task.img_size) + 0.5
    for b in range(6):
        for v in range(2):
            for k in range(3):
                colour = GREY if label == "match" and v == 1 else COLOURS[batch.colours[b, k]]
                u, w = pixels[b, v, k]
                # the pixel under the centre is fully covered, in the ball's colour
                torch.testing.assert_close(image01[b, v, :, int(w), int(u)], colour, atol=1e-5, rtol=0)
                # the disk's coverage (its support is the disc of radius r + 0.5) is centred on the projection
                dist = torch.hypot(centres[None, :] - u, centres[:, None] - w)
                weight = image01[b, v].sum(0) * (dist < task.disk_radius + 0.5)
                centroid = torch.stack(((weight * centres[None, :]).sum(), (weight * centres[:, None]).sum()))
                torch.testing.assert_close(centroid / weight.sum(), torch.stack((u, w)), atol=0.1, rtol=0)
            # nothing else: the covered area is that of three disks, about pi r^2 pixels each
            covered = float((image01[b, v].sum(0) > 0).sum())
            assert 3 * 3.14 * 2.0**2 < covered < 3 * 3.14 * 3.5**2


@pytest.mark.parametrize("label", LABELS)
def test_one_view_alone_gives_little_or_nothing_of_the_label(label):
    task = MultiViewTask(label=label)
    batch = _sample(task, 2400, seed=3)
    pixels, _ = batch.cameras.project(batch.points)
    if label == "match":  # view 1 is grey: it shows which disk is leftmost, not its colour
        view1 = batch.images[:, 1]
        assert torch.equal(view1[:, 0], view1[:, 1]) and torch.equal(view1[:, 1], view1[:, 2])
    # simple statistics of view 0: at chance for "nearest" (depths are drawn independently of view 0's pixels); for
    # "match" a ball at the edge of the group tends to be at its edge in view 1 too, worth a few points
    view0 = pixels[:, 0] - task.img_size / 2
    spread = (view0[:, :, None] - view0[:, None]).norm(dim=-1).sum(-1)
    statistics = {
        "leftmost": view0[..., 0].argmin(-1),
        "topmost": view0[..., 1].argmin(-1),
        "nearest the centre": view0.norm(dim=-1).argmin(-1),
        "farthest from the centre": view0.norm(dim=-1).argmax(-1),
        "most isolated": spread.argmax(-1),
    }
    for name, ball in statistics.items():
        guess = batch.colours.gather(1, ball[:, None])[:, 0]
        accuracy = 100 * float((guess == batch.labels).float().mean())
        if label == "nearest":
            assert abs(accuracy - task.chance) < 4, (name, accuracy)  # a binomial std of about 1 point
        else:
            assert accuracy < task.chance + 10, (name, accuracy)


def test_task_arguments_are_checked():
    with pytest.raises(ValueError, match="label"):
        MultiViewTask(label="farthest")
    with pytest.raises(ValueError, match="num_objects"):
        MultiViewTask(num_objects=7)
    with pytest.raises(ValueError, match="depth_range"):
        MultiViewTask(depth_range=6.0)
    with pytest.raises(ValueError, match="passed min_separation"):
        MultiViewTask(min_separation=30.0).sample(4, torch.Generator())
    with pytest.raises(TypeError, match="generator"):
        MultiViewTask().sample(4, 0)


@needs_relative
def test_quick_mode_trains_evaluates_and_writes_table_csv_and_plot(tmp_path, capsys):
    script = load_script("train/multiview.py")
    schemes = ["none", RELATIVE[0]]
    args = ["--quick", "--schemes", *schemes, "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "docs")]
    with published_untouched():  # --quick writes --results where it is told, never the published tables
        paths = script.main(args)
    assert quick_notices(capsys.readouterr().out) == [
        "--quick: the numbers of this run are a pipeline check, not a measurement"
    ]
    assert sorted(p.name for p in (tmp_path / "docs").iterdir()) == ["multiview.csv", "multiview.md", "multiview.png"]
    for key in ("md", "csv", "png", "results_md", "results_csv", "results_png"):
        assert paths[key].is_file() and paths[key].stat().st_size > 100, key
    rows = list(csv.DictReader(paths["results_csv"].open()))
    assert [(r["scheme"], r["condition"]) for r in rows] == [(s, c) for s in schemes for c in ("held-out", "moved")]
    assert {r["seed"] for r in rows} == {"0"} and all(0 <= float(r["accuracy (%)"]) <= 100 for r in rows)
    table = paths["results_md"].read_text()
    assert table.startswith("Measured ") and f"| {RELATIVE[0]} | relative |" in table and "| none | none |" in table
    assert (tmp_path / "runs" / RELATIVE[0] / "seed0" / "result.json").is_file()
    # --reuse loads the finished runs instead of training them again
    capsys.readouterr()
    script.main([*args, "--reuse"])
    assert capsys.readouterr().out.count("reused") == 2
    assert list(csv.DictReader(paths["results_csv"].open())) == rows


@needs_relative
def test_a_relative_scheme_gives_the_same_logits_when_the_world_moves():
    script = load_script("train/multiview.py")
    task = MultiViewTask()
    batch = _sample(task, 4)
    moved = task.move_world(batch.cameras, torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = script.build_model(RELATIVE[0], task).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(batch.images, moved), model(batch.images, batch.cameras), atol=1e-4, rtol=0)
        if ABSOLUTE:  # the control: an absolute scheme sees the moved world as a new input
            model = script.build_model(ABSOLUTE[0], task).eval()
            assert (model(batch.images, moved) - model(batch.images, batch.cameras)).abs().max() > 1e-3


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--schemes", "nope"], "--schemes must be camera schemes"),
        (["--schemes", "none", "none"], "must not repeat"),
        (["--seeds", "0", "0"], "must not repeat"),
        (["--seeds", "-1"], "non-negative"),
        (["--steps", "0"], "--steps must be a positive int"),
        (["--eval-samples", "-5"], "--eval-samples must be a positive int"),
        (["--lr", "0"], "--lr must be a positive number"),
    ],
)
def test_bad_arguments_fail_before_anything_trains(argv, match, monkeypatch, tmp_path):
    script = load_script("train/multiview.py")
    monkeypatch.setattr(script, "train", lambda *a, **k: pytest.fail("trained despite bad arguments"))
    with pytest.raises(ValueError, match=match):
        script.main(["--quick", "--schemes", "none", "--out", str(tmp_path), *argv])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--quick", "--results", str(PUBLISHED)], "--quick is a pipeline check, not a measurement: --results"),
        (["--out", str(PUBLISHED)], "is the published results folder"),
    ],
    ids=["quick-results", "out"],
)
def test_the_published_tables_are_refused_before_anything_trains(argv, message, monkeypatch, capsys):
    script = load_script("train/multiview.py")
    monkeypatch.setattr(script, "train", lambda *a, **k: pytest.fail("trained despite bad arguments"))
    with published_untouched(), pytest.raises(SystemExit) as exit_:
        script.main(["--schemes", "none", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
