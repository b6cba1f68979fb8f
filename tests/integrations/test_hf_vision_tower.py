"""visionpe rotary schemes in the vision towers of tiny random Qwen-VL models (no downloads)."""

import copy
import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.vision_utils import get_vision_position_ids  # noqa: E402

import visionpe  # noqa: E402
from visionpe.integrations.hf.vision_tower import (  # noqa: E402
    VisionTowerRotary,
    apply_vision_rope,
    own_vision_rope_options,
    remove_vision_rope,
    vision_tower,
)

from . import test_hf as hf  # noqa: E402

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
# a 4x4 and a 4x6 image (in patches) in one sample, a 4x4 one in the other
IMAGES = hf.IMAGES
# a 2-frame 4x4 video beside a 4x6 image
VIDEO = [[(2, (2, 4, 4)), (1, (1, 4, 6))], [(1, (1, 4, 4))]]
MERGE = hf.VISION["spatial_merge_size"]


def _sharpen(model):
    """q and k of the tower scaled up: at random init attention is nearly uniform and hardly sees the rotation."""
    with torch.no_grad():
        for block in vision_tower(model).blocks:
            block.attn.qkv.weight[: 2 * block.attn.qkv.out_features // 3] *= 20
    return model


@functools.cache
def _model(family):
    return _sharpen(hf.tiny_model(family))


@functools.cache
def _deep_model():
    """Qwen2.5-VL with a two-block tower: a window-attention block, then a full one."""
    torch.manual_seed(0)
    vision = {
        **hf.VISION,
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": 64,
        "window_size": 8,
        "fullatt_block_indexes": [1],
    }
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
    config = transformers.Qwen2_5_VLConfig(
        text_config={**hf.TEXT, "rope_parameters": rope}, vision_config=vision, **hf.TOKENS
    )
    return _sharpen(transformers.Qwen2_5_VLForConditionalGeneration(config).eval())


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _no_hooks(tower):
    modules = [tower, *(block.attn for block in tower.blocks)]
    return all(not m._forward_pre_hooks and not m._forward_hooks for m in modules)


@pytest.mark.parametrize(
    "family, blocks", [(f, IMAGES) for f in FAMILIES] + [("qwen2_5_vl", VIDEO)], ids=[*FAMILIES, "qwen2_5_vl-video"]
)
def test_own_scheme_reproduces_the_model(family, blocks):
    model = _model(family)
    inputs = hf.batch(blocks)
    ref = _logits(model, inputs)
    patched = apply_vision_rope(copy.deepcopy(model))  # rope_axial with the tower's base and axis order
    tower = vision_tower(patched)
    assert isinstance(tower.rotary_pos_emb, VisionTowerRotary)
    assert tower.visionpe_vision_rope == "rope_axial"
    torch.testing.assert_close(_logits(patched, inputs), ref, rtol=0, atol=1e-5)
    # the comparison sees the rotary: the same scheme with the axes swapped changes the logits
    apply_vision_rope(patched, axis_order="xy")
    assert not torch.allclose(_logits(patched, inputs), ref, atol=1e-3)


def test_own_options_are_the_towers():
    tower = vision_tower(_model("qwen2_vl"))
    assert own_vision_rope_options(tower) == {"base": 10000.0, "axis_order": "yx"}
    scheme = visionpe.create_pos_embed("rope_axial", dim=32, num_heads=2, **own_vision_rope_options(tower))
    # rows (y, x); the tower: pairs [0, d/4) read h with inv_freq, pairs [d/4, d/2) read w with it
    inv_freq = tower.rotary_pos_emb.inv_freq
    zeros = torch.zeros_like(inv_freq)
    expected = torch.stack((torch.cat((inv_freq, zeros)), torch.cat((zeros, inv_freq))))
    torch.testing.assert_close(scheme.frequencies()[0, 0], expected, rtol=1e-6, atol=0)


def test_positions_in_merge_window_order_with_each_images_grid():
    grid_thw = torch.tensor([[1, 4, 6], [2, 4, 4], [1, 2, 2]])
    position_ids = get_vision_position_ids(grid_thw, MERGE)
    model = apply_vision_rope(copy.deepcopy(_model("qwen2_vl")), coord_mode="centered")
    coords, grids = vision_tower(model).rotary_pos_emb.positions(position_ids, grid_thw)
    counts = grid_thw.prod(-1).tolist()
    sizes = [(h, w) for _, h, w in grid_thw.tolist()]
    expected_grids = torch.cat([torch.tensor([size]).expand(n, 2) for size, n in zip(sizes, counts, strict=True)])
    assert torch.equal(grids, expected_grids)
    # centered: i - (n - 1) / 2 per axis of the token's own image
    torch.testing.assert_close(coords, position_ids.float() - (expected_grids.float() - 1) / 2, rtol=0, atol=0)


def test_rope_mixed_changes_logits_and_its_frequencies_train():
    model = _model("qwen2_5_vl")  # window attention; 2 heads: per-head tables
    inputs = hf.batch(IMAGES)
    ref = _logits(model, inputs)
    patched = apply_vision_rope(copy.deepcopy(model), "rope_mixed")
    scheme = vision_tower(patched).rotary_pos_emb.scheme
    assert any(p is scheme.freqs for p in patched.parameters())
    out = patched(**inputs).logits
    assert not torch.allclose(out, ref, atol=1e-3)
    out.pow(2).mean().backward()
    grad = scheme.freqs.grad
    assert grad is not None and bool(torch.isfinite(grad).all())
    assert bool((grad.abs().sum(dim=(0, -1)) > 0).all())  # every layer and head


def test_per_layer_and_per_head_frequencies_reach_their_block():
    model = _deep_model()
    inputs = hf.batch(IMAGES)
    ref = _logits(model, inputs)
    # RoPE-Mixed started at the tower's axial frequencies: component x on the pairs that read w, y on those of h
    patched = apply_vision_rope(copy.deepcopy(model), "rope_mixed", init_from_tower=True)
    tower = vision_tower(patched)
    scheme = tower.rotary_pos_emb.scheme
    own = tower.rotary_pos_emb.original.inv_freq
    zeros = torch.zeros_like(own)
    torch.testing.assert_close(scheme.freqs[0, 1, 0], torch.cat((zeros, own)), rtol=1e-6, atol=0)  # x, block 1, head 0
    torch.testing.assert_close(scheme.freqs[1, 0, 1], torch.cat((own, zeros)), rtol=1e-6, atol=0)  # y, block 0, head 1
    torch.testing.assert_close(_logits(patched, inputs), ref, rtol=0, atol=1e-5)
    with torch.no_grad():  # the second block's second head alone: the logits move
        scheme.freqs[:, 1, 1] *= 1.5
    assert not torch.allclose(_logits(patched, inputs), ref, atol=1e-4)


def _tables(model, grid_thw, **kwargs):
    patched = apply_vision_rope(copy.deepcopy(model), **kwargs)
    rotary = vision_tower(patched).rotary_pos_emb
    position_ids = get_vision_position_ids(grid_thw, MERGE)
    coords, grids = rotary.positions(position_ids, grid_thw)
    return rotary, position_ids, coords, grids, rotary.layer_tables(coords, grids, 0)


@pytest.mark.parametrize("scheme, mode", [("rope_axial", "ntk"), ("rope_axial", "yarn"), ("rope_mixed", "ntk")])
def test_scaling_matches_visionpe_rotation_per_image_and_changes_the_model(scheme, mode):
    model = _model("qwen2_vl")
    patched = apply_vision_rope(copy.deepcopy(model), scheme, extrapolation=mode, base_grid=(2, 2))
    rotary = vision_tower(patched).rotary_pos_emb
    grid_thw = torch.tensor([[1, 4, 4], [1, 4, 6], [2, 4, 4]])
    position_ids = get_vision_position_ids(grid_thw, MERGE)
    coords, grids = rotary.positions(position_ids, grid_thw)
    cos, sin = rotary.layer_tables(coords, grids, 0)
    if cos.ndim == 2:  # shared by the heads
        cos, sin = cos[:, None], sin[:, None]
    x = torch.randn(len(cos), 2, 16, generator=torch.Generator().manual_seed(0))
    rotated = x * cos + _rotate_half(x) * sin  # the tower's rotation
    half = torch.arange(8)
    interleave = torch.stack((half, half + 8), -1).flatten()  # visionpe's pair j = the tower's (j, j + d/2)
    start = 0
    for t, h, w in grid_thw.tolist():
        rows = slice(start, start + t * h * w)
        start += t * h * w
        x_vpe = x[rows][..., interleave].transpose(0, 1)[None]
        ref = rotary.scheme.rotate(x_vpe, position_ids[rows].float(), grid_size=(h, w))
        torch.testing.assert_close(rotated[rows], ref[0].transpose(0, 1)[..., interleave.argsort()], atol=1e-5, rtol=0)
    inputs = hf.batch(IMAGES)
    scaled = _logits(patched, inputs)
    rotary.scheme.set_extrapolation("none")  # the same frequencies, unscaled
    plain_cos, _ = rotary.layer_tables(coords, grids, 0)
    assert not torch.allclose(cos.squeeze(1), plain_cos, atol=1e-3)
    assert not torch.allclose(scaled, _logits(patched, inputs), atol=1e-4)


def test_pi_interpolates_each_images_positions_against_the_base_grid():
    model = _model("qwen3_vl")
    grid_thw = torch.tensor([[1, 4, 4], [1, 4, 6]])
    *_, coords, grids, (cos, sin) = _tables(model, grid_thw, extrapolation="pi", base_grid=(4, 4))
    plain, *_ = _tables(model, grid_thw)
    # the 4x4 image is not scaled; the 4x6 one reads w / 1.5 (s = (1, 6 / 4))
    factors = torch.where(grids[:, 1:] == 6, torch.tensor([[1.0, 1.5]]), torch.ones(1, 2))
    ref_cos, ref_sin = plain.layer_tables(coords / factors, grids, 0)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-5)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-5)
    assert not torch.allclose(cos[16:], plain.layer_tables(coords, grids, 0)[0][16:], atol=1e-3)


def test_remove_restores_the_model_exactly():
    model = _model("qwen3_vl")
    inputs = hf.batch(IMAGES)
    ref = _logits(model, inputs)
    patched = copy.deepcopy(model)
    tower = vision_tower(patched)
    own = tower.rotary_pos_emb
    apply_vision_rope(patched.model, "rope_mixed")  # through the inner model
    apply_vision_rope(tower, "rope_axial", base=100.0)  # replaces rope_mixed, hooks included
    assert not torch.allclose(_logits(patched, inputs), ref, atol=1e-3)
    assert remove_vision_rope(patched) is patched
    assert tower.rotary_pos_emb is own and _no_hooks(tower)
    assert not hasattr(tower, "visionpe_vision_rope")
    assert torch.equal(_logits(patched, inputs), ref)
    assert remove_vision_rope(patched) is patched  # not patched: unchanged


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(scheme=3), TypeError, "scheme"),
        (dict(scheme="sincos"), TypeError, "scheme"),
        (dict(scheme="alibi2d"), TypeError, "scheme"),
        (dict(scheme="liere"), TypeError, "scheme"),
        (dict(scheme="rope_axial", ndim=3), ValueError, "ndim"),
        (dict(scheme="rope_axial", rotate_values=True), ValueError, "rotate_values"),
        (dict(scheme="rope_axial", bogus=1), ValueError, "bogus"),
        (dict(scheme="no_such_scheme"), ValueError, "no_such_scheme"),
        (dict(extrapolation="ntk"), ValueError, "base_grid"),
        (dict(extrapolation="zoom", base_grid=(2, 2)), ValueError, "extrapolation"),
        (dict(extrapolation="pi", base_grid=(2, 2, 2)), ValueError, "base_grid"),
        (dict(scheme="rope_dinov3", extrapolation="ntk", base_grid=(2, 2)), ValueError, "extrapolation"),
        (dict(scheme="rope_axial", init_from_tower=True), ValueError, "init_from_tower"),
        (dict(scheme="rope_mixed", init_from_tower="yes"), TypeError, "init_from_tower"),
    ],
)
def test_bad_input_names_the_argument_and_leaves_the_model(kwargs, error, name):
    model = copy.deepcopy(_model("qwen2_vl"))
    tower = vision_tower(model)
    own = tower.rotary_pos_emb
    with pytest.raises(error, match=name):
        apply_vision_rope(model, **kwargs)
    assert tower.rotary_pos_emb is own and _no_hooks(tower)


def test_unsupported_model_and_scheme_shape():
    with pytest.raises(TypeError, match="model"):
        apply_vision_rope(torch.nn.Linear(2, 2))
    model = copy.deepcopy(_model("qwen2_vl"))
    wrong = visionpe.create_pos_embed("rope_axial", dim=64, num_heads=4)  # head_dim 16, but 4 heads
    with pytest.raises(ValueError, match="num_heads"):
        apply_vision_rope(model, wrong)
    with pytest.raises(ValueError, match="options"):
        apply_vision_rope(model, visionpe.create_pos_embed("rope_axial", dim=32, num_heads=2), base=10.0)
