import csv
import io
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from experiments import DIGITS_MEAN, DIGITS_PATH, DIGITS_STD, DigitsDataModule, MovingDigitsDataModule, load_digits
from experiments.digits import split_digits
from experiments.moving_digits import DIRECTIONS
from visionpe.training import FrameClipDataModule, ImageFolderDataModule
from visionpe.training.image_folder import IMAGENET_MEAN, IMAGENET_STD
from visionpe.training.sampling import EpochSampler
from visionpe.training.video_data import frame_indices

REPO = Path(__file__).resolve().parents[2]
MOTION = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}  # (dy, dx) per frame


def unnormalize(x: torch.Tensor, mean=DIGITS_MEAN, std=DIGITS_STD, channel_dim: int = 1) -> torch.Tensor:
    """Normalised images, channels along ``channel_dim`` ((B, 3, H, W) or (3, T, H, W)) -> pixel values in [0, 1]."""
    shape = [1] * x.ndim
    shape[channel_dim] = 3
    return x * torch.tensor(std).view(shape) + torch.tensor(mean).view(shape)


def ink_box(image: torch.Tensor) -> tuple[int, int]:
    """Height and width of the nonzero region of a (H, W) image."""
    rows, cols = torch.nonzero(image.any(dim=1)).flatten(), torch.nonzero(image.any(dim=0)).flatten()
    return int(rows[-1] - rows[0] + 1), int(cols[-1] - cols[0] + 1)


# --- the bundled file ---------------------------------------------------------------------------------------------


def test_digits_file_is_in_the_repository_small_and_complete():
    assert DIGITS_PATH == REPO / "assets" / "digits" / "mnist_5k.npz"
    assert DIGITS_PATH.stat().st_size <= 2 * 1024 * 1024
    assert (REPO / "assets" / "digits" / "LICENSE.md").is_file()
    images, labels = load_digits()
    assert images.shape == (5000, 28, 28) and images.dtype == torch.uint8
    assert labels.dtype == torch.int64 and labels.unique().tolist() == list(range(10))
    assert torch.bincount(labels).tolist() == [500] * 10
    assert images.amax().item() == 255 and (images.flatten(1).amax(1) > 0).all()


def test_rebuild_script_reproduces_the_arrays():
    sys.path.insert(0, str(REPO / "assets" / "digits"))
    try:
        import make_digits
    finally:
        sys.path.pop(0)
    images, labels = load_digits()
    assert make_digits.arrays_sha256(images.numpy(), labels.numpy()) == make_digits.ARRAYS_SHA256


def test_load_digits_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.npz"):
        load_digits(tmp_path / "nothere.npz")
    np.savez(tmp_path / "bad.npz", images=np.zeros((3, 28, 28), np.uint8))
    with pytest.raises(ValueError, match=r"lacks arrays \['labels'\]"):
        load_digits(tmp_path / "bad.npz")
    np.savez(tmp_path / "shape.npz", images=np.zeros((3, 32, 32), np.uint8), labels=np.zeros(3, np.int64))
    with pytest.raises(ValueError, match=r"\(N, 28, 28\) uint8"):
        load_digits(tmp_path / "shape.npz")
    with pytest.raises(TypeError, match="path must be"):
        load_digits(5)


def test_installed_package_reads_no_file_of_the_checkout():
    """The installed package neither names this machine's checkout nor climbs out of itself to the repository's
    folders (assets/, train/): the experiments in train/ find the bundled digits."""
    for path in sorted((REPO / "visionpe").rglob("*.py")):
        text = path.read_text()
        assert str(REPO) not in text, path
        assert "assets/digits" not in text and '"assets"' not in text, path
        assert not re.search(r"parents\[\d\]", text), path


# --- split and sampler --------------------------------------------------------------------------------------------


def test_split_is_stratified_disjoint_and_seeded():
    _, labels = load_digits()
    train, val = split_digits(labels, 0.8, seed=0)
    assert len(train) == 4000 and len(val) == 1000
    assert torch.bincount(labels[val]).tolist() == [100] * 10
    assert not set(train.tolist()) & set(val.tolist())
    again, _ = split_digits(labels, 0.8, seed=0)
    other, _ = split_digits(labels, 0.8, seed=1)
    assert torch.equal(train, again) and not torch.equal(train, other)
    with pytest.raises(ValueError, match="train_fraction must be in"):
        split_digits(labels, 1.0)
    with pytest.raises(ValueError, match="class 1"):
        split_digits(torch.tensor([0, 0, 0, 1]), 0.5)


def test_epoch_sampler_follows_the_epoch():
    sampler = EpochSampler(50, seed=3)
    first = list(sampler)
    assert list(sampler) == first and {epoch for _, epoch in first} == {0}
    assert sorted(index for index, _ in first) == list(range(50))
    sampler.set_epoch(1)
    second = list(sampler)
    assert [i for i, _ in second] != [i for i, _ in first] and {epoch for _, epoch in second} == {1}
    assert [i for i, _ in EpochSampler(50, seed=4)] != [i for i, _ in first]


# --- digits, resolution protocol ----------------------------------------------------------------------------------


def first_batch(loader):
    return next(iter(loader))


def test_resolution_shapes_and_normalisation():
    dm = DigitsDataModule(img_size=32, eval_sizes=(32, 48, 96), batch_size=16)
    dm.setup("fit")
    assert len(dm.train_dataset) == 4000 and len(dm.val_dataset) == 1000 and dm.num_classes == 10
    x, y = first_batch(dm.train_dataloader())
    assert x.shape == (16, 3, 32, 32) and x.dtype == torch.float32 and y.shape == (16,) and y.dtype == torch.int64
    background = (0.0 - DIGITS_MEAN[0]) / DIGITS_STD[0]
    assert torch.isclose(x.amin(), torch.tensor(background), atol=1e-4)
    assert torch.equal(x[:, 0], x[:, 1]) and torch.equal(x[:, 0], x[:, 2])
    loaders = dm.test_dataloader()
    assert [first_batch(loader)[0].shape[-1] for loader in loaders] == [32, 48, 96]


def test_resolution_eval_resizes_the_whole_digit():
    dm = DigitsDataModule(batch_size=64)
    dm.setup()
    images, labels = load_digits()
    shares = []
    for size in (32, 64, 128):
        x, y = first_batch(dm.eval_dataloader(size))
        assert x.shape == (64, 3, size, size)
        assert torch.equal(y, labels[dm.val_indices[:64]])
        shares.append((unnormalize(x)[:, 0] > 0.5).float().mean().item())
    # the digit covers the same share of the image at every size: "resize to N, centre crop N"
    assert max(shares) - min(shares) < 0.02
    raw_share = (images[dm.val_indices[:64]] > 127).float().mean().item()
    assert abs(shares[-1] - raw_share) < 0.03


def test_resolution_training_varies_scale():
    dm = DigitsDataModule(batch_size=256, scale=(0.25, 1.0))
    dm.setup()
    x, _ = first_batch(dm.train_dataloader())
    ink_share = (unnormalize(x)[:, 0] > 0.5).float().mean(dim=(1, 2))
    assert ink_share.max() > 2 * ink_share.min()  # zoomed crops and full views
    plain = DigitsDataModule(batch_size=256, scale=(1.0, 1.0), ratio=(1.0, 1.0), translate=0.0)
    plain.setup()
    x_plain, _ = first_batch(plain.train_dataloader())
    assert (unnormalize(x_plain)[:, 0] > 0.5).float().mean(dim=(1, 2)).std() < ink_share.std()


def test_resolution_context_centres_the_digit_on_a_larger_square():
    plain, framed = DigitsDataModule(batch_size=16), DigitsDataModule(batch_size=16, context=2.0)
    plain.setup()
    framed.setup()
    x_plain, _ = first_batch(plain.eval_dataloader(28))  # 28 px: the digit itself, pixel for pixel
    x_framed, _ = first_batch(framed.eval_dataloader(56))  # the digit on a 56 px square, pixel for pixel
    background = (0.0 - DIGITS_MEAN[0]) / DIGITS_STD[0]
    border = torch.ones(56, 56, dtype=torch.bool)
    border[14:42, 14:42] = False
    assert torch.allclose(x_framed[:, :, border], torch.tensor(background), atol=1e-5)
    assert torch.allclose(x_framed[:, :, 14:42, 14:42], x_plain, atol=1e-5)
    # at the training size the digit covers about a quarter of the image's ink share of the plain view
    share = [(unnormalize(first_batch(dm.eval_dataloader(32))[0]) > 0.5).float().mean() for dm in (plain, framed)]
    assert 0.15 < share[1] / share[0] < 0.35


def test_digits_determinism_per_seed_and_epoch():
    def batch(seed, batch_size=8, epoch=0, num_workers=0):
        dm = DigitsDataModule(batch_size=batch_size, seed=seed, num_workers=num_workers)
        dm.setup()
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(epoch)
        return first_batch(loader)

    x0, y0 = batch(0)
    x_again, y_again = batch(0, batch_size=4)
    assert torch.equal(x0[:4], x_again) and torch.equal(y0[:4], y_again)  # same samples whatever the batch size
    x_workers, _ = batch(0, num_workers=1)
    assert torch.equal(x0, x_workers)
    assert not torch.equal(x0, batch(1)[0])
    assert not torch.equal(x0, batch(0, epoch=1)[0])
    dm = DigitsDataModule(batch_size=32)
    dm.setup()
    assert torch.equal(first_batch(dm.eval_dataloader(48))[0], first_batch(dm.eval_dataloader(48))[0])


def test_train_subset():
    dm = DigitsDataModule(train_subset=500, batch_size=600)
    dm.setup()
    assert len(dm.train_dataset) == 500 and len(first_batch(dm.train_dataloader())[1]) == 500
    assert not set(dm.train_indices.tolist()) & set(dm.val_indices.tolist())
    with pytest.raises(ValueError, match="train_subset = 4001 exceeds the 4000"):
        DigitsDataModule(train_subset=4001).setup()


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"protocol": "crop"}, ValueError, "protocol must be one of"),
        ({"img_size": 0}, ValueError, "img_size must be >= 1, got 0"),
        ({"img_size": 32.0}, TypeError, "img_size must be an int, got float"),
        ({"eval_sizes": (32, -1)}, ValueError, r"eval_sizes\[1\] must be >= 1"),
        ({"eval_sizes": 32}, TypeError, "eval_sizes must be a non-empty sequence"),
        ({"batch_size": True}, TypeError, "batch_size must be an int, got bool"),
        ({"train_fraction": 1.5}, ValueError, r"train_fraction must be in \(0, 1\)"),
        ({"scale": (0.5, 1.5)}, ValueError, "scale must satisfy"),
        ({"ratio": (2.0, 1.0)}, ValueError, "ratio must satisfy"),
        ({"translate": 1.0}, ValueError, "translate must be a float in"),
        ({"seed": -1}, ValueError, "seed must be >= 0"),
        ({"context": 0.5}, ValueError, r"context must be a float in \[1, 8\], got 0.5"),
        ({"protocol": "canvas", "context": 2.0}, ValueError, "context applies to protocol='resolution' only"),
        ({"protocol": "canvas", "img_size": 24}, ValueError, "img_size must be >= 28, got 24"),
        ({"protocol": "canvas", "eval_sizes": (32, 16)}, ValueError, r"eval_sizes\[1\] must be >= 28"),
    ],
)
def test_digits_argument_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        DigitsDataModule(**kwargs)


# --- digits, canvas protocol --------------------------------------------------------------------------------------


def test_canvas_keeps_the_digit_scale_and_pixels():
    dm = DigitsDataModule(protocol="canvas", img_size=32, batch_size=32)
    dm.setup()
    images, _ = load_digits()
    digits = images[dm.val_indices[:32]]
    places = set()
    for size in (32, 64, 128):
        x, _ = first_batch(dm.eval_dataloader(size))
        assert x.shape == (32, 3, size, size)
        pixels = (unnormalize(x)[:, 0] * 255).round().to(torch.uint8)
        for digit, canvas in zip(digits, pixels, strict=True):
            assert ink_box(canvas) == ink_box(digit)  # same object size in pixels at every canvas size
            assert torch.equal(torch.sort(canvas[canvas > 0]).values, torch.sort(digit[digit > 0]).values)
            rows = torch.nonzero(canvas.any(dim=1)).flatten()
            places.add((size, int(rows[0])))
    assert len({top for size, top in places if size == 128}) > 5  # placed at random, not centred
    x_train, _ = first_batch(dm.train_dataloader())
    assert x_train.shape == (32, 3, 32, 32)


def test_canvas_eval_is_seeded():
    def eval_batch(seed):
        dm = DigitsDataModule(protocol="canvas", batch_size=16, seed=seed)
        dm.setup()
        return first_batch(dm.eval_dataloader(64))[0]

    assert torch.equal(eval_batch(0), eval_batch(0))
    assert not torch.equal(eval_batch(0), eval_batch(5))


# --- moving digits ------------------------------------------------------------------------------------------------


def observed_motion(clip: torch.Tensor) -> tuple[str, int]:
    """Direction and speed that map frame 0 onto frame 1 of a (3, T, H, W) clip by a wrap-around shift."""
    frames = clip[0]
    for name, (dy, dx) in MOTION.items():
        for speed in range(1, 5):
            if torch.equal(frames[0].roll((dy * speed, dx * speed), dims=(0, 1)), frames[1]):
                return name, speed
    raise AssertionError("frame 1 is no shift of frame 0")


def test_moving_digits_shapes_and_labels_agree_with_digits_and_motion():
    dm = MovingDigitsDataModule(num_frames=8, eval_frames=(8, 16), batch_size=16)
    dm.setup()
    assert dm.num_classes == 40 and len(dm.train_dataset) == 4000 and len(dm.val_dataset) == 1000
    _, digit_labels = load_digits()
    x, y = first_batch(dm.train_dataloader())
    assert x.shape == (16, 3, 8, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    for dataset in (dm.train_dataset, dm.val_dataset):
        for index in range(0, 200, 7):
            clip, label = dataset[index]
            spec = dataset.clip_spec(index)
            direction, speed = observed_motion(clip)
            assert label == digit_labels[spec.digit_index] * 4 + DIRECTIONS.index(direction)
            assert speed == spec.speed and speed in (1, 2)
            split = dm.train_indices if dataset is dm.train_dataset else dm.val_indices
            assert spec.digit_index in split.tolist()
            for t in range(1, 8):  # constant motion over the whole clip
                dy, dx = MOTION[direction]
                assert torch.equal(clip[0, 0].roll((dy * speed * t, dx * speed * t), dims=(0, 1)), clip[0, t])
    labels = torch.stack([dm.val_dataset[i][1] for i in range(len(dm.val_dataset))])
    assert labels.unique().numel() == 40


def test_moving_digits_eval_clips_continue_the_val_clips():
    dm = MovingDigitsDataModule(batch_size=8)
    dm.setup()
    short, y_short = first_batch(dm.val_dataloader())
    long, y_long = first_batch(dm.eval_dataloader(32))
    assert long.shape == (8, 3, 32, 32, 32) and torch.equal(y_short, y_long)
    assert torch.equal(long[:, :, :8], short)
    assert [first_batch(loader)[0].shape[2] for loader in dm.test_dataloader()] == [8, 16, 32]
    assert dm.eval_sizes == (8, 16, 32) and dm.size_label == "frames"


def test_moving_digits_determinism():
    def train_batch(seed, epoch=0):
        dm = MovingDigitsDataModule(batch_size=8, seed=seed)
        dm.setup()
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(epoch)
        return first_batch(loader)

    x, y = train_batch(0)
    x_again, y_again = train_batch(0)
    assert torch.equal(x, x_again) and torch.equal(y, y_again)
    assert not torch.equal(x, train_batch(1)[0]) and not torch.equal(x, train_batch(0, epoch=2)[0])


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"num_frames": 1}, ValueError, "num_frames must be >= 2, got 1"),
        ({"eval_frames": (8, 1)}, ValueError, r"eval_frames\[1\] must be >= 2"),
        ({"digit_size": 40}, ValueError, "digit_size = 40 must not exceed img_size = 32"),
        ({"speeds": ()}, TypeError, "speeds must be a non-empty sequence"),
        ({"speeds": (1, 16)}, ValueError, r"speeds must be < img_size / 2 = 16 pixels per frame .*got \[1, 16\]"),
        ({"num_clips": 0}, ValueError, "num_clips must be >= 1"),
    ],
)
def test_moving_digits_argument_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        MovingDigitsDataModule(**kwargs)


# --- image folders ------------------------------------------------------------------------------------------------


def write_image(path: Path, size=(40, 30), value=128) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (value, value, value)).save(path)


def make_image_folder(root: Path, classes=("cat", "dog"), per_class=3) -> Path:
    for split in ("train", "val"):
        for c, name in enumerate(classes):
            for i in range(per_class):
                write_image(root / split / name / f"{i}.png", size=(40 + 8 * i, 30), value=40 * c + 10 * i)
    return root


def test_image_folder_shapes_and_eval_sizes(tmp_path):
    root = make_image_folder(tmp_path / "data")
    dm = ImageFolderDataModule(root, img_size=32, batch_size=4, num_workers=0, eval_sizes=(32, 48))
    dm.setup("fit")
    assert dm.classes == ["cat", "dog"] and dm.num_classes == 2
    x, y = first_batch(dm.train_dataloader())
    assert x.shape == (4, 3, 32, 32) and y.dtype == torch.int64
    x_val, y_val = first_batch(dm.val_dataloader())
    assert x_val.shape == (4, 3, 32, 32) and y_val.tolist() == [0, 0, 0, 1]
    assert [first_batch(loader)[0].shape for loader in dm.test_dataloader()] == [(4, 3, 32, 32), (4, 3, 48, 48)]
    # eval: a uniform image stays uniform and is normalised with ImageNet's statistics
    pixel = 10 / 255
    expected = (pixel - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
    assert torch.allclose(x_val[1].mean(dim=(1, 2)), expected, atol=1e-3)


def test_image_folder_errors(tmp_path):
    with pytest.raises(ValueError, match="root .*missing does not exist"):
        ImageFolderDataModule(tmp_path / "missing").setup()
    (tmp_path / "no_val" / "train" / "a").mkdir(parents=True)
    write_image(tmp_path / "no_val" / "train" / "a" / "0.png")
    with pytest.raises(ValueError, match=r"no_val/val does not exist"):
        ImageFolderDataModule(tmp_path / "no_val").setup()
    (tmp_path / "flat" / "train").mkdir(parents=True)
    (tmp_path / "flat" / "val").mkdir(parents=True)
    write_image(tmp_path / "flat" / "train" / "0.png")
    with pytest.raises(ValueError, match=r"flat/train has no class folders"):
        ImageFolderDataModule(tmp_path / "flat").setup()
    root = make_image_folder(tmp_path / "empty_class")
    (root / "train" / "fox").mkdir()
    (root / "train" / "fox" / "notes.txt").write_text("not an image")
    with pytest.raises(ValueError, match=r"class folder\(s\) without images \(.*train/fox\)"):
        ImageFolderDataModule(root).setup()
    root = make_image_folder(tmp_path / "mismatch")
    write_image(root / "val" / "fox" / "0.png")
    with pytest.raises(ValueError, match=r"only in train/: \[\], only in val/: \['fox'\]"):
        ImageFolderDataModule(root).setup()
    with pytest.raises(ValueError, match="crop_pct must be a float in"):
        ImageFolderDataModule(root, crop_pct=0.0)
    with pytest.raises(ValueError, match="interpolation must be one of"):
        ImageFolderDataModule(root, interpolation="area")
    with pytest.raises(TypeError, match="root must be a str or Path"):
        ImageFolderDataModule(3)


# --- frame folders ------------------------------------------------------------------------------------------------


def make_clips(root: Path, classes=("push", "pull"), clips=2, frames=6) -> Path:
    """Frame k of every clip is a uniform image of value 20 * k, so sampled indices can be read back."""
    for split in ("train", "val"):
        for name in classes:
            for c in range(clips):
                for k in range(frames):
                    write_image(root / split / name / f"clip{c}" / f"frame_{k}.png", size=(20, 16), value=20 * k)
    return root


def frame_values(x: torch.Tensor) -> list[int]:
    """The frame number of every frame of a (3, T, H, W) clip made by :func:`make_clips`."""
    values = unnormalize(x, IMAGENET_MEAN, IMAGENET_STD, channel_dim=0)[0].mean(dim=(1, 2)) * 255 / 20
    return values.round().int().tolist()


def test_frame_indices():
    assert frame_indices(20, 4, 2).tolist() == [6, 8, 10, 12]
    assert frame_indices(20, 4, 2, start=0).tolist() == [0, 2, 4, 6]
    assert frame_indices(5, 4, 2).tolist() == [0, 2, 4, 4]
    with pytest.raises(ValueError, match=r"start must be in \[0, 13\]"):
        frame_indices(20, 4, 2, start=14)


def test_frame_clips_folder_layout(tmp_path):
    root = make_clips(tmp_path / "clips", frames=12)
    dm = FrameClipDataModule(root, num_frames=4, stride=2, img_size=16, batch_size=2, num_workers=0, eval_frames=(2, 6))
    dm.setup("fit")
    assert dm.classes == ["pull", "push"] and dm.num_classes == 2 and len(dm.train_dataset) == 4
    assert dm.eval_sizes == (2, 6) and dm.size_label == "frames"
    assert [frame_values(first_batch(loader)[0][0]) for loader in dm.test_dataloader()] == [
        [4, 6],  # span 3 of 12 frames, centred
        [0, 2, 4, 6, 8, 10],  # span 11 of 12: slack 1, start 1 // 2 = 0
    ]
    x, y = first_batch(dm.val_dataloader())
    assert x.shape == (2, 3, 4, 16, 16) and y.tolist() == [0, 0]
    assert frame_values(x[0]) == [2, 4, 6, 8]  # centred: span 7 of 12 frames starts at 2
    x_train, _ = first_batch(dm.train_dataloader())
    assert x_train.shape == (2, 3, 4, 16, 16)
    for clip in x_train:
        values = frame_values(clip)
        assert values == list(range(values[0], values[0] + 8, 2)) and 0 <= values[0] <= 5


def test_frame_clips_short_clip_repeats_last_frame(tmp_path):
    root = make_clips(tmp_path / "clips", frames=5)
    dm = FrameClipDataModule(root, num_frames=4, stride=2, img_size=16, batch_size=1, num_workers=0)
    dm.setup()
    assert frame_values(dm.val_dataset[0][0]) == [0, 2, 4, 4]


def test_frame_clips_index_csv(tmp_path):
    root = make_clips(tmp_path / "clips", frames=8)
    for split in ("train", "val"):
        with (root / f"{split}.csv").open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["path", "label"])
            writer.writerows([[f"{split}/push/clip0", "push"], [f"{split}/pull/clip1", "pull"]])
    options = {"num_frames": 2, "stride": 3, "img_size": 16, "batch_size": 2, "num_workers": 0}
    dm = FrameClipDataModule(root, index_csv="{split}.csv", **options)
    dm.setup()
    assert dm.classes == ["pull", "push"] and len(dm.train_dataset) == 2
    x, y = first_batch(dm.val_dataloader())
    assert x.shape == (2, 3, 2, 16, 16) and y.tolist() == [1, 0]
    assert frame_values(x[0]) == [2, 5]


def test_frame_clips_errors(tmp_path):
    with pytest.raises(ValueError, match="clip root .*nothing does not exist"):
        FrameClipDataModule(tmp_path / "nothing").setup()
    root = make_clips(tmp_path / "no_clips")
    (root / "train" / "wave").mkdir()
    with pytest.raises(ValueError, match=r"class folder\(s\) without clip folders: .*train/wave"):
        FrameClipDataModule(root).setup()
    root = make_clips(tmp_path / "no_frames")
    (root / "val" / "push" / "clip9").mkdir()
    with pytest.raises(ValueError, match=r"1 clip folder\(s\) without frame files \(.*val/push/clip9\)"):
        FrameClipDataModule(root).setup()
    (tmp_path / "empty" / "train").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"empty/train has no class folders"):
        FrameClipDataModule(tmp_path / "empty").setup()
    root = make_clips(tmp_path / "csv")
    with pytest.raises(ValueError, match=r"index CSV .*train.csv does not exist"):
        FrameClipDataModule(root, index_csv="{split}.csv").setup()
    (root / "train.csv").write_text("clip,class\ntrain/push/clip0,push\n")
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['label', 'path'\]"):
        FrameClipDataModule(root, index_csv="{split}.csv").setup()
    (root / "train.csv").write_text("path,label\ntrain/push/clip7,push\n")
    with pytest.raises(ValueError, match=r"train.csv line 2: clip folder .*clip7 does not exist"):
        FrameClipDataModule(root, index_csv="{split}.csv").setup()
    (root / "train.csv").write_text("path,label\ntrain/push/clip0,push\n")
    (root / "val.csv").write_text("path,label\nval/pull/clip0,pull\n")
    with pytest.raises(ValueError, match=r"val classes \['pull'\] do not occur in train"):
        FrameClipDataModule(root, index_csv="{split}.csv").setup()
    (root / "val.csv").write_text("path,label\n")
    with pytest.raises(ValueError, match="val.csv has no rows"):
        FrameClipDataModule(root, index_csv="{split}.csv").setup()
    with pytest.raises(ValueError, match="index_csv must be None or a file name containing"):
        FrameClipDataModule(root, index_csv="train.csv")
    with pytest.raises(ValueError, match="stride must be >= 1, got 0"):
        FrameClipDataModule(root, stride=0)


def test_frames_of_different_sizes_are_an_error(tmp_path):
    root = make_clips(tmp_path / "clips", frames=4)
    write_image(root / "val" / "pull" / "clip0" / "frame_3.png", size=(24, 16))
    dm = FrameClipDataModule(root, num_frames=4, stride=1, img_size=16, num_workers=0)
    dm.setup()
    with pytest.raises(ValueError, match=r"val/pull/clip0: frames differ in size"):
        dm.val_dataset[0]


def test_fresh_interpreter_finds_the_digits_from_the_repository(tmp_path):
    code = f"import sys; sys.path.insert(0, {str(REPO / 'train')!r}); from experiments import load_digits; "
    code += "print(load_digits()[0].shape[0])"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "5000"


def test_epoch_sampler_under_lightning_ddp_wrapper():
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    ranks = [DistributedSamplerWrapper(EpochSampler(10, seed=0), num_replicas=2, rank=r, shuffle=False) for r in (0, 1)]
    for wrapper in ranks:
        wrapper.set_epoch(3)
    items = [list(wrapper) for wrapper in ranks]
    assert sorted(index for rank_items in items for index, _ in rank_items) == list(range(10))
    assert {epoch for rank_items in items for _, epoch in rank_items} == {3}


def test_lightning_fit_sets_the_sampler_epoch():
    import lightning as L

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3 * 32 * 32, 10)
            self.first_labels = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            if batch_idx == 0:
                self.first_labels.append(y.clone())
            return torch.nn.functional.cross_entropy(self.layer(x.flatten(1)), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    model = Recorder()
    quiet = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    trainer = L.Trainer(max_epochs=2, limit_train_batches=1, limit_val_batches=0, accelerator="cpu", **quiet)
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=16))
    assert len(model.first_labels) == 2 and not torch.equal(*model.first_labels)


# --- determinism of the folder data modules and their checkpointed hyperparameters ---------------------------------


def write_noise_image(path: Path, seed: int, size=(40, 30)) -> None:
    """A random RGB image (seeded), so that crops, flips and RandAugment change the pixels."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def make_noise_image_folder(root: Path, classes=("cat", "dog"), per_class=4) -> Path:
    for s, split in enumerate(("train", "val")):
        for c, name in enumerate(classes):
            for i in range(per_class):
                write_noise_image(root / split / name / f"{i}.png", seed=100 * s + 10 * c + i)
    return root


def make_noise_clips(root: Path, classes=("push", "pull"), clips=3, frames=10) -> Path:
    for s, split in enumerate(("train", "val")):
        for c, name in enumerate(classes):
            for k in range(clips):
                for f in range(frames):
                    seed = 1000 * s + 100 * c + 10 * k + f
                    write_noise_image(root / split / name / f"clip{k}" / f"frame_{f}.png", seed, size=(20, 16))
    return root


def global_rng_states() -> tuple:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def assert_same_states(before: tuple, after: tuple, torch_too: bool = True) -> None:
    if torch_too:
        assert torch.equal(before[0], after[0]), "torch's global RNG state changed"
    assert before[1] == after[1], "Python's random state changed"
    numpy_before, numpy_after = before[2], after[2]
    assert np.array_equal(numpy_before[1], numpy_after[1]) and numpy_before[2:] == numpy_after[2:], "NumPy's changed"


def reseed_globals(value: int) -> None:
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value)


def read_epoch(loader, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
    loader.sampler.set_epoch(epoch)
    xs, ys = zip(*loader, strict=True)
    return torch.cat(xs), torch.cat(ys)


def frame_clip_module(root: Path, seed: int):
    options = {"num_frames": 3, "stride": 2, "img_size": 12, "batch_size": 2, "num_workers": 0}
    return FrameClipDataModule(root, scale=(0.3, 1.0), hflip=0.5, seed=seed, **options)


def image_folder_module(root: Path, seed: int):
    return ImageFolderDataModule(root, img_size=16, batch_size=4, num_workers=0, re_prob=0.5, seed=seed)


@pytest.mark.parametrize("kind", ["image_folder", "frame_clips"])
def test_folder_training_batches_are_a_function_of_seed_and_epoch(tmp_path, kind):
    if kind == "image_folder":
        root, make = make_noise_image_folder(tmp_path / "images"), image_folder_module
    else:
        root, make = make_noise_clips(tmp_path / "clips"), frame_clip_module
    reseed_globals(1)
    dm = make(root, seed=0)
    loader = dm.train_dataloader()
    before = global_rng_states()
    x, y = read_epoch(loader, 0)
    # the DataLoader's iterator draws its worker base seed from torch's RNG; the samples touch no global RNG
    assert_same_states(before, global_rng_states(), torch_too=False)
    x1, y1 = read_epoch(loader, 1)
    assert len(x) == len(dm.train_dataset) and sorted(y.tolist()) == sorted(y1.tolist())
    assert not torch.equal(x, x1)  # a new order and new augmentation each epoch

    reseed_globals(2)  # as after a resume: other global RNG states, a fresh data module, straight into epoch 1
    fresh = make(root, seed=0).train_dataloader()
    x1_again, y1_again = read_epoch(fresh, 1)
    assert torch.equal(x1, x1_again) and torch.equal(y1, y1_again)
    reseed_globals(3)
    x_again, y_again = read_epoch(fresh, 0)
    assert torch.equal(x, x_again) and torch.equal(y, y_again)
    assert not torch.equal(x, read_epoch(make(root, seed=1).train_dataloader(), 0)[0])

    dataset = dm.train_dataset  # single items: a pure function of (index, epoch), no global RNG touched
    before = global_rng_states()
    first = [dataset[(index, 1)][0] for index in range(len(dataset))]
    assert_same_states(before, global_rng_states())
    reseed_globals(4)
    assert all(torch.equal(item, dataset[(index, 1)][0]) for index, item in enumerate(first))
    assert not all(torch.equal(item, dataset[(index, 2)][0]) for index, item in enumerate(first))
    assert torch.equal(dataset[0][0], dataset[(0, 0)][0])  # a plain index is epoch 0


def test_folder_eval_batches_stay_fixed_and_unshuffled(tmp_path):
    root = make_noise_image_folder(tmp_path / "images")
    dm = image_folder_module(root, seed=0)
    reseed_globals(5)
    x, y = first_batch(dm.val_dataloader())
    reseed_globals(6)
    x_other, y_other = first_batch(image_folder_module(root, seed=1).val_dataloader())
    assert torch.equal(x, x_other) and y.tolist() == y_other.tolist() == [0, 0, 0, 0]
    clips = make_noise_clips(tmp_path / "clips")
    x, y = first_batch(frame_clip_module(clips, seed=0).eval_dataloader(2))
    x_other, y_other = first_batch(frame_clip_module(clips, seed=1).eval_dataloader(2))
    assert torch.equal(x, x_other) and y.tolist() == y_other.tolist() == [0, 0]


@pytest.mark.parametrize("kind", ["image_folder", "frame_clips", "digits", "moving_digits"])
def test_hyperparameters_with_paths_load_with_weights_only(tmp_path, kind):
    """Lightning saves ``dict(datamodule.hparams)`` in checkpoints and loads them with torch's weights_only unpickler,
    which rejects ``pathlib`` objects: paths must be stored as str."""
    if kind == "image_folder":
        dm, key = ImageFolderDataModule(make_image_folder(tmp_path / "images"), seed=2), "root"
    elif kind == "frame_clips":
        dm, key = FrameClipDataModule(make_clips(tmp_path / "clips"), seed=2), "root"
    elif kind == "digits":
        dm, key = DigitsDataModule(digits_path=DIGITS_PATH), "digits_path"
    else:
        dm, key = MovingDigitsDataModule(digits_path=DIGITS_PATH), "digits_path"
    assert isinstance(dm.hparams[key], str) and dm.hparams["seed"] == (0 if "digits" in kind else 2)
    buffer = io.BytesIO()
    torch.save(dict(dm.hparams), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded == dict(dm.hparams)
    rebuilt = type(dm)(**loaded)  # the module rebuilt from its checkpointed hyperparameters
    assert dict(rebuilt.hparams) == loaded
    if kind in ("image_folder", "frame_clips"):
        assert isinstance(dm.root, Path) and rebuilt.root == dm.root


@pytest.mark.parametrize("kwargs", [{"seed": -1}, {"seed": 1.5}])
def test_folder_modules_check_the_seed(tmp_path, kwargs):
    for cls in (ImageFolderDataModule, FrameClipDataModule):
        with pytest.raises((ValueError, TypeError), match="seed must be"):
            cls(tmp_path, **kwargs)
