"""Flux patched by visionpe: with no mode set, the same rotary (cos and sin bit for bit) and the same denoiser output
as diffusers' at the training size, at twice the side, with text tokens and with a Kontext-like reference image; the
way back; the weights untouched."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_flux import FluxPosEmbed

import visionpe
from visionpe.integrations.diffusers import (
    DiffusionRotary,
    apply_position_scheme,
    patched_rotary,
    remove_position_scheme,
)
from visionpe.integrations.diffusers.flux import FLUX, FluxRotary

from .conftest import AXES, TRAIN_GRID, flux_ids, flux_inputs, run, run_capturing_rotary


def assert_same(patched: tuple, original: tuple) -> None:
    for mine, theirs in zip(patched, original, strict=True):
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
        assert torch.equal(mine, theirs), (mine - theirs).abs().max()


@pytest.mark.parametrize(
    "size, text, reference",
    [
        ((4, 4), 3, None),  # the training grid
        ((8, 8), 3, None),  # twice the side
        ((8, 5), 7, None),  # another aspect ratio, more text
        ((6, 6), 0, None),  # no text token
        ((8, 8), 3, (4, 4)),  # a Kontext-like reference image, index id 1
        ((4, 4), 3, (8, 6)),  # a reference image larger than the generated one
    ],
)
def test_patched_flux_equals_the_original(flux, size, text, reference):
    inputs = flux_inputs(*size, text=text, reference=reference)
    original, original_rotary = run_capturing_rotary(flux, inputs)
    apply_position_scheme(flux, train_grid_size=TRAIN_GRID)
    assert isinstance(flux.pos_embed, FluxRotary)
    patched, patched_cos_sin = run_capturing_rotary(flux, inputs)
    assert_same(patched_cos_sin, original_rotary)
    torch.testing.assert_close(patched, original, rtol=0, atol=1e-6)


def test_dype_at_the_training_size_changes_nothing(flux):
    # DyPE, like every mode, acts only on an axis longer than its training length
    inputs = flux_inputs(4, 4, reference=(4, 4))
    original = run(flux, inputs)
    apply_position_scheme(flux, train_grid_size=TRAIN_GRID)
    for mode in ("dype", "yarn", "ntk", "pi", "riflex"):
        visionpe.set_extrapolation(flux, mode)
        torch.testing.assert_close(run(flux, inputs), original, rtol=0, atol=1e-6)


def test_remove_position_scheme_restores_the_module_and_the_outputs(flux):
    own = flux.pos_embed
    hooks = dict(flux._forward_pre_hooks)
    inputs = flux_inputs(8, 8)
    original = run(flux, inputs)
    apply_position_scheme(flux, train_grid_size=TRAIN_GRID)
    visionpe.set_extrapolation(flux, "dype")
    assert not torch.equal(run(flux, inputs), original)  # the mode acts at twice the side
    assert remove_position_scheme(flux) is flux
    assert flux.pos_embed is own and isinstance(own, FluxPosEmbed)
    assert dict(flux._forward_pre_hooks) == hooks  # the timestep hook is gone
    assert torch.equal(run(flux, inputs), original)
    # and the model can be patched again
    apply_position_scheme(flux, train_grid_size=TRAIN_GRID)
    torch.testing.assert_close(run(flux, inputs), original, rtol=0, atol=1e-6)


def test_patched_rotary_is_the_rotary_in_place(flux):
    report = apply_position_scheme(flux)
    rotary = patched_rotary(flux)
    assert isinstance(rotary, DiffusionRotary) and rotary is report.rotary and rotary is flux.pos_embed.rotary
    assert (report.family, report.attribute) == ("flux", "pos_embed")
    # without train_grid_size: the released models' 1024 px, a 64 x 64 grid of tokens
    assert report.train_grid_size == FLUX.default_train_grid == (1, 64, 64)
    assert rotary.names == ("index", "height", "width") and rotary.axes_dim == (4, 6, 6)
    assert rotary.freqs_dtype == torch.float64 and rotary.fixed_axes == ("index",)
    assert visionpe.set_extrapolation(flux, "yarn") == ["pos_embed.rotary"]
    assert rotary.extrapolation == "yarn"


def test_patching_leaves_the_weights_and_their_names(flux):
    before = {k: v.clone() for k, v in flux.state_dict().items()}
    apply_position_scheme(flux, train_grid_size=TRAIN_GRID)
    after = flux.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    # a checkpoint of the original model loads strictly into the patched one, and back
    flux.load_state_dict(before, strict=True)
    remove_position_scheme(flux)
    flux.load_state_dict(after, strict=True)


def test_train_grid_size_is_the_modes_reference(flux):
    # the same 8 x 8 input under PI: a training grid of 4 halves the height and width frequencies, one of 8 leaves them
    inputs = flux_inputs(8, 8)
    original = run(flux, inputs)
    apply_position_scheme(flux, train_grid_size=(1, 8, 8))
    visionpe.set_extrapolation(flux, "pi")
    torch.testing.assert_close(run(flux, inputs), original, rtol=0, atol=1e-6)
    visionpe.set_extrapolation(flux, "pi", train_grid_size=TRAIN_GRID)
    assert patched_rotary(flux).train_grid_size == TRAIN_GRID
    assert not torch.allclose(run(flux, inputs), original, atol=1e-4)


@pytest.mark.parametrize("mode", ["none", "pi", "ntk", "yarn", "dype"])
def test_the_rotary_stays_on_the_device_of_its_ids(mode):
    # the meta device stands in for an accelerator: ids and timestep there, every tensor the mode builds follows
    # them (a CPU tensor mixed in raises); riflex is left out: its eager check reads the frequencies on the host
    rotary = FluxRotary(AXES, 10000.0, TRAIN_GRID)
    rotary.rotary.set_extrapolation(mode)
    rotary.rotary.timestep = torch.tensor([0.7], device="meta")
    cos, sin = rotary(flux_ids(8, 8).to("meta"))
    assert cos.device.type == sin.device.type == "meta" and cos.shape == (64, sum(AXES))
