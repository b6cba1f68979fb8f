"""Random multimodal batches, transformers' reference rope index and what the designs do with videos, shared by the
multimodal tests."""

from __future__ import annotations

from types import SimpleNamespace

import torch

# What a design does with videos, which its registry entry does not declare (MultimodalScheme has no field for it),
# kept here with the reason; tests/multimodal/test_position_ids.py checks both against what the designs do. Every
# other design places videos and needs no option for them: a new design is tested with videos without an entry here.
# - designs that raise on a video
IMAGES_ONLY = {"circle_rope": "Circle-RoPE's paper defines images only"}
# - designs that need ``second_per_grid_ts`` (one value per video) whenever there are videos
NEEDS_TIME = {"mrope_abs_time": "Qwen2.5-VL's temporal ids are absolute times, so every path must give the timing"}


def max_videos(scheme: str, count: int = 2) -> int:
    """``count``, or 0 for a design that places no videos (``IMAGES_ONLY``)."""
    return 0 if scheme in IMAGES_ONLY else count


def video_options(scheme: str, num_videos: int) -> dict:
    """The options a batch with ``num_videos`` videos needs: ``second_per_grid_ts`` (1 s each) for ``NEEDS_TIME``."""
    return {"second_per_grid_ts": torch.full((num_videos,), 1.0)} if scheme in NEEDS_TIME else {}


def random_batch(
    generator: torch.Generator,
    batch_size: int = 4,
    max_images: int = 3,
    max_videos: int = 0,
    max_text: int = 6,
    padding: str = "left",
    merge: int = 2,
):
    """(token_type_ids, attention_mask, image_grid_thw, video_grid_thw): text runs separate visual blocks."""
    rows, image_grids, video_grids = [], [], []

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=generator))

    for _ in range(batch_size):
        blocks = [1] * randint(0, max_images) + [2] * randint(0, max_videos)
        order = torch.randperm(len(blocks), generator=generator).tolist()
        row = [0] * randint(1, max_text)
        for idx in order:
            kind = blocks[idx]
            t = 1 if kind == 1 else randint(1, 4)
            h, w = randint(1, 3) * merge, randint(1, 3) * merge
            (image_grids if kind == 1 else video_grids).append((t, h, w))
            row += [kind] * (t * (h // merge) * (w // merge)) + [0] * randint(1, max_text)
        rows.append(row)
    length = max(len(r) for r in rows)
    types = torch.zeros(batch_size, length, dtype=torch.long)
    mask = torch.zeros(batch_size, length, dtype=torch.long)
    for b, row in enumerate(rows):
        sl = slice(length - len(row), length) if padding == "left" else slice(0, len(row))
        types[b, sl] = torch.tensor(row)
        mask[b, sl] = 1
    image = torch.tensor(image_grids, dtype=torch.long).view(-1, 3) if image_grids else None
    video = torch.tensor(video_grids, dtype=torch.long).view(-1, 3) if video_grids else None
    return types, mask, image, video


def hf_rope_index(model_cls, tokens_per_second: float = 2.0, merge: int = 2):
    """transformers' ``get_rope_index`` bound to a stand-in for the model (it only reads the config)."""
    vision = SimpleNamespace(spatial_merge_size=merge, tokens_per_second=tokens_per_second)
    fake = SimpleNamespace(config=SimpleNamespace(vision_config=vision))
    fake.get_vision_position_ids = lambda *a, **k: model_cls.get_vision_position_ids(fake, *a, **k)
    return lambda *a, **k: model_cls.get_rope_index(fake, *a, **k)
