import math

import pytest
import timm
import torch
import torch.nn.functional as F

import visionpe
from visionpe.attention import PositionContext

GRID = (3, 4)


def _cable(order="axis", heads=2, depth=2):
    torch.manual_seed(0)
    scheme = visionpe.create_pos_embed("cable", dim=32, num_heads=heads, depth=depth, order=order)
    with torch.no_grad():  # steps that differ from token to token
        scheme.weight.normal_(0, 0.5)
        scheme.bias.normal_(0, 0.5)
    return scheme


def _model():
    """A 2-block Cable ViT on a 3 x 4 grid (48 x 64 px) with steps that differ from token to token, in eval mode."""
    torch.manual_seed(0)
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224", pos_embed="cable", embed_dim=32, num_heads=2, depth=2, img_size=(48, 64)
    ).eval()
    scheme = model.pos_schemes["cable"]
    with torch.no_grad():
        scheme.weight.normal_(0, 0.5)
    return model, scheme


def _bias(scheme, grid, tokens, prefix=1, layer=1, rows=None):
    n = prefix + math.prod(grid)
    q = torch.zeros(tokens.shape[0], scheme.num_heads, n if rows is None else len(range(n)[rows]), 8)
    k = torch.zeros(tokens.shape[0], scheme.num_heads, n, 8)
    return scheme.attn_bias(q, k, scheme.prepare(grid, prefix), layer, rows=rows, tokens=tokens)


def _steps(scheme, tokens, layer):
    """softplus(W x + c) of every token: (B, T, A, h)."""
    return F.softplus(tokens @ scheme.weight[layer].T + scheme.bias[layer]).unflatten(-1, (scheme.num_axes, -1))


@pytest.mark.parametrize("order", ["axis", "raster"])
def test_one_row_grid_with_causal_pairs_equals_the_reference(order):
    # the reference on a sequence: b = cumsum(-softplus(W x + c)), bias = b_i - b_j under the causal mask
    scheme = _cable(order)
    tokens = torch.randn(2, 7, 32)
    with torch.no_grad():
        bias = _bias(scheme, (1, 7), tokens, prefix=0)
        h_attn = tokens @ scheme.weight[1].T + scheme.bias[1]
        if order == "axis":
            h_attn = h_attn[..., 2:]  # the x steps (the y heads come first)
        b = torch.cumsum(-F.softplus(h_attn), dim=1).permute(0, 2, 1)  # (B, nh, T)
        reference = b.unsqueeze(3) - b.unsqueeze(2)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    torch.testing.assert_close(bias[..., causal], reference[..., causal], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("order", ["axis", "raster"])
def test_bias_equals_an_explicit_double_loop(order):
    scheme = _cable(order)
    tokens = torch.randn(2, 13, 32)
    height, width = GRID
    with torch.no_grad():
        bias = _bias(scheme, GRID, tokens, prefix=1)
        steps = _steps(scheme, tokens[:, 1:], 1)  # (B, 12, A, h)
        expected = torch.zeros(2, 2, 12, 12)
        for i in range(12):
            for j in range(12):
                (yi, xi), (yj, xj) = divmod(i, width), divmod(j, width)
                if order == "raster":  # the steps of the tokens after the first of the two, up to the second
                    expected[:, :, i, j] = -steps[:, min(i, j) + 1 : max(i, j) + 1, 0].sum(1)
                    continue
                # u^x: the x steps from the left edge of the row (the first patch takes none), u^y along the column
                u_x = [steps[:, y * width + 1 : y * width + x + 1, 1].sum(1) for y, x in ((yi, xi), (yj, xj))]
                u_y = [
                    steps[:, [w + x for w in range(width, (y + 1) * width, width)], 0].sum(1)
                    for y, x in ((yi, xi), (yj, xj))
                ]
                expected[:, :, i, j] = -(u_x[0] - u_x[1]).abs() - (u_y[0] - u_y[1]).abs()
    torch.testing.assert_close(bias[:, :, 1:, 1:], expected, atol=1e-5, rtol=1e-5)
    assert (bias[:, :, 0] == 0).all() and (bias[:, :, :, 0] == 0).all()  # prefix rows and columns


def test_constant_steps_give_a_manhattan_penalty():
    # the same step s everywhere: -s (|dx| + |dy|), not translation-invariant only through the content
    scheme = visionpe.create_pos_embed("cable", dim=32, num_heads=2)
    with torch.no_grad():
        scheme.weight.zero_()
        scheme.bias.copy_(torch.tensor([[0.0, 1.0, 0.5, -1.0]]))  # y steps of heads 0, 1, then x steps
    bias = _bias(scheme, GRID, torch.randn(1, 13, 32), layer=0)[0, :, 1:, 1:]
    y, x = torch.arange(12) // 4, torch.arange(12) % 4
    dy, dx = (y[:, None] - y).abs(), (x[:, None] - x).abs()
    s = F.softplus(scheme.bias[0].detach()).view(2, 2)
    expected = -(s[0, :, None, None] * dy + s[1, :, None, None] * dx)
    torch.testing.assert_close(bias, expected)


@pytest.mark.parametrize("order", ["axis", "raster"])
@pytest.mark.parametrize("prefix", [0, 2])
def test_chunked_rows_equal_the_full_bias(order, prefix):
    scheme = _cable(order)
    tokens = torch.randn(2, prefix + 12, 32)
    with torch.no_grad():
        full = _bias(scheme, GRID, tokens, prefix)
        n = prefix + 12
        for size in (1, 5):
            rows = [_bias(scheme, GRID, tokens, prefix, rows=slice(s, s + size)) for s in range(0, n, size)]
            torch.testing.assert_close(torch.cat(rows, 2), full, atol=0, rtol=0)


@pytest.mark.parametrize("order", ["axis", "raster"])
@pytest.mark.parametrize("prefix", [0, 2])
def test_the_bias_without_autograd_equals_the_training_expression_bit_for_bit(order, prefix):
    scheme = _cable(order)
    tokens = torch.randn(2, prefix + 12, 32)
    recorded = _bias(scheme, GRID, tokens, prefix)  # the parameters need gradients: the elementwise expression
    assert recorded.requires_grad
    with torch.no_grad():
        for rows in (None, slice(0, 3), slice(prefix, prefix + 5)):
            got = _bias(scheme, GRID, tokens, prefix, rows=rows)
            torch.testing.assert_close(got, recorded[:, :, rows or slice(None)], atol=0, rtol=0)


@pytest.mark.parametrize("order", ["axis", "raster"])
def test_bound_tokens_give_the_same_bias_and_only_for_their_layer_and_tensor(order):
    scheme = _cable(order)
    tokens = torch.randn(2, 13, 32)
    state = scheme.prepare(GRID, 1)
    bound = scheme.bind_tokens(state, 1, tokens)
    assert bound.layer == 1 and bound.tokens is tokens and state.sums is None  # the unbound state is untouched
    q, k = torch.zeros(2, 2, 5, 8), torch.zeros(2, 2, 13, 8)
    with torch.no_grad():
        for layer, other in ((1, tokens), (0, tokens), (1, tokens.clone() + 1.0)):
            expected = scheme.attn_bias(q, k, state, layer, rows=slice(3, 8), tokens=other)
            got = scheme.attn_bias(q, k, bound, layer, rows=slice(3, 8), tokens=other)
            torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_chunked_model_attention_sums_the_steps_once_per_block(monkeypatch):
    # at large sizes attention asks for the bias in chunks of query rows; the steps are summed once per block
    model, scheme = _model()
    images = torch.randn(2, 3, 48, 64)
    with torch.no_grad():
        whole = model(images)
        calls = []
        positions = scheme.positions
        monkeypatch.setattr(scheme, "positions", lambda *a, **kw: calls.append(a[1]) or positions(*a, **kw))
        monkeypatch.setattr(type(model.blocks[0].attn), "bias_chunk_bytes", 2 * 2 * 4 * 13 * 3)  # 3 rows a chunk
        chunked = model(images)
    assert calls == [0, 1]
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


def test_model_attention_uses_the_standard_scale_and_the_block_tokens():
    model, scheme = _model()
    x = torch.randn(2, 13, 32)  # cls + 3 x 4 patches, the input of block 1's attention
    attn = model.blocks[1].attn
    state = scheme.prepare(GRID, 1)
    with torch.no_grad():
        out = attn(x, pos=PositionContext(bias=[(scheme, state)]))
        q, k, v = attn.qkv(x).view(2, 13, 3, 2, 16).permute(2, 0, 3, 1, 4)
        logits = q @ k.transpose(-2, -1) / math.sqrt(16) + scheme.attn_bias(q, k, state, 1, tokens=x)
        naive = attn.proj((logits.softmax(-1) @ v).transpose(1, 2).reshape(2, 13, 32))
    torch.testing.assert_close(out, naive, atol=1e-5, rtol=1e-5)


def test_gradients_and_patch_dropout():
    # a dropped patch is seen as a zero token; training runs and every parameter of the blocks gets a gradient
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224",
        pos_embed="cable",
        embed_dim=32,
        num_heads=2,
        depth=2,
        img_size=(48, 64),
        patch_drop_rate=0.5,
        global_pool="avg",
    ).train()
    model(torch.randn(2, 3, 48, 64)).logsumexp(1).sum().backward()
    grads = model.pos_schemes["cable"].weight.grad
    assert torch.isfinite(grads).all() and (grads.flatten(1).abs().sum(1) > 0).all()


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="order"):
        visionpe.create_pos_embed("cable", dim=32, num_heads=2, order="zigzag")
    scheme = visionpe.create_pos_embed("cable", dim=32, num_heads=2)
    assert scheme.weight.shape == (1, 4, 32) and scheme.bias.abs().sum() == 0
    assert 0.015 < scheme.weight.std() < 0.025  # the reference's N(0, 0.02)
    tokens = torch.randn(1, 13, 32)
    with pytest.raises(ValueError, match="tokens"):
        scheme.attn_bias(torch.zeros(1, 2, 13, 8), torch.zeros(1, 2, 13, 8), scheme.prepare(GRID, 1), 0)
    with pytest.raises(ValueError, match=r"tokens must be a floating-point \(B=1, 13, 32\)"):
        _bias(scheme, GRID, tokens[:, 1:], layer=0)
    with pytest.raises(ValueError, match="layer"):
        _bias(scheme, GRID, tokens, layer=1)
    with pytest.raises(ValueError, match="2D grids"):
        scheme.prepare((2, 3, 4), 1)
    with pytest.raises(TypeError, match="state must be the CableState"):
        scheme.bind_tokens({"grid_size": GRID}, 0, tokens)
    with pytest.raises(ValueError, match=r"tokens must be a floating-point \(B=B, 13, 32\)"):
        scheme.bind_tokens(scheme.prepare(GRID, 1), 0, tokens[:, 1:])
    with pytest.raises(TypeError, match="tokens must be a tensor"):
        scheme.bind_tokens(scheme.prepare(GRID, 1), 0, tokens.numpy())
    with pytest.raises(ValueError, match="layer"):
        scheme.bind_tokens(scheme.prepare(GRID, 1), 1, tokens)
