"""Bias schemes give the same attention when it is computed in query chunks (``rows=``), which bounds the
bias memory to (h, chunk, N) at large grids."""

import pytest
import torch
import torch.nn.functional as F

from visionpe.bias.alibi2d import Alibi2D
from visionpe.bias.irpe import IRPE
from visionpe.bias.lookhere import LookHere


def _attention(scheme, state, q, k, v, layer, rows=None):
    q_rows = q if rows is None else q[:, :, rows]
    kwargs = {} if rows is None else {"rows": rows}
    bias = scheme.attn_bias(q_rows, k, state, layer, **kwargs)
    if not scheme.needs_probs:
        return F.scaled_dot_product_attention(q_rows, k, v, attn_mask=bias.expand(q.shape[0], -1, -1, -1))
    attn = torch.softmax(q_rows @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + bias, dim=-1)
    return attn @ v + scheme.value_term(attn, state, layer, **kwargs)


@pytest.mark.parametrize(
    "make",
    [
        lambda: IRPE(24, 3, 2, on="qkv", method="cross", shared_heads=False),
        lambda: IRPE(24, 3, 2, on="qk", mode="bias"),
        lambda: IRPE(24, 3, 2),
        lambda: LookHere(24, 3, 2, variant="45"),
        lambda: Alibi2D(24, 3, 2),
    ],
)
def test_chunked_attention_equals_full(make):
    torch.manual_seed(0)
    scheme = make()
    for param in scheme.parameters():
        torch.nn.init.normal_(param, std=0.5)
    state = scheme.prepare((3, 5), 1)
    q, k, v = (torch.randn(2, 3, 16, 8) for _ in range(3))
    full = _attention(scheme, state, q, k, v, 1)
    chunks = [_attention(scheme, state, q, k, v, 1, slice(s, s + 6)) for s in range(0, 16, 6)]
    torch.testing.assert_close(torch.cat(chunks, dim=2), full, atol=1e-5, rtol=1e-5)


def test_rows_shape_mismatch_raises():
    scheme = IRPE(24, 3, 2)
    state = scheme.prepare((3, 5), 1)
    with pytest.raises(ValueError, match="rows"):
        scheme.attn_bias(torch.randn(1, 3, 16, 8), torch.randn(1, 3, 16, 8), state, 0, rows=slice(0, 4))
