"""Bias schemes give the same attention when it is computed in query chunks (``rows=``), which bounds the
bias memory to (h, chunk, N) at large grids, and the same bias whether their state caches the full (N, N) maps
(small grids) or expands the rows in use from coordinates (large grids)."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

import visionpe
from visionpe.bias.irpe import IRPE
from visionpe.bias.lookhere import LookHere

from ..conftest import BIAS


def _attention(scheme, state, q, k, v, layer, rows=None):
    q_rows = q if rows is None else q[:, :, rows]
    kwargs = {} if rows is None else {"rows": rows}
    if scheme.needs_tokens:  # biases read from the block's tokens (B, N, C): any fixed tensor of that shape
        kwargs["tokens"] = q.transpose(1, 2).flatten(2)
    bias = scheme.attn_bias(q_rows, k, state, layer, **kwargs)
    if not scheme.needs_probs:
        return F.scaled_dot_product_attention(q_rows, k, v, attn_mask=bias.expand(q.shape[0], -1, -1, -1))
    attn = torch.softmax(q_rows @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + bias, dim=-1)
    return attn @ v + scheme.value_term(attn, state, layer, **kwargs)


# every registered bias scheme with its defaults, then other settings of iRPE and LookHere
SCHEMES = [pytest.param(partial(visionpe.create_pos_embed, n, dim=24, num_heads=3, depth=2), id=n) for n in BIAS] + [
    pytest.param(partial(IRPE, 24, 3, 2, on="qkv", method="cross", shared_heads=False), id="irpe-cross-qkv"),
    pytest.param(partial(IRPE, 24, 3, 2, on="qk", mode="bias"), id="irpe-bias-qk"),
    pytest.param(partial(IRPE, 24, 3, 2, method="euclidean", on="qkv"), id="irpe-euclidean-qkv"),
    pytest.param(partial(IRPE, 24, 3, 2, method="quant", on="kv", num_prefix_tokens=0), id="irpe-quant-kv"),
    pytest.param(partial(LookHere, 24, 3, 2, variant="45"), id="lookhere-45"),
    pytest.param(partial(LookHere, 24, 3, 2, variant="90"), id="lookhere-90"),
]


@pytest.mark.parametrize("make", SCHEMES)
@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("prefix", [0, 1, 2])
def test_chunked_attention_equals_full(make, cached, prefix):
    torch.manual_seed(0)
    scheme = make()
    if isinstance(scheme, IRPE) and (prefix > 0) != (scheme.num_prefix_tokens > 0):
        pytest.skip("iRPE tables are built for a fixed prefix/no-prefix setting")
    if not hasattr(scheme, "full_state_max_tokens") and not cached:
        pytest.skip("the scheme has no choice between cached maps and rows built from coordinates")
    for param in scheme.parameters():
        torch.nn.init.normal_(param, std=0.5)
    n = prefix + 15
    q, k, v = (torch.randn(2, 3, n, 8) for _ in range(3))
    full = _attention(scheme, scheme.prepare((3, 5), prefix), q, k, v, 1)  # default: full maps cached
    if hasattr(scheme, "full_state_max_tokens"):
        scheme.full_state_max_tokens = 1024 if cached else 0
    state = scheme.prepare((3, 5), prefix)
    if not cached:
        assert (getattr(state, "flat", None) if isinstance(scheme, IRPE) else state.index) is None
    torch.testing.assert_close(_attention(scheme, state, q, k, v, 1), full, atol=1e-5, rtol=1e-5)
    chunks = [_attention(scheme, state, q, k, v, 1, slice(s, s + 6)) for s in range(0, n, 6)]
    torch.testing.assert_close(torch.cat(chunks, dim=2), full, atol=1e-5, rtol=1e-5)
    one_row = [_attention(scheme, state, q, k, v, 1, slice(s, s + 1)) for s in range(n)]
    torch.testing.assert_close(torch.cat(one_row, dim=2), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", SCHEMES)
def test_row_state_gives_the_exact_bias(make):
    torch.manual_seed(0)
    cached, rows = make(), make()
    if not hasattr(rows, "full_state_max_tokens"):
        pytest.skip("the scheme has no choice between cached maps and rows built from coordinates")
    rows.load_state_dict(cached.state_dict())
    rows.full_state_max_tokens = 0
    grid, prefix = (4, 7), cached.num_prefix_tokens if isinstance(cached, IRPE) else 1
    n = prefix + 28
    q, k = torch.randn(1, 3, n, 8), torch.randn(1, 3, n, 8)
    expected = cached.attn_bias(q, k, cached.prepare(grid, prefix), 1)
    assert torch.equal(rows.attn_bias(q, k, rows.prepare(grid, prefix), 1), expected)


@pytest.mark.parametrize("make", SCHEMES)
def test_batch_shared_bias_is_one_bias_for_the_batch(make):
    """``batch_shared_bias`` (attention then sizes its query chunks for one sample's bias) holds exactly for the
    schemes whose bias has a batch dimension of 1 and does not change with q, k or the tokens."""
    torch.manual_seed(0)
    scheme = make()
    for param in scheme.parameters():
        torch.nn.init.normal_(param, std=0.5)
    prefix = scheme.num_prefix_tokens if isinstance(scheme, IRPE) else 1
    state, n = scheme.prepare((3, 5), prefix), prefix + 15

    def bias(seed):
        q, k = torch.randn(2, 3, n, 8, generator=torch.Generator().manual_seed(seed)).unbind(0)
        q, k = torch.stack([q, q + 1]), torch.stack([k, 2 * k])  # two samples that differ
        extra = {"tokens": q.transpose(1, 2).flatten(2)} if scheme.needs_tokens else {}
        return scheme.attn_bias(q, k, state, 1, **extra)

    if scheme.augments_qk:
        assert not scheme.batch_shared_bias
        return
    first, second = bias(0), bias(1)
    shared = first.shape[0] == 1 and torch.equal(first, second)
    assert scheme.batch_shared_bias == shared, (type(scheme).__name__, tuple(first.shape))


def test_rows_shape_mismatch_raises():
    scheme = IRPE(24, 3, 2)
    state = scheme.prepare((3, 5), 1)
    with pytest.raises(ValueError, match="rows"):
        scheme.attn_bias(torch.randn(1, 3, 16, 8), torch.randn(1, 3, 16, 8), state, 0, rows=slice(0, 4))
