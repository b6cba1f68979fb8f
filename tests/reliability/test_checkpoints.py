"""Checkpoints: state_dict (torch.save) and safetensors round trips for every scheme, and a checkpoint trained at one
image size loaded into a model built for a larger one (224 -> 384 in the README; 32 -> 48 px here, the same
4 x 4 -> 6 x 6 grid change in kind).

(Loading vanilla timm ViT weights is tested in tests/models/test_vit.py.)
"""

import io

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file

import visionpe

from .helpers import ALL_SCHEMES, perturb_, tiny_vit


def _trained(name, seed=0, **kwargs):
    """A model whose weights, position parameters included, are far from any fresh init."""
    torch.manual_seed(seed)
    return perturb_(tiny_vit(name, **kwargs), scale=0.1, seed=seed).eval()


def _assert_same_model(loaded, source, images):
    assert loaded.state_dict().keys() == source.state_dict().keys()
    for key, value in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    with torch.no_grad():
        assert torch.equal(loaded(images), source(images))


@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_state_dict_and_safetensors_round_trips(name, tmp_path):
    source = _trained(name)
    images = torch.randn(2, 3, 32, 32)
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    loaded = _trained(name, seed=1)  # different weights before loading
    loaded.load_state_dict(torch.load(buffer, weights_only=True))
    _assert_same_model(loaded, source, images)

    path = tmp_path / "model.safetensors"
    save_file(source.state_dict(), path)  # fails on shared or non-contiguous tensors
    loaded = _trained(name, seed=2)
    loaded.load_state_dict(load_file(path), strict=True)
    _assert_same_model(loaded, source, images)


def test_folded_string_round_trips_and_stays_folded(tmp_path):
    """The folded flag of STRING lives in the checkpoint: a fresh model that loads a folded checkpoint is folded."""
    source = visionpe.fold_string_(_trained("string_cayley"))
    images = torch.randn(2, 3, 32, 32)
    path = tmp_path / "folded.safetensors"
    save_file(source.state_dict(), path)
    loaded = _trained("string_cayley", seed=1)
    loaded.load_state_dict(load_file(path))
    assert loaded.pos_schemes["string_cayley"].is_folded
    _assert_same_model(loaded, source, images)
    with pytest.raises(ValueError, match="already folded"):
        visionpe.fold_string_(loaded)
    # and back: an unfolded checkpoint unfolds the model
    loaded.load_state_dict(_trained("string_cayley").state_dict())
    assert not loaded.pos_schemes["string_cayley"].is_folded


@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_checkpoint_from_a_smaller_image_size_loads_into_a_larger_model(name, tmp_path):
    """Trained at 32 px (4 x 4 grid), loaded into a model built for 48 px (6 x 6): every weight arrives (the learned
    table resampled) and the model computes what the source model computes at 48 px with ``dynamic_img_size``."""
    source = _trained(name)
    images = torch.randn(2, 3, 48, 48)
    reference = _trained(name, dynamic_img_size=True)
    reference.load_state_dict(source.state_dict())
    with torch.no_grad():
        expected = reference(images)

    larger = _trained(name, seed=1, img_size=48)
    report = visionpe.load_timm_state_dict(larger, source.state_dict())
    assert not report.added and not report.dropped
    # the learned table, and the grid-shaped parameters of schemes that resample their own (LOOPE's context)
    assert bool(report.resampled) == (name == "learned" or hasattr(larger.pos_schemes[name], "resample_table"))
    with torch.no_grad():
        torch.testing.assert_close(larger(images), expected, rtol=1e-5, atol=1e-6)

    # the same through timm's factory, from a .pth and from a .safetensors file
    torch.save(source.state_dict(), tmp_path / "small.pth")
    save_file(source.state_dict(), tmp_path / "small.safetensors")
    for file in ("small.pth", "small.safetensors"):
        torch.manual_seed(1)
        model = timm.create_model(
            "visionpe_vit_tiny_patch16_224",
            pretrained=True,
            pretrained_cfg_overlay={"file": str(tmp_path / file), "num_classes": 3},  # else timm drops the head
            pos_embed=name,
            depth=1,
            embed_dim=32,
            num_heads=2,
            num_classes=3,
            patch_size=8,
            img_size=48,
        ).eval()
        with torch.no_grad():
            torch.testing.assert_close(model(images), expected, rtol=1e-5, atol=1e-6)


def test_a_table_that_does_not_fit_is_reported_not_loaded():
    """A learned table of another width is never broadcast into the model: refused (it fills nothing), or with
    strict=False dropped with its reason."""
    model = tiny_vit("learned")
    before = model.pos_schemes["learned"].pos_embed.detach().clone()
    table = {"pos_schemes.learned.pos_embed": torch.randn(1, 17, 16)}
    with pytest.raises(ValueError, match=r"fills no tensor.*cannot fill pos_schemes\.learned\.pos_embed"):
        visionpe.load_timm_state_dict(model, table)
    report = visionpe.load_timm_state_dict(model, table, strict=False)
    assert report.dropped == [
        "pos_schemes.learned.pos_embed (shape (1, 17, 16) cannot fill pos_schemes.learned.pos_embed (1, 17, 32))"
    ]
    assert torch.equal(model.pos_schemes["learned"].pos_embed, before)
