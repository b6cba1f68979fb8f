"""timm's features_only for the visionpe_vit_* models (FeatureGetterNet over forward_intermediates, as timm's ViT)."""

import pytest
import timm
import torch

from ..conftest import ALL_SCHEMES

ARGS = dict(depth=4, embed_dim=32, num_heads=2, img_size=32, patch_size=8)


@pytest.mark.parametrize("pos_embed", [*ALL_SCHEMES, ["learned", "irpe"]], ids=str)
def test_features_only_default_out_indices_are_the_last_three_blocks(pos_embed):
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=pos_embed, features_only=True, **ARGS).eval()
    assert model.feature_info.channels() == [32] * 3 and model.feature_info.reduction() == [8] * 3
    assert [info["module"] for info in model.feature_info.get_dicts()] == ["blocks.1", "blocks.2", "blocks.3"]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        feats = model(x)
        ref = model.model.forward_intermediates(x, indices=[1, 2, 3], intermediates_only=True)
    assert [tuple(f.shape) for f in feats] == [(2, 32, 4, 4)] * 3
    for f, r in zip(feats, ref, strict=True):
        assert torch.equal(f, r)


def test_features_only_explicit_out_indices_with_registers():
    torch.manual_seed(0)
    full = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="rope_mixed", reg_tokens=2, **ARGS).eval()
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224",
        pos_embed="rope_mixed",
        reg_tokens=2,
        features_only=True,
        out_indices=(0, 2),
        **ARGS,
    ).eval()
    assert len(model.model.blocks) == 3  # pruned after the last block asked for
    kept = model.model.state_dict().keys()  # blocks 0-2, no final norm or head
    model.model.load_state_dict({k: v for k, v in full.state_dict().items() if k in kept})
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        feats = model(x)
        ref = full.forward_intermediates(x, indices=[0, 2], intermediates_only=True)
    assert len(feats) == 2 and all(torch.equal(f, r) for f, r in zip(feats, ref, strict=True))


def test_video_features_only_is_refused_clearly():
    with pytest.raises(ValueError, match="does not support features_only"):
        timm.create_model("visionpe_video_vit_tiny_tubelet2x16", pos_embed="rope_axial", depth=1, features_only=True)
