"""Qwen-Image patched by visionpe: with no mode set, the same complex rotations (bit for bit) and the same output as
diffusers' centred MSRoPE at the training size, at twice the side, with several images (Qwen-Image-Edit's
``img_shapes``), for the layered variant and the ControlNet; the modes measure the image by its sides."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage import QwenEmbedLayer3DRope, QwenEmbedRope

import visionpe
from visionpe.integrations.diffusers import (
    DIFFUSERS_FAMILIES,
    apply_position_scheme,
    dype_frequencies,
    patched_rotary,
    remove_position_scheme,
    rope_frequencies,
)
from visionpe.integrations.diffusers.qwenimage import (
    QWENIMAGE,
    QWENIMAGE_LAYERED_TRAIN_GRID,
    QwenImageLayeredRotary,
    QwenImageRotary,
)

from .conftest import (
    AXES,
    TRAIN_GRID,
    qwen_inputs,
    run_capturing_rotary,
    tiny_qwen,
    tiny_qwen_controlnet,
)

SHAPES = [
    [(1, 4, 4)],  # the training grid
    [(1, 8, 8)],  # twice the side
    [(1, 5, 7)],  # odd sides: one more negative position than positive
    [(1, 8, 6), (1, 4, 4)],  # Qwen-Image-Edit: the generated image, then a condition image (index 1)
    [(1, 3, 5), (1, 6, 4), (1, 2, 2)],  # several condition images
]


def assert_same(patched: tuple, original: tuple) -> None:
    for mine, theirs in zip(patched, original, strict=True):
        assert mine.dtype == theirs.dtype == torch.complex64 and mine.shape == theirs.shape
        assert torch.equal(mine, theirs), (mine - theirs).abs().max()


@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_patched_qwenimage_equals_the_original(qwen, shapes):
    inputs = qwen_inputs(shapes, text=5)
    original, original_rotations = run_capturing_rotary(qwen, inputs)
    apply_position_scheme(qwen, train_grid_size=TRAIN_GRID)
    assert isinstance(qwen.pos_embed, QwenImageRotary)
    patched, rotations = run_capturing_rotary(qwen, inputs)
    assert_same(rotations, original_rotations)
    torch.testing.assert_close(patched, original, rtol=0, atol=1e-6)


@pytest.mark.parametrize("shapes", [[(1, 4, 4)], [(1, 8, 8), (1, 4, 6)], [(2, 3, 3)]], ids=str)
def test_the_rotary_answers_every_call_form_of_diffusers_module(shapes):
    own = QwenEmbedRope(theta=10000, axes_dim=list(AXES), scale_rope=True)
    mine = QwenImageRotary(AXES, 10000.0, TRAIN_GRID)
    # one sample's shapes, a batch of identical samples, a 0-d tensor text length, no device (CPU)
    for video_fhw in (shapes, [shapes, shapes]):
        for text in (4, torch.tensor(4)):
            assert_same(mine(video_fhw, None, text), own(video_fhw, None, text))
            assert_same(mine(video_fhw, device="cpu", max_txt_seq_len=text), own(video_fhw, "cpu", text))
    assert_same(mine(shapes[0], None, 2), own(shapes[0], None, 2))  # one (frames, height, width)
    with pytest.raises(ValueError, match="max_txt_seq_len"):
        mine(shapes, None, None)


def test_without_scale_rope_the_positions_start_at_zero():
    # the model centres its grids; the module it holds also takes scale_rope=False, with positions 0, 1, ...
    own = QwenEmbedRope(theta=10000, axes_dim=list(AXES), scale_rope=False)
    mine = QwenImageRotary(AXES, 10000.0, TRAIN_GRID, scale_rope=False)
    for shapes in ([(1, 4, 4)], [(1, 5, 3), (1, 2, 6)]):
        assert_same(mine([shapes], None, 3), own([shapes], None, 3))


def test_several_samples_with_different_shapes_take_the_first_as_diffusers(caplog):
    own = QwenEmbedRope(theta=10000, axes_dim=list(AXES), scale_rope=True)
    mine = QwenImageRotary(AXES, 10000.0, TRAIN_GRID)
    batch = [[(1, 4, 4)], [(1, 6, 2)]]
    with caplog.at_level("WARNING", logger="visionpe.integrations.diffusers.qwenimage"):
        assert_same(mine(batch, None, 3), own(batch, None, 3))
    assert "first sample" in caplog.text


@pytest.mark.parametrize(
    "shapes",
    [
        [(1, 4, 4), (1, 4, 4)],  # one layer, then the condition image (index -1)
        [(1, 8, 8), (1, 8, 8), (1, 8, 8), (1, 6, 6)],  # three layers at twice the side
        [(1, 2, 2)] * 5,  # more layers than half a side: the text starts after the layer count
    ],
    ids=str,
)
def test_the_layered_variant_equals_the_original(shapes):
    model = tiny_qwen(layered=True)
    assert isinstance(model.pos_embed, QwenEmbedLayer3DRope)
    inputs = qwen_inputs(shapes, text=4)
    original, original_rotations = run_capturing_rotary(model, inputs)
    report = apply_position_scheme(model)
    assert isinstance(model.pos_embed, QwenImageLayeredRotary)
    assert report.train_grid_size == QWENIMAGE_LAYERED_TRAIN_GRID
    patched, rotations = run_capturing_rotary(model, inputs)
    assert_same(rotations, original_rotations)
    torch.testing.assert_close(patched, original, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"condition image .* 1 frame"):
        model.pos_embed([[(1, 4, 4), (2, 4, 4)]], 3)


def test_the_controlnet_equals_the_original():
    controlnet = tiny_qwen_controlnet()
    inputs = qwen_inputs([(1, 8, 8)], text=3)
    inputs["controlnet_cond"] = torch.randn_like(inputs["hidden_states"])
    with torch.no_grad():
        original = controlnet(**inputs)[0]
        apply_position_scheme(controlnet, train_grid_size=TRAIN_GRID)
        assert isinstance(controlnet.pos_embed, QwenImageRotary)
        patched = controlnet(**inputs)[0]
    assert len(patched) == len(original)
    for mine, theirs in zip(patched, original, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)


def test_the_family_and_its_default_training_grid(qwen):
    assert DIFFUSERS_FAMILIES["qwenimage"] is QWENIMAGE
    report = apply_position_scheme(qwen)
    # the released model card's 1:1 size, 1328 px: 1328 / 8 (VAE) / 2 (packing) = 83 tokens a side
    assert report.family == "qwenimage" and report.train_grid_size == QWENIMAGE.default_train_grid == (1, 83, 83)
    rotary = patched_rotary(qwen)
    assert rotary.freqs_dtype == torch.float32 and rotary.names == ("index", "height", "width")
    assert rotary.fixed_axes == ("index",)
    remove_position_scheme(qwen)
    assert isinstance(qwen.pos_embed, QwenEmbedRope)


def height_angles(rotations: torch.Tensor) -> torch.Tensor:
    # the angles of the height block: pairs 2..4 of the (index 2, height 3, width 3) pairs
    return torch.angle(rotations[:, 2:5]).double()


def test_the_modes_measure_the_image_by_its_sides(qwen):
    # at 8 x 8 the centred rows run -4..3: their largest position + 1 is 4, the training side, but the image has 8
    # rows, twice the training side, so PI halves the height frequencies
    inputs = qwen_inputs([(1, 8, 8)], text=2)
    apply_position_scheme(qwen, train_grid_size=TRAIN_GRID)
    visionpe.set_extrapolation(qwen, "pi", axes=("height",))
    _, (image, _) = run_capturing_rotary(qwen, inputs)
    rows = (torch.arange(8) - 4).repeat_interleave(8).double()
    expected = rows[:, None] * rope_frequencies(6, 10000.0, torch.float32).double() / 2
    torch.testing.assert_close(height_angles(image), expected, rtol=0, atol=1e-5)
    # the width keeps its frequencies (only the named axis is scaled)
    visionpe.set_extrapolation(qwen, "none")
    _, (unscaled, _) = run_capturing_rotary(qwen, inputs)
    assert torch.equal(image[:, 5:], unscaled[:, 5:]) and not torch.equal(image[:, 2:5], unscaled[:, 2:5])


@pytest.mark.parametrize("timestep", [1.0, 0.5, 0.1])
def test_dype_reads_the_timestep_the_pipeline_passes(qwen, timestep):
    inputs = qwen_inputs([(1, 8, 4)], text=2, timestep=timestep)
    apply_position_scheme(qwen, train_grid_size=TRAIN_GRID)
    visionpe.set_extrapolation(qwen, "dype")
    _, (image, text) = run_capturing_rotary(qwen, inputs)
    assert float(patched_rotary(qwen).timestep) == pytest.approx(timestep)
    # the height (8 rows, twice the training side) under DyPE at this timestep; the width (4) as trained
    freqs, mscale = dype_frequencies(6, 10000.0, 4, 8, timestep, dtype=torch.float32)
    rows = (torch.arange(8) - 4).repeat_interleave(4).float()
    expected = torch.polar(torch.full((32, 3), float(mscale)), rows[:, None] * freqs)
    torch.testing.assert_close(image[:, 2:5], expected, rtol=0, atol=1e-6)
    own = QwenEmbedRope(theta=10000, axes_dim=list(AXES), scale_rope=True)
    assert torch.equal(image[:, 5:], own([[(1, 8, 4)]], None, 2)[0][:, 5:])
    assert text.shape == (2, 8)
