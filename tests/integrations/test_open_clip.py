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


@pytest.mark.parametrize("scheme", ["learned", "rope_mixed", "irpe"])
def test_lock_image_tower_unlocks_the_last_block_and_norm(scheme, tmp_path):
    """open_clip's lock_image_tower(unlocked_groups=n) follows the tower's group_matcher: position parameters are
    in the stem group, so one unlocked group is the last block and the final norm, as for timm's own ViT."""
    name = register_open_clip_model(
        f"visionpe-lock-{scheme}", pos_embed=scheme, embed_dim=16, vision=VISION, text_cfg=TEXT, config_dir=tmp_path
    )
    model = open_clip.create_model(name)
    model.lock_image_tower(unlocked_groups=1)
    trainable = {n for n, p in model.visual.trunk.named_parameters() if p.requires_grad}
    last = {n for n, _ in model.visual.trunk.named_parameters() if n.startswith(("blocks.1.", "norm."))}
    assert trainable == last
    model = open_clip.create_model(name)
    model.lock_image_tower(unlocked_groups=3)  # stem too: everything, position parameters included
    assert all(p.requires_grad for p in model.visual.trunk.parameters())


def test_names_that_map_to_the_same_tower_are_refused(tmp_path):
    args = dict(pos_embed="learned", embed_dim=16, vision=VISION, text_cfg=TEXT, config_dir=tmp_path)
    register_open_clip_model("visionpe-same-tower", **args)
    with pytest.raises(ValueError, match="'visionpe_same_tower'.*'visionpe-same-tower'"):
        register_open_clip_model("visionpe_same_tower", **{**args, "pos_embed": "rope_mixed"})
    model = open_clip.create_model("visionpe-same-tower")  # the first registration is intact
    assert model.visual.trunk.pos_embed_names == ["learned"]
    register_open_clip_model("visionpe-same-tower", **{**args, "pos_embed": "rope_axial"})  # re-registering: fine
    assert open_clip.create_model("visionpe-same-tower").visual.trunk.pos_embed_names == ["rope_axial"]


def test_text_cfg_is_checked_against_open_clip():
    with pytest.raises(ValueError, match="text_cfg has unknown key 'widht'"):
        register_open_clip_model("visionpe-bad-text", pos_embed="learned", text_cfg={"widht": 32})
    with pytest.raises(TypeError, match="text_cfg\\['width'\\] must be int, got str"):
        register_open_clip_model("visionpe-bad-text", pos_embed="learned", text_cfg={"width": "x"})
    with pytest.raises(ValueError, match="text_cfg\\['layers'\\] must be positive"):
        register_open_clip_model("visionpe-bad-text", pos_embed="learned", text_cfg={"layers": 0})
    with pytest.raises(TypeError, match="text_cfg must be a dict"):
        register_open_clip_model("visionpe-bad-text", pos_embed="learned", text_cfg=[("width", 32)])
    assert "visionpe-bad-text" not in open_clip.list_models()


def test_tower_arguments_are_checked_at_registration():
    """An unknown ViT argument, or one timm would stop at, fails when the tower is registered, not when open_clip
    builds it."""
    with pytest.raises(TypeError, match=r"vit_kwargs must be arguments of VisionPEViT .* got unknown \['bogus'\]"):
        register_open_clip_model("visionpe-bad-vit", pos_embed="learned", vision=dict(VISION, bogus=1))
    with pytest.raises(TypeError, match=r"depth must be a positive int, got str \('2'\)"):
        register_open_clip_model("visionpe-bad-vit", pos_embed="learned", vision=dict(VISION, depth="2"))
    with pytest.raises(ValueError, match=r"embed_dim must be divisible by num_heads, got embed_dim=30"):
        register_open_clip_model(
            "visionpe-bad-vit", pos_embed="learned", vision=dict(VISION, embed_dim=30, num_heads=4)
        )
    with pytest.raises(ValueError, match=r"mlp_ratio must be a positive finite number, got 0"):
        register_open_clip_model("visionpe-bad-vit", pos_embed="learned", vision=dict(VISION, mlp_ratio=0))
    assert "visionpe-bad-vit" not in open_clip.list_models()
