"""DoPE (the library's reading): bands scored by the entropy of their logit contribution, low ones stop rotating."""

from __future__ import annotations

import math

import pytest
import timm
import torch

from visionpe.grid import grid_coords
from visionpe.rotary.dope import band_entropy, band_scores, clear_band_mask, select_bands, set_band_mask


def tiny_vit(name: str, img_size: tuple[int, int], depth: int = 1):
    return timm.create_model(
        "visionpe_vit_tiny_patch16_224",
        pos_embed=name,
        depth=depth,
        embed_dim=32,
        num_heads=2,
        num_classes=0,
        img_size=img_size,
    ).eval()


def naive_entropy(q: torch.Tensor, k: torch.Tensor) -> float:
    """Entropy of the top-2 normalised squared singular values of the explicit T x T matrix q k^T, over ln 2."""
    s2 = torch.linalg.svdvals(q.detach().double() @ k.detach().double().T)[:2].square()
    if s2.sum() == 0:
        return 0.0
    p = s2 / s2.sum()
    return float(-(p * torch.log(torch.where(p > 0, p, 1.0))).sum() / math.log(2))


def rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Pairs (x_2j, x_2j+1) turned by angles[:, j]: (x0 cos - x1 sin, x0 sin + x1 cos)."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    cos, sin = angles.cos(), angles.sin()
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2)


def test_band_entropy_is_the_entropy_of_the_singular_values():
    q, k = torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)
    q[0, 0, :, 2:4] = torch.randn(7, 1) * torch.tensor([0.6, 0.8])  # pair 1 of (0, 0): every query on one line
    out = band_entropy(q, k)
    assert out.shape == (2, 3, 4)
    expected = [[[naive_entropy(q[b, h, :, 2 * j : 2 * j + 2], k[b, h, :, 2 * j : 2 * j + 2]) for j in range(4)]
                 for h in range(3)] for b in range(2)]  # fmt: skip
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=1e-5)
    assert float(out[0, 0, 1]) < 1e-6  # rank one
    assert float(band_entropy(torch.eye(2), torch.eye(2))) == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["rope_axial", "rope_mixed"])
def test_scores_follow_the_rotated_queries_and_keys(name):
    model = tiny_vit(name, (32, 80), depth=2)  # a 2 x 5 grid
    scheme = model.pos_schemes[name]
    images = torch.randn(2, 3, 32, 80)
    inputs = {}
    for block in model.blocks:
        block.attn.register_forward_pre_hook(lambda m, args: inputs.__setitem__(m.layer, args[0]))
    scores = band_scores(model, images)
    assert scores.shape == (2, 2, 2, 8)
    freqs = scheme.frequencies().detach().expand(2, 2, 2, 8)
    assert torch.equal(scores.isnan(), freqs == 0)  # each pair's score on the axes it reads
    coords = torch.cat((torch.zeros(1, 2), grid_coords((2, 5))))  # the cls token is not rotated
    for layer in range(2):
        attn = model.blocks[layer].attn
        qkv = (inputs[layer] @ attn.qkv.weight.T + attn.qkv.bias).unflatten(-1, (3, 2, 16))  # (B, T, 3, heads, d)
        for head in range(2):
            angles = coords @ freqs[layer, head]  # (T, pairs)
            q, k = rotate(qkv[:, :, 0, head], angles), rotate(qkv[:, :, 1, head], angles)
            for j in range(8):
                expected = sum(naive_entropy(q[b, :, 2 * j : 2 * j + 2], k[b, :, 2 * j : 2 * j + 2]) for b in range(2))
                got = scores[layer, head][freqs[layer, head, :, j] != 0, j]
                torch.testing.assert_close(got, torch.full_like(got, expected / 2), rtol=0, atol=1e-4)


def test_a_rank_one_band_is_selected_and_stops_rotating():
    # a 1 x 5 grid: y is 0 everywhere, so y's pairs (4..7 of head_dim 16) turn no token; with the second channel of
    # pair 4 of head 0's queries zeroed, that pair's queries lie on one line: its contribution has rank one
    model = tiny_vit("rope_axial", (16, 80))
    with torch.no_grad():
        model.blocks[0].attn.qkv.weight[9].zero_()
        model.blocks[0].attn.qkv.bias[9].zero_()
    images = torch.randn(3, 3, 16, 80)
    scores = band_scores(model, images)
    assert float(scores[0, 0, 0, 4]) < 1e-6
    mask = select_bands(model, images, threshold=0.05)
    assert bool(mask[0, 0, 0, 4]) and not bool(mask[:, :, 1].any())  # y's pair 4 of head 0; no x pair
    multiplier = model.pos_schemes["rope_axial"].band_multiplier
    assert multiplier.shape == (1, 2, 2, 8) and torch.equal(multiplier, (~mask).float())


def test_zeroed_bands_give_zero_angle():
    model = tiny_vit("rope_axial", (48, 80), depth=2)  # a 3 x 5 grid
    images = torch.randn(1, 3, 48, 80)
    with torch.no_grad():
        before = model(images)
        tables = [model.position_context((3, 5), torch.device("cpu")).rotation(i) for i in range(2)]
        mask = torch.zeros(2, 2, 2, 8, dtype=torch.bool)
        mask[1, 1, 1, 2] = True  # block 1, head 1, x's pair 2
        set_band_mask(model, mask)
        masked = [model.position_context((3, 5), torch.device("cpu")).rotation(i) for i in range(2)]
        assert torch.equal(masked[0].cos, tables[0].cos.expand_as(masked[0].cos))  # block 0 as before
        assert torch.equal(masked[1].cos[1, :, 4:6], torch.ones(16, 2))  # angle 0: cos 1, sin 0
        assert torch.equal(masked[1].sin[1, :, 4:6], torch.zeros(16, 2))
        keep = torch.ones(2, 16, 16, dtype=torch.bool)
        keep[1, :, 4:6] = False
        assert torch.equal(masked[1].cos[keep], tables[1].cos.expand_as(masked[1].cos)[keep])
        assert not torch.equal(tables[1].cos[0, :, 4:6], torch.ones(16, 2))  # the band did turn before
        assert not torch.allclose(model(images), before)
        clear_band_mask(model)
        assert torch.equal(model(images), before)


def test_the_model_is_unchanged_when_nothing_is_selected():
    model = tiny_vit("rope_axial", (48, 80))
    images = torch.randn(2, 3, 48, 80)
    with torch.no_grad():
        before = model(images)
    mask = select_bands(model, images, threshold=0.0)
    assert not mask.any() and model.pos_schemes["rope_axial"].band_multiplier is None
    with torch.no_grad():
        assert torch.equal(model(images), before)
    assert not model.training  # the calibration restored the mode


def test_bad_arguments():
    images = torch.randn(1, 3, 48, 80)
    with pytest.raises(ValueError, match="DoPE masks rotary frequency bands, which LieRE does not have"):
        band_scores(tiny_vit("liere", (48, 80)), images)
    with pytest.raises(ValueError, match="exactly one rotary scheme .*got 0"):
        select_bands(tiny_vit("learned", (48, 80)), images)
    model = tiny_vit("rope_axial", (48, 80))
    with pytest.raises(ValueError, match=r"threshold must be a number in \[0, 1\], got 1.5"):
        select_bands(model, images, threshold=1.5)
    with pytest.raises(ValueError, match=r"mask must broadcast to \(depth, num_heads, ndim, pairs\) = \(1, 2, 2, 8\)"):
        set_band_mask(model, torch.zeros(1, 2, 2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        set_band_mask(model, torch.zeros(1, 2, 2, 8))
    with pytest.raises(TypeError, match="images must be a tensor"):
        band_scores(model, [images])
    with pytest.raises(ValueError, match="q and k must have the same shape"):
        band_entropy(torch.randn(3, 4), torch.randn(3, 6))
