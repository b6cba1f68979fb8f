"""apply_position_scheme on timm's NaFlexVit: its own learned table translated exactly (the logits of a mixed batch
and of images unchanged), any visionpe scheme inside the naflexvit model, and the NaFlex settings refused."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from timm.models.naflexvit import NaFlexVit

from visionpe.integrations.timm import apply_position_scheme, own_position_scheme
from visionpe.integrations.timm_swap import VisionPENaFlexVit

from ..reliability.helpers import perturb_
from ..test_mixed_resolution import GRIDS, PATCH, grid_images, naflex_batch


def naflexvit(variant: str = "naflexvit_base_patch16_gap", **kwargs) -> NaFlexVit:
    """A tiny naflexvit_* (width 32, depth 2, 4 px patches, a 3 x 4 table) with its parameters off their init."""
    args = dict(patch_size=PATCH, embed_dim=32, depth=2, num_heads=2, num_classes=5, pos_embed_grid_size=(3, 4))
    args["init_values"] = None  # no layer scale: the blocks, and so the positions, matter
    return perturb_(timm.create_model(variant, **{**args, **kwargs})).eval()


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # average pooling over valid patches, 4 register tokens
        {"global_pool": "token", "class_token": True, "reg_tokens": 0, "pos_embed_interp_mode": "bilinear"},
        {"pos_embed_antialias": False, "pos_embed_grid_size": (5, 2)},
        {"variant": "naflexvit_base_patch16_map"},  # attention pooling with the padding masked
        {"pos_embed_ar_preserving": True},  # resampled to a square, cropped to each grid (the *_par_* models)
        {"pos_embed_ar_preserving": True, "pos_embed_align_corners": True},  # as RADIO v3
    ],
    ids=["gap", "token_bilinear", "no_antialias", "map", "ar_preserving", "align_corners"],
)
def test_own_table_reproduces_the_logits(kwargs):
    model = naflexvit(**kwargs)
    images = grid_images()
    batch = naflex_batch(images, 20)
    with torch.no_grad():
        expected_mixed, expected_image = model(batch), model(images[0][None])
    options = own_position_scheme(model)
    assert options == {"learned": {**options["learned"], "no_embed_class": True}}
    table = model.embeds.pos_embed.detach().clone()
    report = apply_position_scheme(model)
    assert type(model) is VisionPENaFlexVit and model.embeds.pos_embed is None
    assert report.copied == ["pos_schemes.learned.pos_embed"] and report.dropped == ["embeds.pos_embed"]
    assert torch.equal(model.pos_schemes.learned.pos_embed, table.flatten(1, 2))
    with torch.no_grad():
        torch.testing.assert_close(model(batch), expected_mixed, rtol=0, atol=1e-5)
        torch.testing.assert_close(model(images[0][None]), expected_image, rtol=0, atol=1e-5)
        # the table matters: the logits follow it
        model.pos_schemes.learned.pos_embed.normal_()
        assert not torch.allclose(model(batch), expected_mixed, atol=1e-3)


@pytest.mark.parametrize("ar_preserving", [False, True], ids=["factorized", "parfac"])
def test_own_factorized_tables_reproduce_the_logits(ar_preserving):
    model = naflexvit(pos_embed="factorized", pos_embed_ar_preserving=ar_preserving)
    images = grid_images()
    batch = naflex_batch(images, 20)
    with torch.no_grad():
        expected_mixed, expected_image = model(batch), model(images[0][None])
    rows, cols = model.embeds.pos_embed_y.detach().clone(), model.embeds.pos_embed_x.detach().clone()
    report = apply_position_scheme(model)
    assert model.pos_embed_names == ["learned_factorized"] and model.embeds.pos_embed_y is None
    assert sorted(report.copied) == [
        "pos_schemes.learned_factorized.pos_embed_x",
        "pos_schemes.learned_factorized.pos_embed_y",
    ]
    scheme = model.pos_schemes.learned_factorized
    assert torch.equal(scheme.pos_embed_y, rows) and torch.equal(scheme.pos_embed_x, cols)
    with torch.no_grad():
        torch.testing.assert_close(model(batch), expected_mixed, rtol=0, atol=1e-5)
        torch.testing.assert_close(model(images[0][None]), expected_image, rtol=0, atol=1e-5)
        scheme.pos_embed_x.normal_()
        assert not torch.allclose(model(batch), expected_mixed, atol=1e-3)


@pytest.mark.parametrize("schemes", [["rope_axial", "cpe"], "alibi2d", ["learned", "rope_dinov3"]])
def test_any_scheme_runs_mixed_batches_per_image(schemes):
    model = naflexvit()
    apply_position_scheme(model, schemes)
    perturb_(model.pos_schemes, seed=1)
    images = grid_images()
    batch = naflex_batch(images, 20)
    with torch.no_grad():
        mixed = model(batch)
        for i, image in enumerate(images):
            torch.testing.assert_close(mixed[i], model(image[None])[0], rtol=0, atol=1e-5, msg=f"grid {GRIDS[i]}")
    model.train()
    model(batch).square().mean().backward()
    assert all(p.grad is not None for p in model.pos_schemes.parameters() if p.requires_grad)


def test_swap_back_and_patch_dropout():
    model = naflexvit(patch_drop_rate=0.5)
    original = copy.deepcopy(model)
    apply_position_scheme(model, ["learned", "rope_mixed"])
    apply_position_scheme(model, "learned")  # a converted model converts again; the table is kept
    assert model.pos_embed_names == ["learned"]
    model.train()
    out = model(torch.randn(2, 3, 16, 20))  # images: timm's patch dropout with the kept tokens' positions
    assert out.shape == (2, 5) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="patch dropout .* mixed-resolution"):
        model(naflex_batch(grid_images(), 20))
    assert "embeds.pos_embed" in original.state_dict()


def test_refused_naflex_settings():
    with pytest.raises(ValueError, match="pos_embed_use_grid_sample=True"):
        apply_position_scheme(naflexvit(pos_embed_use_grid_sample=True))
    factorized = naflexvit(pos_embed="factorized")
    apply_position_scheme(factorized, "rope_axial")  # named schemes replace a table with no translation
    assert factorized.embeds.pos_embed_y is None and factorized.pos_embed_names == ["rope_axial"]
    with pytest.raises(TypeError, match="EvaBlock.*NaFlexVit with attn_type='standard'"):
        apply_position_scheme(naflexvit(rope_type="axial", pos_embed="none"), "rope_axial")
    model = naflexvit()
    apply_position_scheme(model)
    with pytest.raises(TypeError, match="forward_intermediates is not available"):
        model.forward_intermediates(torch.randn(1, 3, 16, 16))
    with pytest.raises(TypeError, match="made from a NaFlexVit in place"):
        VisionPENaFlexVit()


def test_variable_patch_size_batches_keep_the_logits():
    # timm's patch interpolator embeds unflattened (B, N, Ph, Pw, C) patches of another size than the model's
    model = naflexvit(enable_patch_interpolator=True)
    images = grid_images([(2, 3), (3, 3)], patch=8)
    batch = naflex_batch(images, 9, patch=8)
    batch["patches"] = batch["patches"].unflatten(2, (8, 8, 3))
    with torch.no_grad():
        expected = model(batch)
        apply_position_scheme(model)
        torch.testing.assert_close(model(batch), expected, rtol=0, atol=1e-5)
