"""A CLIP model with a visionpe ViT image tower, built through open_clip's own factory (tiny, random)."""

import pytest
import torch

open_clip = pytest.importorskip("open_clip")
import visionpe  # noqa: E402
from visionpe.integrations.open_clip import register_open_clip_model  # noqa: E402

VISION = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)
TEXT = dict(context_length=8, vocab_size=64, width=32, heads=2, layers=1)


@pytest.mark.parametrize("scheme", visionpe.list_schemes())
def test_clip_with_visionpe_tower_trains_and_scales_resolution(scheme, tmp_path):
    name = register_open_clip_model(
        f"visionpe-test-{scheme}", pos_embed=scheme, embed_dim=16, vision=VISION, text_cfg=TEXT, config_dir=tmp_path
    )
    assert name in open_clip.list_models()
    torch.manual_seed(0)
    model = open_clip.create_model(name)
    tower = model.visual.trunk
    assert isinstance(tower, visionpe.VisionPEViT) and tower.pos_embed_names == [scheme]
    text = torch.randint(1, 64, (2, 8))
    for size in (32, 64):
        images = torch.randn(2, 3, size, size)
        image_features, text_features, logit_scale = model(images, text)
        assert image_features.shape == (2, 16) and text_features.shape == (2, 16)
        assert torch.isfinite(image_features).all()
        norms = image_features.norm(dim=-1)
        assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5)
    loss = open_clip.ClipLoss()(image_features, text_features, logit_scale)
    loss.backward()
    assert tower.patch_embed.proj.weight.grad is not None


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown position scheme 'nope'"):
        register_open_clip_model("visionpe-bad", pos_embed="nope")
    with pytest.raises(ValueError, match="timm_pool must be"):
        register_open_clip_model("visionpe-bad", pos_embed="learned", timm_pool="max")
    with pytest.raises(ValueError, match="img_size=30 must be divisible by patch_size=8"):
        register_open_clip_model("visionpe-bad", pos_embed="learned", vision=dict(img_size=30, patch_size=8))
