import re

import pytest
import timm
import torch

import visionpe  # noqa: F401  (registers the models)
from visionpe.bias.alibi2d import Alibi2D, alibi_slopes, grid_distances


def test_slopes_for_12_and_8_heads():
    expected_12 = [2.0**-e for e in (1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected_12))
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0**-e for e in range(1, 9)]))
    torch.testing.assert_close(alibi_slopes(6)[:4], torch.tensor([2.0**-e for e in (2, 4, 6, 8)]))


def test_bias_is_minus_slope_times_distance_symmetric_and_prefix_zero():
    alibi = Alibi2D(48, 4, global_slope=1.5)
    state = alibi.prepare((3, 5), 1)
    q = torch.zeros(2, 4, 16, 12)
    bias = alibi.attn_bias(q, q, state, 0)[0]
    assert (bias[:, 0] == 0).all() and (bias[:, :, 0] == 0).all()
    torch.testing.assert_close(bias, bias.transpose(-2, -1))
    y, x = torch.arange(15) // 5, torch.arange(15) % 5
    dist = ((y[:, None] - y[None]) ** 2 + (x[:, None] - x[None]) ** 2).float().sqrt()
    expected = -1.5 * alibi_slopes(4)[:, None, None] * dist
    torch.testing.assert_close(bias[:, 1:, 1:], expected)


def test_grid_distances_depend_only_on_offset():
    dist = grid_distances((4, 6)).reshape(4, 6, 4, 6)
    torch.testing.assert_close(dist[1:, 1:, 1:, 1:], dist[:-1, :-1, :-1, :-1])
    torch.testing.assert_close(dist[2:, :-3, 2:, :-3], dist[:-2, 3:, :-2, 3:])


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(0)
    with pytest.raises(ValueError, match="global_slope"):
        Alibi2D(48, 4, global_slope=-1.0)
    alibi = Alibi2D(48, 4)
    with pytest.raises(ValueError, match="2D grids"):
        alibi.prepare((2, 3, 4), 1)
    state = alibi.prepare((3, 4), 1)
    with pytest.raises(ValueError, match="q and k must have shape"):
        alibi.attn_bias(torch.zeros(1, 4, 12, 12), torch.zeros(1, 4, 12, 12), state, 0)
    for depth in (0, -1, 2.5, True):
        with pytest.raises(
            (TypeError, ValueError), match=rf"depth must be a positive int, got .*{re.escape(repr(depth))}"
        ):
            Alibi2D(48, 4, depth=depth)


@pytest.mark.parametrize("size", [(224, 224), (384, 384), (160, 224)])
@pytest.mark.parametrize("bf16", [False, True])
def test_model_forward_backward(size, bf16):
    torch.manual_seed(0)
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed="alibi2d", dynamic_img_size=True, depth=2)
    x = torch.randn(1, 3, *size, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(x)
    assert out.shape == (1, 1000) and torch.isfinite(out).all()
    out.float().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert not list(model.pos_schemes.parameters())  # nothing learned
