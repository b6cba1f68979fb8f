import pytest
import timm
import torch

import visionpe  # noqa: F401  (registers the models)
from visionpe.absolute.fourier import LearnableFourierFeatures, LearnableFourierPosEmbed


@pytest.mark.parametrize("pos_dim", [2, 3])
def test_pre_mlp_kernel_depends_only_on_difference(pos_dim):
    torch.manual_seed(0)
    lff = LearnableFourierFeatures(pos_dim, 16, fourier_dim=64, gamma=0.5)
    x, y, shift = torch.randn(10, 1, pos_dim), torch.randn(10, 1, pos_dim), torch.randn(1, 1, pos_dim) * 5
    kernel = (lff.features(x) * lff.features(y)).sum(-1)
    torch.testing.assert_close(kernel, (lff.features(x + shift) * lff.features(y + shift)).sum(-1))
    expected = torch.cos((x - y)[:, 0] @ lff.freqs.t()).sum(-1, keepdim=True) / 64
    torch.testing.assert_close(kernel, expected)


@pytest.mark.parametrize("gamma", [0.1, 0.25, 2.0])
def test_frequency_init_is_normal_with_std_one_over_gamma(gamma):
    torch.manual_seed(0)
    freqs = LearnableFourierFeatures(2, 16, fourier_dim=1024, gamma=gamma).freqs.detach()  # W_r, (|F| / 2, M)
    assert freqs.shape == (512, 2)
    assert float(freqs.mean()) == pytest.approx(0.0, abs=0.1 / gamma)  # 1024 draws: the std of the mean is 0.03 / gamma
    assert float(freqs.std()) == pytest.approx(1 / gamma, rel=0.06)  # and of the std about 2%


def test_groups_apply_one_mlp_per_group_and_concatenate():
    torch.manual_seed(0)
    lff = LearnableFourierFeatures(2, 12, num_groups=2, fourier_dim=8, hidden_dim=16)
    positions = torch.randn(5, 2, 2)
    out = lff(positions)
    assert out.shape == (5, 12)
    torch.testing.assert_close(out[:, 6:], lff.mlp(lff.features(positions)[:, 1]))


def test_scheme_adds_to_patches_only_with_normalized_coords():
    torch.manual_seed(0)
    pe = LearnableFourierPosEmbed(32)
    positions = pe.positions((3, 5))
    torch.testing.assert_close(positions[:, 0, 1].reshape(3, 5)[0], (torch.arange(5) + 0.5) / 5)
    x = torch.randn(2, 1 + 15, 32)
    out = pe(x, (3, 5), 1)
    assert torch.equal(out[:, :1], x[:, :1])
    torch.testing.assert_close(out[:, 1:] - x[:, 1:], pe.encoder(positions).expand(2, -1, -1))
    torch.testing.assert_close(pe.encode(positions[:, 0]), pe.encoder(positions))
    corners = LearnableFourierPosEmbed(32, num_groups=2).positions((2, 4))
    torch.testing.assert_close(corners[1, 1] - corners[1, 0], torch.tensor([0.5, 0.25]))


def test_3d_grid():
    pe = LearnableFourierPosEmbed(24, ndim=3, coord_mode="index", gamma=2.0)
    x = torch.randn(1, 2 * 3 * 4, 24, requires_grad=True)
    out = pe(x, (2, 3, 4), 0)
    assert out.shape == x.shape and torch.isfinite(out).all()
    out.sum().backward()
    assert pe.encoder.freqs.grad.abs().sum() > 0


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="2D grids"):
        LearnableFourierPosEmbed(24)(torch.randn(1, 24, 24), (2, 3, 4), 0)
    with pytest.raises(ValueError, match="ndim"):
        LearnableFourierPosEmbed(24, ndim=4)
    with pytest.raises(ValueError, match="coord_mode"):
        LearnableFourierPosEmbed(24, coord_mode="polar")
    with pytest.raises(ValueError, match="fourier_dim"):
        LearnableFourierFeatures(2, 24, fourier_dim=7)
    with pytest.raises(ValueError, match="gamma"):
        LearnableFourierFeatures(2, 24, gamma=0.0)
    with pytest.raises(ValueError, match="positions must have shape"):
        LearnableFourierFeatures(2, 24).features(torch.randn(4, 3))
    with pytest.raises(ValueError, match="x must have shape"):
        LearnableFourierPosEmbed(24)(torch.randn(1, 10, 24), (3, 5), 1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_positions_raise_like_encode(bad):
    lff = LearnableFourierFeatures(2, 24)
    positions = torch.rand(5, 1, 2)
    positions[3, 0, 1] = bad
    for call in (lff.features, lff):
        with pytest.raises(ValueError, match=r"positions must be finite, got NaN or inf"):
            call(positions)
    with pytest.raises(ValueError, match=r"coords must be finite, got NaN or inf"):
        LearnableFourierPosEmbed(24).encode(positions[:, 0])
    with pytest.raises(TypeError, match=r"positions must be a real \(integer or floating-point\) tensor, got dtype"):
        lff(torch.ones(5, 1, 2, dtype=torch.bool))
    torch.testing.assert_close(lff(torch.ones(5, 1, 2, dtype=torch.int64)), lff(torch.ones(5, 1, 2)))


@pytest.mark.parametrize("size", [(224, 224), (384, 384), (160, 224)])
@pytest.mark.parametrize("bf16", [False, True])
def test_model_forward_backward(size, bf16):
    torch.manual_seed(0)
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="fourier", dynamic_img_size=True, depth=2)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(torch.randn(1, 3, *size))
    assert out.shape == (1, 1000) and torch.isfinite(out).all()
    out.float().sum().backward()
    for name, param in model.pos_schemes.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
