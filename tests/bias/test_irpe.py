import math

import numpy as np
import pytest
import timm
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import visionpe  # noqa: F401  (registers the models)
import visionpe.bias.irpe as irpe_module
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


def _naive_lookup(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """r_{I(i,j)}: table (..., n_b) read at every pair, (..., N, N). Cross (ids (2, N, N)) reads p^y_{g(dy)} +
    p^x_{g(dx)} for patch pairs and the one extra bucket, once, for pairs involving a prefix token, as the paper's
    official code does; its row-offset ids are in [0, S), so id 2S in the first half marks a prefix pair."""
    if ids.ndim == 2:
        return table[..., ids]
    prefix_pair = ids[0] == table.shape[-1] - 1 if table.shape[-1] % 2 else torch.zeros_like(ids[0], dtype=torch.bool)
    return torch.where(prefix_pair, table[..., ids[0]], table[..., ids[0]] + table[..., ids[1]])


def _naive_table(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-pair vectors r_{I(i,j)}: (h', N, N, d) from a (h', d, n_b) table (the O(N^2 d) form)."""
    return _naive_lookup(table, ids).permute(0, 2, 3, 1)


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
    # cross: the two per-axis buckets add (a prefix pair reads its one extra bucket once)
    expected = _naive_lookup(r_k, ids) + _naive_lookup(r_q, ids).transpose(-2, -1)
    torch.testing.assert_close(rpe.attn_bias(q, k, rpe.prepare(grid, 1), 0), expected[None])


@pytest.mark.parametrize("rows", [None, slice(0, 3), slice(1, 6), slice(4, 13)])
@pytest.mark.parametrize("prefix", [1, 2])
def test_cross_prefix_pairs_read_the_extra_bucket_once(rows, prefix):
    """Cross has one extra bucket (id 2S) for pairs involving a prefix token: both per-axis halves of such a pair
    hold it, but the pair reads its entry once, in bias and contextual mode, on q (transposed), k and v, for all
    rows or a chunk of query rows. Tables zero except the extra bucket: the prefix rows and columns are 1x it."""
    torch.manual_seed(0)
    heads, head_dim, grid = 2, 4, (3, 4)
    n = prefix + grid[0] * grid[1]
    q_rows = range(n)[rows or slice(None)]
    bias = IRPE(heads * head_dim, heads, method="cross", mode="bias", on="qk", shared_heads=False, num_prefix_tokens=1)
    ctx = IRPE(heads * head_dim, heads, method="cross", on="qkv", shared_heads=False, num_prefix_tokens=1)
    extra = bias.num_buckets - 1  # 2S = 14 for r = 1.9
    ids = irpe_bucket_ids(grid, "cross", 1.9, prefix)
    assert (ids[:, :prefix] == extra).all() and (ids[:, :, :prefix] == extra).all()
    q, k = torch.randn(2, heads, len(q_rows), head_dim), torch.randn(2, heads, n, head_dim)
    attn = torch.softmax(torch.randn(2, heads, len(q_rows), n), dim=-1)
    sel = slice(q_rows.start, q_rows.stop)
    for values in ("unit", "random"):
        with torch.no_grad():
            for table in (*bias.tables.values(), *ctx.tables.values()):
                table.zero_() if values == "unit" else torch.nn.init.normal_(table)
            if values == "unit":
                bias.tables["k"][..., extra] = 1.0
                bias.tables["q"][..., extra] = 10.0
                ctx.tables["v"][..., extra, :] = 1.0
        got = bias.attn_bias(q, k, bias.prepare(grid, prefix), 0, rows=rows)
        r_k, r_q = bias.tables["k"][0], bias.tables["q"][0]  # (h, n_b)
        expected = (_naive_lookup(r_k, ids) + _naive_lookup(r_q, ids).transpose(-2, -1))[None, :, sel]
        torch.testing.assert_close(got, expected)
        if values == "unit":  # prefix row or column: 1 (k) + 10 (q); a prefix-prefix pair too; patch pairs 0
            prefix_pair = torch.zeros(n, n, dtype=torch.bool)
            prefix_pair[:prefix], prefix_pair[:, :prefix] = True, True
            torch.testing.assert_close(got, torch.where(prefix_pair, 11.0, 0.0)[None, None, sel].expand_as(got))

        state = ctx.prepare(grid, prefix)
        scale = head_dim**-0.5
        r_k, r_q = _naive_table(ctx.tables["k"][0], ids), _naive_table(ctx.tables["q"][0], ids)  # (h, N, N, d)
        expected = torch.einsum("bhid,hijd->bhij", q * scale, r_k[:, sel])
        expected += torch.einsum("bhjd,hjid->bhij", k * scale, r_q[:, :, sel])
        torch.testing.assert_close(ctx.attn_bias(q, k, state, 0, rows=rows), expected, atol=1e-5, rtol=1e-5)
        r_v = _naive_table(ctx.tables["v"][0].transpose(-2, -1), ids)[:, sel]  # (h, R, N, d)
        got_v = ctx.value_term(attn, state, 0, rows=rows)
        torch.testing.assert_close(got_v, torch.einsum("bhij,hijd->bhid", attn, r_v), atol=1e-5, rtol=1e-5)
        if values == "unit":  # prefix rows: sum_j a_ij r^V_extra = 1
            first = max(0, min(prefix, q_rows.stop) - q_rows.start)
            torch.testing.assert_close(got_v[:, :, :first], torch.ones_like(got_v[:, :, :first]))


def test_cross_extra_bucket_gradient_is_read_once():
    torch.manual_seed(0)
    rpe = IRPE(8, 2, method="cross", mode="bias", on="k", num_prefix_tokens=1)
    state, q = rpe.prepare((2, 3), 1), torch.randn(1, 2, 7, 4)
    rpe.attn_bias(q, q, state, 0).sum().backward()
    # the extra bucket is read by the 7 + 6 pairs involving the cls token, once each (a shared-heads bias mode
    # term is one (1, 1, 7, 7) map), each spatial bucket by its patch pairs: 6 * 6 reads of the two halves
    grad = rpe.tables["k"].grad[0, 0]
    assert grad[-1].item() == 13 and grad[:-1].sum().item() == 2 * 6 * 6


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


def _cuda_like_scatter_add(record: list, cols: int):
    """``Tensor.scatter_add`` that rounds to the accumulator's dtype after every add, as CUDA's atomic adds do for
    fp16/bf16 (CPU kernels accumulate in fp32), for a flattened (R, cols) source whose row r adds to slots of its
    own (as iRPE's bucket sums): the columns are added one after another. Records the accumulator dtypes."""
    original = torch.Tensor.scatter_add

    def scatter_add(self, dim, index, src):
        record.append(self.dtype)
        if self.dtype not in (torch.float16, torch.bfloat16):
            return original(self, dim, index, src)
        index, src = index.unflatten(-1, (-1, cols)), src.unflatten(-1, (-1, cols))
        for j in range(cols):  # one add per slot per step, rounded to the slot's dtype
            self = original(self, dim, index[..., j], src[..., j])
        return self

    return scatter_add


def test_cuda_like_scatter_add_loses_a_saturated_bf16_sum():
    """The simulation the precision test relies on: bf16 slots that round after every add stagnate."""
    record = []
    index = torch.arange(4).repeat_interleave(1000)[None]  # 4 rows of 1000 terms, each row into its own slot
    src = torch.full((1, 4000), 1e-3)
    torch.testing.assert_close(torch.zeros(1, 4).scatter_add(-1, index, src), torch.ones(1, 4))
    rounded = _cuda_like_scatter_add(record, 1000)(torch.zeros(1, 4, dtype=torch.bfloat16), -1, index, src.bfloat16())
    assert (rounded.float() < 0.6).all() and record == [torch.bfloat16]


@pytest.mark.parametrize("cast", ["module", "autocast"])
def test_low_precision_value_term_sums_saturated_buckets_in_fp32(monkeypatch, cast):
    """bf16 probabilities on a 32 x 32 grid, where each saturated bucket collects hundreds of terms: the bucket sums
    run in fp32 (a bf16 accumulator that rounds after every add, as on CUDA, loses most of them), and the value term
    stays close to the fp32 one, with the module cast to bf16 or under bf16 autocast."""
    torch.manual_seed(0)
    grid, n, rows = (32, 32), 1 + 32 * 32, slice(100, 164)  # one chunk of 64 query rows
    rpe = IRPE(16, 2, on="v", num_prefix_tokens=1)
    torch.nn.init.normal_(rpe.tables["v"])
    state = rpe.prepare(grid, 1)
    attn = torch.softmax(torch.randn(1, 2, 64, n) * 0.1, dim=-1)
    expected = rpe.value_term(attn, state, 0, rows=rows)
    record = []
    monkeypatch.setattr(torch.Tensor, "scatter_add", _cuda_like_scatter_add(record, n))
    if cast == "module":
        rpe.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast == "autocast"):
        got = rpe.value_term(attn.bfloat16(), state, 0, rows=rows)
    assert got.dtype == torch.bfloat16 and record == [torch.float32]
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cast", ["module", "autocast"])
def test_low_precision_contextual_bias_gathers_from_fp32_products(monkeypatch, cast):
    """bf16 q and k: Z = q R^K and k R^Q are computed and gathered in fp32, so the gather's backward adds each
    saturated bucket's gradient in fp32 (in bf16, CUDA rounds after every add); the bias, rounded once to q's dtype,
    and the tables' gradients stay close to fp32."""
    torch.manual_seed(0)
    grid, n, rows = (32, 32), 1 + 32 * 32, slice(200, 264)
    rpe = IRPE(16, 2, on="qk", num_prefix_tokens=1)
    for table in rpe.tables.values():
        torch.nn.init.normal_(table)
    state = rpe.prepare(grid, 1)
    q, k, upstream = torch.randn(1, 2, 64, 8), torch.randn(1, 2, n, 8), torch.randn(1, 2, 64, n)
    expected = rpe.attn_bias(q, k, state, 0, rows=rows)
    (expected * upstream).sum().backward()
    expected_grads = {t: table.grad.clone() for t, table in rpe.tables.items()}
    rpe.zero_grad()
    record, gather = [], irpe_module.gather_offsets
    monkeypatch.setattr(irpe_module, "gather_offsets", lambda t, i: record.append(t.dtype) or gather(t, i))
    if cast == "module":
        rpe.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast == "autocast"):
        got = rpe.attn_bias(q.bfloat16(), k.bfloat16(), state, 0, rows=rows)
        (got.float() * upstream).sum().backward()
    values = [dtype for dtype in record if dtype.is_floating_point]  # not the int32 bucket maps
    assert got.dtype == torch.bfloat16 and values == [torch.float32] * 2
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=2e-2)
    for target, table in rpe.tables.items():
        error = (table.grad.float() - expected_grads[target]).abs().max()
        assert error <= 2e-2 * expected_grads[target].abs().max(), target


@pytest.mark.parametrize("alpha, beta", [(1.5, 1.5), (2.6, 2.7), (0.6, 0.9)])
def test_piecewise_index_rejects_alpha_rounding_past_floor_beta(alpha, beta):
    """round(x) for |x| <= alpha reaches round(alpha): past floor(beta) it would leave the documented range
    [-floor(beta), floor(beta)] (alpha = beta = 1.5 gave g(1.5) = 2, above g(2.6) = 1)."""
    with pytest.raises(
        ValueError,
        match=rf"alpha and beta must satisfy round\(alpha\) <= floor\(beta\).*got "
        rf"alpha={alpha}, beta={beta}",
    ):
        irpe_piecewise_index(torch.arange(-3, 4), alpha, beta, 8 * alpha)


@pytest.mark.parametrize("alpha, beta", [(1.4, 1.5), (2.5, 2.7), (0.5, 0.9), (1.9, 3.8)])
def test_piecewise_index_stays_in_range_when_round_alpha_fits(alpha, beta):
    g = irpe_piecewise_index(torch.linspace(-50, 50, 2001), alpha, beta, 8 * alpha)
    assert g.abs().max() <= math.floor(beta) and (g.diff() >= 0).all()


def test_invalid_argument_types_raise():
    with pytest.raises(
        TypeError, match=r"rel must be a real \(integer or floating-point\) tensor, got dtype torch.bool"
    ):
        irpe_piecewise_index(torch.tensor([True, False]), 1.9, 3.8, 15.2)
    for on in (None, 5):
        with pytest.raises(TypeError, match=rf"on must be a str or a sequence of targets .*got {type(on).__name__}"):
            IRPE(16, 2, on=on)
    for shared in ("False", 0, None, np.bool_(False)):
        with pytest.raises(TypeError, match=rf"shared_heads must be a bool, got {type(shared).__name__}"):
            IRPE(16, 2, shared_heads=shared)
    assert IRPE(16, 2, on=["q", "k"], shared_heads=False).tables["q"].shape == (1, 2, 8, 50)
    rpe = IRPE(16, 2, on="qkv")
    state = rpe.prepare((2, 3), 1)
    q = torch.randn(1, 2, 7, 8)
    for dtype in (torch.int64, torch.bool):
        bad = torch.ones(1, 2, 7, 8, dtype=dtype)
        with pytest.raises(TypeError, match=rf"q must be a floating-point tensor, got dtype {dtype}"):
            rpe.attn_bias(bad, q, state, 0)
        with pytest.raises(TypeError, match=rf"k must be a floating-point tensor, got dtype {dtype}"):
            rpe.attn_bias(q, bad, state, 0)
        with pytest.raises(TypeError, match=rf"attn must be a floating-point tensor, got dtype {dtype}"):
            rpe.value_term(torch.ones(1, 2, 7, 7, dtype=dtype), state, 0)


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
