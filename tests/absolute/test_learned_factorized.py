"""learned_factorized: NaViT's one table per axis, summed per patch, resampled per axis as timm's NaFlex models do."""

import pytest
import torch
import torch.nn.functional as F

import visionpe


def _factorized(grid=(3, 4), prefix=1, **kw):
    return visionpe.create_pos_embed(
        "learned_factorized", dim=8, num_heads=1, grid_size=grid, num_prefix_tokens=prefix, **kw
    )


def _reference(pe, grid, ar_preserving=False):
    """timm's rule written out: each (1, L0, C) table interpolated linearly to its length, then E_y[i] + E_x[j]."""
    height, width = grid
    lengths = (max(grid), max(grid)) if ar_preserving else grid

    def axis(table, length):
        if length == table.shape[1]:
            return table
        return F.interpolate(table.permute(0, 2, 1), size=length, mode="linear", align_corners=False).permute(0, 2, 1)

    rows = axis(pe.pos_embed_y, lengths[0])[:, :height]
    cols = axis(pe.pos_embed_x, lengths[1])[:, :width]
    return torch.stack([rows[0, i] + cols[0, j] for i in range(height) for j in range(width)])[None]


@pytest.mark.parametrize("ar_preserving", [False, True])
@pytest.mark.parametrize("grid", [(3, 4), (5, 2), (6, 6), (2, 7)])
def test_table_is_the_sum_of_the_axis_tables(grid, ar_preserving):
    pe = _factorized(ar_preserving=ar_preserving)
    with torch.no_grad():
        torch.testing.assert_close(pe.table(grid), _reference(pe, grid, ar_preserving), rtol=0, atol=1e-6)


def test_forward_adds_to_patches_only_and_reaches_both_tables():
    pe = _factorized(prefix=2)
    x = torch.randn(2, 2 + 12, 8)
    out = pe(x, (3, 4), 2)
    assert torch.equal(out[:, :2], x[:, :2])
    torch.testing.assert_close(out[:, 2:], x[:, 2:] + _reference(pe, (3, 4)))
    pe(torch.randn(1, 2 + 15, 8), (5, 3), 2).sum().backward()
    assert pe.pos_embed_y.grad.abs().sum() > 0 and pe.pos_embed_x.grad.abs().sum() > 0
    assert pe.no_weight_decay() == {"pos_embed_y", "pos_embed_x"}


def test_set_grid_size_resamples_each_axis():
    pe = _factorized()
    expected = pe.table((5, 6)).detach()
    pe.set_grid_size((5, 6))
    assert pe.pos_embed_y.shape == (1, 5, 8) and pe.pos_embed_x.shape == (1, 6, 8) and pe.grid_size == (5, 6)
    torch.testing.assert_close(pe.table((5, 6)), expected)


def test_model_and_bad_input():
    import timm

    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224",
        pos_embed="learned_factorized",
        img_size=32,
        patch_size=8,
        embed_dim=16,
        depth=1,
        num_heads=2,
        num_classes=3,
        dynamic_img_size=True,
    )
    assert model(torch.randn(1, 3, 32, 48)).shape == (1, 3)
    assert {"pos_schemes.learned_factorized.pos_embed_y", "pos_schemes.learned_factorized.pos_embed_x"} <= set(
        model.no_weight_decay()
    )
    with pytest.raises(TypeError, match="ar_preserving"):
        _factorized(ar_preserving="yes")
    with pytest.raises(ValueError, match="2D"):
        _factorized().table((2, 3, 4))


def test_init_std_scales_both_tables():
    torch.manual_seed(0)
    default, wide = _factorized((64, 64)), _factorized((64, 64), init_std=0.125)
    for pe, std in ((default, 0.02), (wide, 0.125)):
        for table in (pe.pos_embed_y, pe.pos_embed_x):
            assert abs(table.std().item() - std) < 0.1 * std
    with pytest.raises(ValueError, match="init_std"):
        _factorized(init_std=0.0)
