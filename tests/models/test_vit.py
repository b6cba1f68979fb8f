import pytest
import timm
import torch

import visionpe

from ..conftest import ALL_SCHEMES

SMALL = dict(embed_dim=64, depth=2, num_heads=2, num_classes=5)


def _model(pos_embed, **kw):
    return timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=pos_embed, **{**SMALL, **kw})


@pytest.mark.parametrize("pos_embed", [*ALL_SCHEMES, ["learned", "rope_mixed"], ["sincos", "rope_axial"]], ids=str)
def test_forward_backward_at_several_sizes(pos_embed):
    model = _model(pos_embed, dynamic_img_size=True)
    for size in [(64, 64), (96, 96), (64, 112)]:  # grids 4 x 4, 6 x 6 and 4 x 7 of the 224 px (14 x 14) model
        model.zero_grad()
        out = model(torch.randn(2, 3, *size))
        assert out.shape == (2, 5) and torch.isfinite(out).all()
        out.square().mean().backward()
        for name, p in model.pos_schemes.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{pos_embed}: no gradient for {name}"


@pytest.mark.parametrize(
    "name, pos_embed",
    [("visionpe_vit_tiny_patch16_224", n) for n in ALL_SCHEMES] + [("visionpe_vit_small_patch16_224", "rope_axial")],
)
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
    (state,) = ctx.rotary  # the rotary scheme's per-forward state
    cos, _ = model.pos_schemes["rope_axial"].layer_tables(state, 0)
    assert cos.shape[-2] == 1 + 20 * 24  # built for the new grid, prefix row included


def test_prefix_tokens_not_rotated_by_model():
    model = _model("rope_mixed", reg_tokens=2)
    (state,) = model.position_context((14, 14), torch.device("cpu")).rotary
    cos, sin = model.pos_schemes["rope_mixed"].layer_tables(state, 1)
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
    scheme, (state,) = model.pos_schemes["rope_axial"], ctx.rotary
    qk = scheme.apply(torch.stack((attn.q_norm(q), attn.k_norm(k))), state, 0)
    expected = torch.nn.functional.scaled_dot_product_attention(qk[0], qk[1], v)
    expected = attn.proj(expected.transpose(1, 2).reshape(1, 197, 64))
    assert torch.allclose(attn(x, pos=ctx), expected, atol=1e-5)


# -- parameter groups (timm layer-wise lr decay, open_clip lock_image_tower) ---------------------------------------
TINY = dict(embed_dim=32, depth=3, num_heads=2, img_size=32, patch_size=8, num_classes=0)


def _lr_scales(model, layer_decay=0.5):
    """{parameter name: lr_scale} from timm's create_optimizer_v2(..., layer_decay=...)."""
    from timm.optim import create_optimizer_v2

    optimizer = create_optimizer_v2(model, "adamw", lr=1.0, weight_decay=0.05, layer_decay=layer_decay)
    by_id = {id(p): name for name, p in model.named_parameters()}
    return {by_id[id(p)]: group["lr_scale"] for group in optimizer.param_groups for p in group["params"]}


@pytest.mark.parametrize("pos_embed", ["learned", "rope_mixed", "irpe", "string_cayley", ["fourier", "rope_mixed"]])
def test_layer_decay_puts_position_parameters_with_the_stem(pos_embed):
    """As timm's pos_embed: group 0 with patch_embed, so layer decay scales them like the stem, not like the head."""
    from timm.models import group_parameters

    model = _model(pos_embed, **TINY)
    position = [n for n, _ in model.named_parameters() if n.startswith("pos_schemes.")]
    assert position
    groups = group_parameters(model, model.group_matcher())
    assert sorted(groups) == [0, 1, 2, 3]  # stem, blocks 0 and 1, block 2 + norm: no extra group
    assert set(position) <= set(groups[0]) and "patch_embed.proj.weight" in groups[0]
    scales = _lr_scales(model)
    assert {scales[n] for n in position} == {scales["patch_embed.proj.weight"]} == {0.5**3}
    assert scales["blocks.2.attn.qkv.weight"] == scales["norm.weight"] == 1.0


def test_cpe_peg_is_grouped_with_the_block_it_follows():
    from timm.models import group_modules, group_parameters

    model = _model("cpe", pos_embed_kwargs={"insert_after": (0, 2)}, **TINY)
    layer = group_parameters(model, model.group_matcher(), reverse=True)
    assert layer["pos_schemes.cpe.pegs.0.proj.weight"] == layer["blocks.0.attn.qkv.weight"] == 1
    assert layer["pos_schemes.cpe.pegs.1.proj.bias"] == layer["blocks.2.mlp.fc1.weight"] == layer["norm.weight"] == 3
    assert group_modules(model, model.group_matcher(), reverse=True)["pos_schemes.cpe.pegs.1.proj"] == 3
    scales = _lr_scales(model)
    assert scales["pos_schemes.cpe.pegs.0.proj.weight"] == scales["blocks.0.norm1.weight"] == 0.25


def test_layer_decay_with_a_head_keeps_the_head_on_top():
    model = _model(["learned", "rope_axial"], **{**TINY, "num_classes": 5})
    scales = _lr_scales(model)
    assert scales["head.weight"] == 1.0 and scales["norm.weight"] == 0.5
    assert scales["pos_schemes.learned.pos_embed"] == scales["cls_token"] == 0.5**4


# -- no_embed_class (DeiT III / register ViTs) -------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra",
    [
        dict(no_embed_class=True),
        dict(no_embed_class=True, reg_tokens=2),
        dict(no_embed_class=True, reg_tokens=1, class_token=False, global_pool="avg"),
    ],
)
def test_no_embed_class_checkpoint_matches_timm(extra, tmp_path):
    """timm's no_embed_class reaches the learned table: a timm checkpoint loads to the same logits."""
    args = dict(depth=1, embed_dim=32, num_heads=2, img_size=32, patch_size=8, num_classes=5, **extra)
    src = timm.create_model("vit_tiny_patch16_224", **args).eval()
    torch.nn.init.normal_(src.pos_embed, std=0.5)  # a table that matters
    dst = _model("learned", **args).eval()
    assert dst.pos_schemes["learned"].no_embed_class and dst.pos_schemes["learned"].pos_embed.shape == (1, 16, 32)
    report = visionpe.load_timm_state_dict(dst, src.state_dict())
    assert not report.added and not report.dropped
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(dst(x), src(x), rtol=0, atol=1e-6)
    torch.save(src.state_dict(), tmp_path / "deit3.pth")
    overlay = {"file": str(tmp_path / "deit3.pth"), "num_classes": 5}
    loaded = _model("learned", pretrained=True, pretrained_cfg_overlay=overlay, **args).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), src(x), rtol=0, atol=1e-6)


def test_no_embed_class_through_pos_embed_kwargs_and_conflicts():
    model = _model("learned", pos_embed_kwargs={"no_embed_class": True}, reg_tokens=1)
    assert model.no_embed_class and model.pos_schemes["learned"].pos_embed.shape[1] == 14 * 14
    assert _model(["learned", "rope_mixed"], no_embed_class=True).pos_schemes["learned"].no_embed_class
    with pytest.raises(ValueError, match="no_embed_class=False contradicts pos_embed_kwargs\\['learned'\\]"):
        _model("learned", no_embed_class=False, pos_embed_kwargs={"no_embed_class": True})


# -- forward_intermediates: timm 1.0's signature -----------------------------------------------------------------
def test_forward_intermediates_signature_matches_timm():
    import inspect

    from timm.models.vision_transformer import VisionTransformer

    ours = inspect.signature(visionpe.VisionPEViT.forward_intermediates).parameters
    theirs = inspect.signature(VisionTransformer.forward_intermediates).parameters
    # timm's parameters in timm's order, then depth= (STRING's RGB-D positions), keyword-compatible
    expected = [(p.name, p.default) for p in theirs.values()] + [("depth", None)]
    assert [(p.name, p.default) for p in ours.values()] == expected


def test_forward_intermediates_output_dict_matches_timm():
    """Same weights in timm's own ViT (learned table): the same dict, key for key."""
    args = dict(depth=2, embed_dim=32, num_heads=2, img_size=32, patch_size=8, num_classes=5, reg_tokens=1)
    src = timm.create_model("vit_tiny_patch16_224", **args).eval()
    dst = _model("learned", **args).eval()
    visionpe.load_timm_state_dict(dst, src.state_dict())
    x = torch.randn(2, 3, 32, 32)
    for kw in (
        dict(output_dict=True),
        dict(output_dict=True, return_prefix_tokens=True, indices=[0], norm=True),
        dict(output_dict=True, intermediates_only=True, output_fmt="NLC"),
    ):
        with torch.no_grad():
            ours, theirs = dst.forward_intermediates(x, **kw), src.forward_intermediates(x, **kw)
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), kw
        for key in theirs:
            torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-6)
    with torch.no_grad():  # and the tuple / list forms
        final, feats = dst.forward_intermediates(x, indices=1, return_prefix_tokens=True)
        ref_final, ref_feats = src.forward_intermediates(x, indices=1, return_prefix_tokens=True)
    torch.testing.assert_close(final, ref_final, rtol=0, atol=1e-6)
    torch.testing.assert_close(feats, ref_feats, rtol=0, atol=1e-6)


def test_forward_intermediates_without_prefix_tokens_returns_plain_features():
    model = _model("rope_mixed", class_token=False, global_pool="avg", **{**TINY, "depth": 2}).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        feats = model.forward_intermediates(x, return_prefix_tokens=True, intermediates_only=True)
        out = model.forward_intermediates(x, return_prefix_tokens=True, output_dict=True)
    assert all(isinstance(f, torch.Tensor) and f.shape == (1, 32, 4, 4) for f in feats)
    assert set(out) == {"image_intermediates", "image_features"}


# -- loading checkpoints through timm's factory ------------------------------------------------------------------
def test_pretrained_visionpe_checkpoint_of_another_scheme_fails_loudly(tmp_path):
    args = dict(depth=1, embed_dim=32, num_heads=2, img_size=32, patch_size=8, num_classes=5)
    torch.save(_model(["learned", "rope_mixed"], **args).state_dict(), tmp_path / "ckpt.pth")
    overlay = {"file": str(tmp_path / "ckpt.pth"), "num_classes": 5}
    with pytest.raises(ValueError, match="missing position keys \\['pos_schemes.irpe.tables.k'\\], unexpected"):
        _model("irpe", pretrained=True, pretrained_cfg_overlay=overlay, **args)
    with pytest.raises(ValueError, match="unexpected position keys \\['pos_schemes.rope_mixed.freqs'\\]"):
        _model("learned", pretrained=True, pretrained_cfg_overlay=overlay, **args)
    # the same schemes load; a head of another size is still dropped by timm (why the load is not strict)
    src = _model(["learned", "rope_mixed"], **args)
    torch.save(src.state_dict(), tmp_path / "ckpt.pth")
    dst = _model(["learned", "rope_mixed"], pretrained=True, pretrained_cfg_overlay={"file": overlay["file"]}, **args)
    assert torch.equal(dst.pos_schemes["rope_mixed"].freqs, src.pos_schemes["rope_mixed"].freqs)
    assert torch.equal(dst.blocks[0].attn.qkv.weight, src.blocks[0].attn.qkv.weight)


def test_load_timm_state_dict_refuses_a_state_dict_that_fills_nothing_or_another_size():
    """Nothing matched (an empty dict, another model size) or shapes that disagree raise unless strict=False; the
    classifier alone may differ (timm drops a head of another num_classes)."""
    dst = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="rope_mixed", depth=2, num_classes=10)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(ValueError, match="fills no tensor"):
        visionpe.load_timm_state_dict(dst, {})
    wider = timm.create_model("vit_small_patch16_224", depth=2, num_classes=10).state_dict()
    with pytest.raises(ValueError, match="(fills no tensor|disagrees .* in shape).*strict=False"):
        visionpe.load_timm_state_dict(dst, wider)
    partly = timm.create_model("vit_tiny_patch16_224", depth=2, num_classes=10).state_dict()
    partly["blocks.1.mlp.fc1.weight"] = torch.zeros(10, 192)
    with pytest.raises(ValueError, match=r"disagrees .* in shape at 1 key.*blocks\.1\.mlp\.fc1\.weight"):
        visionpe.load_timm_state_dict(dst, partly)
    assert all(torch.equal(v, before[k]) for k, v in dst.state_dict().items())  # a refused load changes nothing
    report = visionpe.load_timm_state_dict(dst, partly, strict=False)
    assert any(d.startswith("blocks.1.mlp.fc1.weight") for d in report.dropped)
    other_head = timm.create_model("vit_tiny_patch16_224", depth=2, num_classes=5).state_dict()
    report = visionpe.load_timm_state_dict(dst, other_head)  # strict: only the classifier differs
    assert [d.split()[0] for d in report.dropped if "head" in d] == ["head.weight", "head.bias"]
    with pytest.raises(TypeError, match="strict must be"):
        visionpe.load_timm_state_dict(dst, other_head, strict="yes")


def test_load_timm_state_dict_rejects_non_tensors():
    model = _model("learned", **TINY)
    with pytest.raises(TypeError, match="got str at key 'pos_embed'"):
        visionpe.load_timm_state_dict(model, {"pos_embed": "x"})
    with pytest.raises(TypeError, match="keys must be parameter names"):
        visionpe.load_timm_state_dict(model, {0: torch.zeros(1)})


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(depth=0), ValueError, r"depth must be a positive int, got 0"),
        (dict(depth=1.5), TypeError, r"depth must be a positive int, got float \(1.5\)"),
        (dict(patch_size=0), ValueError, r"patch_size must be a positive int or \(H, W\) pair .*, got 0"),
        (dict(img_size=(32, 32, 3)), ValueError, r"img_size must be .* got \(32, 32, 3\)"),
        (dict(embed_dim=100, num_heads=3), ValueError, r"embed_dim must be divisible by num_heads, got embed_dim=100"),
        (dict(num_heads=0), ValueError, r"num_heads must be a positive int, got 0"),
        (dict(in_chans=0), ValueError, r"in_chans must be a positive int, got 0"),
        (dict(num_classes=-1), ValueError, r"num_classes must be a non-negative int \(0: no head\), got -1"),
        (dict(mlp_ratio=0), ValueError, r"mlp_ratio must be a positive finite number, got 0"),
        (dict(drop_path_rate=1.5), ValueError, r"drop_path_rate must be a number in \[0, 1\], got 1.5"),
        (dict(class_token=False), ValueError, r"class_token must be True for global_pool='token' .*got class_token=F"),
        (dict(global_pool="mean"), ValueError, r"global_pool must be one of \(.*'avg'.*\), got 'mean'"),
        (dict(dynamic_img_size="yes"), TypeError, r"dynamic_img_size must be a bool, got str \('yes'\)"),
    ],
)
def test_model_arguments_are_checked_before_timm_builds(kwargs, error, match):
    """Before the check, timm stopped at an IndexError (depth=0), a ZeroDivisionError (patch_size=0) or a bare
    AssertionError (embed_dim not divisible by num_heads), or built a model that cannot run (in_chans=0)."""
    names = ["visionpe_vit_tiny_patch16_224", "visionpe_video_vit_tiny_tubelet2x16", "visionpe_mvvit_tiny_patch16"]
    if "class_token" in kwargs:
        names.pop()  # the multi-view ViT has no class token and pools "avg"
    for name in names:
        with pytest.raises(error, match=match):
            timm.create_model(name, pos_embed="none", **{**TINY, **kwargs})


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_input_of_another_dtype_than_the_model_is_refused_outside_autocast(dtype):
    """torch stopped at the patch embedding ("Input type (double) and bias type (float) should be the same")."""
    model = _model("rope_axial", **TINY)
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(ValueError, match=rf"x must have the model's dtype torch.float32 .*got dtype {dtype}"):
        model(x.to(dtype))
    if dtype != torch.float64:  # autocast casts low-precision input itself (it leaves float64 alone)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model(x.to(dtype)).isfinite().all()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="got dtype torch.float64"):
        model(x.double())
    model.to(dtype)  # a model in that dtype takes it, and refuses float32
    assert model(x.to(dtype)).isfinite().all()
    with pytest.raises(ValueError, match=rf"x must have the model's dtype {dtype} .*got dtype torch.float32"):
        model(x)


def test_input_messages_show_the_shape_given():
    model = _model("rope_axial", **TINY)
    with pytest.raises(ValueError, match=r"got \(2, 32, 32, 3\) \(channels last\? x.permute\(0, 3, 1, 2\)"):
        model(torch.randn(2, 32, 32, 3))
    with pytest.raises(TypeError, match=r"x must be a batch \(B, C, H, W\) as a torch.Tensor, got list"):
        model([[0.0]])
    with pytest.raises(ValueError, match=r"x has image size 24x24, which does not match the model's img_size"):
        model(torch.randn(1, 3, 24, 24))
    with pytest.raises(TypeError, match=r"x must be a batch .* got list"):  # checked before x.shape is read
        model.forward_intermediates([[0.0]])


@pytest.mark.parametrize(
    "indices, match",
    [
        (0, r"indices must be None, a number of last blocks in \[1, 3\] or a list of block indices, got 0"),
        (4, r"indices must be None, .* got 4"),
        (2.0, r"indices must be None, .* got float \(2.0\)"),
        ([], r"indices must name at least one block \(of 3\), got \[\]"),
        ([0, 3], r"indices\[1\] must be an int in \[-3, 2\], got 3"),
    ],
)
def test_forward_intermediates_checks_indices(indices, match):
    """timm's feature_take_indices stopped at a bare AssertionError."""
    model = _model("rope_axial", **TINY)
    with pytest.raises((ValueError, TypeError), match=match):
        model.forward_intermediates(torch.randn(1, 3, 32, 32), indices=indices)
    assert len(model.forward_intermediates(torch.randn(1, 3, 32, 32), indices=[-1, 0])[1]) == 2
