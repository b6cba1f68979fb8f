"""Mixed-resolution (NaFlex) batches: every registered scheme encodes each image of a batch at its own grid, so an
image's logits in a mixed batch equal its logits alone; timm's NaFlex loader feeds the model; bad layouts are refused.
"""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from timm.data import create_naflex_loader
from timm.data.naflex_transforms import patchify_image

import visionpe
from visionpe.grid import MixedGrid, mixed_grid
from visionpe.models.naflex import NAFLEX_KEYS, apply_per_grid, embed_patches, naflex_inputs, pool_valid

from .conftest import ALL_SCHEMES, scheme_class
from .reliability.helpers import perturb_

PATCH = 4
GRIDS = [(3, 5), (4, 4), (2, 3)]  # non-square, square, small; padded to N = 20 patches


def naflex_batch(images: list[torch.Tensor], num_patches: int, patch: int = PATCH) -> dict[str, torch.Tensor]:
    """timm's NaFlex layout of ``images`` (C, H, W): each patchified by timm, padded to ``num_patches``."""
    items = [patchify_image(image, (patch, patch)) for image in images]
    batch = len(items)
    patches = torch.zeros(batch, num_patches, items[0][0].shape[1])
    coord = torch.zeros(batch, num_patches, 2, dtype=torch.long)
    valid = torch.zeros(batch, num_patches, dtype=torch.bool)
    for i, (p, c, v) in enumerate(items):
        patches[i, : len(p)], coord[i, : len(p)], valid[i, : len(p)] = p, c, v
    return {"patches": patches, "patch_coord": coord, "patch_valid": valid}


def grid_images(grids=GRIDS, patch: int = PATCH) -> list[torch.Tensor]:
    return [torch.randn(3, h * patch, w * patch) for h, w in grids]


def tiny(pos_embed, **kwargs) -> visionpe.VisionPEViT:
    """Depth 2, width 32, two heads, 4 px patches at any image size; parameters moved off their init."""
    args = dict(depth=2, embed_dim=32, num_heads=2, num_classes=5, img_size=16, patch_size=PATCH, dynamic_img_size=True)
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=pos_embed, **{**args, **kwargs})
    return perturb_(model).eval()


def assert_each_alone(model, images, batch, **forward_kwargs) -> torch.Tensor:
    with torch.no_grad():
        mixed = model(batch, **forward_kwargs)
        for i, image in enumerate(images):
            alone = model(image[None])[0]
            torch.testing.assert_close(mixed[i], alone, rtol=0, atol=1e-5, msg=f"image {i} at grid {GRIDS[i]}")
    return mixed


# every scheme that declares mixed-resolution batches (``supports_mixed_resolution``)
MIXED = [n for n in ALL_SCHEMES if scheme_class(n).supports_mixed_resolution]


@pytest.mark.parametrize("name", MIXED)
def test_mixed_batch_logits_equal_each_image_alone(name):
    model = tiny(name)
    images = grid_images()
    mixed = assert_each_alone(model, images, naflex_batch(images, 20))
    assert not torch.allclose(mixed[0], mixed[1], atol=1e-3)  # the images give different logits


@pytest.mark.parametrize("name", ["learned", "cpe", "rope_dinov3", "fire"])
def test_masked_pooling_and_register_tokens(name):
    # average pooling over the valid patches only, register tokens and no class token
    model = tiny(name, global_pool="avg", class_token=False, reg_tokens=2, fc_norm=True)
    images = grid_images()
    assert_each_alone(model, images, naflex_batch(images, 24))


def test_three_tensors_equal_the_dict():
    model = tiny(["learned", "rope_mixed"])
    images = grid_images()
    batch = naflex_batch(images, 20)
    with torch.no_grad():
        from_dict = model(batch)
        from_tensors = model(batch["patches"], patch_coord=batch["patch_coord"], patch_valid=batch["patch_valid"])
        features = model.forward_features(batch)
    assert torch.equal(from_dict, from_tensors)
    assert features["patches"].shape == (3, 1 + 20, 32) and torch.equal(features["patch_valid"], batch["patch_valid"])


def test_one_grid_without_padding_equals_the_image_batch():
    model = tiny("alibi2d")
    images = torch.randn(2, 3, 12, 20)
    with torch.no_grad():
        torch.testing.assert_close(model(naflex_batch(list(images), 15)), model(images), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["learned", "rope_mixed", "kerple_log", "cpe"])
def test_training_step_gives_finite_gradients(name):
    model = tiny(name).train()
    loss = model(naflex_batch(grid_images(), 20)).square().mean()
    loss.backward()
    grads = [p.grad for p in model.pos_schemes.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


class _Images(torch.utils.data.Dataset):
    """Four PIL images of different aspect ratios and labels 0..2."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        sizes = [(40, 24), (32, 32), (16, 48), (24, 40)]
        self.items = [
            (Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)), i % 3) for i, (h, w) in enumerate(sizes)
        ]
        self.transform = None  # set by timm's NaFlex loader

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        image, target = self.items[index]
        return (self.transform(image) if self.transform is not None else image), target


def naflex_loader(is_training: bool):
    return create_naflex_loader(
        _Images(),
        patch_size=8,
        max_seq_len=16,
        train_seq_lens=(16,),
        batch_size=4,
        is_training=is_training,
        num_workers=0,
        use_prefetcher=False,
        pin_memory=False,
        device=torch.device("cpu"),
        persistent_workers=False,
    )


def test_timm_naflex_loader_feeds_a_training_step():
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224", pos_embed=["learned", "rope_axial"], depth=2, embed_dim=32, num_heads=2,
        num_classes=3, img_size=32, patch_size=8,
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = next(iter(naflex_loader(is_training=True)))
    before = model.pos_schemes.learned.pos_embed.detach().clone()
    loss = torch.nn.functional.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss) and not torch.equal(model.pos_schemes.learned.pos_embed, before)
    # evaluation batches hold several grids; each image's logits are its own
    inputs, _ = next(iter(naflex_loader(is_training=False)))
    layout = mixed_grid(inputs["patch_coord"], inputs["patch_valid"])
    assert len(layout.groups) > 1
    model.eval()
    with torch.no_grad():
        mixed = model(inputs)
        for i, n in enumerate(layout.lengths):
            single = {k: inputs[k][i : i + 1, :n] for k in NAFLEX_KEYS}
            torch.testing.assert_close(mixed[i], model(single)[0], rtol=0, atol=1e-5)


def test_mixed_grid_layout():
    coord = torch.tensor([[[0, 0], [0, 1], [0, 0]], [[0, 0], [1, 0], [2, 0]], [[0, 0], [0, 1], [0, 0]]])
    valid = torch.tensor([[True, True, False], [True, True, True], [True, True, False]])
    layout = mixed_grid(coord, valid)
    assert isinstance(layout, MixedGrid)
    assert layout.grid_sizes == ((1, 2), (3, 1), (1, 2)) and layout.lengths == (2, 3, 2)
    assert [(grid, index.tolist()) for grid, index in layout.groups] == [((1, 2), [0, 2]), ((3, 1), [1])]
    assert not layout.is_uniform and mixed_grid(coord[1:2], valid[1:2]).is_uniform
    assert mixed_grid(coord, valid.long()).grid_sizes == layout.grid_sizes  # 0 / 1 integers as a mask


def test_embed_patches_is_the_convolution_of_the_image():
    proj = torch.nn.Conv2d(3, 8, 4, stride=4)
    image = torch.randn(1, 3, 8, 12)
    patches = naflex_batch([image[0]], 6)["patches"]
    expected = proj(image).flatten(2).transpose(1, 2)
    torch.testing.assert_close(embed_patches(proj, patches), expected, rtol=0, atol=1e-6)


def _bad(coord=None, valid=None):
    batch = naflex_batch(grid_images([(2, 2), (1, 3)]), 5)
    if coord is not None:
        batch["patch_coord"] = coord(batch["patch_coord"])
    if valid is not None:
        batch["patch_valid"] = valid(batch["patch_valid"])
    return batch


def _set(tensor: torch.Tensor, index, value) -> torch.Tensor:
    tensor = tensor.clone()
    tensor[index] = value
    return tensor


@pytest.mark.parametrize(
    ("batch", "error", "match"),
    [
        # coordinates outside the validity mask: a padding entry beyond its sample's grid
        (_bad(coord=lambda c: _set(c, (1, 4), torch.tensor([5, 5]))), ValueError, r"patch_coord at padding.*\(5, 5\)"),
        (_bad(valid=lambda v: _set(v, 1, False)), ValueError, r"patch_valid must mark at least one.*\[1\]"),
        (_bad(valid=lambda v: _set(v, (0, 0), False)), ValueError, "patch_valid must list each sample's valid"),
        (_bad(coord=lambda c: _set(c, (0, 1), torch.tensor([1, 0]))), ValueError, "raster order"),
        (_bad(coord=lambda c: _set(c, (0, 3), torch.tensor([1, 2]))), ValueError, "span a 2x3 grid"),
        (_bad(coord=lambda c: _set(c, (1, 0), torch.tensor([-1, 0]))), ValueError, "non-negative"),
        (_bad(coord=lambda c: c.float()), TypeError, "patch_coord must hold integer"),
        (_bad(valid=lambda v: v[:, :4]), ValueError, r"patch_valid must have shape \(B, N\) = \(2, 5\)"),
        (_bad(valid=lambda v: v.float()), TypeError, "patch_valid must be a bool"),
        (_bad(coord=lambda c: c[..., :1]), ValueError, r"patch_coord must have shape \(B, N, ndim\)"),
        ({"patch_coord": torch.zeros(1, 1, 2, dtype=torch.long)}, ValueError, "must hold 'patches'"),
    ],
)
def test_bad_layouts_are_refused(batch, error, match):
    model = tiny("rope_axial")
    with pytest.raises(error, match=match):
        model(batch)


def test_bad_arguments_are_refused():
    model = tiny("learned")
    batch = naflex_batch(grid_images(), 20)
    with pytest.raises(ValueError, match="patch_coord .* and patch_valid .*got patch_valid=None"):
        model(batch["patches"], patch_coord=batch["patch_coord"])
    with pytest.raises(ValueError, match="attn_mask is not taken"):
        model(batch, attn_mask=torch.zeros(3, 1, 21, 21))
    with pytest.raises(ValueError, match=r"patches must be \(B, N, 4\*4\*3 = 48\)"):
        model({**batch, "patches": batch["patches"][..., :40]})
    with pytest.raises(ValueError, match=r"patches must have shape \(B, N, P\*P\*C\) with \(B, N\) = \(3, 20\)"):
        model({**batch, "patches": batch["patches"][:2]})
    with pytest.raises(TypeError, match=r"x of forward_intermediates must be \(B, C, H, W\) images .* got a mixed-res"):
        model.forward_intermediates(batch)
    with pytest.raises(TypeError, match="patches must be a floating-point"):
        naflex_inputs({**batch, "patches": batch["patches"].long()})
    layout = mixed_grid(batch["patch_coord"], batch["patch_valid"])
    with pytest.raises(TypeError, match="fn must be a callable"):
        apply_per_grid(None, torch.zeros(3, 21, 32), layout, 1)
    with pytest.raises(ValueError, match=r"x must be \(B, P \+ N, C\) = \(3, 1 \+ 20, C\)"):
        apply_per_grid(lambda t, g: t, torch.zeros(3, 20, 32), layout, 1)
    with pytest.raises(TypeError, match="patch_valid must be a \\(B, N\\) bool tensor"):
        pool_valid(model, torch.zeros(3, 21, 32), batch["patch_valid"].long())
    dropout = tiny("learned", patch_drop_rate=0.5).train()
    with pytest.raises(ValueError, match="patch dropout .* got patch_drop_rate=0.5"):
        dropout(batch)
    with pytest.raises(ValueError, match="reads \\('patch_depth',\\)"):
        tiny("string_cayley", pos_embed_kwargs={"depth_coords": True})(batch)


@pytest.mark.parametrize(
    ("pos_embed", "options", "padded"),
    [
        ("rope_axial", {}, True),  # per-token tables, one padded attention
        ("rope_dinov3", {}, True),  # its normalised coordinates are built per grid, then gathered per token
        ("learned", {}, True),  # nothing in attention: the padding mask alone
        ("rope_axial", {"extrapolation": "ntk"}, False),  # frequencies scaled per grid: grid by grid
        ("rope_mixed", {"extrapolation": "yarn"}, False),
        ("alibi2d", {}, False),  # bias schemes: grid by grid
    ],
)
def test_context_form_and_extrapolation_modes(pos_embed, options, padded):
    from visionpe.models.naflex import build_mixed_position_context

    model = tiny(pos_embed, pos_embed_kwargs=options)
    images = grid_images()
    batch = naflex_batch(images, 20)
    layout = mixed_grid(batch["patch_coord"], batch["patch_valid"])
    ctx = build_mixed_position_context(model.pos_schemes.values(), 1, layout, torch.device("cpu"))
    assert (ctx.groups is None) == padded and (ctx.attn_mask is not None) == padded
    if padded:
        assert ctx.attn_mask.shape == (3, 1, 1, 21) and ctx.attn_mask.sum().item() == 3 + 15 + 16 + 6
    assert_each_alone(model, images, batch)  # the 3x5 grid is wider than the 4x4 training grid
