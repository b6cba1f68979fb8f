"""DyPE against its released Flux code, re-written here from its formulas: ``get_1d_rotary_pos_embed(..., yarn=True,
max_pe_len, ori_max_pe_len, dype=True, current_timestep)`` for DY-YaRN and the NTK factor of ``FluxPosEmbed.forward``
for DY-NTK (Issachar et al., arXiv 2510.20766), whose schedule exponent (lambda_t = 2 there) is a parameter here;
then end to end: a patched Flux under ``set_extrapolation(model, "dype")`` computes the released embedder's cos and sin
at the timestep its caller passed, with the call unchanged."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import visionpe
from visionpe.integrations.diffusers import apply_position_scheme, dype_frequencies, patched_rotary

from .conftest import flux_inputs, run, run_capturing_rotary, tiny_flux

THETA = 10000.0


def released_axis(dim, positions, current, base, timestep, method, exponent=2.0):
    """One axis of the released DyPE Flux embedder: (cos, sin), each (S, dim) float32, pairs repeated on their two
    channels; ``current`` the axis' length (largest id + 1), ``base`` its training length (``base_patches``)."""
    index = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    kappa = exponent * timestep**exponent  # the released code: 2.0 * t ** 2.0
    mscale = 1.0
    if current <= base:
        freqs = 1.0 / THETA**index
    elif method == "ntk":
        factor = max(1.0, ((current / base) ** (dim / (dim - 2))) ** kappa)
        freqs = 1.0 / (THETA * factor) ** index
    else:
        scale = torch.tensor(current / base, dtype=torch.float64)

        def bands(fast, slow):
            # YaRN's inverse-dim formula at `fast` and `slow` turns over the base length, floored / ceiled, clamped
            def turns(rotations):
                return dim * math.log(base / (rotations * 2 * math.pi)) / (2 * math.log(THETA))

            low, high = max(math.floor(turns(fast)), 0), min(math.ceil(turns(slow)), dim - 1)
            low, high = max(0, low), min(dim // 2, high)
            high = high + 0.001 if low == high else high
            ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
            return 1 - ramp.double()

        original = 1.0 / THETA**index
        linear = 1.0 / (scale * THETA**index)
        ntk = 1.0 / torch.pow(THETA * scale ** (dim / (dim - 2)), index)
        mask = bands(1.25**kappa, 0.75**kappa)
        freqs = linear * (1 - mask) + ntk * mask
        mask = bands(16**kappa, 2**kappa)
        freqs = freqs * (1 - mask) + original * mask
        mscale = 0.1 * torch.log(scale) + 1.0
    angles = torch.outer(positions.double(), freqs)
    cos = angles.cos().repeat_interleave(2, dim=1).float()
    sin = angles.sin().repeat_interleave(2, dim=1).float()
    return cos * mscale, sin * mscale


class ReleasedFluxPosEmbed(nn.Module):
    """The released embedder's forward on Flux ids: the index axis as trained, the height and width axes by
    :func:`released_axis` with their length read from the ids, at the timestep set on it."""

    def __init__(self, axes_dim, base_patches, method, exponent=2.0):
        super().__init__()
        self.axes_dim, self.base_patches, self.method, self.exponent = axes_dim, base_patches, method, exponent
        self.current_timestep = 1.0

    def forward(self, ids):
        cos, sin = [], []
        for axis, dim in enumerate(self.axes_dim):
            current = int(ids[:, axis].max().item()) + 1
            base = self.base_patches if axis > 0 else current  # the index axis is never extrapolated
            c, s = released_axis(dim, ids[:, axis], current, base, self.current_timestep, self.method, self.exponent)
            cos.append(c)
            sin.append(s)
        return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


@pytest.mark.parametrize("method", ["yarn", "ntk"])
@pytest.mark.parametrize("exponent", [2.0, 1.0, 0.5])
@pytest.mark.parametrize("dim, base, current", [(56, 64, 128), (16, 64, 96), (56, 64, 200), (12, 4, 9)])
def test_dype_frequencies_match_the_released_formula(method, exponent, dim, base, current):
    positions = torch.arange(current, dtype=torch.float32)
    for timestep in (1.0, 0.9, 0.6, 0.35, 0.1, 0.0):
        freqs, mscale = dype_frequencies(dim, THETA, base, current, timestep, method, exponent)
        assert freqs.dtype == torch.float64 and freqs.shape == (dim // 2,)
        angles = torch.outer(positions.double(), freqs)
        cos = (angles.cos().repeat_interleave(2, dim=1).float()) * mscale
        sin = (angles.sin().repeat_interleave(2, dim=1).float()) * mscale
        ref_cos, ref_sin = released_axis(dim, positions, current, base, timestep, method, exponent)
        torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-6, msg=f"t={timestep}")
        torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-6, msg=f"t={timestep}")
        # a 0-d tensor timestep (what the patched model hands over) gives the same
        on_tensor, tensor_mscale = dype_frequencies(
            dim, THETA, base, current, torch.tensor(timestep, dtype=torch.float64), method, exponent
        )
        torch.testing.assert_close(on_tensor, freqs, rtol=1e-12, atol=0)
        assert float(tensor_mscale) == pytest.approx(float(mscale))


def test_dype_interpolates_from_the_full_extrapolation_to_the_model_frequencies():
    # YaRN's multiplier at every timestep; at t = 0 nearly the model's own bands (the ramps collapse), at t = 1 fewer
    base_freqs = 1.0 / THETA ** (torch.arange(0, 56, 2, dtype=torch.float64) / 56)
    late, late_mscale = dype_frequencies(56, THETA, 64, 128, 0.0)
    early, early_mscale = dype_frequencies(56, THETA, 64, 128, 1.0)
    assert float(late_mscale) == float(early_mscale) == pytest.approx(0.1 * math.log(2) + 1)
    assert int((late == base_freqs).sum()) > int((early == base_freqs).sum())
    ntk_late, one = dype_frequencies(56, THETA, 64, 128, 0.0, "ntk")
    assert torch.equal(ntk_late, base_freqs) and float(one) == 1.0
    # at or below the training length, nothing changes
    same, one = dype_frequencies(56, THETA, 64, 64, 1.0)
    assert torch.equal(same, base_freqs) and float(one) == 1.0


@pytest.mark.parametrize(
    "argument, value, match",
    [
        ("dim", 3, "dim"),
        ("train_length", 0, "train_length"),
        ("length", -2, "length"),
        ("timestep", 1.5, "timestep"),
        ("method", "pi", "method"),
        ("exponent", 0.0, "exponent"),
    ],
)
def test_dype_frequencies_refuse_bad_arguments(argument, value, match):
    arguments = dict(dim=8, theta=THETA, train_length=4, length=8, timestep=0.5, method="yarn", exponent=2.0)
    arguments[argument] = value
    with pytest.raises((ValueError, TypeError), match=match):
        dype_frequencies(**arguments)


@pytest.mark.parametrize("method", ["yarn", "ntk"])
@pytest.mark.parametrize("exponent", [2.0, 1.0])
@pytest.mark.parametrize("size, timestep", [((8, 8), 0.6), ((12, 6), 0.25), ((8, 8), 1.0), ((6, 10), 0.0)])
def test_patched_flux_under_dype_is_the_released_embedder_at_the_passed_timestep(method, exponent, size, timestep):
    # head channels 32: index 8, height 12, width 12 (6 bands each); trained on 4 x 4 tokens
    axes = (8, 12, 12)
    original = tiny_flux(axes)
    released = copy.deepcopy(original)
    released.pos_embed = ReleasedFluxPosEmbed(axes, base_patches=4, method=method, exponent=exponent)
    released.pos_embed.current_timestep = timestep  # the released code sets it before each call
    inputs = flux_inputs(*size, text=3, timestep=timestep)
    reference, (ref_cos, ref_sin) = run_capturing_rotary(released, inputs)

    apply_position_scheme(original, train_grid_size=(1, 4, 4))
    visionpe.set_extrapolation(original, "dype", dype_method=method, dype_exponent=exponent)
    out, (cos, sin) = run_capturing_rotary(original, inputs)  # the forward call as the pipeline makes it
    assert float(patched_rotary(original).timestep) == pytest.approx(timestep)
    torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-6)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_the_timestep_reaches_the_rotary_positionally_and_at_every_call(flux):
    apply_position_scheme(flux, train_grid_size=(1, 4, 4))
    visionpe.set_extrapolation(flux, "dype")
    inputs = flux_inputs(8, 8, timestep=0.8)
    rotary = patched_rotary(flux)
    keyword = run(flux, inputs)
    assert float(rotary.timestep) == pytest.approx(0.8)
    names = ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"]
    positional = [inputs.pop(name) for name in names]
    with torch.no_grad():
        assert torch.equal(flux(*positional, **inputs)[0], keyword)
    for step in (0.7, 0.2):
        run(flux, flux_inputs(8, 8, timestep=step))
        assert float(rotary.timestep) == pytest.approx(step)
    # without the patched model's call, DyPE has no timestep to read
    rotary.timestep = None
    with pytest.raises(RuntimeError, match="timestep"):
        rotary.cos_sin(torch.zeros(4, 3), (1, 8, 8))


@pytest.mark.parametrize("method", ["yarn", "ntk"])
@pytest.mark.parametrize("length", [3, 4, 6, 8, 13])
def test_a_length_on_the_device_gives_the_same_frequencies(length, method):
    # the grid Flux reads off its ids stays a tensor (no host sync): the same frequencies and multiplier as the
    # length given as an int, the model's own at or below the training length
    timestep = torch.tensor(0.7, dtype=torch.float64)
    expected = dype_frequencies(16, THETA, 4, length, timestep, method)
    got = dype_frequencies(16, THETA, 4, torch.tensor(float(length)), timestep, method)
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match=r"length must be a number or a real 0-d tensor, got shape \(2,\)"):
        dype_frequencies(16, THETA, 4, torch.tensor([8.0, 8.0]), timestep, method)
