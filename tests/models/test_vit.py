import pytest
import timm
import torch

import visionpe

CORE = ["none", "learned", "sincos", "rope_axial", "rope_mixed"]
SMALL = dict(embed_dim=64, depth=2, num_heads=2, num_classes=5)


def _model(pos_embed, **kw):
    return timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=pos_embed, **{**SMALL, **kw})


@pytest.mark.parametrize("pos_embed", CORE + [["learned", "rope_mixed"], ["sincos", "rope_axial"]])
def test_forward_backward_at_several_sizes(pos_embed):
    model = _model(pos_embed, dynamic_img_size=True)
    for size in [(224, 224), (384, 384), (224, 320)]:
        model.zero_grad()
        out = model(torch.randn(2, 3, *size))
        assert out.shape == (2, 5) and torch.isfinite(out).all()
        out.square().mean().backward()
        for name, p in model.pos_schemes.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{pos_embed}: no gradient for {name}"


@pytest.mark.parametrize("name", ["visionpe_vit_tiny_patch16_224", "visionpe_vit_small_patch16_224"])
@pytest.mark.parametrize("pos_embed", CORE)
def test_timm_factory_every_scheme(name, pos_embed):
    model = timm.create_model(name, pos_embed=pos_embed, num_classes=3, depth=1)
    assert isinstance(model, visionpe.VisionPEViT)
    assert model(torch.randn(1, 3, 224, 224)).shape == (1, 3)


def test_registered_with_timm():
    for size in ["tiny", "small", "base", "large"]:
        assert f"visionpe_vit_{size}_patch16_224" in timm.list_models("visionpe_*")


def test_rotary_tables_recomputed_not_resampled():
    model = _model("rope_axial", dynamic_img_size=True)
    ctx = model.position_context((20, 24), torch.device("cpu"))
    scheme, state = ctx.rotary[0]
    cos, _ = scheme.layer_tables(state, 0)
    assert cos.shape[-2] == 1 + 20 * 24  # built for the new grid, prefix row included


def test_prefix_tokens_not_rotated_by_model():
    model = _model("rope_mixed", reg_tokens=2)
    ((scheme, state),) = model.position_context((14, 14), torch.device("cpu")).rotary
    cos, sin = scheme.layer_tables(state, 1)
    assert (cos[..., :3, :] == 1).all() and (sin[..., :3, :] == 0).all()


def test_set_input_size_resamples_learned_and_follows_grid():
    model = _model(["learned", "rope_axial"])
    model.set_input_size(img_size=(256, 320))
    assert model.pos_schemes["learned"].pos_embed.shape[1] == 1 + 16 * 20
    assert model(torch.randn(1, 3, 256, 320)).shape == (1, 5)


def test_avg_pool_no_class_token_and_registers():
    model = _model("rope_mixed", class_token=False, global_pool="avg", reg_tokens=1, dynamic_img_size=True)
    assert model(torch.randn(1, 3, 224, 288)).shape == (1, 5)


def test_no_weight_decay_covers_position_parameters():
    model = _model(["learned", "rope_mixed"])
    skip = model.no_weight_decay()
    assert {"pos_schemes.rope_mixed.freqs", "pos_schemes.learned.pos_embed", "cls_token"} <= skip


def test_load_vanilla_timm_state_dict_into_rope_model():
    src = timm.create_model("vit_tiny_patch16_224", **SMALL)
    dst = _model("rope_mixed")
    init_freqs = dst.pos_schemes["rope_mixed"].freqs.detach().clone()
    report = visionpe.load_timm_state_dict(dst, src.state_dict())
    assert report.added == ["pos_schemes.rope_mixed.freqs"]
    assert [d.split()[0] for d in report.dropped] == ["pos_embed"]
    assert torch.equal(dst.blocks[1].attn.qkv.weight, src.blocks[1].attn.qkv.weight)
    assert torch.equal(dst.pos_schemes["rope_mixed"].freqs, init_freqs)


def test_load_vanilla_timm_state_dict_resamples_learned_table():
    src = timm.create_model("vit_tiny_patch16_224", **SMALL)
    dst = _model(["learned", "rope_axial"], img_size=288)
    report = visionpe.load_timm_state_dict(dst, src.state_dict())
    assert report.resampled and not report.added and not report.dropped
    table = dst.pos_schemes["learned"].pos_embed
    assert table.shape == (1, 1 + 18 * 18, 64)
    assert torch.equal(table[:, :1], src.pos_embed[:, :1])


def test_same_size_learned_model_matches_timm_exactly():
    src = timm.create_model("vit_tiny_patch16_224", **SMALL).eval()
    dst = _model("learned").eval()
    report = visionpe.load_timm_state_dict(dst, src.state_dict())
    assert not report.added and not report.dropped
    x = torch.randn(2, 3, 224, 224)
    assert torch.allclose(dst(x), src(x), atol=1e-5)


def test_pretrained_file_through_timm_factory(tmp_path):
    src = timm.create_model("vit_tiny_patch16_224", **SMALL)
    path = tmp_path / "vit.pth"
    torch.save(src.state_dict(), path)
    dst = timm.create_model(
        "visionpe_vit_tiny_patch16_224",
        pretrained=True,
        pretrained_cfg_overlay={"file": str(path)},
        pos_embed="rope_axial",
        **SMALL,
    )
    assert torch.equal(dst.patch_embed.proj.weight, src.patch_embed.proj.weight)


def test_bad_input_errors():
    with pytest.raises(ValueError, match="unknown position scheme 'ropee'"):
        _model("ropee")
    with pytest.raises(ValueError, match="not divisible by the patch size"):
        _model("rope_axial", dynamic_img_size=True)(torch.randn(1, 3, 224, 230))
    with pytest.raises(ValueError, match="does not match the model's img_size"):
        _model("rope_axial")(torch.randn(1, 3, 240, 240))
    with pytest.raises(ValueError, match="keyed by scheme name"):
        _model(["learned", "rope_axial"], pos_embed_kwargs={"base": 10})
    with pytest.raises(ValueError, match="unknown option"):
        _model("rope_axial", pos_embed_kwargs={"bse": 10})
    with pytest.raises(ValueError, match="patch_drop_rate"):
        _model("rope_axial", patch_drop_rate=0.5)
    with pytest.raises(ValueError, match="'cpe' runs after blocks \\(0,\\)"):  # the PEG convolves the whole grid
        _model("cpe", patch_drop_rate=0.5)
    assert _model("learned", patch_drop_rate=0.5)(torch.randn(1, 3, 224, 224)).isfinite().all()
    with pytest.raises(ValueError, match="supports 2D grids"):
        visionpe.create_pos_embed("sincos", dim=64, num_heads=2).coords((2, 3, 4))


def test_dynamic_img_pad_accepts_odd_sizes():
    model = _model("rope_axial", dynamic_img_size=True, dynamic_img_pad=True)
    assert model(torch.randn(1, 3, 230, 250)).shape == (1, 5)


def test_grad_checkpointing_matches():
    model = _model("rope_mixed").train()
    x = torch.randn(1, 3, 224, 224)
    ref = model(x)
    model.set_grad_checkpointing(True)
    assert torch.allclose(model(x), ref, atol=1e-6)


def test_forward_intermediates_match_forward_features():
    model = _model("rope_mixed", dynamic_img_size=True).eval()
    x = torch.randn(1, 3, 224, 256)
    final, feats = model.forward_intermediates(x, indices=2)
    assert torch.allclose(final, model.forward_features(x), atol=1e-6)
    assert [f.shape for f in feats] == [(1, 64, 14, 16)] * 2
    only = model.forward_intermediates(
        x, indices=[0], output_fmt="NLC", return_prefix_tokens=True, intermediates_only=True, stop_early=True
    )
    assert only[0][0].shape == (1, 14 * 16, 64) and only[0][1].shape == (1, 1, 64)
    with pytest.raises(ValueError, match="output_fmt"):
        model.forward_intermediates(x, output_fmt="NHWC")


def test_rotary_with_qk_norm_matches_manual_rotation():
    model = _model("rope_axial", qk_norm=True).eval()
    attn = model.blocks[0].attn
    x = torch.randn(1, 1 + 196, 64)
    ctx = model.position_context((14, 14), torch.device("cpu"))
    q, k, v = attn.qkv(x).reshape(1, 197, 3, 2, 32).permute(2, 0, 3, 1, 4).unbind(0)
    scheme, state = ctx.rotary[0]
    qk = scheme.apply(torch.stack((attn.q_norm(q), attn.k_norm(k))), state, 0)
    expected = torch.nn.functional.scaled_dot_product_attention(qk[0], qk[1], v)
    expected = attn.proj(expected.transpose(1, 2).reshape(1, 197, 64))
    assert torch.allclose(attn(x, pos=ctx), expected, atol=1e-5)
