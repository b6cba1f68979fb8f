import pytest
import torch

import visionpe


def _learned(grid=(2, 8), prefix=1, **kw):
    return visionpe.create_pos_embed("learned", dim=16, num_heads=1, grid_size=grid, num_prefix_tokens=prefix, **kw)


def test_same_size_is_identity():
    pe = _learned()
    assert pe.resampled((2, 8)) is pe.pos_embed


def test_prefix_rows_kept_and_same_count_grid_resampled():
    pe = _learned((2, 8))
    out = pe.resampled((4, 4))  # same token count, other grid: must resample
    assert out.shape == (1, 17, 16)
    assert torch.equal(out[:, :1], pe.pos_embed[:, :1])
    assert not torch.allclose(out[:, 1:], pe.pos_embed[:, 1:])


def test_forward_adds_table_with_and_without_class_rows():
    x = torch.randn(2, 1 + 6, 16)
    pe = _learned((2, 3))
    assert torch.allclose(pe(x, (2, 3), 1), x + pe.pos_embed)
    pe = _learned((2, 3), no_embed_class=True)
    out = pe(x, (2, 3), 1)
    assert torch.equal(out[:, :1], x[:, :1]) and torch.allclose(out[:, 1:], x[:, 1:] + pe.pos_embed)


def test_linear_table_stays_linear_under_bilinear():
    pe = _learned((4, 4), prefix=0, interpolation="bilinear", antialias=False)
    yy, xx = torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij")
    with torch.no_grad():
        pe.pos_embed.copy_((2 * xx + 3 * yy).reshape(1, 16, 1).expand(1, 16, 16))
    out = pe.resampled((8, 8))[0, :, 0].reshape(8, 8)
    # interior rows/cols of a linear ramp stay a linear ramp (constant step)
    assert torch.allclose(out[2:6, 3:6].diff(dim=1), out[2:6, 3:6].diff(dim=1)[0, 0].expand(4, 2), atol=1e-5)


def test_set_grid_size_resamples_permanently():
    pe = _learned((2, 2))
    pe.set_grid_size((3, 3))
    assert pe.pos_embed.shape == (1, 10, 16) and pe.grid_size == (3, 3)


def test_init_std_scales_the_table():
    torch.manual_seed(0)
    default, wide = _learned((16, 16)), _learned((16, 16), init_std=0.125)
    assert abs(default.pos_embed.std().item() - 0.02) < 0.002  # timm's ViT
    assert abs(wide.pos_embed.std().item() - 0.125) < 0.01  # e.g. big_vision's 1/sqrt(dim)


def test_bad_input():
    with pytest.raises(ValueError, match="interpolation"):
        _learned(interpolation="cubic")
    with pytest.raises(ValueError, match="prefix tokens"):
        _learned((2, 3))(torch.randn(1, 8, 16), (2, 3), 2)
    with pytest.raises(ValueError, match="2D"):
        _learned((2, 3)).resampled((2, 2, 3))
    for bad in (0.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="init_std"):
            _learned(init_std=bad)


def test_ar_preserving_resamples_to_a_square_and_crops():
    # timm's NaFlex rule, written out: interpolate the (H0, W0) table to (L, L), L = max(H, W), keep the top-left H x W
    pe = _learned((3, 4), prefix=1, ar_preserving=True)
    plain = _learned((3, 4), prefix=1)
    plain.load_state_dict(pe.state_dict())
    table = pe.pos_embed[:, 1:].reshape(1, 3, 4, 16).permute(0, 3, 1, 2)
    for grid in [(2, 6), (5, 3), (4, 4)]:
        side = max(grid)
        square = torch.nn.functional.interpolate(table, size=(side, side), mode="bicubic", antialias=True)
        expected = square[:, :, : grid[0], : grid[1]].flatten(2).transpose(1, 2)
        with torch.no_grad():
            out = pe.resampled(grid)
            # another rule than resampling to H x W directly, except on square grids
            assert torch.allclose(out, plain.resampled(grid)) == (grid[0] == grid[1])
        assert torch.equal(out[:, :1], pe.pos_embed[:, :1])
        torch.testing.assert_close(out[:, 1:], expected.detach(), rtol=0, atol=1e-6)
    assert pe.resampled((3, 4)) is pe.pos_embed
    with pytest.raises(TypeError, match="ar_preserving"):
        _learned(ar_preserving=1)


def test_align_corners_as_interpolate():
    pe = _learned((3, 4), prefix=0, align_corners=True, interpolation="bilinear")
    table = pe.pos_embed.reshape(1, 3, 4, 16).permute(0, 3, 1, 2)
    with torch.no_grad():
        expected = torch.nn.functional.interpolate(
            table, size=(5, 7), mode="bilinear", align_corners=True, antialias=True
        )
        torch.testing.assert_close(pe.resampled((5, 7)), expected.flatten(2).transpose(1, 2), rtol=0, atol=1e-6)
        plain = _learned((3, 4), prefix=0, interpolation="bilinear")
        plain.load_state_dict(pe.state_dict())
        assert not torch.allclose(pe.resampled((5, 7)), plain.resampled((5, 7)))
    with pytest.raises(ValueError, match="align_corners=True applies to the bilinear and bicubic"):
        _learned(align_corners=True, interpolation="nearest")
