"""apply_position_scheme: a timm VisionTransformer or Eva (tiny, random weights) keeps its weights and takes visionpe
schemes; its own encoding translated reproduces its logits."""

import copy

import pytest
import timm
import torch
from timm.models.eva import Eva
from timm.models.vision_transformer import ResPostBlock, VisionTransformer

import visionpe
from visionpe.contract import UnsupportedSchemeError
from visionpe.integrations.timm import SwapReport, VisionPEEva, apply_position_scheme, own_position_scheme
from visionpe.rotary.rope_dinov3 import half_to_interleaved

BASE = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=5, dynamic_img_size=True)
# training size (a 4x4 grid), larger, non-square
SIZES = ((32, 32), (48, 64), (32, 48))

EVA = {
    # EVA-02: APE + axial RoPE (rows first, "ij"), EVA's i * ref / n with a ref grid other than the model's, SwiGLU
    "eva02": dict(mlp_ratio=8 / 3, swiglu_mlp=True, scale_mlp=True, use_rot_pos_emb=True, ref_feat_shape=(3, 5)),
    # rope-vit's RoPE-Axial port: AttentionRope, columns first ("xy"), base 100, layer scale, cls pooling
    "rope_axial_xy": dict(
        attn_type="rope",
        use_abs_pos_emb=False,
        use_rot_pos_emb=True,
        rope_grid_indexing="xy",
        rope_temperature=100.0,
        init_values=1e-5,
        global_pool="token",
    ),
    "rope_mixed_xy": dict(
        attn_type="rope", use_abs_pos_emb=False, use_rot_pos_emb=True, rope_grid_indexing="xy", rope_type="mixed"
    ),
    "rope_mixed_ij_ape": dict(use_rot_pos_emb=True, rope_type="mixed"),
    # DINOv3: half layout, registers, q/k norms (relabelled with the q/k rows)
    "dinov3": dict(
        rope_type="dinov3",
        rope_temperature=100,
        rope_rotate_half=True,
        use_rot_pos_emb=True,
        use_abs_pos_emb=False,
        num_reg_tokens=2,
        qk_norm=True,
    ),
    "mrope": dict(rope_type="mrope", use_rot_pos_emb=True, use_abs_pos_emb=False),
    # Perception Encoder: positions i + 1, ref grid, "xy"; here with grouped k/v heads and separate projections
    "pe_gqa_half": dict(
        attn_type="rope",
        qkv_fused=False,
        num_kv_heads=2,
        use_rot_pos_emb=True,
        ref_feat_shape=(3, 5),
        rope_grid_offset=1.0,
        rope_grid_indexing="xy",
        rope_rotate_half=True,
    ),
}
VIT = {"vit": {}, "vit_no_embed_class_regs": dict(no_embed_class=True, reg_tokens=2)}


def _randomise(model, scale=0.2):
    """Every parameter moved off its init (zero biases, the 0.001 head scale), eval mode."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model.eval()


def _model(name):
    return _randomise(Eva(**BASE, **EVA[name]) if name in EVA else VisionTransformer(**BASE, **VIT[name]))


@pytest.mark.parametrize("name", [*EVA, *VIT])
def test_own_scheme_reproduces_the_logits(name):
    model = _model(name)
    original = copy.deepcopy(model)
    before = original.state_dict()
    report = apply_position_scheme(model)  # pos_embed=None: the model's own encoding in visionpe
    assert isinstance(report, SwapReport) and report.added == []
    assert type(model) is (VisionPEEva if name in EVA else visionpe.VisionPEViT)
    assert model.pos_embed is None and getattr(model, "rope", None) is None
    # every weight outside the position encoding is the model's (relabelled q/k rows aside)
    after = model.state_dict()
    for key in set(before) & set(after):
        if key not in report.permuted:
            assert torch.equal(before[key], after[key]), key
    torch.manual_seed(1)
    with torch.no_grad():
        for size in SIZES:
            x = torch.randn(2, 3, *size)
            torch.testing.assert_close(model(x), original(x), rtol=0, atol=1e-5, msg=f"{name} at {size}")
        final, feats = model.forward_intermediates(x, indices=2)
        final_ref, feats_ref = original.forward_intermediates(x, indices=2)
        torch.testing.assert_close(feats[0], feats_ref[0], rtol=0, atol=1e-5)


def test_translations_and_reports():
    eva02 = _model("eva02")
    assert own_position_scheme(eva02) == {
        "learned": {"no_embed_class": False},
        "rope_axial": {"base": 10000.0, "axis_order": "yx", "coord_mode": "ref_scaled", "grid_size": (3, 5)},
    }
    table = eva02.pos_embed.detach().clone()
    report = apply_position_scheme(eva02)
    assert report.dropped == ["pos_embed"] and report.copied == ["pos_schemes.learned.pos_embed"]
    assert torch.equal(eva02.pos_schemes.learned.pos_embed, table)

    mixed = _model("rope_mixed_ij_ape")
    freqs = mixed.rope.freqs.detach().clone()  # timm: component 0 multiplies y ("ij"), visionpe's 0 is x
    report = apply_position_scheme(mixed)
    assert report.dropped == ["pos_embed", "rope.freqs"]
    assert torch.equal(mixed.pos_schemes.rope_mixed.freqs, freqs.flip(0))

    dinov3 = _model("dinov3")
    assert own_position_scheme(dinov3)["rope_dinov3"]["rescale_coords"] is None  # timm's default: no augmentation
    qkv, q_norm = dinov3.blocks[0].attn.qkv.weight.detach().clone(), dinov3.blocks[0].attn.q_norm.weight.detach()
    q_norm = q_norm.clone()
    report = apply_position_scheme(dinov3)
    assert {"blocks.0.attn.qkv.weight", "blocks.0.attn.q_norm.weight", "blocks.1.attn.k_norm.bias"} <= set(
        report.permuted
    )
    # half layout -> interleaved: head h's channel 2c is its old c, 2c + 1 its old c + d/2; v rows unchanged
    d, h = 16, 4
    order = torch.tensor([c // 2 + (c % 2) * d // 2 for c in range(d)])
    expected = qkv[: 2 * h * d].unflatten(0, (2 * h, d))[:, order].flatten(0, 1)
    new = dinov3.blocks[0].attn.qkv.weight
    assert torch.equal(new[: 2 * h * d], expected) and torch.equal(new[2 * h * d :], qkv[2 * h * d :])
    assert torch.equal(dinov3.blocks[0].attn.q_norm.weight, q_norm[half_to_interleaved(d)])

    mrope = _model("mrope")
    apply_position_scheme(mrope)
    assert not mrope.pos_schemes.rope_mixed.freqs.requires_grad  # MRoPE's frequencies are fixed


def test_translation_is_not_vacuous():
    """The rotation matters, and each part of the translation does: another block order or no ref scaling differ."""
    model = _model("eva02")
    x = torch.randn(1, 3, 32, 48)
    with torch.no_grad():
        reference = model(x)
        for pos_embed, kwargs in (
            ("learned", None),
            (None, {"rope_axial": {"axis_order": "xy"}}),
            (None, {"rope_axial": {"coord_mode": "index"}}),
        ):
            other = copy.deepcopy(model)
            apply_position_scheme(other, pos_embed, kwargs)
            assert (other(x) - reference).abs().max() > 1e-2


def test_bias_schemes_act_on_eva_as_on_visionpe_vit():
    """An Eva and a VisionTransformer with the same weights (EVA's q and v biases as the fused bias, k's zero) stay
    equal after both take ["learned", "alibi2d", "rope_mixed"]; the bias changes the logits."""
    eva = _randomise(Eva(**BASE, global_pool="token"))
    vit = VisionTransformer(**BASE, global_pool="token").eval()
    state = {}
    for key, value in eva.state_dict().items():
        if key.endswith("attn.q_bias"):
            v_bias = eva.state_dict()[key.replace("q_bias", "v_bias")]
            state[key.replace("q_bias", "qkv.bias")] = torch.cat((value, torch.zeros_like(value), v_bias))
        elif not key.endswith("attn.v_bias"):
            state[key] = value
    vit.load_state_dict(state)
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        torch.testing.assert_close(eva(x), vit(x))
        schemes = ["learned", "alibi2d", "rope_mixed"]
        no_bias = copy.deepcopy(eva)
        apply_position_scheme(no_bias, ["learned", "rope_mixed"])
        apply_position_scheme(eva, schemes)
        report = apply_position_scheme(vit, schemes)
        assert "pos_schemes.rope_mixed.freqs" in report.added
        vit.pos_schemes.rope_mixed.load_state_dict(eva.pos_schemes.rope_mixed.state_dict())
        no_bias.pos_schemes.rope_mixed.load_state_dict(eva.pos_schemes.rope_mixed.state_dict())
        torch.testing.assert_close(eva(x), vit(x), rtol=0, atol=1e-5)
        assert (eva(x) - no_bias(x)).abs().max() > 1e-3


def test_patch_dropout_keeps_the_rotations():
    """In training, with timm's patch dropout, the converted model draws the same patches and rotates each kept
    token as the original does."""
    for name in ("rope_axial_xy", "rope_mixed_ij_ape", "dinov3"):
        model = _randomise(Eva(**BASE, patch_drop_rate=0.5, **EVA[name])).train()
        original = copy.deepcopy(model)
        apply_position_scheme(model)
        x = torch.randn(2, 3, 32, 48)
        torch.manual_seed(3)
        expected = original(x)
        torch.manual_seed(3)
        out = model(x)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
        out.sum().backward()
        assert model.blocks[0].attn.proj.weight.grad is not None


@pytest.mark.parametrize("mode", ["pi", "ntk", "yarn"])
def test_extrapolation_on_the_converted_model(mode):
    model = _model("rope_axial_xy")
    apply_position_scheme(model)
    train, large = torch.randn(1, 3, 32, 32), torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        before_train, before_large = model(train), model(large)
        assert visionpe.set_extrapolation(model, mode) == ["pos_schemes.rope_axial"]
        torch.testing.assert_close(model(train), before_train)  # the training grid is unscaled
        assert (model(large) - before_large).abs().max() > 1e-4
    eva02 = _model("eva02")
    apply_position_scheme(eva02)
    with pytest.raises(ValueError, match="already interpolates"):  # EVA's ref_scaled positions
        visionpe.set_extrapolation(eva02, mode)


def test_swap_between_visionpe_schemes():
    model = _model("rope_mixed_xy")
    apply_position_scheme(model)
    freqs = model.pos_schemes.rope_mixed.freqs.detach().clone()
    report = apply_position_scheme(model, ["rope_mixed", "learned", "kerple_log"])
    assert model.pos_embed_names == ["rope_mixed", "learned", "kerple_log"]
    assert report.dropped == [] and report.copied == []
    assert "pos_schemes.learned.pos_embed" in report.added and any("kerple_log" in k for k in report.added)
    assert torch.equal(model.pos_schemes.rope_mixed.freqs, freqs)  # kept as it was
    report = apply_position_scheme(model, "rope_mixed", {"base": 100.0})  # rebuilt with options, values copied
    assert report.copied == ["pos_schemes.rope_mixed.freqs"] and "pos_schemes.learned.pos_embed" in report.dropped
    assert torch.equal(model.pos_schemes.rope_mixed.freqs, freqs)
    model(torch.randn(1, 3, 32, 48)).sum().backward()
    assert model.pos_schemes.rope_mixed.freqs.grad is not None


def test_bad_input():
    with pytest.raises(TypeError, match=r"model must be of a class apply_position_scheme supports \(.*Eva.*\), got"):
        apply_position_scheme(torch.nn.Linear(2, 2), "learned")

    class OtherViT(VisionTransformer):
        pass

    with pytest.raises(TypeError, match="OtherViT"):
        apply_position_scheme(OtherViT(**BASE, depth=1), "learned")
    with pytest.raises(TypeError, match="ResPostBlock"):
        apply_position_scheme(VisionTransformer(**BASE, block_fn=ResPostBlock), "learned")
    model = _model("eva02")
    with pytest.raises(ValueError, match="unknown position scheme 'nope'"):
        apply_position_scheme(model, "nope")
    with pytest.raises(UnsupportedSchemeError, match="'gta' needs cameras.*visionpe_mvvit_"):
        apply_position_scheme(model, ["learned", "gta"])
    with pytest.raises(ValueError, match="'mrope' is a multimodal design"):
        apply_position_scheme(model, "mrope")
    with pytest.raises(ValueError, match="'cpe' runs after blocks"):
        apply_position_scheme(model, "cpe")
    assert type(model) is Eva and model.pos_embed is not None  # nothing changed by a refused call
    with pytest.raises(ValueError, match="has none"):
        apply_position_scheme(VisionTransformer(**BASE, pos_embed="none"))
    with pytest.raises(ValueError, match="grid_offset"):
        own_position_scheme(Eva(**BASE, rope_type="dinov3", use_rot_pos_emb=True, rope_grid_offset=0.5))


def test_rope_axial_axis_order_and_coord_offset():
    """The two rope_axial options the translation uses: the block order of the pairs and a position offset."""
    default = visionpe.create_pos_embed("rope_axial", dim=64, num_heads=2, base=100.0)
    rows_first = visionpe.create_pos_embed("rope_axial", dim=64, num_heads=2, base=100.0, axis_order="yx")
    # default: pairs [0, 8) read x with 100^(-n/8), [8, 16) read y; "yx" swaps the blocks (rows are (y, x))
    theta = 100.0 ** (-torch.arange(8) / 8)
    zeros = torch.zeros(8)
    torch.testing.assert_close(default.freqs, torch.stack((torch.cat((zeros, theta)), torch.cat((theta, zeros)))))
    torch.testing.assert_close(rows_first.freqs, torch.stack((torch.cat((theta, zeros)), torch.cat((zeros, theta)))))
    shifted = visionpe.create_pos_embed(
        "rope_axial", dim=64, num_heads=4, coord_offset=1.0, coord_mode="ref_scaled", grid_size=(3, 5)
    )
    i, j = torch.meshgrid(torch.arange(4.0), torch.arange(6.0), indexing="ij")
    expected = torch.stack(((i + 1) * 3 / 4, (j + 1) * 5 / 6), -1).reshape(-1, 2)
    torch.testing.assert_close(shifted.coords((4, 6)), expected)
    with pytest.raises(ValueError, match="axis_order must be one of"):
        visionpe.create_pos_embed("rope_axial", dim=64, num_heads=4, axis_order="xt")
    with pytest.raises(ValueError, match="coord_offset shifts integer positions"):
        visionpe.create_pos_embed("rope_axial", dim=64, num_heads=4, coord_offset=1.0, coord_mode="centered")


def test_converted_models_check_their_input():
    """timm's Eva and NaFlexVit forwards stopped at torch's RuntimeError (dtype, empty batch), AttributeError (not a
    tensor), AssertionError (image size, NaFlex batch without patch_coord) or KeyError (a dict without patches)."""
    eva = _model("eva02")
    apply_position_scheme(eva, "rope_axial")
    x = torch.randn(1, 3, 32, 32)
    assert eva(x).isfinite().all()
    for call, error, match in [
        (lambda: eva(x.double()), ValueError, r"x must have the model's dtype torch.float32 .*got dtype torch.float64"),
        (lambda: eva(x[:0]), ValueError, r"x must be a non-empty batch \(B, C, H, W\) .*got \(0, 3, 32, 32\)"),
        (lambda: eva([[0.0]]), TypeError, r"x must be a batch \(B, C, H, W\) as a torch.Tensor, got list"),
        (lambda: eva(torch.randn(1, 3, 30, 32)), ValueError, r"x has image size 30x32, not divisible by the patch"),
        (lambda: eva.forward_intermediates(x, indices=3), ValueError, r"indices must be None, .*\[1, 2\].* got 3"),
    ]:
        with pytest.raises(error, match=match):
            call()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert eva(x.bfloat16()).isfinite().all()

    naflex = timm.create_model(
        "naflexvit_base_patch16_gap", patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=3
    ).eval()
    apply_position_scheme(naflex, "rope_axial")
    assert naflex(x).isfinite().all()
    for call, error, match in [
        (lambda: naflex({}), ValueError, r"a NaFlex batch dict must hold 'patches'"),
        (lambda: naflex({"patches": torch.randn(1, 4, 192)}), ValueError, r"needs patch_coord .* got patch_coord=None"),
        (lambda: naflex(x.double()), ValueError, r"x must have the model's dtype torch.float32"),
        (lambda: naflex(torch.randn(3, 32, 32)), ValueError, r"x must be a batch \(B, C, H, W\), got \(3, 32, 32\)"),
        (lambda: naflex(torch.randn(1, 3, 30, 32)), ValueError, r"x has image size 30x32, not divisible by the patch"),
    ]:
        with pytest.raises(error, match=match):
            call()
