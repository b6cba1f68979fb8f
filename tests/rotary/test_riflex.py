"""RIFLEx (extrapolation="riflex"): one band per axis, theta_k -> 0.9 * 2 pi / L past its period, nothing else."""

from __future__ import annotations

import math

import pytest
import timm
import torch

import visionpe
from visionpe.grid import grid_coords
from visionpe.rotary.scaling import identify_k, riflex_frequencies, scale_frequencies, set_extrapolation


def official_identify_k(b: float, d: int, n: int) -> tuple[int, int]:
    """thu-ml/RIFLEx ``identify_k``, written out: periods round(2 pi / theta_j), the nearest to n (first on a tie)."""
    periods = [round(2 * math.pi / (1.0 / b ** (2 * (j - 1) / d))) for j in range(1, d // 2 + 1)]
    diffs = [abs(p - n) for p in periods]
    k = diffs.index(min(diffs)) + 1
    return k, periods[k - 1]


def official_frequencies(dim: int, theta: float, k: int | None, length: int) -> torch.Tensor:
    """thu-ml/RIFLEx ``get_1d_rotary_pos_embed_riflex``'s frequencies: 1D RoPE, then band k set to 0.9 * 2 pi / L."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    if k is not None:
        freqs[k - 1] = 0.9 * 2 * math.pi / length
    return freqs


def test_identify_k_matches_the_reference():
    assert identify_k(256, 16, 48) == (4, 50)  # HunyuanVideo's time axis (periods 6, 13, 25, 50, ...)
    assert identify_k(10000, 16, 20) == (2, 20)  # CogVideoX's
    for b, d, n in [(100, 16, 14), (100, 32, 7), (10000, 32, 100), (256, 16, 1), (256, 16, 10_000)]:
        assert identify_k(b, d, n) == official_identify_k(b, d, n)


def test_only_band_k_changes_and_only_past_its_period():
    # head_dim 32: 8 pairs per axis, theta_n = 100^(-n/8): periods 6, 11, 20, 35, ...; columns (y, x)
    scheme = visionpe.create_pos_embed("rope_axial", dim=64, num_heads=2, grid_size=(3, 5))
    freqs = scheme.frequencies()
    scheme.set_extrapolation("riflex", riflex_k=(0, 2))  # x's band 2 (period 11); y left alone
    scaled, mscale = scheme.scaled_frequencies((7, 12))
    changed = (scaled != freqs).nonzero().tolist()
    x_pairs = freqs[0, 0, 1].nonzero().flatten()
    assert changed == [[0, 0, 1, int(x_pairs[1])]] and mscale == 1.0
    assert float(scaled[0, 0, 1, x_pairs[1]]) == pytest.approx(0.9 * 2 * math.pi / 12, rel=1e-6)
    # L = 11 <= N_2 = 11, and the training length: everything unchanged
    for grid in [(7, 11), (3, 5), (2, 4)]:
        assert torch.equal(scheme.scaled_frequencies(grid)[0], freqs)
    # the default: the band whose period is nearest the training length (5 -> band 1, period 6) on every axis
    scheme.set_extrapolation("riflex")
    scaled = scheme.scaled_frequencies((7, 12))[0]
    y_pairs = freqs[0, 0, 0].nonzero().flatten()
    assert (scaled != freqs).nonzero().tolist() == [[0, 0, 0, int(y_pairs[0])], [0, 0, 1, int(x_pairs[0])]]
    assert torch.equal(scheme.scaled_frequencies((6, 12))[0][..., 0, :], freqs[..., 0, :])  # y: 6 <= N_1 = 6


def test_matches_the_reference_on_the_time_axis():
    # HunyuanVideo's time axis: base 256, 8 pairs (d_t = 16), repetition at N = 48: k = 4, N_k = 50
    scheme = visionpe.create_pos_embed(
        "rope_axial", dim=128, num_heads=2, ndim=3, base=256.0, axis_pairs=(12, 12, 8), grid_size=(33, 3, 5)
    )
    freqs = scheme.frequencies()
    t_pairs = freqs[0, 0, 0].nonzero().flatten()
    k, period = identify_k(256, 16, 48)
    scheme.set_extrapolation("riflex", riflex_k=(k, 0, 0))
    for frames in (40, 50, 66, 261):
        scaled = scheme.scaled_frequencies((frames, 3, 5))[0]
        expected = official_frequencies(16, 256.0, k if frames > period else None, frames)
        torch.testing.assert_close(scaled[0, 0, 0, t_pairs], expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(scaled[..., 1:, :], freqs[..., 1:, :], rtol=0, atol=0)
    # the default band with a training length of 48 is the paper's k
    scheme.set_extrapolation("riflex", train_grid_size=(48, 3, 5))
    scaled = scheme.scaled_frequencies((66, 3, 5))[0]
    torch.testing.assert_close(scaled[0, 0, 0, t_pairs], official_frequencies(16, 256.0, 4, 66), rtol=1e-6, atol=0)


def test_video_model_edits_the_time_axis_of_a_longer_clip():
    # training grid (T', H', W') = (2, 2, 2); t has 8 pairs, theta_n = 100^(-n/8): periods 6, 11, 20, ...
    model = timm.create_model(
        "visionpe_video_vit_tiny_tubelet2x16",
        pos_embed="rope_axial",
        depth=1,
        embed_dim=128,
        num_heads=2,
        num_classes=0,
        img_size=32,
        num_frames=4,
    ).eval()
    scheme = model.pos_schemes["rope_axial"]
    clips = {frames: torch.randn(1, 3, 2 * frames, 32, 32) for frames in (11, 12)}
    with torch.no_grad():
        plain = {frames: model(clip) for frames, clip in clips.items()}
        assert set_extrapolation(model, "riflex", riflex_k=(2, 0, 0)) == ["pos_schemes.rope_axial"]
        torch.testing.assert_close(model(clips[11]), plain[11], rtol=0, atol=0)  # 11 frames <= N_2 = 11
        assert not torch.equal(model(clips[12]), plain[12])
        # the model's tables at 12 frames: t turns by the reference's frequencies, y and x as before
        freqs = scheme.frequencies()[0, 0]
        t_pairs = freqs[0].nonzero().flatten()
        expected = freqs.clone()
        expected[0, t_pairs] = official_frequencies(16, 100.0, 2, 12)
        angles = grid_coords((12, 2, 2)) @ expected  # (N, pairs)
        rotation = model.position_context((12, 2, 2), torch.device("cpu")).rotation(0)
        torch.testing.assert_close(rotation.cos[0, 1:, ::2], angles.cos(), rtol=0, atol=2e-5)  # after the cls row
        torch.testing.assert_close(rotation.sin[0, 1:, 1::2], angles.sin(), rtol=0, atol=2e-5)
    # the constructor takes the mode too (default band per axis)
    built = visionpe.create_pos_embed("rope_axial", dim=64, num_heads=2, grid_size=(3, 5), extrapolation="riflex")
    assert built.extrapolation == "riflex" and built.riflex_k == (None, None)


def test_per_row_spectra_and_the_functional_form():
    # (depth, heads)-rows with their own spectra pick their own band; a frequency sign is kept
    freqs = torch.tensor([[[1.0, 0.5, 0.25, 0.125]], [[-0.125, 0.25, 0.5, 1.0]]])  # periods 6, 13, 25, 50
    out = riflex_frequencies(freqs, (30,), (20,))  # nearest 20: period 25, band 3; 30 > 25
    expected = freqs.clone()
    expected[0, 0, 2], expected[1, 0, 1] = 0.9 * 2 * math.pi / 30, 0.9 * 2 * math.pi / 30
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)
    out = riflex_frequencies(freqs, (60,), (20,), riflex_k=4)  # band 4 = the slowest, period 50
    assert float(out[1, 0, 0]) == pytest.approx(-0.9 * 2 * math.pi / 60)
    assert torch.equal(scale_frequencies(freqs, (1.5,), "riflex", (20,)), riflex_frequencies(freqs, (30,), (20,)))


def test_which_schemes_support_it():
    for name in ("rope_axial",):
        assert "riflex" in visionpe.create_pos_embed(name, dim=32, num_heads=2).supported_extrapolation
    for name in ("rope_mixed", "string_cayley", "liere", "comrope_ld"):
        scheme = visionpe.create_pos_embed(name, dim=32, num_heads=2, grid_size=(3, 5))
        assert "riflex" not in scheme.supported_extrapolation and "riflex" not in scheme.accepted_extrapolation()
    with pytest.raises(ValueError, match="RIFLEx edits one band per axis and needs an axial spectrum"):
        visionpe.create_pos_embed("rope_mixed", dim=32, num_heads=2, grid_size=(3, 5)).set_extrapolation("riflex")


def test_bad_options_raise_naming_the_argument():
    scheme = visionpe.create_pos_embed("rope_axial", dim=64, num_heads=2, grid_size=(3, 5))
    cases = [
        ((9, 0), ValueError, r"riflex_k\[0\] must be a band of axis 0, which has 8 bands in RopeAxial, got 9"),
        ((1, 2, 3), ValueError, r"riflex_k must have one entry per coordinate axis \(2, .*got 3"),
        (-1, ValueError, r"riflex_k must be a band index >= 1 .*got -1"),
        ((1.5, 0), TypeError, r"riflex_k\[0\] must be None, 0 .*got float \(1.5\)"),
        ((True, 0), TypeError, r"riflex_k\[0\] must be None, 0 .*got bool"),
        ("2", TypeError, r"riflex_k must be None, an int >= 1 or a sequence"),
    ]
    for riflex_k, error, match in cases:
        with pytest.raises(error, match=match):
            scheme.set_extrapolation("riflex", riflex_k=riflex_k)
    with pytest.raises(ValueError, match=r"riflex_k applies to extrapolation='riflex' only, got 'ntk'"):
        scheme.set_extrapolation("ntk", riflex_k=2)
    assert scheme.extrapolation == "none"
    # the model-level switch validates every scheme before switching any
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="rope_axial", depth=1)
    set_extrapolation(model, "pi")
    with pytest.raises(ValueError, match=r"riflex_k\[1\] must be a band of axis 1"):
        set_extrapolation(model, "riflex", riflex_k=(1, 99))
    assert model.pos_schemes["rope_axial"].extrapolation == "pi"
    for args, match in [((256, 15, 48), "dim must be even"), ((256, 16, 0), "n must be"), ((0, 16, 4), "base must")]:
        with pytest.raises(ValueError, match=match):
            identify_k(*args)
    with pytest.raises(ValueError, match="riflex needs an axial spectrum"):
        riflex_frequencies(torch.ones(2, 4), (9, 9), (3, 3))
    with pytest.raises(ValueError, match=r"riflex_k\[0\] must be a band of axis 0, which has 4 bands, got 5"):
        riflex_frequencies(torch.tensor([[1.0, 0.5, 0.25, 0.125]]), (60,), (20,), riflex_k=5)
