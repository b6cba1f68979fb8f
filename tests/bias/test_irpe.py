import math

import pytest
import timm
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import visionpe  # noqa: F401  (registers the models)
from visionpe.bias.irpe import IRPE, irpe_bucket_ids, irpe_num_buckets, irpe_piecewise_index


def paper_g(x: float, alpha: float, beta: float, gamma: float) -> int:
    """The piecewise index exactly as written in the paper (Eq. 18), in plain Python."""
    if abs(x) <= alpha:
        return int(round(x))
    value = round(alpha + math.log(abs(x) / alpha) / math.log(gamma / alpha) * (beta - alpha))
    return int(math.copysign(math.trunc(min(beta, value)), x))


@pytest.mark.parametrize("ratio", [1.0, 1.9, 2.5, 3.0])
def test_piecewise_index_matches_paper_formula(ratio):
    alpha, beta, gamma = ratio, 2 * ratio, 8 * ratio  # 1:2:8
    values = [v / 4 for v in range(-400, 401)] + [1000.0, -5000.0]
    got = irpe_piecewise_index(torch.tensor(values), alpha, beta, gamma).tolist()
    assert got == [paper_g(v, alpha, beta, gamma) for v in values]


def test_piecewise_index_paper_example_r19():
    g = irpe_piecewise_index(torch.arange(0, 200), 1.9, 3.8, 15.2)
    assert g[:5].tolist() == [0, 1, 2, 2, 3]
    assert (g[4:] == 3).all()
    assert g.dtype == torch.int64


@settings(max_examples=50, deadline=None)
@given(st.floats(-1e4, 1e4, allow_nan=False), st.floats(0.5, 5.0))
def test_piecewise_index_odd_and_bounded(x, ratio):
    g = irpe_piecewise_index(torch.tensor([x, -x], dtype=torch.float64), ratio, 2 * ratio, 8 * ratio)
    assert g[0] == -g[1]
    assert abs(int(g[0])) <= math.floor(2 * ratio)


@pytest.mark.parametrize("method, expected", [("euclidean", 7), ("quant", 7), ("cross", 14), ("product", 49)])
def test_bucket_counts_with_and_without_cls(method, expected):
    assert irpe_num_buckets(method, 1.9) == expected
    assert irpe_num_buckets(method, 1.9, num_prefix_tokens=1) == expected + 1
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224", pos_embed="irpe", depth=1, pos_embed_kwargs={"method": method}
    )
    assert model.pos_schemes["irpe"].num_buckets == expected + 1  # 49 + 1 = 50 for product
    gap = timm.create_model(
        "visionpe_vit_tiny_patch16_224",
        pos_embed="irpe",
        depth=1,
        class_token=False,
        global_pool="avg",
        pos_embed_kwargs={"method": method},
    )
    assert gap.pos_schemes["irpe"].num_buckets == expected


@pytest.mark.parametrize("method", ["euclidean", "quant", "cross", "product"])
def test_bucket_ids_depend_only_on_offset_and_prefix_uses_extra_bucket(method):
    grid, prefix = (3, 5), 2
    ids = irpe_bucket_ids(grid, method, 1.9, num_prefix_tokens=prefix)
    ids = ids if ids.ndim == 3 else ids[None]
    n = grid[0] * grid[1]
    assert ids.shape[-2:] == (prefix + n, prefix + n)
    skip = irpe_num_buckets(method, 1.9)
    assert (ids[:, :prefix, :] == skip).all() and (ids[:, :, :prefix] == skip).all()
    patch = ids[:, prefix:, prefix:]
    assert patch.min() >= 0 and patch.max() < skip
    ys, xs = torch.arange(n) // grid[1], torch.arange(n) % grid[1]
    seen = {}
    for i in range(n):
        for j in range(n):
            key = (int(ys[i] - ys[j]), int(xs[i] - xs[j]))
            assert seen.setdefault(key, patch[:, i, j].tolist()) == patch[:, i, j].tolist()
    assert len(seen) == (2 * grid[0] - 1) * (2 * grid[1] - 1)


def test_product_ids_use_rows_then_columns_on_non_square_grid():
    ids = irpe_bucket_ids((2, 7), "product", 1.9)
    # token 0 = (0, 0), token 13 = (1, 6): offset (dy, dx) = (-1, -6) -> g = (-1, -3)
    assert ids[0, 13] == (-1 + 3) * 7 + (-3 + 3)
    assert ids[13, 0] == (1 + 3) * 7 + (3 + 3)


def _naive_table(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-pair vectors r_{I(i,j)}: (h', N, N, d) from a (h', d, n_b) table (the O(N^2 d) form)."""
    if ids.ndim == 3:
        return table[:, :, ids[0]].permute(0, 2, 3, 1) + table[:, :, ids[1]].permute(0, 2, 3, 1)
    return table[:, :, ids].permute(0, 2, 3, 1)


@pytest.mark.parametrize("method", ["euclidean", "quant", "cross", "product"])
@pytest.mark.parametrize("shared_heads", [True, False])
def test_bucket_first_terms_equal_naive_reference(method, shared_heads):
    torch.manual_seed(0)
    heads, head_dim, depth, grid = 3, 8, 2, (3, 4)
    rpe = IRPE(heads * head_dim, heads, depth, method=method, on="qkv", shared_heads=shared_heads)
    for table in rpe.tables.values():
        torch.nn.init.normal_(table)
    state = rpe.prepare(grid, 1)
    ids = irpe_bucket_ids(grid, method, 1.9, 1)
    n = 1 + grid[0] * grid[1]
    q, k = torch.randn(2, heads, n, head_dim), torch.randn(2, heads, n, head_dim)
    layer, scale = 1, head_dim**-0.5
    r_k = _naive_table(rpe.tables["k"][layer], ids)  # (h', N, N, d)
    r_q = _naive_table(rpe.tables["q"][layer], ids)
    expected = torch.einsum("bhid,hijd->bhij", q * scale, r_k.expand(heads, -1, -1, -1))
    expected += torch.einsum("bhjd,hjid->bhij", k * scale, r_q.expand(heads, -1, -1, -1))
    torch.testing.assert_close(rpe.attn_bias(q, k, state, layer), expected, atol=1e-5, rtol=1e-5)

    attn = torch.softmax(torch.randn(2, heads, n, n), dim=-1)
    r_v = _naive_table(rpe.tables["v"][layer].transpose(-2, -1), ids)  # (h', N, N, d)
    expected_v = torch.einsum("bhij,hijd->bhid", attn, r_v.expand(heads, -1, -1, -1))
    torch.testing.assert_close(rpe.value_term(attn, state, layer), expected_v, atol=1e-5, rtol=1e-5)


def test_bias_mode_is_table_lookup():
    rpe = IRPE(16, 2, 1, method="product", mode="bias", on="k", shared_heads=False, num_prefix_tokens=1)
    torch.nn.init.normal_(rpe.tables["k"])
    state = rpe.prepare((2, 3), 1)
    q = k = torch.randn(1, 2, 7, 8)
    ids = irpe_bucket_ids((2, 3), "product", 1.9, 1)
    torch.testing.assert_close(rpe.attn_bias(q, k, state, 0), rpe.tables["k"][0][:, ids][None])


@pytest.mark.parametrize("method", ["euclidean", "quant", "cross", "product"])
def test_bias_mode_on_q_and_k_follows_the_reference(method):
    """Bias mode on "qk": the k table is read at I(i, j), the q table at I(j, i) (the reference computes the q term
    as a key-side lookup and transposes it: ``rpe_q(k).transpose(2, 3)``); product and cross are not symmetric."""
    torch.manual_seed(0)
    rpe = IRPE(16, 2, 1, method=method, mode="bias", on="qk", shared_heads=False, num_prefix_tokens=1)
    for table in rpe.tables.values():
        torch.nn.init.normal_(table)
    grid = (2, 3)
    q = k = torch.randn(1, 2, 7, 8)
    ids = irpe_bucket_ids(grid, method, 1.9, 1)
    r_k, r_q = rpe.tables["k"][0], rpe.tables["q"][0]  # (h, n_b)
    if ids.ndim == 3:  # cross: the two per-axis buckets add
        expected = r_k[:, ids[0]] + r_k[:, ids[1]] + (r_q[:, ids[0]] + r_q[:, ids[1]]).transpose(-2, -1)
    else:
        expected = r_k[:, ids] + r_q[:, ids].transpose(-2, -1)
    torch.testing.assert_close(rpe.attn_bias(q, k, rpe.prepare(grid, 1), 0), expected[None])


def test_bias_is_translation_invariant():
    torch.manual_seed(0)
    rpe = IRPE(16, 2, 1, on="qk", num_prefix_tokens=0)
    for table in rpe.tables.values():
        torch.nn.init.normal_(table)
    q = k = torch.randn(1, 2, 1, 8).expand(-1, -1, 20, -1)  # same content at every position
    bias = rpe.attn_bias(q, k, rpe.prepare((4, 5), 0), 0)[0, 0].reshape(4, 5, 4, 5)
    # shifting both query and key by one row/column keeps the bias
    torch.testing.assert_close(bias[1:, 1:, 1:, 1:], bias[:-1, :-1, :-1, :-1])


def test_bucket_map_is_cached_per_grid():
    rpe = IRPE(16, 2)
    assert rpe.prepare((3, 4), 1) is rpe.prepare((3, 4), 1)
    assert rpe.prepare((4, 3), 1).flat.shape == (13, 13)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"method": "polar"}, "method"),
        ({"mode": "relative"}, "mode"),
        ({"mode": "bias", "on": "v"}, "contextual"),
        ({"on": "kx"}, "on"),
        ({"ratio": -1.0}, "ratio"),
    ],
)
def test_invalid_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        IRPE(16, 2, **kwargs)


def test_bad_inputs_raise():
    rpe = IRPE(16, 2, num_prefix_tokens=1)
    with pytest.raises(ValueError, match="2D grids"):
        rpe.prepare((2, 3, 4), 1)
    with pytest.raises(ValueError, match="num_prefix_tokens"):
        rpe.prepare((3, 4), 0)
    state = rpe.prepare((3, 4), 1)
    with pytest.raises(ValueError, match="q must have shape"):
        rpe.attn_bias(torch.randn(1, 2, 12, 8), torch.randn(1, 2, 13, 8), state, 0)
    # a head count that differs from the scheme's: never broadcast silently, even from one head
    for heads in (1, 4):
        with pytest.raises(ValueError, match=r"q must have shape \(B, num_heads=2"):
            rpe.attn_bias(torch.randn(1, heads, 13, 8), torch.randn(1, heads, 13, 8), state, 0)
        with pytest.raises(ValueError, match=r"k must have shape \(B, num_heads=2"):
            rpe.attn_bias(torch.randn(1, 2, 13, 8), torch.randn(1, heads, 13, 8), state, 0)
    values = IRPE(16, 2, on="kv", shared_heads=False)
    with pytest.raises(ValueError, match=r"attn must have shape \(B, num_heads=2"):
        values.value_term(torch.rand(1, 4, 13, 13), values.prepare((3, 4), 1), 0)
    with pytest.raises(ValueError, match="num_heads must be a positive int, got 0"):
        IRPE(16, 0)
    with pytest.raises(ValueError, match="depth must be a positive int, got 0"):
        IRPE(16, 2, depth=0)
    with pytest.raises(ValueError, match="alpha"):
        irpe_piecewise_index(torch.arange(3), 0.0, 1.0, 2.0)
    with pytest.raises(TypeError, match="rel"):
        irpe_piecewise_index([1, 2], 1.0, 2.0, 8.0)


_ALL_TARGETS = {"on": "qkv", "shared_heads": False, "method": "cross"}
_SIZES = [(224, 224), (384, 384), (160, 224)]


@pytest.mark.parametrize(
    "size, bf16, kwargs",
    [(s, False, {}) for s in _SIZES] + [(s, True, {}) for s in _SIZES] + [(s, False, _ALL_TARGETS) for s in _SIZES],
)
def test_model_forward_backward(size, bf16, kwargs):
    torch.manual_seed(0)
    model = timm.create_model(
        "visionpe_vit_tiny_patch16_224", pos_embed="irpe", pos_embed_kwargs=kwargs, dynamic_img_size=True, depth=2
    )
    for table in model.pos_schemes["irpe"].tables.values():
        torch.nn.init.normal_(table, std=0.02)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(torch.randn(1, 3, *size))
    assert out.shape == (1, 1000) and torch.isfinite(out).all()
    out.float().sum().backward()
    for name, param in model.pos_schemes.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    assert "pos_schemes.irpe.tables.k" in model.no_weight_decay()


def test_model_defaults_are_the_papers_deit_setting_with_registers():
    """Product, contextual, on keys, ratio 1.9, heads shared: one (head_dim, 49 + 1) key table per block. Register
    tokens are prefix tokens like cls: all their pairs read the one extra bucket."""
    torch.manual_seed(0)
    model = timm.create_model("visionpe_vit_small_patch16_224", pos_embed="irpe", depth=2, reg_tokens=4)
    scheme = model.pos_schemes["irpe"]
    assert (scheme.method, scheme.mode, scheme.on, scheme.ratio, scheme.shared_heads) == (
        "product",
        "contextual",
        "k",
        1.9,
        True,
    )
    assert list(scheme.tables) == ["k"] and scheme.tables["k"].shape == (2, 1, 64, 50)
    state = scheme.prepare((14, 14), model.num_prefix_tokens)
    ids = state.flat % 50  # flat[i, j] = i * n_b + I(i, j)
    assert (ids[:5] == 49).all() and (ids[:, :5] == 49).all() and (ids[5:, 5:] < 49).all()
    torch.nn.init.normal_(scheme.tables["k"], std=0.02)
    out = model(torch.randn(1, 3, 224, 224))
    out.sum().backward()
    assert torch.isfinite(out).all() and scheme.tables["k"].grad.abs().sum() > 0


def test_combines_with_learned_ape_as_the_papers_deit_models():
    # iRPE's DeiT models keep their learnable absolute table: both schemes in one model, both trained
    torch.manual_seed(0)
    model = timm.create_model("visionpe_vit_tiny_patch16_224", pos_embed=["learned", "irpe"], depth=2)
    assert [m.kind for m in model.pos_schemes.values()] == ["absolute", "bias"]
    torch.nn.init.normal_(model.pos_schemes["irpe"].tables["k"], std=0.02)
    out = model(torch.randn(1, 3, 224, 224))
    out.sum().backward()
    for name, param in model.pos_schemes.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
