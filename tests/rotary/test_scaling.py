import math

import pytest
import timm
import torch

import visionpe
from visionpe.grid import grid_coords
from visionpe.rotary.rope_axial import RopeAxial, axial_frequencies
from visionpe.rotary.rope_mixed import RopeMixed
from visionpe.rotary.scaling import axis_scale_factors, scale_frequencies, set_extrapolation, yarn_attention_factor


def test_factors_per_axis():
    assert axis_scale_factors((28, 14), (14, 14)) == (2.0, 1.0)
    assert axis_scale_factors((7, 21), (14, 14)) == (1.0, 1.5)  # a smaller axis is left alone


@pytest.mark.parametrize("mode", ["none", "pi", "ntk", "yarn"])
def test_unit_factor_is_identity(mode):
    freqs = axial_frequencies(64, 100.0, (16, 16))
    assert torch.equal(scale_frequencies(freqs, (1.0, 1.0), mode, (14, 14)), freqs)
    rope = RopeAxial(384, 6, grid_size=(14, 14), extrapolation=mode)
    plain = RopeAxial(384, 6)
    coords = grid_coords((14, 14))
    a, b = rope.prepare(coords, 1, (14, 14)), plain.prepare(coords, 1, (14, 14))
    assert torch.equal(a.cos, b.cos) and torch.equal(a.sin, b.sin)


def test_ntk_keeps_first_band_and_scales_last_by_one_over_s():
    theta = 100.0 ** (-torch.arange(16, dtype=torch.float64) / 16)
    freqs = axial_frequencies(64, 100.0, (16, 16))  # rows (y, x); x reads pairs 0..15
    scaled = scale_frequencies(freqs, (1.0, 2.0), "ntk")
    x_rates = scaled[1, :16].double()
    assert float(x_rates[0]) == pytest.approx(1.0)
    assert float(x_rates[-1]) == pytest.approx(float(theta[-1]) / 2, rel=1e-5)
    # the base-change form b' = b s^(D / (D - 2)) with D = d / 2
    new_base = 100.0 * 2.0 ** (32 / 30)
    assert torch.allclose(x_rates, new_base ** (-torch.arange(16, dtype=torch.float64) / 16), rtol=1e-5)
    assert torch.equal(scaled[0], freqs[0])  # y is not scaled


def test_ntk_per_axis_in_3d_with_unequal_pair_counts():
    """Video: t has fewer pairs than y and x; each axis gets its own base b_a' = b s_a^(D_a / (D_a - 2))."""
    pairs = {"x": 12, "y": 12, "t": 8}
    freqs = axial_frequencies(64, 100.0, (pairs["x"], pairs["y"], pairs["t"]))  # rows (t, y, x)
    factors = {"t": 2.0, "y": 1.5, "x": 3.0}
    scaled = scale_frequencies(freqs, (factors["t"], factors["y"], factors["x"]), "ntk").double()
    for row, axis in enumerate(("t", "y", "x")):
        n, s = pairs[axis], factors[axis]
        used = freqs[row] != 0
        assert int(used.sum()) == n and torch.equal(scaled[row][~used], torch.zeros(64 // 2 - n, dtype=torch.float64))
        new_base = 100.0 * s ** (2 * n / (2 * n - 2))
        expected = new_base ** (-torch.arange(n, dtype=torch.float64) / n)
        torch.testing.assert_close(scaled[row][used], expected, rtol=1e-5, atol=0)
        assert float(scaled[row][used][-1]) == pytest.approx(float(freqs[row][used][-1]) / s, rel=1e-5)


@pytest.mark.parametrize("name", ["rope_axial", "rope_mixed"])
def test_video_model_scales_the_time_axis_of_a_longer_clip(name):
    # the video ViT's training grid is (T', H', W'); a clip twice as long scales t only, here by PI: t -> t / 2
    model = timm.create_model(
        "visionpe_video_vit_tiny_tubelet2x16", pos_embed=name, depth=1, img_size=32, num_frames=4
    ).eval()
    scheme = model.pos_schemes[name]
    assert scheme.train_grid_size == (2, 2, 2)
    clip = torch.randn(1, 3, 8, 32, 32)  # (T', H', W') = (4, 2, 2)
    coords = grid_coords((4, 2, 2))
    with torch.no_grad():
        plain = model(clip)
        set_extrapolation(model, "pi")
        scaled = scheme.prepare(coords, 1, (4, 2, 2))
        by_hand = scheme.prepare(coords / torch.tensor([2.0, 1.0, 1.0]), 1, (2, 2, 2))
        scaled, by_hand = scaled.layer(0), by_hand.layer(0)
        torch.testing.assert_close(scaled.cos, by_hand.cos)
        torch.testing.assert_close(scaled.sin, by_hand.sin)
        assert not torch.allclose(model(clip), plain)
        set_extrapolation(model, "ntk")  # per-axis factors (2, 1, 1): y and x tables unchanged
        freqs, _ = scheme.scaled_frequencies((4, 2, 2))
        torch.testing.assert_close(freqs[..., 1:, :], scheme.frequencies()[..., 1:, :])
        assert not torch.allclose(freqs[..., 0, :], scheme.frequencies()[..., 0, :])


def test_yarn_band_rules():
    freqs = axial_frequencies(64, 100.0, (16, 16))
    alpha, beta, s, length = 0.5, 1.5, 2.0, 14
    scaled = scale_frequencies(freqs, (s, s), "yarn", (length, length), alpha, beta)[1, :16]
    theta = freqs[1, :16]
    ratio = length * theta / (2 * math.pi)
    high, low = ratio > beta, ratio < alpha
    assert high.any() and low.any()
    assert torch.allclose(scaled[high], theta[high])
    assert torch.allclose(scaled[low], theta[low] / s)
    mid = ~(high | low)
    gamma = (ratio[mid] - alpha) / (beta - alpha)
    assert torch.allclose(scaled[mid], (1 - gamma) * theta[mid] / s + gamma * theta[mid])
    assert yarn_attention_factor((s, 1.5)) == pytest.approx(0.1 * math.log(2.0) + 1)


def test_yarn_multiplies_tables_including_prefix():
    rope = RopeAxial(128, 2, grid_size=(4, 4), extrapolation="yarn")
    state = rope.prepare(grid_coords((8, 8)), 1, (8, 8))
    cos, sin = state.cos, state.sin
    m = 0.1 * math.log(2.0) + 1
    assert torch.allclose(cos[..., 0, :], torch.full_like(cos[..., 0, :], m))
    assert torch.allclose(cos.pow(2) + sin.pow(2), torch.full_like(cos, m * m), atol=1e-5)


def test_pi_reproduces_training_positions():
    rope = RopeAxial(128, 2, grid_size=(7, 7), extrapolation="pi")
    train = rope.prepare(grid_coords((7, 7)), 0, (7, 7)).cos.view(7, 7, -1)
    test = rope.prepare(grid_coords((14, 14)), 0, (14, 14)).cos.view(14, 14, -1)
    assert torch.allclose(test[::2, ::2], train, atol=1e-6)  # position 2i at 14 is position i at 7


def test_mixed_scales_each_component_and_model_switch():
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="rope_mixed", depth=1, dynamic_img_size=True)
    scheme = model.pos_schemes["rope_mixed"]
    assert scheme.train_grid_size == (14, 14) and scheme.extrapolation == "none"
    images = torch.randn(1, 3, 320, 320)
    with torch.no_grad():
        base = model(images)
        for mode in ("pi", "ntk", "yarn"):
            ramp = {"alpha": 0.5, "beta": 2.0} if mode == "yarn" else {}  # YaRN's options: yarn only
            assert set_extrapolation(model, mode, **ramp) == ["pos_schemes.rope_mixed"]
            assert not torch.allclose(model(images), base)
        set_extrapolation(model, "none")
        assert torch.equal(model(images), base)
    freqs, _ = scheme.scaled_frequencies((28, 14))
    pi = RopeMixed.frequencies(scheme)
    assert torch.equal(freqs[..., 0, :], pi[..., 0, :] / 2) is False  # default mode none: unchanged
    scheme.set_extrapolation("pi")
    freqs, _ = scheme.scaled_frequencies((28, 14))
    assert torch.allclose(freqs[..., 0, :], pi[..., 0, :] / 2) and torch.equal(freqs[..., 1, :], pi[..., 1, :])


@pytest.mark.parametrize("mode", ["pi", "ntk", "yarn"])
def test_mixed_with_axial_angles_scales_as_axial(mode):
    """A4: axial RoPE is RoPE-Mixed with a = 0 frozen and base 100, so every mode must scale both alike. The init
    formula at a = 0 leaves fp32 cos(pi / 2) = -4.4e-8 in the components that belong to the other axis; NTK's band
    scale must not stretch to them (it did: the slowest real band was multiplied by 0.87 instead of 1 / s)."""
    head_dim = 64
    mag = 100.0 ** (-torch.arange(0, head_dim, 4, dtype=torch.float32) / head_dim)
    a = torch.zeros(1, 1, 1)
    f_x = torch.cat([mag * torch.cos(a), mag * torch.cos(a + math.pi / 2)], dim=-1)
    f_y = torch.cat([mag * torch.sin(a), mag * torch.sin(a + math.pi / 2)], dim=-1)
    assert 0 < f_x[..., 16:].abs().max() < 1e-7  # the fp32 residual this test is about
    mixed = RopeMixed(head_dim, 1, base=100.0, grid_size=(14, 14), extrapolation=mode, yarn_alpha=0.5, yarn_beta=2.0)
    with torch.no_grad():
        mixed.freqs.copy_(torch.stack([f_x, f_y]))
    axial = RopeAxial(head_dim, 1, base=100.0, grid_size=(14, 14), extrapolation=mode, yarn_alpha=0.5, yarn_beta=2.0)
    torch.testing.assert_close(mixed.frequencies(), axial.frequencies(), atol=1e-7, rtol=0)
    for grid in ((14, 28), (21, 14), (28, 42)):
        (got, got_m), (expected, expected_m) = mixed.scaled_frequencies(grid), axial.scaled_frequencies(grid)
        torch.testing.assert_close(got, expected, atol=1e-7, rtol=1e-6)
        assert got_m == expected_m


def test_ntk_on_mixed_pairs_keeps_each_axis_fastest_and_interpolates_its_slowest():
    torch.manual_seed(0)
    freqs = RopeMixed(384, 6, depth=2).frequencies().detach()  # (L, h, ndim, P), random angles per head
    scaled = scale_frequencies(freqs, (2.0, 3.0), "ntk")
    ratio = scaled / freqs
    for axis, s in enumerate((2.0, 3.0)):
        fastest = freqs[..., axis, :].abs().argmax(-1, keepdim=True)
        torch.testing.assert_close(ratio[..., axis, :].gather(-1, fastest), torch.ones_like(fastest, dtype=ratio.dtype))
        # the slowest pair of every head (rate over both axes) is a band NTK divides by exactly s on each axis
        slowest = freqs.norm(dim=-2).argmin(-1, keepdim=True)
        torch.testing.assert_close(ratio[..., axis, :].gather(-1, slowest), torch.full(slowest.shape, 1 / s))
        assert ((ratio[..., axis, :] <= 1 + 1e-6) & (ratio[..., axis, :] >= 1 / s - 1e-6)).all()


@pytest.mark.parametrize("name", ["string_cayley", "string_circulant"])
def test_string_rope_part_scales(name):
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224", pos_embed=name, depth=1, pos_embed_kwargs={"extrapolation": "ntk"}
    )
    scheme = model.pos_schemes[name]
    assert scheme.extrapolation == "ntk"
    freqs, _ = scheme.scaled_frequencies((28, 28))
    assert not torch.allclose(freqs, scheme.frequencies())


def test_bad_input():
    with pytest.raises(ValueError, match="extrapolation must be one of"):
        RopeAxial(128, 2, grid_size=(4, 4), extrapolation="linear")
    with pytest.raises(ValueError, match="needs the training grid"):
        RopeAxial(128, 2, extrapolation="ntk")
    with pytest.raises(ValueError, match="already interpolates"):
        RopeAxial(128, 2, grid_size=(4, 4), coord_mode="normalized", extrapolation="pi")
    with pytest.raises(ValueError, match="yarn_beta must be greater"):
        RopeAxial(128, 2, grid_size=(4, 4), extrapolation="yarn", yarn_alpha=2.0, yarn_beta=1.0)
    with pytest.raises(ValueError, match="grid_size must have ndim=2"):
        RopeAxial(128, 2, grid_size=(2, 4, 4))
    with pytest.raises(ValueError, match="factors must have ndim"):
        scale_frequencies(torch.ones(2, 4), (2.0,), "pi")
    with pytest.raises(ValueError, match="train_grid_size must have 2 entries"):
        axis_scale_factors((4, 4), (4, 4, 4))
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="liere", depth=1)
    with pytest.raises(ValueError, match="supports extrapolation modes"):
        set_extrapolation(model, "ntk")
    with pytest.raises(ValueError, match="no rotary scheme"):
        set_extrapolation(timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="learned", depth=1), "pi")
    assert visionpe.list_schemes("rotary")  # registry still importable after the scaling module


def test_model_switch_is_all_or_none():
    # ComRoPE with test-grid positions refuses every scaled mode: the RoPE beside it must not switch either
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=["rope_axial", "comrope_ld"], depth=1)
    with pytest.raises(ValueError, match="comrope_ld: extrapolation='ntk' with pos_norm='test_grid' would scale"):
        set_extrapolation(model, "ntk")
    assert [s.extrapolation for s in model.pos_schemes.values()] == ["none", "none"]
    assert model.pos_schemes["rope_axial"].accepted_extrapolation() == ("none", "pi", "ntk", "yarn", "riflex")
    assert model.pos_schemes["comrope_ld"].accepted_extrapolation() == ("none",)


# -- rotate() honours the extrapolation mode (audit: it called prepare without grid_size) ------------------------


@pytest.mark.parametrize("name", ["rope_axial", "rope_mixed", "string_cayley", "string_circulant"])
@pytest.mark.parametrize("mode", ["pi", "ntk", "yarn"])
def test_rotate_scales_like_the_model_path(name, mode):
    torch.manual_seed(0)
    train, test = (3, 5), (7, 8)  # non-square, each axis larger than the training grid
    scheme = visionpe.create_pos_embed(name, dim=64, num_heads=2, depth=2, grid_size=train, extrapolation=mode)
    plain = visionpe.create_pos_embed(name, dim=64, num_heads=2, depth=2, grid_size=train)
    plain.load_state_dict(scheme.state_dict())
    x, coords = torch.randn(1, 2, 56, 32), grid_coords(test)
    # the model path's rotation: prepare with the grid, apply
    state = scheme.prepare(coords, 0, grid_size=test)
    expected = scheme.apply(x, state, 1)
    if name.startswith("string"):  # apply gives RoPE(r) P x; rotate gives R(r) x = Q^T RoPE(r) P x
        out_basis = scheme.rotation_output_basis()
        expected = expected if out_basis is None else expected @ out_basis
    inferred = scheme.rotate(x, coords, 1)  # grid read off the index coordinates
    given = scheme.rotate(x, coords, 1, grid_size=test)
    torch.testing.assert_close(inferred, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(given, inferred, atol=0, rtol=0)
    assert not torch.allclose(inferred, plain.rotate(x, coords, 1), atol=1e-3)  # the mode does something
    # at the training grid nothing is scaled
    small = grid_coords(train)
    torch.testing.assert_close(scheme.rotate(x[:, :, :15], small, 1), plain.rotate(x[:, :, :15], small, 1))


def test_rotate_scales_liere_pi():
    torch.manual_seed(0)
    scheme = visionpe.create_pos_embed("liere", dim=64, num_heads=2, grid_size=(3, 5), extrapolation="pi")
    plain = visionpe.create_pos_embed("liere", dim=64, num_heads=2, grid_size=(3, 5))
    plain.load_state_dict(scheme.state_dict())
    x, coords = torch.randn(1, 2, 56, 32), grid_coords((7, 8))
    expected = plain.rotate(x, coords / torch.tensor([7 / 3, 8 / 5]))  # PI: p_a / s_a
    torch.testing.assert_close(scheme.rotate(x, coords), expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(scheme.rotate(x, coords), plain.rotate(x, coords), atol=1e-3)


def test_rotate_asks_for_grid_size_when_it_cannot_be_inferred():
    rope = RopeAxial(128, 2, grid_size=(3, 5), extrapolation="pi")
    x = torch.randn(1, 2, 4, 64)
    fractional = torch.tensor([[0.0, 0.5], [1.0, 2.0], [2.0, 0.0], [6.0, 9.0]])
    with pytest.raises(ValueError, match=r"extrapolation='pi'.*pass grid_size=\(\.\.\.\) to rotate"):
        rope.rotate(x, fractional)
    with pytest.raises(ValueError, match=r"extrapolation='pi'.*pass grid_size"):
        rope.rotate(x, -fractional.round())
    # given explicitly, it is used; with no mode set nothing is inferred or needed
    torch.testing.assert_close(
        rope.rotate(x, fractional, grid_size=(6, 10)), rope.apply(x, rope.prepare(fractional, 0, (6, 10)), 0)
    )
    assert torch.equal(RopeAxial(128, 2).rotate(x, fractional), RopeAxial(128, 2).apply(x, rope.prepare(fractional), 0))
    with pytest.raises(ValueError, match=r"supports 2D grids, got a 3D grid_size"):
        rope.rotate(x, fractional, grid_size=(1, 6, 10))
    with pytest.raises(TypeError, match=r"grid_size\[0\] must be an int"):
        rope.rotate(x, fractional, grid_size=(6.0, 10))


def test_rotate_fft_refuses_to_skip_the_scaling():
    scheme = visionpe.create_pos_embed("string_circulant", dim=64, num_heads=2, grid_size=(3, 5), extrapolation="ntk")
    x = torch.randn(1, 2, 15, 32)
    torch.testing.assert_close(scheme.rotate_fft(x, grid_coords((3, 5))), scheme.rotate(x, grid_coords((3, 5))))
    with pytest.raises(ValueError, match=r"rotate_fft computes the unscaled rotation.*extrapolation='ntk'"):
        scheme.rotate_fft(torch.randn(1, 2, 56, 32), grid_coords((7, 8)))


# -- the training grid must have the scheme's rank ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["rope_axial", "string_cayley", "liere"])
def test_train_grid_size_of_the_wrong_rank_is_refused(name):
    scheme = visionpe.create_pos_embed(name, dim=64, num_heads=2, grid_size=(14, 14))
    with pytest.raises(ValueError, match=r"train_grid_size must have 2 entries, got 3: \(2, 14, 14\)"):
        scheme.set_extrapolation("pi", train_grid_size=(2, 14, 14))
    assert (scheme.extrapolation, scheme.train_grid_size) == ("none", (14, 14))
    video = visionpe.create_pos_embed(name, dim=64, num_heads=2, ndim=3, grid_size=(2, 4, 4))
    with pytest.raises(ValueError, match=r"train_grid_size must have 3 entries, got 2: \(4, 4\)"):
        video.set_extrapolation("none", train_grid_size=(4, 4))
    assert video.train_grid_size == (2, 4, 4)


def test_model_switch_refuses_a_wrong_rank_train_grid_before_switching_anything():
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=["rope_axial", "rope_mixed"], depth=1)
    with pytest.raises(ValueError, match=r"rope_axial: train_grid_size must have 2 entries for RopeAxial, got 3"):
        set_extrapolation(model, "pi", train_grid_size=(2, 14, 14))
    assert [s.extrapolation for s in model.pos_schemes.values()] == ["none", "none"]
    assert [s.train_grid_size for s in model.pos_schemes.values()] == [(14, 14), (14, 14)]
