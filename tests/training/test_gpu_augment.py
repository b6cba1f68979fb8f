"""The batched (kornia) training augmentation and the data modules' ``gpu_pipeline``, on the CPU.

The statistical tests compare against timm's own samplers with thresholds of a two-sample Kolmogorov-Smirnov test
at a 1e-3 false-alarm level, and check with a control that the same threshold rejects a slightly different sampler.
"""

import math
import random

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import auto_augment as timm_aa
from timm.data.transforms import RandomResizedCropAndInterpolation

from visionpe.training import Classifier, FrameClipDataModule, ImageFolderDataModule
from visionpe.training.gpu_augment import (
    BatchAugment,
    RandAugmentPolicy,
    _apply_op,
    _level_arg,
    _prepare_batch,
    parse_rand_augment,
    resized_crops,
    sample_resized_crop,
)
from visionpe.training.image_folder import IMAGENET_MEAN, IMAGENET_STD

N = 4000


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov distance sup |F_a - F_b|."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    return float(np.abs(np.searchsorted(a, grid, "right") / len(a) - np.searchsorted(b, grid, "right") / len(b)).max())


def ks_threshold(n: int, m: int, alpha: float = 1e-3) -> float:
    """The KS distance exceeded with probability ``alpha`` by two samples of one distribution."""
    return math.sqrt(-0.5 * math.log(alpha / 2)) * math.sqrt((n + m) / (n * m))


def timm_boxes(height: int, width: int, scale, ratio, count: int, seed: int) -> np.ndarray:
    random.seed(seed)
    image = Image.new("RGB", (width, height))
    get = RandomResizedCropAndInterpolation.get_params
    return np.array([get(image, scale, ratio) for _ in range(count)], dtype=np.float64)  # (top, left, h, w)


def crop_statistics(boxes: np.ndarray, height: int, width: int) -> dict[str, np.ndarray]:
    top, left, h, w = boxes.T
    return {
        "area": h * w / (height * width),
        "log_ratio": np.log(w / h),
        "top": (top + 0.5) / (height - h + 1),
        "left": (left + 0.5) / (width - w + 1),
    }


@pytest.mark.parametrize("height, width", [(300, 400), (60, 400)])  # the second often falls back to a centre crop
def test_crop_boxes_follow_timm_random_resized_crop(height, width):
    scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
    ours = sample_resized_crop([height] * N, [width] * N, scale, ratio, torch.Generator().manual_seed(0)).numpy()
    theirs = timm_boxes(height, width, scale, ratio, N, seed=0)
    assert (ours[:, 0] + ours[:, 2] <= height).all() and (ours[:, 1] + ours[:, 3] <= width).all()
    assert (ours >= 0).all() and (ours[:, 2:] >= 1).all()
    threshold = ks_threshold(N, N)
    ours_stats, theirs_stats = crop_statistics(ours, height, width), crop_statistics(theirs, height, width)
    for key in ours_stats:
        assert ks_statistic(ours_stats[key], theirs_stats[key]) < threshold, key
    # control: the same test rejects a sampler with another area range or another ratio range
    for other_scale, other_ratio in (((0.2, 1.0), ratio), (scale, (0.6, 1.6))):
        control = crop_statistics(timm_boxes(height, width, other_scale, other_ratio, N, seed=1), height, width)
        distances = [ks_statistic(control[key], theirs_stats[key]) for key in ("area", "log_ratio")]
        assert max(distances) > 2 * threshold
    # the central-crop fallback happens as often as in timm (binomial bound, 5 sigma)
    central = [
        np.mean((b[:, 0] == (height - b[:, 2]) // 2) & (b[:, 1] == (width - b[:, 3]) // 2)) for b in (ours, theirs)
    ]
    p = max(central[1], 1 / N)
    assert abs(central[0] - central[1]) < 5 * math.sqrt(2 * p * (1 - p) / N) + 1e-9


def test_crop_stage_of_the_pipeline_cuts_the_sampled_boxes():
    # images whose pixel values are their coordinates: the crop's corners give the box back
    height, width, size = 90, 120, 16
    ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    image = torch.stack([ys, xs, ys * 0]).float()[None].repeat(6, 1, 1, 1)
    aug = BatchAugment(size, hflip=0.0, rand_augment=None, re_prob=0.0, mean=(0, 0, 0), std=(1, 1, 1))
    params = aug.sample_params(6, [height] * 6, [width] * 6, torch.Generator().manual_seed(3))
    out = aug(image / 255, params) * 255
    top, left, h, w = params["crop"].float().unbind(1)
    torch.testing.assert_close(out[:, 0, 0, 0], top, atol=1e-3, rtol=0)
    torch.testing.assert_close(out[:, 1, 0, 0], left, atol=1e-3, rtol=0)
    torch.testing.assert_close(out[:, 0, -1, -1], top + h - 1, atol=1e-3, rtol=0)
    torch.testing.assert_close(out[:, 1, -1, -1], left + w - 1, atol=1e-3, rtol=0)


def test_flip_rate_is_half_and_flips_the_images():
    aug = BatchAugment(8, hflip=0.5, rand_augment=None, re_prob=0.0)
    flips = aug.sample_params(20000, generator=torch.Generator().manual_seed(0))["flip"].double()
    assert abs(flips.mean().item() - 0.5) < 5 * math.sqrt(0.25 / 20000)
    x = torch.rand(64, 3, 8, 8)
    params = aug.sample_params(64, generator=torch.Generator().manual_seed(1))
    out = aug(x, params)
    plain = (x - torch.tensor(IMAGENET_MEAN)[:, None, None]) / torch.tensor(IMAGENET_STD)[:, None, None]
    for image, flip, reference in zip(out, params["flip"], plain, strict=True):
        torch.testing.assert_close(image, reference.flip(-1) if flip else reference)
    assert 0 < params["flip"].sum() < 64


def test_seeded_runs_are_equal_and_seeds_differ():
    aug = BatchAugment(24)
    x = torch.randint(0, 256, (8, 3, 40, 30), dtype=torch.uint8)
    first = aug(x, generator=torch.Generator().manual_seed(7))
    again = aug(x, generator=torch.Generator().manual_seed(7))
    other = aug(x, generator=torch.Generator().manual_seed(8))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert first.shape == (8, 3, 24, 24) and first.dtype == torch.float32


def test_clips_get_the_same_parameters_on_every_frame():
    aug = BatchAugment(16, rand_augment="rand-m9-mstd0.5-inc1", re_prob=0.5)
    clips = torch.randint(0, 256, (6, 4, 3, 32, 28), dtype=torch.uint8)
    params = aug.sample_params(6, [32] * 6, [28] * 6, torch.Generator().manual_seed(0))
    out = aug(clips, params)
    assert out.shape == (6, 4, 3, 16, 16)
    for t in range(4):  # each frame is what its image would give with the clip's parameters
        torch.testing.assert_close(out[:, t], aug(clips[:, t], params), rtol=0, atol=1e-5)
    same = clips[:, :1].expand(-1, 4, -1, -1, -1)  # identical frames stay identical
    out = aug(same, params)
    assert torch.equal(out, out[:, :1].expand_as(out))


@pytest.mark.parametrize("name", RandAugmentPolicy(increasing=True).ops + ("Posterize", "Solarize", "Contrast"))
def test_rand_augment_ops_match_timm(name):
    generator = torch.Generator().manual_seed(0)
    smooth = torch.nn.functional.interpolate(torch.rand(1, 3, 8, 8, generator=generator), size=64, mode="bilinear")
    image = (smooth[0] * 255).round().to(torch.uint8)
    pil = Image.fromarray(image.permute(1, 2, 0).numpy())
    fill = BatchAugment(64).fill
    for level, sign in ((9.0, 1.0), (5.0, -1.0)):
        arg = _level_arg(name, torch.tensor([level]), torch.tensor([sign]))
        ours = _apply_op(name, image[None].float() / 255, arg, fill)[0] * 255
        value = arg.item()
        args = (
            ()
            if name in ("AutoContrast", "Equalize", "Invert")
            else (int(value),)
            if "olarize" in name or "oster" in name
            else (value,)
        )
        reference = timm_aa.NAME_TO_OP[name](pil, *args, fillcolor=(124, 116, 104), resample=Image.BILINEAR)
        reference = torch.tensor(np.array(reference)).permute(2, 0, 1).float()
        assert (ours - reference).abs().mean() < 2.0, (name, level, sign)  # levels of 255; a wrong sign gives > 10


def test_rand_augment_draws_follow_the_policy():
    policy = parse_rand_augment("rand-m9-mstd0.5-inc1")
    assert policy == RandAugmentPolicy(magnitude=9.0, num_layers=2, prob=0.5, magnitude_std=0.5, increasing=True)
    params = BatchAugment(8, rand_augment=policy).sample_params(N, generator=torch.Generator().manual_seed(0))
    assert params["ra_op"].shape == (N, 2)
    counts = torch.bincount(params["ra_op"].flatten(), minlength=15).double()
    expected = 2 * N / 15
    assert ((counts - expected).abs() < 5 * math.sqrt(expected)).all()  # uniform per image and layer
    assert abs(params["ra_apply"].double().mean().item() - 0.5) < 5 * math.sqrt(0.25 / (2 * N))
    level = params["ra_level"]
    assert level.max() <= 10.0 and abs(level.mean().item() - 9.0) < 0.05 and abs(level.std().item() - 0.5) < 0.05


def write_jpeg(path, size, colour):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path, quality=100)


COLOURS = {"a": (200, 100, 50), "b": (20, 160, 240)}


@pytest.fixture
def jpeg_folder(tmp_path):
    for split in ("train", "val"):
        for name, colour in COLOURS.items():
            for i, size in enumerate([(40, 30), (25, 50), (64, 64)]):
                write_jpeg(tmp_path / split / name / f"{i}.jpg", size, colour)
    return tmp_path


def test_image_data_module_gpu_pipeline_batches(jpeg_folder):
    data = ImageFolderDataModule(
        jpeg_folder, img_size=24, batch_size=4, num_workers=0, auto_augment=None, re_prob=0.0, gpu_pipeline=True
    )
    raw = next(iter(data.train_dataloader()))
    x, y, params = raw
    assert x.shape == (4, 3, 24, 24) and x.dtype == torch.uint8 and y.dtype == torch.int64
    assert "crop" not in params and params["flip"].shape == (4,)
    images, labels = data.on_after_batch_transfer(raw, 0)
    assert images.shape == (4, 3, 24, 24) and images.dtype == torch.float32 and torch.equal(labels, y)
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None, None], torch.tensor(IMAGENET_STD)[:, None, None]
    for image, label in zip(images, labels.tolist(), strict=True):  # solid colours: normalised to within JPEG error
        colour = torch.tensor(COLOURS[data.classes[label]], dtype=torch.float32)[:, None, None] / 255
        assert ((image - (colour - mean) / std).abs() * std).max() < 4 / 255
    val = next(iter(data.val_dataloader()))
    assert data.on_after_batch_transfer(val, 0) is val  # evaluation stays timm's CPU transform


def test_image_data_module_gpu_pipeline_is_seeded(jpeg_folder):
    def first(seed, workers):
        data = ImageFolderDataModule(
            jpeg_folder, img_size=16, batch_size=6, num_workers=workers, seed=seed, gpu_pipeline=True
        )
        return data.on_after_batch_transfer(next(iter(data.train_dataloader())), 0)[0]

    reference = first(0, 0)
    assert torch.equal(reference, first(0, 1))  # workers do not change the batch
    assert not torch.equal(reference, first(1, 0))


def test_clip_data_module_gpu_pipeline_batches(tmp_path):
    for split in ("train", "val"):
        for name, colour in COLOURS.items():
            for clip in range(2):
                for frame in range(5):
                    write_jpeg(tmp_path / split / name / f"clip{clip}" / f"{frame}.jpg", (40, 30), colour)
    data = FrameClipDataModule(
        tmp_path, num_frames=3, stride=1, img_size=16, batch_size=2, num_workers=0, hflip=0.5, gpu_pipeline=True
    )
    raw = next(iter(data.train_dataloader()))
    assert raw[0].shape == (2, 3, 3, 16, 16) and raw[0].dtype == torch.uint8  # (B, T, C, S, S)
    clips, labels = data.on_after_batch_transfer(raw, 0)
    assert clips.shape == (2, 3, 3, 16, 16) and clips.dtype == torch.float32  # (B, C, T, S, S)
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None, None, None], torch.tensor(IMAGENET_STD)[:, None, None, None]
    for clip, label in zip(clips, labels.tolist(), strict=True):
        colour = torch.tensor(COLOURS[data.classes[label]], dtype=torch.float32)[:, None, None, None] / 255
        assert ((clip - (colour - mean) / std).abs() * std).max() < 4 / 255


def test_resized_crops_of_images_of_several_sizes():
    images = [torch.full((3, 20, 30), 10, dtype=torch.uint8), torch.full((3, 50, 12), 200, dtype=torch.uint8)]
    out = resized_crops(images, torch.tensor([[2, 3, 10, 20], [0, 0, 50, 12]]), 8, ["bilinear", "bicubic"])
    assert out.shape == (2, 3, 8, 8) and out.dtype == torch.uint8
    assert (out[0] == 10).all() and (out[1] == 200).all()


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: BatchAugment(0), ValueError, "size"),
        (lambda: BatchAugment(8.0), TypeError, "size"),
        (lambda: BatchAugment(8, hflip=1.5), ValueError, "hflip"),
        (lambda: BatchAugment(8, re_prob="0.2"), TypeError, "re_prob"),
        (lambda: BatchAugment(8, scale=(0.5, 0.1)), ValueError, "scale"),
        (lambda: BatchAugment(8, ratio=(0.0, 1.0)), ValueError, "ratio"),
        (lambda: BatchAugment(8, rand_augment="augmix-m5"), ValueError, "policy"),
        (lambda: BatchAugment(8, rand_augment="rand-m9-x3"), ValueError, "policy"),
        (lambda: BatchAugment(8, rand_augment=9), TypeError, "rand_augment"),
        (lambda: BatchAugment(8, interpolation="nearest"), ValueError, "interpolation"),
        (lambda: BatchAugment(8)(torch.zeros(3, 8, 8)), ValueError, "x must be"),
        (lambda: BatchAugment(8)(torch.zeros(2, 3, 8, 8, dtype=torch.int32)), TypeError, "x must be"),
        (lambda: BatchAugment(8)(torch.zeros(2, 3, 8, 8), params={"flip": torch.zeros(2)}), ValueError, "params"),
        (
            lambda: BatchAugment(8)(torch.zeros(2, 3, 9, 9), params=BatchAugment(8).sample_params(2)),
            ValueError,
            "x must",
        ),
        (lambda: BatchAugment(8).sample_params(2, heights=[4, 4]), ValueError, "heights and widths"),
        (lambda: sample_resized_crop([0], [4]), ValueError, "heights"),
        (lambda: sample_resized_crop([4.0], [4]), TypeError, "heights"),
        (lambda: resized_crops([torch.zeros(3, 4, 4)], torch.tensor([[0, 0, 5, 4]]), 2), ValueError, "boxes"),
        (lambda: ImageFolderDataModule("x", gpu_pipeline="yes"), TypeError, "gpu_pipeline"),
        (lambda: ImageFolderDataModule("x", gpu_pipeline=True, auto_augment="original"), ValueError, "auto_augment"),
        (lambda: ImageFolderDataModule("x", gpu_pipeline=True, interpolation="nearest"), ValueError, "interpolation"),
        (lambda: FrameClipDataModule("x", decode_on_device=1), TypeError, "decode_on_device"),
    ],
)
def test_bad_arguments_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_trainer_runs_the_hooks_of_the_gpu_pipeline(jpeg_folder):
    seen = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen.append((batch[0].shape, batch[0].dtype, len(batch)))

    model = Classifier(
        "visionpe_vit_small_patch16_224",
        model_kwargs={"img_size": 16, "patch_size": 8, "embed_dim": 16, "depth": 1, "num_heads": 2},
        num_classes=2,
    )
    data = ImageFolderDataModule(jpeg_folder, img_size=16, batch_size=2, num_workers=0, gpu_pipeline=True)
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[Record()],
    )
    trainer.fit(model, data)
    assert seen == [(torch.Size([2, 3, 16, 16]), torch.float32, 2)] * 2


def test_encoded_batches_decoded_before_the_transfer_equal_worker_decoded_ones(jpeg_folder, monkeypatch):
    # the path of a CUDA trainer (workers send file bytes, the batch is decoded before the transfer), run on the CPU
    data = ImageFolderDataModule(jpeg_folder, img_size=16, batch_size=6, num_workers=0, gpu_pipeline=True)
    decoded = next(iter(data.train_dataloader()))
    monkeypatch.setattr(data, "_decodes_on_device", lambda: True)
    encoded = next(iter(data.train_dataloader()))
    assert isinstance(encoded[0], list) and "crop" in encoded[2]
    prepared = _prepare_batch(encoded, torch.device("cpu"), 16, clips=False)
    assert torch.equal(prepared[0], decoded[0])
    first, second = data.on_after_batch_transfer(prepared, 0), data.on_after_batch_transfer(decoded, 0)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
